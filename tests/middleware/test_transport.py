"""ZeroMQ transport over real loopback sockets: round trip, bad messages, restarts of either side, CURVE."""

import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import threading

import msgpack
import numpy as np
import pytest
import zmq
from pool_cases import (
    fill_group, free_port, make_episode, produce_groups, start_pool_process, stop_process, train_then_hang,
)

from forge_megatron.middleware import pool_server
from forge_megatron.middleware.pool import DataPool, PoolConfig
from forge_megatron.middleware.transport import CurveKeys, PoolClient, PoolError, PoolServer
from forge_megatron.middleware.wire import PROTOCOL_VERSION, WireError, pack, unpack

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def served(tmp_path):
    """A pool served from a thread of this process (1 MiB message limit) and a client."""
    pool = DataPool(PoolConfig(db_path=os.fspath(tmp_path / "pool.sqlite"), window="inf"))
    server = PoolServer(pool, bind="tcp://127.0.0.1:0", max_message_bytes=1 << 20).start()
    client = PoolClient(server.address, timeout_s=5.0)
    yield pool, server, client
    client.close()
    server.stop()
    pool.close()


def test_batch_round_trip_matches_pool(served):
    pool, server, client = served
    gid = client.register_group("t", 3, domain="code", metadata={"answer": "42"})
    client.episode_started(gid, "e0")
    episodes = [make_episode(gid, f"e{i}", reward=float(i), segments=1 + i, seed=i) for i in range(3)]
    assert [client.submit_episode(ep) for ep in episodes] == ["accepted"] * 3
    assert client.submit_episode(episodes[0]) == "duplicate"
    batch = client.get_batch(1, timeout_s=5.0)
    local = pool.load_batch(batch.batch_id)
    assert batch.group_indices == local.group_indices == [int(gid[1:])]
    assert len(batch.samples) == len(local.samples) == 6
    for got, want in zip(batch.samples, local.samples):
        for name in ("tokens", "loss_mask", "rollout_logprobs", "policy_versions", "advantages"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
            assert getattr(got, name).dtype == getattr(want, name).dtype
        assert (got.episode_id, got.domain, got.group_index) == (want.episode_id, "code", want.group_index)
        assert got.reward == pytest.approx(want.reward) and got.sample_weight == pytest.approx(want.sample_weight)
        assert want.segment_return is not None and got.segment_return == pytest.approx(want.segment_return)
    assert not batch.samples[0].tokens.flags.owndata  # a view of the received frame, not a copy
    assert client.commit(batch.batch_id) == 1
    assert client.can_admit() is True
    client.set_policy_version(3)
    metrics = client.metrics()
    assert metrics["groups"]["committed"] == 1 and metrics["policy_version"] == 3


def test_waiting_get_batch_does_not_block_other_requests(served):
    pool, server, client = served
    gid = client.register_group("t", 2)
    feeder = PoolClient(server.address, timeout_s=5.0)
    pool_thread_result = []
    waiter = threading.Thread(target=lambda: pool_thread_result.append(client.get_batch(1, timeout_s=20.0)))
    waiter.start()
    fill_group(feeder, gid, 2)  # served while the get_batch above is parked
    waiter.join(timeout=30)
    feeder.close()
    assert pool_thread_result[0].group_indices == [int(gid[1:])]
    assert pool_thread_result[0].metrics["wait_s"] > 0.0 and client.metrics()["trainer_wait_total_s"] > 0.0
    assert client.get_batch(1, timeout_s=0.2) is None


def _raw_request(address: str, frames: list) -> dict:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        assert sock.poll(10_000), "no reply from the pool"
        header, _ = unpack(sock.recv_multipart(), 1 << 30)
        return header
    finally:
        sock.close()


def _header(**kw) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "rid": "r", "arrays": [], **kw})


