"""torch.library plumbing shared by the compiled tree-attention backends (Triton, CUDA).

Each backend supplies two plain functions and gets back one differentiable, ``torch.compile``-traceable op:
  forward  (q_TNH, k_TKH, v_TKH, sub_end_T, scale) -> (o_TNH, lse_NT)
  backward (do_TNH, q_TNH, k_TKH, v_TKH, o_TNH, lse_NT, sub_end_T, scale) -> (dq_TNH, dk_TKH, dv_TKH)
registered as ``forge::tree_attn_<name>_fwd`` / ``_bwd`` custom ops with fake (shape-only) implementations and
an autograd formula that calls the backward op (FlashAttention-2: P is recomputed from the saved LSE).

Semantics (docs/prefix_tree.md): key j is visible to query i  <=>  j <= i < sub_end[j];
o_i = sum_j softmax_j(scale * q_i . k_j) v_j over visible j; lse_i = log sum_j exp(scale * q_i . k_j).

Suffix queries: k, v and sub_end cover tree tokens [0, T) and q may cover only the last Tq of them, the tokens
[T - Tq, T) (bottom-right aligned, as FlashAttention aligns seqlen_q < seqlen_k): o and lse then have Tq rows and
dk, dv hold those queries' contributions to every key. Context parallelism's all-gather mode runs each rank's shard
of queries this way against the keys before and in it (clamping sub_end to T: a subtree that continues past the
tokens given ends at T as far as they are concerned).

Value heads may be narrower (or wider) than query/key heads (multi-latent attention: 192-channel queries and keys,
128-channel values): o and dv then have the values' head size Hv.

Legend: T = packed tree tokens, N = query heads, K = key/value heads (N % K == 0), H = query/key head dim,
Hv = value head dim.
"""

from __future__ import annotations

from typing import Callable

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

ForwardImpl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
BackwardImpl = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def check_inputs(q_TNH: torch.Tensor, k_TKH: torch.Tensor, v_TKH: torch.Tensor, sub_end_T: torch.Tensor) -> None:
    """Raise ValueError naming the first problem with the shapes, dtypes or devices of the inputs."""
    for name, x in (("q", q_TNH), ("k", k_TKH), ("v", v_TKH)):
        if x.dim() != 3:
            raise ValueError(f"{name} must be 3-D [T, heads, head_dim], got shape {tuple(x.shape)}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} has dtype {x.dtype}; supported: float16, bfloat16, float32")
        if x.device != q_TNH.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q_TNH.device}")
    Tq, N, H = q_TNH.shape
    if k_TKH.shape[:2] != v_TKH.shape[:2]:
        raise ValueError(f"k and v must have the same tokens and heads, got {tuple(k_TKH.shape)} and "
                         f"{tuple(v_TKH.shape)}")
    T = k_TKH.shape[0]
    if T < Tq or k_TKH.shape[2] != H:
        raise ValueError(f"k/v shape {tuple(k_TKH.shape)} does not match q shape {tuple(q_TNH.shape)}: k/v need q's "
                         "head_dim and at least as many tokens (the queries are the last tokens of the keys' tree)")
    if not (k_TKH.dtype == v_TKH.dtype == q_TNH.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q_TNH.dtype}, {k_TKH.dtype}, {v_TKH.dtype}")
    K = k_TKH.shape[1]
    if K == 0 or N % K != 0:
        raise ValueError(f"query heads ({N}) must be a multiple of key/value heads ({K})")
    if sub_end_T.shape != (T,):
        raise ValueError(f"sub_end must have shape [{T}], got {tuple(sub_end_T.shape)}")
    if sub_end_T.dtype != torch.int32:
        raise ValueError(f"sub_end must be int32, got {sub_end_T.dtype}")
    if sub_end_T.device != q_TNH.device:
        raise ValueError(f"sub_end is on {sub_end_T.device} but q is on {q_TNH.device}")


