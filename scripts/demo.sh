#!/usr/bin/env bash
# The README's main command: the whole agent-RL loop on CPU, for real, in a few minutes on 2 cores.
#   tiny model -> supervised warm-start (Megatron) -> forge-engine + gateway/data pool + calculator agent (openai
#   client, black box) -> rollout driver -> Megatron trainer (CISPO on prefix trees) -> weight sync every step.
# Prints progress; writes runs/demo/{metrics.json, reward_curve.png, metrics.jsonl, logs/} (or --out DIR).
# Idempotent: sets up .venv on first use and starts each run from scratch; stops every process it started.
# Options are forge_megatron.training.demo's (python -m forge_megatron.training.demo --help).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup_env.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Bytecode caches on (some machines set PYTHONDONTWRITEBYTECODE): every process imports forge_megatron afresh, and
# without its .pyc files each compiles the sources again (~0.4 s of CPU a process, hundreds of processes a run).
unset PYTHONDONTWRITEBYTECODE
exec python -m forge_megatron.training.demo "$@"
