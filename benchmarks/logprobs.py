"""Memory and time of per-token logprobs + entropy, forward and backward: plain, chunked and fused side by side.

All three compute, for every row of a [T, V] logits tensor, the log-probability of a target token and the entropy,
then backpropagate a random upstream gradient through both:

- ``plain``: upcast, shift by the row max, exp, sum, gather (and exp * shifted for the entropy) under autograd:
  what ``vocab_parallel_logprobs`` did before it was chunked (kept here as the baseline);
- ``chunked``: ``forge_megatron.mcore.logprobs.vocab_parallel_logprobs`` on the logits (``--chunk-mib`` fp32 per
  chunk; dL/dlogits written over the logits unless ``--no-inplace``), the trainer's ``--no-fused-logprobs`` path;
- ``fused``: ``linear_vocab_parallel_logprobs``, the output layer fused in (the trainer's default): the logits are
  made chunk by chunk and never exist at once;
- ``fused_fp32``: the same with the output layer's matmul in fp32 (the trainer's ``--fp32-lm-head``); differs from
  ``fused`` only with ``--dtype bfloat16``.

Each variant also reports ``logp_err_fp64``: the largest error of its logprobs (first 256 rows) against fp64 math on
the same operands, which shows what the fp32 head buys in precision next to what it costs in time and memory.

The logits come out of an output layer (hidden [T, H] @ W^T, W [V, H], as in the model) and the gradient flows back
into it. On CPU each variant runs in its own child process (same seed, same inputs), so the peak memory of one does
not hide another's: the growth of the peak resident set (with a fixed glibc mmap threshold, so freed buffers leave)
over the inputs. On CUDA they run one after another in this process (``--children`` for the CPU's way): CUDA's
``max_memory_allocated`` is reset for each, and four processes each starting CUDA and importing Megatron took over a
minute on an H200. The plain and chunked peaks include the logits; the fused
one has none. Times are medians of ``--repeats`` after a warm-up. The children also report the logprobs and the
first rows of the hidden-state gradient, compared with the plain variant's in the parent. Prints one JSON line.

    OMP_NUM_THREADS=1 python benchmarks/logprobs.py [--rows 4096 --vocab 32768 --dtype float32 --device cpu]
"""

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch


VARIANTS = ("plain", "chunked", "fused", "fused_fp32")


def plain_logprobs(logits_TV, rows_M, targets_M):
    z = logits_TV.float()
    max_T = z.detach().max(dim=-1).values
    shifted = z - max_T[:, None]
    exp_TV = shifted.exp()
    sum_exp = exp_TV.sum(dim=-1)
    lse = max_T + sum_exp.log()
    logp = z[rows_M, targets_M] - lse[rows_M]
    entropy = (sum_exp.log() - (exp_TV * shifted).sum(dim=-1) / sum_exp)[rows_M]
    return logp, entropy


