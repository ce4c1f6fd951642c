"""Tree attention throughput: attended-pairs TFLOP/s of each tree backend vs per-sample attention, fwd and fwd+bwd.

Workloads (samples share prefixes; the tree holds each unique token once):
  grpo     one prompt of P tokens, G completions of R tokens each;
  agentic  one episode of C calls, each re-sending the whole history: sample c = the first P + c * R tokens of the
           episode (each call adds R tokens), so the tree is one chain of P + C * R tokens.
Per-sample baselines run the same samples unmerged: SDPA causal (batched when lengths are equal), torch's varlen
FlashAttention (torch.nn.attention.varlen, torch 2.9+, CUDA) and flash-attn varlen when installed; the fastest of them
is the baseline. FLOPs count attended (query, key) pairs only: forward 2 * pairs * N * (H + HV) (QK^T and PV),
forward + backward 2 * pairs * N * (4 H + 3 HV) (4 and 14 * pairs * N * H when HV = H, FlashAttention-2's convention:
the backward is 2.5x the forward). Tree pairs are
sum_j (sub_end[j] - j); per-sample pairs are sum_s L_s (L_s + 1) / 2. Every tree backend's output is compared with
the segment backend (max_abs_diff_vs_segment). Prints ONE JSON line.

  python benchmarks/tree_attention.py                          # GPU defaults, CPU gets tiny sizes
  python benchmarks/tree_attention.py --workload agentic --calls 16

Legend: T = tree tokens, S = total per-sample tokens, N = query heads, K = key/value heads, H = head dim.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from forge_megatron.kernels.tree_attention.segment import tree_attention_segment
from forge_megatron.utils import env


def workload_lengths(args) -> tuple[torch.Tensor, list[int]]:
    """(sub_end_T of the merged tree, per-sample lengths) for the chosen workload."""
    if args.workload == "grpo":
        P, R, G = args.prompt, args.completion, args.samples
        # prompt chain [0, P) then G completion chains, each a child of the last prompt token.
        prompt = torch.full((P,), P + G * R, dtype=torch.int32)
        completions = [torch.full((R,), P + (g + 1) * R, dtype=torch.int32) for g in range(G)]
        return torch.cat([prompt, *completions]), [P + R] * G
    P, R, C = args.prompt, args.completion, args.calls
    T = P + C * R
    return torch.full((T,), T, dtype=torch.int32), [P + c * R for c in range(1, C + 1)]


def tile_counts(sub_end_T: torch.Tensor, block: int) -> dict[str, int]:
    """How many causal block x block tiles are empty (skipped), full (unmasked) or partial (masked), by the Triton
    kernels' own classification (kernels/tree_attention/schedule.py, the rules of docs/prefix_tree.md)."""
    from forge_megatron.kernels.tree_attention.schedule import build_schedule

    T = sub_end_T.shape[0]
    plan = build_schedule(sub_end_T, T, block, block)
    blocks = -(-T // block)
    causal = blocks * (blocks + 1) // 2  # every visited tile is causal (its keys start before its queries end)
    return {"empty": causal - plan.full_tiles - plan.partial_tiles, "full": plan.full_tiles,
            "partial": plan.partial_tiles}


def _time_ms(fn: Callable[[], object], device: torch.device, repeat: int, inner: int = 1) -> float:
    """Median over ``repeat`` timings of ``inner`` calls in a row between two device synchronisations, per call.
    inner = 1 puts each call's host overhead (Python, the launch) into its time; more calls in a row let it overlap
    the device's work, as a model's layers do in training."""
    fn()  # warm-up (compilation, autotuning, allocator)
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3 / inner)
    return statistics.median(times)


def _fwd_and_fwd_bwd(attn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], device, repeat,
                     inner=1):
    q, k, v = (x.detach().requires_grad_() for x in inputs)

    def fwd():
        with torch.no_grad():
            return attn(q, k, v)

    def fwd_bwd():
        o = attn(q, k, v)
        torch.autograd.backward(o, torch.ones_like(o))

    return _time_ms(fwd, device, repeat, inner), _time_ms(fwd_bwd, device, repeat, inner)


