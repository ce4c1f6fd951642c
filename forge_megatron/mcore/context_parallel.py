"""Context parallelism (CP) for tree-packed micro-batches: each rank holds zig-zag chunks of the tree's tokens.

With CP = C ranks (Megatron's context-parallel group), a tree-packed micro-batch of T tokens in DFS order is
padded to T_pad, a multiple of 2 R C (R = ``ROUNDS`` = 4), with single-token roots (token 0, depth 0, visible only
to itself, never a target) and cut into 2 R C chunks; of every 2C consecutive chunks CP rank r holds the r-th and
the (2C - 1 - r)-th (Megatron's zig-zag split, repeated R times), T_l = T_pad / C tokens in all. It embeds,
normalises, runs the MLP/MoE layers and the output layer for those tokens only, so activation memory per rank is
divided by C. Attention needs all keys; two ways to get them (``cp_comm_type``, Megatron's config field; None or
"auto" picks a2a where the heads allow it, else all_gather):

* ``a2a`` (DeepSpeed-Ulysses): each rank trades its tokens of every head for every token of 1/C of the heads
  (one all-to-all each for q, k, v and one back for the output), puts the chunks back in DFS order and runs the
  unchanged tree kernel over the whole tree for its heads:

      q [T_l, N, H] --all-to-all--> [T_pad, N/C, H]  (k, v alike when C divides K; all-gathered when K divides C)
      o = tree_attention(q, k, v, sub_end_Tpad)
      o [T_pad, N/C, H] --all-to-all--> [T_l, N, H]

  Heads, not tokens, are split inside attention, so the work is balanced whatever the tree's shape. It needs C to
  divide the query heads per TP rank N, and C to divide, or be a multiple of, the key/value heads per TP rank K.
* ``all_gather`` (any head count): k and v are all-gathered ([T_pad, K, H] on every rank, gathered again in the
  backward rather than saved: ``_GatheredKVAttention``) and each of the rank's chunks attends as *suffix queries*
  (kernels/tree_attention/ops.py): chunk [a, b) against keys [0, b) with sub_end clamped to b. Under a causal mask
  over a DFS order the cost of a query grows with its depth; the zig-zag chunks give every rank early and late
  ones: exactly balanced for one long chain (a long agent episode), near balanced for trees (see ``ROUNDS``;
  benchmarks/cp_balance.py). The backward reduce-scatters dk and dv. Moves T_pad x K x H x 2 of gathered keys per
  layer forward and again backward (held only while that layer's attention runs), where a2a moves q, k, v and o
  but only 1/C of them.

Either way autograd is exact: CP ranks' parameter gradients sum to the CP = 1 gradient (Megatron's DDP reduces
over the data-parallel-with-CP group).

Per-sample logprobs: each rank scores the next-token targets whose predicting row is local and the partial
vectors are summed over the CP group (all-reduce forward, identity backward, like Megatron's TP reductions), so
every CP rank holds the full, identical logp_M and computes the same loss, and gradients flow only into its
own rows.

Legend: T tokens of the tree, T_pad padded, T_l = T_pad / C per rank, N / K query / key-value heads per TP rank,
H head dim, M next-token targets.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def cp_world() -> tuple[int, int, object]:
    """(size, rank, group) of Megatron's context-parallel group; (1, 0, None) when it is not initialised."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 0, None
    size = ps.get_context_parallel_world_size()
    if size == 1:
        return 1, 0, None
    return size, ps.get_context_parallel_rank(), ps.get_context_parallel_group()


ROUNDS = 4
"""Zig-zag rounds: the padded tree is cut into 2 x ROUNDS x C chunks and every run of 2C consecutive chunks is
dealt zig-zag (rank r takes chunks r and 2C - 1 - r of it), so each rank holds 2 x ROUNDS chunks. One round balances
a chain exactly; trees (depth rising within each branch and falling back at the next) need finer interleaving:
counted attention imbalance of a GRPO group at C = 8 is 1.23 with one round and 1.00 with four, of a packed batch
of groups 1.42 and 1.14 (benchmarks/cp_balance.py). Costs: padding to a multiple of 2 x ROUNDS x C (x TP) tokens,
and 2 x ROUNDS kernel calls per layer in all_gather mode."""


