"""Group-relative advantages and reward-to-go.

A group is the G episodes rolled out for one task. Each episode i has a return ``G_i`` (its discounted total
reward seen from its first segment). The group supplies the baseline and the scale:

    GRPO   b_i = mean_j G_j                        A_i = (G_i - b_i) / (std_j G_j + eps)
    RLOO   b_i = mean_{j != i} G_j                 A_i = (G_i - b_i) / (std_j G_j + eps)
           (= G/(G-1) * (G_i - mean_j G_j): leave-one-out keeps the baseline independent of the sample)

``std`` is the population standard deviation; with ``std_normalize=False`` the divisor is 1. Both give advantages
that sum to zero over the group, and zero everywhere when all returns are equal (never NaN).

Reward-to-go over the K segments/turns of an episode with per-segment rewards r_k and discount gamma:

    G_k = sum_{j >= k} gamma^(j - k) r_j

Segment k of episode i then gets ``(G_ik - b_i) / scale``: the same baseline as the episode, so with gamma = 1 and
no per-segment rewards every segment carries the episode's advantage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["ESTIMATORS", "reward_to_go", "group_baselines"]

ESTIMATORS = ("grpo", "rloo")


def reward_to_go(rewards: Sequence[float], gamma: float) -> list[float]:
    """Discounted sum of this and all later rewards, for every position: ``G_k = r_k + gamma * G_{k+1}``."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma}")
    out = [0.0] * len(rewards)
    acc = 0.0
    for k in range(len(rewards) - 1, -1, -1):
        acc = rewards[k] + gamma * acc
        out[k] = acc
    return out


def group_baselines(
    returns: Sequence[float], estimator: str, std_normalize: bool, eps: float
) -> tuple[list[float], float]:
    """Per-episode baseline ``b_i`` and the group scale, so that ``A_i = (G_i - b_i) / scale``.

    Needs at least two returns; a group of one has no baseline (the caller decides what to do).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    n = len(returns)
    if n < 2:
        raise ValueError(f"a group-relative baseline needs at least 2 episodes, got {n}")
    total = math.fsum(returns)
    mean = total / n
    if estimator == "grpo":
        baselines = [mean] * n
    else:
        baselines = [(total - g) / (n - 1) for g in returns]
    scale = 1.0
    if std_normalize:
        scale = math.sqrt(math.fsum((g - mean) ** 2 for g in returns) / n) + eps
    return baselines, scale
