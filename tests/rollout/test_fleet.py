"""EngineFleet: least-loaded routing, session stickiness, failover when an engine dies, health-based down/up.
Real forge-engine servers over loopback HTTP (in-process threads; a dead engine is a closed port)."""

import asyncio
import socket

import pytest

from forge_megatron.models.tiny import build_tiny_model
from forge_megatron.rollout.launch import start_engine
from forge_megatron.rollout.sglang_client import EngineFleet, FleetConfig, NoEngineAvailable, SharedLoad

PROMPT = [3, 14, 15, 92]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    d = build_tiny_model(str(tmp_path_factory.mktemp("tiny")), sampling_seed=0)
    hs = [start_engine(d, in_process=True) for _ in range(2)]
    yield hs
    for h in hs:
        h.stop()


def dead_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_least_loaded_routing_and_stickiness(engines):
    async def go():
        fleet = EngineFleet([h.url for h in engines])
        results = await asyncio.gather(*(fleet.generate(PROMPT, {"max_new_tokens": 20, "sampling_seed": i}) for i in range(6)))
        spread = {r.engine_url for r in results}
        a = await fleet.generate(PROMPT, {"max_new_tokens": 2}, session_key="s1")
        b = [await fleet.generate(PROMPT, {"max_new_tokens": 2}, session_key="s1") for _ in range(4)]
        served = {e.url: e.served for e in fleet.engines}
        await fleet.close()
        return spread, a, b, served
    spread, a, b, served = asyncio.run(go())
    assert spread == {h.url for h in engines}  # concurrent calls use both engines
    assert all(r.engine_url == a.engine_url for r in b)  # a session stays on its engine
    assert sum(served.values()) == 11


def test_failover_mark_down_and_back_up(engines):
    bad = dead_url()

    async def go():
        fleet = EngineFleet([bad, engines[0].url], FleetConfig(max_attempts=2))
        fleet.sticky["s"] = fleet.engines[0]  # the session's engine is the dead one
        r = await fleet.generate(PROMPT, {"max_new_tokens": 3}, session_key="s")
        down = [e.up for e in fleet.engines]
        live = await fleet.check_health()
        fleet.engines[1].client.url = bad  # now both are dead
        fleet.mark_up(bad)
        with pytest.raises(NoEngineAvailable, match="failed on every engine"):
            await fleet.generate(PROMPT, {"max_new_tokens": 3})
        fleet.engines[1].client.url = engines[0].url
        back = await fleet.check_health()
        await fleet.close()
        return r, down, live, back
    r, down, live, back = asyncio.run(go())
    assert r.engine_url == engines[0].url and down == [False, True]
    assert live == [engines[0].url] and back == [engines[0].url]


def test_group_sessions_open_on_their_groups_engine_within_the_slack(engines):
    """The G sessions of a group follow the first one's engine (one prefill of the shared prompt, cached) while it
    has at most ``group_affinity_slack`` calls in flight over the least-loaded engine; past that a new session
    spills to the least loaded (and its group follows it from then on); a session keeps its engine either way; with
    the slack None every new session goes to the least loaded."""
    async def go(slack):
        fleet = EngineFleet([h.url for h in engines], FleetConfig(group_affinity_slack=slack))
        first = await fleet.generate(PROMPT, {"max_new_tokens": 2}, session_key="a0", group_key="g")
        # concurrent: the group's engine busy with its sessions' calls, the other idle
        mates = await asyncio.gather(*(fleet.generate(PROMPT, {"max_new_tokens": 8}, session_key=f"a{i}",
                                                      group_key="g") for i in range(1, 4)))
        home = next(e for e in fleet.engines if e.url == first.engine_url)
        home.inflight += 3  # three more calls in flight there than on the other (0): past a slack of 2
        spilled = await fleet.generate(PROMPT, {"max_new_tokens": 2}, session_key="a4", group_key="g")
        again = await fleet.generate(PROMPT, {"max_new_tokens": 2}, session_key="a0", group_key="g")
        home.inflight -= 3
        other = await fleet.generate(PROMPT, {"max_new_tokens": 2}, session_key="b0", group_key="h")
        await fleet.close()
        return first, mates, spilled, again, other, dict(fleet.affinity)
    first, mates, spilled, again, other, affinity = asyncio.run(go(2))
    assert {r.engine_url for r in mates} == {first.engine_url}  # concurrent, yet all on the group's engine
    assert spilled.engine_url != first.engine_url and again.engine_url == first.engine_url
    assert other.engine_url == spilled.engine_url  # another group: the least-served engine
    assert affinity == {"followed": 3, "spilled": 1}
    first, mates, *_ , affinity = asyncio.run(go(None))
    assert {r.engine_url for r in mates} == {h.url for h in engines} and affinity == {"followed": 0, "spilled": 0}


