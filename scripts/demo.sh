#!/usr/bin/env bash
# The README's main command. Idempotent: sets up .venv on first use.
# For now this runs the most complete real path that exists: a few training steps of a tiny Megatron-Core GPT
# on this machine through forge_megatron's CPU patches. The end-to-end RL demo replaces it (issue 9).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup_env.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
echo "[demo] running: tiny Megatron-Core GPT, 30 Adam steps on CPU (scripts/megatron_smoke.py)"
python scripts/megatron_smoke.py --steps 30 "$@"
