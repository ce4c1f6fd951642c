"""A gateway in several processes (gateway_front.py): forge-gateway --workers 2 and forge-node --gateway-workers 2 as
real processes in front of a real engine. Groups and sessions spread over the workers; calls go to a worker directly
(its base_url) or through the front (path key, bearer key, streams, Anthropic's route); pause / resume reach every
worker; /metrics labels each worker's series; episodes reach the JSONL file or the data pool from both; a worker
killed with SIGKILL is started again (its sessions answer 410, its groups open sessions in the new worker, which
comes back at the policy version of the others). CPU."""

import json
import os
import signal
import threading
import time

import urllib.error
import urllib.request

import pytest

from forge_megatron.middleware.gateway_front import merge_prometheus, worker_tag_of
from forge_megatron.models.tiny import build_tiny_model
from forge_megatron.rollout.launch import ProcessServer, start_engine

TOKEN = "front-admin-token"
ADMIN = {"X-Forge-Admin-Token": TOKEN}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A tiny model's engine serving LoRA, with two (zero) policy adapters loaded: forge-t-v3 and forge-t-v4."""
    from tests.rollout.peft_adapters import write_peft_adapter

    root = tmp_path_factory.mktemp("tiny")
    model_dir = build_tiny_model(str(root / "model"), seed=0)
    eng = start_engine(model_dir, in_process=True, extra_args=["--enable-lora"])
    for version in (3, 4):
        path = write_peft_adapter(model_dir, str(root / f"v{version}"), b_std=0.0)
        assert _http("POST", eng.url + "/load_lora_adapter",
                     {"lora_name": f"forge-t-v{version}", "lora_path": path}).status_code == 200
    yield model_dir, eng
    eng.stop()


class _Reply:
    def __init__(self, status: int, text: str):
        self.status_code, self.text = status, text

    def json(self):
        return json.loads(self.text)


def _http(method, url, body=None, headers=None, timeout=60) -> _Reply:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return _Reply(r.status, r.read().decode())
    except urllib.error.HTTPError as exc:
        return _Reply(exc.code, exc.read().decode())


def _post(url, body=None, headers=ADMIN, ok=True):
    r = _http("POST", url, body or {}, headers)
    if ok:
        assert r.status_code == 200, r.text
    return r


