"""MiniMax-M3's block-sparse attention over prefix trees, as a Megatron ``core_attention``.

In the layers MiniMax-M3 marks ``minimax_m3_sparse`` a small "lightning indexer" chooses, per query and per key head
(GQA group), which *blocks* of keys the query may attend to. For query i at position p (its depth in the tree) and
key j at position p_j, indexer head h (one per key head) scores

    s_h(i, j) = q^I_h(i) . k^I(j),   q^I = rope(RMSNorm(W_q x)) (H_I heads of D_I),   k^I = rope(RMSNorm(W_k x)),

both norms scaling by (1 + weight), RoPE on the same first channels the attention rotates. A block is ``block_size``
consecutive positions; block b's score is the largest s_h(i, j) over the keys j the query sees with p_j // block_size
== b. The ``local_blocks`` blocks ending at the query's own (p // block_size, and the ones before it) always win; of
the others the query keeps the best until it holds ``topk_blocks`` blocks. Query heads of group h then attend to the
keys they see in the kept blocks only (the usual causal softmax, scale head_dim ** -0.5). This is what transformers'
MiniMaxM3VLIndexer and its block mask compute.

Trees. Blocks are cut by *position* (depth), not by place in the packed sequence: a key is in block p_j //
block_size whatever else the tree holds, and a query sees its ancestors only (j <= i < sub_end[j]), which are the
tokens of its own sample. So a tree token selects exactly the blocks it selects alone, and the layer equals every
sample trained alone (transformers anchors blocks to cache slots, which are positions for an unpadded sample).

What runs: a query whose position is below ``topk_blocks * block_size`` sees at most ``topk_blocks`` blocks and keeps
them all: plain tree attention. The queries before the first deeper one (in tree order) run the tree-attention
kernel (the fast backends; for RL samples shorter than 2048 tokens, MiniMax-M3's 16 blocks of 128, the whole layer,
context parallelism included). Every later query runs the block-sparse path here: in chunks of queries, the indexer
scores (no gradient), then the attention, recomputed chunk by chunk in the backward pass (memory bounded by the
chunk): over the kept blocks' keys gathered (a query's key at position d is its ancestor of depth d) where they are
few against the keys before the chunk, else over those keys masked to the kept blocks (:data:`GATHER_KEYS`). A fused
block-sparse kernel is the GPU follow-up; the semantics are these. Under context parallelism a tree without deep
queries takes TreeAttention's CP path; otherwise keys, values, indexer inputs and depths are all-gathered over CP.

The indexer's choice is discrete and transformers trains it by nothing: it is frozen (``requires_grad=False``).
Megatron's attention does not hand core attention the layer's input, so the sparse layers' self-attention is
:class:`IndexedSelfAttention`, which lends it for the forward (the core attention gathers it under sequence
parallelism).

Legend: T = tokens (keys), R = query rows, N = query heads on this TP rank, K = key heads on this TP rank, H = head
dim, B = block size, NB = blocks, H_I / D_I = indexer heads (all key heads) / head dim.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.attention import SelfAttention
from torch.utils.checkpoint import checkpoint

from forge_megatron.mcore.dsa import check_causal_model, gather_keys_over_cp, gather_sequence, rope_first_channels
from forge_megatron.mcore.model import ZeroCenteredRMSNorm

# elements of one [N, rows, T] score block (fp32): the query chunk size follows from it
CHUNK_ELEMENTS = 1 << 25
# the deep queries' attention: over their kept blocks' keys gathered (True), over every key before them masked
# (False), or None: gathered when the kept keys are at most a sixteenth of those (benchmarks/block_sparse.py: on CPU
# the gathers cost more than they save above that)
GATHER_KEYS: bool | None = None


class BlockIndexer(torch.nn.Module):
    """The lightning indexer of one MiniMax-M3 sparse layer (``q_proj`` [H_I * D_I, D], ``k_proj`` [D_I, D],
    ``q_norm``, ``k_norm``): replicated on every TP rank, frozen."""

    def __init__(self, hidden_size: int, heads: int, head_dim: int, inv_freq: torch.Tensor, eps: float, dtype):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.rope_dim = min(2 * inv_freq.numel(), head_dim)
        self.q_proj = torch.nn.Linear(hidden_size, heads * head_dim, bias=False, dtype=dtype)
        self.k_proj = torch.nn.Linear(hidden_size, head_dim, bias=False, dtype=dtype)
        self.q_norm = ZeroCenteredRMSNorm(head_dim, eps).to(dtype)  # ((1 + w) norms in fp32, as transformers')
        self.k_norm = ZeroCenteredRMSNorm(head_dim, eps).to(dtype)
        self.inv_freq = inv_freq.float()[: self.rope_dim // 2]
        for p in self.parameters():
            p.requires_grad_(False)

    def _rope(self, x, positions):
        return rope_first_channels(x, positions, self.inv_freq, self.rope_dim)

    def keys(self, x_TD, positions_T):
        """k^I [T, D_I] (fp32)."""
        return self._rope(self.k_norm(self.k_proj(x_TD)), positions_T).float()

    def queries(self, x_RD, positions_R, heads: slice):
        """q^I [R, heads, D_I] (fp32) of the indexer heads ``heads`` (this TP rank's key heads)."""
        w = self.q_proj.weight.view(self.heads, self.head_dim, -1)[heads].reshape(-1, x_RD.shape[-1])
        q = torch.nn.functional.linear(x_RD, w).view(x_RD.shape[0], -1, self.head_dim)
        return self._rope(self.q_norm(q), positions_R).float()


class IndexedSelfAttention(SelfAttention):
    """Megatron's SelfAttention lending its input to its core attention for the forward (the indexer reads it)."""

    def forward(self, hidden_states, *args, **kwargs):
        self.core_attention.index_input = hidden_states
        try:
            return super().forward(hidden_states, *args, **kwargs)
        finally:
            self.core_attention.index_input = None


def _masked_attention(q_RNH, k_TKH, v_TKH, keep_KRT, scale: float):
    """Softmax attention of queries ``q_RNH`` over the keys ``keep_KRT`` keeps for their key head's group."""
    R, N, _ = q_RNH.shape
    K = k_TKH.shape[1]
    q = q_RNH.float().view(R, K, N // K, -1)
    scores = torch.einsum("rkgh,tkh->kgrt", q, k_TKH.float()) * scale
    scores = scores.masked_fill(~keep_KRT[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("kgrt,tkh->rkgh", probs, v_TKH.float())
    return out.reshape(R, N, -1).to(v_TKH.dtype)


class BlockSparseAttention(torch.nn.Module):
    """``core_attention`` of a MiniMax-M3 sparse layer in the tree model (TreePackedSeqParams: the mask is the tree)
    and in the plain causal one (no packed params). Spec params (model.layer_spec): ``index_heads``,
    ``index_head_dim``, ``block_size``, ``topk_blocks``, ``local_blocks``, ``inv_freq`` (the attention's RoPE
    frequencies), ``eps``."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, k_channels: int | None = None,
                 v_channels: int | None = None, *, index_heads: int, index_head_dim: int, block_size: int,
                 topk_blocks: int, local_blocks: int, inv_freq: torch.Tensor, eps: float = 1e-6):
        super().__init__()
        if (attention_dropout if attention_dropout is not None else config.attention_dropout):
            raise ValueError("block-sparse attention has no attention dropout; set attention_dropout=0")
        self.config = config
        self.layer_number = layer_number
        if softmax_scale is None:
            softmax_scale = getattr(config, "softmax_scale", None) or (k_channels or config.kv_channels) ** -0.5
        self.softmax_scale = softmax_scale
        self.block_size, self.topk_blocks, self.local_blocks = int(block_size), int(topk_blocks), int(local_blocks)
        if index_heads != config.num_query_groups:
            raise ValueError(f"block-sparse attention: {index_heads} indexer heads for {config.num_query_groups} key "
                             "heads (one selection per key head)")
        self.indexer = BlockIndexer(config.hidden_size, index_heads, index_head_dim, inv_freq, eps,
                                    config.params_dtype)
        tp = config.tensor_model_parallel_size
        if config.num_query_groups % tp:
            raise ValueError(f"block-sparse attention: tensor parallelism {tp} must divide the "
                             f"{config.num_query_groups} key heads")
        self.local_groups = config.num_query_groups // tp
        self.index_input = None  # set by IndexedSelfAttention for the forward
        from forge_megatron.mcore.tree_attention import TreeAttention

        # context parallelism over a tree without deep queries: plain tree attention (no parameters of its own)
        self.dense = TreeAttention(config, layer_number, attn_mask_type, attention_type,
                                   softmax_scale=self.softmax_scale, cp_comm_type=cp_comm_type)

    def _group_slice(self) -> slice:
        from megatron.core import parallel_state as ps

        rank = ps.get_tensor_model_parallel_rank() if self.config.tensor_model_parallel_size > 1 else 0
        return slice(rank * self.local_groups, (rank + 1) * self.local_groups)

    def _input(self):
        x = self.index_input
        if x is None:
            raise ValueError("block-sparse attention needs the layer's input: build the model through "
                             "forge_megatron.mcore.model (IndexedSelfAttention), and do not recompute core attention "
                             "alone (recompute whole layers instead)")
        return gather_sequence(x.detach(), self.config)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **unused):
        from forge_megatron.mcore.context_parallel import cp_world
        from forge_megatron.mcore.tree_attention import TreePackedSeqParams

        if attention_bias is not None:
            raise ValueError("block-sparse attention takes no attention_bias")
        x = self._input()
        deep_from = self.topk_blocks * self.block_size  # the first position that may drop a block
        if isinstance(packed_seq_params, TreePackedSeqParams):
            if query.dim() == 4:
                query, key, value = query[:, 0], key[:, 0], value[:, 0]
            T = query.shape[0]
            sub_end = packed_seq_params.sub_end.to(query.device)
            positions = packed_seq_params.position_ids.to(query.device).reshape(-1)
            if cp_world()[0] > 1:
                return self._attend_cp(query, key, value, x.reshape(T, -1), sub_end, positions, packed_seq_params,
                                       deep_from)
            out = self._attend(query, key, value, x.reshape(T, -1), sub_end, positions, packed_seq_params.backend)
            return out.reshape(T, 1, -1)
        s, b = query.shape[:2]  # the causal model: one sample per batch row
        check_causal_model(packed_seq_params, attention_mask, s, query.device, "block-sparse attention")
        x = x.reshape(s, b, -1)
        sub_end = torch.full((s,), s, dtype=torch.int32, device=query.device)
        positions = torch.arange(s, device=query.device)
        outs = [self._attend(query[:, i], key[:, i], value[:, i], x[:, i], sub_end, positions, None)
                for i in range(b)]
        return torch.stack(outs, dim=1).reshape(s, b, -1)

    def _attend_cp(self, q_TlNH, k_TlKH, v_TlKH, x_TlD, sub_end_T, positions_Tl, params, deep_from):
        """Context parallelism (this CP rank holds the zig-zag chunks of the padded tree, as mcore/context_parallel.py
        shards them). A tree without deep queries is plain tree attention (TreeAttention's CP path); otherwise keys
        and values are all-gathered over CP in tree order (their gradients reduce-scattered back to the ranks holding
        them), so are the indexer's inputs and the depths, and each local query attends to the keys of its blocks
        among the whole tree's."""
        from forge_megatron.mcore.context_parallel import _gather_tree_order, cp_world, gather_tree

        group = cp_world()[2]
        positions_T = gather_tree(positions_Tl, group)
        if int(positions_T.max()) < deep_from:
            return self.dense(q_TlNH[:, None], k_TlKH[:, None], v_TlKH[:, None], None, packed_seq_params=params)
        rows, k_TKH, v_TKH = gather_keys_over_cp(q_TlNH, k_TlKH, v_TlKH, sub_end_T)
        x_TD = _gather_tree_order(x_TlD, group)
        return self._sparse(q_TlNH, k_TKH, v_TKH, rows, x_TD, sub_end_T, positions_T).reshape(q_TlNH.shape[0], 1, -1)

    def _attend(self, q_TNH, k_TKH, v_TKH, x_TD, sub_end_T, positions_T, backend):
        """Queries before the first deep one run the tree-attention kernel on the keys before them; every later
        query attends to the keys of its blocks."""
        from forge_megatron.kernels.tree_attention import tree_attention

        T = q_TNH.shape[0]
        deep = positions_T >= self.topk_blocks * self.block_size
        first = int(torch.argmax(deep.int())) if bool(deep.any()) else T
        if first == T:
            return tree_attention(q_TNH, k_TKH, v_TKH, sub_end_T, softmax_scale=self.softmax_scale, backend=backend)
        out = []
        if first:
            out.append(tree_attention(q_TNH[:first], k_TKH[:first], v_TKH[:first], sub_end_T[:first].clamp(max=first),
                                      softmax_scale=self.softmax_scale, backend=backend))
        rows = torch.arange(first, T, device=q_TNH.device)
        return torch.cat(out + [self._sparse(q_TNH[first:], k_TKH, v_TKH, rows, x_TD, sub_end_T, positions_T)])

    def _sparse(self, q_RNH, k_TKH, v_TKH, rows_R, x_TD, sub_end_T, positions_T):
        """The queries at tree positions ``rows_R`` (ascending) attending to the keys of their blocks, in chunks of
        queries (each recomputed in the backward pass): over the kept blocks' keys gathered (when they are at most a
        sixteenth of the keys before the chunk: :data:`GATHER_KEYS`), else over every key before it, masked."""
        keys_TD = self.indexer.keys(x_TD, positions_T)
        groups = self._group_slice()
        chunk = max(1, CHUNK_ELEMENTS // max(1, q_RNH.shape[1] * keys_TD.shape[0]))
        kept_keys = self.topk_blocks * self.block_size
        out = []
        for a in range(0, rows_R.numel(), chunk):
            rows = rows_R[a:a + chunk]
            end = int(rows.max()) + 1  # a query's keys are its ancestors: before it in the tree
            chosen, valid, visible = self._select(rows, x_TD[rows], keys_TD[:end], sub_end_T[:end], positions_T,
                                                  groups)
            gather = GATHER_KEYS if GATHER_KEYS is not None else 16 * kept_keys <= end
            if gather:
                index, keep = self._block_keys(rows, chosen, valid, visible, positions_T)
                fn, args = _gathered_attention, (q_RNH[a:a + chunk], k_TKH, v_TKH, index, keep, self.softmax_scale)
            else:
                key_block = (positions_T[:end] // self.block_size).long()
                kept = torch.zeros((*chosen.shape[:2], int(key_block.max()) + 1), dtype=torch.bool,
                                   device=chosen.device)
                kept.scatter_(-1, chosen.clamp(max=kept.shape[-1] - 1), valid & (chosen < kept.shape[-1]))
                keep = kept.gather(-1, key_block.expand(*chosen.shape[:2], end)) & visible[None]
                fn, args = _masked_attention, (q_RNH[a:a + chunk], k_TKH[:end], v_TKH[:end], keep, self.softmax_scale)
            out.append(checkpoint(fn, *args, use_reentrant=False) if torch.is_grad_enabled() else fn(*args))
        return torch.cat(out)

    @torch.no_grad()
    def _select(self, rows_R, x_RD, keys_TD, sub_end_T, positions_T, groups: slice):
        """(chosen [K, R, k] block numbers, valid [K, R, k], visible [R, T]): the blocks each query row keeps per key
        head (valid: a block with a key it sees) and the keys it sees."""
        T = keys_TD.shape[0]
        key_index = torch.arange(T, device=rows_R.device)
        visible = (key_index[None, :] <= rows_R[:, None]) & (rows_R[:, None] < sub_end_T[None, :].long())  # [R, T]
        q = self.indexer.queries(x_RD, positions_T[rows_R], groups)  # [R, K, D_I]
        scores = torch.einsum("rkd,td->krt", q, keys_TD)
        scores = scores.masked_fill(~visible[None], float("-inf"))
        key_block = (positions_T[:T] // self.block_size).long()
        q_block = (positions_T[rows_R] // self.block_size).long()
        blocks = int(torch.maximum(key_block.max(), q_block.max())) + 1  # (keys of other branches may be deeper)
        block_scores = torch.full((*scores.shape[:2], blocks), float("-inf"), device=scores.device)
        block_scores.scatter_reduce_(-1, key_block.expand_as(scores), scores, reduce="amax", include_self=True)
        for back in range(self.local_blocks):  # the query's own block and the ones before it always win
            local = (q_block - back).clamp(min=0)
            block_scores.scatter_(-1, local[None, :, None].expand(scores.shape[0], -1, 1), float("inf"))
        top, chosen = block_scores.topk(min(self.topk_blocks, blocks), dim=-1)
        return chosen, top > float("-inf"), visible

    @torch.no_grad()
    def _block_keys(self, rows_R, chosen, valid, visible, positions_T):
        """(index [K, R, k x B], keep): the tree index of the key at each position of each kept block, and whether the
        query sees it. A query's ancestors hold positions 0..p once each, so its key at position d is the visible key
        of depth d (``path``)."""
        R, T = visible.shape
        depth = positions_T[rows_R].long()
        path = torch.zeros(R, int(depth.max()) + 1, dtype=torch.long, device=visible.device)
        r, j = torch.nonzero(visible, as_tuple=True)
        path[r, positions_T[j].long()] = j
        offsets = torch.arange(self.block_size, device=chosen.device)
        where = (chosen[..., None] * self.block_size + offsets).flatten(-2)  # [K, R, k x B] positions
        keep = (valid[..., None].expand(*valid.shape, self.block_size).flatten(-2)
                & (where <= depth[None, :, None]))
        index = path.gather(1, where.clamp(max=path.shape[1] - 1).permute(1, 0, 2).reshape(R, -1))
        return index.view(R, *where.shape[::2]).permute(1, 0, 2), keep


def _gathered_attention(q_RNH, k_TKH, v_TKH, index_KRS, keep_KRS, scale: float):
    """Softmax attention of each query over the keys ``index_KRS`` names for its key head's group (``keep_KRS``
    false: padding)."""
    R, N, _ = q_RNH.shape
    K = k_TKH.shape[1]
    heads = torch.arange(K, device=index_KRS.device)[:, None, None]
    k = k_TKH.transpose(0, 1)[heads, index_KRS].float()  # [K, R, S, H]
    v = v_TKH.transpose(0, 1)[heads, index_KRS].float()
    q = q_RNH.float().view(R, K, N // K, -1)
    scores = torch.einsum("rkgh,krsh->kgrs", q, k) * scale
    scores = scores.masked_fill(~keep_KRS[:, None], float("-inf"))
    out = torch.einsum("kgrs,krsh->rkgh", torch.softmax(scores, dim=-1), v)
    return out.reshape(R, N, -1).to(v_TKH.dtype)


def block_sparse_spec_params(cfg) -> dict:
    """The :class:`BlockSparseAttention` spec params of a GPTConfig with MiniMax-M3's sparse layers."""
    from forge_megatron.mcore import rope

    rotated = int(cfg.kv_channels * cfg.rotary_percent)
    return dict(index_heads=cfg.block_index_heads, index_head_dim=cfg.block_index_head_dim,
                block_size=cfg.block_size, topk_blocks=cfg.block_topk, local_blocks=cfg.block_local,
                inv_freq=rope.inv_freq(cfg.rope_scaling, cfg.rotary_base, rotated), eps=cfg.norm_epsilon)
