"""Which data-parallel rank trains which groups of a batch: balanced by estimated compute, not dealt round-robin.

A step lasts as long as its slowest DP rank, and agent rollouts are heavy-tailed: dealing groups round-robin
(rank d takes groups d, d + D, ...) leaves one rank with the long episodes while the others wait at the gradient
all-reduce. Here every group gets a cost and the groups are split into D parts of near-equal total cost by the
longest-processing-time rule (largest first, each to the least-loaded rank), which is within 4/3 of the best split
and much closer when there are many groups per rank.

Cost of a group = the forward/backward FLOPs of its prefix tree up to a common factor. A transformer layer spends
about 24 h^2 FLOPs per token in its linear layers (QKV/output projections and a 4h MLP) and about 4 h per attended
(query, key) pair, so

    cost = 6 h * tokens + pairs,

with tokens = the group's unique tree tokens and pairs = sum over them of (depth + 1) (each token attends to its
ancestors and itself). Without tree merging, tokens = sum of lengths and pairs = sum L (L + 1) / 2. Groups that
share a prefix with other groups (a common system prompt) are costed alone, which overstates them equally.

Every rank computes the same split from the same broadcast batch (ties broken by position), so no communication is
needed.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

BALANCE_MODES = ("cost", "round-robin")


def group_cost(sequences: Sequence, hidden_size: int, merging: bool = True) -> float:
    """Estimated training cost of one group's samples (see the module docstring)."""
    if merging:
        from forge_megatron.tree import build_tree

        layout = build_tree(list(sequences))
        tokens = layout.unique_tokens
        pairs = int(layout.position_ids.sum()) + tokens
    else:
        lengths = np.array([len(s) for s in sequences], dtype=np.int64)
        tokens = int(lengths.sum())
        pairs = int((lengths * (lengths + 1) // 2).sum())
    return 6.0 * hidden_size * tokens + pairs


def balanced_partition(costs: Sequence[float], parts: int) -> list[list[int]]:
    """Indices of ``costs`` split into ``parts`` lists of near-equal total cost (longest processing time first).

    Deterministic; each list is in increasing index order; every part gets an item when there are at least
    ``parts`` items.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if any(not np.isfinite(c) or c < 0 for c in costs):
        raise ValueError("costs must be finite and non-negative")
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    heap = [(0.0, p) for p in range(parts)]  # (load, part): the least-loaded part first, lowest index on ties
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in order:
        load, p = heapq.heappop(heap)
        out[p].append(i)
        heapq.heappush(heap, (load + costs[i], p))
    return [sorted(part) for part in out]


def assign_groups(group_samples: dict, dp_size: int, mode: str, hidden_size: int, merging: bool = True):
    """Split the groups of a batch over DP ranks.

    ``group_samples`` maps group index -> list of token sequences. Returns (groups of each rank, estimated cost of
    each rank). ``mode`` is ``cost`` (balanced) or ``round-robin`` (rank d takes the d-th, (d + D)-th, ... group in
    index order).
    """
    if mode not in BALANCE_MODES:
        raise ValueError(f"DP balance mode must be one of {BALANCE_MODES}, got {mode!r}")
    if not isinstance(hidden_size, (int, np.integer)) or hidden_size < 1:
        raise ValueError(f"hidden_size must be a positive integer, got {hidden_size!r}")
    groups = sorted(group_samples)
    costs = [group_cost(group_samples[g], hidden_size, merging) for g in groups]
    if mode == "round-robin":
        parts = [list(range(d, len(groups), dp_size)) for d in range(dp_size)]
    else:
        parts = balanced_partition(costs, dp_size)
    return [[groups[i] for i in part] for part in parts], [sum(costs[i] for i in part) for part in parts]


def imbalance(loads: Sequence[float]) -> float:
    """Slowest rank's load over the mean load (1.0 = perfectly balanced)."""
    mean = float(np.mean(loads)) if len(loads) else 0.0
    return float(max(loads)) / mean if mean > 0 else 1.0
