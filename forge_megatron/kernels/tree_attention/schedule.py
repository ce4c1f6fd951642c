"""Tile schedules of the Triton tree-attention kernels: which tiles each program visits, and which need a mask.

The kernels tile the [queries x keys] score matrix into BLOCK_M x BLOCK_N tiles. A tile is, by the rules of
triton_kernel.py's docstring (sub_end's min / max per key block; with bidirectional blocks key_end's min / max per
query block; with a window the depths),
  empty    (0): no query of it sees a key of it -> never visited,
  full     (1): every query sees every key -> computed without a mask,
  partial  (2): otherwise -> computed with the element mask.
A schedule lists, for every row block (a query block for the forward and dQ kernels, a key block for the dK/dV
kernel), the runs of consecutive column blocks whose tiles are full, and separately those whose tiles are partial,
as CSR arrays (row r's full runs are full_lo[full_offsets[r]:full_offsets[r + 1]] .. full_hi[...], column blocks
[lo, hi)). The kernels then loop over runs and, inside a run, over consecutive blocks with no test in the loop: no
data-dependent branch around the loads, so Triton can pipeline them (the first H200 run of the kernels, which tested
every block of the causal range inside the loop, reached 0.28x of SDPA's speed). A GRPO group's completion block has
two full runs (the prompt, its own completion) and a partial tile or two where they end; an agent episode's chain one
full run and the diagonal tile.

Built with torch ops on sub_end's device (a few host syncs, for the run counts) and cached per (sub_end, key_end,
shape, blocks, window, chunk): every layer of a micro-batch, and the backward, reuse the first layer's.

Legend: T = tree tokens (keys), TQ = queries (the last TQ tokens), QB / KB = query / key blocks, R / C = row /
column blocks of a schedule.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

EMPTY, FULL, PARTIAL = 0, 1, 2
_INT_MAX = 2**31 - 1
# tiles classified at once (int8 each, a few temporaries of the same size): bounds the schedule's memory at long T
_CHUNK_TILES = 1 << 24


@dataclass(frozen=True)
class TileSchedule:
    """Per row block, the runs [lo, hi) of column blocks with full tiles and with partial tiles (CSR, int32)."""

    full_offsets: torch.Tensor
    full_lo: torch.Tensor
    full_hi: torch.Tensor
    partial_offsets: torch.Tensor
    partial_lo: torch.Tensor
    partial_hi: torch.Tensor
    full_tiles: int
    partial_tiles: int

    @property
    def rows(self) -> int:
        return self.full_offsets.numel() - 1

    def args(self) -> tuple[torch.Tensor, ...]:
        """The six arrays in the kernels' argument order (F_OFF, F_LO, F_HI, P_OFF, P_LO, P_HI)."""
        return (self.full_offsets, self.full_lo, self.full_hi, self.partial_offsets, self.partial_lo, self.partial_hi)


@dataclass(frozen=True)
class _BlockStats:
    """What the tile rules read, per block: queries [q_lo, q_hi) with their key_end range and least depth, keys
    [k_lo, k_lo + BLOCK_N) with their sub_end range and greatest depth."""

    q_lo: torch.Tensor
    q_hi: torch.Tensor
    k_end: torch.Tensor  # keys at or past it are seen by no query of the block (causal: q_hi; blocks: max key_end)
    kemin: torch.Tensor | None  # least key_end of the block's queries (bidirectional blocks only)
    qdmin: torch.Tensor | None  # least depth of the block's queries (window only)
    k_lo: torch.Tensor
    kmin: torch.Tensor
    kmax: torch.Tensor
    kdmax: torch.Tensor | None  # greatest depth of the key block (window only)


def _block_reduce(x: torch.Tensor, block: int, pad_value: int, op: str) -> torch.Tensor:
    padded = F.pad(x.long(), (0, -x.numel() % block), value=pad_value).view(-1, block)
    return padded.amin(1) if op == "min" else padded.amax(1)


