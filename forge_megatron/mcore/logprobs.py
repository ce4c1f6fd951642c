"""Per-sample log-probabilities (and entropies) from vocabulary-parallel logits, chunked, with an exact backward.

For rows ``rows_M`` of the logits z (one row per next-token target; at a tree branch point one row serves several
targets) and targets ``y_M``:

    logp_m    = z[r_m, y_m] - lse(r_m),        lse(t) = log sum_v exp z[t, v]
    entropy_m = lse(r_m) - E_t[z],             E_t[z] = sum_v p[t, v] z[t, v],   p = softmax(z)

and the gradients, with g_m = dL/dlogp_m, h_m = dL/dentropy_m summed into per-row c_t, e_t:

    dL/dz[t, v] = sum_{m: r_m = t, y_m = v} g_m  -  c_t p[t, v]  +  e_t p[t, v] (E_t[z] - z[t, v])

Written out like this, nothing of size rows x vocabulary has to outlive the forward: the forward walks the needed
rows in chunks and keeps three numbers per row (max, log-sum-exp, E[z] - max); the backward walks them again,
recomputing the softmax from the logits. The plain autograd formulation kept three to four fp32 copies of the
logits alive between forward and backward (the upcast, the shifted logits, their exponential, and with the entropy
their product): at 64k tree tokens and a 152k vocabulary that is 37 GiB per copy per TP rank, which is how long
contexts run out of memory in the loss, not in the model. Here the extra memory is one fp32 chunk of rows
(``DEFAULT_CHUNK_BYTES``, 256 MiB, unless ``chunk_rows`` is given) in the forward, two with the entropy and two in
the backward.

Under tensor parallelism each rank holds a vocabulary slice; one pass per chunk gives local max, sum exp and
sum exp * z relative to the local max, and the global values follow from one all-reduce(max) and one all-reduce(sum)
of per-row vectors (rescaling each rank's sums by exp(local max - global max)). The target logit comes from the
rank that owns it (all-reduce(sum)). Every rank then holds the same replicated logp/entropy, and its backward
writes only its own slice of dL/dz: the same contract as Megatron's ``reduce_from_tensor_model_parallel_region``
(all-reduce forward, identity backward).

``inplace_backward=True`` writes dL/dz into the logits' own storage, as Megatron's vocab-parallel cross entropy
does: the model's output layer does not need its output for its backward, so the buffer is free by then, and
the backward then allocates no rows x vocabulary tensor at all. Only for logits that nothing else reads after the
loss (the trainer's forward step); calling backward twice through it is an error.

Legend: T = logits rows, V = vocabulary slice on this TP rank, U = distinct rows scored, M = targets.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

DEFAULT_CHUNK_BYTES = 256 << 20
"""fp32 working set of one chunk of rows (the forward needs one such buffer, the backward two)."""


def check_targets(rows_M: torch.Tensor, targets_M: torch.Tensor, vocab_size: int) -> None:
    """Targets outside the vocabulary would silently score 0 on every rank: refuse them."""
    if rows_M.shape != targets_M.shape or rows_M.dim() != 1:
        raise ValueError(f"rows and targets must be 1-D of the same length, got {tuple(rows_M.shape)} "
                         f"and {tuple(targets_M.shape)}")
    if targets_M.numel() and (int(targets_M.min()) < 0 or int(targets_M.max()) >= vocab_size):
        raise ValueError(f"target token ids must lie in [0, {vocab_size}) (the model's vocabulary), got "
                         f"[{int(targets_M.min())}, {int(targets_M.max())}]")


def _tp():
    """(world size, rank, group) of the tensor-parallel group; (1, 0, None) when Megatron is not initialised."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 0, None
    world = ps.get_tensor_model_parallel_world_size()
    if world == 1:
        return 1, 0, None
    return world, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()


def _chunks(n: int, chunk_rows: int):
    for lo in range(0, n, chunk_rows):
        yield lo, min(lo + chunk_rows, n)


