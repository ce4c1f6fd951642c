"""Pack samples into micro-batches whose merged prefix trees stay under a unique-token budget.

The cost of a tree-packed micro-batch is its number of *unique* tokens, so samples that share prefixes should
travel together. One prefix forest of the whole batch tells us everything:
- order: samples sorted by the DFS pre-order index of their last token put samples sharing prefixes next to
  each other (the deepest shared prefix of a sample with any earlier one is with its neighbour); optional
  ``keys`` (e.g. GRPO group ids) keep each key's samples contiguous, keys in order of first appearance;
- cost: a sample adds the tree nodes on its root path not yet in the micro-batch (exact, not an estimate).
Greedy next-fit in that order; a key group that would straddle a boundary but fits in a fresh micro-batch
starts one. Deterministic: ties keep sample order.

Legend: S = samples, T = unique tree tokens of the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from forge_megatron.tree.build import build_tree


def pack_micro_batches(samples, token_budget: int, keys: Sequence | None = None) -> list[list[int]]:
    """Partition sample indices into micro-batches of at most ``token_budget`` unique (merged) tokens."""
    if isinstance(token_budget, bool) or not isinstance(token_budget, (int, np.integer)) or token_budget <= 0:
        raise ValueError(f"token_budget must be a positive integer, got {token_budget!r}")
    if keys is not None and len(keys) != len(samples):
        raise ValueError(f"keys has {len(keys)} entries but there are {len(samples)} samples")
    layout = build_tree(samples)
    offsets_S1 = layout.sample_offsets.numpy()
    lengths_S = np.diff(offsets_S1)
    too_long = np.flatnonzero(lengths_S > token_budget)
    if too_long.size:
        s = int(too_long[0])
        raise ValueError(
            f"sample {s} has {int(lengths_S[s])} tokens, more than the micro-batch token budget {token_budget}"
        )
    nodes_P = layout.sample_nodes.numpy()
    paths = [nodes_P[a:b] for a, b in zip(offsets_S1[:-1], offsets_S1[1:])]
    groups = _ordered_groups(paths, keys)
    return _next_fit(groups, paths, layout.unique_tokens, token_budget)


def _ordered_groups(paths: list[np.ndarray], keys: Sequence | None) -> list[list[int]]:
    """Samples in DFS order of their last token, grouped by key (keys by first appearance)."""
    last_S = np.fromiter((p[-1] for p in paths), dtype=np.int64, count=len(paths))
    dfs_order = np.argsort(last_S, kind="stable").tolist()
    if keys is None:
        return [dfs_order]
    groups: dict = {}
    for s in range(len(paths)):
        groups.setdefault(keys[s], [])
    for s in dfs_order:
        groups[keys[s]].append(s)
    return list(groups.values())


def _next_fit(groups: list[list[int]], paths: list[np.ndarray], num_nodes: int, budget: int) -> list[list[int]]:
    owner_T = np.full(num_nodes, -1, dtype=np.int64)  # micro-batch that already holds each tree node
    batches: list[list[int]] = [[]]
    used = 0
    for group in groups:
        group_nodes = np.unique(np.concatenate([paths[s] for s in group]))
        added = int(np.count_nonzero(owner_T[group_nodes] != len(batches) - 1))
        if batches[-1] and used + added > budget >= group_nodes.size:
            batches.append([])
            used = 0
        for s in group:
            new_nodes = paths[s][owner_T[paths[s]] != len(batches) - 1]
            if batches[-1] and used + new_nodes.size > budget:
                batches.append([])
                used = 0
                new_nodes = paths[s]
            owner_T[new_nodes] = len(batches) - 1
            used += new_nodes.size
            batches[-1].append(s)
    return batches