def peak_bytes(device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def child(args) -> dict:
    from forge_megatron.mcore.logprobs import linear_vocab_parallel_logprobs, vocab_parallel_logprobs

    device = torch.device(args.device)
    g = torch.Generator(device="cpu").manual_seed(0)
    dtype = getattr(torch, args.dtype)
    # The logits come out of an output layer, as in the model: hidden [T, H] @ W^T, W [V, H].
    hidden = (torch.randn(args.rows, args.hidden, generator=g)).to(device=device, dtype=dtype).requires_grad_(True)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * 2 / args.hidden ** 0.5).to(
        device=device, dtype=dtype).requires_grad_(True)
    rows_M = torch.arange(args.rows - 1, device=device)
    targets_M = torch.randint(0, args.vocab, (args.rows - 1,), generator=g).to(device)
    grad_logp = torch.randn(args.rows - 1, generator=g).to(device)
    grad_ent = torch.randn(args.rows - 1, generator=g).to(device)
    chunk_rows = max(1, (args.chunk_mib << 20) // (4 * args.vocab))

    def loss():  # the logits live only inside: after it returns, only what autograd saved is left
        if args.variant.startswith("fused"):
            logp, ent = linear_vocab_parallel_logprobs(hidden, weight, rows_M, targets_M, with_entropy=True,
                                                       chunk_rows=chunk_rows, compute_dtype=torch.float32
                                                       if args.variant == "fused_fp32" else None)
            return (logp * grad_logp).sum() + (ent * grad_ent).sum(), logp.detach()
        logits = hidden @ weight.t()
        if args.variant == "plain":
            logp, ent = plain_logprobs(logits, rows_M, targets_M)
        else:
            logp, ent = vocab_parallel_logprobs(logits, rows_M, targets_M, with_entropy=True,
                                                chunk_rows=chunk_rows, inplace_backward=args.inplace)
        return (logp * grad_logp).sum() + (ent * grad_ent).sum(), logp.detach()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # A tiny call first in both variants: imports (Megatron's parallel state) must not count as memory.
    vocab_parallel_logprobs(torch.zeros(2, 3, device=device), torch.tensor([0], device=device),
                            torch.tensor([1], device=device), with_entropy=True)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = peak_bytes(device)  # inputs resident (on CPU: the process's peak so far, before any logits)
    times = []
    for i in range(args.repeats + 1):
        hidden.grad = weight.grad = None
        sync()
        t0 = time.perf_counter()
        total, logp = loss()
        total.backward()
        sync()
        if i:
            times.append(time.perf_counter() - t0)
        del total
    n = min(256, args.rows - 1)
    with torch.no_grad():
        exact = (hidden[:n].double() @ weight.double().t()).log_softmax(-1)[rows_M[:n], targets_M[:n]]
    err = (logp[:n].double() - exact).abs().max().item()
    return {"peak_extra_bytes": max(0, peak_bytes(device) - base), "seconds": statistics.median(times),
            "logp_err_fp64": err,
            "logp": logp.float().cpu().tolist(), "grad_head": hidden.grad[:8].float().cpu().tolist()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4096, help="logits rows (tree tokens on one rank)")
    p.add_argument("--vocab", type=int, default=32768, help="vocabulary slice on one TP rank")
    p.add_argument("--hidden", type=int, default=64, help="hidden size of the output layer making the logits")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="logits dtype (Megatron's Float16Module hands the loss fp32 logits)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--chunk-mib", type=int, default=256, help="fp32 working set per chunk of rows")
    p.add_argument("--no-inplace", dest="inplace", action="store_false",
                   help="chunked: allocate dL/dlogits instead of writing it over the logits")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--children", action="store_true",
                   help="on CUDA too, run each variant in a child process (the CPU always does)")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # child mode
    args = p.parse_args()
    if args.variant:
        print(json.dumps(child(args)))
        return

    results = {}
    in_process = torch.device(args.device).type == "cuda" and not args.children
    for variant in VARIANTS:
        started = time.perf_counter()
        if in_process:  # CUDA's peak counter is reset per variant (child()); what the last one held is freed first
            gc.collect()
            torch.cuda.empty_cache()
            results[variant] = child(argparse.Namespace(**{**vars(args), "variant": variant}))
        else:
            cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant] + sys.argv[1:]
            # A fixed mmap threshold makes glibc return every large buffer when it is freed, so the CPU peak
            # resident set counts live tensors, not allocator caching.
            env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=os.environ.get("MALLOC_MMAP_THRESHOLD_", "65536"))
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
            results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"[logprobs] {variant}: done in {time.perf_counter() - started:.1f}s"
              f"{'' if in_process else ' (child process)'}", file=sys.stderr, flush=True)
    plain = results["plain"]
    logits_bytes = args.rows * args.vocab * torch.empty((), dtype=getattr(torch, args.dtype)).element_size()

    def max_diff(key, other):
        flat = lambda x: [v for row in x for v in (row if isinstance(row, list) else [row])]  # noqa: E731
        return max(abs(a - b) for a, b in zip(flat(plain[key]), flat(other[key])))

    line = {"benchmark": "logprobs", "device": args.device, "dtype": args.dtype, "rows": args.rows,
            "vocab": args.vocab, "hidden": args.hidden, "logits_mib": round(logits_bytes / 2**20, 1),
            "chunk_mib": args.chunk_mib, "inplace": args.inplace}
    for name, r in results.items():
        line[f"{name}_peak_mib"] = round(r["peak_extra_bytes"] / 2**20, 1)
        line[f"{name}_s"] = round(r["seconds"], 4)
        line[f"{name}_logp_err_fp64"] = float(f"{r['logp_err_fp64']:.3g}")
    for name in VARIANTS[1:]:
        r = results[name]
        line[f"{name}_memory_ratio"] = round(plain["peak_extra_bytes"] / max(1, r["peak_extra_bytes"]), 2)
        line[f"{name}_time_ratio"] = round(r["seconds"] / plain["seconds"], 3)
        line[f"{name}_max_abs_diff_logp"] = max_diff("logp", r)
        line[f"{name}_max_abs_diff_grad"] = max_diff("grad_head", r)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