class _Rows:
    """The distinct rows to score, in increasing order, read chunk by chunk (slices when they are all rows)."""

    def __init__(self, rows_M: torch.Tensor, num_rows: int):
        self.U, self.pos_M = torch.unique(rows_M, sorted=True, return_inverse=True)
        self.dense = self.U.numel() == num_rows  # every row is scored: chunks are plain slices

    def read(self, z_TV: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """A fresh fp32 copy of the chunk's rows (callers work on it in place)."""
        if self.dense:
            return z_TV[lo:hi].to(torch.float32, copy=True)
        return z_TV.index_select(0, self.U[lo:hi]).float()

    def write(self, out_TV: torch.Tensor, lo: int, hi: int, grad_CV: torch.Tensor) -> None:
        if self.dense:
            out_TV[lo:hi] = grad_CV
        else:
            out_TV.index_copy_(0, self.U[lo:hi], grad_CV.to(out_TV.dtype))


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TV, rows_M, targets_M, with_entropy, chunk_rows, inplace_backward):
        world, rank, group = _tp()
        V = logits_TV.shape[-1]
        rows = _Rows(rows_M, logits_TV.shape[0])
        n_u = rows.U.numel()
        max_U = torch.empty(n_u, dtype=torch.float32, device=logits_TV.device)
        sum_exp_U = torch.empty_like(max_U)
        sum_exp_z_U = torch.empty_like(max_U) if with_entropy else None  # sum exp(z - max) (z - max)
        for lo, hi in _chunks(n_u, chunk_rows):
            z_CV = rows.read(logits_TV, lo, hi)
            m_C = z_CV.max(dim=-1).values
            z_CV -= m_C[:, None]
            exp_CV = z_CV.exp() if with_entropy else z_CV.exp_()
            sum_exp_U[lo:hi] = exp_CV.sum(dim=-1)
            if with_entropy:
                sum_exp_z_U[lo:hi] = exp_CV.mul_(z_CV).sum(dim=-1)
            max_U[lo:hi] = m_C
            del z_CV, exp_CV
        if world > 1:
            # Rescale every rank's sums to the global max: sum exp(z - M) = exp(m - M) sum exp(z - m), and
            # sum exp(z - M)(z - M) = exp(m - M) [sum exp(z - m)(z - m) + (m - M) sum exp(z - m)].
            local_max_U = max_U.clone()
            dist.all_reduce(max_U, op=dist.ReduceOp.MAX, group=group)
            delta_U = local_max_U - max_U
            scale_U = delta_U.exp()
            if with_entropy:
                sum_exp_z_U = (sum_exp_z_U + delta_U * sum_exp_U) * scale_U
                dist.all_reduce(sum_exp_z_U, group=group)
            sum_exp_U *= scale_U
            dist.all_reduce(sum_exp_U, group=group)
        log_sum_exp_U = sum_exp_U.log()

        local_M = targets_M.to(logits_TV.device) - rank * V
        owned_M = (local_M >= 0) & (local_M < V)
        local_M = local_M.clamp(0, V - 1)
        rows_M = rows_M.to(logits_TV.device)
        target_M = logits_TV[rows_M, local_M].float() * owned_M
        if world > 1:
            dist.all_reduce(target_M, group=group)
        pos_M = rows.pos_M.to(logits_TV.device)
        logp_M = target_M - (max_U + log_sum_exp_U)[pos_M]

        ctx.rows, ctx.chunk_rows, ctx.inplace = rows, chunk_rows, inplace_backward
        ctx.with_entropy = with_entropy
        ez_minus_max_U = sum_exp_z_U / sum_exp_U if with_entropy else None  # E[z] - max
        ctx.save_for_backward(logits_TV, local_M, owned_M, pos_M, max_U, log_sum_exp_U,
                              ez_minus_max_U if with_entropy else max_U)
        if not with_entropy:
            return logp_M
        entropy_U = log_sum_exp_U - ez_minus_max_U
        return logp_M, entropy_U[pos_M]

    @staticmethod
    def backward(ctx, grad_logp_M, grad_entropy_M=None):
        logits_TV, local_M, owned_M, pos_M, max_U, log_sum_exp_U, ez_minus_max_U = ctx.saved_tensors
        rows, chunk_rows = ctx.rows, ctx.chunk_rows
        n_u = rows.U.numel()
        c_U = torch.zeros_like(max_U).index_add_(0, pos_M, grad_logp_M.float())
        e_U = (torch.zeros_like(max_U).index_add_(0, pos_M, grad_entropy_M.float())
               if ctx.with_entropy and grad_entropy_M is not None else None)
        g_M = grad_logp_M.float() * owned_M  # only the rank owning a target gets its one-hot term
        order_M = torch.argsort(pos_M, stable=True)  # targets grouped by chunk: a slice per chunk
        bounds = torch.searchsorted(pos_M[order_M], torch.arange(0, n_u + chunk_rows, chunk_rows,
                                                                 device=pos_M.device)).tolist()
        if ctx.inplace:
            out_TV = logits_TV
            if not rows.dense:  # rows that score nothing get no gradient
                unused_T = torch.ones(out_TV.shape[0], dtype=torch.bool, device=out_TV.device)
                unused_T[rows.U] = False
                out_TV.masked_fill_(unused_T[:, None], 0)
        else:
            out_TV = torch.zeros_like(logits_TV)
        for k, (lo, hi) in enumerate(_chunks(n_u, chunk_rows)):
            z_CV = rows.read(logits_TV, lo, hi)
            z_CV -= max_U[lo:hi, None]  # z - max
            p_CV = (z_CV - log_sum_exp_U[lo:hi, None]).exp_()
            if e_U is not None:
                # -c p + e p (E[z] - z) = p (e (E[z] - max - (z - max)) - c)
                z_CV.neg_().add_(ez_minus_max_U[lo:hi, None]).mul_(e_U[lo:hi, None]).sub_(c_U[lo:hi, None])
                grad_CV = p_CV.mul_(z_CV)
            else:
                grad_CV = p_CV.mul_(-c_U[lo:hi, None])
            del z_CV
            m = order_M[bounds[k]:bounds[k + 1]]
            grad_CV.index_put_((pos_M[m] - lo, local_M[m]), g_M[m], accumulate=True)
            rows.write(out_TV, lo, hi, grad_CV)
            del grad_CV, p_CV
        return out_TV, None, None, None, None, None


