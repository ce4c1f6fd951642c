"""Async client for SGLang's native HTTP API, and a fleet of engines with routing, stickiness and failover.

Field names follow SGLang (python/sglang/srt/managers/io_struct.py, entrypoints/http_server.py):
``/generate`` takes ``input_ids``, ``sampling_params`` {temperature, top_p, top_k, max_new_tokens, stop,
stop_token_ids, ...}, ``return_logprob``, ``top_logprobs_num``, ``stream``, ``rid``; it answers ``output_ids``, ``text``
and ``meta_info`` {finish_reason {type: stop|length|abort, matched}, prompt_tokens, completion_tokens,
output_token_logprobs [[logprob, token_id, text], ...], output_top_logprobs (per output token, a list of such
triples, most likely first), weight_version, routed_experts (with ``return_routed_experts``: base64 int32
[prompt + output - 1, layers, topk], the server started with ``--enable-return-routed-experts``)}. Control routes: ``/health``, ``/get_model_info``,
``/get_weight_version``, ``/flush_cache``, ``/pause_generation`` {mode}, ``/continue_generation``,
``/update_weights_from_disk`` {model_path, weight_version, flush_cache, abort_all_requests},
``/init_weights_update_group`` {master_address, master_port, rank_offset, world_size, group_name, backend},
``/destroy_weights_update_group`` {group_name},
``/update_weights_from_distributed`` {names, dtypes, shapes, group_name, flush_cache, weight_version};
LoRA serving (``--enable-lora``): ``/generate``'s ``lora_path`` (a loaded adapter's name), ``/load_lora_adapter``
{lora_name, lora_path, pinned}, ``/unload_lora_adapter`` {lora_name} (answers {success, error_message,
loaded_adapters}, 400 on failure), ``/v1/models`` (adapters after the base model, with ``parent``).

The fleet routes each call to the least-loaded live engine, but keeps a session on the engine it used before
(its prefix cache holds the session's history), and opens a session on the engine its group's sessions use (the G
rollouts of a task share the task's prompt: one prefill of it, cached, instead of one per engine) unless that engine
has more than ``group_affinity_slack`` calls in flight over the least-loaded one. An engine that fails a call (connection refused/reset, timeout,
5xx) is marked down and the call is retried on another engine; a health loop marks engines back up. The processes of
a multi-process gateway share their in-flight counts (:class:`SharedLoad`), so each routes by the whole gateway's
load on every engine, not by its own calls alone.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import mmap
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import AsyncIterator

import aiohttp
import numpy as np


class EngineError(RuntimeError):
    """The engine failed (unreachable, died, timed out, or answered 5xx): retry elsewhere."""


class EngineRequestError(ValueError):
    """The engine rejected the request (4xx): retrying elsewhere will not help."""


class NoEngineAvailable(RuntimeError):
    """Every engine is down or failed this call."""


@dataclass
class GenerateResult:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict
    prompt_tokens: int
    completion_tokens: int
    weight_version: str | None
    text: str
    engine_url: str = ""
    routed_experts: "np.ndarray | None" = None  # flat int32 (SGLang: [prompt + output - 1, layers, topk]), if asked
    top_logprobs: "list[list[tuple[float, int]]] | None" = None  # per output token, (logprob, id) most likely first
    lora_path: str | None = None  # the LoRA adapter the request named (set by the client, not the engine's answer)

    @property
    def finish_type(self) -> str:
        return (self.finish_reason or {}).get("type", "")

    @classmethod
    def from_response(cls, body: dict, engine_url: str) -> "GenerateResult":
        meta = body.get("meta_info") or {}
        triples = meta.get("output_token_logprobs") or []
        ids = body.get("output_ids")
        if ids is None:  # older SGLang: ids only inside the logprob triples
            ids = [t[1] for t in triples]
        return cls(
            output_ids=list(ids),
            logprobs=[float(t[0]) for t in triples],
            finish_reason=meta.get("finish_reason") or {},
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            completion_tokens=int(meta.get("completion_tokens", len(ids))),
            weight_version=meta.get("weight_version"),
            text=body.get("text", ""),
            engine_url=engine_url,
            routed_experts=_decode_routed_experts(meta.get("routed_experts"), engine_url),
            top_logprobs=_top_logprobs(meta.get("output_top_logprobs"), engine_url),
        )


def _top_logprobs(value, engine_url: str):
    """SGLang's ``meta_info["output_top_logprobs"]`` -> per position [(logprob, token_id), ...] (None if absent; a
    position SGLang reports as null has no alternatives)."""
    if value is None:
        return None
    try:
        return [[(float(t[0]), int(t[1])) for t in (pos or [])] for pos in value]
    except (TypeError, ValueError, IndexError) as exc:
        raise EngineError(f"{engine_url}: output_top_logprobs is not a list of [logprob, token_id, text] lists: "
                          f"{exc}") from exc


def _decode_routed_experts(value, engine_url: str):
    """SGLang's ``meta_info["routed_experts"]``: base64 of int32 bytes -> flat int32 array (None if absent)."""
    if value is None:
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except (TypeError, ValueError) as exc:
        raise EngineError(f"{engine_url}: routed_experts is not base64: {exc}") from exc
    if len(raw) % 4:
        raise EngineError(f"{engine_url}: routed_experts has {len(raw)} bytes, not a whole number of int32")
    return np.frombuffer(raw, dtype=np.int32)


