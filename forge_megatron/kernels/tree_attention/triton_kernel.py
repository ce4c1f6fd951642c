"""Tree attention in Triton: FlashAttention-2 forward and backward with tile skipping over a DFS-ordered forest.

Mask: key j is visible to query i  <=>  j <= i < sub_end[j]. A tile (queries [q_lo, q_hi), keys [k_lo, k_hi)) is
  empty   if k_lo >= q_hi or max(sub_end[k_lo:k_hi]) <= q_lo          -> skipped,
  full    if k_hi - 1 <= q_lo and min(sub_end[k_lo:k_hi]) >= q_hi    -> no mask,
  partial otherwise                                                  -> mask per element.
Per key block min/max(sub_end) come from a tiny Triton kernel. Padded keys (past T) only occur in the last key
block, which never satisfies k_hi - 1 <= q_lo with the unclamped k_hi, so full tiles never see padding.

Forward (online softmax, base 2): s = scale * log2(e) * q.k; m = running max; l = running sum of 2^(s - m);
o = sum 2^(s - m) v / l; lse_i = (m + log2 l) * ln 2 (natural log, saved for the backward).
Backward (FA2): P = exp(scale q.k - lse), delta_i = rowsum(dO * O), dV = P^T dO, dS = P * (dO V^T - delta),
dQ = scale dS K, dK = scale dS^T Q. dK/dV are summed over the N/K query heads of each key/value head (GQA) inside
one program, so no atomics are needed. Loads are upcast to fp32 under TRITON_INTERPRET=1 (bf16 arithmetic is wrong
in the interpreter) and for fp32 inputs; on GPU fp16/bf16 tiles go to tl.dot natively with fp32 accumulation.

Suffix queries (ops.py): the TQ query rows are tree tokens [T - TQ, T); query tiles are laid from T - TQ, the mask
and the tile tests use tree positions, rows of q/o/lse are positions minus T - TQ.

Attention sinks (ops.py) start each row's online softmax at the head's sink logit with nothing accumulated
(m = sink, l = 1), so o and lse include them and the backward is unchanged (its P comes from that lse). A sliding
window (WINDOW > 0) masks keys whose depth (DEPTH, ops.depths) is WINDOW or more below the query's; every tile is then
masked element-wise (no full-tile fast path), and a tile whose keys all lie WINDOW or more levels above every query
of it (max depth of the key block, KDMAX, + WINDOW <= min depth of the query block, QDMIN) is skipped like an empty
one: along an agent episode's chain depth grows with position, so a windowed layer visits about T x W / BLOCK^2
tiles instead of T^2 / 2 BLOCK^2 (``window_live_tiles`` counts them).

Bidirectional blocks (ops.py; HAS_KEY_END, a constexpr: without key_end the kernels compile to the causal code
above): key j is visible to query i  <=>  j < key_end[i] and i < sub_end[j] (and the window). With, per query block,
KEMIN / KEMAX = min / max of key_end over its queries, and per key block KMIN / KMAX = min / max of sub_end, a tile is
  empty   if k_lo >= KEMAX or KMAX <= q_lo                          -> skipped,
  full    if k_hi <= KEMIN and KMIN >= q_hi (and no window)          -> no mask,
  partial otherwise                                                  -> mask per element (j < key_end[i]).
(Without key_end, key_end[i] = i + 1 gives back the rules above: KEMAX = q_hi, KEMIN = q_lo + 1.) The forward and dQ
loops run over the key blocks below KEMAX (a block's keys may lie past q_hi). The dK/dV loop of a key block starts
at the query block of KQSTART = min{i : key_end[i] > k_lo} (<= k_lo; that query sees key k_lo, as i <= k_lo <
sub_end[k_lo], and none before it sees a key >= k_lo: the bound is exact without a window), the first index where
the running max of key_end passes k_lo, and skips query blocks with KEMAX <= k_lo (never the case for key_end made of
blocks, whose tokens between KQSTART and k_lo all see k_lo; possible for other key_end ops.check_key_end admits). The
last key block, padded past T, is never full (its unclamped k_hi > T >= KEMIN); padded query rows read key_end 0 and
see nothing. The window's depth test stays a valid skip: it is ANDed onto visibility, and keys past a query in its
block are deeper (depth[i] - depth[j] < 0 < WINDOW).

Value heads may differ in size from query/key heads (multi-latent attention: H = 192, HV = 128): v, o, dO and dV
tiles are BLOCK_HV wide, q, k, dQ and dK tiles BLOCK_H.

Legend: T = packed tree tokens (keys), TQ = query rows, N = query heads, K = key/value heads, H = query/key head dim,
HV = value head dim, B = key blocks. KEY_END / QKEMIN / QKEMAX / KQSTART: key_end, KEMIN / KEMAX per query block and
KQSTART per key block.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from forge_megatron.kernels.tree_attention.ops import depths, make_public_entry, register_tree_attention_ops

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 512
# Heads wider than this take 32 x 32 tiles (Gemma 4's global heads of 512): 64 x 64 tiles of 512-wide heads need
# more shared memory than a Hopper SM has (about 260 KiB for the backward, 227 KiB available), 32 x 32 ones about
# 66-112 KiB (tests/kernels/triton_aot.py prints them).
WIDE_HEAD_DIM = 256
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _key_block_bounds_kernel(SUB_END, KMIN, KMAX, T, BLOCK_N: tl.constexpr):
    """KMIN[b], KMAX[b] = min, max of sub_end over key block b (padding ignored)."""
    b = tl.program_id(0)
    offs = b * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = offs < T
    se = tl.load(SUB_END + offs, mask=inside, other=0)
    tl.store(KMAX + b, tl.max(se, axis=0))
    tl.store(KMIN + b, tl.min(tl.where(inside, se, 2147483647), axis=0))


@triton.jit
def _tile_visible(offs_m, offs_n, SUB_END, T, DEPTH, KEY_END, WINDOW: tl.constexpr, HAS_KEY_END: tl.constexpr):
    """Element mask of a partial tile: j <= i < sub_end[j] (sub_end of padded keys reads as 0 -> invisible), with
    bidirectional blocks j < key_end[i] instead of j <= i (key_end of padded queries reads as 0 -> they see
    nothing), and with a window depth[i] - depth[j] < WINDOW."""
    se = tl.load(SUB_END + offs_n, mask=offs_n < T, other=0)
    if HAS_KEY_END:
        ke = tl.load(KEY_END + offs_m, mask=offs_m < T, other=0)
        visible = (offs_n[None, :] < ke[:, None]) & (offs_m[:, None] < se[None, :])
    else:
        visible = (offs_n[None, :] <= offs_m[:, None]) & (offs_m[:, None] < se[None, :])
    if WINDOW > 0:
        dq = tl.load(DEPTH + offs_m, mask=offs_m < T, other=0)
        dk = tl.load(DEPTH + offs_n, mask=offs_n < T, other=0)
        visible = visible & ((dq[:, None] - dk[None, :]) < WINDOW)
    return visible


@triton.jit
def _tile_is_full(q_lo, q_hi, k_lo, kmin, kemin, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
                  HAS_KEY_END: tl.constexpr):
    """Every key of the tile is visible to every query: with bidirectional blocks the last key lies below the least
    key_end of the query block (kemin), else at or below the first query; every key's subtree holds the last query
    (kmin = min sub_end of the key block); no window."""
    if HAS_KEY_END:
        keys_below = k_lo + BLOCK_N <= kemin
    else:
        keys_below = k_lo + BLOCK_N - 1 <= q_lo
    return keys_below & (kmin >= q_hi) & (WINDOW == 0)


@triton.jit
def _load_rows(PTR, offs_t, T, stride_t, offs_h, H, COMPUTE: tl.constexpr):
    """Load a [rows, BLOCK_H] tile of one head, zero outside [0, T) x [0, H), cast to the compute dtype."""
    mask = (offs_t[:, None] < T) & (offs_h[None, :] < H)
    return tl.load(PTR + offs_t[:, None] * stride_t + offs_h[None, :], mask=mask, other=0.0).to(COMPUTE)


@triton.jit
def _store_rows(PTR, x, offs_t, T, stride_t, offs_h, H):
    mask = (offs_t[:, None] < T) & (offs_h[None, :] < H)
    tl.store(PTR + offs_t[:, None] * stride_t + offs_h[None, :], x.to(PTR.dtype.element_ty), mask=mask)


@triton.jit
def _row_stats(LSE, DELTA, n, rows_m, TQ):
    """Saved log-sum-exp (converted to base 2) and delta = rowsum(dO * O) of query rows rows_m, head n."""
    lse2 = tl.load(LSE + n * TQ + rows_m, mask=rows_m < TQ, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + n * TQ + rows_m, mask=rows_m < TQ, other=0.0)
    return lse2, delta


@triton.jit
def _query_block_keys(QKEMIN, QKEMAX, q_hi, HAS_KEY_END: tl.constexpr):
    """(the end of the keys the query block sees, the least key_end of its queries): with bidirectional blocks no
    query of the block sees a key at or past the block's greatest key_end; causally the keys end at q_hi (kemin is
    then unused)."""
    if HAS_KEY_END:
        k_end = tl.load(QKEMAX + tl.program_id(0))
        kemin = tl.load(QKEMIN + tl.program_id(0))
    else:
        k_end = q_hi
        kemin = 0
    return k_end, kemin


@triton.jit
def _probabilities(q, k, lse2, offs_m, offs_n, q_lo, q_hi, k_lo, kmin, kemin, SUB_END, T, qk_scale, DEPTH, KEY_END,
                   WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   HAS_KEY_END: tl.constexpr):
    """Recomputed softmax probabilities P = 2^(s - lse2) of one tile, zero where the tree mask hides the key."""
    p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale - lse2[:, None])
    if not _tile_is_full(q_lo, q_hi, k_lo, kmin, kemin, BLOCK_N, WINDOW, HAS_KEY_END):
        p = tl.where(_tile_visible(offs_m, offs_n, SUB_END, T, DEPTH, KEY_END, WINDOW, HAS_KEY_END), p, 0.0)
    return p


@triton.jit
def _fwd_kernel(
    Q, K, V, SUB_END, KMIN, KMAX, O, LSE, SINKS, DEPTH, KDMAX, QDMIN, KEY_END, QKEMIN, QKEMAX, KQSTART,
    T, TQ, H, HV, qk_scale,
    stride_qt, stride_qn, stride_kt, stride_kn, stride_vt, stride_vn, stride_ot, stride_on,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr, COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SINKS: tl.constexpr,
    WINDOW: tl.constexpr, HAS_KEY_END: tl.constexpr,
):
    n = tl.program_id(1)
    q0 = T - TQ  # the TQ queries are tree tokens [q0, T); row r of Q, O and LSE is token q0 + r
    q_lo = q0 + tl.program_id(0) * BLOCK_M
    q_hi = tl.minimum(q_lo + BLOCK_M, T)
    offs_m = q_lo + tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, BLOCK_H)
    offs_hv = tl.arange(0, BLOCK_HV)
    q = _load_rows(Q + n * stride_qn, offs_m - q0, TQ, stride_qt, offs_h, H, COMPUTE)
    K_head = K + (n // GROUP) * stride_kn
    V_head = V + (n // GROUP) * stride_vn

    if HAS_SINKS:  # the sink's term: exp(sink) in the denominator, no value
        m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(SINKS + n).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_HV], tl.float32)
    if WINDOW > 0:
        qdmin = tl.load(QDMIN + tl.program_id(0))
    k_end, kemin = _query_block_keys(QKEMIN, QKEMAX, q_hi, HAS_KEY_END)
    for kb in range(0, tl.cdiv(k_end, BLOCK_N)):
        live = tl.load(KMAX + kb) > q_lo  # otherwise the tile is empty
        if WINDOW > 0:  # or every key is WINDOW or more levels above every query
            live = live & (tl.load(KDMAX + kb) + WINDOW > qdmin)
        if live:
            k_lo = kb * BLOCK_N
            offs_n = k_lo + tl.arange(0, BLOCK_N)
            k = _load_rows(K_head, offs_n, T, stride_kt, offs_h, H, COMPUTE)
            v = _load_rows(V_head, offs_n, T, stride_vt, offs_hv, HV, COMPUTE)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            if not _tile_is_full(q_lo, q_hi, k_lo, tl.load(KMIN + kb), kemin, BLOCK_N, WINDOW, HAS_KEY_END):
                s = tl.where(_tile_visible(offs_m, offs_n, SUB_END, T, DEPTH, KEY_END, WINDOW, HAS_KEY_END), s,
                             float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v, input_precision=DOT_PRECISION)
            m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    _store_rows(O + n * stride_on, acc / l_safe[:, None], offs_m - q0, TQ, stride_ot, offs_hv, HV)
    tl.store(LSE + n * TQ + offs_m - q0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, mask=offs_m < T)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, SUB_END, KMIN, KMAX, LSE, DELTA, DQ, DEPTH, KDMAX, QDMIN, KEY_END, QKEMIN, QKEMAX, KQSTART,
    T, TQ, H, HV, qk_scale, scale,
    stride_qt, stride_qn, stride_kt, stride_kn, stride_vt, stride_vn, stride_ot, stride_on,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr, COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr,
    HAS_KEY_END: tl.constexpr,
):
    n = tl.program_id(1)
    q0 = T - TQ
    q_lo = q0 + tl.program_id(0) * BLOCK_M
    q_hi = tl.minimum(q_lo + BLOCK_M, T)
    offs_m = q_lo + tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, BLOCK_H)
    offs_hv = tl.arange(0, BLOCK_HV)
    q = _load_rows(Q + n * stride_qn, offs_m - q0, TQ, stride_qt, offs_h, H, COMPUTE)
    do = _load_rows(DO + n * stride_on, offs_m - q0, TQ, stride_ot, offs_hv, HV, COMPUTE)
    lse2, delta = _row_stats(LSE, DELTA, n, offs_m - q0, TQ)
    K_head = K + (n // GROUP) * stride_kn
    V_head = V + (n // GROUP) * stride_vn

    dq = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    if WINDOW > 0:
        qdmin = tl.load(QDMIN + tl.program_id(0))
    k_end, kemin = _query_block_keys(QKEMIN, QKEMAX, q_hi, HAS_KEY_END)
    for kb in range(0, tl.cdiv(k_end, BLOCK_N)):
        live = tl.load(KMAX + kb) > q_lo  # otherwise the tile is empty
        if WINDOW > 0:  # or every key is WINDOW or more levels above every query
            live = live & (tl.load(KDMAX + kb) + WINDOW > qdmin)
        if live:
            k_lo = kb * BLOCK_N
            offs_n = k_lo + tl.arange(0, BLOCK_N)
            k = _load_rows(K_head, offs_n, T, stride_kt, offs_h, H, COMPUTE)
            v = _load_rows(V_head, offs_n, T, stride_vt, offs_hv, HV, COMPUTE)
            p = _probabilities(q, k, lse2, offs_m, offs_n, q_lo, q_hi, k_lo, tl.load(KMIN + kb), kemin, SUB_END,
                               T, qk_scale, DEPTH, KEY_END, WINDOW, BLOCK_N, DOT_PRECISION, HAS_KEY_END)
            ds = p * (tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION) - delta[:, None])
            dq += tl.dot(ds.to(COMPUTE), k, input_precision=DOT_PRECISION)
    _store_rows(DQ + n * stride_qn, dq * scale, offs_m - q0, TQ, stride_qt, offs_h, H)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, SUB_END, KMIN, KMAX, LSE, DELTA, DK, DV, DEPTH, KDMAX, QDMIN, KEY_END, QKEMIN, QKEMAX, KQSTART,
    T, TQ, H, HV, qk_scale, scale,
    stride_qt, stride_qn, stride_kt, stride_kn, stride_vt, stride_vn, stride_ot, stride_on,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr, COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr,
    HAS_KEY_END: tl.constexpr,
):
    kb = tl.program_id(0)
    kv = tl.program_id(1)
    k_lo = kb * BLOCK_N
    offs_n = k_lo + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    offs_hv = tl.arange(0, BLOCK_HV)
    k = _load_rows(K + kv * stride_kn, offs_n, T, stride_kt, offs_h, H, COMPUTE)
    v = _load_rows(V + kv * stride_vn, offs_n, T, stride_vt, offs_hv, HV, COMPUTE)
    kmin = tl.load(KMIN + kb)
    # Queries that see any key of this block lie in [k_lo, max(sub_end)) (with bidirectional blocks from KQSTART[kb],
    # the first query whose key_end passes k_lo), and the queries are tokens [q0, T): the loop visits only the
    # query blocks (tiled from q0) that overlap both.
    q0 = T - TQ
    if HAS_KEY_END:
        qb_start = (tl.maximum(tl.load(KQSTART + kb), q0) - q0) // BLOCK_M
    else:
        qb_start = (tl.maximum(k_lo, q0) - q0) // BLOCK_M
    qb_end = tl.maximum(tl.cdiv(tl.load(KMAX + kb) - q0, BLOCK_M), 0)

    dk = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_HV], tl.float32)
    if WINDOW > 0:
        kdmax = tl.load(KDMAX + kb)
    for g in range(GROUP):
        n = kv * GROUP + g
        for qb in range(qb_start, qb_end):
            if WINDOW > 0:  # a query block whose every query is WINDOW or more levels below every key: skipped
                live = tl.load(QDMIN + qb) < kdmax + WINDOW
            else:
                live = qb >= qb_start
            if HAS_KEY_END:  # a query block whose every key_end is at or below k_lo sees none of these keys
                live = live & (tl.load(QKEMAX + qb) > k_lo)
                kemin = tl.load(QKEMIN + qb)
            else:
                kemin = 0
            if live:
                q_lo = q0 + qb * BLOCK_M
                q_hi = tl.minimum(q_lo + BLOCK_M, T)
                offs_m = q_lo + tl.arange(0, BLOCK_M)
                q = _load_rows(Q + n * stride_qn, offs_m - q0, TQ, stride_qt, offs_h, H, COMPUTE)
                do = _load_rows(DO + n * stride_on, offs_m - q0, TQ, stride_ot, offs_hv, HV, COMPUTE)
                lse2, delta = _row_stats(LSE, DELTA, n, offs_m - q0, TQ)
                p = _probabilities(q, k, lse2, offs_m, offs_n, q_lo, q_hi, k_lo, kmin, kemin, SUB_END, T, qk_scale,
                                   DEPTH, KEY_END, WINDOW, BLOCK_N, DOT_PRECISION, HAS_KEY_END)
                dv += tl.dot(tl.trans(p.to(COMPUTE)), do, input_precision=DOT_PRECISION)
                ds = p * (tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION) - delta[:, None])
                dk += tl.dot(tl.trans(ds.to(COMPUTE)), q, input_precision=DOT_PRECISION)
    _store_rows(DK + kv * stride_kn, dk * scale, offs_n, T, stride_kt, offs_h, H)
    _store_rows(DV + kv * stride_vn, dv, offs_n, T, stride_vt, offs_hv, HV)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def gpu_launch_config(head_dim: int, compute: tl.dtype, v_head_dim: int | None = None) -> dict:
    """Block sizes, warps and dot precision of a GPU launch; ``compute`` is the dtype fed to tl.dot."""
    block_h = max(16, triton.next_power_of_2(head_dim))
    block_hv = max(16, triton.next_power_of_2(v_head_dim or head_dim))
    block = 32 if max(block_h, block_hv) > WIDE_HEAD_DIM else 64
    return dict(
        BLOCK_M=block, BLOCK_N=block, BLOCK_H=block_h, BLOCK_HV=block_hv, COMPUTE=compute,
        DOT_PRECISION="ieee" if compute == tl.float32 else None,  # fp32 inputs: exact fp32, not TF32
        num_warps=8 if max(block_h, block_hv) >= 128 else 4,
    )


def _launch_config(q_TNH: torch.Tensor, T: int, v_head_dim: int | None = None) -> dict:
    """GPU config for q's dtype; under the CPU interpreter big blocks and fp32 math (bf16 math is wrong there)."""
    H = q_TNH.shape[2]
    v_head_dim = v_head_dim or H
    if max(H, v_head_dim) > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {max(H, v_head_dim)} is not supported by the Triton tree attention kernel (max "
                         f"{MAX_HEAD_DIM})")
    if T * q_TNH.shape[1] * max(H, v_head_dim) >= 2**31:
        raise ValueError(f"{T} tokens x {q_TNH.shape[1]} heads x head_dim {max(H, v_head_dim)} needs offsets >= 2^31; "
                         "the Triton kernel uses int32 offsets: split the micro-batch")
    if _interpreting():
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_H=max(16, triton.next_power_of_2(H)),
                    BLOCK_HV=max(16, triton.next_power_of_2(v_head_dim)), COMPUTE=tl.float32, DOT_PRECISION="ieee")
    return gpu_launch_config(H, _TL_DTYPES[q_TNH.dtype], v_head_dim)


