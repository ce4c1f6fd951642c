#!/usr/bin/env bash
# Run the whole CPU test suite. Idempotent: sets up .venv on first use. Extra args go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup_env.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python -m forge_megatron.env
# No path: pytest takes testpaths (tests/) from pyproject.toml; a path argument narrows the run.
python -m pytest -q -ra --timeout=600 "$@"
