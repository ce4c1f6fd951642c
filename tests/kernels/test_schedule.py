"""Tile schedules of the Triton kernels (kernels/tree_attention/schedule.py): which tiles each program visits and
which it masks, against the tile rules written out per tile in Python and against the element mask itself.
GPUs needed: 0.
"""

import pytest
import torch
from test_triton import BLOCK_CASES, _key_end, _random_blocks
from tree_cases import forest_cases, sub_end_from_samples

from forge_megatron.kernels.tree_attention import schedule as sch
from forge_megatron.kernels.tree_attention.ops import depths
from forge_megatron.kernels.tree_attention.reference import tree_mask

CASES = forest_cases()


def _rule_classes(sub_end, TQ, bm, bn, window=0, key_end=None) -> torch.Tensor:
    """[query blocks, key blocks] EMPTY / FULL / PARTIAL by the rules of triton_kernel.py's docstring, tile by tile."""
    T = sub_end.shape[0]
    q0, se, depth = T - TQ, sub_end.tolist(), depths(sub_end).tolist()
    rows = []
    for q_lo in range(q0, T, bm):
        q_hi = min(q_lo + bm, T)
        if key_end is not None:
            kemin, kemax = int(key_end[q_lo:q_hi].min()), int(key_end[q_lo:q_hi].max())
        else:
            kemin, kemax = q_lo + 1, q_hi
        row = []
        for k_lo in range(0, T, bn):
            keys = range(k_lo, min(k_lo + bn, T))
            live = k_lo < kemax and max(se[j] for j in keys) > q_lo
            if window:
                live = live and max(depth[j] for j in keys) + window > min(depth[i] for i in range(q_lo, q_hi))
            keys_below = k_lo + bn <= kemin if key_end is not None else k_lo + bn - 1 <= q_lo
            full = live and not window and keys_below and min(se[j] for j in keys) >= q_hi
            row.append(sch.FULL if full else sch.PARTIAL if live else sch.EMPTY)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int8)


def _dense(plan: sch.TileSchedule, cols: int) -> torch.Tensor:
    """The [rows, cols] classes a schedule encodes; checks its runs are ordered, disjoint and maximal."""
    out = torch.zeros(plan.rows, cols, dtype=torch.int8)
    for kind, off, lo, hi in ((sch.FULL, plan.full_offsets, plan.full_lo, plan.full_hi),
                              (sch.PARTIAL, plan.partial_offsets, plan.partial_lo, plan.partial_hi)):
        assert off.dtype == lo.dtype == hi.dtype == torch.int32 and int(off[0]) == 0 and int(off[-1]) == lo.numel()
        for r in range(plan.rows):
            end = -1
            for a, b in zip(lo[off[r]:off[r + 1]].tolist(), hi[off[r]:off[r + 1]].tolist()):
                assert end < a < b <= cols, (kind, r, a, b)  # ordered, not touching the previous run: maximal
                assert (out[r, a:b] == sch.EMPTY).all()
                out[r, a:b] = kind
                end = b
    assert int((out == sch.FULL).sum()) == plan.full_tiles and int((out == sch.PARTIAL).sum()) == plan.partial_tiles
    return out


def _check(sub_end, TQ, bm, bn, window=0, key_end=None):
    want = _rule_classes(sub_end, TQ, bm, bn, window, key_end)
    by_query = sch.build_schedule(sub_end, TQ, bm, bn, window, key_end)
    by_key = sch.build_schedule(sub_end, TQ, bm, bn, window, key_end, by="key")
    assert torch.equal(_dense(by_query, want.shape[1]), want)
    assert torch.equal(_dense(by_key, want.shape[0]).t(), want)
    # the rules are sound for the element mask: a full tile's real pairs are all visible, an empty tile's none
    T = sub_end.shape[0]
    mask = tree_mask(sub_end, TQ, window or None, key_end)
    for qb in range(want.shape[0]):
        for kb in range(want.shape[1]):
            tile = mask[qb * bm:(qb + 1) * bm, kb * bn:min((kb + 1) * bn, T)]
            if want[qb, kb] == sch.FULL:
                assert tile.all(), (qb, kb)
            elif want[qb, kb] == sch.EMPTY:
                assert not tile.any(), (qb, kb)
    return want


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("bm,bn", [(16, 16), (32, 16), (16, 32), (64, 32)])
def test_schedules_follow_the_tile_rules(case, bm, bn):
    sub_end = CASES[case]
    T = sub_end.shape[0]
    for TQ in (T, T - 7, 1):
        _check(sub_end, TQ, bm, bn)


@pytest.mark.parametrize("window", [1, 3, 20])
def test_schedules_with_a_window(window):
    for case in ("grpo", "long_chain", "random_trie"):
        sub_end = CASES[case]
        classes = _check(sub_end, sub_end.shape[0], 16, 16, window=window)
        assert not (classes == sch.FULL).any()  # a window masks every tile it does not skip


