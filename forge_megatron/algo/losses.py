"""Policy-gradient losses over per-sample token logprobs: CISPO (default), PPO-clip and GSPO.

The trainer gathers, for every sample of a batch, the logprob of each next token under the current policy
(``logp_M``, carries gradient) from the tree-packed forward. This module only sees those per-sample token
tensors, so a loss computed on a tree-packed batch equals the loss of the same samples trained apart: shared
prefix tokens were already expanded to every sample that contains them.

Per token t of sample i (``r = exp(clamp(logp - old_logp, -c, c))``, ``sg`` = stop-gradient):

    CISPO (MiniMax-M1)  l_it = - sg(clip(r_it, 1 - eps_low, 1 + eps_high)) * A_it * logp_it
    PPO-clip            l_it = - min(r_it * A_it, clip(r_it, 1 - eps_low, 1 + eps_high) * A_it)
                        dual clip (A_it < 0): l_it = min(l_it, - dual_clip_c * A_it)
    GSPO (token form)   s_i  = exp(clamp(mean_t (logp_it - old_logp_it), -c, c))     (masked tokens)
                        s_it = sg(s_i) * exp(logp_it - sg(logp_it))                  (value s_i, grad s_i dlogp_it)
                        l_it = - min(s_it * A_it, clip(s_it, 1 - eps_low, 1 + eps_high) * A_it)

CISPO has no min(): a token whose ratio is clipped still gets gradient ``-w A`` through ``logp``, only its weight
``w`` is capped. Optional terms per token: truncated importance weight ``tis_it = min(exp(old - rollout), cap)``
(detached) multiplying ``l_it``; the mismatch mask ``k_it = [low <= exp(old - rollout) <= high]`` (IcePop)
multiplying ``l_it`` (masked tokens still count in the normaliser); ``+ kl_coef * kl_it`` with ``k1 = logp - ref`` or
``k3 = exp(ref - logp) - (ref - logp) - 1``; ``- entropy_coef * H_it``.

On-policy distillation (``teacher_logp_M``, a frozen teacher's log-probabilities of the sampled tokens): the
advantage of every trained token becomes

    A_it = outcome_coef * A_it + distill_coef * (teacher_logp_it - old_logp_it)

the negative of the sampled per-token estimate of the reverse KL(pi_old || pi_teacher): a policy-gradient step then
lowers the reverse KL to the teacher on the student's own samples (per token, no reward-to-go: on-policy distillation
as Agarwal et al. 2024 (GKD) and Thinking Machines 2025 run it). ``outcome_coef = 0`` trains on the teacher alone.

With ``distill_kl = "forward"``, ``"reverse"`` or ``"jsd"`` the teacher's guidance is a dense loss instead: at every
trained position, a divergence between the student's and the teacher's next-token distributions, both
coarse-grained to the teacher's top K tokens plus one bucket for the rest of the vocabulary (``teacher_topk_logp_XK``
and the student's ``topk_logp_XK`` of the same tokens; tail ``log(1 - sum_k p_k)``):

    forward  kl_it = sum_k pt_k (log pt_k - log ps_k) + pt_tail (log pt_tail - log ps_tail)      KL(teacher || student)
    reverse  kl_it = sum_k ps_k (log ps_k - log pt_k) + ps_tail (log ps_tail - log pt_tail)      KL(student || teacher)
    jsd      kl_it = beta KL(pt || m) + (1 - beta) KL(ps || m),   m = beta pt + (1 - beta) ps     (GKD's JSD(beta))
    L = L_pg(outcome_coef * A) + distill_coef * reduce(kl)

differentiated through the student's distribution (GKD's objective on the student's own samples). Merging
outcomes never raises a KL or a JSD (data processing inequality), so this is a lower bound of the full-vocabulary
divergence that tightens as K grows and equals it once the top K hold all of the mass; each tail's probability is
floored at 1e-12.

Reduction with sample weights ``w_i`` (an episode split into n segments has ``w = 1/n`` per segment) and loss
mask ``m``:

    token_mean   L = sum_i w_i sum_t m_it l_it / sum_i sum_t m_it              (the CISPO normaliser)
    seq_mean     L = sum_i w_i (sum_t m_it l_it / sum_t m_it) / W,    W = norm_constant or sum_i w_i
    constant     L = sum_i w_i sum_t m_it l_it / norm_constant                 (gradient-accumulation invariant)

With ``norm="seq_mean"`` and a constant advantage per sample, GSPO's token form equals the sequence objective
``- mean_i min(s_i A_i, clip(s_i) A_i)`` in value and gradient.

Legend: M = next-token positions of all samples concatenated (sample i owns ``cu_seqlens[i]:cu_seqlens[i+1]``),
S = samples, S1 = S + 1, D = domains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from forge_megatron.algo.offpolicy import mismatch_mask, truncated_is_weights

__all__ = ["LossConfig", "policy_loss", "sample_index"]

LOSS_TYPES = ("cispo", "ppo", "gspo")
NORMS = ("token_mean", "seq_mean", "constant")
KL_TYPES = ("k1", "k3")
DISTILL_KL = ("sampled", "forward", "reverse", "jsd")

# Recommended clip ranges per loss (eps_low, eps_high): CISPO caps only large ratios (MiniMax-M1 / DAPO clip-higher),
# PPO uses the classic symmetric 0.2, GSPO's sequence ratios are length-normalised so its range is tiny (GSPO paper).
RECOMMENDED_EPS = {"cispo": (1e6, 0.28), "ppo": (0.2, 0.2), "gspo": (3e-4, 4e-4)}


@dataclass
class LossConfig:
    """How ``policy_loss`` turns token logprobs into a scalar loss."""

    loss_type: str = "cispo"
    """"cispo" | "ppo" | "gspo"."""
    eps_low: float = 1e6
    """Lower clip: ratios below ``1 - eps_low`` are clipped. Huge by default (CISPO: off)."""
    eps_high: float = 0.28
    """Upper clip: ratios above ``1 + eps_high`` are clipped."""
    dual_clip_c: float | None = None
    """PPO dual clip: with A < 0 the per-token loss never exceeds ``-c * A``. Must be > 1. PPO only."""
    log_ratio_clamp: float = 20.0
    """``logp - old_logp`` is clamped to ``[-c, c]`` before exp, so a stale token cannot overflow the ratio."""
    norm: str = "token_mean"
    """"token_mean" | "seq_mean" | "constant"."""
    norm_constant: float | None = None
    """Divisor for ``norm="constant"`` (e.g. the max tokens of a global batch). With ``norm="seq_mean"`` it replaces
    this call's ``sum_i w_i`` (the trainer passes the whole batch's, so every sequence weighs the same whichever
    micro-batch or data-parallel rank it lands in)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy (needs ``ref_logp_M``)."""
    kl_type: str = "k3"
    """"k1" (logp - ref) or "k3" (exp(ref - logp) - (ref - logp) - 1, non-negative)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (needs ``entropy_M``)."""
    tis_cap: float | None = None
    """Truncated importance weight cap: ``w = min(exp(old_logp - rollout_logp), cap)`` (needs ``rollout_logp_M``)."""
    mismatch_band: tuple[float, float] | None = None
    """(low, high): tokens whose ``exp(old_logp - rollout_logp)`` lies outside get no policy-gradient loss (IcePop;
    needs ``rollout_logp_M``); e.g. (0.5, 2.0)."""
    distill_coef: float = 0.0
    """Weight of the on-policy distillation advantage ``teacher_logp - old_logp`` (needs ``teacher_logp_M``)."""
    outcome_coef: float = 1.0
    """Weight of the given (outcome) advantages; 0 with ``distill_coef > 0`` distils from the teacher alone."""
    distill_kl: str = "sampled"
    """"sampled": the teacher's logprob of the sampled token in the advantage; "forward" / "reverse" / "jsd": a
    dense divergence over the teacher's top-k tokens (needs ``teacher_topk_logp_XK``, ``topk_logp_XK``,
    ``distill_index_X``)."""
    distill_jsd_beta: float = 0.5
    """The JSD's mixture weight of the teacher (``distill_kl="jsd"``), in (0, 1)."""

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if not self.eps_low >= 0 or not self.eps_high >= 0:
            raise ValueError(f"eps_low and eps_high must be >= 0, got eps_low={self.eps_low}, eps_high={self.eps_high}")
        if self.dual_clip_c is not None:
            if self.loss_type != "ppo":
                raise ValueError(f"dual_clip_c applies to loss_type='ppo' only, got loss_type={self.loss_type!r}")
            if not self.dual_clip_c > 1.0:
                raise ValueError(f"dual_clip_c must be > 1, got {self.dual_clip_c}")
        if not self.log_ratio_clamp > 0:
            raise ValueError(f"log_ratio_clamp must be > 0, got {self.log_ratio_clamp}")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.norm == "constant" and not (self.norm_constant is not None and self.norm_constant > 0):
            raise ValueError(f"norm='constant' needs norm_constant > 0, got {self.norm_constant}")
        if self.norm_constant is not None and not self.norm_constant > 0:
            raise ValueError(f"norm_constant must be > 0, got {self.norm_constant}")
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"kl_type must be one of {KL_TYPES}, got {self.kl_type!r}")
        if not self.kl_coef >= 0 or not self.entropy_coef >= 0:
            raise ValueError(
                f"kl_coef and entropy_coef must be >= 0, got kl_coef={self.kl_coef}, entropy_coef={self.entropy_coef}"
            )
        if not self.distill_coef >= 0 or not self.outcome_coef >= 0:
            raise ValueError(f"distill_coef and outcome_coef must be >= 0, got distill_coef={self.distill_coef}, "
                             f"outcome_coef={self.outcome_coef}")
        if self.distill_kl not in DISTILL_KL:
            raise ValueError(f"distill_kl must be one of {DISTILL_KL}, got {self.distill_kl!r}")
        if not 0 < self.distill_jsd_beta < 1:
            raise ValueError(f"distill_jsd_beta must lie in (0, 1), got {self.distill_jsd_beta}")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")
        if self.mismatch_band is not None:
            if len(self.mismatch_band) != 2 or not 0 < self.mismatch_band[0] < 1 < self.mismatch_band[1]:
                raise ValueError(f"mismatch_band must be (low, high) with 0 < low < 1 < high, got {self.mismatch_band}")
            self.mismatch_band = (float(self.mismatch_band[0]), float(self.mismatch_band[1]))

    @classmethod
    def recommended(cls, loss_type: str, **overrides) -> "LossConfig":
        """Config with the recommended clip range of ``loss_type`` (see ``RECOMMENDED_EPS``), then ``overrides``."""
        if loss_type not in RECOMMENDED_EPS:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
        eps_low, eps_high = RECOMMENDED_EPS[loss_type]
        return replace(cls(), **{"loss_type": loss_type, "eps_low": eps_low, "eps_high": eps_high, **overrides})