class SGLangClient:
    """One engine. Methods are coroutines; the aiohttp session is created on first use inside the running loop."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _call(self, method: str, route: str, body: dict | None = None, timeout_s: float | None = None):
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else None
        try:
            async with self._http().request(method, self.url + route, json=body, timeout=timeout) as resp:
                text = await resp.text()
                _raise_for_status(resp.status, text, self.url + route)
                return json.loads(text) if text.strip().startswith(("{", "[")) else text
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
            raise EngineError(f"{self.url}{route} failed: {type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _generate_body(input_ids, sampling_params, return_logprob, rid, return_routed_experts, top_logprobs_num,
                       image_data=None, lora_path=None):
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": return_logprob}
        if lora_path is not None:
            body["lora_path"] = lora_path
        if rid:
            body["rid"] = rid
        if return_routed_experts:
            body["return_routed_experts"] = True
        if top_logprobs_num:
            body["top_logprobs_num"] = top_logprobs_num
        if image_data:
            body["image_data"] = image_data
        return body

    async def generate(self, input_ids: list[int], sampling_params: dict, return_logprob: bool = True,
                       rid: str | None = None, return_routed_experts: bool = False,
                       top_logprobs_num: int = 0, image_data: list[str] | None = None,
                       lora_path: str | None = None) -> GenerateResult:
        body = self._generate_body(input_ids, sampling_params, return_logprob, rid, return_routed_experts,
                                   top_logprobs_num, image_data, lora_path)
        result = GenerateResult.from_response(await self._call("POST", "/generate", body), self.url)
        result.lora_path = lora_path
        return result

    async def generate_stream(self, input_ids: list[int], sampling_params: dict, return_logprob: bool = True,
                              rid: str | None = None, return_routed_experts: bool = False,
                              top_logprobs_num: int = 0, image_data: list[str] | None = None,
                              lora_path: str | None = None) -> AsyncIterator[GenerateResult]:
        """Yield the cumulative result after each chunk SGLang streams (``stream: true``, SSE ``data:`` lines)."""
        body = {**self._generate_body(input_ids, sampling_params, return_logprob, rid, return_routed_experts,
                                      top_logprobs_num, image_data, lora_path), "stream": True}
        try:
            async with self._http().post(self.url + "/generate", json=body) as resp:
                if resp.status != 200:
                    _raise_for_status(resp.status, await resp.text(), self.url + "/generate")
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    result = GenerateResult.from_response(json.loads(line[5:]), self.url)
                    result.lora_path = lora_path
                    yield result
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
            raise EngineError(f"{self.url}/generate stream failed: {type(exc).__name__}: {exc}") from exc

    async def input_logprobs(self, input_ids: list[int], logprob_start_len: int, temperature: float = 1.0,
                             timeout_s: float | None = None, top_logprobs_num: int = 0):
        """Prefill-only scoring (``max_new_tokens: 0``, ``return_logprob``, ``logprob_start_len``): the logprob of
        each input token from ``logprob_start_len + 1`` on, under softmax(logits / temperature) (SGLang tempers input
        logprobs as it does output ones). SGLang answers ``meta_info["input_token_logprobs"]``, one [logprob,
        token_id, text] per position from ``logprob_start_len``, the first logprob None; an answer of another length,
        other token ids, or a missing or non-finite logprob raises EngineRequestError naming the engine, an aborted
        one (the engine paused for a weight update: teacher URLs may be the policy's own engines) EngineError.

        ``top_logprobs_num`` k > 0 also asks for each position's k most likely tokens (``meta_info[
        "input_top_logprobs"]``: per position a list of [logprob, token_id, text], most likely first, the first
        position None) and returns (logprobs, ids int32 [n, k], logprobs float32 [n, k]) for the same n positions;
        an entry that is not k finite logprobs of distinct token ids in descending order raises EngineRequestError."""
        body = {"input_ids": input_ids, "return_logprob": True, "logprob_start_len": logprob_start_len,
                "sampling_params": {"max_new_tokens": 0, "temperature": temperature}}
        if top_logprobs_num:
            body["top_logprobs_num"] = top_logprobs_num
        answer = await self._call("POST", "/generate", body, timeout_s=timeout_s)
        meta = (answer.get("meta_info") or {}) if isinstance(answer, dict) else {}
        if (meta.get("finish_reason") or {}).get("type") == "abort":  # a weight sync paused the engine: try again
            raise EngineError(f"{self.url}/generate: the scoring was aborted ({meta['finish_reason'].get('message')})")
        entries = meta.get("input_token_logprobs")
        want = input_ids[logprob_start_len:]
        if not isinstance(entries, list) or len(entries) != len(want):
            raise EngineRequestError(f"{self.url}/generate: input_token_logprobs should have {len(want)} entries "
                                     f"(logprob_start_len {logprob_start_len} of {len(input_ids)} tokens), got "
                                     f"{len(entries) if isinstance(entries, list) else type(entries).__name__}")
        out = []
        for j, (entry, token) in enumerate(zip(entries[1:], want[1:]), start=1):
            ok = isinstance(entry, (list, tuple)) and len(entry) >= 2 and entry[1] == token and \
                isinstance(entry[0], (int, float)) and math.isfinite(entry[0])
            if not ok:
                raise EngineRequestError(f"{self.url}/generate: input_token_logprobs[{j}] is {entry!r}, expected a "
                                         f"finite logprob of token {token}")
            out.append(float(entry[0]))
        if not top_logprobs_num:
            return out
        return (out, *self._input_top(meta.get("input_top_logprobs"), len(want), top_logprobs_num))

    def _input_top(self, entries, n: int, k: int):
        """``input_top_logprobs`` (n entries, the first None) -> ids int32 [n - 1, k], logprobs float32 [n - 1, k]."""
        import numpy as np

        if not isinstance(entries, list) or len(entries) != n:
            raise EngineRequestError(f"{self.url}/generate: input_top_logprobs should have {n} entries (one per "
                                     f"input_token_logprobs entry), got "
                                     f"{len(entries) if isinstance(entries, list) else type(entries).__name__}")
        ids = np.zeros((max(n - 1, 0), k), np.int32)
        logp = np.zeros((max(n - 1, 0), k), np.float32)
        for j, entry in enumerate(entries[1:]):
            ok = isinstance(entry, list) and len(entry) == k and all(
                isinstance(e, (list, tuple)) and len(e) >= 2 and isinstance(e[0], (int, float)) and
                not isinstance(e[1], bool) and isinstance(e[1], int) and e[1] >= 0 and math.isfinite(e[0])
                for e in entry)
            if ok:
                ids[j] = [e[1] for e in entry]
                logp[j] = [e[0] for e in entry]
                ok = len(set(ids[j].tolist())) == k and bool((np.diff(logp[j]) <= 1e-6).all()) and logp[j][0] <= 1e-6
            if not ok:
                raise EngineRequestError(f"{self.url}/generate: input_top_logprobs[{j + 1}] is not {k} [logprob, "
                                         f"token_id, text] entries of distinct tokens, most likely first: "
                                         f"{str(entry)[:200]}")
        return ids, logp

    async def health(self, timeout_s: float = 2.0) -> bool:
        try:
            await self._call("GET", "/health", timeout_s=timeout_s)
            return True
        except (EngineError, EngineRequestError):
            return False

    async def get_model_info(self) -> dict:
        return await self._call("GET", "/get_model_info")

    async def get_weight_version(self) -> str:
        return (await self._call("GET", "/get_weight_version"))["weight_version"]

    async def flush_cache(self) -> None:
        await self._call("POST", "/flush_cache")

    async def pause_generation(self, mode: str = "abort") -> dict:
        return await self._call("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict:
        return await self._call("POST", "/continue_generation", {})

    async def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict:
        return _checked(await self._call("POST", "/load_lora_adapter", {
            "lora_name": lora_name, "lora_path": lora_path, "pinned": pinned}))

    async def unload_lora_adapter(self, lora_name: str) -> dict:
        return _checked(await self._call("POST", "/unload_lora_adapter", {"lora_name": lora_name}))

    async def list_models(self) -> list[dict]:
        """``/v1/models``' cards: the base model, then each loaded LoRA adapter (``parent``: the base)."""
        return (await self._call("GET", "/v1/models"))["data"]

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       flush_cache: bool = True, abort_all_requests: bool = False) -> dict:
        return _checked(await self._call("POST", "/update_weights_from_disk", {
            "model_path": model_path, "weight_version": weight_version, "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests}))

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "gloo") -> dict:
        return _checked(await self._call("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}))

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str = "weight_update_group", flush_cache: bool = True,
                                              weight_version: str | None = None) -> dict:
        return _checked(await self._call("POST", "/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": flush_cache, "weight_version": weight_version}))


def _lacks_adapter(exc: EngineRequestError, lora_path: str | None) -> bool:
    """The engine refused the request for not holding its LoRA adapter (one restarted, or that failed the last
    load): another engine may hold it."""
    from forge_megatron.rollout.lora_serving import NOT_LOADED

    return lora_path is not None and NOT_LOADED in str(exc)


def _raise_for_status(status: int, text: str, where: str) -> None:
    if status < 400:
        return
    try:
        body = json.loads(text)
        msg = (body.get("error") or {}).get("message") or body.get("message") or text
    except (json.JSONDecodeError, AttributeError):
        msg = text
    if status >= 500:
        raise EngineError(f"{where} answered {status}: {msg}")
    raise EngineRequestError(f"{where} answered {status}: {msg}")


def _checked(body: dict) -> dict:
    if isinstance(body, dict) and body.get("success") is False:
        raise EngineRequestError(body.get("message") or body.get("error_message") or "engine reported failure")
    return body


class SharedLoad:
    """In-flight calls per engine of every process of one gateway: an int64 [processes, engines] table in a file that
    each process maps, adds its own calls to its own row of, and reads the column sums of (the front of a
    multi-process gateway creates it, one row per worker). No locks: a row has one writer (its process's event
    loop), and a read racing another process's update is off by that one call, which routing tolerates. A process
    that attaches zeroes its row (a restarted worker's predecessor may have died with calls counted)."""

    def __init__(self, path: str, row: int):
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        rows, engines = np.frombuffer(self._map, np.int64, count=2)
        if not 0 <= row < rows:
            raise ValueError(f"{path}: row {row} outside the table's {rows} rows")
        self.table = np.frombuffer(self._map, np.int64, count=int(rows * engines), offset=16).reshape(rows, engines)
        self.row = row
        self.table[row] = 0

    @staticmethod
    def create(path: str, rows: int, engines: int) -> str:
        """Write an all-zero table for ``rows`` processes and ``engines`` engines at ``path``; return the path."""
        with open(path, "wb") as f:
            f.write(np.array([rows, engines], np.int64).tobytes() + bytes(8 * rows * engines))
        return path

    @property
    def engines(self) -> int:
        return self.table.shape[1]

    def add(self, engine: int, delta: int) -> None:
        self.table[self.row, engine] += delta

    def total(self, engine: int) -> int:
        return int(self.table[:, engine].sum())

    def close(self) -> None:
        self.table = None
        self._map.close()


@dataclass
class EngineState:
    client: SGLangClient
    index: int = 0  # in the fleet's list (a column of its SharedLoad)
    up: bool = True
    inflight: int = 0  # this process's calls
    served: int = 0
    failures: int = 0
    down_since: float = 0.0

    @property
    def url(self) -> str:
        return self.client.url


@dataclass
class FleetConfig:
    """Routing and failover knobs."""

    max_attempts: int = 3  # engines tried per call before NoEngineAvailable
    health_interval_s: float = 2.0  # how often down engines are probed
    max_sticky_sessions: int = 100_000  # LRU bound on the session -> engine map
    timeout_s: float = 600.0  # per /generate call
    # A new session goes to its group's engine unless that one has more than this many calls in flight over the
    # least-loaded engine (SGLang's cache-aware router balances on a similar absolute threshold, 32); None: each new
    # session to the least-loaded engine.
    group_affinity_slack: int | None = 32

    def __post_init__(self):
        if self.group_affinity_slack is not None and self.group_affinity_slack < 0:
            raise ValueError(f"group_affinity_slack must be >= 0 or None, got {self.group_affinity_slack}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.health_interval_s <= 0:
            raise ValueError(f"health_interval_s must be > 0, got {self.health_interval_s}")


def _remember(lru: OrderedDict, key: str, value, bound: int) -> None:
    lru[key] = value
    lru.move_to_end(key)
    while len(lru) > bound:
        lru.popitem(last=False)


class EngineFleet:
    """Engines behind one interface: ``generate`` picks, calls, fails over; control calls go to every live engine."""

    def __init__(self, urls: list[str], config: FleetConfig | None = None, shared: SharedLoad | None = None):
        if not urls:
            raise ValueError("EngineFleet needs at least one engine url")
        if shared is not None and shared.engines != len(urls):
            raise ValueError(f"the shared load table has {shared.engines} engines, the fleet {len(urls)}")
        self.config = config or FleetConfig()
        self.shared = shared  # the gateway's other processes' calls too (SharedLoad)
        self.engines = [EngineState(SGLangClient(u, self.config.timeout_s), index=i) for i, u in enumerate(urls)]
        self.sticky: OrderedDict[str, EngineState] = OrderedDict()
        self.group_sticky: OrderedDict[str, EngineState] = OrderedDict()  # a group's engine: its sessions' latest
        self.affinity = {"followed": 0, "spilled": 0}  # new sessions placed with their group / away (load)
        self._health_task: asyncio.Task | None = None

    # --- routing ----------------------------------------------------------------------------------------------
    def load(self, eng: EngineState) -> int:
        """Calls in flight on ``eng``: the whole gateway's with a shared table, else this process's."""
        return self.shared.total(eng.index) if self.shared is not None else eng.inflight

    def _busy(self, eng: EngineState, delta: int) -> None:
        eng.inflight += delta
        if self.shared is not None:
            self.shared.add(eng.index, delta)

    def pick(self, session_key: str | None = None, exclude: set[str] = frozenset(),
             group_key: str | None = None) -> EngineState:
        """The session's engine if it is live; else its group's engine if live and within ``group_affinity_slack``
        calls of the least loaded; else the live engine with the fewest in-flight calls."""
        eng = self.sticky.get(session_key) if session_key else None
        if eng is None or not eng.up or eng.url in exclude:
            live = [e for e in self.engines if e.up and e.url not in exclude]
            if not live:
                raise NoEngineAvailable(f"no live engine (down: {[e.url for e in self.engines if not e.up]})")
            loads = {e.url: self.load(e) for e in live}
            eng = min(live, key=lambda e: (loads[e.url], e.served))
            slack = self.config.group_affinity_slack
            mate = self.group_sticky.get(group_key) if group_key and slack is not None else None
            if mate is not None and mate.up and mate.url not in exclude:
                if loads[mate.url] <= loads[eng.url] + slack:
                    eng = mate
                    self.affinity["followed"] += 1
                else:
                    self.affinity["spilled"] += 1
            if group_key:
                _remember(self.group_sticky, group_key, eng, self.config.max_sticky_sessions)
        if session_key:
            _remember(self.sticky, session_key, eng, self.config.max_sticky_sessions)
        return eng

    def forget(self, session_key: str) -> None:
        self.sticky.pop(session_key, None)

    def mark_down(self, url: str) -> None:
        for e in self.engines:
            if e.url == url and e.up:
                e.up, e.down_since = False, time.time()
                e.failures += 1

    def mark_up(self, url: str) -> None:
        for e in self.engines:
            if e.url == url:
                e.up = True

    @property
    def live_urls(self) -> list[str]:
        return [e.url for e in self.engines if e.up]

    # --- generation with failover -----------------------------------------------------------------------------
    def _candidates(self, session_key: str | None, group_key: str | None = None):
        """Engines to try for one call, in order, each at most once, up to ``max_attempts``."""
        tried: set[str] = set()
        for _ in range(self.config.max_attempts):
            try:
                eng = self.pick(session_key, exclude=tried, group_key=group_key)
            except NoEngineAvailable:
                return
            tried.add(eng.url)
            yield eng

    async def generate(self, input_ids: list[int], sampling_params: dict, session_key: str | None = None,
                       return_logprob: bool = True, return_routed_experts: bool = False,
                       group_key: str | None = None, top_logprobs_num: int = 0,
                       image_data: list[str] | None = None, lora_path: str | None = None) -> GenerateResult:
        errors = []
        for eng in self._candidates(session_key, group_key):
            self._busy(eng, 1)
            try:
                result = await eng.client.generate(input_ids, sampling_params, return_logprob,
                                                   return_routed_experts=return_routed_experts,
                                                   top_logprobs_num=top_logprobs_num, image_data=image_data,
                                                   lora_path=lora_path)
                eng.served += 1
                return result
            except EngineError as exc:
                errors.append(str(exc))
                self.mark_down(eng.url)
            except EngineRequestError as exc:
                if not _lacks_adapter(exc, lora_path):
                    raise
                errors.append(str(exc))  # (not marked down: it serves the rest; the next sync loads the adapter)
            finally:
                self._busy(eng, -1)
        raise NoEngineAvailable(f"generate failed on every engine tried: {errors or 'no live engine'}")

    async def generate_stream(self, input_ids: list[int], sampling_params: dict, session_key: str | None = None,
                              return_logprob: bool = True, return_routed_experts: bool = False,
                              group_key: str | None = None, top_logprobs_num: int = 0,
                              image_data: list[str] | None = None,
                              lora_path: str | None = None) -> AsyncIterator[GenerateResult]:
        """Stream from one engine; fail over only while nothing has been yielded yet."""
        errors = []
        for eng in self._candidates(session_key, group_key):
            self._busy(eng, 1)
            yielded = False
            try:
                async for partial in eng.client.generate_stream(input_ids, sampling_params, return_logprob,
                                                                return_routed_experts=return_routed_experts,
                                                                top_logprobs_num=top_logprobs_num,
                                                                image_data=image_data, lora_path=lora_path):
                    yielded = True
                    yield partial
                eng.served += 1
                return
            except EngineError as exc:
                errors.append(str(exc))
                self.mark_down(eng.url)
                if yielded:
                    raise
            except EngineRequestError as exc:
                if yielded or not _lacks_adapter(exc, lora_path):
                    raise
                errors.append(str(exc))
            finally:
                self._busy(eng, -1)
        raise NoEngineAvailable(f"generate failed on every engine tried: {errors or 'no live engine'}")

    # --- health and control -----------------------------------------------------------------------------------
    async def check_health(self) -> list[str]:
        """Probe every engine, mark it up or down; return the live urls."""
        oks = await asyncio.gather(*(e.client.health() for e in self.engines))
        for e, ok in zip(self.engines, oks):
            if ok:
                e.up = True
            elif e.up:
                self.mark_down(e.url)
        return self.live_urls

    def start_health_loop(self) -> None:
        if self._health_task is None:
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self.check_health()

    async def broadcast(self, method: str, *args, **kwargs) -> dict[str, object]:
        """Call ``SGLangClient.<method>`` on every live engine concurrently; return {url: result or exception}."""
        live = [e for e in self.engines if e.up]
        results = await asyncio.gather(*(getattr(e.client, method)(*args, **kwargs) for e in live),
                                       return_exceptions=True)
        return {e.url: r for e, r in zip(live, results)}

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            self._health_task = None
        await asyncio.gather(*(e.client.close() for e in self.engines))