@pytest.mark.parametrize(
    ("frames", "message"),
    [([b"\xc1\xff garbage"], "header frame is not valid msgpack"),
     ([msgpack.packb([1, 2, 3])], "header must be a map, got list"),
     ([msgpack.packb({"v": 99, "rid": "r", "op": "ping"})], "protocol version 99 is not supported (expected 1)"),
     ([_header(op="ping"), b"x" * (2 << 20)], "exceeds the limit of 1048576 bytes"),
     ([_header(op="ping", arrays=[["int32", [4]]]), b"123"], "array 0: frame has 3 bytes, int32[4] needs 16"),
     ([_header(op="ping", arrays=[["object", [1]]]), b"1234"], "array 0: spec must be [dtype in"),
     ([_header(op="ping", arrays=[["uint8", [1 << 40, 1 << 40]]]), b""], "needs 1208925819614629174706176"),
     ([_header(op="ping", arrays=[["int32", [1]]])], "header declares 1 arrays, message has 0 array frames"),
     ([_header(op="format_disk")], "unknown op 'format_disk'"),
     ([_header(op="get_batch", num_groups="two", timeout_s=0)], "request field 'num_groups' must be int, got str"),
     ([_header(op="set_policy_version", version=True)], "request field 'version' must be int, got bool"),
     ([_header(op="submit_episode", episode={"episode_id": "e"})], "episode is missing field 'segment_lengths'"),
     ([_header(op="episode_started", group_id="g000000077", episode_id="e")], "unknown group_id 'g000000077'"),
     ([_header(op="commit", batch_ids=[12345])], "unknown batch_id 12345"),
     ([msgpack.packb({"v": PROTOCOL_VERSION, "op": "ping", "arrays": []})], "'rid' must be a non-empty string")],
)
def test_bad_messages_get_clear_errors_and_pool_keeps_serving(served, frames, message):
    pool, server, client = served
    reply = _raw_request(server.address, frames)
    assert reply["ok"] is False and message in reply["error"]
    assert client.ping() == {"pool": "forge"}


def test_invalid_episode_is_rejected_by_schema(served):
    pool, server, client = served
    gid = client.register_group("t", 1)
    bad = make_episode(gid, "e")
    bad.segments[0].loss_mask[0] = 7
    with pytest.raises(PoolError, match=r"segments\[0\].loss_mask must be 0/1"):
        client.submit_episode(bad)
    assert client.group_status(gid)["finished"] == 0


def test_call_rewards_travel_and_bad_ones_are_refused(served):
    """Rewards of single calls over the real sockets and database (the ZeroMQ path white-box agents submit on): the
    batch's sample carries them and the per-call advantages; positions that are not trained tokens (the first token,
    a prompt token, out of range, decreasing) or non-finite rewards are refused naming the field."""
    pool, server, client = served
    gid = client.register_group("t", 2)
    good, other = make_episode(gid, "e0", seed=1), make_episode(gid, "e1", seed=2)
    seg = good.segments[0]
    trained = [i for i, m in enumerate(seg.loss_mask) if m and i > 0]
    seg.call_rewards = [[trained[0], 0.5]]
    for bad, message in (([[0, 1.0]], "positions must increase and lie in [1, "),
                         ([[len(seg.tokens), 1.0]], "positions must increase"),
                         ([[trained[1], 1.0], [trained[0], 1.0]], "positions must increase"),
                         ([[trained[0], float("nan")]], "must be [position, finite reward] pairs")):
        broken = make_episode(gid, "e9", seed=1)
        broken.segments[0].call_rewards = bad
        with pytest.raises(PoolError, match=re.escape(message)):
            client.submit_episode(broken)
    untrained = make_episode(gid, "e8", seed=1)
    untrained.segments[0].call_rewards = [[untrained.segments[0].loss_mask.index(0, 1), 1.0]]
    with pytest.raises(PoolError, match="positions must be sampled tokens"):
        client.submit_episode(untrained)
    assert client.submit_episode(good) == "accepted" and client.submit_episode(other) == "accepted"
    batch = client.get_batch(1, timeout_s=5.0)
    (smp,) = [s for s in batch.samples if s.episode_id == "e0"]
    assert smp.call_rewards == [[trained[0], 0.5]]
    a = smp.advantages[smp.loss_mask == 1]
    assert len(set(a.tolist())) == 2  # the call's tokens take the return from the call on, the rest the end's


