"""Staleness guarantee of the data pool (``max_lag``): stale groups are dropped, on real SQLite and over ZeroMQ."""

import os

import numpy as np
import pytest
from pool_cases import fill_group, free_port, make_episode, start_pool_process, stop_process

from forge_megatron.middleware import pool_server
from forge_megatron.middleware.pool import DataPool, PoolConfig
from forge_megatron.middleware.scheduler import exceeds_lag
from forge_megatron.middleware.schema import SchemaError
from forge_megatron.middleware.transport import PoolClient

pytestmark = pytest.mark.timeout(120)


def _index(group_id: str) -> int:
    return int(group_id[1:])


def _sampled(episode) -> int:
    return sum(sum(s.loss_mask) for s in episode.segments)


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_max_lag_config_error(bad):
    with pytest.raises(ValueError, match=f"^max_lag must be an int >= 0 or None, got {bad!r}$"):
        PoolConfig(max_lag=bad)


def test_exceeds_lag_rule():
    assert not exceeds_lag(3, 5, 2) and exceeds_lag(3, 6, 2)  # trained at 5 = 3 + 2 is still allowed
    assert exceeds_lag(0, 1, 0) and not exceeds_lag(4, 4, 0)
    assert not exceeds_lag(0, 10**6, None)


def _run_greedy(pool: DataPool, steps: int = 30, per_step: int = 2, batch_groups: int = 2) -> list[int]:
    """Rollouts with heavy tails (most groups finish at once, one in five after 6 trainer steps) against a greedy
    trainer taking ``batch_groups`` groups per version. Returns the start-version lag of every delivered group."""
    rng = np.random.default_rng(7)
    finish_at: dict[int, list[str]] = {}
    lags = []
    for step in range(steps):
        version = pool.policy_version
        for _ in range(per_step):
            gid = pool.register_group("t", 2)
            finish_at.setdefault(step + (6 if rng.random() < 0.2 else 0), []).append((gid, version))
        for gid, started in finish_at.pop(step, []):
            for e in range(2):
                pool.submit_episode(make_episode(gid, f"{gid}-e{e}", reward=float(e), seed=e, version=started))
        batch = pool.next_batch(batch_groups, timeout_s=0)
        if batch is None:
            continue
        group_lags = [version - pool.group_status(f"g{i:09d}")["start_version"] for i in batch.group_indices]
        assert batch.metrics["group_staleness"] == group_lags  # tokens were sampled at the start version
        lags += group_lags
        pool.set_policy_version(version + 1)
    return lags


def test_greedy_with_max_lag_never_delivers_older_groups(tmp_path):
    unbounded = DataPool(PoolConfig(db_path=os.fspath(tmp_path / "a.sqlite"), window="inf"))
    bounded = DataPool(PoolConfig(db_path=os.fspath(tmp_path / "b.sqlite"), window="inf", max_lag=2))
    try:
        assert max(_run_greedy(unbounded)) > 2  # without the guarantee greedy trains the stragglers late
        lags = _run_greedy(bounded)
        metrics = bounded.metrics()
    finally:
        unbounded.close()
        bounded.close()
    assert max(lags) <= 2 and len(lags) >= 30
    assert metrics["stale_groups"] > 0 and metrics["staleness_max"] <= 2
    assert metrics["max_lag"] == 2


def test_stale_groups_leave_window_and_late_episodes_are_acknowledged(make_pool):
    pool = make_pool(window=1, max_lag=1)
    old = pool.register_group("t0", 3)
    pool.set_policy_version(1)
    young = pool.register_group("t1", 2)
    pool.episode_started(old, "a")
    done = make_episode(old, "b", seed=1, length=10)
    assert pool.submit_episode(done) == "accepted"
    fill_group(pool, young, 2, version=1)
    assert pool.next_batch(1, timeout_s=0) is None  # strict FIFO: the running old group blocks the head
    assert pool.metrics()["head"] == _index(old)
    pool.set_policy_version(2)  # old started at 0: 2 - 0 > 1, it can no longer train in time; young (1) can
    assert pool.group_status(old) | {"state": "stale", "open_slots": 0, "start_version": 0} == pool.group_status(old)
    metrics = pool.metrics()
    assert metrics["head"] == _index(young) and metrics["stale_groups"] == 1
    assert (metrics["stale_episodes"], metrics["stale_tokens"]) == (1, _sampled(done))
    late = [make_episode(old, "a", seed=2, length=14), make_episode(old, "c", seed=3, length=16)]
    assert [pool.submit_episode(ep) for ep in late] == ["late", "late"]
    assert pool.submit_episode(late[1]) == "late"  # a resend is not counted twice
    assert pool.submit_episode(make_episode(old, "d", status="failed")) == "late"
    assert pool.submit_episode(done) == "duplicate"
    metrics = pool.metrics()
    assert (metrics["stale_episodes"], metrics["stale_tokens"]) == (3, sum(map(_sampled, [done, *late])))
    with pytest.raises(SchemaError, match=f"group {old} is already complete \\(stale\\)"):
        pool.episode_started(old, "e")
    assert pool.next_batch(1, timeout_s=0).group_indices == [_index(young)]