def default_multiple(cp: int) -> int:
    """The padding multiple without sequence parallelism: 2 x ROUNDS x CP (the chunks), 1 without CP."""
    return 2 * ROUNDS * cp if cp > 1 else 1


def seq_multiple(config=None) -> int:
    """Tree micro-batches are padded to a multiple of this: :func:`default_multiple` (1 without CP), times the TP
    size when the model runs with sequence parallelism (``config.sequence_parallel``: each TP rank then holds 1/TP
    of a CP shard's tokens outside attention)."""
    from megatron.core import parallel_state as ps

    multiple = default_multiple(cp_world()[0])
    if config is not None and getattr(config, "sequence_parallel", False):
        return multiple * ps.get_tensor_model_parallel_world_size()
    return multiple


def padded_length(T: int, multiple: int) -> int:
    return -(-T // multiple) * multiple


def shard_ranges(T: int, cp: int, rank: int, multiple: int | None = None) -> list[tuple[int, int]]:
    """The 2 x ROUNDS [lo, hi) chunks of the tree, padded to ``multiple`` (default :func:`default_multiple`, which
    must divide it), held by CP rank ``rank``, in its local order: of every 2 cp consecutive chunks, the ``rank``-th
    and the (2 cp - 1 - ``rank``)-th."""
    multiple = multiple or default_multiple(cp)
    if multiple % default_multiple(cp):
        raise ValueError(f"the padding multiple ({multiple}) must be a multiple of 2 x {ROUNDS} rounds x CP "
                         f"({default_multiple(cp)})")
    chunk = padded_length(T, multiple) // default_multiple(cp)
    out = []
    for g in range(ROUNDS):
        for c in (g * 2 * cp + rank, g * 2 * cp + 2 * cp - 1 - rank):
            out.append((c * chunk, (c + 1) * chunk))
    return out


def take_shard(x_T: torch.Tensor, cp: int, rank: int, multiple: int | None = None) -> torch.Tensor:
    """This rank's rows of per-token values (token ids, depths, routing) of the padded tree ``x_T``."""
    return torch.cat([x_T[lo:hi] for lo, hi in shard_ranges(x_T.shape[0], cp, rank, multiple)])


def shard_positions(T: int, cp: int, rank: int, multiple: int | None = None, device=None) -> torch.Tensor:
    """Tree positions of this rank's local rows, in local order (int64 [T_l])."""
    return torch.cat([torch.arange(lo, hi, device=device) for lo, hi in shard_ranges(T, cp, rank, multiple)])


def pad_zeros(x_T: torch.Tensor, multiple: int) -> torch.Tensor:
    """Per-token values (token ids, depths) of the padded tree: zeros for the padding."""
    extra = padded_length(x_T.numel(), multiple) - x_T.numel()
    return x_T if extra == 0 else torch.cat([x_T, x_T.new_zeros(extra)])


def pad_sub_end(sub_end_T: torch.Tensor, multiple: int) -> torch.Tensor:
    """``sub_end`` of the padded tree: every padding token is a single-token root (sees only itself)."""
    T = sub_end_T.numel()
    pad_idx = torch.arange(T + 1, padded_length(T, multiple) + 1, device=sub_end_T.device, dtype=sub_end_T.dtype)
    return torch.cat([sub_end_T, pad_idx])


def ranks_to_tree_order(x: torch.Tensor, cp: int) -> torch.Tensor:
    """Rows gathered rank by rank ([C x T_l, ...], each rank's chunks in its local order) -> tree (DFS) order."""
    x_CR2 = x.reshape(cp, ROUNDS, 2, x.shape[0] // default_multiple(cp), *x.shape[1:])
    early = x_CR2[:, :, 0].transpose(0, 1)         # [R, C, chunk]: chunk g 2C + s of rank s
    late = x_CR2[:, :, 1].flip(0).transpose(0, 1)  # [R, C, chunk]: chunk g 2C + C + s' of rank C - 1 - s'
    return torch.cat([early, late], dim=1).reshape(x.shape)


def tree_to_ranks_order(x: torch.Tensor, cp: int) -> torch.Tensor:
    """The inverse of :func:`ranks_to_tree_order`."""
    x_R2C = x.reshape(ROUNDS, 2 * cp, x.shape[0] // default_multiple(cp), *x.shape[1:])
    early = x_R2C[:, :cp].transpose(0, 1)
    late = x_R2C[:, cp:].transpose(0, 1).flip(0)
    return torch.stack([early, late], dim=2).reshape(x.shape)


# --------------------------------------------------------------------------------------- collectives
class _AllToAll(torch.autograd.Function):
    """``to_heads``: [T_l, X, H] (this rank's tokens, all X heads) -> [C * T_l, X / C, H] (all tokens, this rank's
    heads); otherwise the inverse. The backward is the other direction."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad.contiguous(), ctx.group), None, None


class _GatherSeq(torch.autograd.Function):
    """[T_l, X, H] -> [C * T_l, X, H] (all-gather); backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        C = dist.get_world_size(group)
        out = x.new_empty((C * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        C = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // C, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


class _SumIdentityBackward(torch.autograd.Function):
    """All-reduce (sum) over a group forward, identity backward: every rank then computes the same loss."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _gather_tree_order(x_TlXH: torch.Tensor, group) -> torch.Tensor:
    """This rank's rows -> the whole padded tree's rows, in tree (DFS) order (no autograd)."""
    C = dist.get_world_size(group)
    out = x_TlXH.new_empty((C * x_TlXH.shape[0], *x_TlXH.shape[1:]))
    dist.all_gather_into_tensor(out, x_TlXH.contiguous(), group=group)
    return ranks_to_tree_order(out, C)


def _chunks(sub_end_T: torch.Tensor, Tl: int, C: int, rank: int):
    """(rows of this rank's q, keys end hi, sub_end clamped to hi) of each of its chunks: the chunk [lo, hi) of the
    tree attends as suffix queries to keys [0, hi). The clamped sub_end is cached per sub_end (schedule.derived), so
    every layer and the backward pass the Triton kernels the same tensor and its tile schedule is built once."""
    from forge_megatron.kernels.tree_attention.schedule import derived

    step = Tl // (2 * ROUNDS)
    for i, (lo, hi) in enumerate(shard_ranges(C * Tl, C, rank)):
        yield slice(i * step, (i + 1) * step), hi, derived(sub_end_T, ("clamp", hi), lambda t: t[:hi].clamp(max=hi))


class _GatheredKVAttention(torch.autograd.Function):
    """all_gather mode: k and v are all-gathered and each of the rank's chunks attends as suffix queries to the keys
    before and in it. Only this rank's k and v are saved (with o and, for compiled kernels, the log-sum-exp): the
    backward gathers them again, runs each chunk's backward (compiled kernels from the saved o and lse; the autograd
    backends recompute their forward) and reduce-scatters dk and dv. Per layer that keeps T_l rows of keys and values
    for the backward instead of T_pad (C times fewer), for one more all-gather in the backward (what Transformer
    Engine's all-gather context parallelism does too)."""

    @staticmethod
    def forward(ctx, q, k_local, v_local, sub_end_T, scale, backend, group, rank, sinks=None, window=0, softcap=0.0,
                chunk=0):
        from forge_megatron.kernels.tree_attention.dispatch import function_of, raw_ops
        from forge_megatron.kernels.tree_attention.ops import check_inputs

        C = dist.get_world_size(group)
        k, v = _gather_tree_order(k_local, group), _gather_tree_order(v_local, group)
        raw = raw_ops(backend)
        extras = {} if sinks is None and not window else {"sinks": sinks, "window": window}
        if softcap:
            extras["softcap"] = softcap
        if chunk:
            extras["chunk"] = chunk
        outs, lses = [], []
        for rows, hi, se in _chunks(sub_end_T, q.shape[0], C, rank):
            if raw is None:
                outs.append(function_of(backend)(q[rows], k[:hi], v[:hi], se, softmax_scale=scale, **extras))
            else:
                check_inputs(q[rows], k[:hi], v[:hi], se)
                o, lse = raw[0](q[rows].contiguous(), k[:hi], v[:hi], se.contiguous(), scale, sinks, window, None,
                                softcap, chunk)
                outs.append(o)
                lses.append(lse)
        o = torch.cat(outs)
        ctx.has_sinks = sinks is not None
        ctx.save_for_backward(q, k_local, v_local, sub_end_T, o, *([sinks] if sinks is not None else []), *lses)
        ctx.scale, ctx.backend, ctx.group, ctx.rank, ctx.window = scale, backend, group, rank, window
        ctx.softcap, ctx.chunk = softcap, chunk
        return o

    @staticmethod
    def backward(ctx, do):
        from forge_megatron.kernels.tree_attention.dispatch import function_of, raw_ops
        from forge_megatron.kernels.tree_attention.ops import sink_grad

        q, k_local, v_local, sub_end_T, o, *rest = ctx.saved_tensors
        sinks, lses = (rest[0], rest[1:]) if ctx.has_sinks else (None, rest)
        group, C = ctx.group, dist.get_world_size(ctx.group)
        k, v = _gather_tree_order(k_local, group), _gather_tree_order(v_local, group)
        raw = raw_ops(ctx.backend)
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dsinks = torch.zeros_like(sinks) if sinks is not None else None
        extras = {} if sinks is None and not ctx.window else {"window": ctx.window}
        if ctx.softcap:
            extras["softcap"] = ctx.softcap
        if ctx.chunk:
            extras["chunk"] = ctx.chunk
        do = do.contiguous()
        for i, (rows, hi, se) in enumerate(_chunks(sub_end_T, q.shape[0], C, ctx.rank)):
            if raw is None:
                with torch.enable_grad():
                    leaves = [x.detach().requires_grad_() for x in (q[rows], k[:hi], v[:hi])]
                    if sinks is not None:
                        leaves.append(sinks.detach().requires_grad_())
                        extras["sinks"] = leaves[3]
                    oi = function_of(ctx.backend)(*leaves[:3], se, softmax_scale=ctx.scale, **extras)
                    dqi, dki, dvi, *dsi = torch.autograd.grad(oi, leaves, do[rows])
            else:
                dqi, dki, dvi = raw[1](do[rows].contiguous(), q[rows].contiguous(), k[:hi], v[:hi],
                                       o[rows].contiguous(), lses[i], se.contiguous(), ctx.scale, ctx.window, None,
                                       ctx.softcap, ctx.chunk)
                dsi = [sink_grad(sinks, lses[i], do[rows], o[rows])] if sinks is not None else []
            dq[rows] = dqi
            dk[:hi] += dki
            dv[:hi] += dvi
            if dsinks is not None:
                dsinks += dsi[0]
        dk_local, dv_local = (_scatter_tree_order(x, group) for x in (dk, dv))
        return dq, dk_local, dv_local, None, None, None, None, None, dsinks, None, None, None


def _scatter_tree_order(x_TXH: torch.Tensor, group) -> torch.Tensor:
    """Gradients of the whole tree's rows (tree order) -> this rank's rows, summed over the CP ranks."""
    C = dist.get_world_size(group)
    send = tree_to_ranks_order(x_TXH, C).contiguous()
    out = send.new_empty((send.shape[0] // C, *send.shape[1:]))
    dist.reduce_scatter_tensor(out, send, group=group)
    return out


def _seq_to_heads(x_TlXH: torch.Tensor, group) -> torch.Tensor:
    C = dist.get_world_size(group)
    Tl, X, H = x_TlXH.shape
    send = x_TlXH.reshape(Tl, C, X // C, H).transpose(0, 1).contiguous()  # [C, T_l, X/C, H]: chunk s -> rank s
    recv = torch.empty_like(send)                                         # chunk s <- rank s's tokens
    dist.all_to_all_single(recv, send, group=group)
    return recv.reshape(C * Tl, X // C, H)


def _heads_to_seq(y_TXcH: torch.Tensor, group) -> torch.Tensor:
    C = dist.get_world_size(group)
    T, Xc, H = y_TXcH.shape
    send = y_TXcH.reshape(C, T // C, Xc, H).contiguous()  # chunk s = rank s's tokens, this rank's heads
    recv = torch.empty_like(send)                          # chunk s = this rank's tokens, rank s's heads
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(T // C, C * Xc, H)


def tokens_to_heads(x_TlXH: torch.Tensor, group) -> torch.Tensor:
    """This CP rank's tokens of all X heads [T_l, X, H] -> every token of the padded tree, in DFS order, of 1/C of
    the heads [T_pad, X / C, H] (one all-to-all; its backward is the inverse)."""
    return ranks_to_tree_order(_AllToAll.apply(x_TlXH.contiguous(), group, True), dist.get_world_size(group))


def layer_tokens_to_heads(x_TlXH: torch.Tensor, packed_seq_params, layer: str) -> tuple[torch.Tensor, int]:
    """The recurrent mixers' way into context parallelism (Gated DeltaNet, Kimi Delta Attention, Mamba-2, short
    convolutions, lightning attention): a scan runs along the tree's paths, so under CP each rank takes every token
    of 1/C of the heads (:func:`tokens_to_heads`) instead of 1/C of the tokens of every head. Returns (the heads
    this rank runs, [T_pad, X / C, H], or ``x_TlXH`` itself without CP; this rank's CP rank: its heads are the
    rank-th 1/C). ``layer`` names the layer in the error for a batch that is not a tree."""
    size, rank, group = cp_world()
    if size == 1:
        return x_TlXH, 0
    if packed_seq_params is None:
        raise ValueError(f"{layer} layers run under context parallelism on trees only (TreePackedSeqParams)")
    return tokens_to_heads(x_TlXH, group), rank


def layer_heads_to_tokens(y_TXcH: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`layer_tokens_to_heads`: the heads this rank ran, every token [T_pad, X / C, H] -> this
    rank's tokens of every head [T_l, X, H] (``y_TXcH`` itself without CP)."""
    size, _, group = cp_world()
    return y_TXcH if size == 1 else heads_to_tokens(y_TXcH, group)


def heads_to_tokens(y_TXcH: torch.Tensor, group) -> torch.Tensor:
    """The inverse of :func:`tokens_to_heads`: [T_pad, X / C, H] in DFS order -> this rank's tokens [T_l, X, H]."""
    return _AllToAll.apply(tree_to_ranks_order(y_TXcH, dist.get_world_size(group)).contiguous(), group, False)


def gather_tree(x_Tl: torch.Tensor, group) -> torch.Tensor:
    """Per-token values of this CP rank's tokens [T_l] -> the whole padded tree's [T_pad], in DFS order (no
    autograd: depths, token ids)."""
    return _gather_tree_order(x_Tl[:, None, None], group).reshape(-1)


def sum_over_cp(x: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over the CP group (identity backward); ``x`` itself when CP is 1."""
    size, _, group = cp_world()
    return x if size == 1 else _SumIdentityBackward.apply(x, group)


COMM_TYPES = ("a2a", "all_gather")


def check_heads(N: int, K: int, cp: int) -> None:
    """Raise unless the a2a mode can split these heads (N query and K key/value heads per TP rank)."""
    if N % cp:
        raise ValueError(f"cp_comm_type a2a splits attention heads across CP ranks: cp={cp} must divide the query "
                         f"heads per tensor-parallel rank ({N}); all_gather works with any head count")
    if K % cp and cp % K:
        raise ValueError(f"cp_comm_type a2a: cp={cp} must divide, or be a multiple of, the key/value heads per "
                         f"tensor-parallel rank ({K}); all_gather works with any head count")


def resolve_comm_type(comm_type: str | None, N: int, K: int, cp: int) -> str:
    """"a2a" or "all_gather" for Megatron's ``cp_comm_type`` (None or "auto": a2a where the heads allow it;
    "allgather", Megatron-LM's command-line spelling, is "all_gather")."""
    if comm_type == "allgather":
        comm_type = "all_gather"
    if comm_type in (None, "auto"):
        return "a2a" if N % cp == 0 and (K % cp == 0 or cp % K == 0) else "all_gather"
    if comm_type not in COMM_TYPES:
        raise ValueError(f"tree attention supports cp_comm_type a2a or all_gather (or auto), got {comm_type!r} "
                         "(Megatron's p2p ring and a2a+p2p are not implemented for trees)")
    if comm_type == "a2a":
        check_heads(N, K, cp)
    return comm_type


# ------------------------------------------------------------------------------------------ attention
def tree_attention_cp(q_TlNH, k_TlKH, v_TlKH, sub_end_T, softmax_scale=None, backend=None, comm_type=None,
                      sinks=None, window=None, key_end_T=None, softcap=None, chunk=None):
    """Tree attention for this CP rank's zig-zag shard: o [T_l, N, Hv] over the whole padded tree ``sub_end_T``;
    ``sinks`` [N] and ``window``: gpt-oss attention; ``key_end_T`` (the whole padded tree's): bidirectional blocks,
    Gemma 3 and 4's images (kernels/tree_attention/ops.py), in the all-to-all mode only; ``softcap``: Gemma 2's
    soft-capped scores; ``chunk``: Llama 4's chunked attention."""
    from forge_megatron.kernels.tree_attention import tree_attention

    C, rank, group = cp_world()
    Tl, N, H = q_TlNH.shape
    K = k_TlKH.shape[1]
    extras = {} if sinks is None and not window else {"sinks": sinks, "window": window}
    if key_end_T is not None:
        extras["key_end"] = key_end_T
    if softcap:
        extras["softcap"] = float(softcap)
    if chunk:
        extras["chunk"] = int(chunk)
    if C == 1:
        return tree_attention(q_TlNH, k_TlKH, v_TlKH, sub_end_T, softmax_scale=softmax_scale, backend=backend,
                              **extras)
    mode = resolve_comm_type(comm_type, N, K, C)
    if key_end_T is not None and mode == "all_gather":
        raise ValueError("bidirectional image attention (Gemma 3 and 4's images) under context parallelism needs the "
                         "all-to-all mode (--cp-comm-type a2a, with query heads divisible by the CP size)")
    if sub_end_T.numel() != C * Tl or Tl % (2 * ROUNDS):
        raise ValueError(f"CP rank holds {Tl} tokens but sub_end has {sub_end_T.numel()} (expected {C} x {Tl}, "
                         f"{2 * ROUNDS} chunks each): shard the micro-batch with "
                         "forge_megatron.mcore.forward.tree_model_inputs")
    if mode == "all_gather":
        from forge_megatron.kernels.tree_attention.dispatch import resolve
        from forge_megatron.kernels.tree_attention.ops import resolve_scale

        name = resolve(q_TlNH.device, backend, suffix_queries=True, head_dim=q_TlNH.shape[2],
                       v_head_dim=v_TlKH.shape[2], score_extras=bool(extras))
        scale = resolve_scale(softmax_scale, H)
        return _GatheredKVAttention.apply(q_TlNH, k_TlKH, v_TlKH, sub_end_T, scale, name, group, rank, sinks,
                                          int(window or 0), float(softcap or 0.0), int(chunk or 0))
    q = tokens_to_heads(q_TlNH, group)
    if K % C == 0:
        k, v = tokens_to_heads(k_TlKH, group), tokens_to_heads(v_TlKH, group)
    else:  # K divides C: this rank's N/C query heads all use KV head r*K/C
        head = rank * K // C
        k = ranks_to_tree_order(_GatherSeq.apply(k_TlKH, group)[:, head:head + 1], C)
        v = ranks_to_tree_order(_GatherSeq.apply(v_TlKH, group)[:, head:head + 1], C)
    if sinks is not None:  # this rank's heads after the all-to-all: chunk `rank` of the local heads
        extras["sinks"] = sinks[rank * (N // C):(rank + 1) * (N // C)]
    o = tree_attention(q, k, v, sub_end_T, softmax_scale=softmax_scale, backend=backend, **extras)
    return heads_to_tokens(o, group)
