"""Triton kernels for the sequential part of the chunked gated delta rule (kernels/gated_delta.py).

Everything inside a chunk is batched over all chunks at once in torch; what remains is a scan over the chunks of
each sequence, per value head, of a [dk, dv] state. Written with torch ops that scan is a Python loop (a few small
kernels per chunk, forward and backward); here it is one program per (sequence x head, block of value columns)
that keeps its block of the state on chip and walks the chunks in order (forward) or in reverse (backward). The
columns of a state evolve independently (every update multiplies the state from the left), so blocks of value
columns need no communication.

Forward (chunk i, S_0 the initial state): stores S_i, then

    Vn_i = U_i - W_i S_i                 S_{i+1} = decay_i S_i + KD_i^T Vn_i

(W None, the plain gated rule of Mamba-2: Vn_i = U_i, no product with W and no Vn written; HAS_W a constexpr)

Backward (dS_n the final state's gradient, X_i = attn_i^T dO_i, Y_i = Qd_i^T dO_i precomputed): stores dS_{i+1},

    dVn_i = X_i + KD_i dS_{i+1}          dS_i = Y_i + decay_i dS_{i+1} - W_i^T dVn_i

and dS_0 at the end. Tensors are fp32 and contiguous: U / Vn / X / dVn [BH, n, C, dv], W / KD [BH, n, C, dk], decay
[BH, n] (or [BH, n, dk]: Kimi Delta Attention's decay per key channel scales each row of the state, ``PER_ROW``),
states [BH, (n,) dk, dv]. tl.dot runs at input_precision "ieee" (fp32 FMAs, as torch's fp32 matmul) so the
kernels agree with the torch scan to fp32 round-off; C, the key block and the value block are at least 16 (tl.dot's
smallest tile).

Legend: BH = sequences x value heads, n = chunks, C = chunk, dk / dv = key / value head dims.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MAX_KEY_DIM = 256  # the whole key dimension of a state block lives in registers


@triton.jit
def _scan_fwd_kernel(U, W, KD, DECAY, S0, S_ALL, VN, S_FINAL, n_chunks, dk, dv,
                     C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_S0: tl.constexpr,
                     PRECISION: tl.constexpr, PER_ROW: tl.constexpr = False, HAS_W: tl.constexpr = True):
    bh = tl.program_id(0).to(tl.int64)
    rc = tl.arange(0, C)
    rk = tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    mk, mv = rk < dk, rv < dv
    state_off = rk[:, None] * dv + rv[None, :]
    state_mask = mk[:, None] & mv[None, :]
    if HAS_S0:
        S = tl.load(S0 + bh * dk * dv + state_off, mask=state_mask, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    for i in range(n_chunks):
        chunk = bh * n_chunks + i
        tl.store(S_ALL + chunk * dk * dv + state_off, S, mask=state_mask)
        key_off = chunk * C * dk + rc[:, None] * dk + rk[None, :]
        val_off = chunk * C * dv + rc[:, None] * dv + rv[None, :]
        vn = tl.load(U + val_off, mask=mv[None, :], other=0.0)
        if HAS_W:
            w = tl.load(W + key_off, mask=mk[None, :], other=0.0)
            vn = vn - tl.dot(w, S, input_precision=PRECISION)
            tl.store(VN + val_off, vn, mask=mv[None, :])
        kd = tl.load(KD + key_off, mask=mk[None, :], other=0.0)
        if PER_ROW:  # a decay per key channel: each row of the state its own
            S = S * tl.load(DECAY + chunk * dk + rk, mask=mk, other=0.0)[:, None]
        else:
            S = S * tl.load(DECAY + chunk)
        S = S + tl.dot(tl.trans(kd), vn, input_precision=PRECISION)
    tl.store(S_FINAL + bh * dk * dv + state_off, S, mask=state_mask)


@triton.jit
def _scan_bwd_kernel(X, Y, W, KD, DECAY, DS_FINAL, DVN, DS_NEXT, DS0, n_chunks, dk, dv,
                     C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_DS_FINAL: tl.constexpr,
                     PRECISION: tl.constexpr, PER_ROW: tl.constexpr = False, HAS_W: tl.constexpr = True):
    bh = tl.program_id(0).to(tl.int64)
    rc = tl.arange(0, C)
    rk = tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    mk, mv = rk < dk, rv < dv
    state_off = rk[:, None] * dv + rv[None, :]
    state_mask = mk[:, None] & mv[None, :]
    if HAS_DS_FINAL:
        dS = tl.load(DS_FINAL + bh * dk * dv + state_off, mask=state_mask, other=0.0)
    else:
        dS = tl.zeros([BK, BV], dtype=tl.float32)
    for j in range(n_chunks):
        chunk = bh * n_chunks + (n_chunks - 1 - j)
        tl.store(DS_NEXT + chunk * dk * dv + state_off, dS, mask=state_mask)
        key_off = chunk * C * dk + rc[:, None] * dk + rk[None, :]
        val_off = chunk * C * dv + rc[:, None] * dv + rv[None, :]
        kd = tl.load(KD + key_off, mask=mk[None, :], other=0.0)
        x = tl.load(X + val_off, mask=mv[None, :], other=0.0)
        dvn = x + tl.dot(kd, dS, input_precision=PRECISION)
        tl.store(DVN + val_off, dvn, mask=mv[None, :])
        y = tl.load(Y + chunk * dk * dv + state_off, mask=state_mask, other=0.0)
        if PER_ROW:
            dS = dS * tl.load(DECAY + chunk * dk + rk, mask=mk, other=0.0)[:, None]
        else:
            dS = dS * tl.load(DECAY + chunk)
        dS = y + dS
        if HAS_W:
            w = tl.load(W + key_off, mask=mk[None, :], other=0.0)
            dS = dS - tl.dot(tl.trans(w), dvn, input_precision=PRECISION)
    tl.store(DS0 + bh * dk * dv + state_off, dS, mask=state_mask)


def blocks(dk: int, dv: int, BH: int = 1, min_programs: int = 0) -> tuple[int, int]:
    """(key block, value block): the whole key dimension (a power of two, at least 16) and a value block that
    keeps the state tile at 8k fp32 values or less (64 columns for dk <= 128, 32 beyond), halved (down to 16) while
    the launch, BH x dv / value block programs, has fewer than ``min_programs``: each program walks all chunks in
    sequence, so a launch of few programs leaves most of the GPU idle (on an H200, 4 sequences x 8 heads of 128 gave
    64 programs for 132 SMs, and the scan took 1.4x the torch loop's time)."""
    if dk > MAX_KEY_DIM:
        raise ValueError(f"key head dim {dk} > {MAX_KEY_DIM}: the Triton scan keeps a whole key column on chip")
    bk = max(16, triton.next_power_of_2(dk))
    bv = max(16, min(64 if bk <= 128 else 32, triton.next_power_of_2(dv)))
    while bv > 16 and BH * triton.cdiv(dv, bv) < min_programs:
        bv //= 2
    return bk, bv


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def programs_wanted(device: torch.device) -> int:
    """Two programs per multiprocessor of a CUDA device; 0 (no narrowing) elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 0
    return 2 * _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


def supports(chunk: int, dk: int, dtype: torch.dtype) -> bool:
    """Shapes the kernels take (tl.dot needs tiles of 16 or more; fp32 only)."""
    return dtype == torch.float32 and chunk >= 16 and dk <= MAX_KEY_DIM


def launch_options(bk: int, bv: int) -> dict:
    """Two pipeline stages (the next chunk's tiles load while this one's products run): with fp32 tiles, the
    default three would need 190 KiB of shared memory at dk = dv = 128 and 300 KiB at 256 (an H100 has 227 KiB);
    two need 112 / 168 KiB (checked by compiling for sm_90, tests/kernels/triton_aot.py --gated-delta)."""
    return dict(num_warps=4 if bk * bv <= 4096 else 8, num_stages=2)


def _launch_args(dk: int, dv: int, BH: int, device: torch.device):
    bk, bv = blocks(dk, dv, BH, programs_wanted(device))
    return (BH, triton.cdiv(dv, bv)), bk, bv, launch_options(bk, bv)


def scan_forward(U, W, KD, decay, S0):
    """(S_all [BH, n, dk, dv], Vn [BH, n, C, dv], S_final [BH, dk, dv]); S0 None: zeros; W None: the plain rule
    (Vn is U)."""
    BH, n, C, dv = U.shape
    dk = KD.shape[-1]
    grid, bk, bv, opts = _launch_args(dk, dv, BH, U.device)
    S_all = U.new_empty(BH, n, dk, dv)
    Vn = U if W is None else torch.empty_like(U)
    S_final = U.new_empty(BH, dk, dv)
    _scan_fwd_kernel[grid](U, KD if W is None else W, KD, decay, S0 if S0 is not None else S_final, S_all, Vn,
                           S_final, n, dk, dv, C=C, BK=bk, BV=bv, HAS_S0=S0 is not None, PRECISION="ieee",
                           PER_ROW=decay.dim() == 3, HAS_W=W is not None, **opts)
    return S_all, Vn, S_final


def scan_backward(X, Y, W, KD, decay, dS_final):
    """(dVn [BH, n, C, dv], dS_next [BH, n, dk, dv] (chunk i: dS_{i+1}), dS0 [BH, dk, dv]); dS_final None: zeros;
    W None: the plain rule."""
    BH, n, C, dv = X.shape
    dk = KD.shape[-1]
    grid, bk, bv, opts = _launch_args(dk, dv, BH, X.device)
    dVn = torch.empty_like(X)
    dS_next = X.new_empty(BH, n, dk, dv)
    dS0 = X.new_empty(BH, dk, dv)
    _scan_bwd_kernel[grid](X, Y, KD if W is None else W, KD, decay, dS_final if dS_final is not None else dS0, dVn,
                           dS_next, dS0, n, dk, dv, C=C, BK=bk, BV=bv, HAS_DS_FINAL=dS_final is not None,
                           PRECISION="ieee", PER_ROW=decay.dim() == 3, HAS_W=W is not None, **opts)
    return dVn, dS_next, dS0