def resolve_scale(softmax_scale: float | None, head_dim: int) -> float:
    """The softmax scale: 1/sqrt(H) unless given; must be positive and finite."""
    if softmax_scale is None:
        return head_dim ** -0.5
    scale = float(softmax_scale)
    if not (scale > 0.0 and scale != float("inf")):
        raise ValueError(f"softmax_scale must be positive and finite, got {softmax_scale}")
    return scale


def register_tree_attention_ops(name: str, forward_impl: ForwardImpl, backward_impl: BackwardImpl):
    """Register ``forge::tree_attn_{name}_fwd/_bwd`` and return the differentiable forward op.

    The returned op maps (q_TNH, k_TKH, v_TKH, sub_end_T, scale) -> (o_TNH, lse_NT); gradients flow to q, k, v.
    """
    fwd_name = f"forge::tree_attn_{name}_fwd"
    bwd_name = f"forge::tree_attn_{name}_bwd"

    @torch.library.custom_op(fwd_name, mutates_args=())
    def fwd_op(
        q_TNH: torch.Tensor, k_TKH: torch.Tensor, v_TKH: torch.Tensor, sub_end_T: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return forward_impl(q_TNH, k_TKH, v_TKH, sub_end_T, scale)

    @fwd_op.register_fake
    def _(q_TNH, k_TKH, v_TKH, sub_end_T, scale):
        Tq, N, _ = q_TNH.shape
        return q_TNH.new_empty((Tq, N, v_TKH.shape[2])), q_TNH.new_empty((N, Tq), dtype=torch.float32)

    @torch.library.custom_op(bwd_name, mutates_args=())
    def bwd_op(
        do_TNH: torch.Tensor,
        q_TNH: torch.Tensor,
        k_TKH: torch.Tensor,
        v_TKH: torch.Tensor,
        o_TNH: torch.Tensor,
        lse_NT: torch.Tensor,
        sub_end_T: torch.Tensor,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return backward_impl(do_TNH, q_TNH, k_TKH, v_TKH, o_TNH, lse_NT, sub_end_T, scale)

    @bwd_op.register_fake
    def _(do_TNH, q_TNH, k_TKH, v_TKH, o_TNH, lse_NT, sub_end_T, scale):
        return torch.empty_like(q_TNH), torch.empty_like(k_TKH), torch.empty_like(v_TKH)

    def setup_context(ctx, inputs, output):
        q_TNH, k_TKH, v_TKH, sub_end_T, scale = inputs
        o_TNH, lse_NT = output
        ctx.save_for_backward(q_TNH, k_TKH, v_TKH, o_TNH, lse_NT, sub_end_T)
        ctx.scale = scale

    def backward(ctx, do_TNH, _dlse_NT):
        # lse is an auxiliary output for the backward pass; gradients through it are not supported.
        q_TNH, k_TKH, v_TKH, o_TNH, lse_NT, sub_end_T = ctx.saved_tensors
        dq, dk, dv = bwd_op(do_TNH.contiguous(), q_TNH, k_TKH, v_TKH, o_TNH, lse_NT, sub_end_T, ctx.scale)
        return dq, dk, dv, None, None

    fwd_op.register_autograd(backward, setup_context=setup_context)
    return fwd_op


def make_public_entry(fwd_op) -> Callable[..., torch.Tensor]:
    """Wrap a registered forward op into the public ``(q, k, v, sub_end, softmax_scale=None) -> o`` function."""

    def tree_attention(
        q_TNH: torch.Tensor,
        k_TKH: torch.Tensor,
        v_TKH: torch.Tensor,
        sub_end_T: torch.Tensor,
        softmax_scale: float | None = None,
    ) -> torch.Tensor:
        check_inputs(q_TNH, k_TKH, v_TKH, sub_end_T)
        scale = resolve_scale(softmax_scale, q_TNH.shape[2])
        o_TNH, _ = fwd_op(q_TNH.contiguous(), k_TKH.contiguous(), v_TKH.contiguous(), sub_end_T.contiguous(), scale)
        return o_TNH

    return tree_attention
