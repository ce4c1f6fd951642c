"""Windowed FIFO rules: the selection logic against a brute-force definition, and the same rules in a real pool.

The simulation in benchmarks/scheduler.py is tested in test_scheduler_sim.py."""

import math
import os

import numpy as np
import pytest
from pool_cases import fill_group

from forge_megatron.middleware.pool import DataPool, PoolConfig
from forge_megatron.middleware.scheduler import PendingGroup, select_groups, window_occupancy, window_size


def brute_force(pending: list[PendingGroup], window: float, k: int) -> list[int]:
    """The definition, one group at a time: head = oldest untaken pending group; take the oldest finished one
    with index in [head, head + W - 1]."""
    taken: list[int] = []
    for _ in range(k):
        left = [g for g in pending if g.index not in taken]
        if not left:
            break
        head = min(g.index for g in left)
        ok = sorted(g.index for g in left if g.finished and head <= g.index <= head + window - 1)
        if not ok:
            break
        taken.append(ok[0])
    return taken


@pytest.mark.parametrize("window", [1, 2, 3, 7, math.inf])
def test_select_matches_definition_on_random_states(window):
    rng = np.random.default_rng(int(window) if window != math.inf else 99)
    for _ in range(300):
        n = int(rng.integers(0, 25))
        indices = sorted(rng.choice(100, size=n, replace=False).tolist())
        pending = [PendingGroup(i, bool(rng.random() < 0.5)) for i in indices]
        k = int(rng.integers(1, 8))
        assert select_groups(pending, window, k) == brute_force(pending, window, k)


def test_never_beyond_window_and_greedy_inside():
    pending = [PendingGroup(i, f) for i, f in enumerate([False, True, True, False, True, True])]
    # W = 3: window [0, 2]; groups 1, 2 are finished; 4, 5 are beyond the window.
    assert select_groups(pending, 3, 10) == [1, 2]
    # W = 5 reaches group 4 but not 5.
    assert select_groups(pending, 5, 10) == [1, 2, 4]


def test_head_advance_slides_window():
    pending = [PendingGroup(i, True) for i in range(6)]
    # Taking the head moves it, so W = 2 still yields six groups in order.
    assert select_groups(pending, 2, 6) == [0, 1, 2, 3, 4, 5]


def test_strict_fifo_blocks_on_unfinished_head():
    pending = [PendingGroup(0, False)] + [PendingGroup(i, True) for i in range(1, 5)]
    assert select_groups(pending, 1, 4) == []
    assert select_groups(pending, math.inf, 4) == [1, 2, 3, 4]


def test_window_occupancy():
    pending = [PendingGroup(i, f) for i, f in zip([3, 4, 6, 9], [False, True, True, True])]
    assert window_occupancy(pending, 4) == (2, 3)  # window [3, 6]
    assert window_occupancy([], 4) == (0, 0)


@pytest.mark.parametrize(
    ("window", "fraction", "n", "expected"),
    [(None, 0.3, 16, 5.0), (None, 0.3, 1, 1.0), (None, 1.0, 8, 8.0), (1, 0.3, 16, 1.0), ("inf", 0.3, 4, math.inf),
     (float("inf"), 0.3, 4, math.inf), (4, 0.3, 4, 4.0), ("12", 0.3, 4, 12.0), (0, 0.3, 16, 5.0),
     ("0", 0.5, 4, 2.0)],
)
def test_window_size(window, fraction, n, expected):
    assert window_size(window, fraction, n) == expected


@pytest.mark.parametrize(
    ("window", "fraction", "n", "message"),
    [(-1, 0.3, 4, "window must be an int >= 1 or 'inf', got -1"), (2.5, 0.3, 4, "got 2.5"),
     ("wide", 0.3, 4, "got 'wide'"), ("-2", 0.3, 4, "got '-2'"),
     (None, 0.0, 4, "window_fraction must be in (0, 1], got 0.0"),
     (None, 0.3, 0, "generation_batch_groups must be >= 1, got 0")],
)
def test_window_size_errors(window, fraction, n, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        window_size(window, fraction, n)


def _pool(tmp_path, name: str = "pool", **kw) -> DataPool:
    return DataPool(PoolConfig(db_path=os.fspath(tmp_path / f"{name}.sqlite"), **kw))


def test_pool_window_rules(tmp_path):
    """N = 10, fraction 0.3 -> W = 3: a finished group 3 places behind an unfinished head waits."""
    pool = _pool(tmp_path, generation_batch_groups=10)
    gids = [pool.register_group(f"t{i}", 2) for i in range(6)]
    idx = [int(g[1:]) for g in gids]
    for g in (gids[1], gids[3], gids[5]):
        fill_group(pool, g, 2)
    batch = pool.next_batch(2, timeout_s=0)
    assert batch is None  # only group 1 is inside [head, head + 2]; group 3 is beyond
    m = pool.metrics()
    assert (m["head"], m["window"], m["window_ready"], m["window_pending"], m["queue_depth"]) == (idx[0], 3, 1, 3, 3)
    assert m["window_occupancy"] == pytest.approx(1 / 3)
    batch = pool.next_batch(1, timeout_s=0)
    assert batch.group_indices == [idx[1]] and batch.metrics["head"] == idx[0]
    fill_group(pool, gids[0], 2)
    batch = pool.next_batch(2, timeout_s=0)
    assert batch.group_indices == [idx[0], idx[3]]  # head advanced past 0 and 1: window now reaches group 3
    assert pool.metrics()["head"] == idx[2]
    pool.close()


def test_pool_strict_and_greedy(tmp_path):
    strict = _pool(tmp_path, "strict", window=1)
    greedy = _pool(tmp_path, "greedy", window="inf")
    for pool in (strict, greedy):
        gids = [pool.register_group(f"t{i}", 2) for i in range(4)]
        for g in gids[1:]:
            fill_group(pool, g, 2)
    assert strict.next_batch(1, timeout_s=0) is None
    assert greedy.next_batch(3, timeout_s=0).group_indices == [2, 3, 4]
    fill_group(strict, "g000000001", 2)
    assert strict.next_batch(4, timeout_s=0).group_indices == [1, 2, 3, 4]
    strict.close()
    greedy.close()
