"""Off-policy control: truncated importance weights, mismatch masking and dropping stale samples.

With asynchronous rollouts a token may have been sampled by weights several versions older than the ones being
trained (every token records its ``policy_version``; -1 marks tokens that were not sampled, e.g. prompts).

    truncated IS weight   w_t = min(exp(old_logp_t - rollout_logp_t), cap)        (no gradient)
    mismatch mask         k_t = [low <= exp(old_logp_t - rollout_logp_t) <= high]  (no gradient)
    staleness of a sample current_version - min_t policy_version_t   over sampled tokens (version >= 0)

``w`` corrects for the rollout engine's distribution differing from the trainer's behaviour policy (different
kernels, precision, or weights); the cap bounds its variance. ``k`` instead drops the tokens whose two
probabilities disagree too much in either direction (IcePop, from the Ring-1T report): their gradient is the
least trustworthy, and a truncated weight would still push them. A sample whose staleness exceeds the limit is
dropped before training.

Legend: M = next-token positions of all samples concatenated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["truncated_is_weights", "mismatch_mask", "staleness", "drop_stale"]


def truncated_is_weights(old_logp_M: torch.Tensor, rollout_logp_M: torch.Tensor, cap: float) -> torch.Tensor:
    """``min(exp(old_logp - rollout_logp), cap)``, detached."""
    if not cap > 0:
        raise ValueError(f"tis cap must be > 0, got {cap}")
    log_w_M = (old_logp_M - rollout_logp_M).detach().clamp(max=math.log(cap))
    return torch.exp(log_w_M)


def mismatch_mask(old_logp_M: torch.Tensor, rollout_logp_M: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """1.0 where ``low <= exp(old_logp - rollout_logp) <= high``, else 0.0 (float, detached)."""
    if not 0 < low < 1 < high:
        raise ValueError(f"the mismatch band must satisfy 0 < low < 1 < high, got ({low}, {high})")
    log_r_M = (old_logp_M - rollout_logp_M).detach()
    return ((log_r_M >= math.log(low)) & (log_r_M <= math.log(high))).float()


def staleness(policy_versions: Sequence[int], current_version: int) -> int:
    """How many versions the oldest sampled token lags ``current_version`` (0 if no token was sampled)."""
    sampled = [int(v) for v in policy_versions if int(v) >= 0]
    if not sampled:
        return 0
    oldest = min(sampled)
    if max(sampled) > current_version:
        raise ValueError(f"policy version {max(sampled)} is newer than the current version {current_version}")
    return current_version - oldest


def drop_stale(
    versions_per_sample: Sequence[Sequence[int]], current_version: int, max_staleness: int
) -> list[int]:
    """Indices of the samples to keep: those whose staleness is at most ``max_staleness``."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    return [i for i, v in enumerate(versions_per_sample) if staleness(v, current_version) <= max_staleness]
