"""Prefix-forest build speed: C++ builder vs the Python one on the same ~1M-token batch. Prints ONE JSON line.

Workload: GRPO-style groups (one prompt, G completions, random token ids) until ``--total-tokens`` sample tokens.
Both builders run side by side in this process on identical input; ``identical`` checks their layouts agree.

    python benchmarks/tree_build.py [--total-tokens 1000000] [--group-size 8] [--prompt 512] [--completion 512]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from forge_megatron.tree import build_tree


def grpo_batch(total_tokens: int, group_size: int, prompt: int, completion: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    samples: list[np.ndarray] = []
    while sum(s.size for s in samples) < total_tokens:
        p = rng.integers(0, 150_000, prompt)
        samples += [np.concatenate([p, rng.integers(0, 150_000, completion)]) for _ in range(group_size)]
    return samples


def best_time(samples, backend: str, repeats: int):
    best, layout = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        layout = build_tree(samples, backend=backend)
        best = min(best, time.perf_counter() - start)
    return best, layout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total-tokens", type=int, default=1_000_000, help="sample tokens in the batch")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--prompt", type=int, default=512, help="prompt length")
    parser.add_argument("--completion", type=int, default=512, help="completion length")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per builder")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    samples = grpo_batch(args.total_tokens, args.group_size, args.prompt, args.completion, args.seed)
    cpp_s, cpp = best_time(samples, "cpp", args.repeats)
    python_s, py = best_time(samples, "python", args.repeats)
    identical = all(torch.equal(getattr(cpp, f), getattr(py, f)) for f in ("tokens", "position_ids", "sub_end", "sample_nodes"))
    print(json.dumps({
        "benchmark": "tree_build",
        "total_tokens": cpp.total_tokens,
        "unique_tokens": cpp.unique_tokens,
        "samples": cpp.num_samples,
        "python_s": round(python_s, 4),
        "cpp_s": round(cpp_s, 4),
        "python_unique_tokens_per_s": round(cpp.unique_tokens / python_s),
        "cpp_unique_tokens_per_s": round(cpp.unique_tokens / cpp_s),
        "speedup": round(python_s / cpp_s, 2),
        "identical": identical,
    }))


if __name__ == "__main__":
    main()