def default_chunk_rows(vocab_slice: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    return max(1, chunk_bytes // (4 * max(1, vocab_slice)))


def vocab_parallel_logprobs(logits_TV: torch.Tensor, rows_M: torch.Tensor, targets_M: torch.Tensor,
                            with_entropy: bool = False, chunk_rows: int | None = None,
                            inplace_backward: bool = False):
    """(logp_M, entropy_M | None) of ``targets_M`` under rows ``rows_M`` of TP-sharded logits; full-vocab exact.

    ``logits_TV`` is this rank's vocabulary slice (all of it without TP). ``chunk_rows`` bounds the rows processed
    at once (default: ``DEFAULT_CHUNK_BYTES`` of fp32); see the module docstring for ``inplace_backward``.
    """
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    if logits_TV.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab slice], got {tuple(logits_TV.shape)}")
    check_targets(rows_M, targets_M, logits_TV.shape[-1] * tp)
    if rows_M.numel() and (int(rows_M.min()) < 0 or int(rows_M.max()) >= logits_TV.shape[0]):
        raise ValueError(f"rows must lie in [0, {logits_TV.shape[0]}), got [{int(rows_M.min())}, "
                         f"{int(rows_M.max())}]")
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(logits_TV.shape[-1])
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    out = _VocabParallelLogprobs.apply(logits_TV, rows_M.to(torch.int64), targets_M.to(torch.int64),
                                       with_entropy, int(chunk_rows), inplace_backward)
    return out if with_entropy else (out, None)
