"""A learned value function (the critic of PPO): token-level GAE advantages and the value loss.

With ``--critic`` the trainer scores every trained token with a value model ``V`` (a sequence-classification
network read at every position: training/critic.py) and replaces the pool's group advantages by generalised
advantage estimates (Schulman et al. 2016) along each sample's trained tokens. The trained (sampled) tokens of a
sample are its actions, in order; the tokens between them (prompts, tool results) are the environment's and carry
neither reward nor value. For the n trained tokens of a sample with values ``v_1 .. v_n`` and return ``G`` (the
pool's return of the segment: its reward-to-go within the episode, ``GroupScores.segment_returns``)::

    r_t     = G if t = n else 0                    (plus the call's reward where a rewarded call ends at t)
    delta_t = r_t + gamma * v_{t+1} - v_t          (v_{n+1} = 0: the segment's return already holds what follows)
    A_t     = sum_{j >= t} (gamma * lambda)^(j - t) * delta_j
    R_t     = A_t + v_t                            (the value target)

so with ``gamma = lambda = 1`` (the defaults) ``A_t = G - v_t``: the return against a per-token baseline. (With the
gateway's per-call rewards, ``G`` is the return from the segment's end and each rewarded call's reward lands on its
last sampled token, so ``A_t`` is the rewards from t on, minus ``v_t``.) The
advantages are then whitened over the whole batch's trained tokens (zero mean, unit variance; ``--no-whiten-
advantages`` keeps them raw).

The suffix sums run vectorised over all samples of a micro-batch at once, in fp64: with ``gamma * lambda = 1`` one
reverse cumulative sum, otherwise a parallel scan of ceil(log2 of the longest sample) steps, each adding ``c^d`` times
the partial sum ``d`` tokens later where that token belongs to the same sample.

The critic's loss is the squared error toward those targets, ``l_t = 0.5 * (V_t - R_t)^2``, reduced as a token mean
over the batch's trained tokens. With several updates per batch (``--ppo-mini-batches`` / ``--ppo-epochs``) PPO's
value clip (``--value-clip eps``) bounds how far the values may move from ``V_old``, the values the targets came
from (taken before the batch's first update)::

    l_t = 0.5 * max((V_t - R_t)^2, (V_old_t + clip(V_t - V_old_t, -eps, eps) - R_t)^2)

(the clipped term is the larger, and its gradient 0, once ``V`` has moved past ``eps`` on the side away from ``R``).

Legend: M = next-token positions of a micro-batch's samples (sample i owns ``cu_seqlens[i]:cu_seqlens[i+1]``),
N = their trained tokens (loss mask 1), S = samples, S1 = S + 1.
"""

from __future__ import annotations

import torch

from forge_megatron.algo.losses import sample_index

__all__ = ["gae_advantages", "discounted_suffix_sums", "value_loss", "value_clip_count"]


def discounted_suffix_sums(x_N: torch.Tensor, segment_N: torch.Tensor, c: float) -> torch.Tensor:
    """``y_i = sum_{j >= i, same segment} c^(j - i) x_j`` for tokens grouped in contiguous segments (ids
    ``segment_N``, non-decreasing). ``c = 1``: one reverse cumulative sum less the next segments' share; otherwise a
    Hillis-Steele scan: after the step of stride d every partial sum covers 2d tokens (or runs to its segment's
    end), ceil(log2 of the longest segment) steps."""
    if not 0.0 <= c <= 1.0:
        raise ValueError(f"the discount gamma * lambda must lie in [0, 1], got {c}")
    n = x_N.numel()
    if n == 0 or c == 0.0:
        return x_N.clone()
    starts = torch.ones(n, dtype=torch.bool, device=x_N.device)
    starts[1:] = segment_N[1:] != segment_N[:-1]
    first = torch.nonzero(starts).flatten()  # each segment's first token
    ends = torch.cat([first[1:], first.new_tensor([n])])
    seg = torch.cumsum(starts, 0) - 1  # 0-based segment of every token
    if c == 1.0:
        suffix = x_N.flip(0).cumsum(0).flip(0)  # sum_{j >= i} x_j over every later segment too
        after = torch.cat([suffix, suffix.new_zeros(1)])[ends]  # what the segments after each one add
        return suffix - after[seg]
    left = ends[seg] - torch.arange(n, device=x_N.device)  # tokens from i to its segment's end (>= 1)
    y, d, w = x_N.clone(), 1, c
    longest = int((ends - first).max())
    while d < longest:
        y[:-d] = y[:-d] + w * y[d:] * (left[:-d] > d)  # (the right side is made whole before it is written)
        d, w = 2 * d, w * w
    return y


