"""Attention work per context-parallel rank: contiguous shards vs the zig-zag chunks the trainer uses.

Under ``--cp-comm-type all_gather`` every CP rank attends its own queries against all keys before them, so its
attention work is the number of (query, visible key) pairs of its tokens, sum over its queries of depth + 1; a CP
step waits for the slowest rank. Contiguous shards of a DFS order give the last rank the deepest tokens (a chain
of T tokens split over C ranks: the last rank has 2C - 1 times the first one's work); one zig-zag round (rank r
holds chunks r and 2C - 1 - r of 2C, Megatron's split) pairs early and late chunks; the trainer repeats it
``ROUNDS`` times over 2 ROUNDS C chunks (``zigzag``, forge_megatron.mcore.context_parallel), which also evens out
the depth pattern of trees. The a2a mode splits heads instead of tokens and is balanced by construction: it is
the reference line.

Per workload and CP size: the counted imbalance (slowest rank's pairs over the mean) of both splits, and, measured
in this process one rank after the other (``--measure``), each rank's forward+backward time of its attention with
the segment backend (suffix queries against the gathered keys, exactly what each rank runs), the step time (the
slowest rank), the same for the a2a split (the whole tree with N / C heads) and ``speedup`` = contiguous step time
/ the trainer's (``zigzag``) step time. Workloads: ``chain`` (one agent episode, every call extending the last: one long chain),
``grpo`` (one prompt of T / 4 tokens and 8 completions), ``batch`` (8 GRPO groups of 4 with lognormal completion
lengths, packed into one micro-batch). Prints one JSON line.

    OMP_NUM_THREADS=1 python benchmarks/cp_balance.py [--tokens 4096 --cps 2 4 8 --heads 8 --kv-heads 1]
"""

import argparse
import json
import time

import numpy as np
import torch


def workloads(T: int, seed: int) -> dict[str, list[list[int]]]:
    rng = np.random.default_rng(seed)

    def toks(n):
        return rng.integers(10, 30000, n).tolist()

    prompt = toks(T // 4)
    grpo = [prompt + toks((T - T // 4) // 8) for _ in range(8)]
    batch = []
    for _ in range(8):
        p = toks(T // 32)
        for _ in range(4):
            batch.append(p + toks(int(min(T // 8, max(2, rng.lognormal(np.log(T // 48), 1.0))))))
    return {"chain": [toks(T)], "grpo": grpo, "batch": batch}


def splits(T_pad: int, cp: int) -> dict[str, list[list[tuple[int, int]]]]:
    """Query ranges per rank for each split: contiguous shards, one zig-zag round (chunks r and 2C - 1 - r of 2C)
    and the trainer's split (``context_parallel.ROUNDS`` rounds)."""
    from forge_megatron.mcore.context_parallel import shard_ranges

    local, half = T_pad // cp, T_pad // (2 * cp)
    return {"contiguous": [[(r * local, (r + 1) * local)] for r in range(cp)],
            "zigzag_1round": [[(r * half, (r + 1) * half), ((2 * cp - 1 - r) * half, (2 * cp - r) * half)]
                              for r in range(cp)],
            "zigzag": [list(shard_ranges(T_pad, cp, r)) for r in range(cp)]}


def rank_time(ranges, q, k, v, sub_end, repeats: int) -> float:
    """Median forward+backward time of one rank's attention (its query ranges as suffix queries)."""
    from forge_megatron.kernels.tree_attention import tree_attention

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for lo, hi in ranges:
            qq = q[lo:hi].detach().requires_grad_()
            kk, vv = k[:hi].detach().requires_grad_(), v[:hi].detach().requires_grad_()
            o = tree_attention(qq, kk, vv, sub_end[:hi].clamp(max=hi), backend="segment")
            o.sum().backward()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tree tokens per workload (approximately for batch)")
    p.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8], help="CP sizes")
    p.add_argument("--heads", type=int, default=8, help="query heads per TP rank (a2a needs CP to divide them)")
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-measure", action="store_false", dest="measure", help="count pairs only")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    from forge_megatron.kernels.tree_attention.segment import Forest
    from forge_megatron.mcore.context_parallel import ROUNDS, default_multiple, pad_sub_end, padded_length
    from forge_megatron.tree import build_tree

    results = {}
    for name, samples in workloads(args.tokens, args.seed).items():
        layout = build_tree(samples)
        T = layout.unique_tokens
        results[name] = {"tokens": T}
        for cp in args.cps:
            T_pad = padded_length(T, default_multiple(cp))
            sub_end = pad_sub_end(layout.sub_end.to(torch.int32), default_multiple(cp))
            pairs_T = (Forest(sub_end).depth_T + 1).double()  # visible keys of every query
            row = {}
            for split, ranks in splits(T_pad, cp).items():
                pairs = [sum(float(pairs_T[lo:hi].sum()) for lo, hi in ranges) for ranges in ranks]
                row[split] = {"imbalance_pairs": round(max(pairs) / (sum(pairs) / cp), 3)}
            if args.measure:
                g = torch.Generator().manual_seed(args.seed)
                q = torch.randn(T_pad, args.heads, args.head_dim, generator=g)
                k = torch.randn(T_pad, args.kv_heads, args.head_dim, generator=g)
                v = torch.randn(T_pad, args.kv_heads, args.head_dim, generator=g)
                for split, ranks in splits(T_pad, cp).items():
                    times = [rank_time(ranges, q, k, v, sub_end, args.repeats) for ranges in ranks]
                    row[split].update(step_s=round(max(times), 4),
                                      imbalance_measured=round(max(times) / (sum(times) / cp), 3))
                if args.heads % cp == 0:  # a2a: every rank runs the whole tree for heads / cp query heads
                    kv = max(1, args.kv_heads // cp) if args.kv_heads % cp == 0 else 1
                    row["a2a"] = {"step_s": round(rank_time([(0, T_pad)], q[:, :args.heads // cp], k[:, :kv],
                                                            v[:, :kv], sub_end, args.repeats), 4)}
                row["speedup"] = round(row["contiguous"]["step_s"] / row["zigzag"]["step_s"], 3)
            results[name][str(cp)] = row
    print(json.dumps({"benchmark": "cp_balance", "rounds": ROUNDS, "heads": args.heads, "kv_heads": args.kv_heads,
                      "head_dim": args.head_dim, "threads": torch.get_num_threads(), "results": results}))


if __name__ == "__main__":
    main()
