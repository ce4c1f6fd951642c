"""Reference tree attention: the executable specification every other backend is tested against.

Layout (see docs/prefix_tree.md): T unique tokens of a forest laid out in DFS pre-order; ``sub_end[j]`` is the
exclusive end of the subtree rooted at token j. Key j is visible to query i  <=>  j <= i < sub_end[j]
(j is an ancestor of i, or i itself). A sample is a root-to-node path, so attention over the forest equals
causal attention of every sample alone.

Bidirectional blocks (Gemma 3's images: the tokens of one image see each other): ``key_end[i]`` is the exclusive
end, by index, of the keys query i may see: i + 1 for a causal token, the end of its block for a token of a block.
Key j is then visible to query i  <=>  j < key_end[i] and i < sub_end[j]. A block lies inside one chain of the tree
(its tokens are each the only child of the one before), so the keys after i it adds are i's block's own.

Legend: T = packed tree tokens, N = query heads, K = key/value heads (GQA: N % K == 0), H = head dim.
Dense O(T^2) mask through SDPA: small inputs only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def tree_mask(sub_end_T: torch.Tensor, num_queries: int | None = None, window: int | None = None,
              key_end_T: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """Boolean [Tq, T] mask, True where query i may attend key j; the queries are the last ``num_queries`` (default
    all T) tokens; with ``window`` only keys less than ``window`` positions above the query (ops.py); ``key_end``
    (int [T], None: causal) the bidirectional blocks (above); with ``chunk`` only keys whose depth lies in the
    query's chunk of ``chunk`` positions (ops.py)."""
    from forge_megatron.kernels.tree_attention.ops import depths

    T = sub_end_T.shape[0]
    Tq = T if num_queries is None else num_queries
    k = torch.arange(T, device=sub_end_T.device)[None, :]
    q = torch.arange(T - Tq, T, device=sub_end_T.device)[:, None]
    upper = q + 1 if key_end_T is None else key_end_T.to(k.dtype)[T - Tq:, None]
    mask = (k < upper) & (q < sub_end_T.to(k.dtype)[None, :])
    if window or chunk:
        depth_T = depths(sub_end_T).long()
    if window:
        mask &= (depth_T[T - Tq:, None] - depth_T[None, :]) < window
    if chunk:
        mask &= (depth_T[T - Tq:, None] // chunk) == (depth_T[None, :] // chunk)
    return mask


def tree_attention_reference(
    q_TNH: torch.Tensor,
    k_TKH: torch.Tensor,
    v_TKH: torch.Tensor,
    sub_end_T: torch.Tensor,
    softmax_scale: float | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    key_end_T: torch.Tensor | None = None,
    explicit: bool = False,
    softcap: float | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Exact tree attention through SDPA with a dense boolean mask (with ``sinks``, ``softcap`` or ``explicit``:
    plain tensor ops, an explicit softmax, with one more column per head for the sinks). Returns o_TNH.

    q may hold only the last Tq of the T tokens k, v and sub_end describe (suffix queries, see ops.py); sinks,
    window, key_end, softcap (scores c * tanh(s / c)) and chunk (chunked attention) as in ops.py. The explicit ops round every intermediate (scores, probabilities) to the
    inputs' dtype, and autograd's backward likewise, where SDPA's fused kernels keep fp32 inside: in bf16 they are
    the low-precision math of the FlashAttention tolerance rule the kernel tests use."""
    Tq, N, H = q_TNH.shape  # v may have another head size (o takes it)
    T, K = k_TKH.shape[:2]
    if N % K != 0:
        raise ValueError(f"query heads ({N}) must be a multiple of key/value heads ({K})")
    if sub_end_T.shape != (T,) or Tq > T:
        raise ValueError(f"sub_end must have shape [{T}] (the keys' tokens) and q at most {T} rows, got sub_end "
                         f"{tuple(sub_end_T.shape)} and q {tuple(q_TNH.shape)}")
    scale = softmax_scale if softmax_scale is not None else H ** -0.5
    rep = N // K
    k_TNH = k_TKH.repeat_interleave(rep, dim=1)
    v_TNH = v_TKH.repeat_interleave(rep, dim=1)
    if key_end_T is not None:
        from forge_megatron.kernels.tree_attention.ops import check_key_end

        check_key_end(key_end_T, sub_end_T)
    mask_QT = tree_mask(sub_end_T, Tq, window, key_end_T, chunk)
    if sinks is None and not explicit and not softcap:
        o_NTH = F.scaled_dot_product_attention(
            q_TNH.transpose(0, 1), k_TNH.transpose(0, 1), v_TNH.transpose(0, 1), attn_mask=mask_QT, scale=scale
        )
        return o_NTH.transpose(0, 1)
    s_NQT = torch.einsum("qnh,tnh->nqt", q_TNH, k_TNH) * scale
    if softcap:
        s_NQT = torch.tanh(s_NQT / softcap) * softcap
    s_NQT = s_NQT.masked_fill(~mask_QT, float("-inf"))
    if sinks is None:
        p_NQT = s_NQT.softmax(-1)
    else:
        sink_NQ1 = sinks.to(s_NQT.dtype)[:, None, None].expand(-1, Tq, 1)
        p_NQT = torch.cat([sink_NQ1, s_NQT], dim=-1).softmax(-1)[..., 1:]
    return torch.einsum("nqt,tnh->qnh", p_NQT, v_TNH)
