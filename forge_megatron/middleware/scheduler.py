"""Windowed FIFO selection: which finished groups the trainer may take next.

Groups are numbered in submission order. ``head`` is the oldest group that is still *pending* (running or
finished, i.e. not yet delivered, failed or dropped as stale). The trainer may take any finished group whose
index i satisfies

    head <= i <= head + W - 1,        W = ceil(window_fraction * N)   (N = generation batch size in groups)

never one beyond. Taking the head group advances ``head`` to the next pending group, which slides the
window forward, so one call may take several groups in turn. ``W = 1`` is strict FIFO (head-of-line
blocking, no drift); ``W = inf`` is greedy first-finished-first-out (no blocking, biased towards short
rollouts). Inside the window the oldest finished groups are taken first.

Admission (backpressure): a new group may start while fewer than ``max_inflight`` groups run and, with a
staleness limit s and ``per_step`` groups consumed per trainer step, the groups queued ahead of it fit in s + 1
steps:  undelivered + 1 <= (s + 1) * per_step.

Staleness guarantee (``max_lag``): a group started under policy version v0 and still undelivered when the policy
reaches version v can only be trained at a version >= v, so once  v - v0 > max_lag  it can never meet the
guarantee and is dropped (``exceeds_lag``); delivered groups are never dropped.

This module is pure logic (no database, no clock) so the data pool and the discrete-event simulation in
``benchmarks/scheduler.py`` share exactly the same rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def window_size(window: float | int | str | None, window_fraction: float, generation_batch_groups: int) -> float:
    """W from an explicit ``window`` (int >= 1, ``inf`` or ``"inf"``); None or 0 means ``ceil(fraction * N)``."""
    if window in (None, 0, "0"):
        if not (0.0 < window_fraction <= 1.0):
            raise ValueError(f"window_fraction must be in (0, 1], got {window_fraction}")
        if generation_batch_groups < 1:
            raise ValueError(f"generation_batch_groups must be >= 1, got {generation_batch_groups}")
        return float(max(1, math.ceil(window_fraction * generation_batch_groups)))
    if isinstance(window, str):
        text = window.strip().lower()
        if text in ("inf", "infinity", "greedy"):
            return math.inf
        if not text.isdigit():
            raise ValueError(f"window must be an int >= 1 or 'inf', got {window!r}")
        window = int(text)
    if window == math.inf:
        return math.inf
    if isinstance(window, bool) or not float(window).is_integer() or window < 1:
        raise ValueError(f"window must be an int >= 1 or 'inf', got {window!r}")
    return float(window)


@dataclass(frozen=True)
class PendingGroup:
    """A group that is not yet delivered nor failed: ``finished`` once all its episodes are in and scored."""

    index: int
    finished: bool


def select_groups(pending: list[PendingGroup], window: float, num_groups: int) -> list[int]:
    """Indices of up to ``num_groups`` finished groups the window allows, in the order they are taken.

    ``pending`` must be sorted by index. Repeats: head = oldest pending group not yet taken; take the oldest
    finished group with index < head + window; stop when there is none.
    """
    remaining = list(pending)
    taken: list[int] = []
    while len(taken) < num_groups and remaining:
        limit = remaining[0].index + window
        pos = next((p for p, g in enumerate(remaining) if g.index >= limit or g.finished), None)
        if pos is None or remaining[pos].index >= limit:
            break
        taken.append(remaining.pop(pos).index)
    return taken


def window_occupancy(pending: list[PendingGroup], window: float) -> tuple[int, int]:
    """(finished groups inside the current window, pending groups inside it); head is ``pending[0]``."""
    if not pending:
        return 0, 0
    limit = pending[0].index + window
    inside = [g for g in pending if g.index < limit]
    return sum(g.finished for g in inside), len(inside)


def exceeds_lag(start_version: int, version: int, max_lag: int | None) -> bool:
    """Whether an undelivered group started at ``start_version`` can no longer train within ``max_lag`` versions
    now that the policy is at ``version`` (None = no guarantee: never)."""
    return max_lag is not None and version - start_version > max_lag


def admit(running: int, undelivered: int, max_inflight: int | None, max_staleness: int | None, per_step: int) -> bool:
    """Backpressure rule: may one more group start now? (``undelivered`` counts running + finished groups.)"""
    if max_inflight is not None and running >= max_inflight:
        return False
    return max_staleness is None or undelivered + 1 <= (max_staleness + 1) * per_step
