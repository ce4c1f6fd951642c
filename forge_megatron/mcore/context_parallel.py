"""Context parallelism (CP) for tree-packed micro-batches: all-to-all around the tree attention kernel.

With CP = C ranks (Megatron's context-parallel group), a tree-packed micro-batch of T tokens in DFS order is
padded to T_pad = ceil(T / C) * C with single-token roots (token 0, depth 0, visible only to itself, never a
target) and cut into C contiguous shards of T_l = T_pad / C tokens; CP rank r embeds, normalises, runs the
MLP/MoE layers and the output layer for tokens [r T_l, (r + 1) T_l) only, so activation memory per rank is
divided by C. Attention needs all keys: around the kernel each rank trades its token shard of every head for
every token of 1/C of the heads (one all-to-all each for q, k, v, and one back for the output; DeepSpeed-Ulysses'
scheme), then runs the unchanged tree kernel over the whole tree for its heads:

    q [T_l, N, H] --all-to-all--> [T_pad, N/C, H]    (k, v alike when C divides K; see below)
    o = tree_attention(q, k, v, sub_end_Tpad)          (any backend, the mask needs no change)
    o [T_pad, N/C, H] --all-to-all--> [T_l, N, H]

Heads, not tokens, are split inside attention, so the work is balanced whatever the tree's shape (causal
ring attention over a DFS order would need zig-zag balancing and a kernel taking query offsets). Requirements:
C divides the query heads per TP rank N; for key/value heads K, either C divides K (all-to-all) or K divides C
(GQA with few KV heads: k and v are all-gathered along the sequence and each rank keeps the one KV head its query
heads use). The backward of each all-to-all is the reverse all-to-all and that of the all-gather a
reduce-scatter, so autograd is exact: CP ranks' parameter gradients sum to the CP = 1 gradient (Megatron's DDP
reduces over the data-parallel-with-CP group).

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


def seq_multiple(config=None) -> int:
    """Tree micro-batches are padded to a multiple of this: the CP size, times the TP size when the model runs
    with sequence parallelism (``config.sequence_parallel``: each TP rank then holds 1/TP of a CP shard's tokens
    outside attention)."""
    from megatron.core import parallel_state as ps

    cp = cp_world()[0]
    if config is not None and getattr(config, "sequence_parallel", False):
        return cp * ps.get_tensor_model_parallel_world_size()
    return cp


def padded_length(T: int, multiple: int) -> int:
    return -(-T // multiple) * multiple


def shard_range(T: int, cp: int, rank: int, multiple: int | None = None) -> tuple[int, int]:
    """[lo, hi) of the tree, padded to ``multiple`` (default ``cp``, which must divide it), held by CP rank
    ``rank``."""
    local = padded_length(T, multiple or cp) // cp
    return rank * local, (rank + 1) * local


def pad_zeros(x_T: torch.Tensor, multiple: int) -> torch.Tensor:
    """Per-token values (token ids, depths) of the padded tree: zeros for the padding."""
    extra = padded_length(x_T.numel(), multiple) - x_T.numel()
    return x_T if extra == 0 else torch.cat([x_T, x_T.new_zeros(extra)])


def pad_sub_end(sub_end_T: torch.Tensor, multiple: int) -> torch.Tensor:
    """``sub_end`` of the padded tree: every padding token is a single-token root (sees only itself)."""
    T = sub_end_T.numel()
    pad_idx = torch.arange(T + 1, padded_length(T, multiple) + 1, device=sub_end_T.device, dtype=sub_end_T.dtype)
    return torch.cat([sub_end_T, pad_idx])


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


def sum_over_cp(x: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over the CP group (identity backward); ``x`` itself when CP is 1."""
    size, _, group = cp_world()
    return x if size == 1 else _SumIdentityBackward.apply(x, group)


def check_heads(N: int, K: int, cp: int) -> None:
    """Raise unless CP can split these heads (N query and K key/value heads per TP rank)."""
    if N % cp:
        raise ValueError(f"context parallelism splits attention heads across CP ranks: cp={cp} must divide the "
                         f"query heads per tensor-parallel rank ({N})")
    if K % cp and cp % K:
        raise ValueError(f"cp={cp} must divide, or be a multiple of, the key/value heads per tensor-parallel rank "
                         f"({K})")


# ------------------------------------------------------------------------------------------ attention
def tree_attention_cp(q_TlNH, k_TlKH, v_TlKH, sub_end_T, softmax_scale=None, backend=None):
    """Tree attention for this CP rank's token shard: o [T_l, N, H] over the whole padded tree ``sub_end_T``."""
    from forge_megatron.kernels.tree_attention import tree_attention

    C, rank, group = cp_world()
    Tl, N, H = q_TlNH.shape
    K = k_TlKH.shape[1]
    if C == 1:
        return tree_attention(q_TlNH, k_TlKH, v_TlKH, sub_end_T, softmax_scale=softmax_scale, backend=backend)
    check_heads(N, K, C)
    if sub_end_T.numel() != C * Tl:
        raise ValueError(f"CP rank holds {Tl} tokens but sub_end has {sub_end_T.numel()} (expected {C} x {Tl}): "
                         "shard the micro-batch with forge_megatron.mcore.forward.tree_model_inputs")
    q = _AllToAll.apply(q_TlNH, group, True)
    if K % C == 0:
        k, v = _AllToAll.apply(k_TlKH, group, True), _AllToAll.apply(v_TlKH, group, True)
    else:  # K divides C: this rank's N/C query heads all use KV head r*K/C
        head = rank * K // C
        k = _GatherSeq.apply(k_TlKH, group)[:, head:head + 1]
        v = _GatherSeq.apply(v_TlKH, group)[:, head:head + 1]
    o = tree_attention(q, k, v, sub_end_T, softmax_scale=softmax_scale, backend=backend)
    return _AllToAll.apply(o.contiguous(), group, False)