def _chat(base_url, key, content="hi", stream=False):
    """One chat call of 4 tokens (ignore_eos: a random tiny model may end at once); its completion token count."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "ignore_eos": True, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    r = _http("POST", base_url + "/chat/completions", body, {"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["usage"]["completion_tokens"]
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    assert len(chunks) > 2  # streamed piece by piece through the front
    return chunks[-1]["usage"]["completion_tokens"]


def _state(url):
    r = _http("GET", url + "/forge/admin/state", headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()


def test_sessions_spread_over_workers_and_survive_a_worker_crash(engine, tmp_path):
    model_dir, eng = engine
    episodes = tmp_path / "episodes.jsonl"
    front = ProcessServer("forge_megatron.middleware.gateway",
                          ["--model-path", model_dir, "--engines", eng.url, "--workers", "2", "--admin-token", TOKEN,
                           "--episodes-jsonl", str(episodes)])
    try:
        url = front.url
        groups = [_post(url + "/forge/groups", {"task_id": f"t{i}", "size": 2}).json()["group_id"] for i in range(2)]
        sessions = [_post(url + "/forge/sessions", {"group_id": g}).json() for g in groups for _ in range(2)]
        tags = [worker_tag_of(s["session_id"]) for s in sessions]
        assert tags[0] == tags[1] and tags[2] == tags[3] and {tags[0], tags[2]} == {"w0r0", "w1r0"}  # a group, a worker
        assert all(worker_tag_of(s["api_key"]) == t for s, t in zip(sessions, tags))
        ports = {s["base_url"].split("/s/")[0] for s in sessions}
        assert len(ports) == 2 and url not in ports  # agents call the workers directly

        # direct, through the front by path key, by bearer key, streamed; Anthropic's route through the front
        assert _chat(sessions[0]["base_url"], sessions[0]["api_key"]) == 4
        assert _chat(f"{url}/s/{sessions[1]['api_key']}/v1", "unused") == 4
        assert _chat(url + "/v1", sessions[2]["api_key"]) == 4
        assert _chat(url + "/v1", sessions[3]["api_key"], stream=True) == 4
        r = _http("POST", f"{url}/s/{sessions[3]['api_key']}/v1/messages",
                  {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hey"}]})
        assert r.status_code == 200 and r.json()["type"] == "message", r.text
        for s, n in zip(sessions, (1, 1, 1, 2)):  # recorded in the worker holding the session, read through the front
            got = _http("GET", f"{url}/forge/sessions/{s['session_id']}", headers=ADMIN).json()
            assert got["session_id"] == s["session_id"] and len(got["calls"]) == n, got

        # bad keys and ids: the worker's 401, the front's 404; a malformed session body: the worker's 400
        r = _http("POST", url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
                  {"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert _http("GET", url + "/forge/sessions/zzz", headers=ADMIN).status_code == 404
        r = _post(url + "/forge/sessions", {"group_id": 5}, ok=False)
        assert r.status_code == 404 and r.json()["error"]["code"] == "group_not_found"
        assert _post(url + "/forge/admin/pause", {}, headers={}, ok=False).status_code == 401

        # pause and resume reach both workers; the front sums and labels
        assert _post(url + "/forge/admin/pause", {"drain_timeout_s": 1}).json() == {"paused": True, "inflight": 0}
        workers = _state(url)["workers"]
        assert [w["tag"] for w in workers] == ["w0r0", "w1r0"] and all(_state(w["url"])["paused"] for w in workers)
        resumed = _post(url + "/forge/admin/resume", {"policy_version": 3, "lora_name": "forge-t-v3"}).json()
        assert resumed == {"paused": False, "policy_version": 3, "policy_adapter": "forge-t-v3"}
        state = _state(url)
        assert not state["paused"] and state["policy_version"] == 3 and state["calls"] == 5
        assert [(_state(w["url"])["policy_version"], _state(w["url"])["policy_adapter"]) for w in workers] == \
            [(3, "forge-t-v3")] * 2  # (the engine's adapter: calls from now on name it)
        metrics = _http("GET", url + "/metrics", headers=ADMIN).text
        assert metrics.count("# HELP forge_gateway_calls_total ") == 1
        calls = {line.split("{")[1].split("}")[0]: float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("forge_gateway_calls_total{")}
        assert sorted(calls) == ['worker="0"', 'worker="1"'] and sum(calls.values()) == 5
        assert "forge_gateway_workers 2" in metrics

        # each worker routes by the whole gateway's calls in flight per engine (the front's shared table): a call one
        # worker holds in the engine (paused in place) is in the other's load, not in its own inflight
        peer = next(w["url"] for w in workers if w["tag"] != tags[0])
        assert _http("POST", eng.url + "/pause_generation", {"mode": "in_place"}).status_code == 200
        held_call = threading.Thread(target=_chat, args=(sessions[0]["base_url"], sessions[0]["api_key"]))
        held_call.start()
        try:
            deadline = time.time() + 30
            while _state(peer)["engines"][0]["load"] != 1 and time.time() < deadline:
                time.sleep(0.05)
            seen = _state(peer)["engines"][0]
        finally:
            assert _http("POST", eng.url + "/continue_generation", {}).status_code == 200
            held_call.join(60)
        assert (seen["load"], seen["inflight"]) == (1, 0)
        assert _state(peer)["engines"][0]["load"] == 0
        load_file = _state(url)["engine_load_file"]
        assert os.path.isfile(load_file)

        # episodes from both workers reach the one file, whole lines
        for s in sessions[:2] + sessions[2:3]:
            assert _post(f"{url}/forge/sessions/{s['session_id']}/end", {"status": "finished"}).json()["sink"]
        lines = episodes.read_text().splitlines()
        assert sorted(json.loads(x)["episode_id"] for x in lines) == sorted(s["session_id"] for s in sessions[:3])

        # SIGKILL the worker holding the last open session during a pause: started again under a new tag, paused, at
        # policy version 3 with its adapter, as the other worker is
        held = workers[int(tags[3][1])]
        _post(url + "/forge/admin/pause", {"drain_timeout_s": 0})
        os.kill(held["pid"], signal.SIGKILL)
        deadline = time.time() + 90
        while time.time() < deadline:
            w = _state(url)["workers"][held["index"]]
            if w["serving"] and w["tag"].endswith("r1"):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"worker {held['tag']} was not started again: {_state(url)['workers']}")
        restarted = _state(w["url"])
        assert restarted["policy_version"] == 3 and restarted["paused"] and _state(url)["worker_restarts"] == 1
        assert restarted["policy_adapter"] == "forge-t-v3"
        assert _post(url + "/forge/admin/resume", {"policy_version": 4, "lora_name": "forge-t-v4"}).json()[
            "policy_version"] == 4
        assert [(s["paused"], s["policy_version"], s["policy_adapter"])
                for s in (_state(x["url"]) for x in _state(url)["workers"])] == [(False, 4, "forge-t-v4")] * 2
        r = _http("POST", url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
                  {"Authorization": f"Bearer {sessions[3]['api_key']}"})
        assert r.status_code == 410 and r.json()["error"]["code"] == "session_lost"
        again = _post(url + "/forge/sessions", {"group_id": groups[1]}).json()  # the new worker adopts the group
        assert worker_tag_of(again["session_id"]) == w["tag"]
        assert _chat(again["base_url"], again["api_key"])
        other = _post(url + "/forge/sessions", {"group_id": groups[0]}).json()  # the other worker is untouched
        assert worker_tag_of(other["session_id"]) == tags[0] and _chat(other["base_url"], other["api_key"])
        os.kill(front.proc.pid, signal.SIGKILL)  # the front alone, as an OOM kill would: its workers follow it
        front.proc.wait(10)
    finally:
        front.stop()
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(w["pid"]) for w in workers + [w]):
        time.sleep(0.1)
    assert not any(_alive(w["pid"]) for w in workers + [w])
    deadline = time.time() + 5  # the workers removed their table when the front was killed
    while time.time() < deadline and os.path.exists(load_file):
        time.sleep(0.1)
    assert not os.path.exists(load_file)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_forge_node_workers_send_episodes_to_its_pool(engine, tmp_path):
    from forge_megatron.middleware.transport import PoolClient
    from forge_megatron.utils.ports import free_port

    model_dir, eng = engine
    pool_addr = f"tcp://127.0.0.1:{free_port()}"
    node = ProcessServer("forge_megatron.agents.middleware_node",
                         ["--model-path", model_dir, "--engines", eng.url, "--gateway-workers", "2",
                          "--pool-bind", pool_addr, "--pool-db", str(tmp_path / "pool.sqlite"),
                          "--rollout-batch-groups", "2"])
    client = PoolClient(pool_addr)
    try:
        url = node.url
        gids = [_post(url + "/forge/groups", {"task_id": f"t{i}", "size": 2}, headers={}).json()["group_id"]
                for i in range(2)]
        ended = []
        for gid in gids:
            for reward in (0.0, 1.0):
                s = _post(url + "/forge/sessions", {"group_id": gid}, headers={}).json()
                assert _chat(s["base_url"], s["api_key"])
                _post(f"{url}/forge/sessions/{s['session_id']}/reward", {"reward": reward}, headers={})
                assert _post(f"{url}/forge/sessions/{s['session_id']}/end", {"status": "finished"},
                             headers={}).json()["sink"] == "accepted"
                ended.append(s["session_id"])
        assert sorted({worker_tag_of(e) for e in ended}) == ["w0r0", "w1r0"]
        assert all(client.group_status(g)["state"] == "finished" for g in gids)
        batch = client.get_batch(2, timeout_s=10)  # scored by the pool: one episode of each group rewarded
        assert batch is not None and sorted(x.episode_id for x in batch.samples) == sorted(ended)
        assert sorted(set(x.group_index for x in batch.samples)) == sorted(batch.group_indices) and \
            all(abs(x.advantages).max() > 0 for x in batch.samples)
        metrics = _http("GET", url + "/metrics").text
        assert metrics.count("# HELP forge_pool_groups ") == 1 and 'forge_pool_groups{state="delivered"} 2' in metrics
        assert 'forge_gateway_calls_total{worker="0"} 2' in metrics and 'forge_gateway_calls_total{worker="1"} 2' in metrics
        # SIGTERM to the node alone (scancel's signal): it stops its workers, removes their table, closes its pool
        load_file = _state(url)["engine_load_file"]
        workers = [w["pid"] for w in _state(url)["workers"]]
        os.kill(node.proc.pid, signal.SIGTERM)
        assert node.proc.wait(60) == 0
        assert not os.path.exists(load_file) and not any(_alive(p) for p in workers)
        assert not os.path.exists(tmp_path / "pool.sqlite-wal")  # the last connection closed: the WAL folded in
    finally:
        client.close()
        node.stop()


def test_forge_node_and_forge_engine_stop_cleanly_on_sigterm(engine, tmp_path):
    """scancel's signal to forge-node in one process (its pool closed: the WAL folded in) and to forge-engine: both
    stop serving and exit 0."""
    model_dir, _ = engine
    eng = start_engine(model_dir)
    node = ProcessServer("forge_megatron.agents.middleware_node",
                         ["--model-path", model_dir, "--engines", eng.url, "--pool-bind", "tcp://127.0.0.1:0",
                          "--pool-db", str(tmp_path / "pool.sqlite")])
    try:
        _post(node.url + "/forge/groups", {"task_id": "t", "size": 1}, headers={})
        for server in (node, eng):
            os.kill(server.proc.pid, signal.SIGTERM)
            assert server.proc.wait(60) == 0
        assert not os.path.exists(tmp_path / "pool.sqlite-wal")
    finally:
        node.stop()
        eng.stop()


def test_merge_prometheus_labels_each_worker_and_keeps_one_help_line():
    text = ("# HELP forge_x x\n# TYPE forge_x counter\nforge_x 1\n"
            '# HELP forge_e e\n# TYPE forge_e gauge\nforge_e{engine="a"} 2\n')
    merged = merge_prometheus([("0", text), ("1", text.replace(" 1\n", " 5\n"))])
    assert merged == ["# HELP forge_x x", "# TYPE forge_x counter", 'forge_x{worker="0"} 1', 'forge_x{worker="1"} 5',
                      "# HELP forge_e e", "# TYPE forge_e gauge", 'forge_e{worker="0",engine="a"} 2',
                      'forge_e{worker="1",engine="a"} 2']
    assert worker_tag_of("forge-w3r12-abc-def") == "w3r12" and worker_tag_of("w0r0-0123abcd") == "w0r0"
    assert worker_tag_of("forge-Abc-xyz") is None and worker_tag_of("0123abcd") is None and worker_tag_of(None) is None


def test_a_worker_that_cannot_start_stops_the_gateway_with_its_reason(engine):
    """--return-routed-experts on a dense model: each worker refuses; the front exits naming why, not hanging."""
    import subprocess
    import sys

    model_dir, eng = engine
    out = subprocess.run([sys.executable, "-m", "forge_megatron.middleware.gateway", "--model-path", model_dir,
                          "--engines", eng.url, "--port", "0", "--workers", "2", "--return-routed-experts"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "FORGE_READY" not in out.stdout
    assert "exited with 1 before it served" in out.stderr and "not a MoE model" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "forge_megatron.middleware.gateway", "--model-path", model_dir,
                          "--engines", eng.url, "--workers", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--workers must be >= 1" in out.stderr


def test_a_pool_that_does_not_answer_loses_no_episode(engine, tmp_path):
    """A gateway worker's sink is the pool over ZeroMQ (PoolSink). While the pool process is down, ending a session
    answers 503 sink_unavailable and the session stays open (its calls, its episode); once the pool is back (same
    database) the end goes through and the group completes; a new group while it is down is a 503 too."""
    import asyncio

    from forge_megatron.middleware.gateway import Gateway, GatewayConfig, serve
    from forge_megatron.middleware.gateway_front import PoolSink
    from forge_megatron.middleware.transport import PoolClient
    from forge_megatron.rollout.launch import ThreadServer
    from forge_megatron.utils.ports import free_port
    from tests.middleware.pool_cases import start_pool_process, stop_process

    model_dir, eng = engine
    db, bind = str(tmp_path / "pool.sqlite"), f"tcp://127.0.0.1:{free_port()}"
    pool = start_pool_process(db, bind)
    gw = Gateway(GatewayConfig(model_path=model_dir, engine_urls=[eng.url], port=0, worker_tag="w0r0"),
                 sink=PoolSink(bind, timeout_s=0.3, retries=1))
    server = ThreadServer(lambda ready: serve(gw, ready))
    try:
        group = _post(server.url + "/forge/groups", {"task_id": "t", "size": 1}, headers={}).json()["group_id"]
        s = _post(server.url + "/forge/sessions", {"group_id": group}, headers={}).json()
        assert _chat(s["base_url"], s["api_key"])
        stop_process(pool, signal.SIGKILL)
        r = _post(f"{server.url}/forge/sessions/{s['session_id']}/end", {"status": "finished"}, headers={}, ok=False)
        assert r.status_code == 503 and r.json()["error"]["code"] == "sink_unavailable", r.text
        r = _post(server.url + "/forge/groups", {"task_id": "t2", "size": 1}, headers={}, ok=False)
        assert r.status_code == 503 and r.json()["error"]["code"] == "sink_unavailable"
        assert _chat(s["base_url"], s["api_key"], "still there?")  # the session is still open
        pool = start_pool_process(db, bind)
        ended = _post(f"{server.url}/forge/sessions/{s['session_id']}/end", {"status": "finished"}, headers={})
        assert ended.json()["sink"] == "accepted" and ended.json()["num_calls"] == 2
        client = PoolClient(bind)
        try:
            assert client.group_status(group)["state"] == "finished"
        finally:
            client.close()
        # the idle reaper meets the same: a session it cannot end stays open (ended on a later round)
        group = _post(server.url + "/forge/groups", {"task_id": "t3", "size": 1}, headers={}).json()["group_id"]
        idle = gw.sessions[_post(server.url + "/forge/sessions", {"group_id": group}, headers={}).json()["session_id"]]
        stop_process(pool, signal.SIGKILL)
        gw.config.session_idle_timeout_s = 0.01
        assert asyncio.run_coroutine_threadsafe(gw.reap_idle_sessions(time.time() + 1), server.loop).result(30) == 0
        assert not idle.ended
    finally:
        server.stop()
        stop_process(pool, signal.SIGKILL)