def test_routed_experts_travel_from_episode_to_batch(served):
    """Routed experts (rollout routing replay) over the real sockets and database: an episode with routing on one of
    its two segments, another with none; the batch carries every sample's rows, -1 where none were recorded. A
    routing frame that does not match its header is refused by name and the pool keeps serving."""
    from forge_megatron.middleware.wire import episode_to_wire

    pool, server, client = served
    gid = client.register_group("t", 2)
    with_routing, without = make_episode(gid, "e0", segments=2, seed=1), make_episode(gid, "e1", seed=2)
    rng = np.random.default_rng(0)
    seg = with_routing.segments[1]
    seg.routed_experts = rng.integers(-1, 16, size=(len(seg.tokens), 3, 2)).astype(np.int8)  # <= 128 experts: int8
    assert client.submit_episode(with_routing) == "accepted" and client.submit_episode(without) == "accepted"
    batch = client.get_batch(1, timeout_s=5.0)
    by_tokens = {tuple(smp.tokens.tolist()): smp.routed_experts for smp in batch.samples}
    np.testing.assert_array_equal(by_tokens[tuple(seg.tokens)], seg.routed_experts)
    assert by_tokens[tuple(seg.tokens)].dtype == np.int8  # one byte per id all the way to the trainer
    for other in (with_routing.segments[0], without.segments[0]):
        got = by_tokens[tuple(other.tokens)]
        assert got.shape == (len(other.tokens), 3, 2) and (got == -1).all()

    meta, arrays = episode_to_wire(make_episode(gid, "e9", seed=3))
    meta["routing_shape"] = [3, 2]
    for frame, dtype, message in ((np.zeros(5, np.int16), "int16", "routed experts must be int16[72]"),
                                  (np.zeros(72, np.int16), "int8", "routed experts must be int8[72]"),
                                  (np.zeros(72, np.int16), "int32", "'routing_dtype' must be 'int8' or 'int16'")):
        bad = arrays + [frame]
        header = _header(op="submit_episode", episode={**meta, "routing_dtype": dtype},
                         arrays=[[a.dtype.name, list(a.shape)] for a in bad])
        reply = _raw_request(server.address, [header] + [a.tobytes() for a in bad])
        assert reply["ok"] is False and message in reply["error"], reply
    assert client.ping() == {"pool": "forge"}


def test_wire_checks_a_samples_return():
    """A batch sample's optional ``return`` (a critic's value target) must be a finite number; without it the sample
    has none (the trainer then uses the episode's reward)."""
    from forge_megatron.middleware.batch import TrainBatch, TrainSample
    from forge_megatron.middleware.wire import batch_from_wire, batch_to_wire

    arrays = dict(tokens=np.arange(4, dtype=np.int32), loss_mask=np.array([0, 0, 1, 1], np.uint8),
                  rollout_logprobs=np.zeros(4, np.float32), policy_versions=np.zeros(4, np.int32),
                  advantages=np.zeros(4, np.float32))
    batch = TrainBatch(1, [TrainSample(**arrays, sample_weight=1.0, group_index=0, episode_id="e", domain="d",
                                       reward=1.0, segment_return=0.25),
                           TrainSample(**arrays, sample_weight=1.0, group_index=0, episode_id="f", domain="d",
                                       reward=2.0)], [0])
    meta, frames = batch_to_wire(batch)
    back = batch_from_wire(meta, frames)
    assert [s.segment_return for s in back.samples] == [0.25, None]
    for bad in ("x", float("nan"), True):
        meta["samples"][0]["return"] = bad
        with pytest.raises(WireError, match="return must be a finite number"):
            batch_from_wire(meta, frames)


def test_wire_rejects_unknown_dtype_on_send():
    with pytest.raises(WireError, match="array dtype complex64 is not allowed"):
        pack({"op": "x"}, [np.zeros(2, np.complex64)])


