"""Segment tree attention: exact attention over a DFS-ordered prefix forest at cost ~ sum_t depth(t).

Mask rule (see reference.py and docs/prefix_tree.md): key j is visible to query i  <=>  j <= i < sub_end[j].

The forest is cut into *chains* (compressed-trie nodes): maximal runs of tokens in which each token is the only
child of the one before. Token i+1 continues i's chain  <=>  sub_end[i+1] == sub_end[i]. A chain c of length L_c
whose first token has depth d_c sees its ancestor path (d_c keys) plus its own tokens, bottom-right causal:

    o_i = softmax(q_i K_c^T * scale + mask) V_c,   K_c = keys of path(c) ++ chain(c),   key m visible to the
    r-th query of the chain  <=>  m <= d_c + r

so the work is sum_c L_c (d_c + L_c) ~ sum_t depth(t), not T^2. Suffix queries (q holds only the last Tq tokens,
see ops.py) cut the chains at the first query and skip those before it. Everything is derived from sub_end with
vectorised torch ops (no Python loop over chains):
- depth_T by a difference array: each j adds 1 on (j, sub_end[j]);
- the ancestor of token i at depth m is the last token at depth m that is <= i: one searchsorted in the tokens
  sorted by (depth, index);
- short chains (L_c <= QUERY_BLOCK) are grouped by (L, key count) rounded up to 4 steps per octave (<= 25% padding
  per side), each group is one batched SDPA call with a boolean mask;
- a long chain gathers its keys once and runs its queries in blocks of QUERY_BLOCK against prefixes of them.
GQA without repeating K/V: the N/K query heads that share a key head become extra query rows.
Autograd flows through the gathers, SDPA and the final index_copy, so backward is exact too.
Sliding windows (ops.py) narrow each chain's mask by key depth; attention sinks replace SDPA by an explicit softmax
with one more column per head (autograd gives the sinks their gradient), as soft-capped scores (Gemma 2) do. Chunked
attention (Llama 4) keeps, for a query at depth d, the keys whose depth lies in d's chunk. Bidirectional blocks
(``key_end``, ops.py) lie inside one chain: a query of a block sees ``key_end[i] - i - 1`` more of its chain's keys (its
block's rest).

Legend: T = tree tokens, N = query heads, K = key/value heads, H = head dim, C = chains, B = chains in a group,
L = padded queries per chain, J = padded keys per chain, R = N // K query heads per key head.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from forge_megatron.kernels.tree_attention.ops import (check_chunk, check_extras, check_inputs, check_key_end,
                                                       check_softcap, resolve_scale)

QUERY_BLOCK = 512  # chains longer than this are processed alone, in query blocks of this size


def tree_attention_segment(
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
    """Exact tree attention, cost ~ sum of token depths. Returns o_TNH; differentiable in q, k, v (and the sinks);
    sinks, window, key_end (bidirectional blocks), softcap (soft-capped scores) and chunk (chunked attention) as in
    ops.py."""
    check_inputs(q_TNH, k_TKH, v_TKH, sub_end_T)
    window = check_extras(q_TNH, sinks, window)
    softcap, chunk = check_softcap(softcap), check_chunk(chunk)
    ahead_T = None  # per token, the keys after it in its block
    if key_end_T is not None:
        check_key_end(key_end_T, sub_end_T)
        ahead_T = key_end_T.long() - torch.arange(sub_end_T.shape[0], device=sub_end_T.device) - 1
    scale = resolve_scale(softmax_scale, q_TNH.shape[2])
    Hv = v_TKH.shape[2]
    if q_TNH.shape[0] == 0:
        return q_TNH.new_zeros((0, q_TNH.shape[1], Hv))
    q_start = k_TKH.shape[0] - q_TNH.shape[0]  # suffix queries: q holds tokens [q_start, T)
    forest = Forest(sub_end_T, q_start)
    groups = list(forest.short_chain_groups(window, ahead_T, chunk))
    chains = forest.long_chains()
    arange = functools.partial(torch.arange, device=sub_end_T.device)
    q_idx = [g.q_idx_BL.flatten() for g in groups] + [arange(start, end) for start, end in chains]
    key_idx = [g.key_idx_BJ.flatten() for g in groups] + [forest.path_keys(start, end) for start, end in chains]
    if q_start:
        q_idx = [idx - q_start for idx in q_idx]
    # One gather per input, then views: per-piece indexing would give every piece a T-sized gradient buffer.
    # 16-bit inputs are computed in fp32: a key shared by many chains sums one partial gradient per chain, and
    # rounding each partial to 16 bits would double the error of the same math done in one pass.
    work = torch.float32 if q_TNH.element_size() < 4 else q_TNH.dtype
    sinks = None if sinks is None else sinks.to(work)
    q_parts = _gather_split(q_TNH, q_idx, work)
    k_parts, v_parts = _gather_split(k_TKH, key_idx, work), _gather_split(v_TKH, key_idx, work)
    rows, outs = [], []
    for g, q_part, k_part, v_part in zip(groups, q_parts, k_parts, v_parts):
        B, L = g.q_idx_BL.shape
        J = g.key_idx_BJ.shape[1]
        o_BLNH = _attend(
            q_part.view(B, L, *q_TNH.shape[1:]), k_part.view(B, J, *k_TKH.shape[1:]),
            v_part.view(B, J, *v_TKH.shape[1:]), g.allowed_BLJ, scale, sinks, softcap,
        )
        rows.append(g.q_idx_BL[g.row_valid_BL] - q_start)  # q's rows
        outs.append(o_BLNH[g.row_valid_BL])
    n = len(groups)
    for idx_L, q_LNH, k_JKH, v_JKH in zip(q_idx[n:], q_parts[n:], k_parts[n:], v_parts[n:]):
        rows.append(idx_L)  # already q's rows
        ahead_L = None if ahead_T is None else ahead_T[idx_L + q_start]
        outs.append(_attend_long_chain(q_LNH, k_JKH, v_JKH, scale, sinks, window, ahead_L, softcap, chunk))
    o_TNH = q_TNH.new_zeros((q_TNH.shape[0], q_TNH.shape[1], Hv), dtype=work)
    return o_TNH.index_copy(0, torch.cat(rows), torch.cat(outs)).to(q_TNH.dtype)


def _gather_split(x_T, idx_list: list[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """x_T[cat(idx_list)] in ``dtype``, split back into one piece per index tensor."""
    return x_T.to(dtype)[torch.cat(idx_list)].split([idx.numel() for idx in idx_list])


def _attend_long_chain(q_LNH, k_JKH, v_JKH, scale: float, sinks=None, window: int = 0,
                       ahead_L: torch.Tensor | None = None, softcap: float = 0.0, chunk: int = 0) -> torch.Tensor:
    """One chain (its queries are the last L of its J keys; key m has depth m), in query blocks against prefixes
    of the keys; ``ahead_L``: the keys each query sees past itself (its bidirectional block's rest)."""
    L, J = q_LNH.shape[0], k_JKH.shape[0]
    outs = []
    for a, q_block in zip(range(0, L, QUERY_BLOCK), q_LNH.split(QUERY_BLOCK)):
        r = torch.arange(q_block.shape[0], device=q_LNH.device)
        own = J - L + a + r  # each query's own key
        last_seen = own if ahead_L is None else own + ahead_L[a:a + q_block.shape[0]]
        n_keys = int(last_seen.max()) + 1
        m = torch.arange(n_keys, device=q_LNH.device)
        allowed_LJ = m[None, :] <= last_seen[:, None]
        if window:
            allowed_LJ &= m[None, :] > (own[:, None] - window)
        if chunk:
            allowed_LJ &= (m[None, :] // chunk) == (own[:, None] // chunk)
        o_BLNH = _attend(q_block[None], k_JKH[None, :n_keys], v_JKH[None, :n_keys], allowed_LJ[None], scale, sinks,
                         softcap)
        outs.append(o_BLNH[0])
    return torch.cat(outs)


class ChainGroup(NamedTuple):
    """B short chains padded to L queries and J keys, attended in one batched call."""

    q_idx_BL: torch.Tensor  # query token of each row (padded rows repeat the chain's first token)
    row_valid_BL: torch.Tensor  # False on padded rows
    key_idx_BJ: torch.Tensor  # ancestors root-first, then the chain's own tokens (padded slots: token 0)
    allowed_BLJ: torch.Tensor  # bottom-right causal within each chain, padded keys masked


class Forest:
    """Chains, depths and ancestor lookup of a DFS-ordered forest, derived from sub_end alone (and validated).

    With ``q_start`` > 0 only tokens [q_start, T) are queries: the chains are cut at q_start and those before it
    dropped (their tokens stay keys: ancestors of the queries)."""

    def __init__(self, sub_end_T: torch.Tensor, q_start: int = 0):
        sub_end_T = sub_end_T.long()
        T = sub_end_T.numel()
        device = sub_end_T.device
        self.T = T
        self.device = device
        idx_T = torch.arange(T, device=device)
        if not bool(((sub_end_T > idx_T) & (sub_end_T <= T)).all()):
            raise ValueError(f"sub_end must satisfy i < sub_end[i] <= T = {T} for every token i (a DFS subtree end)")
        diff = torch.zeros(T + 1, dtype=torch.long, device=device)
        diff.index_add_(0, idx_T + 1, torch.ones_like(idx_T))
        diff.index_add_(0, sub_end_T, -torch.ones_like(idx_T))
        self.depth_T = torch.cumsum(diff, 0)[:T]
        self.sorted_key_T, self.order_T = torch.sort(self.depth_T * T + idx_T)
        is_start_T = torch.ones(T, dtype=torch.bool, device=device)
        is_start_T[1:] = sub_end_T[1:] != sub_end_T[:-1]
        if q_start:
            is_start_T[:q_start] = False
            if q_start < T:
                is_start_T[q_start] = True
        self.start_C = torch.nonzero(is_start_T).flatten()
        self.end_C = torch.cat([self.start_C[1:], torch.tensor([T], device=device)])
        self._check_nested(sub_end_T)

    def _check_nested(self, sub_end_T: torch.Tensor) -> None:
        """Every non-root token's parent (the last token one level up) covers it and contains its subtree.

        With depth = number of covering subtrees, this holds iff the subtrees nest (no two partly overlap).
        """
        child = torch.nonzero(self.depth_T > 0).flatten()
        parent = self.ancestor(child, self.depth_T[child] - 1)
        nested = (
            (self.depth_T[parent] == self.depth_T[child] - 1)
            & (sub_end_T[parent] > child)
            & (sub_end_T[child] <= sub_end_T[parent])
        )
        if not bool(nested.all()):
            i = int(child[~nested][0])
            raise ValueError(
                f"sub_end is not a DFS forest layout: the subtree of token {i}, [{i}, {int(sub_end_T[i])}), is not "
                f"nested in the subtree of its parent {int(parent[~nested][0])}"
            )

    def ancestor(self, token: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """Index of the ancestor of ``token`` at ``depth`` (broadcast; requires depth <= depth_T[token])."""
        pos = torch.searchsorted(self.sorted_key_T, depth * self.T + token, right=True) - 1
        return self.order_T[pos]

    def path_keys(self, start: int, end: int) -> torch.Tensor:
        """Key indices of the chain [start, end): its ancestors root-first, then its own tokens."""
        n_keys = int(self.depth_T[end - 1]) + 1
        return self.ancestor(torch.tensor(end - 1, device=self.device), torch.arange(n_keys, device=self.device))

    def long_chains(self) -> list[tuple[int, int]]:
        is_long_C = (self.end_C - self.start_C) > QUERY_BLOCK
        return list(zip(self.start_C[is_long_C].tolist(), self.end_C[is_long_C].tolist()))

    def short_chain_groups(self, window: int = 0, ahead_T: torch.Tensor | None = None, chunk: int = 0):
        """Yield one ChainGroup per bucket of short chains (equal padded query and key counts); with ``window``
        the masks keep only keys less than ``window`` levels above each query; ``ahead_T``: the keys each token
        sees past itself (its bidirectional block's rest, in its chain); with ``chunk`` only the keys of each
        query's chunk of depths."""
        length_C = self.end_C - self.start_C
        short_C = torch.nonzero(length_C <= QUERY_BLOCK).flatten()
        if short_C.numel() == 0:
            return
        start_C, length_C = self.start_C[short_C], length_C[short_C]
        last_C = self.end_C[short_C] - 1
        n_keys_C = self.depth_T[last_C] + 1
        padded_L_C, padded_J_C = _round_up(length_C), _round_up(n_keys_C)
        bucket_C = padded_L_C * (int(padded_J_C.max()) + 1) + padded_J_C
        buckets, bucket_of_C = torch.unique(bucket_C, return_inverse=True)
        for b in range(buckets.numel()):
            members = torch.nonzero(bucket_of_C == b).flatten()
            L, J = int(padded_L_C[members[0]]), int(padded_J_C[members[0]])
            yield self._group(start_C[members], length_C[members], last_C[members], n_keys_C[members], L, J, window,
                              ahead_T, chunk)

    def _group(self, start_B, length_B, last_B, n_keys_B, L: int, J: int, window: int = 0, ahead_T=None,
               chunk: int = 0):
        r_L = torch.arange(L, device=self.device)
        m_J = torch.arange(J, device=self.device)
        row_valid_BL = r_L[None, :] < length_B[:, None]
        q_idx_BL = torch.where(row_valid_BL, start_B[:, None] + r_L[None, :], start_B[:, None])
        key_valid_BJ = m_J[None, :] < n_keys_B[:, None]
        depth_BJ = torch.minimum(m_J[None, :], n_keys_B[:, None] - 1)
        key_idx_BJ = torch.where(key_valid_BJ, self.ancestor(last_B[:, None], depth_BJ), 0)
        first_depth_B = n_keys_B - length_B
        last_seen_BL = first_depth_B[:, None] + r_L[None, :]  # the depth of the last key each row sees
        if ahead_T is not None:
            last_seen_BL = last_seen_BL + torch.where(row_valid_BL, ahead_T[q_idx_BL], 0)
        causal_BLJ = m_J[None, None, :] <= last_seen_BL[:, :, None]
        allowed_BLJ = key_valid_BJ[:, None, :] & causal_BLJ  # padded rows see real keys: never an empty softmax
        if window:  # key m (depth m) within the window of the query at depth first + r; padded rows exempt
            in_window_BLJ = m_J[None, None, :] > (first_depth_B[:, None, None] + r_L[None, :, None] - window)
            allowed_BLJ = allowed_BLJ & (in_window_BLJ | ~row_valid_BL[:, :, None])
        if chunk:  # key m in the chunk of the query at depth first + r; padded rows exempt
            own_chunk_BL = torch.div(first_depth_B[:, None] + r_L[None, :], chunk, rounding_mode="floor")
            in_chunk_BLJ = torch.div(m_J, chunk, rounding_mode="floor")[None, None, :] == own_chunk_BL[:, :, None]
            allowed_BLJ = allowed_BLJ & (in_chunk_BLJ | ~row_valid_BL[:, :, None])
        return ChainGroup(q_idx_BL, row_valid_BL, key_idx_BJ, allowed_BLJ)


def _attend(q_BLNH, k_BJKH, v_BJKH, allowed_BLJ, scale: float, sinks=None, softcap: float = 0.0) -> torch.Tensor:
    """Masked attention of B independent query/key sets, GQA by folding R query heads into the query rows (head
    n = key head n // R, row r * L + l of it); ``sinks``: one more softmax column per head, without a value;
    ``softcap`` c: scores c * tanh(s / c) (0: as they are). Every row has a key it may see (padded rows too)."""
    B, L, N, H = q_BLNH.shape
    K, Hv = k_BJKH.shape[2], v_BJKH.shape[3]
    R = N // K
    q_BKRH = q_BLNH.view(B, L, K, R, H).permute(0, 2, 3, 1, 4).reshape(B, K, R * L, H)
    mask_B1RJ = allowed_BLJ.repeat(1, R, 1)[:, None]
    if sinks is None and not softcap:
        o_BKRH = F.scaled_dot_product_attention(
            q_BKRH, k_BJKH.transpose(1, 2), v_BJKH.transpose(1, 2), attn_mask=mask_B1RJ, scale=scale
        )
    else:
        s_BKRJ = (q_BKRH @ k_BJKH.permute(0, 2, 3, 1)) * scale
        if softcap:
            s_BKRJ = torch.tanh(s_BKRJ / softcap) * softcap
        s_BKRJ = s_BKRJ.masked_fill(~mask_B1RJ, float("-inf"))
        if sinks is None:
            p_BKRJ = s_BKRJ.softmax(-1)
        else:
            sink_1KR1 = sinks.view(K, R, 1).expand(K, R, L).reshape(1, K, R * L, 1).expand(B, -1, -1, -1)
            p_BKRJ = torch.cat([sink_1KR1, s_BKRJ], dim=-1).softmax(-1)[..., 1:]
        o_BKRH = p_BKRJ @ v_BJKH.transpose(1, 2)
    return o_BKRH.view(B, K, R, L, Hv).permute(0, 3, 1, 2, 4).reshape(B, L, N, Hv)


def _round_up(x: torch.Tensor) -> torch.Tensor:
    """Round positive sizes up to 4 steps per octave (exact below 8), so padding stays under 25%."""
    shift = torch.clamp(torch.floor(torch.log2(x.double())).long() - 2, min=0)
    step = torch.pow(2, shift)
    return (x + step - 1) // step * step