def sample_index(cu_seqlens_S1: torch.Tensor) -> torch.Tensor:
    """Sample id of every position, shape [M]."""
    lengths_S = cu_seqlens_S1[1:] - cu_seqlens_S1[:-1]
    return torch.repeat_interleave(torch.arange(lengths_S.numel(), device=cu_seqlens_S1.device), lengths_S)


def _check_finite(named_M: dict[str, torch.Tensor]) -> None:
    """A finite sum implies finite elements, so one host sync clears the common case; only then look closer."""
    sums = torch.stack([t.detach().float().sum() for t in named_M.values()])
    if torch.isfinite(sums).all():
        return
    for name, t in named_M.items():
        if not torch.isfinite(t).all():
            raise ValueError(f"{name} has non-finite values")


def _check_inputs(named_M: dict[str, torch.Tensor], cu_seqlens_S1: torch.Tensor) -> None:
    """Validate shapes and values of the per-position tensors and the sample boundaries."""
    logp_M = named_M["logp_M"]
    if logp_M.dim() != 1:
        raise ValueError(f"logp_M must be 1-D [M], got shape {tuple(logp_M.shape)}")
    for name, t in named_M.items():
        if t.shape != logp_M.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(logp_M.shape)} like logp_M")
    _check_finite(named_M)
    if cu_seqlens_S1.dim() != 1 or cu_seqlens_S1.numel() < 2:
        raise ValueError(f"cu_seqlens_S1 must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens_S1.shape)}")
    if cu_seqlens_S1.dtype.is_floating_point:
        raise ValueError(f"cu_seqlens_S1 must be an integer tensor, got {cu_seqlens_S1.dtype}")
    if cu_seqlens_S1[0] != 0 or cu_seqlens_S1[-1] != logp_M.numel():
        raise ValueError(
            f"cu_seqlens_S1 must start at 0 and end at M={logp_M.numel()}, got "
            f"{int(cu_seqlens_S1[0])}..{int(cu_seqlens_S1[-1])}"
        )
    lengths_S = cu_seqlens_S1[1:] - cu_seqlens_S1[:-1]
    if (lengths_S <= 0).any():
        bad = int(torch.nonzero(lengths_S <= 0)[0])
        raise ValueError(f"sample {bad} is empty (cu_seqlens_S1 must be strictly increasing)")
    mask_M = named_M["loss_mask_M"]
    if ((mask_M != 0) & (mask_M != 1)).any():
        raise ValueError("loss_mask_M must contain only 0 and 1")


