"""Dynamic sampling in the data pool (``drop_zero_advantage_groups``): groups without policy-gradient signal are not
delivered, leave the window and the admission count, and are counted; on a real SQLite database."""

import sqlite3

import pytest
from pool_cases import fill_group, make_episode

from forge_megatron.middleware.pool import ZERO_ADVANTAGE_TOL
from forge_megatron.middleware.pool_server import build_parser
from forge_megatron.middleware.wire import episode_to_wire

# rewards per group, and whether the group carries signal
GROUPS = [("solved", [1.0, 1.0, 1.0], False),
          ("unsolved", [0.0, 0.0, 0.0], False),
          ("tied-floats", [0.1, 0.1, 0.1], False),  # the group mean of equal floats is round-off away from them
          ("mixed", [1.0, 0.0, 1.0], True)]


def _fill(pool):
    gids, episodes = [], []
    for name, rewards, _ in GROUPS:
        gid = pool.register_group(name, len(rewards))
        gids.append(gid)
        episodes.append(fill_group(pool, gid, len(rewards), rewards))
    return gids, episodes


def _sampled(episodes):
    return sum(int(episode_to_wire(ep)[1][1].sum()) for ep in episodes)


@pytest.mark.parametrize("window", [1, "inf"])
def test_groups_without_signal_leave_the_window(make_pool, db, window):
    pool = make_pool(window=window, drop_zero_advantage_groups=True)
    gids, episodes = _fill(pool)
    states = [pool.group_status(g)["state"] for g in gids]
    assert states == ["filtered", "filtered", "filtered", "finished"]
    batch = pool.next_batch(1, timeout_s=0)  # strict FIFO too: the head passed the filtered groups
    assert batch.group_indices == [int(gids[3][1:])]
    assert batch.metrics["filtered_groups_total"] == 3
    assert any(s.advantages.any() for s in batch.samples)
    metrics = pool.metrics()
    assert metrics["filtered_groups"] == 3 and metrics["head"] is None
    assert (metrics["filtered_solved"], metrics["filtered_unsolved"]) == (2, 1)  # 0.1 > 0 counts as success
    assert metrics["filtered_episodes"] == 9
    assert metrics["filtered_tokens"] == _sampled(episodes[0] + episodes[1] + episodes[2])
    with sqlite3.connect(db) as con:  # never to be trained: their tokens are deleted
        assert con.execute("SELECT COUNT(*) FROM episodes WHERE blob IS NOT NULL").fetchone()[0] == 3
    pool.close()
    reopened = make_pool(window=window, drop_zero_advantage_groups=True)
    again = reopened.metrics()
    assert again["filtered_groups"] == 3 and again["filtered_tokens"] == metrics["filtered_tokens"]
    assert reopened.next_batch(1, timeout_s=0) is None


def test_off_by_default_every_group_is_delivered_in_order(make_pool):
    pool = make_pool(window=1)
    gids, _ = _fill(pool)
    batch = pool.next_batch(4, timeout_s=0)
    assert batch.group_indices == [int(g[1:]) for g in gids]
    assert pool.metrics()["filtered_groups"] == 0 and batch.metrics["filtered_groups_total"] == 0
    assert pool.config_summary()["drop_zero_advantage_groups"] is False


def test_the_filter_reads_final_advantages_not_outcomes(make_pool):
    """All episodes solved the task, but a process penalty (a malformed tool call) separates them: signal, kept.
    A group of one gets zero advantages (singleton_group='zero'): filtered."""
    pool = make_pool(window="inf", drop_zero_advantage_groups=True)
    gid = pool.register_group("penalised", 3)
    for i in range(3):
        ep = make_episode(gid, f"p{i}", reward=1.0, seed=i)
        ep.num_malformed_tool_calls = int(i == 0)
        pool.submit_episode(ep)
    single = pool.register_group("single", 1)
    fill_group(pool, single, 1, [1.0])
    assert pool.group_status(gid)["state"] == "finished"
    assert pool.group_status(single)["state"] == "filtered"
    advantages = [s.advantages.max() for s in pool.next_batch(1, timeout_s=0).samples]
    assert max(abs(a) for a in advantages) > ZERO_ADVANTAGE_TOL


@pytest.mark.parametrize("drop", [False, True])
def test_filtered_groups_free_admission(make_pool, drop):
    """max_staleness 0, one group per step: admission waits for the group's delivery, unless it was filtered."""
    pool = make_pool(window="inf", max_staleness=0, train_batch_groups=1, generation_batch_groups=1,
                     drop_zero_advantage_groups=drop)
    fill_group(pool, pool.register_group("solved", 2), 2, [1.0, 1.0])
    assert pool.can_admit() == drop
    if drop:
        fill_group(pool, pool.register_group("mixed", 2), 2, [1.0, 0.0])
        assert not pool.can_admit()


def test_forge_pool_flag():
    assert build_parser().parse_args(["--drop-zero-advantage-groups"]).drop_zero_advantage_groups
    assert not build_parser().parse_args([]).drop_zero_advantage_groups
