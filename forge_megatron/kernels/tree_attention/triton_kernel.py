"""Tree attention in Triton: FlashAttention-2 forward and backward with tile skipping over a DFS-ordered forest.

Mask: key j is visible to query i  <=>  j <= i < sub_end[j]. A tile (queries [q_lo, q_hi), keys [k_lo, k_hi)) is
  empty   if k_lo >= q_hi or max(sub_end[k_lo:k_hi]) <= q_lo          -> skipped,
  full    if k_hi - 1 <= q_lo and min(sub_end[k_lo:k_hi]) >= q_hi    -> no mask,
  partial otherwise                                                  -> mask per element.
The classification happens before the kernels run (schedule.py, torch ops on the device, cached per micro-batch):
each program gets the runs of consecutive full tiles and of partial tiles along its row and loops over them with no
test inside the loops, so the loads pipeline; empty tiles are never visited. Padded keys (past T) only occur in the
last key block, which never satisfies k_hi - 1 <= q_lo with the unclamped k_hi, so full tiles never see padding.

Forward (online softmax, base 2): s = scale * log2(e) * q.k; m = running max; l = running sum of 2^(s - m);
o = sum 2^(s - m) v / l; lse_i = (m + log2 l) * ln 2 (natural log, saved for the backward).
Backward (FA2): P = exp(scale q.k - lse), delta_i = rowsum(dO * O), dV = P^T dO, dS = P * (dO V^T - delta),
dQ = scale dS K, dK = scale dS^T Q. dK/dV are summed over the N/K query heads of each key/value head (GQA) inside
one program, so no atomics are needed (FORGE_TREE_ATTN_DKDV_SPLIT=1: one program per query head instead, adding
into fp32 dK/dV with atomics; dkdv_split). Loads are upcast to fp32 under TRITON_INTERPRET=1 (bf16 arithmetic is wrong
in the interpreter) and for fp32 inputs; on GPU fp16/bf16 tiles go to tl.dot natively with fp32 accumulation.

Suffix queries (ops.py): the TQ query rows are tree tokens [T - TQ, T); query tiles are laid from T - TQ, the mask
and the tile tests use tree positions, rows of q/o/lse are positions minus T - TQ.

Chunked attention (CHUNK > 0, a constexpr: Llama 4) masks keys whose depth lies in another chunk of CHUNK positions
than the query's (depth[i] // CHUNK != depth[j] // CHUNK); as with a window every tile is masked element-wise, and a
tile whose keys all lie above the chunk start of its shallowest query (KDMAX < (QDMIN // CHUNK) * CHUNK) is skipped.

Soft-capped scores (SOFTCAP > 0, a constexpr: the cap in base 2, c * log2(e)): each tile's scores become
SOFTCAP * tanh(s / SOFTCAP) before the mask (_capped), and the backward multiplies dS by 1 - tanh^2, recomputed with P.

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
(Without key_end, key_end[i] = i + 1 gives back the rules above: KEMAX = q_hi, KEMIN = q_lo + 1.) A block's keys may
lie past q_hi, so the forward and dQ rows reach key blocks up to KEMAX, and a key block's dK/dV row starts at the
first query block whose KEMAX passes k_lo. The last key block, padded past T, is never full (its unclamped k_hi > T
>= KEMIN); padded query rows read key_end 0 and see nothing. The window's depth test stays a valid skip: it is ANDed
onto visibility, and keys past a query in its block are deeper (depth[i] - depth[j] < 0 < WINDOW).

Value heads may differ in size from query/key heads (multi-latent attention: H = 192, HV = 128): v, o, dO and dV
tiles are BLOCK_HV wide, q, k, dQ and dK tiles BLOCK_H. A q/k head whose size is not a power of two is padded to the
next one, or with SPLIT_H (FORGE_TREE_ATTN_SPLIT_HEAD=1, head_blocks) held as two tiles, BLOCK_H and BLOCK_H2
channels (192 = 128 + 64): q.k sums two products (_dot_t), dQ and dK keep two accumulators.

Tiles (gpu_launch_config): each kernel has its own BLOCK_M x BLOCK_N, warps and pipeline stages, chosen by head
size and overridable with FORGE_TREE_ATTN_TRITON_TILES for measuring (benchmarks/tree_attention.py --sweep).

Legend: T = packed tree tokens (keys), TQ = query rows, N = query heads, K = key/value heads, H = query/key head dim,
HV = value head dim. F_OFF / F_LO / F_HI and P_OFF / P_LO / P_HI: a schedule's full and partial runs (schedule.py).
"""

from __future__ import annotations

import logging
import os
import re

import torch
import triton
import triton.language as tl

from forge_megatron.kernels.tree_attention import schedule as tile_schedule
from forge_megatron.kernels.tree_attention.ops import depths, make_public_entry, register_tree_attention_ops

log = logging.getLogger(__name__)

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 512
# Heads wider than this take 32 x 32 tiles or smaller (Gemma 4's global heads of 512): 64 x 64 tiles of 512-wide
# heads need more shared memory than a Hopper SM has (227 KiB), 32 x 32 ones 99-133 KiB with two pipeline stages
# (tests/kernels/triton_aot.py prints them).
WIDE_HEAD_DIM = 256
TILES_ENV = "FORGE_TREE_ATTN_TRITON_TILES"
DKDV_SPLIT_ENV = "FORGE_TREE_ATTN_DKDV_SPLIT"
SPLIT_HEAD_ENV = "FORGE_TREE_ATTN_SPLIT_HEAD"
KERNELS = ("fwd", "dq", "dkdv")
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
# Token counts only bound masks: Triton's specialisation of integer arguments (== 1, multiple of 16) would compile a
# kernel again for each kind of micro-batch length and buy nothing (heads of 512 in fp32 timed out a GPU test on
# those recompiles); the strides and head dims stay specialised (they decide vectorised loads).
_LENGTHS = ["T", "TQ"]