@pytest.mark.timeout(300)  # three forge-pool starts; slow only on a loaded machine
def test_pool_kill9_restart_loses_and_duplicates_nothing(tmp_path):
    """forge-pool in its own process is killed with SIGKILL mid-run and restarted on the same db and port while a
    producer process keeps submitting and this process keeps training."""
    db, addr = os.fspath(tmp_path / "pool.sqlite"), f"tcp://127.0.0.1:{free_port()}"
    num_groups = 24
    pool_proc = start_pool_process(db, addr, "--window", "4")
    producer = mp.get_context("spawn").Process(target=produce_groups, args=(addr, num_groups, 2, 0.05))
    producer.start()
    trainer = PoolClient(addr, timeout_s=1.0, retries=60)
    seen: list[int] = []
    try:
        while len(seen) < num_groups:
            batch = trainer.get_batch(2, timeout_s=2.0)
            if batch is None:
                continue
            seen += batch.group_indices
            trainer.commit(batch.batch_id)
            if len(seen) in (8, 16):
                stop_process(pool_proc, signal.SIGKILL)
                pool_proc = start_pool_process(db, addr, "--window", "4")
        producer.join(timeout=60)
        assert producer.exitcode == 0
        metrics = trainer.metrics()
    finally:
        trainer.close()
        stop_process(pool_proc)
        if producer.is_alive():
            producer.kill()
    assert sorted(seen) == list(range(1, num_groups + 1))  # every group exactly once
    assert metrics["groups"] == {"running": 0, "finished": 0, "failed": 0, "delivered": 0, "committed": num_groups}


def test_trainer_crash_resume_gets_exactly_uncommitted(served):
    pool, server, client = served
    for i in range(10):
        fill_group(pool, pool.register_group(f"t{i}", 2), 2)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    crashed = ctx.Process(target=train_then_hang, args=(server.address, 4, 2, 2, queue))
    crashed.start()
    delivered = [queue.get(timeout=60) for _ in range(4)]
    assert queue.get(timeout=60) == "done"
    os.kill(crashed.pid, signal.SIGKILL)
    crashed.join(timeout=30)
    # The new trainer resumes from the checkpoint taken after batch 2: batches 3 and 4 must come back, nothing else.
    assert client.requeue_uncommitted() == delivered[2] + delivered[3]
    resumed = client.get_batch(4, timeout_s=5.0)
    assert resumed.group_indices == delivered[2] + delivered[3]
    rest = client.get_batch(2, timeout_s=5.0)
    assert set(rest.group_indices).isdisjoint(sum(delivered, []))
    assert client.get_batch(1, timeout_s=0.1) is None


def test_curve_authenticates_clients(tmp_path):
    server_pub, server_sec = zmq.curve_keypair()
    client_pub, client_sec = zmq.curve_keypair()
    stranger_pub, stranger_sec = zmq.curve_keypair()
    pool = DataPool(PoolConfig(db_path=os.fspath(tmp_path / "pool.sqlite")))
    server = PoolServer(pool, bind="tcp://127.0.0.1:0",
                        curve_keys=CurveKeys(server_pub, server_sec, allowed_clients=(client_pub,))).start()
    good = PoolClient(server.address, timeout_s=5.0, curve_keys=CurveKeys(client_pub, client_sec, server_pub))
    bad = PoolClient(server.address, timeout_s=0.5, retries=0,
                     curve_keys=CurveKeys(stranger_pub, stranger_sec, server_pub))
    try:
        assert good.ping() == {"pool": "forge"}
        with pytest.raises(TimeoutError, match="did not answer 'ping' after 1 attempts"):
            bad.ping()
    finally:
        good.close()
        bad.close()
        server.stop()
        pool.close()
    with pytest.raises(ValueError, match="client CurveKeys need server_public"):
        PoolClient("tcp://127.0.0.1:1", curve_keys=CurveKeys(client_pub, client_sec))