def _stats(sub_end_T: torch.Tensor, TQ: int, block_m: int, block_n: int, window: int,
           key_end_T: torch.Tensor | None, chunk: int = 0) -> _BlockStats:
    from forge_megatron.kernels.tree_attention.ops import depths

    T = sub_end_T.numel()
    device = sub_end_T.device
    q0 = T - TQ
    q_lo = q0 + torch.arange(0, TQ, block_m, device=device, dtype=torch.long)
    q_hi = torch.clamp(q_lo + block_m, max=T)
    if key_end_T is not None:
        queries = key_end_T[q0:]
        k_end, kemin = _block_reduce(queries, block_m, 0, "max"), _block_reduce(queries, block_m, _INT_MAX, "min")
    else:
        k_end, kemin = q_hi, None
    qdmin = kdmax = None
    if window or chunk:
        depth_T = derived(sub_end_T, "depths", depths)  # the kernels' DEPTH argument: computed once
        qdmin = _block_reduce(depth_T[q0:], block_m, _INT_MAX, "min")
        kdmax = _block_reduce(depth_T, block_n, -1, "max")
    return _BlockStats(q_lo=q_lo, q_hi=q_hi, k_end=k_end, kemin=kemin, qdmin=qdmin,
                       k_lo=torch.arange(0, T, block_n, device=device, dtype=torch.long),
                       kmin=_block_reduce(sub_end_T, block_n, _INT_MAX, "min"),
                       kmax=_block_reduce(sub_end_T, block_n, 0, "max"), kdmax=kdmax)


def _classes(s: _BlockStats, qbs: slice, kbs: slice, block_n: int, window: int, chunk: int = 0) -> torch.Tensor:
    """int8 [query blocks qbs, key blocks kbs]: EMPTY, FULL or PARTIAL by triton_kernel.py's tile rules (with a
    window or chunks: no tile is full; one whose keys all lie above the window, or above the chunk start of the
    block's shallowest query, is empty)."""
    q_lo, q_hi, k_end = s.q_lo[qbs, None], s.q_hi[qbs, None], s.k_end[qbs, None]
    k_lo, kmin, kmax = s.k_lo[None, kbs], s.kmin[None, kbs], s.kmax[None, kbs]
    live = (k_lo < k_end) & (kmax > q_lo)
    if window or chunk:
        if window:
            live &= s.kdmax[None, kbs] + window > s.qdmin[qbs, None]
        if chunk:
            live &= s.kdmax[None, kbs] >= torch.div(s.qdmin[qbs, None], chunk, rounding_mode="floor") * chunk
        full = torch.zeros_like(live)
    else:
        keys_below = k_lo + block_n <= s.kemin[qbs, None] if s.kemin is not None else k_lo + block_n - 1 <= q_lo
        full = live & keys_below & (kmin >= q_hi)
    return torch.where(full, FULL, torch.where(live, PARTIAL, EMPTY)).to(torch.int8)