@triton.jit
def _tile_visible(offs_m, offs_n, SUB_END, T, DEPTH, KEY_END, WINDOW: tl.constexpr, CHUNK: tl.constexpr,
                  HAS_KEY_END: tl.constexpr, KEY_MAJOR: tl.constexpr):
    """Element mask of a partial tile: j <= i < sub_end[j] (sub_end of padded keys reads as 0 -> invisible), with
    bidirectional blocks j < key_end[i] instead of j <= i (key_end of padded queries reads as 0 -> they see
    nothing), with a window depth[i] - depth[j] < WINDOW, with a chunk depth[i] // CHUNK == depth[j] // CHUNK.
    [queries, keys], or [keys, queries] with KEY_MAJOR (dK / dV's transposed tiles)."""
    if KEY_MAJOR:
        i = offs_m[None, :]
        j = offs_n[:, None]
    else:
        i = offs_m[:, None]
        j = offs_n[None, :]
    se = tl.load(SUB_END + j, mask=j < T, other=0)
    if HAS_KEY_END:
        visible = (j < tl.load(KEY_END + i, mask=i < T, other=0)) & (i < se)
    else:
        visible = (j <= i) & (i < se)
    if WINDOW > 0 or CHUNK > 0:
        depth_i = tl.load(DEPTH + i, mask=i < T, other=0)
        depth_j = tl.load(DEPTH + j, mask=j < T, other=0)
        if WINDOW > 0:
            visible = visible & ((depth_i - depth_j) < WINDOW)
        if CHUNK > 0:
            visible = visible & ((depth_i // CHUNK) == (depth_j // CHUNK))
    return visible


@triton.jit
def _capped(s, SOFTCAP: tl.constexpr):
    """(SOFTCAP * tanh(s / SOFTCAP), tanh(s / SOFTCAP)) of base-2 scores s: a cap of c on natural scores is a cap
    of c * log2(e) on base-2 ones. tanh(x) = 2 sigmoid(2x) - 1 (saturates to +-1, no overflow)."""
    t = 2.0 * tl.sigmoid(s * (2.0 / SOFTCAP)) - 1.0
    return SOFTCAP * t, t


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
def _heavy_first(pid, programs):
    """The query block a forward or dQ program takes: the last first. Later query blocks see more keys (causally,
    and a GRPO group's completions see the prompt), so the longest programs start first and the short ones fill in
    at the end (FlashAttention-3's order for causal attention); dK/dV's first key blocks are its longest already."""
    return programs - 1 - pid


@triton.jit
def _load_qk(PTR, offs_t, T, stride_t, offs_h, offs_h2, H, COMPUTE: tl.constexpr, SPLIT_H: tl.constexpr):
    """A query or key tile of one head: channels offs_h, and with SPLIT_H a second tile of channels offs_h2 (a head
    of 192 as 128 + 64 instead of padded to 256); without it the second is the first (unused)."""
    a = _load_rows(PTR, offs_t, T, stride_t, offs_h, H, COMPUTE)
    if SPLIT_H:
        b = _load_rows(PTR, offs_t, T, stride_t, offs_h2, H, COMPUTE)
    else:
        b = a
    return a, b


@triton.jit
def _dot_t(x, x2, y, y2, SPLIT_H: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """x y^T over the head's channels: both parts of a split head."""
    s = tl.dot(x, tl.trans(y), input_precision=DOT_PRECISION)
    if SPLIT_H:
        s += tl.dot(x2, tl.trans(y2), input_precision=DOT_PRECISION)
    return s


@triton.jit
def _key_tile(K_head, V_head, kb, T, stride_kt, stride_vt, offs_h, offs_h2, offs_hv, H, HV, BLOCK_N: tl.constexpr,
              COMPUTE: tl.constexpr, SPLIT_H: tl.constexpr):
    """(key positions, K tile (two with SPLIT_H), V tile) of key block kb of one key/value head."""
    offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    k, k2 = _load_qk(K_head, offs_n, T, stride_kt, offs_h, offs_h2, H, COMPUTE, SPLIT_H)
    return offs_n, k, k2, _load_rows(V_head, offs_n, T, stride_vt, offs_hv, HV, COMPUTE)


@triton.jit
def _fwd_tiles(acc, m_i, l_i, q, q2, K_head, V_head, SUB_END, DEPTH, KEY_END, OFF, LO, HI, row, offs_m, offs_h,
               offs_h2, offs_hv, T, H, HV, qk_scale, stride_kt, stride_vt, BLOCK_N: tl.constexpr,
               COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr,
               HAS_KEY_END: tl.constexpr, MASKED: tl.constexpr, SPLIT_H: tl.constexpr, SOFTCAP: tl.constexpr):
    """The online softmax over this query block's runs [LO[r], HI[r]) of key blocks, r in [OFF[row], OFF[row + 1])
    (full tiles: MASKED False, no mask; partial ones: the element mask); SOFTCAP > 0: scores capped (_capped)."""
    for r in range(tl.load(OFF + row), tl.load(OFF + row + 1)):
        for kb in range(tl.load(LO + r), tl.load(HI + r)):
            offs_n, k, k2, v = _key_tile(K_head, V_head, kb, T, stride_kt, stride_vt, offs_h, offs_h2, offs_hv, H,
                                         HV, BLOCK_N, COMPUTE, SPLIT_H)
            s = _dot_t(q, q2, k, k2, SPLIT_H, DOT_PRECISION) * qk_scale
            if SOFTCAP > 0:
                s, _ = _capped(s, SOFTCAP)
            if MASKED:
                s = tl.where(_tile_visible(offs_m, offs_n, SUB_END, T, DEPTH, KEY_END, WINDOW, CHUNK, HAS_KEY_END,
                                           False), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v, input_precision=DOT_PRECISION)
            m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=_LENGTHS)
def _fwd_kernel(
    Q, K, V, SUB_END, O, LSE, SINKS, DEPTH, KEY_END, F_OFF, F_LO, F_HI, P_OFF, P_LO, P_HI,
    T, TQ, H, HV, qk_scale,
    stride_qt, stride_qn, stride_kt, stride_kn, stride_vt, stride_vn, stride_ot, stride_on,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr, COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SINKS: tl.constexpr,
    WINDOW: tl.constexpr, CHUNK: tl.constexpr, HAS_KEY_END: tl.constexpr, SPLIT_H: tl.constexpr, BLOCK_H2: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    n = tl.program_id(0)  # heads vary fastest: every head's longest query blocks are launched before any short one
    row = _heavy_first(tl.program_id(1), tl.num_programs(1))
    q0 = T - TQ  # the TQ queries are tree tokens [q0, T); row r of Q, O and LSE is token q0 + r
    offs_m = q0 + row * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, BLOCK_H)
    offs_h2 = BLOCK_H + tl.arange(0, BLOCK_H2)
    offs_hv = tl.arange(0, BLOCK_HV)
    q, q2 = _load_qk(Q + n * stride_qn, offs_m - q0, TQ, stride_qt, offs_h, offs_h2, H, COMPUTE, SPLIT_H)
    K_head = K + (n // GROUP) * stride_kn
    V_head = V + (n // GROUP) * stride_vn

    if HAS_SINKS:  # the sink's term: exp(sink) in the denominator, no value
        m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(SINKS + n).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_HV], tl.float32)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, q2, K_head, V_head, SUB_END, DEPTH, KEY_END, F_OFF, F_LO, F_HI, row,
                               offs_m, offs_h, offs_h2, offs_hv, T, H, HV, qk_scale, stride_kt, stride_vt, BLOCK_N,
                               COMPUTE, DOT_PRECISION, WINDOW, CHUNK, HAS_KEY_END, False, SPLIT_H, SOFTCAP)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, q2, K_head, V_head, SUB_END, DEPTH, KEY_END, P_OFF, P_LO, P_HI, row,
                               offs_m, offs_h, offs_h2, offs_hv, T, H, HV, qk_scale, stride_kt, stride_vt, BLOCK_N,
                               COMPUTE, DOT_PRECISION, WINDOW, CHUNK, HAS_KEY_END, True, SPLIT_H, SOFTCAP)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    _store_rows(O + n * stride_on, acc / l_safe[:, None], offs_m - q0, TQ, stride_ot, offs_hv, HV)
    tl.store(LSE + n * TQ + offs_m - q0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, mask=offs_m < T)


