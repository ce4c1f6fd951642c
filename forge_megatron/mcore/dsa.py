"""DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5) over prefix trees, as a Megatron ``core_attention``.

DSA is multi-latent attention in which each query attends only to the ``topk`` keys a small "lightning indexer"
scores highest among the keys it may see. For query i and key j the indexer computes

    I(i, j) = sum_h w_h(i) * relu(scale_I * q^I_h(i) . k^I(j)),   w(i) = W_w x_i / sqrt(H_I),  scale_I = 1 / sqrt(D_I)
    q^I(i) = rope(W_q qr_i)  (H_I heads of D_I),   k^I(j) = rope(LayerNorm(W_k x_j))  (one head of D_I)

with x the attention's input (after the layer's input norm), qr the normalised query latent, RoPE on the first
``qk_pos_emb_head_dim`` channels of each head (DeepSeek-V3.2 rotates the two halves, GLM-5 interleaved pairs). The
main attention then runs over the selected keys only. What is computed here is what transformers' reference
(DeepseekV32Indexer, GlmMoeDsaIndexer) computes, the Hadamard rotation of DeepSeek's FP8 kernels left out as it does
(an orthogonal map: it changes no dot product).

Trees. A key is visible to a query as in tree attention (an ancestor or itself: j <= i < sub_end[j]); the indexer
chooses among the visible keys only, so a tree token selects exactly what it selects in its sample alone, and the
layer still equals every sample trained alone. Ties are broken toward earlier keys (a stable sort; a sample's keys
keep their order in the tree), so even equal scores select the same keys in the tree and alone.

What runs: a query with at most ``topk`` visible keys (a sample's first ``topk`` tokens) selects all of them. The
queries before the first deeper one run the dense tree-attention kernel (the fast backends) over the keys before
them, and the indexer is not evaluated for them; for RL samples shorter than ``topk`` that is the whole layer. Every
later query attends to its selection (a shallow one's: its visible keys) through :class:`_SelectedAttention`: query
chunks scored against the keys up to their last selected one and masked to the selection (memory bounded by the
chunk), probabilities recomputed in the backward pass from the saved log-sum-exp; selections are kept as key indices
(O(queries x topk)). The indexer runs for the deep queries only, in query chunks, without
gradient. A fused sparse kernel (FlashMLA's) is the GPU follow-up; the semantics are these.

Context parallelism: each CP rank holds zig-zag chunks of the padded tree (mcore/context_parallel.py); keys and values
are all-gathered over CP (their gradients reduce-scattered back), so are the indexer's inputs and the depths, and
every local query attends to its selection among the whole tree's keys (a shallow one's: its visible keys; no dense
prefix), whatever the head count.

The indexer's choice is discrete, so the policy loss gives it no gradient: by default it is frozen
(``requires_grad=False``; Adam's weight decay would otherwise shrink it). With ``loss_coeff`` > 0
(``--dsa-indexer-loss-coeff``, Megatron's name) it trains on DeepSeek-V3.2's sparse-stage indexer loss: for each deep
query, KL(p || softmax(I)) over its selected keys, p the main attention's probabilities there summed over all heads
(every TP rank's) and normalised, the mean over the deep queries times the coefficient, added to the step's loss the way
Megatron adds its auxiliary losses (:class:`_AttachLoss`, scaled by 1 / micro-batches); its inputs are detached, so only
the indexer learns from it, and its graph is recomputed chunk by chunk in the backward pass (:class:`_IndexerKL`).
GLM's "shared" layers (``indexer_types``) have no indexer and reuse the selection of the last full layer before them;
it travels with the micro-batch's packed-sequence params (or, in the causal model, the model's forward), so
recomputation and pipelining see their own micro-batch's.

Legend: T = tokens (keys), R = deep query rows, N = heads on this TP rank, H = query/key head dim, Hv = value head
dim, H_I / D_I = indexer heads / head dim, k = topk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# elements of one [N, rows, T] score block (fp32): the query chunk size follows from it
CHUNK_ELEMENTS = 1 << 25


# ------------------------------------------------------------------------------------------------ indexer
def rope_first_channels(x, positions, inv_freq, rope_dim: int, interleaved: bool = False):
    """An indexer's RoPE on the first ``rope_dim`` channels of the last dim of ``x`` ([rows, ..., dim], one position
    per row; HF's layout: rotated channels first): the two halves rotated together (DeepSeek-V3.2, MiniMax-M3), or
    with ``interleaved`` the pairs (0, 1), (2, 3), ... written out halves-first as HF does (GLM-5)."""
    r = rope_dim
    angles = positions.float()[:, None] * inv_freq.to(x.device)[None]  # [rows, r / 2]
    shape = (angles.shape[0],) + (1,) * (x.dim() - 2) + (r // 2,)
    cos, sin = angles.cos().to(x.dtype).view(shape), angles.sin().to(x.dtype).view(shape)
    rot, rest = x[..., :r], x[..., r:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
    else:
        a, b = rot[..., : r // 2], rot[..., r // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)


class DSAIndexer(torch.nn.Module):
    """The lightning indexer of one layer (Megatron-Core's parameter names: ``linear_wq_b``, ``linear_wk``,
    ``k_norm``, ``linear_weights_proj``). Replicated on every TP rank, frozen (see the module docstring)."""

    def __init__(self, hidden_size: int, q_lora_rank: int, heads: int, head_dim: int, rope_dim: int,
                 inv_freq: torch.Tensor, interleaved: bool, eps: float = 1e-6, dtype=torch.float32,
                 trainable: bool = False):
        super().__init__()
        if rope_dim > head_dim or rope_dim % 2:
            raise ValueError(f"the indexer rotates {rope_dim} channels of {head_dim}-channel heads: need an even "
                             "number no larger than the head")
        self.heads, self.head_dim, self.rope_dim, self.interleaved = heads, head_dim, rope_dim, interleaved
        self.linear_wq_b = torch.nn.Linear(q_lora_rank, heads * head_dim, bias=False, dtype=dtype)
        self.linear_wk = torch.nn.Linear(hidden_size, head_dim, bias=False, dtype=dtype)
        self.k_norm = torch.nn.LayerNorm(head_dim, eps=eps, dtype=dtype)
        self.linear_weights_proj = torch.nn.Linear(hidden_size, heads, bias=False, dtype=dtype)
        self.inv_freq = inv_freq.float()
        for p in self.parameters():
            p.requires_grad_(trainable)

    def _rope(self, x, positions):
        return rope_first_channels(x, positions, self.inv_freq, self.rope_dim, self.interleaved)

    def keys(self, x_TD, positions_T):
        """k^I of every token: [T, D_I]."""
        return self._rope(self.k_norm(self.linear_wk(x_TD)), positions_T)

    def scores(self, x_RD, qr_RL, positions_R, keys_TD):
        """I(i, j) of the rows given against every key: fp32 [R, T]."""
        q = self.linear_wq_b(qr_RL).view(qr_RL.shape[0], self.heads, self.head_dim)
        q = self._rope(q, positions_R)
        s = torch.relu(torch.einsum("rhd,td->rht", q.float(), keys_TD.float()) * self.head_dim ** -0.5)
        w = F.linear(x_RD.float(), self.linear_weights_proj.weight.float()) * self.heads ** -0.5
        return torch.einsum("rh,rht->rt", w, s)


    def selected_scores(self, x_RD, qr_RL, positions_R, keys_TD, index_RK):
        """I(i, j) of the rows given against their selected keys only: fp32 [R, K] (differentiable)."""
        q = self._rope(self.linear_wq_b(qr_RL).view(qr_RL.shape[0], self.heads, self.head_dim), positions_R)
        s = torch.relu(torch.einsum("rhd,rkd->rhk", q.float(), keys_TD[index_RK].float()) * self.head_dim ** -0.5)
        w = F.linear(x_RD.float(), self.linear_weights_proj.weight.float()) * self.heads ** -0.5
        return torch.einsum("rh,rhk->rk", w, s)


def select_topk(scores_RT: torch.Tensor, visible_RT: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``topk`` visible keys of highest score in each row (all visible ones if fewer), ties to the earlier key:
    (key indices [R, k], valid [R, k]) with k = min(topk, T); a row with fewer visible keys has its last slots
    invalid."""
    masked = scores_RT.masked_fill(~visible_RT, float("-inf"))
    k = min(topk, scores_RT.shape[1])
    values, index = torch.topk(masked, k, dim=1)
    # topk breaks ties its own way: rows whose k-th score is tied with an unchosen key take the stable order
    threshold = values[:, -1:]
    tied = (masked == threshold).sum(1) > (values == threshold).sum(1)
    if bool(tied.any()):
        index[tied] = torch.sort(masked[tied], dim=1, descending=True, stable=True).indices[:, :k]
    return index, visible_RT.gather(1, index)


