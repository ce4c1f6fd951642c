#!/usr/bin/env bash
# One-shot GPU check on a single H100/H200 (about 8 minutes: the second H200 run took 400 s before the mla and
# sweep64 steps; 825 s of step limits in the worst case, 60 more after a crash; the CUDA extension's build took 47 s
# on one machine and over 60 on another). Steps run most wanted first, so a device call cut short by its own limit
# (at most 600 s) still returns the log of the most useful ones; GPU_CHECK_ONLY then runs the rest in a second call.
# Step keys (GPU_CHECK_ONLY=build,sweep,tests runs only those; env always runs):
#   env       installs the wheels in .whl/ if present (benchmarks/gpu_wheels.sh fetches megatron-core and pyzmq for
#             the lent image; carry .whl on the device call),
#   build     builds the CUDA extension in place (forge_megatron._C_tree_attn, sm_90 unless FORGE_CUDA_ARCH_LIST
#             says else),
#   grpo      benchmarks/tree_attention.py on the GRPO workload at the default tiles (one JSON line),
#   sweep     --sweep (each Triton kernel under candidate tiles), then GRPO again with the fastest,
#   tests     the `gpu` tests of the kernels, the losses and FP8 quantisation (GPU_CHECK_TESTS: the paths, space-
#             separated; "tests" runs every area's gpu tests) on 4 pytest-xdist workers (GPU_CHECK_WORKERS): a test
#             that crashes its process (a segfault in an extension) is reported as failed and the others still run,
#   trainer   the trainer on the GPU (tests/training/test_gpu_trainer.py: fp32 and bf16 steps against CPU, the offline
#             modes' (SFT, DPO, reward model) fp32 steps against CPU, a distillation teacher's steps (sampled and
#             dense) and a learned critic's against CPU, bf16 keeps
#             the HF weights, distributed-optimizer checkpoints resume exactly, LoRA steps against CPU; skipped
#             without megatron-core and pyzmq; each rank its own interpreter, tests/dist_utils.py),
#   gdelta    benchmarks/gated_delta.py (Qwen3.5's linear-attention recurrence: autograd loop, torch scan and the
#             Triton scan kernels, forward + backward at 4 x 8192 tokens, 8 heads of 128),
#   gae       benchmarks/gae.py (a learned critic's GAE advantages on the GPU against a Python loop on the CPU),
#   agentic, heads512   tree attention on the agentic workload and on heads of 512,
#   mla       tree attention on multi-latent attention's heads (192 / 128), whole and split 128 + 64
#             (FORGE_TREE_ATTN_SPLIT_HEAD=1), and the tile sweep there,
#   backtrace a test that crashed its worker, again under cuda-gdb for a native stack,
#   logprobs  benchmarks/logprobs.py (plain, chunked, fused and fused with an fp32 LM head: logprobs+entropy at 16k
#             rows x 152k vocabulary, bf16; memory, time and error against fp64),
#   sweep64   the tile sweep on heads of 64.
# Everything goes to the log file (GPU_CHECK_LOG, default runs/gpu_check.log), each test failure also to
# <log>_failures.log as it happens; copy the JSON lines to docs/benchmarks.md.
# Needs a CUDA build of torch, triton, pybind11, ninja, pytest (+ pytest-timeout, pytest-xdist) and nvcc; megatron-core
# and pyzmq only for the trainer. PYTHON picks the interpreter (default python3: on the lent H200 image that is the
# one holding PyTorch). Exit status: non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout itself, built in place: no pip install needed
export PYTHONUNBUFFERED=1
LOG="${GPU_CHECK_LOG:-runs/gpu_check.log}"
mkdir -p "$(dirname "$LOG")"
read -ra TESTS <<< "${GPU_CHECK_TESTS:-tests/kernels tests/algo/test_losses.py tests/weight_sync/test_fp8.py}"
: > "$LOG"
failed=0

step() {  # step KEY NAME TIMEOUT_S CMD...: skipped when GPU_CHECK_ONLY is set and does not name KEY
  local key="$1" name="$2" limit="$3"
  shift 3
  if [ -n "${GPU_CHECK_ONLY:-}" ] && [ "$key" != env ] && [[ ",$GPU_CHECK_ONLY," != *",$key,"* ]]; then
    return 0
  fi
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$LOG"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - start))s" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || failed=1
}