@triton.jit
def _dq_tiles(dq, dq2, q, q2, do, lse2, delta, K_head, V_head, SUB_END, DEPTH, KEY_END, OFF, LO, HI, row, offs_m,
              offs_h, offs_h2, offs_hv, T, H, HV, qk_scale, stride_kt, stride_vt, BLOCK_N: tl.constexpr,
              COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr,
              HAS_KEY_END: tl.constexpr, MASKED: tl.constexpr, SPLIT_H: tl.constexpr, SOFTCAP: tl.constexpr):
    """dQ's sum over this query block's runs of key blocks (MASKED as in _fwd_tiles): P recomputed from the saved
    lse, dS = P * (dO V^T - delta) (times 1 - tanh^2 under a soft cap), dQ += dS K (dq2 the second part of a split
    head)."""
    for r in range(tl.load(OFF + row), tl.load(OFF + row + 1)):
        for kb in range(tl.load(LO + r), tl.load(HI + r)):
            offs_n, k, k2, v = _key_tile(K_head, V_head, kb, T, stride_kt, stride_vt, offs_h, offs_h2, offs_hv, H,
                                         HV, BLOCK_N, COMPUTE, SPLIT_H)
            s = _dot_t(q, q2, k, k2, SPLIT_H, DOT_PRECISION) * qk_scale
            if SOFTCAP > 0:
                s, t = _capped(s, SOFTCAP)
            p = tl.exp2(s - lse2[:, None])
            if MASKED:
                p = tl.where(_tile_visible(offs_m, offs_n, SUB_END, T, DEPTH, KEY_END, WINDOW, CHUNK, HAS_KEY_END,
                                           False), p, 0.0)
            ds = p * (tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION) - delta[:, None])
            if SOFTCAP > 0:
                ds = ds * (1.0 - t * t)
            ds = ds.to(COMPUTE)
            dq += tl.dot(ds, k, input_precision=DOT_PRECISION)
            if SPLIT_H:
                dq2 += tl.dot(ds, k2, input_precision=DOT_PRECISION)
    return dq, dq2


