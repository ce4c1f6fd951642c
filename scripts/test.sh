#!/usr/bin/env bash
# Run the whole CPU test suite. Idempotent: sets up .venv on first use. Extra args go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup_env.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Bytecode caches on (some machines set PYTHONDONTWRITEBYTECODE): every process imports forge_megatron afresh, and
# without its .pyc files each compiles the sources again (~0.4 s of CPU a process, hundreds of processes a run).
unset PYTHONDONTWRITEBYTECODE
python -m forge_megatron.env
# No path: pytest takes testpaths (tests/) from pyproject.toml; a path argument narrows the run.
# Two pytest workers (FORGE_TEST_WORKERS, 0: one process), each taking whole files (module fixtures built once): most
# tests wait on subprocesses, servers and sockets, so two workers on two cores take about 0.7x the time of one. (Three
# were 10 % faster on two cores, Dec 6 2026, but a code-verifier case then ran past its 3 s limit: timing-sensitive.)
python -m pytest -q -ra --timeout=600 -n "${FORGE_TEST_WORKERS:-2}" --dist loadfile "$@"