def test_delivered_groups_are_never_dropped(make_pool):
    pool = make_pool(window="inf", max_lag=0)
    gid = pool.register_group("t", 2)
    fill_group(pool, gid, 2)
    assert pool.next_batch(1, timeout_s=0).group_indices == [_index(gid)]
    pool.set_policy_version(5)
    assert pool.group_status(gid)["state"] == "delivered"
    assert pool.requeue_uncommitted() == [_index(gid)]  # trainer restart: served again, still not stale
    pool.set_policy_version(6)
    assert pool.next_batch(1, timeout_s=0).group_indices == [_index(gid)]
    assert pool.metrics()["stale_groups"] == 0


def test_stale_state_survives_restart_and_applies_to_old_groups(make_pool):
    pool = make_pool()  # no guarantee yet: nothing is dropped
    kept, dropped = pool.register_group("t0", 2), pool.register_group("t1", 2)
    fill_group(pool, dropped, 2)
    pool.set_policy_version(3)
    kept_new = pool.register_group("t2", 2)
    assert pool.metrics()["stale_groups"] == 0
    pool.close()
    pool = make_pool(max_lag=2)
    assert pool.next_batch(1, timeout_s=0) is None  # the selection itself enforces the new guarantee
    assert [pool.group_status(g)["state"] for g in (kept, dropped, kept_new)] == ["stale", "stale", "running"]
    tokens = pool.metrics()["stale_tokens"]
    assert tokens > 0
    pool.close()
    pool = make_pool(max_lag=2)
    metrics = pool.metrics()
    assert (metrics["stale_groups"], metrics["stale_episodes"], metrics["stale_tokens"]) == (2, 2, tokens)
    assert pool.submit_episode(make_episode(kept, "x")) == "late"
    fill_group(pool, kept_new, 2, version=3)
    assert pool.next_batch(1, timeout_s=0).group_indices == [_index(kept_new)]


def test_max_lag_through_forge_pool_process(tmp_path):
    assert "--max-lag" in pool_server.build_parser().format_help()
    addr = f"tcp://127.0.0.1:{free_port()}"
    proc = start_pool_process(os.fspath(tmp_path / "pool.sqlite"), addr, "--window", "inf", "--max-lag", "1")
    client = None
    try:
        client = PoolClient(addr, timeout_s=5.0)
        old = client.register_group("t0", 2)
        client.episode_started(old, f"{old}-e0")
        client.set_policy_version(2)
        young = client.register_group("t1", 2)
        assert client.group_status(old)["state"] == "stale"
        assert client.submit_episode(make_episode(old, f"{old}-e0")) == "late"
        fill_group(client, young, 2, version=2)
        batch = client.get_batch(1, timeout_s=5.0)
        assert batch.group_indices == [_index(young)] and batch.metrics["staleness_max"] == 0
        metrics = client.metrics()
        assert (metrics["stale_groups"], metrics["stale_episodes"], metrics["max_lag"]) == (1, 1, 1)
    finally:
        if client is not None:
            client.close()
        stop_process(proc)


def test_forge_node_passes_max_lag(tmp_path):
    from forge_megatron.agents.middleware_node import build_parser, pool_config

    args = build_parser().parse_args(["--model-path", "m", "--engines", "http://127.0.0.1:1", "--pool-db",
                                      os.fspath(tmp_path / "p.sqlite"), "--max-lag", "3"])
    assert pool_config(args).max_lag == 3
    with pytest.raises(ValueError, match="max_lag must be an int >= 0 or None, got -1"):
        pool_config(build_parser().parse_args(["--model-path", "m", "--engines", "e", "--max-lag", "-1"]))
