"""A gateway in several processes: ``forge-gateway --workers N`` (``forge-node --gateway-workers N``).

One gateway process prepares some 50 long-context calls a second (docs/benchmarks.md: rendering the chat template
over a 200-turn conversation is ~20 ms of Python per call, under the GIL), so a few hundred agents deep into long
conversations keep one process busy. With ``--workers N`` the process on the public port is a *front*: it starts N
gateway processes (*workers*, each a whole gateway on a loopback port picked at start, or on the front's host) and
shares the sessions out among them. Every session lives in one worker, so what a gateway keeps per session (the
conversation, its segments, stored responses) needs no sharing.

Routing
  POST /forge/groups        to the workers in turn; the front remembers each group's worker, and all G sessions of
                            a group open in it (their prompts are alike: one worker renders them)
  POST /forge/sessions      a training session to its group's worker, an eval session to the workers in turn; the
                            answer's ``base_url`` is the worker's own (``http://host:port/s/<key>/v1``), so agents
                            call the worker directly and the front stays off the hot path. With ``--public-url``
                            (workers not reachable by agents) base URLs are the front's, which forwards each call.
  /v1/..., /s/<key>/v1/...  forwarded (streams too) to the worker that holds the key (path, ``Authorization:
                            Bearer``, ``x-api-key``): keys and session ids carry the worker's tag ``w<i>r<restarts>``
  /forge/sessions/<id>/...  forwarded to the session's worker
  /forge/admin/pause        to every worker at once (``inflight``: their sum); resume likewise; state: summed over
                            the workers, each worker's own under ``workers``
  /metrics                  every worker's series with a ``worker`` label; the data pool's once (forge-node)
  /forge/evals              worker 0 (the eval log is not sharded)

Engines. Each worker routes its calls over the engines itself, by the whole gateway's calls in flight on each: the
front creates a small shared table (``SharedLoad``: a file in /dev/shm, one row per worker) that every worker adds its
calls to and reads the sums of; a restarted worker zeroes its row.

Workers and faults. A worker that exits is started again under a new tag: its open sessions are lost (calls and
session requests for them answer 410 ``session_lost``; their groups are timed out by the pool's
``--episode-timeout-s``); new sessions of its groups open in the new worker, which adopts the groups
(``POST /forge/groups/adopt``). Workers exit when the front does (they watch their parent). Episodes reach the sink
from each worker: forge-node's data pool over ZeroMQ (:class:`PoolSink`), or ``--episodes-jsonl`` (appends under a
file lock).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass

from aiohttp import ClientConnectionError, ClientSession, ClientTimeout, TCPConnector, web

from forge_megatron.middleware.gateway import ApiError, GatewayConfig, pool_metric_lines
from forge_megatron.middleware.schema import EpisodeSink, SchemaError
from forge_megatron.rollout.sglang_client import SharedLoad

log = logging.getLogger("forge.gateway")

_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
        "transfer-encoding", "upgrade", "host", "content-length"}
MAX_GROUPS = 1 << 20  # group -> worker entries the front keeps (oldest forgotten first)


def worker_tag_of(key_or_id: str | None) -> str | None:
    """The worker tag in a session id (``<tag>-<hex>``) or API key (``forge-<tag>-<token>``), else None."""
    if not key_or_id:
        return None
    rest = key_or_id[len("forge-"):] if key_or_id.startswith("forge-") else key_or_id
    tag, sep, _ = rest.partition("-")
    return tag if sep and tag.startswith("w") and tag[1:].replace("r", "", 1).isdigit() else None


class PoolSink(EpisodeSink):
    """The data pool over ZeroMQ as a worker's episode sink: one :class:`PoolClient` per thread (the gateway calls
    its sink from worker threads; a ZeroMQ socket belongs to one thread), the pool's refusals as SchemaError (the
    gateway answers them 409, as with the pool in process). A pool that does not answer (TimeoutError after the
    client's resends) is the gateway's 503 ``sink_unavailable``: the session stays open and the end can be sent
    again; the pool dedups an episode it already has (by episode id)."""

    def __init__(self, addr: str, timeout_s: float = 10.0, retries: int = 3):
        self.addr, self.timeout_s, self.retries = addr, timeout_s, retries
        self._local = threading.local()
        self._clients: list = []  # every thread's, closed by close()
        self._lock = threading.Lock()

    def _client(self):
        client = getattr(self._local, "client", None)
        if client is None:
            from forge_megatron.middleware.transport import PoolClient

            client = self._local.client = PoolClient(self.addr, timeout_s=self.timeout_s, retries=self.retries)
            with self._lock:
                self._clients.append(client)
        return client

    def close(self) -> None:
        """Close every thread's client (the gateway is stopping: no call uses them any more)."""
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()

    def _call(self, method: str, *args):
        from forge_megatron.middleware.transport import PoolError

        try:
            return getattr(self._client(), method)(*args)
        except PoolError as exc:
            raise SchemaError(str(exc)) from exc

    def register_group(self, task_id: str, size: int, domain: str = "default", metadata: dict | None = None) -> str:
        return self._call("register_group", task_id, size, domain, metadata)

    def episode_started(self, group_id: str, episode_id: str) -> None:
        self._call("episode_started", group_id, episode_id)

    def submit_episode(self, episode) -> str:
        return self._call("submit_episode", episode)


def _sink(spec: dict, tag: str) -> EpisodeSink:
    from forge_megatron.middleware.gateway import JsonlSink
    from forge_megatron.middleware.schema import ListSink

    kind = spec.get("kind")
    if kind == "pool":
        return PoolSink(spec["addr"])
    if kind == "jsonl":
        return JsonlSink(spec["path"], id_prefix=f"{tag}-")
    if kind == "list":
        return ListSink(id_prefix=f"{tag}-")
    raise ValueError(f"unknown sink {spec!r}")


@dataclass
class _Worker:
    index: int
    restarts: int
    proc: asyncio.subprocess.Process | None = None
    url: str | None = None
    ready: bool = False
    retry_at: float = 0.0  # a failed restart is tried again from then

    @property
    def tag(self) -> str:
        return f"w{self.index}r{self.restarts}"


class GatewayFront:
    """The front of a multi-process gateway (module docstring): starts the workers, keeps them running, routes."""

    def __init__(self, config: GatewayConfig, workers: int, sink: dict, pool=None, start_timeout_s: float = 300.0):
        if workers < 2:
            raise ValueError(f"a multi-process gateway needs at least 2 workers, got {workers}")
        if sink.get("kind") not in ("pool", "jsonl", "list"):
            raise ValueError(f"sink must be a pool, jsonl or list spec, got {sink!r}")
        self.config, self.sink, self.pool = config, sink, pool  # pool: forge-node's DataPool, for /metrics
        self.start_timeout_s = start_timeout_s
        self.workers = [_Worker(i, 0) for i in range(workers)]
        self.groups: OrderedDict[str, tuple[int, dict]] = OrderedDict()
        self.restarts_total = 0
        self.paused, self.policy_version = False, None  # as last sent to the workers (a restarted one is set so)
        self.policy_adapter: str | None = None  # the LoRA adapter the last resume named (see Gateway.resume)
        self._turn = 0
        self._http: ClientSession | None = None
        self._monitor: asyncio.Task | None = None
        self._stopping = False
        self.load_file: str | None = None  # the workers' shared engine-load table (created at start)

    # --- workers ----------------------------------------------------------------------------------------------
    def worker_spec(self, w: _Worker) -> dict:
        fields = asdict(self.config)
        fields.update(port=0, worker_tag=w.tag,  # public_url: the front's when given (agents reach only it)
                      engine_load_file=self.load_file, engine_load_row=w.index)
        return {"config": fields, "sink": self.sink, "tag": w.tag}

    async def _start(self, w: _Worker) -> None:
        """Start worker ``w`` and wait for its port (raise with its output when it dies first); the caller marks it
        ready."""
        w.ready, w.url = False, None
        w.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "forge_megatron.middleware.gateway_front", "--serve-worker",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "FORGE_GATEWAY_FRONT_PID": str(os.getpid())})
        w.proc.stdin.write(json.dumps(self.worker_spec(w)).encode())
        await w.proc.stdin.drain()
        w.proc.stdin.close()
        tail: list[str] = []
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                line = await asyncio.wait_for(w.proc.stdout.readline(), max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                w.proc.kill()
                await w.proc.wait()
                raise RuntimeError(f"gateway worker {w.tag} did not start in {self.start_timeout_s:.0f}s:\n"
                                   + "".join(tail)) from None
            if not line:
                await w.proc.wait()
                raise RuntimeError(f"gateway worker {w.tag} exited with {w.proc.returncode} before it served (its "
                                   "error is above)" + "".join(["; its output:\n", *tail] if tail else []))
            text = line.decode(errors="replace")
            if text.startswith("FORGE_READY port="):
                port = int(text.strip().split("=", 1)[1])
                host = "127.0.0.1" if self.config.host in ("0.0.0.0", "::", "") else self.config.host
                w.url = f"http://{host}:{port}"
                asyncio.get_running_loop().create_task(self._relay(w))
                log.info("gateway worker %s (pid %d) serves on %s", w.tag, w.proc.pid, w.url)
                return
            tail = (tail + [text])[-30:]

    @staticmethod
    async def _relay(w: _Worker) -> None:
        """Keep the worker's stdout drained (its logs go to stderr, shared with the front)."""
        proc = w.proc
        while await proc.stdout.readline():
            pass

    async def start(self) -> None:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="forge-gateway-load-", dir=shm)
        os.close(fd)
        self.load_file = SharedLoad.create(path, len(self.workers), len(self.config.engine_urls))
        self._http = ClientSession(connector=TCPConnector(limit=0), auto_decompress=False,
                                   timeout=ClientTimeout(total=None, sock_connect=10))
        try:
            await asyncio.gather(*(self._start(w) for w in self.workers))
            for w in self.workers:
                w.ready = True
        except BaseException:
            await self.stop()
            raise
        self._monitor = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        """Start again any worker that exits, under a new tag (its sessions are gone), paused and at the policy
        version as the others are."""
        while not self._stopping:
            await asyncio.sleep(0.2)
            for w in self.workers:
                if self._stopping or w.proc.returncode is None or time.monotonic() < w.retry_at:
                    continue
                if w.ready:
                    log.error("gateway worker %s exited with %s: its open sessions are lost; starting it again",
                              w.tag, w.proc.returncode)
                    w.ready = False
                w.restarts += 1
                self.restarts_total += 1
                try:
                    await self._start(w)
                    applied = None
                    while applied != (self.paused, self.policy_version, self.policy_adapter):  # a pause or resume
                        applied = (self.paused, self.policy_version, self.policy_adapter)  # may come meanwhile
                        version = {} if applied[1] is None else {"policy_version": applied[1]}
                        if applied[2] is not None:
                            version["lora_name"] = applied[2]
                        for path, body in (("resume", version), *((("pause", {"drain_timeout_s": 0}),)
                                                                  if applied[0] else ())):
                            status, answer = await self._json(w, "POST", f"/forge/admin/{path}",
                                                              self._credentials(None), body=body)
                            if status != 200:
                                raise RuntimeError(f"{path} answered {status}: {answer}")
                    w.ready = True  # only now: no call reaches it at another version or while the others pause
                except Exception:  # noqa: BLE001 - the others keep serving; try again in a while
                    log.exception("gateway worker %s did not start again; next try in 5 s", w.tag)
                    if w.proc.returncode is None:
                        w.proc.kill()
                        await w.proc.wait()
                    w.ready, w.retry_at = False, time.monotonic() + 5.0

    async def stop(self) -> None:
        self._stopping = True
        if self._monitor is not None:
            self._monitor.cancel()
        for w in self.workers:
            if w.proc is not None and w.proc.returncode is None:
                w.proc.terminate()
        for w in self.workers:
            if w.proc is not None:
                try:
                    await asyncio.wait_for(w.proc.wait(), 10)
                except asyncio.TimeoutError:
                    w.proc.kill()
        if self._http is not None:
            await self._http.close()
        if self.load_file is not None:
            try:
                os.unlink(self.load_file)
            except FileNotFoundError:
                pass

    def _next(self) -> _Worker:
        """The next worker in turn that is serving (503 when none is)."""
        for _ in range(len(self.workers)):
            w = self.workers[self._turn % len(self.workers)]
            self._turn += 1
            if w.ready:
                return w
        raise ApiError(503, "no gateway worker is serving (all are starting again)", "service_unavailable",
                       code="no_worker")

    def _serving(self, index: int) -> _Worker:
        w = self.workers[index]
        if not w.ready:
            raise ApiError(503, f"gateway worker {index} is starting again; retry shortly", "service_unavailable",
                           code="worker_restarting")
        return w

    def _holder(self, tag: str | None) -> _Worker | None:
        """The worker holding sessions tagged ``tag``; None for no tag; 410 when that worker has since died."""
        if tag is None:
            return None
        index, _, restarts = tag[1:].partition("r")
        if not index.isdigit() or int(index) >= len(self.workers):
            return None
        w = self._serving(int(index))
        if str(w.restarts) != restarts:
            raise ApiError(410, f"the session's gateway worker ({tag}) exited and was started again: the session is "
                                "lost; end the episode and start another", code="session_lost")
        return w

    # --- forwarding -------------------------------------------------------------------------------------------
    async def forward(self, request: web.Request, w: _Worker, body: bytes | None = None) -> web.StreamResponse:
        """``request`` sent on to worker ``w`` as it came; the answer streamed back as it comes."""
        data = await request.read() if body is None else body
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        resp = None
        try:
            async with self._http.request(request.method, w.url + request.rel_url.path_qs, data=data,
                                          headers=headers) as up:
                resp = web.StreamResponse(status=up.status, reason=up.reason,
                                          headers={k: v for k, v in up.headers.items() if k.lower() not in _HOP})
                if up.content_length is not None:
                    resp.content_length = up.content_length
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except ClientConnectionError as exc:
            if resp is not None:  # the worker died mid-answer: the client sees the stream end early
                raise
            raise ApiError(503, f"gateway worker {w.tag} did not answer ({exc.__class__.__name__}); retry shortly",
                           "service_unavailable", code="worker_unavailable") from exc

    async def _json(self, w: _Worker, method: str, path: str, headers: dict, data: bytes | None = None,
                    body: dict | None = None) -> tuple[int, dict]:
        """(status, JSON answer) of worker ``w`` to one request (``data``: bytes as they came, or ``body`` as JSON);
        an answer that is not JSON becomes an error object; a worker that does not answer is a 503."""
        try:
            async with self._http.request(method, w.url + path, data=data, json=body, headers=headers) as r:
                try:
                    return r.status, await r.json(content_type=None)
                except ValueError:
                    return r.status, {"error": {"message": await r.text(), "type": "worker_error"}}
        except ClientConnectionError as exc:
            raise ApiError(503, f"gateway worker {w.tag} did not answer ({exc.__class__.__name__}); retry shortly",
                           "service_unavailable", code="worker_unavailable") from exc

    def _credentials(self, request: web.Request | None) -> dict:
        """The caller's credentials, for a request of the front's own to a worker (the front's admin token when
        it acts on its own)."""
        if request is not None:
            return {k: v for k in ("Authorization", "X-Forge-Admin-Token") if (v := request.headers.get(k))}
        return {"X-Forge-Admin-Token": self.config.admin_token} if self.config.admin_token else {}

    async def _post_raw(self, request: web.Request, w: _Worker, body: bytes) -> tuple[int, dict]:
        """``request`` (its body already read) sent on to worker ``w``; its (status, JSON answer)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        return await self._json(w, "POST", request.rel_url.path_qs, headers, data=body)

    async def _each(self, method: str, path: str, request: web.Request, body: dict | None = None) -> list:
        """(worker, status, answer) of every serving worker that answered. One that did not has just exited: the
        watch starts it again, paused and at the policy version as the others (so pause and resume hold for it)."""
        serving = [w for w in self.workers if w.ready]

        async def one(w):
            try:
                return (w, *await self._json(w, method, path, self._credentials(request), body=body))
            except ApiError:  # it did not answer
                return None
        answers = [a for a in await asyncio.gather(*(one(w) for w in serving)) if a is not None]
        if not answers:
            raise ApiError(503, "no gateway worker is serving", "service_unavailable", code="no_worker")
        return answers

    # --- routes -----------------------------------------------------------------------------------------------
    async def by_key(self, request: web.Request) -> web.StreamResponse:
        key = request.match_info.get("key") or request.headers.get("x-api-key")
        auth = request.headers.get("Authorization", "")
        if not key and auth.startswith("Bearer "):
            key = auth[7:].strip()
        w = self._holder(worker_tag_of(key)) or self._next()  # no session key: any worker answers (401, models)
        return await self.forward(request, w)

    async def by_session(self, request: web.Request) -> web.StreamResponse:
        w = self._holder(worker_tag_of(request.match_info["sid"]))
        if w is None:
            raise ApiError(404, f"unknown session {request.match_info['sid']!r}", code="session_not_found")
        return await self.forward(request, w)

    async def create_group(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        w = self._next()
        status, answer = await self._post_raw(request, w, body)
        if status == 200:
            try:
                sent = json.loads(body)
                # (the metadata too: a worker that adopts the group renders its teacher prompt from it)
                self._remember(answer["group_id"], w.index,
                               {k: sent.get(k) for k in ("task_id", "size", "domain", "metadata")})
            except (ValueError, KeyError, TypeError, AttributeError):
                log.warning("group answer of worker %s not understood: %r", w.tag, answer)
        return web.json_response(answer, status=status)

    def _remember(self, group_id: str, index: int, info: dict) -> None:
        self.groups[group_id] = (index, info)
        while len(self.groups) > MAX_GROUPS:
            self.groups.popitem(last=False)

    async def create_session(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            parsed = json.loads(body)
            group_id = parsed.get("group_id") if isinstance(parsed, dict) and not parsed.get("eval") else None
        except ValueError:
            group_id = None  # a worker answers the 400
        placed = self.groups.get(group_id) if isinstance(group_id, str) else None
        w = self._serving(placed[0]) if placed else self._next()
        status, answer = await self._post_raw(request, w, body)
        if status == 404 and placed and (answer.get("error") or {}).get("code") == "group_not_found":
            # the group's worker was started again since the group opened: the new one takes the group over
            adopt_status, adopted = await self._json(w, "POST", "/forge/groups/adopt", self._credentials(request),
                                                     body={"group_id": group_id, **placed[1]})
            if adopt_status != 200:
                return web.json_response(adopted, status=adopt_status)
            status, answer = await self._post_raw(request, w, body)
        return web.json_response(answer, status=status)

    async def _to_every_worker(self, request: web.Request, path: str) -> list | web.StreamResponse:
        """The request's JSON body POSTed to ``path`` of every serving worker: their answers, or the response to
        give (a worker's 400 for a body that is not a JSON object, the first worker's error)."""
        body = await request.read()
        try:
            sent = json.loads(body) if body else {}
        except ValueError:
            sent = None
        if not isinstance(sent, dict):
            return await self.forward(request, self._next(), body)
        answers = await self._each("POST", path, request, sent)
        bad = _first_error(answers)  # (a response is a mapping: empty, it is falsy)
        return answers if bad is None else bad

    async def pause(self, request: web.Request) -> web.StreamResponse:
        answers = await self._to_every_worker(request, "/forge/admin/pause")
        if not isinstance(answers, list):
            return answers
        self.paused = True
        return web.json_response({"paused": True, "inflight": sum(a.get("inflight", 0) for _, _, a in answers)})

    async def resume(self, request: web.Request) -> web.StreamResponse:
        answers = await self._to_every_worker(request, "/forge/admin/resume")
        if not isinstance(answers, list):
            return answers
        self.paused, self.policy_version = False, max(a.get("policy_version", 0) for _, _, a in answers)
        self.policy_adapter = answers[0][2].get("policy_adapter")
        return web.json_response({"paused": False, "policy_version": self.policy_version,
                                  "policy_adapter": self.policy_adapter})

    async def state(self, request: web.Request) -> web.Response:
        answers = await self._each("GET", "/forge/admin/state", request)
        bad = _first_error(answers)
        if bad is not None:
            return bad
        states = [a for _, _, a in answers]
        out = dict(states[0])
        for key, value in states[0].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "policy_version":
                out[key] = sum(s.get(key, 0) for s in states)
        out["group_affinity"] = {k: sum((s.get("group_affinity") or {}).get(k, 0) for s in states)
                                 for k in states[0].get("group_affinity") or {}}
        out["paused"] = any(s.get("paused") for s in states)
        out["policy_version"] = max(s.get("policy_version", 0) for s in states)
        engines: dict[str, dict] = {}
        for s in states:
            for e in s.get("engines", []):
                seen = engines.setdefault(e["url"], {"url": e["url"], "up": True, "inflight": 0, "served": 0,
                                                     "failures": 0})
                seen["up"] = seen["up"] and bool(e.get("up"))
                for k in ("inflight", "served", "failures"):
                    seen[k] += e.get(k, 0)
        out["engines"] = list(engines.values())
        by_tag = {w.tag: (w, a) for w, _, a in answers}
        out["workers"] = [{"index": w.index, "tag": w.tag, "url": w.url, "serving": w.ready,
                           "pid": w.proc.pid if w.proc else None, "restarts": w.restarts,
                           **({k: by_tag[w.tag][1].get(k) for k in ("sessions_open", "inflight", "calls")}
                              if w.tag in by_tag else {})} for w in self.workers]
        out["worker_restarts"] = self.restarts_total
        out["engine_load_file"] = self.load_file  # the workers' shared calls-in-flight table
        return web.json_response(out)

    async def metrics(self, request: web.Request) -> web.Response:
        serving = [w for w in self.workers if w.ready]
        headers = self._credentials(request)

        async def text(w):
            try:
                async with self._http.get(w.url + "/metrics", headers=headers) as r:
                    return w, r.status, await r.text()
            except ClientConnectionError:
                return w, 503, ""
        texts = await asyncio.gather(*(text(w) for w in serving))
        for _, status, body in texts:
            if status == 401:
                return web.Response(status=401, text=body, content_type="application/json")
        lines = merge_prometheus([(str(w.index), body) for w, status, body in texts if status == 200])
        lines += [ "# HELP forge_gateway_workers gateway workers serving", "# TYPE forge_gateway_workers gauge",
                   f"forge_gateway_workers {len(serving)}",
                   "# HELP forge_gateway_worker_restarts_total gateway workers started again after exiting",
                   "# TYPE forge_gateway_worker_restarts_total counter",
                   f"forge_gateway_worker_restarts_total {self.restarts_total}"]
        if self.pool is not None:
            lines += pool_metric_lines(await asyncio.to_thread(self.pool.metrics))
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8",
                            headers={"X-Prometheus-Format": "0.0.4"})

    async def evals(self, request: web.Request) -> web.StreamResponse:
        return await self.forward(request, self._serving(0))

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)

        def api(handler):
            async def wrapped(request: web.Request) -> web.StreamResponse:
                try:
                    return await handler(request)
                except ApiError as exc:
                    return exc.response()
            return wrapped

        app.router.add_route("*", "/v1/{tail:.*}", api(self.by_key))
        app.router.add_route("*", "/s/{key}/v1/{tail:.*}", api(self.by_key))
        app.router.add_post("/forge/groups", api(self.create_group))
        app.router.add_post("/forge/sessions", api(self.create_session))
        app.router.add_route("*", "/forge/sessions/{sid}", api(self.by_session))
        app.router.add_route("*", "/forge/sessions/{sid}/{tail:.*}", api(self.by_session))
        app.router.add_post("/forge/admin/pause", api(self.pause))
        app.router.add_post("/forge/admin/resume", api(self.resume))
        app.router.add_get("/forge/admin/state", api(self.state))
        app.router.add_route("*", "/forge/evals", api(self.evals))
        app.router.add_get("/metrics", api(self.metrics))
        return app


def _first_error(answers: list) -> web.Response | None:
    for w, status, answer in answers:
        if status != 200:
            return web.json_response(answer, status=status)
    return None


def merge_prometheus(texts: list[tuple[str, str]]) -> list[str]:
    """Prometheus text expositions of several workers as one: each family's HELP and TYPE once, every sample with a
    ``worker`` label (``texts``: (worker label, exposition))."""
    families: dict[str, dict] = {}
    for label, text in texts:
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                name = line.split(" ", 3)[2]
                fam = families.setdefault(name, {"meta": [], "samples": []})
                if line not in fam["meta"]:
                    fam["meta"].append(line)
            elif line and not line.startswith("#"):
                series, _, value = line.rpartition(" ")
                name, brace, labels = series.partition("{")
                worker = f'worker="{label}"'
                series = f"{name}{{{worker},{labels}" if brace and labels != "}" else f"{name}{{{worker}}}"
                fam = families.setdefault(name, {"meta": [], "samples": []})
                fam["samples"].append(f"{series} {value}")
    return [line for fam in families.values() for line in fam["meta"] + fam["samples"]]


async def serve_front(front: GatewayFront, ready=None) -> None:
    """Start the workers, then serve the front until cancelled or sent SIGTERM (then it stops its workers and removes
    their shared table before it returns); ``ready(port)`` once listening."""
    from forge_megatron.rollout.launch import serve_app, until_terminated

    async def run() -> None:
        await front.start()
        await serve_app(front.app(), front.config.host, front.config.port, ready, stopping=front.stop)

    await until_terminated(run())


def _orphaned(parent: int, load_file: str | None) -> bool:
    """Whether the front that started this worker is gone (killed -9 or otherwise); then the workers' shared load
    table, which the front removes when it stops cleanly, is removed here."""
    if os.getppid() == parent:
        return False
    if load_file:
        try:
            os.unlink(load_file)
        except OSError:
            pass
    return True


def _watch_parent(parent: int, load_file: str | None = None) -> None:
    """Exit when the front is gone."""
    while True:
        time.sleep(0.5)
        if _orphaned(parent, load_file):
            os._exit(0)


def serve_worker() -> None:
    """``python -m forge_megatron.middleware.gateway_front --serve-worker``: one worker, its spec as JSON on stdin."""
    from forge_megatron.middleware.gateway import Gateway, serve
    from forge_megatron.rollout.launch import print_ready, until_terminated

    spec = json.loads(sys.stdin.read())
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s forge-gateway[{spec['tag']}] %(message)s")
    parent = int(os.environ.get("FORGE_GATEWAY_FRONT_PID", os.getppid()))
    load_file = spec["config"].get("engine_load_file")
    threading.Thread(target=_watch_parent, args=(parent, load_file), daemon=True).start()
    try:
        gw = Gateway(GatewayConfig(**spec["config"]), sink=_sink(spec["sink"], spec["tag"]))
    except ValueError as exc:  # e.g. --return-routed-experts on a dense model: the front reports the exit
        print(f"forge-gateway[{spec['tag']}]: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    try:  # SIGTERM (the front stopping it, or one to the whole group) stops serving
        asyncio.run(until_terminated(serve(gw, ready=print_ready)))
    finally:  # a front killed along with its group: the table is the workers' to remove
        if isinstance(gw.sink, PoolSink):
            gw.sink.close()
        _orphaned(parent, load_file)


if __name__ == "__main__":
    if sys.argv[1:] != ["--serve-worker"]:
        raise SystemExit("gateway_front.py starts gateway workers for forge-gateway --workers N; run forge-gateway")
    serve_worker()