def tree_backends(device: torch.device, head_dim: int) -> dict[str, Callable]:
    from forge_megatron.kernels.tree_attention.reference import tree_attention_reference

    found = {"segment": tree_attention_segment}
    if device.type == "cpu":
        found["reference"] = tree_attention_reference
        return found
    if env.has_triton():
        from forge_megatron.kernels.tree_attention.triton_kernel import tree_attention_triton

        found["triton"] = tree_attention_triton
    from forge_megatron.kernels.tree_attention import cuda

    if cuda.is_available() and head_dim in cuda.SUPPORTED_HEAD_DIMS:  # heads of 256 and 512: Triton only
        found["cuda"] = cuda.tree_attention_cuda  # FORGE_TREE_ATTN_CUDA_IMPL=auto: tensor cores for fp16/bf16
        found["cuda_simt"] = cuda.tree_attention_cuda  # run with FORGE_TREE_ATTN_CUDA_IMPL=simt (see CUDA_IMPL)
    return found


CUDA_IMPL = {"cuda": "auto", "cuda_simt": "simt"}  # backend name -> FORGE_TREE_ATTN_CUDA_IMPL while it is timed


@contextlib.contextmanager
def _cuda_impl(name: str):
    """Set FORGE_TREE_ATTN_CUDA_IMPL for the whole forward and backward of a CUDA backend, then restore it."""
    from forge_megatron.kernels.tree_attention.cuda import IMPL_ENV_VAR

    if name not in CUDA_IMPL:
        yield
        return
    old = os.environ.get(IMPL_ENV_VAR)
    os.environ[IMPL_ENV_VAR] = CUDA_IMPL[name]
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(IMPL_ENV_VAR, None)
        else:
            os.environ[IMPL_ENV_VAR] = old


