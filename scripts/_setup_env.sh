# Sourced by scripts/test.sh and scripts/demo.sh: create .venv if missing and install what the project needs.
# Idempotent: a stamp keyed on the hashes of setup.py, pyproject.toml and csrc/ skips the install when nothing changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $PY"
  "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
STAMP=.venv/.forge_installed
WANT="$(cat setup.py pyproject.toml | sha256sum | cut -c1-16)-$(find csrc -type f -exec sha256sum {} + 2>/dev/null | sort | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[setup] installing dependencies into .venv (first run takes about a minute)"
  "$VPY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # CPU torch first: an unpinned torch would pull a multi-GB CUDA build. GPU users install their CUDA torch first.
  if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
    "$VPY" -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
  fi
  "$VPY" -m pip install -q pybind11 setuptools wheel 2>&1 | grep -v "^WARNING: Location" || true
  FORGE_SKIP_CUDA_BUILD="${FORGE_SKIP_CUDA_BUILD:-1}" "$VPY" -m pip install -q --no-build-isolation -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
  "$VPY" -c "import forge_megatron, megatron.core, torch, zmq, transformers" || { echo "[setup] install failed"; exit 1; }
  echo "$WANT" > "$STAMP"
fi
export PATH="$ROOT/.venv/bin:$PATH"