def _check_sample_weight(sample_weight_S: torch.Tensor, num_samples: int) -> None:
    if sample_weight_S.shape != (num_samples,):
        raise ValueError(f"sample_weight_S has shape {tuple(sample_weight_S.shape)}, expected ({num_samples},)")
    if not torch.isfinite(sample_weight_S).all() or (sample_weight_S < 0).any():
        raise ValueError("sample_weight_S must be finite and >= 0")


@dataclass
class _Batch:
    """The per-position tensors every term needs, in fp32, plus the reduction they share."""

    mask_M: torch.Tensor
    sample_M: torch.Tensor
    sample_weight_S: torch.Tensor
    cfg: LossConfig

    @property
    def num_samples(self) -> int:
        return self.sample_weight_S.numel()

    def per_sample_sum(self, x_M: torch.Tensor) -> torch.Tensor:
        zeros_S = torch.zeros(self.num_samples, dtype=x_M.dtype, device=x_M.device)
        return zeros_S.index_add(0, self.sample_M, x_M)

    def reduce(self, x_M: torch.Tensor) -> torch.Tensor:
        """Mask, sample weights and the configured normaliser (module docstring)."""
        norm = self.cfg.norm
        if norm == "seq_mean":
            denom = self.cfg.norm_constant if self.cfg.norm_constant is not None else self.sample_weight_S.sum()
            if denom == 0:
                raise ValueError("sample_weight_S sums to 0: seq_mean normaliser is 0")
            mean_S = self.per_sample_sum(x_M * self.mask_M) / self.per_sample_sum(self.mask_M).clamp(min=1.0)
            return (self.sample_weight_S * mean_S).sum() / denom
        total = (x_M * self.mask_M * self.sample_weight_S[self.sample_M]).sum()
        if norm == "constant":
            return total / self.cfg.norm_constant
        denom = self.mask_M.sum()
        if denom == 0:
            raise ValueError("loss_mask_M selects no tokens: token_mean normaliser is 0")
        return total / denom

    def masked_mean(self, x_M: torch.Tensor) -> torch.Tensor:
        """Unweighted mean over trained tokens (for metrics)."""
        return (x_M * self.mask_M).sum() / self.mask_M.sum().clamp(min=1.0)