def per_sample_backends(lengths: list[int], device: torch.device) -> dict[str, Callable]:
    """Attention over the unmerged samples packed as [S, N|K, H] with cumulative offsets."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)

    def sdpa(q_SNH, k_SKH, v_SKH):
        outs = []
        for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
            # 4-D [1, heads, L, H]: SDPA's fused kernels (flash, cuDNN) take only 4-D inputs and run 3-D ones through
            # the unfused math path (the first H200 run timed that: 16 TFLOP/s)
            q, k, v = (x[lo:hi].transpose(0, 1)[None] for x in (q_SNH, k_SKH, v_SKH))
            outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[0].transpose(0, 1))
        return torch.cat(outs)

    def sdpa_batched(q_SNH, k_SKH, v_SKH):
        B, L = len(lengths), lengths[0]
        q, k, v = (x.view(B, L, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q_SNH, k_SKH, v_SKH))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
        return o.reshape(q_SNH.shape[0], q_SNH.shape[1], v_SKH.shape[2])

    found = {"sdpa_per_sample": sdpa_batched if len(set(lengths)) == 1 else sdpa}
    if device.type != "cuda":
        return found
    L = max(lengths)
    varlen = torch_varlen_attention()
    if varlen is not None:  # FlashAttention's varlen kernel as torch ships it: all samples in one call
        found["torch_varlen"] = lambda q, k, v: varlen(q, k, v, cu, L)
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - optional baseline
        return found
    found["flash_attn_varlen"] = lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, L, L, causal=True)
    return found


def torch_varlen_attention() -> Callable | None:
    """torch.nn.attention.varlen.varlen_attn (torch 2.9+: FlashAttention's varlen kernel) as f(q, k, v, cu, L), causal,
    with GQA; None where torch has none. Its causal argument changed between releases (is_causal, then window_size
    (-1, 0)) and GQA came later (enable_gqa; without it k and v are repeated per query head)."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:  # noqa: BLE001 - an older torch
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    gqa = "enable_gqa" in params

    def attend(q, k, v, cu, L):
        if not gqa and k.shape[1] != q.shape[1]:
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        return varlen_attn(q, k, v, cu, cu, L, L, **causal, **({"enable_gqa": True} if gqa else {}))

    return attend


def _rates(pairs: int, N: int, H: int, fwd_ms: float, fwd_bwd_ms: float, HV: int | None = None) -> dict:
    """Times and attended-pair TFLOP/s: the forward's two products per pair and head, q.k (H) and p.v (HV); the
    backward's five, q.k again, dO.v, p.dO and dS.q (H, HV, HV, H) and dS.k (H): 2 (H + HV) and 2 (4 H + 3 HV)
    flops per pair and head (4 H and 14 H when HV = H)."""
    HV = HV or H
    return {
        "fwd_ms": round(fwd_ms, 4),
        "fwd_bwd_ms": round(fwd_bwd_ms, 4),
        "fwd_tflops": round(2 * pairs * N * (H + HV) / (fwd_ms * 1e9), 4),
        "fwd_bwd_tflops": round(2 * pairs * N * (4 * H + 3 * HV) / (fwd_bwd_ms * 1e9), 4),
    }


def run(args) -> dict:
    device = torch.device(args.device or ("cuda" if env.has_cuda() else "cpu"))
    dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float32
    sub_end_T, lengths = workload_lengths(args)
    sub_end_T = sub_end_T.to(device)
    T, S, N, K, H = sub_end_T.shape[0], sum(lengths), args.heads, args.kv_heads, args.head_dim
    HV = args.v_head_dim or H
    tree_pairs = int((sub_end_T.long() - torch.arange(T, device=device)).sum())
    sample_pairs = sum(L * (L + 1) // 2 for L in lengths)

    g = torch.Generator(device="cpu").manual_seed(0)
    tree_qkv = [torch.randn(T, n, h, generator=g).to(device, dtype) for n, h in ((N, H), (K, H), (K, HV))]
    sample_qkv = [torch.randn(S, n, h, generator=g).to(device, dtype) for n, h in ((N, H), (K, H), (K, HV))]

    results = {}
    with torch.no_grad():
        segment_o = tree_attention_segment(*tree_qkv, sub_end_T).float()
    for name, fn in tree_backends(device, H if HV == H else -1).items():  # (the CUDA kernel needs HV = H)
        attn = lambda q, k, v, fn=fn: fn(q, k, v, sub_end_T)  # noqa: E731
        with _cuda_impl(name):
            results[name] = _rates(tree_pairs, N, H, *_fwd_and_fwd_bwd(attn, tree_qkv, device, args.repeat,
                                                                         args.inner), HV)
            with torch.no_grad():
                results[name]["max_abs_diff_vs_segment"] = float((attn(*tree_qkv).float() - segment_o).abs().max())
    if "cuda" in results:  # which implementation "auto" ran: the tensor cores, or SIMT and why
        from forge_megatron import _C_tree_attn

        why = _C_tree_attn.mma_unsupported(*tree_qkv)
        results["cuda"]["impl"] = "mma" if not why else f"simt ({why})"
    failed = {}
    for name, fn in per_sample_backends(lengths, device).items():
        try:
            results[name] = _rates(sample_pairs, N, H, *_fwd_and_fwd_bwd(fn, sample_qkv, device, args.repeat,
                                                                             args.inner), HV)
        except Exception as exc:  # noqa: BLE001 - an optional baseline this torch cannot run is reported, not fatal
            if name == "sdpa_per_sample":
                raise
            failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"

    # the fastest per-sample baseline (the GPU target is against FlashAttention's varlen kernel)
    baseline = max((n for n in ("flash_attn_varlen", "torch_varlen", "sdpa_per_sample") if n in results),
                   key=lambda n: results[n]["fwd_bwd_tflops"])
    if "triton" in results and device.type == "cuda":  # which tiles were timed (defaults or the environment's)
        from forge_megatron.kernels.tree_attention import triton_kernel as tk

        results["triton"]["tiles"] = {kernel: "x".join(map(str, t)) for kernel, t in
                                      tk.gpu_launch_config(H, tk._TL_DTYPES[dtype], HV)["tiles"].items()}
        results["triton"]["dkdv_split"] = int(tk.dkdv_split())
        results["triton"]["split_head"] = int(tk.head_blocks(H)["SPLIT_H"])
    tree_names = [n for n in ("cuda", "cuda_simt", "triton", "segment") if n in results]
    best = max(tree_names, key=lambda n: results[n]["fwd_bwd_tflops"])
    return {
        "bench": "tree_attention", "device": str(device), "gpu": env.describe_cuda() if device.type == "cuda" else "",
        "workload": args.workload, "dtype": str(dtype).replace("torch.", ""), "N": N, "K": K, "H": H, "HV": HV,
        "inner": args.inner,
        "tree_tokens": T, "per_sample_tokens": S, "tree_pairs": tree_pairs, "per_sample_pairs": sample_pairs,
        "tiles_64": tile_counts(sub_end_T, 64),
        "backends": results, **({"baselines_failed": failed} if failed else {}), "baseline": baseline,
        "best_tree_backend": best,
        # >= 0.7 is the GPU target: tree kernel efficiency per attended pair relative to the per-sample kernel.
        "tflops_ratio_fwd_bwd": round(results[best]["fwd_bwd_tflops"] / results[baseline]["fwd_bwd_tflops"], 4),
        # Wall-clock gain of attending over the tree instead of the unmerged samples (same logical work).
        "speedup_fwd_bwd": round(results[baseline]["fwd_bwd_ms"] / results[best]["fwd_bwd_ms"], 4),
    }


def parse_args(argv=None):
    gpu = env.has_cuda()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("grpo", "agentic"), default="grpo")
    p.add_argument("--prompt", type=int, default=2048 if gpu else 48, help="prompt tokens P")
    p.add_argument("--completion", type=int, default=1024 if gpu else 20, help="tokens R per completion / per call")
    p.add_argument("--samples", type=int, default=8 if gpu else 4, help="GRPO group size G")
    p.add_argument("--calls", type=int, default=8 if gpu else 4, help="agentic: calls C per episode")
    p.add_argument("--heads", type=int, default=16 if gpu else 2, help="query heads N")
    p.add_argument("--kv-heads", type=int, default=4 if gpu else 1, help="key/value heads K")
    p.add_argument("--head-dim", type=int, default=128 if gpu else 32, help="head dim H (queries and keys)")
    p.add_argument("--v-head-dim", type=int, default=None,
                   help="value head dim HV (default H; multi-latent attention: --head-dim 192 --v-head-dim 128 with "
                        "as many key/value heads as query heads)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16", help="GPU dtype (CPU: fp32)")
    p.add_argument("--repeat", type=int, default=10 if gpu else 5)
    p.add_argument("--inner", type=int, default=5 if gpu else 1,
                   help="calls in a row per timing, between device synchronisations (5 on GPU: host overhead then "
                        "overlaps the kernels, as across a model's layers; the Dec 4 2026 runs before it used 1)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--sweep", action="store_true",
                   help="instead: time the Triton kernels (forward, dQ, dK/dV each alone) under candidate tiles "
                        "(FORGE_TREE_ATTN_TRITON_TILES values) and print the fastest; GPU only")
    return p.parse_args(argv)


# Candidate tiles per kernel (BLOCK_MxBLOCK_NxWARPSxSTAGES) by head size (the widest of H and HV, rounded up to a
# power of two), each list starting with that size's defaults (triton_kernel._default_tiles, bf16; a test checks). A
# dK/dV candidate ending in "+split" runs with FORGE_TREE_ATTN_DKDV_SPLIT=1 (one program per query head, fp32
# atomics; with as many key/value heads as query heads it is the plain kernel).
SWEEP_64 = {
    "fwd": ["128x64x4x3", "64x64x4x3", "128x64x4x2", "64x128x4x3", "128x32x4x3"],
    "dq": ["128x64x4x2", "128x64x4x3", "128x32x4x3", "64x64x4x3", "64x32x4x3"],
    "dkdv": ["32x64x4x3", "32x64x4x3+split", "64x64x4x2", "64x64x4x2+split", "32x128x4x3", "64x32x4x2",
             "16x64x4x3"],
}
SWEEP = {  # heads of 128
    "fwd": ["64x64x4x3", "128x64x8x3", "128x128x8x3", "64x64x4x4", "128x64x8x4"],
    "dq": ["128x32x4x3", "128x64x8x3", "128x128x8x2", "128x64x4x3", "128x32x4x4", "64x64x4x3"],
    "dkdv": ["32x64x4x3", "32x64x4x3+split", "32x64x4x4", "32x64x4x4+split", "32x128x8x3", "32x128x8x3+split",
             "64x64x8x2", "64x64x8x2+split", "64x32x4x2", "32x64x4x2", "16x64x4x3"],
}
SWEEP_256 = {  # heads of 256 and multi-latent attention's 192 (queries and keys) / 128 (values)
    "fwd": ["64x64x8x2", "64x64x4x2", "64x32x4x2", "32x64x4x2", "128x32x8x2", "64x32x4x3"],
    "dq": ["32x64x8x2", "64x32x4x2", "64x64x8x2", "32x32x4x3", "64x32x8x2", "32x64x4x2"],
    "dkdv": ["32x32x8x2", "32x32x8x2+split", "32x32x4x2", "32x32x4x2+split", "16x64x8x2", "32x64x8x2",
             "16x32x4x3"],
}
SWEEP_512 = {
    "fwd": ["32x32x8x2", "32x32x4x2", "16x32x4x2", "32x16x4x2", "64x16x8x2"],
    "dq": ["32x32x8x2", "32x16x4x2", "16x32x4x2", "32x16x8x2"],
    "dkdv": ["32x16x8x2", "32x16x8x2+split", "16x16x8x2", "16x16x8x2+split", "16x32x8x1", "32x16x4x2"],
}


def sweep_candidates(widest: int) -> dict[str, list[str]]:
    """The candidate tiles of each kernel for heads of ``widest`` channels (a power of two)."""
    if widest <= 64:
        return SWEEP_64
    if widest <= 128:
        return SWEEP
    return SWEEP_256 if widest <= 256 else SWEEP_512


def sweep(args) -> dict:
    """Median time of each Triton kernel alone under every candidate tile for the head size (sweep_candidates; the
    other kernels at their defaults), side by side in one process on the same inputs; a candidate that fails to
    compile or launch (shared memory) is reported with its error. ``best_env`` is the FORGE_TREE_ATTN_TRITON_TILES
    value of the fastest, ``best_split`` the FORGE_TREE_ATTN_DKDV_SPLIT value."""
    from forge_megatron.kernels.tree_attention import triton_kernel as tk

    device = torch.device(args.device or "cuda")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--sweep times GPU kernels: run it on a CUDA device (or, to test it, under TRITON_INTERPRET=1)")
    dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float32
    sub_end_T, _ = workload_lengths(args)
    sub_end_T = sub_end_T.to(device)
    T, N, K, H = sub_end_T.shape[0], args.heads, args.kv_heads, args.head_dim
    HV = args.v_head_dim or H
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, do = (torch.randn(T, n, h, generator=g).to(device, dtype) for n, h in ((N, H), (K, H), (K, HV), (N, HV)))
    scale = H ** -0.5
    candidates = sweep_candidates(tk.pow2_block(max(H, HV)))
    saved = os.environ.pop(tk.TILES_ENV, None)
    saved_split = os.environ.pop(tk.DKDV_SPLIT_ENV, None)
    o, lse = tk._forward(q, k, v, sub_end_T, scale)
    calls = {"fwd": lambda: tk._forward(q, k, v, sub_end_T, scale),
             "dq": lambda: tk._backward(do, q, k, v, o, lse, sub_end_T, scale, kernels=("dq",)),
             "dkdv": lambda: tk._backward(do, q, k, v, o, lse, sub_end_T, scale, kernels=("dkdv",))}
    results: dict = {}
    try:
        for kernel, tried in candidates.items():
            results[kernel] = {}
            for tiles in tried:
                os.environ[tk.TILES_ENV] = f"{kernel}={tiles.removesuffix('+split')}"
                os.environ[tk.DKDV_SPLIT_ENV] = "1" if tiles.endswith("+split") else "0"
                try:
                    results[kernel][tiles] = round(_time_ms(calls[kernel], device, args.repeat, args.inner), 4)
                except Exception as exc:  # noqa: BLE001 - a candidate that does not fit is a result too
                    results[kernel][tiles] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                # progress on stderr: a run cut short by a time limit still shows what it measured
                print(f"[sweep] {kernel} {tiles}: {results[kernel][tiles]}", file=sys.stderr, flush=True)
    finally:
        for name, value in ((tk.TILES_ENV, saved), (tk.DKDV_SPLIT_ENV, saved_split)):
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
    best = {kernel: min((t for t, ms in times.items() if isinstance(ms, float)), key=times.get, default=None)
            for kernel, times in results.items()}
    return {"bench": "tree_attention_sweep", "gpu": env.describe_cuda(), "workload": args.workload, "inner": args.inner,
            "dtype": args.dtype, "N": N, "K": K, "H": H, "HV": HV, "tree_tokens": T, "ms": results, "best": best,
            "default_ms": {kernel: results[kernel][tried[0]] for kernel, tried in candidates.items()},
            "best_env": ",".join(f"{kernel}={tiles.removesuffix('+split')}" for kernel, tiles in best.items() if tiles),
            "best_split": int(bool(best.get("dkdv")) and best["dkdv"].endswith("+split"))}


if __name__ == "__main__":
    parsed = parse_args()
    print(json.dumps(sweep(parsed) if parsed.sweep else run(parsed)))
