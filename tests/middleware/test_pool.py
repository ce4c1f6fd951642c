"""Data pool on a real SQLite database: scoring, failure policy, timeouts, delivery guarantees, recovery."""

import threading
import time

import numpy as np
import pytest
from pool_cases import fill_group, make_episode

from forge_megatron.algo.rewards import RewardConfig, score_group
from forge_megatron.middleware.batch import episode_outcome
from forge_megatron.middleware.pool import DataPool, PoolConfig
from forge_megatron.middleware.schema import SchemaError


@pytest.mark.parametrize(
    ("kw", "message"),
    [({"db_path": ""}, "db_path is empty"),
     ({"max_inflight_groups": 0}, "max_inflight_groups must be > 0 or None, got 0"),
     ({"train_batch_groups": -1}, "train_batch_groups must be > 0 or None, got -1"),
     ({"episode_timeout_s": 0}, "episode_timeout_s must be > 0 or None, got 0"),
     ({"max_staleness": -1}, "max_staleness must be >= 0 or None, got -1"),
     ({"max_retries": -2}, "max_retries must be >= 0, got -2"),
     ({"min_finished_episodes": 0}, "min_finished_episodes must be >= 1, got 0"),
     ({"window": "big"}, "window must be an int >= 1 or 'inf', got 'big'")],
)
def test_config_errors(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PoolConfig(**kw)


def test_batch_carries_algo_scores(make_pool):
    """Advantages/weights/rewards equal score_group on the mapped outcomes, broadcast on trained tokens only."""
    cfg = RewardConfig(completion_time_bound=0.5)
    pool = make_pool(reward=cfg)
    gid = pool.register_group("t", 3, domain="math")
    episodes = [make_episode(gid, f"e{i}", reward=r, segments=s, seed=i, duration_s=d)
                for i, (r, s, d) in enumerate([(1.0, 2, 3.0), (0.0, 1, 1.0), (1.0, 1, 2.0)])]
    for ep in episodes:
        ep.num_malformed_tool_calls = ep.segments[0].tokens[0] % 3
        pool.submit_episode(ep)
    expected = score_group([episode_outcome(ep) for ep in episodes], cfg)
    batch = pool.next_batch(1, timeout_s=0)
    assert [s.episode_id for s in batch.samples] == ["e0", "e0", "e1", "e2"]
    flat = [(e, s) for e, ep in enumerate(episodes) for s in range(len(ep.segments))]
    for sample, (e, s) in zip(batch.samples, flat):
        seg = episodes[e].segments[s]
        np.testing.assert_array_equal(sample.tokens, seg.tokens)
        np.testing.assert_array_equal(sample.policy_versions, seg.policy_versions)
        np.testing.assert_allclose(sample.rollout_logprobs, np.float32(seg.rollout_logprobs))
        mask = np.asarray(seg.loss_mask, dtype=bool)
        np.testing.assert_allclose(sample.advantages[mask], np.float32(expected.segment_advantages[e][s]))
        assert not sample.advantages[~mask].any()
        assert sample.sample_weight == pytest.approx(expected.segment_weights[e][s])
        assert sample.reward == pytest.approx(expected.rewards[e])
        assert sample.segment_return == pytest.approx(expected.segment_returns[e][s])
        assert sample.domain == "math"
    assert expected.rewards[0] != expected.rewards[2]  # the completion-time bonus made a difference
    assert batch.metrics["domain_samples"] == {"math": 4}


def test_overlong_penalty_counts_every_segments_sampled_tokens(make_pool):
    """--overlong-max-tokens: the pool penalises an episode by all the tokens its segments sampled (two segments of
    6 and 7 sampled tokens: 13), a ramp over the buffer; the delivered rewards carry it and the pool's config says
    it (what the trainer checks)."""
    pool = make_pool(reward=RewardConfig(overlong_max_tokens=12, overlong_buffer_tokens=4))
    gid = pool.register_group("t", 3)
    episodes = [make_episode(gid, "short", length=6), make_episode(gid, "ramp", length=20),
                make_episode(gid, "long", segments=2, length=12)]
    for ep in episodes:
        pool.submit_episode(ep)
    assert [sum(s.num_trained_tokens for s in ep.segments) for ep in episodes] == [3, 10, 13]
    rewards = {s.episode_id: s.reward for s in pool.next_batch(1, timeout_s=0).samples}
    assert rewards == pytest.approx({"short": 1.0, "ramp": 1.0 - 0.5, "long": 0.0})
    config = pool.metrics()["config"]
    assert (config["overlong_max_tokens"], config["overlong_buffer_tokens"], config["overlong_penalty"]) == (12, 4, 1.0)


def test_failed_episode_without_retries_completes_group_without_it(make_pool):
    pool = make_pool(window=1)
    gid = pool.register_group("t", 3)
    pool.submit_episode(make_episode(gid, "bad", status="failed"))
    fill_group(pool, gid, 2)
    batch = pool.next_batch(1, timeout_s=0)
    assert {s.episode_id for s in batch.samples} == {f"{gid}-e0", f"{gid}-e1"}


def test_all_failed_group_leaves_window(make_pool):
    pool = make_pool(window=1)
    bad, good = pool.register_group("t0", 2), pool.register_group("t1", 2)
    fill_group(pool, good, 2)
    assert pool.next_batch(1, timeout_s=0) is None  # strict FIFO: the head blocks
    pool.submit_episode(make_episode(bad, "x0", status="aborted"))
    pool.submit_episode(make_episode(bad, "x1", status="timed_out"))
    assert pool.group_status(bad)["state"] == "failed"
    assert pool.next_batch(1, timeout_s=0).group_indices == [int(good[1:])]
    assert pool.metrics()["groups"]["failed"] == 1


def test_retry_reopens_slot(make_pool):
    pool = make_pool(max_retries=1)
    gid = pool.register_group("t", 2)
    pool.episode_started(gid, "a")
    pool.submit_episode(make_episode(gid, "a", status="failed"))
    status = pool.group_status(gid)
    assert (status["state"], status["open_slots"]) == ("running", 2)
    pool.submit_episode(make_episode(gid, "b", reward=1.0, seed=1))
    pool.submit_episode(make_episode(gid, "c", status="failed"))  # retries exhausted: slot closes empty
    status = pool.group_status(gid)
    assert (status["state"], status["finished"], status["closed_empty"]) == ("finished", 1, 1)


def test_timeouts_unblock_head(make_pool):
    pool = make_pool(window=1, episode_timeout_s=1.0)
    stuck, idle, good = (pool.register_group(f"t{i}", 2) for i in range(3))
    pool.episode_started(stuck, "s0")
    pool.submit_episode(make_episode(stuck, "s1", reward=1.0))
    fill_group(pool, good, 2)
    assert pool.next_batch(1, timeout_s=0) is None
    batch = pool.next_batch(2, timeout_s=5.0)  # s0 times out; idle's slots close; stuck completes with s1
    assert batch.group_indices == [int(stuck[1:]), int(good[1:])]
    assert [s.episode_id for s in batch.samples if s.group_index == int(stuck[1:])] == ["s1"]
    assert pool.group_status(idle)["state"] == "failed"
    assert pool.submit_episode(make_episode(stuck, "s0")) == "late"


def test_submit_errors_and_duplicates(make_pool):
    pool = make_pool()
    gid = pool.register_group("t", 1)
    ep = make_episode(gid, "e")
    assert pool.submit_episode(ep) == "accepted"
    assert pool.submit_episode(ep) == "duplicate"
    with pytest.raises(SchemaError, match=f"group {gid} has no open slot for episode other"):
        pool.submit_episode(make_episode(gid, "other"))
    other = pool.register_group("t", 1)
    pool.episode_started(other, "started")
    with pytest.raises(SchemaError, match=f"episode started was started in group {other}, not {gid}"):
        pool.submit_episode(make_episode(gid, "started"))
    fill_group(pool, other, 1)  # completes the group while "started" still runs
    assert pool.submit_episode(make_episode(other, "started")) == "late"
    with pytest.raises(SchemaError, match="unknown group_id 'g000000099'"):
        pool.submit_episode(make_episode("g000000099", "x"))
    with pytest.raises(SchemaError, match="group_id 'zz' is not a pool group id"):
        pool.episode_started("zz", "x")
    with pytest.raises(SchemaError, match="group size must be an int >= 1, got 0"):
        pool.register_group("t", 0)
    with pytest.raises(ValueError, match="num_groups must be an int >= 1, got 0"):
        pool.next_batch(0)


def _deliver_batches(pool, n_batches, groups_per_batch=2):
    gids = [pool.register_group(f"t{i}", 2) for i in range(n_batches * groups_per_batch)]
    for g in gids:
        fill_group(pool, g, 2)
    return [pool.next_batch(groups_per_batch, timeout_s=0) for _ in range(n_batches)]


def test_commit_and_requeue_return_exactly_uncommitted(make_pool):
    pool = make_pool(window="inf")
    b1, b2, b3 = _deliver_batches(pool, 3)
    assert pool.commit(b1.batch_id) == 2
    assert pool.requeue_uncommitted() == b2.group_indices + b3.group_indices
    again = pool.next_batch(4, timeout_s=0)
    assert again.group_indices == b2.group_indices + b3.group_indices
    assert pool.next_batch(1, timeout_s=0) is None
    with pytest.raises(ValueError, match=f"batch {b2.batch_id} was requeued after a trainer restart"):
        pool.commit(b2.batch_id)
    with pytest.raises(ValueError, match="unknown batch_id 999"):
        pool.commit([999])
    with pytest.raises(ValueError, match="exactly one of batch_ids or up_to_batch_id"):
        pool.commit()
    assert pool.commit(up_to_batch_id=again.batch_id) == 4
    assert pool.metrics()["groups"]["committed"] == 6


@pytest.mark.parametrize("keep", [False, True])
def test_committed_and_dropped_trajectories_are_deleted_unless_kept(make_pool, db, keep):
    """The database must not grow with the run: a committed group's episodes (trained and checkpointed) and a failed
    group's lose their tokens; their states, scores and the batch records stay, and the pool reopens on them.
    keep_trajectories keeps everything (offline analysis)."""
    import sqlite3

    pool = make_pool(window="inf", keep_trajectories=keep, min_finished_episodes=2)
    b1, b2 = _deliver_batches(pool, 2)
    failed = pool.register_group("doomed", 2)
    pool.submit_episode(make_episode(failed, "d0"))
    pool.submit_episode(make_episode(failed, "d1", status="failed"))
    assert pool.commit(b1.batch_id) == 2

    def stored(group_indices):
        with sqlite3.connect(db) as con:
            marks = ",".join("?" * len(group_indices))
            return con.execute(f"SELECT COUNT(*) FROM episodes WHERE blob IS NOT NULL AND group_idx IN ({marks})",
                               group_indices).fetchone()[0]

    assert stored(b1.group_indices) == (4 if keep else 0)  # committed
    assert stored([int(failed[1:])]) == (1 if keep else 0)  # failed: never to be trained
    assert stored(b2.group_indices) == 4  # delivered, not committed: a trainer restart may need them again
    if keep:
        assert len(pool.load_batch(b1.batch_id).samples) == 4
    else:
        with pytest.raises(ValueError, match=f"batch {b1.batch_id} is committed and its trajectories were deleted"):
            pool.load_batch(b1.batch_id)
    metrics = pool.metrics()
    pool.close()
    reopened = make_pool(window="inf", keep_trajectories=keep, min_finished_episodes=2)
    assert reopened.metrics()["groups"] == metrics["groups"]
    assert reopened.requeue_uncommitted() == b2.group_indices
    assert reopened.next_batch(2, timeout_s=0).group_indices == b2.group_indices  # still servable


def test_restart_recovers_state_and_request_ids(make_pool):
    pool = make_pool(window="inf")
    b1, b2 = _deliver_batches(pool, 2)
    pool.commit(b1.batch_id)
    pool.set_policy_version(7)
    fill_group(pool, pool.register_group("extra", 2), 2)
    redo = pool.next_batch(1, timeout_s=0, request_id="r1")
    before = pool.metrics()
    pool.close()
    reopened = make_pool(window="inf")
    after = reopened.metrics()
    assert after["groups"] == before["groups"] and after["policy_version"] == 7
    again = reopened.next_batch(1, timeout_s=0, request_id="r1")
    assert (again.batch_id, again.group_indices) == (redo.batch_id, redo.group_indices)
    assert reopened.requeue_uncommitted() == b2.group_indices + redo.group_indices
    assert reopened.next_batch(3, timeout_s=0).group_indices == b2.group_indices + redo.group_indices


def test_request_id_returns_same_batch(make_pool):
    pool = make_pool(window="inf")
    gids = [pool.register_group(f"t{i}", 2, request_id=f"reg{i}") for i in range(3)]
    assert pool.register_group("t0", 2, request_id="reg0") == gids[0]
    for g in gids:
        fill_group(pool, g, 2)
    first = pool.next_batch(2, timeout_s=0, request_id="x")
    second = pool.next_batch(2, timeout_s=0, request_id="x")
    assert second.batch_id == first.batch_id and second.group_indices == first.group_indices
    np.testing.assert_array_equal(second.samples[3].advantages, first.samples[3].advantages)
    assert pool.next_batch(1, timeout_s=0, request_id="y").group_indices == [int(gids[2][1:])]


def test_backpressure(make_pool):
    pool = make_pool(max_inflight_groups=2, max_staleness=1, generation_batch_groups=2)
    a = pool.register_group("a", 1)
    assert pool.can_admit()
    b = pool.register_group("b", 1)
    assert not pool.can_admit()  # two running
    fill_group(pool, a, 1)
    fill_group(pool, b, 1)
    c = pool.register_group("c", 1)
    fill_group(pool, c, 1)
    assert pool.can_admit()  # undelivered 3, + 1 <= (1 + 1) * 2
    fill_group(pool, pool.register_group("d", 1), 1)
    assert not pool.can_admit()  # undelivered 4: a new group would be 2 steps behind
    pool.next_batch(2, timeout_s=0)
    assert pool.can_admit()


def test_staleness_and_blocking_wait(make_pool):
    pool = make_pool()
    gid = pool.register_group("t", 2)
    pool.set_policy_version(3)
    threading.Timer(0.3, lambda: fill_group(pool, gid, 2, version=1)).start()
    start = time.monotonic()
    batch = pool.next_batch(1, timeout_s=10)
    assert time.monotonic() - start >= 0.25
    assert batch.metrics["staleness_max"] == 2 and batch.metrics["wait_s"] >= 0.25
    metrics = pool.metrics()
    assert metrics["staleness_max"] == 2 and metrics["trainer_wait_total_s"] >= 0.25
    assert pool.next_batch(1, timeout_s=0.05) is None


def test_requeue_forgets_request_ids(make_pool):
    pool = make_pool()
    fill_group(pool, pool.register_group("t", 2), 2)
    first = pool.next_batch(1, timeout_s=0, request_id="a")
    pool.requeue_uncommitted()
    again = pool.next_batch(1, timeout_s=0, request_id="a")  # a late resend gets a fresh delivery, not the stale one
    assert again.batch_id != first.batch_id and again.group_indices == first.group_indices
    assert pool.commit(again.batch_id) == 1


def test_one_pool_per_database(db, make_pool):
    pool = make_pool()
    with pytest.raises(RuntimeError, match=f"another data pool is using {db}"):
        DataPool(PoolConfig(db_path=db))
    pool.close()
    make_pool().close()  # the lock is released on close (and when a process dies)