def _ratio(logp_M: torch.Tensor, old_logp_M: torch.Tensor, batch: _Batch) -> torch.Tensor:
    """Token ratio (CISPO, PPO) or GSPO's sequence ratio with a per-token gradient path."""
    c = batch.cfg.log_ratio_clamp
    if batch.cfg.loss_type != "gspo":
        return torch.exp((logp_M - old_logp_M).clamp(-c, c))
    mean_log_ratio_S = batch.per_sample_sum((logp_M - old_logp_M) * batch.mask_M) / batch.per_sample_sum(
        batch.mask_M
    ).clamp(min=1.0)
    seq_ratio_S = torch.exp(mean_log_ratio_S.clamp(-c, c))
    return seq_ratio_S.detach()[batch.sample_M] * torch.exp(logp_M - logp_M.detach())


def _token_loss(logp_M: torch.Tensor, ratio_M: torch.Tensor, adv_M: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """Per-token policy-gradient loss ``l_it`` (module docstring)."""
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    if cfg.loss_type == "cispo":
        return -ratio_M.detach().clamp(lo, hi) * adv_M * logp_M
    loss_M = -torch.min(ratio_M * adv_M, ratio_M.clamp(lo, hi) * adv_M)
    if cfg.dual_clip_c is not None:
        loss_M = torch.where(adv_M < 0, torch.min(loss_M, -cfg.dual_clip_c * adv_M), loss_M)
    return loss_M


def _kl(logp_M: torch.Tensor, ref_logp_M: torch.Tensor, kl_type: str) -> torch.Tensor:
    if kl_type == "k1":
        return logp_M - ref_logp_M
    delta_M = ref_logp_M - logp_M
    return torch.exp(delta_M) - delta_M - 1.0


TAIL_FLOOR = 1e-12
"""Smallest probability a top-k KL gives the tail bucket (a teacher sure of its top k has a tail of 0)."""


def _merged(lp_XK: torch.Tensor) -> torch.Tensor:
    """[X, K + 1] log-probabilities of the K tokens and of the rest of the vocabulary (``log(1 - sum_k p_k)``, its
    probability floored at ``TAIL_FLOOR``), in fp64 (the tail is one minus a sum of probabilities)."""
    lp_XK = lp_XK.double()
    edge = torch.log1p(torch.tensor(-TAIL_FLOOR, dtype=torch.float64, device=lp_XK.device))
    tail_X = torch.log(-torch.expm1(torch.logsumexp(lp_XK, dim=-1).clamp(max=edge)))
    return torch.cat([lp_XK, tail_X[:, None]], dim=-1)


def topk_kl(student_XK: torch.Tensor, teacher_XK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(forward KL(teacher || student), reverse KL(student || teacher)) per row [X] of the distributions over
    the teacher's top K tokens plus a tail bucket (module docstring), from both models' logprobs of those K tokens;
    differentiable in ``student_XK``."""
    s, t = _merged(student_XK), _merged(teacher_XK.detach())
    return (t.exp() * (t - s)).sum(-1).float(), (s.exp() * (s - t)).sum(-1).float()


def topk_jsd(student_XK: torch.Tensor, teacher_XK: torch.Tensor, beta: float) -> torch.Tensor:
    """GKD's generalized Jensen-Shannon divergence per row [X] on the same merged distributions:
    ``beta KL(teacher || m) + (1 - beta) KL(student || m)`` with the mixture ``m = beta teacher + (1 - beta) student``,
    0 < beta < 1 (it tends to the forward KL as beta -> 0 and to the reverse KL as beta -> 1, each scaled by beta
    or 1 - beta); differentiable in ``student_XK``."""
    if not 0 < beta < 1:
        raise ValueError(f"the JSD's beta must lie in (0, 1), got {beta}")
    s, t = _merged(student_XK), _merged(teacher_XK.detach())
    m = torch.logaddexp(t + math.log(beta), s + math.log1p(-beta))
    return (beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)).float()


def _domain_stats(
    per_token: dict[str, torch.Tensor], mask_M: torch.Tensor, domain_M: torch.Tensor, domain_names: list[str]
) -> dict[str, torch.Tensor]:
    """Masked token means of each per-token quantity per domain, keyed ``"<domain>/<name>"``."""
    zeros_D = torch.zeros(len(domain_names), dtype=mask_M.dtype, device=mask_M.device)
    count_D = zeros_D.index_add(0, domain_M, mask_M)
    mean_D = {
        key: zeros_D.index_add(0, domain_M, x_M * mask_M) / count_D.clamp(min=1.0) for key, x_M in per_token.items()
    }
    out = {}
    for d, name in enumerate(domain_names):
        out[f"{name}/num_tokens"] = count_D[d]
        out.update({f"{name}/{key}": m_D[d] for key, m_D in mean_D.items()})
    return out


def _to_floats(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """All metrics to host in one transfer; domains without trained tokens are left out."""
    values = torch.stack([v.detach().float().reshape(()) for v in stats.values()]).tolist()
    out = dict(zip(stats, values))
    empty = {key.rsplit("/", 1)[0] for key, v in out.items() if key.endswith("/num_tokens") and v == 0}
    return {key: v for key, v in out.items() if key.rsplit("/", 1)[0] not in empty}


def _check_domains(domain_ids_S: torch.Tensor, domain_names: list[str] | None, num_samples: int) -> list[str]:
    if domain_ids_S.shape != (num_samples,) or domain_ids_S.dtype.is_floating_point:
        raise ValueError(f"domain_ids_S must be an integer tensor of shape ({num_samples},)")
    if (domain_ids_S < 0).any():
        raise ValueError("domain_ids_S must be >= 0")
    num_domains = int(domain_ids_S.max()) + 1
    if domain_names is None:
        return [str(d) for d in range(num_domains)]
    if num_domains > len(domain_names):
        raise ValueError(f"domain_ids_S must lie in [0, {len(domain_names)}) to index domain_names")
    return list(domain_names)


def _check_required(cfg: LossConfig, named_M: dict[str, torch.Tensor]) -> None:
    """Every configured term has its input."""
    if (cfg.tis_cap is not None or cfg.mismatch_band is not None) and "rollout_logp_M" not in named_M:
        raise ValueError("tis_cap / mismatch_band is set but rollout_logp_M was not given")
    if cfg.kl_coef > 0 and "ref_logp_M" not in named_M:
        raise ValueError("kl_coef > 0 but ref_logp_M was not given")
    if cfg.entropy_coef > 0 and "entropy_M" not in named_M:
        raise ValueError("entropy_coef > 0 but entropy_M was not given")
    if cfg.distill_coef > 0 and cfg.distill_kl == "sampled" and "teacher_logp_M" not in named_M:
        raise ValueError("distill_coef > 0 but teacher_logp_M was not given")


def _make_batch(
    loss_mask_M: torch.Tensor, cu_seqlens_S1: torch.Tensor, sample_weight_S: torch.Tensor | None, cfg: LossConfig
) -> _Batch:
    device, num_samples = loss_mask_M.device, cu_seqlens_S1.numel() - 1
    if sample_weight_S is None:
        sample_weight_S = torch.ones(num_samples, device=device)
    _check_sample_weight(sample_weight_S, num_samples)
    return _Batch(
        mask_M=loss_mask_M.detach().float(),
        sample_M=sample_index(cu_seqlens_S1.to(device).long()),
        sample_weight_S=sample_weight_S.detach().to(device=device, dtype=torch.float32),
        cfg=cfg,
    )


def _zero_one(x_M: torch.Tensor, name: str) -> torch.Tensor:
    if ((x_M != 0) & (x_M != 1)).any():
        raise ValueError(f"{name} must contain only 0 and 1")
    return x_M.detach().float()


def _dense_distill(teacher_XK, student_XK, index_X, batch: _Batch, cfg: LossConfig) -> dict[str, torch.Tensor]:
    """The top-k KLs per position [M] (0 where not trained) and the teacher's top-k mass."""
    if teacher_XK is None or student_XK is None or index_X is None:
        raise ValueError(f"distill_kl={cfg.distill_kl!r} needs teacher_topk_logp_XK, topk_logp_XK and "
                         "distill_index_X")
    if teacher_XK.dim() != 2 or student_XK.shape != teacher_XK.shape or index_X.shape != teacher_XK.shape[:1]:
        raise ValueError(f"teacher_topk_logp_XK {tuple(teacher_XK.shape)}, topk_logp_XK {tuple(student_XK.shape)} "
                         f"and distill_index_X {tuple(index_X.shape)} must be [X, K], [X, K] and [X]")
    M = batch.mask_M.numel()
    index_X = index_X.to(batch.mask_M.device).long()
    if index_X.numel() and (int(index_X.min()) < 0 or int(index_X.max()) >= M):
        raise ValueError(f"distill_index_X must index the {M} positions")
    if bool((batch.mask_M[index_X] == 0).any()) or index_X.unique().numel() != index_X.numel():
        raise ValueError("distill_index_X must list trained positions (loss_mask_M == 1), each once")
    _check_finite({"teacher_topk_logp_XK": teacher_XK, "topk_logp_XK": student_XK})
    forward_X, reverse_X = topk_kl(student_XK, teacher_XK)
    mass_X = teacher_XK.detach().float().exp().sum(-1)

    def on_positions(x_X):
        return torch.zeros(M, dtype=x_X.dtype, device=x_X.device).index_put((index_X,), x_X)

    out = {"distill_forward_kl": on_positions(forward_X), "distill_reverse_kl": on_positions(reverse_X),
           "distill_topk_mass": on_positions(mass_X),
           "scored": on_positions(torch.ones_like(mass_X))}  # (the positions the teacher's top-k covers)
    if cfg.distill_kl == "jsd":
        out["distill_jsd"] = on_positions(topk_jsd(student_XK, teacher_XK, cfg.distill_jsd_beta))
    return out


def _clip_stats(ratio_M: torch.Tensor, adv_M: torch.Tensor, batch: _Batch) -> dict[str, torch.Tensor]:
    cfg = batch.cfg
    log_r = torch.log(ratio_M.clamp(min=1e-30))
    return {
        "clip_frac_low": batch.masked_mean((ratio_M < 1.0 - cfg.eps_low).float()),
        "clip_frac_high": batch.masked_mean((ratio_M > 1.0 + cfg.eps_high).float()),
        "ratio_mean": batch.masked_mean(ratio_M),
        # k3 estimate of KL(pi_old || pi) over the trained tokens (sampled by pi_old): how far the updates moved
        "ppo_kl": batch.masked_mean(ratio_M - 1.0 - log_r),
        "ratio_max": torch.where(batch.mask_M > 0, ratio_M, 0.0).max(),
        "advantage_mean": batch.masked_mean(adv_M),
        "num_tokens": batch.mask_M.sum(),
    }


def _rollout_mismatch(logp_M: torch.Tensor, rollout_logp_M: torch.Tensor, batch: _Batch,
                      on_policy_M: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """How far the trainer's log-probabilities of the sampled tokens are from the engine's, over the loss tokens:
    mean and max of ``|logp - rollout_logp|``, and ``rollout_kl``, the k3 estimate of KL(rollout || trainer) (the
    tokens were sampled by the rollout policy: ``E[r - 1 - log r]`` with ``r = pi / pi_rollout``). Tokens sampled by
    the current weights measure numerical mismatch alone (precision, kernels; see ``--fp32-lm-head``); stale
    tokens add the policy's change since. With ``on_policy_M`` (1 for tokens sampled by the weights being trained)
    the same terms over those tokens alone come as ``onpolicy/...`` with their count ``onpolicy/num_tokens``."""
    d_M = logp_M - rollout_logp_M
    abs_M = d_M.abs()
    d_M = d_M.clamp(-20.0, 20.0)  # exp() of a wild mismatch must not make the metric inf
    k3_M = torch.expm1(d_M) - d_M
    out = {
        "rollout_logp_abs_diff": batch.masked_mean(abs_M),
        "rollout_logp_abs_diff_max": torch.where(batch.mask_M > 0, abs_M, 0.0).max(),
        "rollout_kl": batch.masked_mean(k3_M),
    }
    if on_policy_M is not None:
        mask_M = batch.mask_M * on_policy_M.to(batch.mask_M.device).float()
        n = mask_M.sum()
        out.update({"onpolicy/num_tokens": n,
                    "onpolicy/rollout_logp_abs_diff": (abs_M * mask_M).sum() / n.clamp(min=1.0),
                    "onpolicy/rollout_kl": (k3_M * mask_M).sum() / n.clamp(min=1.0)})
    return out


def policy_loss(
    logp_M: torch.Tensor,
    old_logp_M: torch.Tensor,
    advantages_M: torch.Tensor,
    loss_mask_M: torch.Tensor,
    cu_seqlens_S1: torch.Tensor,
    cfg: LossConfig,
    *,
    rollout_logp_M: torch.Tensor | None = None,
    ref_logp_M: torch.Tensor | None = None,
    teacher_logp_M: torch.Tensor | None = None,
    entropy_M: torch.Tensor | None = None,
    sample_weight_S: torch.Tensor | None = None,
    domain_ids_S: torch.Tensor | None = None,
    domain_names: list[str] | None = None,
    on_policy_M: torch.Tensor | None = None,
    teacher_topk_logp_XK: torch.Tensor | None = None,
    topk_logp_XK: torch.Tensor | None = None,
    distill_index_X: torch.Tensor | None = None,
    teacher_mask_M: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar loss (to minimise) and float metrics. See the module docstring for the formulas.

    ``on_policy_M`` (optional, metrics only) marks the tokens sampled by the weights being trained: the
    training/inference mismatch is then also reported over them alone (``onpolicy/...``).

    ``old_logp_M``, ``advantages_M``, ``rollout_logp_M``, ``ref_logp_M`` and ``teacher_logp_M`` are treated as
    constants (detached); with ``teacher_logp_M`` the advantages are the distillation's (module docstring) and the
    metrics gain ``distill_reverse_kl`` (the mean of ``old_logp - teacher_logp`` over trained tokens) and
    ``distill_teacher_logp``.
    ``entropy_M`` keeps its gradient (the entropy bonus trains through it). Everything is computed in fp32.

    ``distill_kl = "forward" | "reverse" | "jsd"``: ``teacher_topk_logp_XK`` (the teacher's logprobs of its top K
    tokens at the targets ``distill_index_X``, trained ones the teacher scored) and ``topk_logp_XK`` (the student's of the same
    tokens, differentiable) give the dense term; the metrics gain ``distill_forward_kl``, ``distill_reverse_kl``
    (both top-k KLs, whichever trains), ``distill_jsd`` (with "jsd"), ``distill_topk_mass`` (the teacher's
    probability in its top K) and ``distill_loss`` (the trained term, reduced).

    Positions the teacher did not score (episodes recorded before the gateway had a teacher: ``teacher_mask_M`` 0 in
    the sampled form, trained positions left out of ``distill_index_X`` in the dense one) get no teacher term; the
    distillation metrics are means over the scored positions and ``distill_scored_fraction`` is their share of the
    trained ones.
    """
    named_M = {"logp_M": logp_M, "old_logp_M": old_logp_M, "advantages_M": advantages_M, "loss_mask_M": loss_mask_M}
    for name, t in (("rollout_logp_M", rollout_logp_M), ("ref_logp_M", ref_logp_M), ("entropy_M", entropy_M),
                    ("teacher_logp_M", teacher_logp_M), ("teacher_mask_M", teacher_mask_M)):
        if t is not None:
            named_M[name] = t
    _check_inputs(named_M, cu_seqlens_S1)
    _check_required(cfg, named_M)
    batch = _make_batch(loss_mask_M, cu_seqlens_S1, sample_weight_S, cfg)
    logp_M, old_logp_M, adv_M = logp_M.float(), old_logp_M.detach().float(), advantages_M.detach().float()
    distill, scored_M = {}, None  # scored_M: the trained positions the teacher scored (the metrics' mask)
    dense = cfg.distill_kl != "sampled"
    teacher_mask = batch.mask_M if teacher_mask_M is None else \
        batch.mask_M * _zero_one(teacher_mask_M, "teacher_mask_M")
    if dense:
        distill.update(_dense_distill(teacher_topk_logp_XK, topk_logp_XK, distill_index_X, batch, cfg))
        scored_M = distill.pop("scored")
        adv_M = cfg.outcome_coef * adv_M
    if teacher_logp_M is not None:
        teacher_M = teacher_logp_M.detach().float()
        distill["distill_teacher_logp"] = teacher_M
        if not dense:
            scored_M = teacher_mask
            reverse_kl_M = old_logp_M - teacher_M  # log pi_old / pi_teacher at the sampled token
            adv_M = cfg.outcome_coef * adv_M - cfg.distill_coef * reverse_kl_M * scored_M
            distill["distill_reverse_kl"] = reverse_kl_M

    ratio_M = _ratio(logp_M, old_logp_M, batch)
    pg_M = _token_loss(logp_M, ratio_M, adv_M, cfg)
    stats = _clip_stats(ratio_M.detach(), adv_M, batch)
    if cfg.tis_cap is not None:
        tis_M = truncated_is_weights(old_logp_M, rollout_logp_M.float(), cfg.tis_cap)
        pg_M = pg_M * tis_M
        stats["tis_weight_mean"] = batch.masked_mean(tis_M)
        stats["tis_clip_frac"] = batch.masked_mean((tis_M >= cfg.tis_cap).float())
    if cfg.mismatch_band is not None:
        keep_M = mismatch_mask(old_logp_M, rollout_logp_M.float(), *cfg.mismatch_band)
        pg_M = pg_M * keep_M
        stats["mismatch_masked_frac"] = batch.masked_mean(1.0 - keep_M)
    if rollout_logp_M is not None:
        stats.update(_rollout_mismatch(logp_M.detach(), rollout_logp_M.detach().float(), batch, on_policy_M))
    loss = stats["pg_loss"] = batch.reduce(pg_M)
    per_token = {"pg_loss": pg_M.detach(), "advantage": adv_M, "ratio": ratio_M.detach()}
    if distill:
        partial = bool((scored_M != batch.mask_M).any())
        stats["distill_scored_fraction"] = scored_M.sum() / batch.mask_M.sum().clamp(min=1.0)
        for key, x_M in distill.items():
            mask_M = teacher_mask if key == "distill_teacher_logp" else scored_M
            stats[key] = (x_M.detach() * mask_M).sum() / mask_M.sum().clamp(min=1.0)
            if not partial:  # (per-domain means over the trained tokens: only when the teacher scored them all)
                per_token[key] = x_M.detach()
    if dense:
        trained = distill["distill_jsd" if cfg.distill_kl == "jsd" else f"distill_{cfg.distill_kl}_kl"]
        stats["distill_loss"] = batch.reduce(trained)
        loss = loss + cfg.distill_coef * stats["distill_loss"]
    if ref_logp_M is not None:
        kl_M = _kl(logp_M, ref_logp_M.detach().float(), cfg.kl_type)
        stats["kl"], per_token["kl"] = batch.reduce(kl_M), kl_M.detach()
        loss = loss + cfg.kl_coef * stats["kl"]
    if entropy_M is not None:
        ent_M = entropy_M.float()
        stats["entropy"], per_token["entropy"] = batch.reduce(ent_M), ent_M.detach()
        loss = loss - cfg.entropy_coef * stats["entropy"]
    stats["loss"] = loss
    if domain_ids_S is not None:
        names = _check_domains(domain_ids_S, domain_names, batch.num_samples)
        domain_M = domain_ids_S.to(batch.sample_M.device)[batch.sample_M]
        stats.update(_domain_stats(per_token, batch.mask_M, domain_M, names))
    return loss, _to_floats(stats)