@pytest.mark.parametrize("case", sorted(BLOCK_CASES))
def test_schedules_with_bidirectional_blocks(case):
    sub_end, blocks = BLOCK_CASES[case]
    T = sub_end.shape[0]
    for key_end in (_key_end(sub_end, blocks), _key_end(sub_end, _random_blocks(sub_end, 3))):
        for TQ, bm, bn, window in ((T, 32, 32, 0), (T - 20, 16, 32, 0), (T, 16, 16, 4), (T - 37, 32, 16, 0)):
            _check(sub_end, TQ, bm, bn, window, key_end)


def test_a_grpo_group_is_a_few_runs_per_row():
    """What the kernels' loops see for a GRPO group (prompt of 256, 8 completions of 128, 64 x 64 tiles): each
    completion's query block has one full run over the prompt, at most one over its own earlier blocks and one
    partial tile (the diagonal); the other completions' tiles are never visited."""
    prompt = list(range(256))
    sub_end = sub_end_from_samples([prompt + [1000 + g] + list(range(2000, 2127)) for g in range(8)])
    plan = sch.build_schedule(sub_end, sub_end.shape[0], 64, 64)
    full_runs = plan.full_offsets.diff()
    partial_runs = plan.partial_offsets.diff()
    assert full_runs.max() <= 2 and partial_runs.max() <= 1
    blocks = -(-sub_end.shape[0] // 64)
    assert plan.full_tiles + plan.partial_tiles < blocks * (blocks + 1) // 2 * 0.6  # most causal tiles skipped


def test_long_trees_are_classified_in_chunks(monkeypatch):
    sub_end = CASES["random_trie"]
    whole = sch.build_schedule(sub_end, sub_end.shape[0], 16, 16, by="key")
    monkeypatch.setattr(sch, "_CHUNK_TILES", 5)  # a row or two per chunk
    chunked = sch.build_schedule(sub_end, sub_end.shape[0], 16, 16, by="key")
    for a, b in zip(whole.args(), chunked.args()):
        assert torch.equal(a, b)


def test_schedules_are_cached_per_tensor_and_version():
    sub_end = CASES["grpo"].clone()
    first = sch.schedule(sub_end, sub_end.shape[0], 16, 16)
    assert sch.schedule(sub_end, sub_end.shape[0], 16, 16) is first  # every layer of a micro-batch
    assert sch.schedule(sub_end, sub_end.shape[0], 16, 16, by="key") is not first
    twin = sub_end.clone()
    other = sch.schedule(twin, twin.shape[0], 16, 16)
    assert other is not first and all(torch.equal(a, b) for a, b in zip(other.args(), first.args()))
    sub_end[0] = 1  # changed in place: a new version, a new schedule
    assert sch.schedule(sub_end, sub_end.shape[0], 16, 16) is not first


def test_bad_by_raises():
    with pytest.raises(ValueError, match="by must be 'query' or 'key'"):
        sch.build_schedule(CASES["grpo"], 5, 16, 16, by="row")


def test_derived_tensors_are_the_same_object_per_layer():
    """Context parallelism clamps sub_end per chunk on every call: schedule.derived hands every layer (and the
    backward) the same clamped tensor, so the schedule cache hits."""
    sub_end = CASES["grpo"].clone()
    calls = []

    def clamp(t):
        calls.append(1)
        return t[:30].clamp(max=30)

    first = sch.derived(sub_end, ("clamp", 30), clamp)
    assert sch.derived(sub_end, ("clamp", 30), clamp) is first and len(calls) == 1
    assert sch.schedule(first, 10, 16, 16) is sch.schedule(sch.derived(sub_end, ("clamp", 30), clamp), 10, 16, 16)
    assert torch.equal(sch.derived(sub_end, ("clamp", 20), lambda t: t[:20].clamp(max=20)), sub_end[:20].clamp(max=20))
    sub_end[3] = 4  # changed in place: made again
    assert sch.derived(sub_end, ("clamp", 30), clamp) is not first and len(calls) == 2


def test_inference_tensors_are_cached_too():
    """Tensors made under torch.inference_mode have no version counter (reading it raises)."""
    with torch.inference_mode():
        sub_end = CASES["grpo"].clone()
        first = sch.schedule(sub_end, sub_end.shape[0], 16, 16)
    assert sch.schedule(sub_end, sub_end.shape[0], 16, 16) is first


def test_entries_of_freed_tensors_are_dropped():
    """A micro-batch's sub_end dies with it: the next insertion drops its schedules and derived tensors (CP's clamped
    copies are as long as the tree: kept for dead trees they would pile up on the GPU)."""
    import gc

    sub_end = CASES["grpo"].clone()
    sch.schedule(sub_end, sub_end.shape[0], 16, 16)
    sch.derived(sub_end, ("clamp", 30), lambda t: t[:30].clamp(max=30))
    assert any(entry[0]() is sub_end for entry in sch._CACHE.values())
    del sub_end
    gc.collect()
    other = CASES["random_trie"].clone()
    sch.schedule(other, other.shape[0], 16, 16)
    sch.derived(other, ("clamp", 30), lambda t: t[:30].clamp(max=30))
    for cache in (sch._CACHE, sch._DERIVED):
        assert all(entry[0]() is not None for entry in cache.values())