# ----------------------------------------------------------------------------------- selected-keys attention
class _SelectedAttention(torch.autograd.Function):
    """o_r = sum_j softmax_j(scale * q_r . k_{index[r, j]}) v_{index[r, j]} over the valid slots of each row. Rows in
    chunks; a chunk scores its queries against the keys up to the last one it selected (BLAS matmuls; the selection
    as a mask: gathering each row's keys was slower on CPU), the probabilities recomputed in the backward pass from
    the saved log-sum-exp. fp32 inside."""

    @staticmethod
    def forward(ctx, q_RNH, k_TNH, v_TNH, index_RK, valid_RK, scale: float, chunk: int, head_sums: bool):
        R, N = q_RNH.shape[:2]
        o = q_RNH.new_empty(R, N, v_TNH.shape[2], dtype=torch.float32)
        lse = q_RNH.new_empty(N, R, dtype=torch.float32)
        # sum over this rank's heads of each row's probabilities at its selected slots (the indexer loss's target)
        p_sum = q_RNH.new_zeros(R, index_RK.shape[1] if head_sums else 0, dtype=torch.float32)
        for a in range(0, R, chunk):
            b = min(R, a + chunk)
            mask, n = _chunk_mask(index_RK[a:b], valid_RK[a:b])
            s = torch.einsum("rnh,tnh->nrt", q_RNH[a:b].float(), k_TNH[:n].float()) * scale
            s = s.masked_fill(~mask[None], float("-inf"))
            lse[:, a:b] = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - lse[:, a:b, None])
            o[a:b] = torch.einsum("nrt,tnh->rnh", p, v_TNH[:n].float())
            if head_sums:
                p_sum[a:b] = p.sum(0).gather(1, index_RK[a:b].clamp(max=n - 1)) * valid_RK[a:b]
        ctx.save_for_backward(q_RNH, k_TNH, v_TNH, index_RK, valid_RK, o, lse)
        ctx.scale, ctx.chunk = scale, chunk
        ctx.mark_non_differentiable(p_sum)
        return o.to(v_TNH.dtype), p_sum

    @staticmethod
    def backward(ctx, do_RNH, _):
        q, k, v, index, valid, o, lse = ctx.saved_tensors
        do = do_RNH.float()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk = torch.zeros_like(k, dtype=torch.float32)
        dv = torch.zeros_like(v, dtype=torch.float32)
        delta = (do * o).sum(-1).transpose(0, 1)  # [N, R]
        for a in range(0, q.shape[0], ctx.chunk):
            b = min(q.shape[0], a + ctx.chunk)
            mask, n = _chunk_mask(index[a:b], valid[a:b])
            qf, kf, vf = q[a:b].float(), k[:n].float(), v[:n].float()
            s = torch.einsum("rnh,tnh->nrt", qf, kf) * ctx.scale
            p = torch.exp(s.masked_fill(~mask[None], float("-inf")) - lse[:, a:b, None])
            dv[:n] += torch.einsum("nrt,rnh->tnh", p, do[a:b])
            ds = p * (torch.einsum("rnh,tnh->nrt", do[a:b], vf) - delta[:, a:b, None]) * ctx.scale
            dq[a:b] = torch.einsum("nrt,tnh->rnh", ds, kf)
            dk[:n] += torch.einsum("nrt,rnh->tnh", ds, qf)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def _chunk_mask(index_rK: torch.Tensor, valid_rK: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(boolean [r, n] of the selected keys, n = 1 + the last key selected) of a chunk of rows."""
    n = int(index_rK[valid_rK].max()) + 1
    mask = torch.zeros(index_rK.shape[0], n + 1, dtype=torch.bool, device=index_rK.device)
    mask.scatter_(1, torch.where(valid_rK, index_rK, n), True)
    return mask[:, :n], n


def selected_attention(q_RNH, k_TNH, v_TNH, index_RK, valid_RK, scale: float, head_sums: bool = False):
    """Attention of R query rows over their selected keys (``index_RK``, slots marked ``valid_RK``; every row has
    one). With ``head_sums`` also (not differentiable) each row's probabilities at its slots summed over the heads,
    [R, K]: (output, sums)."""
    T, N = k_TNH.shape[:2]
    chunk = max(1, CHUNK_ELEMENTS // max(1, N * T))
    out, sums = _SelectedAttention.apply(q_RNH, k_TNH, v_TNH, index_RK, valid_RK, scale, chunk, head_sums)
    return (out, sums) if head_sums else out


# ------------------------------------------------------------------------------------------- indexer loss
class _IndexerKL(torch.autograd.Function):
    """mean over rows of KL(target_r || softmax(I(r, selected keys))): the indexer's training loss (DeepSeek-V3.2's
    sparse stage: over each row's selected keys). The loss graph is never kept: the backward pass recomputes it row
    chunk by row chunk (the indexer's keys once) and returns the parameters' gradients."""

    @staticmethod
    def forward(ctx, indexer, x_TD, qr_TL, positions_T, rows_R, index_RK, valid_RK, target_RK, chunk, *params):
        with torch.no_grad():
            keys = indexer.keys(x_TD, positions_T)
            loss = sum(_kl_sum(indexer, x_TD, qr_TL, positions_T, keys, rows_R[a:a + chunk], index_RK[a:a + chunk],
                               valid_RK[a:a + chunk], target_RK[a:a + chunk])
                       for a in range(0, rows_R.numel(), chunk)) / rows_R.numel()
        ctx.indexer, ctx.chunk = indexer, chunk
        ctx.save_for_backward(x_TD, qr_TL, positions_T, rows_R, index_RK, valid_RK, target_RK)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        x_TD, qr_TL, positions_T, rows_R, index_RK, valid_RK, target_RK = ctx.saved_tensors
        indexer, chunk = ctx.indexer, ctx.chunk
        params = list(indexer.parameters())
        grads = [torch.zeros_like(p) for p in params]
        with torch.enable_grad():
            keys = indexer.keys(x_TD, positions_T)
            keys_leaf = keys.detach().requires_grad_()
            d_keys = torch.zeros_like(keys_leaf)
            for a in range(0, rows_R.numel(), chunk):
                part = _kl_sum(indexer, x_TD, qr_TL, positions_T, keys_leaf, rows_R[a:a + chunk],
                               index_RK[a:a + chunk], valid_RK[a:a + chunk], target_RK[a:a + chunk])
                got = torch.autograd.grad(part * (grad_loss / rows_R.numel()), params + [keys_leaf],
                                          allow_unused=True)
                for g, d in zip(grads, got[:-1]):
                    if d is not None:
                        g += d
                d_keys += got[-1]
            got = torch.autograd.grad(keys, params, d_keys, allow_unused=True)
        for g, d in zip(grads, got):
            if d is not None:
                g += d
        return (None,) * 9 + tuple(grads)


def _kl_sum(indexer, x_TD, qr_TL, positions_T, keys_TD, rows, index, valid, target):
    """sum over ``rows`` of KL(target || softmax of the indexer's scores at the selected slots)."""
    scores = indexer.selected_scores(x_TD[rows], qr_TL[rows], positions_T[rows], keys_TD, index)
    log_q = torch.log_softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
    return (torch.xlogy(target, target) - target * log_q.masked_fill(~valid, 0.0)).sum()


class _AttachLoss(torch.autograd.Function):
    """Returns ``output`` unchanged; in the backward pass the attached ``loss`` gets ``scale`` as its gradient (the
    indexer loss trains alongside the policy loss: Megatron's auxiliary-loss pattern)."""

    @staticmethod
    def forward(ctx, output, loss, scale: float):
        ctx.scale = scale
        ctx.save_for_backward(loss)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(loss, ctx.scale), None


# what the indexer losses of a step scale by (the trainer sets 1 / micro-batches, as Megatron scales its auxiliary
# losses) and the losses computed since the trainer last read them (detached): set_indexer_loss_scale and
# pop_indexer_losses
_LOSS_SCALE = [1.0]
_LOSSES: list[torch.Tensor] = []


def set_indexer_loss_scale(scale: float) -> None:
    _LOSS_SCALE[0] = float(scale)


def pop_indexer_losses() -> list[float]:
    """The indexer losses (KL, before the coefficient) computed since the last call, one per layer and micro-batch."""
    out = [float(x) for x in _LOSSES]
    _LOSSES.clear()
    return out


# ----------------------------------------------------------------------------------------- core attention
def gather_sequence(t: torch.Tensor, config) -> torch.Tensor:
    """``t`` (an indexer's input, no gradient) whole: under sequence parallelism each TP rank holds a slice of the
    tokens, and an indexer needs all of them."""
    if not config.sequence_parallel or config.tensor_model_parallel_size == 1:
        return t
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=0)


def gather_keys_over_cp(q_TlNH, k_TlXH, v_TlXH, sub_end_T):
    """Under context parallelism (this CP rank holds the zig-zag chunks of the padded tree, as
    mcore/context_parallel.py shards them): (the tree positions of this rank's query rows, the whole tree's keys,
    its values), the keys and values all-gathered in tree order (their gradients reduce-scattered back to the ranks
    holding them)."""
    from forge_megatron.mcore.context_parallel import (
        _GatherSeq, cp_world, default_multiple, ranks_to_tree_order, shard_positions)

    C, rank, group = cp_world()
    T, Tl = sub_end_T.shape[0], q_TlNH.shape[0]
    if T != C * Tl:
        raise ValueError(f"CP rank holds {Tl} tokens but sub_end has {T} (expected {C} x {Tl}): shard the "
                         "micro-batch with forge_megatron.mcore.forward.tree_model_inputs")
    rows = shard_positions(T, C, rank, default_multiple(C), device=q_TlNH.device)
    return (rows, ranks_to_tree_order(_GatherSeq.apply(k_TlXH, group), C),
            ranks_to_tree_order(_GatherSeq.apply(v_TlXH, group), C))


def check_causal_model(packed_seq_params, attention_mask, s: int, device, what: str) -> None:
    """What a sparse attention (``what``) takes outside a tree: no other packed sequences, no context parallelism, and
    Megatron's causal mask or none over its [s, b] samples (one per batch row)."""
    from forge_megatron.mcore.context_parallel import cp_world

    if packed_seq_params is not None:
        raise ValueError(f"{what} takes tree-packed sequences (TreePackedSeqParams) or none")
    if cp_world()[0] > 1:
        raise ValueError(f"{what} under context parallelism needs tree-packed sequences (the causal model is not "
                         "sharded)")
    if attention_mask is not None and not torch.equal(
            attention_mask.reshape(-1, s, s), torch.ones(s, s, dtype=torch.bool, device=device)
            .triu(1).expand(attention_mask.reshape(-1, s, s).shape)):
        raise ValueError(f"{what}'s causal model takes the causal mask only (padding: pack the samples as a tree)")


class SparseTreeAttention(torch.nn.Module):
    """``core_attention`` of a DSA layer (DeepSeek-V3.2, GLM-5) for Megatron's multi-latent attention, in the tree
    model (TreePackedSeqParams: the mask is the tree) and in the plain causal one (no packed params). Megatron's MLA
    hands it the attention's input ``x`` and the query latent ``qr`` when the config's
    ``experimental_attention_variant`` is "dsa" (model.transformer_config sets it).

    Spec params (model.layer_spec): ``topk``, ``index_heads``, ``index_head_dim``, ``inv_freq`` (the layer's RoPE
    frequencies), ``interleaved`` (the indexer's RoPE pairs), ``shared_layers`` (True where a layer reuses the
    previous full layer's selection), ``eps``."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, k_channels: int | None = None,
                 v_channels: int | None = None, *, topk: int, index_heads: int, index_head_dim: int,
                 inv_freq: torch.Tensor, interleaved: bool = False, shared_layers: tuple[bool, ...] | None = None,
                 eps: float = 1e-6, loss_coeff: float = 0.0):
        super().__init__()
        if (attention_dropout if attention_dropout is not None else config.attention_dropout):
            raise ValueError("DeepSeek sparse attention has no attention dropout; set attention_dropout=0")
        self.config = config
        self.layer_number = layer_number
        self.topk = int(topk)
        if softmax_scale is None:
            softmax_scale = getattr(config, "softmax_scale", None) or (k_channels or config.kv_channels) ** -0.5
        self.softmax_scale = softmax_scale
        self.shared = bool(shared_layers and shared_layers[layer_number - 1])
        self.loss_coeff = float(loss_coeff)
        self.indexer = None if self.shared else DSAIndexer(
            config.hidden_size, config.q_lora_rank, index_heads, index_head_dim, config.qk_pos_emb_head_dim,
            inv_freq, interleaved, eps=eps, dtype=config.params_dtype, trainable=self.loss_coeff > 0)
        # the full layer whose selection a shared layer reuses: the last layer before it with an indexer
        self.source_layer = max((n for n in range(1, layer_number) if not shared_layers[n - 1]), default=None) \
            if self.shared else None
        # the causal model's selections (batch row -> layer number -> selection); build_gpt gives every DSA layer of
        # a model one store (share_selection_store)
        self.selection_store: dict = {}

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, x=None, qr=None, **unused):
        from forge_megatron.mcore.tree_attention import TreePackedSeqParams

        if x is None or qr is None:
            raise ValueError("DeepSeek sparse attention needs the attention's input and query latent: build the model "
                             "through forge_megatron.mcore.model (experimental_attention_variant='dsa'), and do not "
                             "recompute core attention alone (recompute whole layers instead)")
        if attention_bias is not None:
            raise ValueError("DeepSeek sparse attention takes no attention_bias")
        from forge_megatron.mcore.context_parallel import cp_world

        x, qr = gather_sequence(x, self.config), gather_sequence(qr, self.config)
        if isinstance(packed_seq_params, TreePackedSeqParams):
            if query.dim() == 4:
                query, key, value = query[:, 0], key[:, 0], value[:, 0]
            sub_end = packed_seq_params.sub_end.to(query.device)
            positions = packed_seq_params.position_ids.to(query.device)
            x, qr = x.reshape(query.shape[0], -1), qr.reshape(query.shape[0], -1)
            if cp_world()[0] > 1:
                return self._attend_cp(query, key, value, x, qr, sub_end, positions,
                                       packed_seq_params).reshape(query.shape[0], 1, -1)
            return self._attend(query, key, value, x, qr, sub_end, positions, packed_seq_params,
                                packed_seq_params.backend).reshape(query.shape[0], 1, -1)
        # the causal model: [s, b, heads, dim], one sample per batch row
        s, b = query.shape[:2]
        check_causal_model(packed_seq_params, attention_mask, s, query.device, "DeepSeek sparse attention")
        x, qr = x.reshape(s, b, -1), qr.reshape(s, b, -1)
        sub_end = torch.full((s,), s, dtype=torch.int32, device=query.device)
        positions = torch.arange(s, device=query.device)
        outs = [self._attend(query[:, i], key[:, i], value[:, i], x[:, i], qr[:, i], sub_end, positions,
                             self.selection_store.setdefault(i, {}), None) for i in range(b)]
        return torch.stack(outs, dim=1).reshape(s, b, -1)

    def _attend(self, q_TNH, k_TNH, v_TNH, x_TD, qr_TL, sub_end_T, positions_T, carrier, backend):
        """Queries before the first one deeper than topk (all shallow: every visible key selected) run the dense
        tree-attention kernel on the keys before them; every later query attends to its selection (a shallow one's
        selection is all its visible keys)."""
        from forge_megatron.kernels.tree_attention import tree_attention

        T = q_TNH.shape[0]
        deep = positions_T >= self.topk
        first = int(torch.argmax(deep.int())) if bool(deep.any()) else T
        if first == T:
            return tree_attention(q_TNH, k_TNH, v_TNH, sub_end_T, softmax_scale=self.softmax_scale, backend=backend)
        out = []
        if first:
            out.append(tree_attention(q_TNH[:first], k_TNH[:first], v_TNH[:first], sub_end_T[:first].clamp(max=first),
                                      softmax_scale=self.softmax_scale, backend=backend))
        x_TD, qr_TL = x_TD.detach(), qr_TL.detach()
        rows = torch.arange(first, T, device=q_TNH.device)
        return torch.cat(out + [self._sparse(q_TNH[first:], k_TNH, v_TNH, rows, deep, sub_end_T, x_TD, qr_TL,
                                             positions_T, carrier)])

    def _attend_cp(self, q_TlNH, k_TlNH, v_TlNH, x_TlD, qr_TlL, sub_end_T, positions_Tl, carrier):
        """Under context parallelism (this CP rank holds the zig-zag chunks of the padded tree's tokens, as
        mcore/context_parallel.py shards them): keys and values are all-gathered over CP (in tree order; the
        backward reduce-scatters their gradients back to the ranks holding them), and so are the indexer's inputs
        and the tokens' depths (no gradient); each local query then attends to its selection (a shallow one's: its
        visible keys) among the whole tree's keys. Any head count (the all_gather way of CP)."""
        from forge_megatron.mcore.context_parallel import _gather_tree_order, cp_world, gather_tree

        group = cp_world()[2]
        rows, k_TNH, v_TNH = gather_keys_over_cp(q_TlNH, k_TlNH, v_TlNH, sub_end_T)
        x_TD = _gather_tree_order(x_TlD.detach(), group)
        qr_TL = _gather_tree_order(qr_TlL.detach(), group)
        positions_T = gather_tree(positions_Tl, group)
        return self._sparse(q_TlNH, k_TNH, v_TNH, rows, positions_T >= self.topk, sub_end_T, x_TD, qr_TL,
                            positions_T, carrier)

    def _sparse(self, q_RNH, k_TNH, v_TNH, rows_R, deep_T, sub_end_T, x_TD, qr_TL, positions_T, carrier):
        """The queries at tree positions ``rows_R`` attending to their selections (with the indexer loss attached
        when it trains)."""
        index, valid = self._select(rows_R, deep_T, sub_end_T, x_TD, qr_TL, positions_T, carrier)
        train_indexer = self.indexer is not None and self.loss_coeff > 0 and self.training and torch.is_grad_enabled()
        sparse = selected_attention(q_RNH, k_TNH, v_TNH, index, valid, self.softmax_scale, head_sums=train_indexer)
        if train_indexer:
            sparse = self._with_indexer_loss(*sparse, rows_R, deep_T, index, valid, x_TD, qr_TL, positions_T)
        return sparse.to(v_TNH.dtype)

    def _with_indexer_loss(self, sparse, head_sums, rows_R, deep_T, index, valid, x_TD, qr_TL, positions_T):
        """``sparse`` with the indexer loss attached (--dsa-indexer-loss-coeff): over the deep rows, KL from the main
        attention's probabilities at the selected keys (summed over all heads, every TP rank's, and normalised) to the
        indexer's softmax over them; the loss's gradient reaches the indexer only (its inputs are detached).

        Under context parallelism the deep rows are spread over the CP ranks: each attaches its rows' share of the
        mean over all of them (their KL sum over the CP group's deep-row count), times CP, as the gradients of
        every CP rank are averaged where the shares must add up (Megatron multiplies the main loss by CP for the
        same reason); the logged KL is the group's mean."""
        from forge_megatron.mcore.context_parallel import cp_world

        rel = torch.nonzero(deep_T[rows_R]).flatten()
        target = head_sums[rel]
        if self.config.tensor_model_parallel_size > 1:  # each TP rank holds some of the heads
            from megatron.core import parallel_state as ps

            torch.distributed.all_reduce(target, group=ps.get_tensor_model_parallel_group())
        target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
        chunk = max(1, CHUNK_ELEMENTS // max(1, self.indexer.heads * index.shape[1]))
        C, _, group = cp_world()
        loss = _IndexerKL.apply(self.indexer, x_TD, qr_TL, positions_T, rows_R[rel], index[rel], valid[rel], target,
                                chunk, *self.indexer.parameters()) if rel.numel() else None
        if C == 1:
            if loss is None:
                return sparse
            _LOSSES.append(loss.detach())
            return _AttachLoss.apply(sparse, loss * self.loss_coeff, _LOSS_SCALE[0])
        from forge_megatron.mcore.parallel import comm_device

        local = float(loss.detach()) * rel.numel() if loss is not None else 0.0
        stats = torch.tensor([local, float(rel.numel())], dtype=torch.float64, device=comm_device(group))
        torch.distributed.all_reduce(stats, group=group)
        total, rows = stats.tolist()
        if rows:
            _LOSSES.append(torch.tensor(total / rows))
        if loss is None:
            return sparse
        return _AttachLoss.apply(sparse, loss * (self.loss_coeff * rel.numel() / rows * C), _LOSS_SCALE[0])

    @torch.no_grad()
    def _select(self, rows_R, deep_T, sub_end_T, x_TD, qr_TL, positions_T, carrier):
        """(key indices, valid) [R, k] of the queries at tree positions ``rows_R``: a deep one's topk by its indexer
        scores, a shallow one's visible keys; shared layers take the last full layer's."""
        store = carrier.__dict__.setdefault("_dsa_selections", {}) if not isinstance(carrier, dict) else carrier
        if self.shared:
            if self.source_layer not in store:
                raise ValueError(f"layer {self.layer_number} reuses the indexer selection of layer "
                                 f"{self.source_layer}, which did not run before it on this rank (pipeline stages "
                                 "must keep a shared DSA layer with the full layer before it)")
            return store[self.source_layer]
        T = sub_end_T.shape[0]
        keys = self.indexer.keys(x_TD, positions_T)
        key_index = torch.arange(T, device=sub_end_T.device)
        sub_end = sub_end_T.long()
        chunk = max(1, CHUNK_ELEMENTS // max(1, self.indexer.heads * T))
        indices, valids = [], []
        for a in range(0, rows_R.numel(), chunk):
            r = rows_R[a:a + chunk]
            visible = (key_index[None, :] <= r[:, None]) & (r[:, None] < sub_end[None, :])
            scores = torch.zeros(r.numel(), T, dtype=torch.float32, device=r.device)
            rows = torch.nonzero(deep_T[r]).flatten()  # shallow rows select every visible key: no scores needed
            if rows.numel():
                scores[rows] = self.indexer.scores(x_TD[r[rows]], qr_TL[r[rows]], positions_T[r[rows]], keys)
            index, valid = select_topk(scores, visible, self.topk)
            indices.append(index)
            valids.append(valid)
        chosen = torch.cat(indices), torch.cat(valids)
        store[self.layer_number] = chosen
        return chosen


def dsa_spec_params(cfg) -> dict:
    """The :class:`SparseTreeAttention` spec params of a GPTConfig with DSA."""
    from forge_megatron.mcore import rope

    return dict(topk=cfg.dsa_index_topk, index_heads=cfg.dsa_index_heads, index_head_dim=cfg.dsa_index_head_dim,
                inv_freq=rope.inv_freq(cfg.rope_scaling, cfg.rotary_base, cfg.qk_pos_emb_head_dim),
                interleaved=cfg.dsa_rope_interleaved, shared_layers=cfg.dsa_shared_layers, eps=1e-6,
                loss_coeff=cfg.dsa_indexer_loss_coeff)


def share_selection_store(model) -> None:
    """One selection store for every DSA layer of ``model`` (the causal model's shared layers read it)."""
    store: dict = {}
    for module in model.modules():
        if isinstance(module, SparseTreeAttention):
            module.selection_store = store
