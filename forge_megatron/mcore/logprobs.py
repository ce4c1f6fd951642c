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

``temperature`` T scores the tokens under softmax(z / T), the distribution an engine samples from at temperature T
and whose logprobs SGLang returns by default: every chunk of logits is divided by T as it is read, and the
gradient with respect to the raw logits is the one with respect to z / T divided by T.

``softcap`` c (Gemma 4's ``final_logit_softcapping``) scores softmax(c tanh(z / c) / T) instead: the cap goes on
before the temperature, as in transformers and SGLang; the backward recomputes tanh chunk by chunk and multiplies
the gradient by (1 - tanh^2) / T.

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
"""fp32 working set of one chunk of rows (the forward needs one such buffer, two with the entropy; the backward
two)."""


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


class _Targets:
    """The distinct rows to score (increasing) and, per target, its row's position among them, its column in this
    rank's vocabulary slice and whether this rank owns it; targets grouped by chunk of rows."""

    def __init__(self, rows_M, targets_M, num_rows: int, vocab_slice: int, rank: int, chunk_rows: int, device):
        rows_M, targets_M = rows_M.to(device), targets_M.to(device)
        self.U, self.pos_M = torch.unique(rows_M, sorted=True, return_inverse=True)
        self.dense = self.U.numel() == num_rows  # every row is scored: chunks are plain slices
        local_M = targets_M - rank * vocab_slice
        self.owned_M = (local_M >= 0) & (local_M < vocab_slice)
        self.local_M = local_M.clamp(0, vocab_slice - 1)
        self.chunk_rows = chunk_rows
        self.order_M = torch.argsort(self.pos_M, stable=True)
        edges = torch.arange(0, self.U.numel() + chunk_rows, chunk_rows, device=device)
        self.bounds = torch.searchsorted(self.pos_M[self.order_M], edges).tolist()

    def chunks(self):
        """(lo, hi, the targets scored on rows U[lo:hi], their rows within the chunk) per chunk of rows."""
        for k, (lo, hi) in enumerate(_chunks(self.U.numel(), self.chunk_rows)):
            m = self.order_M[self.bounds[k]:self.bounds[k + 1]]
            yield lo, hi, m, self.pos_M[m] - lo

    def fresh_fp32(self, x_T: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """An fp32 copy of rows U[lo:hi] of x that the caller may overwrite."""
        if self.dense:
            return x_T[lo:hi].to(torch.float32, copy=True)
        return x_T.index_select(0, self.U[lo:hi]).float()  # index_select already copies

    def select(self, x_T: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Rows U[lo:hi] of x (a view when every row is scored)."""
        return x_T[lo:hi] if self.dense else x_T.index_select(0, self.U[lo:hi])


def _forward(read, t: _Targets, with_entropy: bool, device):
    """logp_M, entropy_M | None and the per-row statistics the backward needs; ``read(lo, hi)`` gives a fresh fp32
    [C, V] chunk of this rank's logits for rows U[lo:hi]."""
    world, _, group = _tp()
    n_u = t.U.numel()
    max_U = torch.empty(n_u, dtype=torch.float32, device=device)
    sum_exp_U = torch.empty_like(max_U)
    sum_exp_z_U = torch.empty_like(max_U) if with_entropy else None  # sum exp(z - max) (z - max)
    target_M = torch.zeros(t.pos_M.shape, dtype=torch.float32, device=device)
    for lo, hi, m, r in t.chunks():
        z_CV = read(lo, hi)
        # only the owning rank contributes the target logit (where, not a product: -inf * 0 would be NaN)
        target_M[m] = torch.where(t.owned_M[m], z_CV[r, t.local_M[m]], 0.0)
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
        dist.all_reduce(target_M, group=group)
    log_sum_exp_U = sum_exp_U.log()
    logp_M = target_M - (max_U + log_sum_exp_U)[t.pos_M]
    if not with_entropy:
        return logp_M, None, (max_U, log_sum_exp_U, max_U)  # (the third slot is unused without entropy)
    ez_minus_max_U = sum_exp_z_U / sum_exp_U  # E[z] - max
    entropy_M = (log_sum_exp_U - ez_minus_max_U)[t.pos_M]
    return logp_M, entropy_M, (max_U, log_sum_exp_U, ez_minus_max_U)


def _backward_chunks(read, t: _Targets, stats, grad_logp_M, grad_entropy_M):
    """Yield (lo, hi, dL/dz for rows U[lo:hi] in fp32) chunk by chunk, recomputing the softmax from ``read``."""
    max_U, log_sum_exp_U, ez_minus_max_U = stats
    c_U = torch.zeros_like(max_U).index_add_(0, t.pos_M, grad_logp_M.float())
    e_U = (torch.zeros_like(max_U).index_add_(0, t.pos_M, grad_entropy_M.float())
           if grad_entropy_M is not None else None)
    g_M = grad_logp_M.float() * t.owned_M  # only the rank owning a target gets its one-hot term
    for lo, hi, m, r in t.chunks():
        z_CV = read(lo, hi)
        z_CV -= max_U[lo:hi, None]  # z - max
        p_CV = (z_CV - log_sum_exp_U[lo:hi, None]).exp_()
        if e_U is not None:
            # -c p + e p (E[z] - z) = p (e (E[z] - max - (z - max)) - c)
            z_CV.neg_().add_(ez_minus_max_U[lo:hi, None]).mul_(e_U[lo:hi, None]).sub_(c_U[lo:hi, None])
            grad_CV = p_CV.mul_(z_CV)
        else:
            grad_CV = p_CV.mul_(-c_U[lo:hi, None])
        del z_CV
        grad_CV.index_put_((r, t.local_M[m]), g_M[m], accumulate=True)
        yield lo, hi, grad_CV
        del grad_CV, p_CV


class _Scores:
    """What the distribution is taken of: the raw logits z, soft-capped to ``softcap`` * tanh(z / ``softcap``) when
    given (Gemma's ``final_logit_softcapping``, applied to the logits before any sampling temperature, as
    transformers and SGLang do), then divided by ``temperature``. ``forward(read)`` maps every chunk ``read`` gives
    (in place: they are fresh fp32 copies); ``backward(read)`` does the same and keeps the chunk's derivative
    d score / dz, which ``chain(grad)`` then applies to the gradient with respect to the scores (one more fp32 chunk
    in the backward with soft-capping)."""

    def __init__(self, temperature: float, softcap: float | None):
        self.temperature, self.softcap = temperature, softcap
        self._deriv = None

    def _map(self, z_CV):
        if self.softcap is not None:
            z_CV.div_(self.softcap).tanh_().mul_(self.softcap)
        if self.temperature != 1.0:
            z_CV.div_(self.temperature)
        return z_CV

    def forward(self, read):
        if self.softcap is None and self.temperature == 1.0:
            return read
        return lambda lo, hi: self._map(read(lo, hi))

    def backward(self, read):
        if self.softcap is None:
            return self.forward(read)

        def mapped(lo, hi):
            z_CV = read(lo, hi).div_(self.softcap).tanh_()  # tanh(z / c)
            self._deriv = (1.0 - z_CV * z_CV).div_(self.temperature)  # d (c tanh(z / c) / T) / dz
            return z_CV.mul_(self.softcap / self.temperature)

        return mapped

    def chain(self, grad_CV):
        """dL/dz from dL/dscore for the chunk the backward read last."""
        if self.softcap is not None:
            grad_CV.mul_(self._deriv)
            self._deriv = None
        elif self.temperature != 1.0:
            grad_CV.div_(self.temperature)  # d(z / T) / dz
        return grad_CV


class _VocabParallelLogprobs(torch.autograd.Function):
    """Logprobs/entropy from this rank's logits [T, V]."""

    @staticmethod
    def forward(ctx, logits_TV, rows_M, targets_M, with_entropy, chunk_rows, inplace_backward, temperature, softcap):
        _, rank, _ = _tp()
        t = _Targets(rows_M, targets_M, logits_TV.shape[0], logits_TV.shape[-1], rank, chunk_rows, logits_TV.device)

        def read(lo, hi):
            return t.fresh_fp32(logits_TV, lo, hi)

        scores = _Scores(temperature, softcap)
        logp_M, entropy_M, stats = _forward(scores.forward(read), t, with_entropy, logits_TV.device)
        ctx.t, ctx.inplace, ctx.with_entropy, ctx.scores = t, inplace_backward, with_entropy, scores
        ctx.save_for_backward(logits_TV, *stats)
        return (logp_M, entropy_M) if with_entropy else logp_M

    @staticmethod
    def backward(ctx, grad_logp_M, grad_entropy_M=None):
        logits_TV, *stats = ctx.saved_tensors
        t = ctx.t

        def read(lo, hi):
            return t.fresh_fp32(logits_TV, lo, hi)

        if ctx.inplace:
            out_TV = logits_TV
            if not t.dense:  # rows that score nothing get no gradient
                unused_T = torch.ones(out_TV.shape[0], dtype=torch.bool, device=out_TV.device)
                unused_T[t.U] = False
                out_TV.masked_fill_(unused_T[:, None], 0)
        else:
            out_TV = torch.zeros_like(logits_TV)
        # Each chunk's rows are read before its gradient is written, and chunks are disjoint: safe in place.
        scores = ctx.scores
        for lo, hi, grad_CV in _backward_chunks(scores.backward(read), t, stats, grad_logp_M,
                                                grad_entropy_M if ctx.with_entropy else None):
            grad_CV = scores.chain(grad_CV)
            if t.dense:
                out_TV[lo:hi] = grad_CV
            else:
                out_TV.index_copy_(0, t.U[lo:hi], grad_CV.to(out_TV.dtype))
        return out_TV, None, None, None, None, None, None, None


def _head_weight(weight_VH, compute_dtype):
    """The output weight in the dtype the output layer's matmul runs in (its own unless ``compute_dtype`` says)."""
    return weight_VH if compute_dtype is None or compute_dtype == weight_VH.dtype else weight_VH.to(compute_dtype)


def _output_layer_rows(t: _Targets, hidden_TH, w_VH):
    def read(lo, hi):  # the output layer's matmul, in w_VH's dtype, on the chunk's rows; fp32 result
        return (t.select(hidden_TH, lo, hi).to(w_VH.dtype) @ w_VH.t()).float()

    return read


class _LinearVocabParallelLogprobs(torch.autograd.Function):
    """Logprobs/entropy from hidden states [T, H] and this rank's output weight [V, H]: logits made chunk by chunk,
    never all at once, and made again in the backward."""

    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, rows_M, targets_M, with_entropy, chunk_rows, compute_dtype, temperature,
                softcap):
        _, rank, _ = _tp()
        t = _Targets(rows_M, targets_M, hidden_TH.shape[0], weight_VH.shape[0], rank, chunk_rows, hidden_TH.device)

        scores = _Scores(temperature, softcap)
        read = scores.forward(_output_layer_rows(t, hidden_TH, _head_weight(weight_VH, compute_dtype)))
        logp_M, entropy_M, stats = _forward(read, t, with_entropy, hidden_TH.device)
        ctx.t, ctx.with_entropy, ctx.compute_dtype = t, with_entropy, compute_dtype  # an upcast weight is not kept
        ctx.scores = scores
        ctx.save_for_backward(hidden_TH, weight_VH, *stats)
        return (logp_M, entropy_M) if with_entropy else logp_M

    @staticmethod
    def backward(ctx, grad_logp_M, grad_entropy_M=None):
        hidden_TH, weight_VH, *stats = ctx.saved_tensors
        t = ctx.t
        grad_hidden_TH = torch.zeros_like(hidden_TH) if ctx.needs_input_grad[0] else None
        # Chunks add up in fp32 (the unfused matmul accumulates in fp32 too), then one rounding to the weight's dtype.
        grad_weight_VH = (torch.zeros(weight_VH.shape, dtype=torch.float32, device=weight_VH.device)
                          if ctx.needs_input_grad[1] else None)

        w_VH = _head_weight(weight_VH, ctx.compute_dtype)
        scores = ctx.scores
        read = scores.backward(_output_layer_rows(t, hidden_TH, w_VH))
        for lo, hi, grad_CV in _backward_chunks(read, t, stats, grad_logp_M,
                                                grad_entropy_M if ctx.with_entropy else None):
            g_CV = scores.chain(grad_CV).to(w_VH.dtype)
            if grad_hidden_TH is not None:
                g_CH = (g_CV @ w_VH).to(hidden_TH.dtype)
                if t.dense:
                    grad_hidden_TH[lo:hi] = g_CH
                else:
                    grad_hidden_TH.index_copy_(0, t.U[lo:hi], g_CH)
            if grad_weight_VH is not None:
                grad_weight_VH += g_CV.t() @ t.select(hidden_TH, lo, hi).to(w_VH.dtype)
        if grad_weight_VH is not None:
            grad_weight_VH = grad_weight_VH.to(weight_VH.dtype)
        return grad_hidden_TH, grad_weight_VH, None, None, None, None, None, None, None


def default_chunk_rows(vocab_slice: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    return max(1, chunk_bytes // (4 * max(1, vocab_slice)))


def _check_temperature(temperature, softcap=None) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature <= 2:
        raise ValueError(f"temperature must be in (0, 2], got {temperature!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or
                                not softcap > 0):
        raise ValueError(f"softcap (final logit soft-capping) must be > 0 or None, got {softcap!r}")


def _checked(rows_M, targets_M, num_rows: int, vocab_slice: int, tp: int, chunk_rows: int | None):
    check_targets(rows_M, targets_M, vocab_slice * tp)
    if rows_M.numel() and (int(rows_M.min()) < 0 or int(rows_M.max()) >= num_rows):
        raise ValueError(f"rows must lie in [0, {num_rows}), got [{int(rows_M.min())}, {int(rows_M.max())}]")
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(vocab_slice)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    return rows_M.to(torch.int64), targets_M.to(torch.int64), int(chunk_rows)


def vocab_parallel_logprobs(logits_TV: torch.Tensor, rows_M: torch.Tensor, targets_M: torch.Tensor,
                            with_entropy: bool = False, chunk_rows: int | None = None,
                            inplace_backward: bool = False, temperature: float = 1.0, softcap: float | None = None):
    """(logp_M, entropy_M | None) of ``targets_M`` under rows ``rows_M`` of TP-sharded logits; full-vocab exact.

    ``logits_TV`` is this rank's vocabulary slice (all of it without TP). ``chunk_rows`` bounds the rows processed
    at once (default: ``DEFAULT_CHUNK_BYTES`` of fp32); see the module docstring for ``inplace_backward``,
    ``temperature`` and ``softcap``.
    """
    world, _, _ = _tp()
    _check_temperature(temperature, softcap)
    if logits_TV.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab slice], got {tuple(logits_TV.shape)}")
    rows_M, targets_M, chunk_rows = _checked(rows_M, targets_M, logits_TV.shape[0], logits_TV.shape[-1], world,
                                             chunk_rows)
    out = _VocabParallelLogprobs.apply(logits_TV, rows_M, targets_M, with_entropy, chunk_rows, inplace_backward,
                                       float(temperature), None if softcap is None else float(softcap))
    return out if with_entropy else (out, None)


def linear_vocab_parallel_logprobs(hidden_TH: torch.Tensor, weight_VH: torch.Tensor, rows_M: torch.Tensor,
                                   targets_M: torch.Tensor, with_entropy: bool = False,
                                   chunk_rows: int | None = None, compute_dtype: torch.dtype | None = None,
                                   temperature: float = 1.0, softcap: float | None = None):
    """As :func:`vocab_parallel_logprobs` of ``hidden_TH @ weight_VH.T`` (the output layer fused in), without ever
    holding those logits: each chunk of rows is multiplied out, reduced and dropped, and multiplied out again in the
    backward (one extra output-layer matmul).

    ``weight_VH`` is this TP rank's vocabulary slice of the output weight (``ColumnParallelLinear.weight``, or the
    embedding weight when they are tied); the matmul runs in its dtype, as the output layer's does, or in
    ``compute_dtype`` (``torch.float32``: an fp32 LM head, as SGLang's ``--enable-fp32-lm-head`` on the rollout side;
    MiniMax-M1 traced most of the training/inference probability mismatch of bf16 models to the head's precision).
    The upcast weight exists during the forward and again during the backward, not in between. Under TP the
    hidden states are the same on every rank: their gradient is summed over the TP group here, as
    ``ColumnParallelLinear``'s backward does.
    """
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    world, _, _ = _tp()
    _check_temperature(temperature, softcap)
    if hidden_TH.dim() != 2 or weight_VH.dim() != 2 or hidden_TH.shape[1] != weight_VH.shape[1]:
        raise ValueError(f"hidden must be [rows, H] and weight [vocab slice, H], got {tuple(hidden_TH.shape)} "
                         f"and {tuple(weight_VH.shape)}")
    rows_M, targets_M, chunk_rows = _checked(rows_M, targets_M, hidden_TH.shape[0], weight_VH.shape[0], world,
                                             chunk_rows)
    if world > 1:
        hidden_TH = copy_to_tensor_model_parallel_region(hidden_TH)  # identity forward, all-reduce backward
    out = _LinearVocabParallelLogprobs.apply(hidden_TH, weight_VH, rows_M, targets_M, with_entropy, chunk_rows,
                                             compute_dtype, float(temperature),
                                             None if softcap is None else float(softcap))
    return out if with_entropy else (out, None)


@torch.no_grad()
def vocab_parallel_topk(rows_U: torch.Tensor, k: int, *, targets_U: torch.Tensor | None = None,
                        logits_TV: torch.Tensor | None = None, hidden_TH: torch.Tensor | None = None,
                        weight_VH: torch.Tensor | None = None, vocab_limit: int | None = None,
                        chunk_rows: int | None = None, compute_dtype: torch.dtype | None = None,
                        temperature: float = 1.0, softcap: float | None = None):
    """The ``k`` most likely tokens of each row ``rows_U`` and their log-probabilities under the full (vocabulary-
    parallel) distribution: (ids [U, k] int64, logp [U, k] fp32), most likely first; with ``targets_U`` also the
    log-probability of each row's target [U] as a third output, from the same pass over the logits. Forward only (a
    frozen teacher's top-k for distillation, ``--distill-kl forward|reverse|jsd``).

    Either this rank's logits ``logits_TV`` or the output layer's input ``hidden_TH`` and this rank's output weight
    ``weight_VH`` (fused: logits made chunk by chunk, matmul in ``compute_dtype`` or the weight's dtype), scored as
    :func:`vocab_parallel_logprobs` scores them (``temperature``, ``softcap``). Every column enters the normaliser;
    only ids below ``vocab_limit`` (default: the whole vocabulary) are candidates, so that a padded or untrained
    embedding row of a larger vocabulary never becomes a target. Under TP each rank takes the top-k of its slice;
    one all-gather of k candidates per rank and row and the all-reduces of the log-sum-exp give every rank the
    same result."""
    world, rank, group = _tp()
    _check_temperature(temperature, softcap)
    if (logits_TV is None) == (hidden_TH is None) or (hidden_TH is None) != (weight_VH is None):
        raise ValueError("vocab_parallel_topk takes either logits_TV or hidden_TH with weight_VH")
    if logits_TV is not None:
        num_rows, vocab_slice, device = logits_TV.shape[0], logits_TV.shape[-1], logits_TV.device
    else:
        if hidden_TH.dim() != 2 or weight_VH.dim() != 2 or hidden_TH.shape[1] != weight_VH.shape[1]:
            raise ValueError(f"hidden must be [rows, H] and weight [vocab slice, H], got {tuple(hidden_TH.shape)} "
                             f"and {tuple(weight_VH.shape)}")
        num_rows, vocab_slice, device = hidden_TH.shape[0], weight_VH.shape[0], hidden_TH.device
    vocab = vocab_slice * world
    limit = vocab if vocab_limit is None else int(vocab_limit)
    if not 1 <= k <= min(limit, vocab):
        raise ValueError(f"top-k needs 1 <= k <= {min(limit, vocab)} (the candidate vocabulary), got k={k}")
    rows_U, targets, chunk_rows = _checked(rows_U, torch.zeros_like(rows_U) if targets_U is None else targets_U,
                                           num_rows, vocab_slice, world, chunk_rows)
    t = _Targets(rows_U, targets, num_rows, vocab_slice, rank, chunk_rows, device)
    if logits_TV is not None:
        def read(lo, hi):
            return t.fresh_fp32(logits_TV, lo, hi)
    else:
        read = _output_layer_rows(t, hidden_TH, _head_weight(weight_VH, compute_dtype))
    read = _Scores(temperature, softcap).forward(read)
    n_u = t.U.numel()
    kk = min(k, vocab_slice)  # candidates this rank offers per row
    cand_val = torch.full((n_u, kk), float("-inf"), dtype=torch.float32, device=device)
    cand_id = torch.zeros((n_u, kk), dtype=torch.int64, device=device)
    max_U = torch.empty(n_u, dtype=torch.float32, device=device)
    sum_exp_U = torch.empty_like(max_U)
    first = rank * vocab_slice
    allowed = min(max(limit - first, 0), vocab_slice)  # this slice's columns that may be candidates
    target_M = torch.zeros(t.pos_M.shape, dtype=torch.float32, device=device)
    for lo, hi, m, r in t.chunks():
        z_CV = read(lo, hi)
        target_M[m] = torch.where(t.owned_M[m], z_CV[r, t.local_M[m]], 0.0)
        if allowed > 0:
            v, i = z_CV[:, :allowed].topk(min(kk, allowed), dim=-1)
            cand_val[lo:hi, :v.shape[1]], cand_id[lo:hi, :v.shape[1]] = v, i + first
        m_C = z_CV.max(dim=-1).values
        max_U[lo:hi] = m_C
        sum_exp_U[lo:hi] = z_CV.sub_(m_C[:, None]).exp_().sum(dim=-1)
        del z_CV
    if world > 1:
        local_max_U = max_U.clone()
        dist.all_reduce(max_U, op=dist.ReduceOp.MAX, group=group)
        sum_exp_U *= (local_max_U - max_U).exp()
        dist.all_reduce(sum_exp_U, group=group)
        if targets_U is not None:
            dist.all_reduce(target_M, group=group)
        vals = [torch.empty_like(cand_val) for _ in range(world)]
        ids = [torch.empty_like(cand_id) for _ in range(world)]
        dist.all_gather(vals, cand_val, group=group)
        dist.all_gather(ids, cand_id, group=group)
        cand_val, cand_id = torch.cat(vals, dim=1), torch.cat(ids, dim=1)
    val_UK, pick_UK = cand_val.topk(k, dim=-1)
    lse_U = max_U + sum_exp_U.log()
    # rows asked for more than once get their row's answer each time
    ids, logp = cand_id.gather(1, pick_UK)[t.pos_M], (val_UK - lse_U[:, None])[t.pos_M]
    return (ids, logp) if targets_U is None else (ids, logp, target_M - lse_U[t.pos_M])