def test_processes_sharing_a_load_table_route_by_the_whole_load(engines, tmp_path):
    """Two fleets (two gateway workers) on one SharedLoad file: one's calls in flight steer the other's new sessions
    to the other engine, group affinity weighs them too, a finished call is taken off, and a process that attaches
    to a row (a restarted worker) starts it from zero. Without the table each sees only its own calls."""
    urls = [h.url for h in engines]
    path = SharedLoad.create(str(tmp_path / "load"), rows=2, engines=2)

    async def go():
        a = EngineFleet(urls, shared=SharedLoad(path, 0))
        b = EngineFleet(urls, shared=SharedLoad(path, 1), config=FleetConfig(group_affinity_slack=1))
        alone = EngineFleet(urls)
        a._busy(a.engines[0], 3)  # worker a: three calls on engine 0
        seen = [b.load(e) for e in b.engines], [alone.load(e) for e in alone.engines]
        r = await b.generate(PROMPT, {"max_new_tokens": 2}, session_key="s1", group_key="g")
        first = r.engine_url, alone.pick("x").url
        a._busy(a.engines[0], -3)
        a._busy(a.engines[1], 2)  # now engine 1 (group g's) is 2 busier than engine 0: past b's slack of 1
        r = await b.generate(PROMPT, {"max_new_tokens": 2}, session_key="s2", group_key="g")
        spilled = r.engine_url, dict(b.affinity)
        after_calls = b.shared.table.tolist()
        b._busy(b.engines[0], 5)  # b dies with calls counted ...
        b.shared.close()
        again = SharedLoad(path, 1)  # ... and is started again: its row from zero, a's kept
        out = seen, first, spilled, after_calls, again.table.tolist()
        for f in (a, b, alone):
            await f.close()
        return out
    seen, first, spilled, after_calls, restarted = asyncio.run(go())
    assert seen == ([3, 0], [0, 0])
    assert first == (urls[1], urls[0])  # b avoids a's busy engine; a fleet of its own would not
    assert spilled == (urls[0], {"followed": 0, "spilled": 1})
    assert after_calls == [[0, 2], [0, 0]]  # b's finished calls were taken off its row
    assert restarted == [[0, 2], [0, 0]]
    with pytest.raises(ValueError, match="2 engines, the fleet 1"):
        EngineFleet(urls[:1], shared=SharedLoad(path, 0))


def test_fleet_config_validation():
    with pytest.raises(ValueError, match="group_affinity_slack must be >= 0"):
        FleetConfig(group_affinity_slack=-1)
    with pytest.raises(ValueError, match="max_attempts must be >= 1"):
        FleetConfig(max_attempts=0)
    with pytest.raises(ValueError, match="at least one engine"):
        EngineFleet([])


def test_broadcast_control_calls(engines):
    async def go():
        fleet = EngineFleet([h.url for h in engines])
        paused = await fleet.broadcast("pause_generation", "in_place")
        resumed = await fleet.broadcast("continue_generation")
        info = await fleet.broadcast("get_model_info")
        await fleet.close()
        return paused, resumed, info
    paused, resumed, info = asyncio.run(go())
    assert all(v["success"] for v in paused.values()) and all(v["success"] for v in resumed.values())
    assert all(v["is_generation"] and v["vocab_size"] == 400 for v in info.values())
