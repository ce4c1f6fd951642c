#!/usr/bin/env bash
# One-shot GPU check on a single H100/H200 (515 s of step limits in the worst case, 45 more after a crash; the first
# H200 run took 221 s, most steps failing early; expect about 6 minutes). Steps run most wanted first, so a device
# call cut short by its own limit (a 15-minute device budget holds one such call and the machine's start) still
# returns the log of the most useful ones:
#   1. installs the wheels in .whl/ if present (benchmarks/gpu_wheels.sh fetches megatron-core and pyzmq for the
#      lent image; carry .whl on the device call),
#   2. builds the CUDA extension in place (forge_megatron._C_tree_attn, sm_90 unless FORGE_CUDA_ARCH_LIST says else),
#   3. runs the `gpu` tests of the kernels, the losses and FP8 quantisation (GPU_CHECK_TESTS: the paths, space-separated;
#      "tests" runs every area's gpu tests) on 4 pytest-xdist workers: a test that crashes its process (a segfault in
#      an extension) is reported as failed and the others still run,
#   4. runs benchmarks/tree_attention.py on the GRPO and agentic workloads and heads of 512 (one JSON line each),
#      then --sweep (each Triton kernel under candidate tiles) and GRPO again with the fastest tiles,
#   5. runs the trainer on the GPU (tests/training/test_gpu_trainer.py: fp32 and bf16 steps against CPU, bf16 keeps
#      the HF weights, distributed-optimizer checkpoints resume exactly, LoRA steps against CPU; skipped without
#      megatron-core and pyzmq; each rank its own interpreter, tests/dist_utils.py),
#   6. runs benchmarks/gated_delta.py (Qwen3.5's linear-attention recurrence: autograd loop, torch scan and the Triton
#      scan kernels, forward + backward at 4 x 8192 tokens, 8 heads of 128),
#   7. runs benchmarks/logprobs.py (plain, chunked, fused and fused with an fp32 LM head: logprobs+entropy at 16k
#      rows x 152k vocabulary, bf16; memory, time and error against fp64; four child processes).
# Everything goes to the log file (GPU_CHECK_LOG, default runs/gpu_check.log); copy the JSON lines to docs/benchmarks.md.
# Needs a CUDA build of torch, triton, pybind11, ninja, pytest (+ pytest-timeout, pytest-xdist) and nvcc; megatron-core
# and pyzmq only for step 5. PYTHON picks the interpreter (default python3: on the lent H200 image that is the one
# holding PyTorch). Exit status: non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout itself, built in place: no pip install needed
export PYTHONUNBUFFERED=1
LOG="${GPU_CHECK_LOG:-runs/gpu_check.log}"
mkdir -p "$(dirname "$LOG")"
read -ra TESTS <<< "${GPU_CHECK_TESTS:-tests/kernels tests/algo/test_losses.py tests/weight_sync/test_fp8.py}"
: > "$LOG"
failed=0

step() {  # step NAME TIMEOUT_S CMD...
  local name="$1" limit="$2"
  shift 2
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$LOG"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - start))s" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || failed=1
}

PY="${PYTHON:-python3}"
# pytest on 4 workers; failures in short form; a module that fails to import (a package the image lacks) does not
# stop the others
PYTEST=("$PY" -m pytest -q -m gpu -rfEs --tb=short -p no:cacheprovider -n 4 --continue-on-collection-errors)
step "environment" 10 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; \
  $PY -m forge_megatron.env"
if compgen -G ".whl/*.whl" > /dev/null; then
  step "install carried wheels" 10 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/forge_site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/forge_site"
fi
# most wanted first: a device call cut short by its limit still returns the log of the steps before
step "build CUDA extension" 60 env FORGE_CUDA_ARCH_LIST="${FORGE_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}" \
  "$PY" setup.py build_ext --inplace
step "benchmark grpo" 30 "$PY" benchmarks/tree_attention.py --workload grpo
step "gpu tests" 100 "${PYTEST[@]}" --dist load --timeout=90 "${TESTS[@]}"
step "sweep Triton tiles" 80 "$PY" benchmarks/tree_attention.py --sweep --workload grpo
best=$(grep -o '"best_env": "[^"]*"' "$LOG" | tail -1 | cut -d'"' -f4)
if [ -n "$best" ]; then
  step "benchmark grpo, fastest tiles ($best)" 25 env FORGE_TREE_ATTN_TRITON_TILES="$best" \
    "$PY" benchmarks/tree_attention.py --workload grpo
fi
step "trainer on GPU" 90 "${PYTEST[@]}" --dist load --timeout=85 tests/training/test_gpu_trainer.py
step "benchmark gated delta" 20 "$PY" benchmarks/gated_delta.py --device cuda --batch 4 --len 8192 --heads 8
step "benchmark agentic" 25 "$PY" benchmarks/tree_attention.py --workload agentic --prompt 1024 --completion 512 --calls 16
step "benchmark heads of 512" 20 "$PY" benchmarks/tree_attention.py --workload grpo --prompt 1024 --completion 512 \
  --heads 16 --kv-heads 4 --head-dim 512
# a test that killed its worker (xdist: "crashed while running '<id>'") runs again under cuda-gdb for the native stack
crashed=$(grep -o "crashed while running '[^']*'" "$LOG" | head -1 | cut -d"'" -f2)
if [ -n "$crashed" ] && command -v cuda-gdb > /dev/null; then
  step "native backtrace of $crashed" 45 cuda-gdb -batch -ex run -ex bt -ex quit --args \
    "$PY" -m pytest -q -p no:cacheprovider -p no:xdist "$crashed"
fi
step "benchmark logprobs" 45 "$PY" benchmarks/logprobs.py --device cuda --rows 16384 --vocab 152064 --dtype bfloat16

echo "gpu_check: $([ $failed -eq 0 ] && echo PASSED || echo FAILED), log in $LOG" | tee -a "$LOG"
exit $failed
