"""torch.library plumbing shared by the compiled tree-attention backends (Triton, CUDA).

Each backend supplies two plain functions and gets back one differentiable, ``torch.compile``-traceable op:
  forward  (q_TNH, k_TKH, v_TKH, sub_end_T, scale, sinks_N, window, key_end_T, softcap, chunk) -> (o_TNH, lse_NT)
  backward (do_TNH, q_TNH, k_TKH, v_TKH, o_TNH, lse_NT, sub_end_T, scale, window, key_end_T, softcap, chunk)
           -> (dq_TNH, dk_TKH, dv_TKH)
registered as ``forge::tree_attn_<name>_fwd`` / ``_bwd`` custom ops with fake (shape-only) implementations and
an autograd formula that calls the backward op (FlashAttention-2: P is recomputed from the saved LSE).

Semantics (docs/prefix_tree.md): key j is visible to query i  <=>  j <= i < sub_end[j];
o_i = sum_j softmax_j(scale * q_i . k_j) v_j over visible j; lse_i = log sum_j exp(scale * q_i . k_j).

Suffix queries: k, v and sub_end cover tree tokens [0, T) and q may cover only the last Tq of them, the tokens
[T - Tq, T) (bottom-right aligned, as FlashAttention aligns seqlen_q < seqlen_k): o and lse then have Tq rows and
dk, dv hold those queries' contributions to every key. Context parallelism's all-gather mode runs each rank's shard
of queries this way against the keys before and in it (clamping sub_end to T: a subtree that continues past the
tokens given ends at T as far as they are concerned).

Attention sinks and sliding windows (gpt-oss; Megatron's ``softmax_type="learnable"`` and ``window_size``):
- ``sinks_N`` (None: none): a learned logit per query head that joins every row's softmax denominator and carries no
  value: o_i = sum_j exp(s_ij) v_j / (exp(sink_n) + sum_j exp(s_ij)); lse includes it. Its gradient needs no kernel:
  do_i/dsink_n = -p_sink,i o_i with p_sink,i = exp(sink_n - lse_ni), so dL/dsink_n = -sum_i p_sink,i delta_ni with
  delta = rowsum(dO * O), and dq/dk/dv keep FlashAttention's formulas (P recomputed from the lse that holds the sink).
- ``window`` (0: none): key j is visible to query i only if depth(i) - depth(j) < window as well (depths are the
  tokens' positions in their samples, :func:`depths`), i.e. each sample's sliding window.

Chunked attention (Llama 4's ``attention_chunk_size`` layers): ``chunk`` C (0: none) lets query i see key j only if
depth(i) // C == depth(j) // C as well: each sample's positions cut into chunks of C, a query seeing the keys of its
own chunk only (transformers' chunked causal mask on each sample alone).

Soft-capped scores (Gemma 2's ``attn_logit_softcapping``): ``softcap`` c (0: none) replaces every score
s = scale * q_i . k_j by c * tanh(s / c) before the mask and the softmax (the sinks are not capped). The backward
multiplies dS by the cap's derivative 1 - tanh(s / c)^2 before dQ = scale dS K and dK = scale dS^T Q.

Bidirectional blocks (Gemma 3's images; transformers' "OR(causal, blockwise)" mask, the window ANDed after it):
``key_end_T`` (int32 [T], None: causal) is the exclusive end of the keys each token may see as a query, i + 1 for a
causal token, the end of its block for a token of a block; key j is visible to query i  <=>  j < key_end[i] and
i < sub_end[j] (and the window). A block must lie in one chain of the tree (:func:`check_key_end`): then the only keys
past i that i sees are its block's.

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


def block_key_end(block_T: torch.Tensor, sub_end_T: torch.Tensor) -> torch.Tensor:
    """int32 [T] ``key_end`` of a tree whose tokens ``block_T`` marks (bool [T]: True for a token of a bidirectional
    block): a block is a maximal run of marked tokens along the tree, each the child of the one before (transformers'
    Gemma 3 groups a sample's image tokens so), its tokens' key_end its end; i + 1 for the others. ValueError when a
    run goes on into more than one child (a block would span a branch: samples that share part of an image)."""
    T = block_T.shape[0]
    idx = torch.arange(T, device=block_T.device)
    marked = block_T.bool()
    sub_end = sub_end_T.long()
    # i's run goes on to i + 1 when both are marked and i + 1 is i's child (i's subtree holds more than i)
    goes_on = marked[:-1] & marked[1:] & (sub_end[:-1] > idx[:-1] + 1)
    branching = goes_on & (sub_end[1:] != sub_end[:-1])  # i + 1 is a child of i, not its only one
    if bool(branching.any()):
        i = int(torch.nonzero(branching)[0])
        raise ValueError(f"a bidirectional block runs on past token {i} into more than one child: samples share part "
                         "of a block")
    # the end of each token's run: the first token from it on whose run stops there, plus one (found from the right)
    stops = torch.cat([~goes_on, goes_on.new_ones(1)])
    last = torch.where(stops, idx, torch.full_like(idx, T))
    run_end = torch.flip(torch.cummin(torch.flip(last, [0]), 0).values, [0]) + 1
    return torch.where(marked, run_end, idx + 1).to(torch.int32)


def check_key_end(key_end_T: torch.Tensor, sub_end_T: torch.Tensor, values: bool | None = None) -> None:
    """ValueError unless ``key_end`` describes blocks inside chains of the tree: int32, shape [T], on sub_end's
    device, i < key_end[i] <= sub_end[i], and the tokens i .. key_end[i] - 1 one chain, each the only child of the
    one before (sub_end[j] == sub_end[i] for i < j < key_end[i]). ``values`` (default: off CUDA only) checks the
    last two, which reads the tensors: on a GPU a device sync per attention call, so there the layout is trusted as
    :func:`block_key_end` made it (it refuses blocks that span a branch), as sub_end's is."""
    T = sub_end_T.shape[0]
    if key_end_T.shape != (T,) or key_end_T.dtype != torch.int32 or key_end_T.device != sub_end_T.device:
        raise ValueError(f"key_end must be int32 of shape [{T}] on {sub_end_T.device}, got {key_end_T.dtype} "
                         f"{tuple(key_end_T.shape)} on {key_end_T.device}")
    if not (values if values is not None else key_end_T.device.type != "cuda"):
        return
    idx = torch.arange(T, device=key_end_T.device, dtype=torch.int32)
    if bool(((key_end_T <= idx) | (key_end_T > sub_end_T)).any()):
        raise ValueError("key_end must satisfy i < key_end[i] <= sub_end[i]: a bidirectional block ends inside the "
                         "subtree of each of its tokens")
    # the tokens i .. key_end[i] - 1 are one chain (each the only child of the one before): sub_end is constant on it
    changes = torch.cumsum(torch.cat([sub_end_T.new_zeros(1), (sub_end_T[1:] != sub_end_T[:-1]).int()]), 0)
    if bool((changes[key_end_T.long() - 1] != changes).any()):
        raise ValueError("a bidirectional block (key_end) spans a branch of the tree: its tokens must be one chain")


def depths(sub_end_T: torch.Tensor) -> torch.Tensor:
    """int32 [T] depth of every token (its position in each sample holding it): token j adds one to the tokens of
    (j, sub_end[j]), a difference array."""
    T = sub_end_T.shape[0]
    idx_T = torch.arange(T, device=sub_end_T.device)
    diff = torch.zeros(T + 1, dtype=torch.int64, device=sub_end_T.device)
    diff.index_add_(0, idx_T + 1, torch.ones_like(idx_T))
    diff.index_add_(0, sub_end_T.long(), -torch.ones_like(idx_T))
    return torch.cumsum(diff, 0)[:T].to(torch.int32)


def check_extras(q_TNH: torch.Tensor, sinks_N: torch.Tensor | None, window: int | None) -> int:
    """Validate sinks and window; return the window as an int (0: none)."""
    if sinks_N is not None:
        if sinks_N.shape != (q_TNH.shape[1],):
            raise ValueError(f"sinks must have one logit per query head, shape [{q_TNH.shape[1]}], got "
                             f"{tuple(sinks_N.shape)}")
        if sinks_N.device != q_TNH.device:
            raise ValueError(f"sinks are on {sinks_N.device} but q is on {q_TNH.device}")
    window = int(window or 0)
    if window < 0:
        raise ValueError(f"window must be >= 1 (or None / 0 for none), got {window}")
    return window


def check_chunk(chunk: int | None) -> int:
    """The attention chunk as an int (0: none); ValueError unless None, 0 or positive."""
    value = int(chunk or 0)
    if value < 0:
        raise ValueError(f"chunk must be >= 1 (or None / 0 for none), got {chunk!r}")
    return value


def check_softcap(softcap: float | None) -> float:
    """The score soft cap as a float (0.0: none); ValueError unless None, 0 or positive and finite."""
    cap = float(softcap or 0.0)
    if not (cap >= 0.0 and cap != float("inf")):
        raise ValueError(f"softcap must be positive and finite (or None / 0 for none), got {softcap!r}")
    return cap


def sink_grad(sinks_N: torch.Tensor, lse_NT: torch.Tensor, do_TNH: torch.Tensor, o_TNH: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks from the forward's lse (which includes the sinks) and delta = rowsum(dO * O)."""
    delta_NT = (do_TNH.float() * o_TNH.float()).sum(-1).transpose(0, 1)
    return -(torch.exp(sinks_N.float()[:, None] - lse_NT) * delta_NT).sum(-1).to(sinks_N.dtype)


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

    The returned op maps (q_TNH, k_TKH, v_TKH, sub_end_T, scale, sinks_N=None, window=0, key_end_T=None,
    softcap=0.0, chunk=0) -> (o_TNH, lse_NT); gradients flow to q, k, v and the sinks (key_end, like sub_end, gets
    none). The backward op takes (do_TNH, q_TNH, k_TKH, v_TKH, o_TNH, lse_NT, sub_end_T, scale, window=0,
    key_end_T=None, softcap=0.0, chunk=0). The impls are called with every argument, chunk (0: none) last.
    """
    fwd_name = f"forge::tree_attn_{name}_fwd"
    bwd_name = f"forge::tree_attn_{name}_bwd"

    @torch.library.custom_op(fwd_name, mutates_args=())
    def fwd_op(
        q_TNH: torch.Tensor, k_TKH: torch.Tensor, v_TKH: torch.Tensor, sub_end_T: torch.Tensor, scale: float,
        sinks_N: torch.Tensor | None = None, window: int = 0, key_end_T: torch.Tensor | None = None,
        softcap: float = 0.0, chunk: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return forward_impl(q_TNH, k_TKH, v_TKH, sub_end_T, scale, sinks_N, window, key_end_T, softcap, chunk)

    @fwd_op.register_fake
    def _(q_TNH, k_TKH, v_TKH, sub_end_T, scale, sinks_N=None, window=0, key_end_T=None, softcap=0.0, chunk=0):
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
        window: int = 0,
        key_end_T: torch.Tensor | None = None,
        softcap: float = 0.0,
        chunk: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return backward_impl(do_TNH, q_TNH, k_TKH, v_TKH, o_TNH, lse_NT, sub_end_T, scale, window, key_end_T, softcap,
                             chunk)

    @bwd_op.register_fake
    def _(do_TNH, q_TNH, k_TKH, v_TKH, o_TNH, lse_NT, sub_end_T, scale, window=0, key_end_T=None, softcap=0.0,
          chunk=0):
        return torch.empty_like(q_TNH), torch.empty_like(k_TKH), torch.empty_like(v_TKH)

    def setup_context(ctx, inputs, output):
        q_TNH, k_TKH, v_TKH, sub_end_T, scale = inputs[:5]
        given = tuple(inputs[5:])  # (the defaults of the arguments not given)
        sinks_N, window, key_end_T, softcap, chunk = given + (None, 0, None, 0.0, 0)[len(given):]
        o_TNH, lse_NT = output
        ctx.has_sinks = sinks_N is not None
        ctx.has_key_end = key_end_T is not None
        ctx.save_for_backward(q_TNH, k_TKH, v_TKH, o_TNH, lse_NT, sub_end_T,
                              *([sinks_N] if sinks_N is not None else []),
                              *([key_end_T] if key_end_T is not None else []))
        ctx.scale, ctx.window, ctx.softcap, ctx.chunk = scale, window, softcap, chunk

    def backward(ctx, do_TNH, _dlse_NT):
        # lse is an auxiliary output for the backward pass; gradients through it are not supported.
        q_TNH, k_TKH, v_TKH, o_TNH, lse_NT, sub_end_T, *rest = ctx.saved_tensors
        sinks_N = rest.pop(0) if ctx.has_sinks else None
        key_end_T = rest.pop(0) if ctx.has_key_end else None
        do_TNH = do_TNH.contiguous()
        dq, dk, dv = bwd_op(do_TNH, q_TNH, k_TKH, v_TKH, o_TNH, lse_NT, sub_end_T, ctx.scale, ctx.window, key_end_T,
                            ctx.softcap, ctx.chunk)
        dsinks = sink_grad(sinks_N, lse_NT, do_TNH, o_TNH) if sinks_N is not None else None
        return dq, dk, dv, None, None, dsinks, None, None, None, None

    fwd_op.register_autograd(backward, setup_context=setup_context)
    return fwd_op


def make_public_entry(fwd_op) -> Callable[..., torch.Tensor]:
    """Wrap a registered forward op into the public ``(q, k, v, sub_end, softmax_scale=None, sinks=None,
    window=None, key_end_T=None, softcap=None, chunk=None) -> o`` function (key_end_T: bidirectional blocks, checked by
    :func:`check_key_end` outside torch.compile: the check reads the tensor, a device sync)."""

    def tree_attention(
        q_TNH: torch.Tensor,
        k_TKH: torch.Tensor,
        v_TKH: torch.Tensor,
        sub_end_T: torch.Tensor,
        softmax_scale: float | None = None,
        sinks: torch.Tensor | None = None,
        window: int | None = None,
        key_end_T: torch.Tensor | None = None,
        softcap: float | None = None,
        chunk: int | None = None,
    ) -> torch.Tensor:
        check_inputs(q_TNH, k_TKH, v_TKH, sub_end_T)
        window = check_extras(q_TNH, sinks, window)
        softcap, chunk = check_softcap(softcap), check_chunk(chunk)
        if key_end_T is not None:
            if not torch.compiler.is_compiling():  # data-dependent: a graph break under torch.compile
                check_key_end(key_end_T, sub_end_T)
            key_end_T = key_end_T.contiguous()
        scale = resolve_scale(softmax_scale, q_TNH.shape[2])
        o_TNH, _ = fwd_op(q_TNH.contiguous(), k_TKH.contiguous(), v_TKH.contiguous(), sub_end_T.contiguous(), scale,
                          None if sinks is None else sinks.contiguous(), window, key_end_T, softcap, chunk)
        return o_TNH

    return tree_attention