@triton.jit(do_not_specialize=_LENGTHS)
def _bwd_dq_kernel(
    Q, K, V, DO, SUB_END, LSE, DELTA, DQ, DEPTH, KEY_END, F_OFF, F_LO, F_HI, P_OFF, P_LO, P_HI,
    T, TQ, H, HV, qk_scale, scale,
    stride_qt, stride_qn, stride_kt, stride_kn, stride_vt, stride_vn, stride_ot, stride_on,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr, COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr,
    CHUNK: tl.constexpr, HAS_KEY_END: tl.constexpr, SPLIT_H: tl.constexpr, BLOCK_H2: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    n = tl.program_id(0)  # heads vary fastest: every head's longest query blocks are launched before any short one
    row = _heavy_first(tl.program_id(1), tl.num_programs(1))
    q0 = T - TQ
    offs_m = q0 + row * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, BLOCK_H)
    offs_h2 = BLOCK_H + tl.arange(0, BLOCK_H2)
    offs_hv = tl.arange(0, BLOCK_HV)
    q, q2 = _load_qk(Q + n * stride_qn, offs_m - q0, TQ, stride_qt, offs_h, offs_h2, H, COMPUTE, SPLIT_H)
    do = _load_rows(DO + n * stride_on, offs_m - q0, TQ, stride_ot, offs_hv, HV, COMPUTE)
    lse2, delta = _row_stats(LSE, DELTA, n, offs_m - q0, TQ)
    K_head = K + (n // GROUP) * stride_kn
    V_head = V + (n // GROUP) * stride_vn

    dq = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    dq2 = tl.zeros([BLOCK_M, BLOCK_H2], tl.float32)  # (without SPLIT_H never touched)
    dq, dq2 = _dq_tiles(dq, dq2, q, q2, do, lse2, delta, K_head, V_head, SUB_END, DEPTH, KEY_END, F_OFF, F_LO, F_HI,
                        row, offs_m, offs_h, offs_h2, offs_hv, T, H, HV, qk_scale, stride_kt, stride_vt, BLOCK_N,
                        COMPUTE, DOT_PRECISION, WINDOW, CHUNK, HAS_KEY_END, False, SPLIT_H, SOFTCAP)
    dq, dq2 = _dq_tiles(dq, dq2, q, q2, do, lse2, delta, K_head, V_head, SUB_END, DEPTH, KEY_END, P_OFF, P_LO, P_HI,
                        row, offs_m, offs_h, offs_h2, offs_hv, T, H, HV, qk_scale, stride_kt, stride_vt, BLOCK_N,
                        COMPUTE, DOT_PRECISION, WINDOW, CHUNK, HAS_KEY_END, True, SPLIT_H, SOFTCAP)
    _store_rows(DQ + n * stride_qn, dq * scale, offs_m - q0, TQ, stride_qt, offs_h, H)
    if SPLIT_H:
        _store_rows(DQ + n * stride_qn, dq2 * scale, offs_m - q0, TQ, stride_qt, offs_h2, H)


@triton.jit
def _dkdv_tiles(dk, dk2, dv, k, k2, v, Q_head, DO_head, LSE, DELTA, n, SUB_END, DEPTH, KEY_END, OFF, LO, HI, row,
                offs_n, offs_h, offs_h2, offs_hv, T, TQ, H, HV, qk_scale, stride_qt, stride_ot, BLOCK_M: tl.constexpr,
                COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr,
                HAS_KEY_END: tl.constexpr, MASKED: tl.constexpr, SPLIT_H: tl.constexpr, SOFTCAP: tl.constexpr):
    """dK / dV's sums over this key block's runs [LO[r], HI[r]) of query blocks for query head n (MASKED as in
    _fwd_tiles). The tiles are key-major, P^T and dS^T [BLOCK_N, BLOCK_M] (FlashAttention-2's dK/dV loop): every
    product then has the key block as its rows, dV += P^T dO and dK += dS^T Q take P^T and dS^T from registers as
    they are, and the query-side operands (Q^T, dO^T) are views of the tiles loaded into shared memory, with no
    transpose of a register tile (the query-major form, [BLOCK_M, BLOCK_N] tiles transposed in registers, took
    2.08 ms at its best tiles on an H200 where this one took 1.76). dk2 / k2: the second part of a split head.
    Padded query rows (past T) load zeros and lse = delta = 0: P = 1 there but dO = 0, so they add nothing."""
    q0 = T - TQ
    for r in range(tl.load(OFF + row), tl.load(OFF + row + 1)):
        for qb in range(tl.load(LO + r), tl.load(HI + r)):
            offs_m = q0 + qb * BLOCK_M + tl.arange(0, BLOCK_M)
            q, q2 = _load_qk(Q_head, offs_m - q0, TQ, stride_qt, offs_h, offs_h2, H, COMPUTE, SPLIT_H)
            do = _load_rows(DO_head, offs_m - q0, TQ, stride_ot, offs_hv, HV, COMPUTE)
            lse2, delta = _row_stats(LSE, DELTA, n, offs_m - q0, TQ)
            st = _dot_t(k, k2, q, q2, SPLIT_H, DOT_PRECISION) * qk_scale
            if SOFTCAP > 0:
                st, tt = _capped(st, SOFTCAP)
            pt = tl.exp2(st - lse2[None, :])
            if MASKED:
                pt = tl.where(_tile_visible(offs_m, offs_n, SUB_END, T, DEPTH, KEY_END, WINDOW, CHUNK, HAS_KEY_END,
                                            True), pt, 0.0)
            dv += tl.dot(pt.to(COMPUTE), do, input_precision=DOT_PRECISION)
            dst = pt * (tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION) - delta[None, :])
            if SOFTCAP > 0:
                dst = dst * (1.0 - tt * tt)
            dst = dst.to(COMPUTE)
            dk += tl.dot(dst, q, input_precision=DOT_PRECISION)
            if SPLIT_H:
                dk2 += tl.dot(dst, q2, input_precision=DOT_PRECISION)
    return dk, dk2, dv


@triton.jit
def _add_rows(PTR, x, offs_t, T, stride_t, offs_h, H):
    """Atomically add a [rows, BLOCK_H] fp32 tile into one head of an fp32 tensor (dK / dV split over query heads)."""
    mask = (offs_t[:, None] < T) & (offs_h[None, :] < H)
    tl.atomic_add(PTR + offs_t[:, None] * stride_t + offs_h[None, :], x, mask=mask, sem="relaxed")


@triton.jit
def _dkdv_head(dk, dk2, dv, k, k2, v, Q, DO, LSE, DELTA, n, SUB_END, DEPTH, KEY_END, F_OFF, F_LO, F_HI, P_OFF, P_LO,
               P_HI, row, offs_n, offs_h, offs_h2, offs_hv, T, TQ, H, HV, qk_scale, stride_qt, stride_qn, stride_ot,
               stride_on, BLOCK_M: tl.constexpr, COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr,
               WINDOW: tl.constexpr, CHUNK: tl.constexpr, HAS_KEY_END: tl.constexpr, SPLIT_H: tl.constexpr,
               SOFTCAP: tl.constexpr):
    """Query head n's part of dK / dV for this key block: its full runs (no mask), then its partial ones."""
    dk, dk2, dv = _dkdv_tiles(dk, dk2, dv, k, k2, v, Q + n * stride_qn, DO + n * stride_on, LSE, DELTA, n, SUB_END,
                              DEPTH, KEY_END, F_OFF, F_LO, F_HI, row, offs_n, offs_h, offs_h2, offs_hv, T, TQ, H, HV,
                              qk_scale, stride_qt, stride_ot, BLOCK_M, COMPUTE, DOT_PRECISION, WINDOW, CHUNK,
                              HAS_KEY_END, False, SPLIT_H, SOFTCAP)
    return _dkdv_tiles(dk, dk2, dv, k, k2, v, Q + n * stride_qn, DO + n * stride_on, LSE, DELTA, n, SUB_END, DEPTH,
                       KEY_END, P_OFF, P_LO, P_HI, row, offs_n, offs_h, offs_h2, offs_hv, T, TQ, H, HV, qk_scale,
                       stride_qt, stride_ot, BLOCK_M, COMPUTE, DOT_PRECISION, WINDOW, CHUNK, HAS_KEY_END, True, SPLIT_H,
                       SOFTCAP)


@triton.jit(do_not_specialize=_LENGTHS)
def _bwd_dkdv_kernel(
    Q, K, V, DO, SUB_END, LSE, DELTA, DK, DV, DEPTH, KEY_END, F_OFF, F_LO, F_HI, P_OFF, P_LO, P_HI,
    T, TQ, H, HV, qk_scale, scale,
    stride_qt, stride_qn, stride_kt, stride_kn, stride_vt, stride_vn, stride_ot, stride_on,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr, COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr,
    CHUNK: tl.constexpr, HAS_KEY_END: tl.constexpr, SPLIT: tl.constexpr, SPLIT_H: tl.constexpr, BLOCK_H2: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One key block of one key/value head, summed over its GROUP query heads; with SPLIT one query head per
    program (GROUP times the programs, each a GROUP-th as long) adding into fp32 dK / dV with atomics. Heads vary
    fastest and key block 0 comes first: a GRPO prompt's key blocks, seen by every completion, are the longest
    programs and all start before the short ones."""
    pid = tl.program_id(0)
    row = tl.program_id(1)
    if SPLIT:
        kv = pid // GROUP
    else:
        kv = pid
    offs_n = row * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    offs_h2 = BLOCK_H + tl.arange(0, BLOCK_H2)
    offs_hv = tl.arange(0, BLOCK_HV)
    k, k2 = _load_qk(K + kv * stride_kn, offs_n, T, stride_kt, offs_h, offs_h2, H, COMPUTE, SPLIT_H)
    v = _load_rows(V + kv * stride_vn, offs_n, T, stride_vt, offs_hv, HV, COMPUTE)
    dk = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
    dk2 = tl.zeros([BLOCK_N, BLOCK_H2], tl.float32)  # (without SPLIT_H never touched)
    dv = tl.zeros([BLOCK_N, BLOCK_HV], tl.float32)
    if SPLIT:
        dk, dk2, dv = _dkdv_head(dk, dk2, dv, k, k2, v, Q, DO, LSE, DELTA, pid, SUB_END, DEPTH, KEY_END, F_OFF, F_LO,
                                 F_HI, P_OFF, P_LO, P_HI, row, offs_n, offs_h, offs_h2, offs_hv, T, TQ, H, HV,
                                 qk_scale, stride_qt, stride_qn, stride_ot, stride_on, BLOCK_M, COMPUTE,
                                 DOT_PRECISION, WINDOW, CHUNK, HAS_KEY_END, SPLIT_H, SOFTCAP)
        _add_rows(DK + kv * stride_kn, dk * scale, offs_n, T, stride_kt, offs_h, H)
        if SPLIT_H:
            _add_rows(DK + kv * stride_kn, dk2 * scale, offs_n, T, stride_kt, offs_h2, H)
        _add_rows(DV + kv * stride_vn, dv, offs_n, T, stride_vt, offs_hv, HV)
    else:
        for g in range(GROUP):  # the query heads sharing this key/value head
            dk, dk2, dv = _dkdv_head(dk, dk2, dv, k, k2, v, Q, DO, LSE, DELTA, kv * GROUP + g, SUB_END, DEPTH,
                                     KEY_END, F_OFF, F_LO, F_HI, P_OFF, P_LO, P_HI, row, offs_n, offs_h, offs_h2,
                                     offs_hv, T, TQ, H, HV, qk_scale, stride_qt, stride_qn, stride_ot, stride_on,
                                     BLOCK_M, COMPUTE, DOT_PRECISION, WINDOW, CHUNK, HAS_KEY_END, SPLIT_H, SOFTCAP)
        _store_rows(DK + kv * stride_kn, dk * scale, offs_n, T, stride_kt, offs_h, H)
        if SPLIT_H:
            _store_rows(DK + kv * stride_kn, dk2 * scale, offs_n, T, stride_kt, offs_h2, H)
        _store_rows(DV + kv * stride_vn, dv, offs_n, T, stride_vt, offs_hv, HV)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _default_tiles(widest: int, compute: tl.dtype) -> dict[str, tuple[int, int, int, int]]:
    """kernel -> (BLOCK_M, BLOCK_N, warps, pipeline stages) for heads up to ``widest`` channels (a power of two).
    Heads of 128 in fp16/bf16: from benchmarks/tree_attention.py --sweep on two H200s (GRPO workload,
    docs/benchmarks.md): dK/dV's 4-warp tiles spill 48 bytes of registers and ran 15-45 % faster than the spill-free
    8-warp ones; dQ's spill 144 bytes and timed 0.83 ms in both sweeps (128x64x8x3: 0.79 and 1.01); the forward's
    candidates were within 3 % of each other. Other sizes are not timed yet: for each kernel
    the largest tiles among those tried that ptxas compiles for sm_90 without spilling registers, as Triton's JIT
    specialises them (tests/kernels/triton_aot.py --resources prints shared memory, registers and spills). dK / dV
    keeps two [BLOCK_N, head] fp32 accumulators and its K and V tiles for the whole loop, hence its short query
    steps. fp32 inputs (exact IEEE dots, no tensor cores: the tests' path, not a fast one) take small tiles that fit
    in shared memory at every head size."""
    if compute == tl.float32:
        if widest > WIDE_HEAD_DIM:
            return dict.fromkeys(KERNELS, (16, 16, 4, 1))
        return {"fwd": (32, 32, 8, 1), "dq": (32, 32, 8, 1), "dkdv": (16, 32, 8, 1)}
    if widest > WIDE_HEAD_DIM:
        return {"fwd": (32, 32, 8, 2), "dq": (32, 32, 8, 2), "dkdv": (32, 16, 8, 2)}
    if widest > 128:
        return {"fwd": (64, 64, 8, 2), "dq": (32, 64, 8, 2), "dkdv": (32, 32, 8, 2)}
    if widest == 128:
        return {"fwd": (64, 64, 4, 3), "dq": (128, 32, 4, 3), "dkdv": (32, 64, 4, 3)}
    return {"fwd": (128, 64, 4, 3), "dq": (128, 64, 4, 2), "dkdv": (32, 64, 4, 3)}


_logged_tiles: set[str] = set()


def tiles_from_env(value: str | None = None) -> dict[str, tuple[int, int, int, int]]:
    """FORGE_TREE_ATTN_TRITON_TILES, e.g. "fwd=128x64x8x3,dkdv=64x128x8x2": kernel=BLOCK_MxBLOCK_NxWARPSxSTAGES for
    any of fwd, dq, dkdv (the others keep their defaults). Blocks are powers of two from 16 to 256."""
    value = os.environ.get(TILES_ENV, "") if value is None else value
    tiles = {}
    for item in filter(None, (x.strip() for x in value.split(","))):
        m = re.fullmatch(r"(\w+)=(\d+)x(\d+)x(\d+)x(\d+)", item)
        if not m or m.group(1) not in KERNELS:
            raise ValueError(f"{TILES_ENV}: {item!r} is not KERNEL=BLOCK_MxBLOCK_NxWARPSxSTAGES with KERNEL one of "
                             f"{', '.join(KERNELS)} (e.g. fwd=128x64x8x3)")
        bm, bn, warps, stages = (int(m.group(i)) for i in range(2, 6))
        if any(b < 16 or b > 256 or b & (b - 1) for b in (bm, bn)) or warps not in (1, 2, 4, 8, 16) \
                or not 1 <= stages <= 8:
            raise ValueError(f"{TILES_ENV}: {item!r}: blocks must be powers of two in [16, 256], warps 1-16 (a power "
                             "of two), stages 1-8")
        tiles[m.group(1)] = (bm, bn, warps, stages)
    if tiles and value not in _logged_tiles:
        _logged_tiles.add(value)
        log.info("Triton tree attention tiles from %s: %s", TILES_ENV, tiles)
    return tiles


def gpu_launch_config(head_dim: int, compute: tl.dtype, v_head_dim: int | None = None) -> dict:
    """Constexprs of a GPU launch (head tiles, compute dtype, dot precision) and, under ``tiles``, each kernel's
    BLOCK_M / BLOCK_N / warps / stages (defaults by head size, FORGE_TREE_ATTN_TRITON_TILES overriding them);
    BLOCK_M / BLOCK_N / num_warps at the top level are the forward's."""
    block_hv = pow2_block(v_head_dim or head_dim)
    tiles = {**_default_tiles(max(pow2_block(head_dim), block_hv), compute), **tiles_from_env()}
    fwd = tiles["fwd"]
    return dict(
        BLOCK_M=fwd[0], BLOCK_N=fwd[1], **head_blocks(head_dim), BLOCK_HV=block_hv, COMPUTE=compute,
        DOT_PRECISION="ieee" if compute == tl.float32 else None,  # fp32 inputs: exact fp32, not TF32
        num_warps=fwd[2], tiles=tiles,
    )


def head_split(value: str | None = None) -> bool:
    """FORGE_TREE_ATTN_SPLIT_HEAD=1: a query/key head whose size is not a power of two runs as two tiles (192 = 128
    + 64: multi-latent attention's heads) instead of one padded to the next power of two (256: a quarter of the
    q.k products and of dQ / dK's accumulators spent on zeros). Off by default until a GPU sweep times it."""
    return _env_flag(SPLIT_HEAD_ENV, value)


def pow2_block(channels: int) -> int:
    """The tile width of ``channels``: the next power of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(channels))


def _env_flag(name: str, value: str | None) -> bool:
    """A 0/1 environment switch (``value`` in its place when given); anything else is an error naming it."""
    value = os.environ.get(name, "0") if value is None else value
    if value not in ("0", "1", ""):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def head_blocks(head_dim: int, split: bool | None = None) -> dict:
    """BLOCK_H (and with a split head BLOCK_H2, SPLIT_H) of query/key heads of ``head_dim`` channels."""
    split = head_split() if split is None else split
    whole = pow2_block(head_dim)
    if not split or whole == head_dim or head_dim <= 16:
        return dict(BLOCK_H=whole, BLOCK_H2=16, SPLIT_H=False)
    first = whole // 2  # the largest power of two below head_dim
    return dict(BLOCK_H=first, BLOCK_H2=pow2_block(head_dim - first), SPLIT_H=True)


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
        cfg = dict(BLOCK_M=32, BLOCK_N=32, **head_blocks(H), BLOCK_HV=pow2_block(v_head_dim),
                   COMPUTE=tl.float32, DOT_PRECISION="ieee")
        tiles = tiles_from_env()  # tiles set in the environment apply here too (tests of that path)
        if tiles:
            cfg["tiles"] = {kernel: tiles.get(kernel, (32, 32, 4, 1)) for kernel in KERNELS}
        return cfg
    return gpu_launch_config(H, _TL_DTYPES[q_TNH.dtype], v_head_dim)


def _grid(heads: int, rows: int) -> tuple[int, int]:
    """(heads, blocks): heads on the grid's first axis, so they vary fastest in launch order and the longest blocks
    of every head start first; blocks on the second, which CUDA caps at 65535."""
    if rows > 65535:
        raise ValueError(f"{rows} blocks of tokens exceed the CUDA grid's 65535 (a micro-batch of millions of "
                         "tokens): split the micro-batch")
    return heads, rows


def dkdv_split(value: str | None = None) -> bool:
    """FORGE_TREE_ATTN_DKDV_SPLIT=1: dK / dV with one program per query head (fp32 atomics summing a group's heads)
    instead of one per key/value head looping over its group. More, shorter programs: a GRPO prompt's key blocks,
    which every completion sees, then no longer run GROUP times as long as the rest. The atomics add a group's heads
    in whatever order they finish, so dK / dV are not bitwise the same from run to run. Off by default until a GPU
    sweep times it (benchmarks/tree_attention.py --sweep tries both)."""
    return _env_flag(DKDV_SPLIT_ENV, value)


def _kernel_launch(cfg: dict, kernel: str) -> tuple[dict, dict]:
    """(constexprs, launch options) of one kernel: its BLOCK_M / BLOCK_N, warps and stages from cfg["tiles"], or
    cfg's own BLOCK_M / BLOCK_N (and num_warps) for every kernel where it has no tiles (the interpreter, tests)."""
    constexprs = {"SPLIT_H": False, "BLOCK_H2": 16,  # a whole head unless cfg splits it (head_blocks)
                  **{k: v for k, v in cfg.items() if k not in ("tiles", "num_warps", "num_stages")}}
    options = {k: cfg[k] for k in ("num_warps", "num_stages") if k in cfg}
    if "tiles" in cfg:
        bm, bn, warps, stages = cfg["tiles"][kernel]
        constexprs.update(BLOCK_M=bm, BLOCK_N=bn)
        options = dict(num_warps=warps, num_stages=stages)
    return constexprs, options


def window_live_tiles(sub_end_T: torch.Tensor, window: int, block_m: int, block_n: int) -> tuple[int, int]:
    """(tiles the forward computes with this window, tiles it computes without one) for a whole tree, from the
    kernels' own schedules. For benchmarks and tests."""
    T = sub_end_T.shape[0]
    with_window = tile_schedule.build_schedule(sub_end_T, T, block_m, block_n, window)
    without = tile_schedule.build_schedule(sub_end_T, T, block_m, block_n)
    return (with_window.full_tiles + with_window.partial_tiles, without.full_tiles + without.partial_tiles)


def _extras(sub_end_T, key_end_T, window, chunk=0):
    """(DEPTH, KEY_END): the depths for a window or chunks, key_end for bidirectional blocks; sub_end as a
    placeholder pointer where unused (the kernels never read it then)."""
    depth = tile_schedule.derived(sub_end_T, "depths", depths) if window or chunk else sub_end_T  # once a micro-batch
    return depth, key_end_T.contiguous() if key_end_T is not None else sub_end_T


def _forward(q_TNH, k_TKH, v_TKH, sub_end_T, scale, sinks_N=None, window=0, key_end_T=None, softcap=0.0, chunk=0):
    Tq, N, H = q_TNH.shape
    T, HV = k_TKH.shape[0], v_TKH.shape[2]
    o_TNH = q_TNH.new_empty((Tq, N, HV))
    lse_NT = torch.empty((N, Tq), dtype=torch.float32, device=q_TNH.device)
    if Tq == 0:
        return o_TNH, lse_NT
    constexprs, options = _kernel_launch(_launch_config(q_TNH, T, HV), "fwd")
    plan = tile_schedule.schedule(sub_end_T, Tq, constexprs["BLOCK_M"], constexprs["BLOCK_N"], window, key_end_T,
                                  chunk=chunk)
    _fwd_kernel[_grid(N, plan.rows)](
        q_TNH, k_TKH, v_TKH, sub_end_T, o_TNH, lse_NT, sinks_N if sinks_N is not None else lse_NT,
        *_extras(sub_end_T, key_end_T, window, chunk), *plan.args(),
        T, Tq, H, HV, scale * LOG2E,
        q_TNH.stride(0), q_TNH.stride(1), k_TKH.stride(0), k_TKH.stride(1), v_TKH.stride(0), v_TKH.stride(1),
        o_TNH.stride(0), o_TNH.stride(1), GROUP=N // k_TKH.shape[1], HAS_SINKS=sinks_N is not None,
        WINDOW=int(window), CHUNK=int(chunk or 0), HAS_KEY_END=key_end_T is not None,
        SOFTCAP=float(softcap or 0.0) * LOG2E, **constexprs, **options,
    )
    return o_TNH, lse_NT


def _backward(do_TNH, q_TNH, k_TKH, v_TKH, o_TNH, lse_NT, sub_end_T, scale, window=0, key_end_T=None, softcap=0.0,
              chunk=0, kernels=("dq", "dkdv")):
    """dQ, dK, dV (``kernels`` narrows what runs, for timing one kernel alone; the others' outputs stay unset)."""
    Tq, N, H = q_TNH.shape
    T, K = k_TKH.shape[:2]
    HV = v_TKH.shape[2]
    dq_TNH, dk_TKH, dv_TKH = torch.empty_like(q_TNH), torch.empty_like(k_TKH), torch.empty_like(v_TKH)
    if Tq == 0:
        return dq_TNH, dk_TKH.zero_(), dv_TKH.zero_()
    do_TNH = do_TNH.contiguous()
    delta_NT = (do_TNH.float() * o_TNH.float()).sum(-1).transpose(0, 1).contiguous()
    cfg = _launch_config(q_TNH, T, HV)
    common = dict(T=T, TQ=Tq, H=H, HV=HV, qk_scale=scale * LOG2E, scale=scale, stride_qt=q_TNH.stride(0),
                  stride_qn=q_TNH.stride(1), stride_kt=k_TKH.stride(0), stride_kn=k_TKH.stride(1),
                  stride_vt=v_TKH.stride(0), stride_vn=v_TKH.stride(1), stride_ot=do_TNH.stride(0),
                  stride_on=do_TNH.stride(1), GROUP=N // K, WINDOW=int(window), CHUNK=int(chunk or 0),
                  HAS_KEY_END=key_end_T is not None, SOFTCAP=float(softcap or 0.0) * LOG2E)
    extras = _extras(sub_end_T, key_end_T, window, chunk)
    if "dq" in kernels:
        constexprs, options = _kernel_launch(cfg, "dq")
        plan = tile_schedule.schedule(sub_end_T, Tq, constexprs["BLOCK_M"], constexprs["BLOCK_N"], window, key_end_T,
                                      chunk=chunk)
        _bwd_dq_kernel[_grid(N, plan.rows)](
            q_TNH, k_TKH, v_TKH, do_TNH, sub_end_T, lse_NT, delta_NT, dq_TNH, *extras, *plan.args(), **common,
            **constexprs, **options,
        )
    if "dkdv" in kernels:
        constexprs, options = _kernel_launch(cfg, "dkdv")
        plan = tile_schedule.schedule(sub_end_T, Tq, constexprs["BLOCK_M"], constexprs["BLOCK_N"], window, key_end_T,
                                      by="key", chunk=chunk)
        split = dkdv_split() and N > K
        if split:  # fp32 sums that every query head of a group adds into
            dk_TKH = torch.zeros_like(k_TKH, dtype=torch.float32)
            dv_TKH = torch.zeros_like(v_TKH, dtype=torch.float32)
        _bwd_dkdv_kernel[_grid(N if split else K, plan.rows)](
            q_TNH, k_TKH, v_TKH, do_TNH, sub_end_T, lse_NT, delta_NT, dk_TKH, dv_TKH, *extras, *plan.args(),
            **common, **constexprs, **options, SPLIT=split,
        )
        if split:
            dk_TKH, dv_TKH = dk_TKH.to(k_TKH.dtype), dv_TKH.to(v_TKH.dtype)
    return dq_TNH, dk_TKH, dv_TKH


tree_attention_triton_op = register_tree_attention_ops("triton", _forward, _backward)
tree_attention_triton = make_public_entry(tree_attention_triton_op)
tree_attention_triton.__doc__ = """Tree attention through the Triton kernels. (q_TNH, k_TKH, v_TKH, sub_end_T int32,
softmax_scale=None, sinks=None, window=None, key_end_T=None, softcap=None, chunk=None) -> o_TNH; differentiable in
q, k, v (and sinks);
fp16/bf16/fp32; N % K == 0; head dims <= 512 (values may be narrower or wider than queries and keys); q may hold only
the last tokens of the keys' tree (suffix queries, ops.py; key_end then still covers all T tokens); sinks, sliding
windows, bidirectional blocks (key_end_T int32 [T]), soft-capped scores and chunked attention as ops.py describes."""