def key_block_bounds(sub_end_T: torch.Tensor, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per key block (min, max) of sub_end, int32 [B] each, computed on sub_end's device."""
    T = sub_end_T.shape[0]
    B = triton.cdiv(T, block_n)
    kmin_B = torch.empty(B, dtype=torch.int32, device=sub_end_T.device)
    kmax_B = torch.empty(B, dtype=torch.int32, device=sub_end_T.device)
    if B:
        _key_block_bounds_kernel[(B,)](sub_end_T, kmin_B, kmax_B, T, BLOCK_N=block_n)
    return kmin_B, kmax_B


def _depth_args(sub_end_T: torch.Tensor, window: int, TQ: int, block_m: int, block_n: int):
    """(DEPTH, KDMAX, QDMIN) for the window: every token's depth, the max depth of each key block and the min depth
    of each query block (queries are the last TQ tokens, tiled from T - TQ); placeholder pointers without a
    window."""
    if not window:
        return sub_end_T, sub_end_T, sub_end_T
    depth_T = depths(sub_end_T)
    T = depth_T.shape[0]
    keys = torch.full((triton.cdiv(T, block_n) * block_n,), -1, dtype=torch.int32, device=depth_T.device)
    keys[:T] = depth_T
    queries = torch.full((triton.cdiv(TQ, block_m) * block_m,), 2**31 - 1, dtype=torch.int32, device=depth_T.device)
    queries[:TQ] = depth_T[T - TQ:]
    return depth_T, keys.view(-1, block_n).amax(1), queries.view(-1, block_m).amin(1)


def _key_end_args(key_end_T: torch.Tensor | None, sub_end_T: torch.Tensor, TQ: int, block_m: int, block_n: int):
    """(KEY_END, QKEMIN, QKEMAX, KQSTART) for bidirectional blocks: every token's key_end, the min and max key_end
    of each query block (queries are the last TQ tokens, tiled from T - TQ), and per key block the first query that
    sees any of its keys, min{i : key_end[i] > k_lo} (<= k_lo, as key_end[k_lo] > k_lo; such an i sees key k_lo, as
    k_lo < key_end[i] and i <= k_lo < sub_end[k_lo], and no query before it sees a key >= k_lo): the first index
    where the running max of key_end passes k_lo. Placeholder pointers without key_end."""
    if key_end_T is None:
        return sub_end_T, sub_end_T, sub_end_T, sub_end_T
    key_end_T = key_end_T.contiguous()
    T = key_end_T.shape[0]
    pad = triton.cdiv(TQ, block_m) * block_m - TQ
    queries = key_end_T[T - TQ:]
    qkemin = torch.nn.functional.pad(queries, (0, pad), value=2**31 - 1).view(-1, block_m).amin(1)
    qkemax = torch.nn.functional.pad(queries, (0, pad), value=0).view(-1, block_m).amax(1)
    running = torch.cummax(key_end_T, 0).values
    k_lo = torch.arange(0, T, block_n, dtype=torch.int32, device=key_end_T.device)
    kqstart = torch.searchsorted(running, k_lo, right=True).to(torch.int32)
    return key_end_T, qkemin, qkemax, kqstart


def window_live_tiles(sub_end_T: torch.Tensor, window: int, block_m: int, block_n: int) -> tuple[int, int]:
    """(tiles the forward computes with this window, tiles it computes without one) for a whole tree: the same
    tests as the kernel (empty by sub_end, and by depth with a window). For benchmarks and tests."""
    T = sub_end_T.shape[0]
    kmax = torch.zeros(triton.cdiv(T, block_n) * block_n, dtype=torch.int64)
    kmax[:T] = sub_end_T.long().cpu()
    kmax = kmax.view(-1, block_n).amax(1)
    _, kdmax, qdmin = _depth_args(sub_end_T.cpu(), window or 1, T, block_m, block_n)
    live = without = 0
    for qb in range(triton.cdiv(T, block_m)):
        q_lo, q_hi = qb * block_m, min(qb * block_m + block_m, T)
        for kb in range(triton.cdiv(q_hi, block_n)):
            if int(kmax[kb]) > q_lo:
                without += 1
                live += not window or int(kdmax[kb]) + window > int(qdmin[qb])
    return live, without


def _forward(q_TNH, k_TKH, v_TKH, sub_end_T, scale, sinks_N=None, window=0, key_end_T=None):
    Tq, N, H = q_TNH.shape
    T, HV = k_TKH.shape[0], v_TKH.shape[2]
    o_TNH = q_TNH.new_empty((Tq, N, HV))
    lse_NT = torch.empty((N, Tq), dtype=torch.float32, device=q_TNH.device)
    if Tq == 0:
        return o_TNH, lse_NT
    cfg = _launch_config(q_TNH, T, HV)
    kmin_B, kmax_B = key_block_bounds(sub_end_T, cfg["BLOCK_N"])
    grid = (triton.cdiv(Tq, cfg["BLOCK_M"]), N)
    _fwd_kernel[grid](
        q_TNH, k_TKH, v_TKH, sub_end_T, kmin_B, kmax_B, o_TNH, lse_NT,
        sinks_N if sinks_N is not None else lse_NT, *_depth_args(sub_end_T, window, Tq, cfg["BLOCK_M"], cfg["BLOCK_N"]),
        *_key_end_args(key_end_T, sub_end_T, Tq, cfg["BLOCK_M"], cfg["BLOCK_N"]),
        T, Tq, H, HV, scale * LOG2E,
        q_TNH.stride(0), q_TNH.stride(1), k_TKH.stride(0), k_TKH.stride(1), v_TKH.stride(0), v_TKH.stride(1),
        o_TNH.stride(0), o_TNH.stride(1), GROUP=N // k_TKH.shape[1], HAS_SINKS=sinks_N is not None,
        WINDOW=int(window), HAS_KEY_END=key_end_T is not None, **cfg,
    )
    return o_TNH, lse_NT


def _backward(do_TNH, q_TNH, k_TKH, v_TKH, o_TNH, lse_NT, sub_end_T, scale, window=0, key_end_T=None):
    Tq, N, H = q_TNH.shape
    T, K = k_TKH.shape[:2]
    HV = v_TKH.shape[2]
    dq_TNH, dk_TKH, dv_TKH = torch.empty_like(q_TNH), torch.empty_like(k_TKH), torch.empty_like(v_TKH)
    if Tq == 0:
        return dq_TNH, dk_TKH.zero_(), dv_TKH.zero_()
    do_TNH = do_TNH.contiguous()
    delta_NT = (do_TNH.float() * o_TNH.float()).sum(-1).transpose(0, 1).contiguous()
    cfg = _launch_config(q_TNH, T, HV)
    kmin_B, kmax_B = key_block_bounds(sub_end_T, cfg["BLOCK_N"])
    common = dict(T=T, TQ=Tq, H=H, HV=HV, qk_scale=scale * LOG2E, scale=scale, stride_qt=q_TNH.stride(0),
                  stride_qn=q_TNH.stride(1), stride_kt=k_TKH.stride(0), stride_kn=k_TKH.stride(1),
                  stride_vt=v_TKH.stride(0), stride_vn=v_TKH.stride(1), stride_ot=do_TNH.stride(0),
                  stride_on=do_TNH.stride(1), GROUP=N // K, WINDOW=int(window), HAS_KEY_END=key_end_T is not None,
                  **cfg)
    depth = (*_depth_args(sub_end_T, window, Tq, cfg["BLOCK_M"], cfg["BLOCK_N"]),
             *_key_end_args(key_end_T, sub_end_T, Tq, cfg["BLOCK_M"], cfg["BLOCK_N"]))
    _bwd_dq_kernel[(triton.cdiv(Tq, cfg["BLOCK_M"]), N)](
        q_TNH, k_TKH, v_TKH, do_TNH, sub_end_T, kmin_B, kmax_B, lse_NT, delta_NT, dq_TNH, *depth, **common
    )
    _bwd_dkdv_kernel[(kmin_B.shape[0], K)](
        q_TNH, k_TKH, v_TKH, do_TNH, sub_end_T, kmin_B, kmax_B, lse_NT, delta_NT, dk_TKH, dv_TKH, *depth, **common
    )
    return dq_TNH, dk_TKH, dv_TKH


tree_attention_triton_op = register_tree_attention_ops("triton", _forward, _backward)
tree_attention_triton = make_public_entry(tree_attention_triton_op)
tree_attention_triton.__doc__ = """Tree attention through the Triton kernels. (q_TNH, k_TKH, v_TKH, sub_end_T int32,
softmax_scale=None, sinks=None, window=None, key_end_T=None) -> o_TNH; differentiable in q, k, v (and sinks);
fp16/bf16/fp32; N % K == 0; head dims <= 512 (values may be narrower or wider than queries and keys); q may hold only
the last tokens of the keys' tree (suffix queries, ops.py; key_end then still covers all T tokens); sinks, sliding
windows and bidirectional blocks (key_end_T int32 [T]) as ops.py describes."""