PY="${PYTHON:-python3}"
# pytest on GPU_CHECK_WORKERS workers (4); failures in short form; a module that fails to import (a package the
# image lacks) does not stop the others; each failure is also appended to FAILURES as it happens (tests/conftest.py),
# so a step cut short by its limit still tells what failed
FAILURES="${LOG%.log}_failures.log"
: > "$FAILURES"
export FORGE_TEST_FAILURE_LOG="$FAILURES"
PYTEST=("$PY" -m pytest -q -m gpu -rfEs --tb=short -p no:cacheprovider -n "${GPU_CHECK_WORKERS:-4}"
        --continue-on-collection-errors)
step env "environment" 10 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; \
  $PY -m forge_megatron.env"
if compgen -G ".whl/*.whl" > /dev/null; then
  step env "install carried wheels" 10 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/forge_site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/forge_site"
fi
# most wanted first: a device call cut short by its limit still returns the log of the steps before
step build "build CUDA extension" 100 \
  env FORGE_CUDA_ARCH_LIST="${FORGE_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}" "$PY" setup.py build_ext --inplace
step grpo "benchmark grpo" 30 "$PY" benchmarks/tree_attention.py --workload grpo
step sweep "sweep Triton tiles" 80 "$PY" benchmarks/tree_attention.py --sweep --workload grpo
best=$(grep -o '"best_env": "[^"]*"' "$LOG" | tail -1 | cut -d'"' -f4)
split=$(grep -o '"best_split": [01]' "$LOG" | tail -1 | grep -o '[01]$')
if [ -n "$best" ]; then
  step sweep "benchmark grpo, fastest tiles ($best, dK/dV split ${split:-0})" 25 \
    env FORGE_TREE_ATTN_TRITON_TILES="$best" FORGE_TREE_ATTN_DKDV_SPLIT="${split:-0}" \
    "$PY" benchmarks/tree_attention.py --workload grpo
fi
step tests "gpu tests" 150 "${PYTEST[@]}" --dist load --timeout=90 "${TESTS[@]}"
step trainer "trainer on GPU" 215 "${PYTEST[@]}" --dist load --timeout=85 tests/training/test_gpu_trainer.py
step gdelta "benchmark gated delta" 20 "$PY" benchmarks/gated_delta.py --device cuda --batch 4 --len 8192 --heads 8
step gae "benchmark GAE (a learned critic's advantages)" 15 "$PY" benchmarks/gae.py --device cuda
step agentic "benchmark agentic" 25 "$PY" benchmarks/tree_attention.py --workload agentic --prompt 1024 \
  --completion 512 --calls 16
step heads512 "benchmark heads of 512" 20 "$PY" benchmarks/tree_attention.py --workload grpo --prompt 1024 \
  --completion 512 --heads 16 --kv-heads 4 --head-dim 512
# multi-latent attention (DeepSeek-V3, Kimi-K2, GLM-4.7-Flash, Mistral Small 4): 192-channel queries and keys,
# 128-channel values, a key/value head per query head
step mla "benchmark grpo, multi-latent attention heads" 30 "$PY" benchmarks/tree_attention.py --workload grpo \
  --head-dim 192 --v-head-dim 128 --kv-heads 16
step mla "benchmark grpo, multi-latent attention heads split 128 + 64" 30 env FORGE_TREE_ATTN_SPLIT_HEAD=1 \
  "$PY" benchmarks/tree_attention.py --workload grpo --head-dim 192 --v-head-dim 128 --kv-heads 16
step mla "sweep Triton tiles, multi-latent attention heads" 70 "$PY" benchmarks/tree_attention.py --sweep \
  --workload grpo --head-dim 192 --v-head-dim 128 --kv-heads 16
# a test that killed its worker (xdist: "crashed while running '<id>'", in the failures file as soon as it happens)
# runs again under cuda-gdb for the native stack
crashed=$(cat "$LOG" "$FAILURES" | grep -o "crashed while running '[^']*'" | head -1 | cut -d"'" -f2)
if [ -n "$crashed" ] && command -v cuda-gdb > /dev/null; then
  step backtrace "native backtrace of $crashed" 60 cuda-gdb -batch -ex run -ex bt -ex quit --args \
    "$PY" -m pytest -q -p no:cacheprovider -p no:xdist "$crashed"
fi
step logprobs "benchmark logprobs" 75 "$PY" benchmarks/logprobs.py --device cuda --rows 16384 --vocab 152064 \
  --dtype bfloat16
step sweep64 "sweep Triton tiles, heads of 64" 60 "$PY" benchmarks/tree_attention.py --sweep --workload grpo \
  --head-dim 64

echo "gpu_check: $([ $failed -eq 0 ] && echo PASSED || echo FAILED), log in $LOG" | tee -a "$LOG"
exit $failed