def gae_advantages(values_M: torch.Tensor, loss_mask_M: torch.Tensor, cu_seqlens_S1: torch.Tensor,
                   returns_S: torch.Tensor, gamma: float = 1.0, lam: float = 1.0,
                   rewards_M: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_M, value targets_M) of the trained tokens (zeros elsewhere), fp32; see the module docstring.
    ``rewards_M``: rewards at trained positions before the last (single calls' rewards), added to ``r_t``."""
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"GAE needs gamma and lambda in [0, 1], got {gamma} and {lam}")
    M, S = values_M.numel(), returns_S.numel()
    if loss_mask_M.numel() != M or cu_seqlens_S1.numel() != S + 1 or int(cu_seqlens_S1[-1]) != M:
        raise ValueError(f"GAE inputs disagree: {M} values, {loss_mask_M.numel()} mask entries, {S} returns, "
                         f"cu_seqlens ending at {int(cu_seqlens_S1[-1])}")
    device = values_M.device
    sample_M = sample_index(cu_seqlens_S1.to(device))
    trained_N = torch.nonzero(loss_mask_M.to(device) > 0).flatten()
    v_N = values_M.detach()[trained_N].double()
    seg_N = sample_M[trained_N]
    last_N = torch.ones_like(seg_N, dtype=torch.bool)
    last_N[:-1] = seg_N[:-1] != seg_N[1:]  # the sample's last trained token: its return, no next value
    next_v_N = torch.zeros_like(v_N)
    next_v_N[:-1] = v_N[1:]
    next_v_N[last_N] = 0.0
    r_N = torch.where(last_N, returns_S.to(device).double()[seg_N], torch.zeros_like(v_N))
    if rewards_M is not None:
        if rewards_M.numel() != M:
            raise ValueError(f"GAE rewards_M has {rewards_M.numel()} entries for {M} positions")
        r_N = r_N + rewards_M.to(device).double()[trained_N]
    adv_N = discounted_suffix_sums(r_N + gamma * next_v_N - v_N, seg_N, gamma * lam)
    adv_M = torch.zeros(M, dtype=torch.float32, device=device)
    ret_M = torch.zeros(M, dtype=torch.float32, device=device)
    adv_M[trained_N] = adv_N.float()
    ret_M[trained_N] = (adv_N + v_N).float()
    return adv_M, ret_M


def value_loss(values_M: torch.Tensor, returns_M: torch.Tensor, loss_mask_M: torch.Tensor,
               old_values_M: torch.Tensor | None = None, clip: float | None = None) -> torch.Tensor:
    """The summed value loss ``0.5 * (V - R)^2`` over the trained tokens (divide by the batch's count for the token
    mean); with ``clip`` the clipped form of the module docstring around ``old_values_M`` (a constant)."""
    mask = loss_mask_M.to(values_M.dtype)
    err = (values_M - returns_M) ** 2
    if clip is not None:
        if old_values_M is None:
            raise ValueError("value_loss: clip needs old_values_M (the values the targets came from)")
        old = old_values_M.detach().to(values_M.dtype)
        err = torch.maximum(err, (old + (values_M - old).clamp(-clip, clip) - returns_M) ** 2)
    return 0.5 * (err * mask).sum()


def value_clip_count(values_M: torch.Tensor, returns_M: torch.Tensor, loss_mask_M: torch.Tensor,
                        old_values_M: torch.Tensor, clip: float) -> torch.Tensor:
    """The count of trained tokens whose clipped term is the larger (strictly: the clip binds, no gradient)."""
    v, old = values_M.detach(), old_values_M.detach().to(values_M.dtype)
    clipped = (old + (v - old).clamp(-clip, clip) - returns_M) ** 2
    return ((clipped > (v - returns_M) ** 2).to(v.dtype) * loss_mask_M.to(v.dtype)).sum()
