#!/usr/bin/env bash
# Fetch, on a machine that reaches PyPI, the wheels the lent H200 image lacks for benchmarks/gpu_check.sh's training
# test (megatron-core, pyzmq; the image has Python 3.12, torch, triton, transformers, msgpack, aiohttp, numpy) into
# .whl/ (git-ignored). Then carry it on the device call: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"]).
# gpu_check.sh installs .whl/*.whl into /tmp/forge_site when the folder exists. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "megatron-core==0.16.1" "pyzmq==27.3.0"
ls -l .whl