def test_forge_pool_help_teaches():
    out = subprocess.run([sys.executable, "-m", "forge_megatron.middleware.pool_server", "--help"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert "strict FIFO" in out and "--generation-batch-groups" in out and "--max-staleness" in out
    bad = subprocess.run([sys.executable, "-m", "forge_megatron.middleware.pool_server", "--window", "2.5"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "window must be an int >= 1 or 'inf', got '2.5'" in bad.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--estimator", "median"], "estimator must be one of"),
     (["--process-weight", "malformed_tool_calls"], "must look like NAME=NUMBER, got 'malformed_tool_calls'"),
     (["--process-weight", "=1"], "must look like NAME=NUMBER, got '=1'"),
     (["--reward-fn", "no_such_module:f"], "cannot import module 'no_such_module'")],
)
def test_forge_pool_reward_flags_are_checked(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exc:
        pool_server.main(["--db", os.fspath(tmp_path / "pool.sqlite"), *flags])
    assert message in str(exc.value) + capsys.readouterr().err


def test_forge_pool_reward_flags_reach_the_pool():
    args = pool_server.build_parser().parse_args(["--process-weight", "malformed_tool_calls=-0.7",
                                                  "--completion-time-bound", "0.25", "--estimator", "rloo"])
    cfg = pool_server._reward_config(args)
    assert cfg.process_weights["malformed_tool_calls"] == -0.7 and cfg.process_weights["language_mixing"] == -0.5
    assert (cfg.completion_time_bound, cfg.estimator) == (0.25, "rloo")


def test_resent_get_batch_returns_the_same_batch(served):
    """A reply lost on the way: the same rid sent again yields the batch already delivered, not a second one."""
    pool, server, client = served
    for i in range(2):
        fill_group(pool, pool.register_group(f"t{i}", 2), 2)
    request = [msgpack.packb({"v": PROTOCOL_VERSION, "rid": "lost-1", "op": "get_batch", "num_groups": 1,
                              "timeout_s": 1.0, "arrays": []})]
    first, second = _raw_request(server.address, request), _raw_request(server.address, request)
    assert first["ok"] and second["result"]["batch_id"] == first["result"]["batch_id"]
    assert second["result"]["group_indices"] == first["result"]["group_indices"]
    assert pool.metrics()["groups"]["delivered"] == 1


def test_client_survives_server_starting_late(tmp_path):
    """The client's request is resent on a fresh socket until a pool appears on the address."""
    addr = f"tcp://127.0.0.1:{free_port()}"
    pool = DataPool(PoolConfig(db_path=os.fspath(tmp_path / "pool.sqlite")))
    server = PoolServer(pool, bind=addr)
    threading.Timer(1.0, server.start).start()
    client = PoolClient(addr, timeout_s=0.3, retries=100)
    try:
        assert client.ping() == {"pool": "forge"}
    finally:
        client.close()
        server.stop()
        pool.close()


def test_forge_pool_process_with_curve_key_files(tmp_path):
    server_pub, server_sec = zmq.curve_keypair()
    client_pub, client_sec = zmq.curve_keypair()
    (tmp_path / "server.keys").write_bytes(server_pub + b"\n" + server_sec + b"\n")
    (tmp_path / "clients.keys").write_bytes(client_pub + b"\n")
    addr = f"tcp://127.0.0.1:{free_port()}"
    proc = start_pool_process(os.fspath(tmp_path / "pool.sqlite"), addr, "--curve-secret-file",
                              os.fspath(tmp_path / "server.keys"), "--curve-clients-file",
                              os.fspath(tmp_path / "clients.keys"))
    client = PoolClient(addr, timeout_s=5.0, curve_keys=CurveKeys(client_pub, client_sec, server_pub))
    try:
        assert client.ping() == {"pool": "forge"}
    finally:
        client.close()
        stop_process(proc)
    assert proc.returncode == 0  # SIGTERM: clean shutdown


def test_server_errors_are_clear(served):
    pool, server, client = served
    with pytest.raises(RuntimeError, match=f"pool server cannot bind {server.address}: Address already in use"):
        PoolServer(pool, bind=server.address).start().stop()
    with pytest.raises(ValueError, match="server CurveKeys need allowed_clients"):
        PoolServer(pool, curve_keys=CurveKeys(*zmq.curve_keypair()))
    with pytest.raises(ValueError, match="max_message_bytes must be >= 1024, got 10"):
        PoolServer(pool, max_message_bytes=10)


def test_a_dropped_client_is_collected_without_blocking():
    """A PoolClient dropped with its socket open, inside a reference cycle (a gateway's thread-local clients are),
    is collected without blocking the thread the collector runs on: with a context of its own, the context's
    termination waited forever for the socket whose weak reference the collector had cleared (a forge-engine
    thread hung so, inside a forward, in a test run)."""
    import gc
    import threading

    import zmq

    from forge_megatron.middleware.transport import PoolClient

    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    try:
        client = PoolClient(f"tcp://127.0.0.1:{port}", timeout_s=0.2, retries=0)
        client._socket().send_multipart([b"pending"])  # a socket open, a message on its way
        client.cycle = client
        del client
        collector = threading.Thread(target=gc.collect, daemon=True)
        collector.start()
        collector.join(20)
        assert not collector.is_alive(), "the garbage collector is stuck in a dropped client's context"
    finally:
        server.close(linger=0)
        ctx.term()
