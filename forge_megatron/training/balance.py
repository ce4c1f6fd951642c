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

Splitting a group. A group costing more than a rank's fair share (total / D) would leave its rank the slowest
whatever the rest of the split; ``cost`` mode then deals the group's *episodes* into ceil(cost / share) pieces of
near-equal cost (each piece a tree of its own, so the shared prompt is paid once per piece and costed so) and
balances the pieces with the other groups. An episode is never split (its segments share long prefixes: the
black-box per-call samples re-send the history). The split is kept only when it lowers the estimated slowest rank
by at least ``SPLIT_MIN_GAIN`` (each piece recomputes the shared prompt: a group that is mostly prompt would cost
nearly as much per piece, doubling the work for almost no gain).
The loss does not change: advantages, sample weights and the loss normalisers are per sample and batch-wide, and a
merged tree trains exactly like its samples alone. ``cost-groups`` keeps every group whole (for comparison).

Every rank computes the same split from the same broadcast batch (ties broken by position), so no communication is
needed.
"""

from __future__ import annotations

import heapq
import math
from typing import NamedTuple, Sequence

import numpy as np

BALANCE_MODES = ("cost", "cost-groups", "round-robin")
SPLIT_MIN_GAIN = 0.05
"""Splitting groups must lower the estimated slowest rank's cost by at least this fraction to be used."""


class Share(NamedTuple):
    """One unit of work given to a DP rank: a whole group (``episodes`` None) or those episodes of it."""

    group: int
    episodes: frozenset | None
    cost: float


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


def _whole_groups(groups: list, costs: list[float], dp_size: int, mode: str):
    """Whole groups per rank: by cost (largest first to the least-loaded rank) or, ``round-robin``, the d-th,
    (d + D)-th, ... group in index order to rank d. Returns (groups of each rank, estimated cost of each rank)."""
    if mode == "round-robin":
        parts = [list(range(d, len(groups), dp_size)) for d in range(dp_size)]
    else:
        parts = balanced_partition(costs, dp_size)
    return [[groups[i] for i in part] for part in parts], [sum(costs[i] for i in part) for part in parts]


def _check(mode: str, hidden_size) -> None:
    if mode not in BALANCE_MODES:
        raise ValueError(f"DP balance mode must be one of {BALANCE_MODES}, got {mode!r}")
    if not isinstance(hidden_size, (int, np.integer)) or hidden_size < 1:
        raise ValueError(f"hidden_size must be a positive integer, got {hidden_size!r}")


def assign_episodes(group_episodes: dict, dp_size: int, mode: str, hidden_size: int, merging: bool = True):
    """Split a batch over DP ranks, whole groups or (``cost`` mode, see the module docstring) pieces of the groups
    that cost more than a rank's share.

    ``group_episodes`` maps group index -> {episode id -> list of token sequences}. Returns (the :class:`Share` list
    of each rank, estimated cost of each rank).
    """
    _check(mode, hidden_size)
    groups = sorted(group_episodes)
    costs = {g: group_cost([q for e in sorted(group_episodes[g]) for q in group_episodes[g][e]], hidden_size, merging)
             for g in groups}
    parts, loads = _whole_groups(groups, [costs[g] for g in groups], dp_size,
                                 "cost" if mode == "cost-groups" else mode)
    shares = [[Share(g, None, costs[g]) for g in part] for part in parts]
    if mode != "cost" or dp_size == 1 or not costs:
        return shares, loads
    fair = sum(costs.values()) / dp_size
    units: list[Share] = []
    for g in sorted(group_episodes):
        episodes = group_episodes[g]
        pieces = min(len(episodes), math.ceil(costs[g] / fair - 1e-9)) if fair > 0 else 1
        if pieces < 2:
            units.append(Share(g, None, costs[g]))
            continue
        ids = sorted(episodes)
        split = balanced_partition([group_cost(episodes[e], hidden_size, merging) for e in ids], pieces)
        for part in split:
            piece = [ids[i] for i in part]
            units.append(Share(g, frozenset(piece), group_cost([q for e in piece for q in episodes[e]],
                                                                hidden_size, merging)))
    if all(u.episodes is None for u in units):
        return shares, loads
    split_parts = balanced_partition([u.cost for u in units], dp_size)
    split_loads = [sum(units[i].cost for i in part) for part in split_parts]
    if max(split_loads) > (1.0 - SPLIT_MIN_GAIN) * max(loads):
        return shares, loads
    return [[units[i] for i in part] for part in split_parts], split_loads


def imbalance(loads: Sequence[float]) -> float:
    """Slowest rank's load over the mean load (1.0 = perfectly balanced)."""
    mean = float(np.mean(loads)) if len(loads) else 0.0
    return float(max(loads)) / mean if mean > 0 else 1.0