def _runs(classes_RC: torch.Tensor, kind: int, row0: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, lo, hi) of every maximal run of ``kind`` along the columns, rows offset by row0, row-major order."""
    m = classes_RC == kind
    starts = m & ~F.pad(m[:, :-1], (1, 0), value=False)
    ends = m & ~F.pad(m[:, 1:], (0, 1), value=False)
    s, e = starts.nonzero(), ends.nonzero()  # the same runs in the same order: one start and one end each
    return s[:, 0] + row0, s[:, 1], e[:, 1] + 1


def _csr(rows: int, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], device) -> tuple:
    row = torch.cat([p[0] for p in parts]) if parts else torch.zeros(0, dtype=torch.long, device=device)
    lo = torch.cat([p[1] for p in parts]) if parts else row
    hi = torch.cat([p[2] for p in parts]) if parts else row
    offsets = torch.zeros(rows + 1, dtype=torch.int32, device=device)
    offsets[1:] = torch.cumsum(torch.bincount(row, minlength=rows), 0)
    return offsets, lo.to(torch.int32), hi.to(torch.int32), int((hi - lo).sum())


def build_schedule(sub_end_T: torch.Tensor, TQ: int, block_m: int, block_n: int, window: int = 0,
                   key_end_T: torch.Tensor | None = None, by: str = "query", chunk: int = 0) -> TileSchedule:
    """The schedule of BLOCK_M x BLOCK_N tiles for queries = the last TQ tokens (tiled from T - TQ): rows are query
    blocks (``by="query"``: forward, dQ) or key blocks (``by="key"``: dK / dV), runs go along the other axis."""
    if by not in ("query", "key"):
        raise ValueError(f"by must be 'query' or 'key', got {by!r}")
    s = _stats(sub_end_T, TQ, block_m, block_n, window, key_end_T, chunk)
    QB, KB = s.q_lo.numel(), s.k_lo.numel()
    rows, cols = (QB, KB) if by == "query" else (KB, QB)
    step = max(1, _CHUNK_TILES // max(cols, 1))
    full, partial = [], []
    for r0 in range(0, rows, step):
        r = slice(r0, min(rows, r0 + step))
        classes = _classes(s, r, slice(None), block_n, window, chunk) if by == "query" else \
            _classes(s, slice(None), r, block_n, window, chunk).t().contiguous()
        full.append(_runs(classes, FULL, r0))
        partial.append(_runs(classes, PARTIAL, r0))
    f_off, f_lo, f_hi, n_full = _csr(rows, full, sub_end_T.device)
    p_off, p_lo, p_hi, n_partial = _csr(rows, partial, sub_end_T.device)
    return TileSchedule(f_off, f_lo, f_hi, p_off, p_lo, p_hi, n_full, n_partial)


_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 32


def _identity(t: torch.Tensor | None) -> tuple:
    if t is None:
        return (None,)
    # inference tensors have no version counter, and cannot be changed in place outside inference mode
    version = -1 if t.is_inference() else t._version
    return (id(t), version, t.data_ptr(), t.numel(), str(t.device))


def schedule(sub_end_T: torch.Tensor, TQ: int, block_m: int, block_n: int, window: int = 0,
             key_end_T: torch.Tensor | None = None, by: str = "query", chunk: int = 0) -> TileSchedule:
    """:func:`build_schedule`, cached: the same sub_end (and key_end) tensor objects, unmodified, with the same
    arguments give the schedule built the first time (a tensor that died and whose memory was reused is a miss: the
    cache holds weak references and checks them)."""
    key = (_identity(sub_end_T), _identity(key_end_T), TQ, block_m, block_n, int(window), by, int(chunk))
    hit = _CACHE.get(key)
    if hit is not None:
        sub_ref, key_ref, found = hit
        if sub_ref() is sub_end_T and (key_ref is None or key_ref() is key_end_T):
            _CACHE.move_to_end(key)
            return found
    found = build_schedule(sub_end_T, TQ, block_m, block_n, window, key_end_T, by, chunk)
    _forget_dead(_CACHE)
    _CACHE[key] = (weakref.ref(sub_end_T), None if key_end_T is None else weakref.ref(key_end_T), found)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return found


def _forget_dead(cache: OrderedDict) -> None:
    """Drop the entries whose tensor has been freed (the last micro-batch's): what they hold goes with them."""
    for key in [key for key, entry in cache.items() if entry[0]() is None]:
        del cache[key]


_DERIVED: OrderedDict = OrderedDict()


def derived(t: torch.Tensor, tag, make):
    """``make(t)``, cached like :func:`schedule` on t's identity and version and ``tag``: a tensor made from sub_end
    per call (context parallelism's clamped sub_end of each chunk) is then the same object in every layer and in the
    backward, so its tile schedule is built once, not once per layer."""
    key = (_identity(t), tag)
    hit = _DERIVED.get(key)
    if hit is not None and hit[0]() is t:
        _DERIVED.move_to_end(key)
        return hit[1]
    made = make(t)
    _forget_dead(_DERIVED)
    _DERIVED[key] = (weakref.ref(t), made)
    while len(_DERIVED) > 4 * _CACHE_SIZE:
        _DERIVED.popitem(last=False)
    return made
