"""Deliver buckets of HF-named tensors to SGLang-compatible engines: every pipeline stage sends its own.

Two roles. The *driver* (global rank 0, the only rank that talks HTTP to the engines) decides who takes part and
announces each bucket to the engines; the *sender* of each pipeline stage (its lead: TP, DP and CP rank 0;
:class:`StageSender`) moves that stage's bytes itself, so no stage's weights are relayed through another rank. The
two talk in short JSON messages (:mod:`buckets`: ``send_json``/``recv_json``; on rank 0, for stage 0, plain calls),
one reply per request:

    sender -> driver                    driver's reply            then the sender
    {op: open, addr, port}              {go, name, world}         hosts the stage's group at addr:port
    {op: opened, ok, error}             {go}
    {op: bucket, names, dtypes, shapes} {go[, path]}              broadcasts the tensors / writes the file
    {op: delivered, ok, error}          {go}
    {op: end}                           (none)

``go`` false means the pass has failed somewhere (any stage): the sender stops sending but keeps walking its
parameters, since the other ranks of its stage are in the gathers with it.

Two transports, each a driver half (``begin(urls, version) -> handle(stage, message)* -> finish()``) that the
sender side matches:

- :class:`DistributedTransport`: one process group per pipeline stage between that stage's lead and every engine
  rank, made with ``POST /init_weights_update_group {master_address, master_port, rank_offset, world_size,
  group_name, backend}`` (the lead's own address and port) and built on the lead's side exactly as SGLang builds
  the engines' (``weight_group.custom_group``). SGLang keeps its groups by name, so an engine holds one per stage.
  Group names carry a per-run token (a restarted trainer never asks long-lived engines for a name they already
  hold), the generation (a new set of groups whenever the engines in service change or a group broke) and the
  stage. Per bucket ``POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache}`` to
  every engine while the stage lead broadcasts each tensor, in order (SGLang's protocol); NCCL on GPUs, gloo on
  CPU. ``finish`` sends an empty update carrying ``weight_version``. A bucket is only announced after every engine
  answered ``/health``, so an engine that died between buckets is found before the others start waiting for data.
- :class:`DiskTransport`: every bucket becomes one safetensors file in ``<disk_dir>/policy_<version>/``, written by
  its stage's lead (so ``disk_dir`` must be shared by the trainer's nodes and the engines); rank 0 writes the index
  json and config.json, and ``finish`` calls ``POST /update_weights_from_disk {model_path, weight_version}``.

Failures name the engine: :class:`EngineFailure` carries the URLs that failed.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from forge_megatron.utils.ports import free_port
from forge_megatron.weight_sync.buckets import describe, meta_bytes, recv_json, send_json, wire_view

log = logging.getLogger("forge.weight_sync")


class EngineFailure(RuntimeError):
    """Engines that failed a step of the sync (``urls``), with the reason."""

    def __init__(self, urls, reason: str):
        self.urls = sorted(urls)
        super().__init__(f"engine(s) {self.urls} failed: {reason}")


class EngineHTTP:
    """Blocking JSON calls to engines, fanned out over a thread pool."""

    def __init__(self, timeout_s: float, headers: dict | None = None):
        self.timeout_s = timeout_s
        self.headers = headers or {}
        self.pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="forge-sync-http")

    def post(self, url: str, route: str, body: dict | None = None, timeout_s: float | None = None) -> dict:
        req = urllib.request.Request(url + route, data=json.dumps(body or {}).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **self.headers})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{route} -> HTTP {exc.code}: {exc.read().decode()[:300]}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise RuntimeError(f"{route} -> {exc}") from exc
        out = json.loads(text) if text.strip().startswith("{") else {}
        if out.get("success") is False:
            raise RuntimeError(f"{route} -> {out.get('message')}")
        return out

    def get(self, url: str, route: str, timeout_s: float | None = None) -> dict:
        req = urllib.request.Request(url + route, headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                return json.loads(resp.read().decode())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{route} -> HTTP {exc.code}: {exc.read().decode()[:300]}") from exc
        except (urllib.error.URLError, OSError, json.JSONDecodeError) as exc:
            raise RuntimeError(f"{route} -> {exc}") from exc

    def healthy(self, url: str, timeout_s: float = 5.0) -> bool:
        try:
            with urllib.request.urlopen(url + "/health", timeout=timeout_s) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def unhealthy(self, urls) -> list[str]:
        """The URLs among ``urls`` that do not answer ``/health`` (probed concurrently)."""
        futures = {u: self.pool.submit(self.healthy, u) for u in urls}
        return [u for u, f in futures.items() if not f.result()]

    def submit_all(self, urls, route: str, body_of) -> dict:
        """Start ``POST route`` on every URL (``body_of(i, url)`` gives the body); returns {url: future}."""
        return {u: self.pool.submit(self.post, u, route, body_of(i, u)) for i, u in enumerate(urls)}

    @staticmethod
    def wait_all(futures: dict, what: str) -> None:
        failed = {}
        for url, fut in futures.items():
            try:
                fut.result()
            except Exception as exc:  # noqa: BLE001 - reported with the engine's URL
                failed[url] = str(exc)
        if failed:
            raise EngineFailure(failed, f"{what}: {failed}")

    def call_all(self, urls, route: str, body: dict | None = None) -> None:
        self.wait_all(self.submit_all(urls, route, lambda i, u: body), route)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def bindable(host: str) -> bool:
    """Whether this machine can listen on ``host`` (one of its own addresses or names)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
        return True
    except OSError:
        return False


def advertised_addr(master_addr: str, engine_url: str) -> str:
    """The address a stage lead hosts its weight-update group at: ``master_addr`` when this machine can listen on
    it (a loopback address, or the name/address of this node), else the address of the interface this machine
    routes to the engines through (multi-node trainers: the stage leads live on different nodes). Nothing is sent to
    find it (a UDP socket is only connected)."""
    if bindable(master_addr):
        return master_addr
    host = urlparse(engine_url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def make_group(host: str, port: int, world_size: int, group_name: str, backend: str, timeout_s: float):
    """Host (rank 0) a standalone process group at ``host:port`` that engines join through SGLang's API, built
    exactly as SGLang builds its side (:func:`forge_megatron.rollout.weight_group.custom_group`). (store, group)."""
    from forge_megatron.rollout.weight_group import custom_group

    return custom_group(host, port, 0, world_size, group_name, backend, timeout_s)


class DistributedTransport:
    """Driver half of the broadcast transport (rank 0): the engines' side of every stage's weight-update group."""

    def __init__(self, config, http: EngineHTTP):
        self.cfg = config
        self.http = http
        self.members: tuple[str, ...] = ()
        self.generation = 0
        self.broken = True  # no groups yet
        self.version = None
        self.pending = None  # (route, {url: future}) between a request and its sender's report
        self.run_token = secrets.token_hex(4)  # engines outlive trainer restarts and refuse a group name twice
        self.held: dict[str, set[str]] = {}  # engine -> names of our groups it joined (dropped on a new generation)

    def group_name(self, stage: int) -> str:
        return f"forge_weights_{self.run_token}_{self.generation}_s{stage}"

    def begin(self, urls, version: int) -> int:
        """Start a pass to exactly ``urls``; returns the group generation the stage leads must use (a new one, so
        new groups with new names and ports, whenever the members changed or a group broke)."""
        urls = tuple(urls)
        if urls != self.members or self.broken:
            self._drop_old_groups(urls)
            self.generation += 1
            self.members, self.broken = urls, False
        self.version = version
        return self.generation

    def _drop_old_groups(self, urls) -> None:
        """Ask the engines of the new generation to destroy the groups of ours they still hold
        (``/destroy_weights_update_group {group_name}``, SGLang's route; each group holds communicator memory on
        every engine GPU). Best effort: an engine without the route (older SGLang) just keeps them."""
        for url in urls:
            for name in sorted(self.held.pop(url, ())):
                try:
                    self.http.post(url, "/destroy_weights_update_group", {"group_name": name}, timeout_s=10.0)
                except RuntimeError as exc:
                    log.warning("weight sync: %s kept group %s: %s", url, name, exc)

    def handle(self, stage: int, msg: dict) -> dict:
        """One sender message of stage ``stage``; the reply. Raises :class:`EngineFailure`."""
        try:
            return self._handle(stage, msg)
        except Exception:
            self.broken = True  # a group that saw a failed collective (or a half-made one) is not used again
            raise

    def _handle(self, stage: int, msg: dict) -> dict:
        cfg, op = self.cfg, msg["op"]
        if op == "open":
            name, world = self.group_name(stage), 1 + len(self.members) * cfg.ranks_per_engine
            body = lambda i, u: {"master_address": msg["addr"], "master_port": msg["port"],  # noqa: E731
                                 "rank_offset": 1 + i * cfg.ranks_per_engine, "world_size": world,
                                 "group_name": name, "backend": cfg.backend}
            route = "/init_weights_update_group"
            self.pending = (route, self.http.submit_all(self.members, route, body))
            return {"go": True, "name": name, "world": world}
        if op == "bucket":
            dead = self.http.unhealthy(self.members)
            if dead:
                raise EngineFailure(dead, "not healthy before a bucket")
            body = {"names": msg["names"], "dtypes": msg["dtypes"], "shapes": msg["shapes"],
                    "group_name": self.group_name(stage), "flush_cache": False}
            route = "/update_weights_from_distributed"
            self.pending = (route, self.http.submit_all(self.members, route, lambda i, u: body))
            return {"go": True}
        if op in ("opened", "delivered"):
            (route, futures), self.pending = self.pending, None
            try:
                if not msg["ok"]:
                    failed = [u for u, f in futures.items() if f.done() and f.exception() is not None]
                    raise EngineFailure(failed or self.http.unhealthy(self.members) or self.members,
                                        f"stage {stage}'s lead: {msg['error']}")
                self.http.wait_all(futures, route)
            finally:
                if op == "opened":  # whoever joined holds the group, also when others failed: drop it later
                    for url, f in futures.items():
                        if f.done() and f.exception() is None:
                            self.held.setdefault(url, set()).add(self.group_name(stage))
            return {"go": True}
        raise ValueError(f"unknown weight-sync message {op!r}")

    def finish(self) -> None:
        body = {"names": [], "dtypes": [], "shapes": [], "group_name": self.group_name(0), "flush_cache": True,
                "weight_version": str(self.version)}
        self.http.call_all(self.members, "/update_weights_from_distributed", body)

    def close(self) -> None:
        self.members, self.broken = (), True


class DiskTransport:
    """Driver half of the disk transport (rank 0): names the files, writes the index, asks every engine to load."""

    generation = 0  # no groups

    def __init__(self, config, http: EngineHTTP, hf_config: dict):
        if not config.disk_dir:
            raise ValueError("transport='disk' needs disk_dir (a directory every engine can read)")
        self.cfg = config
        self.http = http
        self.hf_config = hf_config
        self.urls: tuple[str, ...] = ()
        self.dir = None
        self.weight_map: dict[str, str] = {}
        self.total = 0
        self.pending = None

    def begin(self, urls, version: int) -> int:
        self.urls = tuple(urls)
        self.version = version
        self.dir = os.path.join(self.cfg.disk_dir, f"policy_{version}")
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir)
        self.weight_map, self.total, self.files = {}, 0, 0
        return self.generation

    def handle(self, stage: int, msg: dict) -> dict:
        if msg["op"] == "bucket":
            fname = f"bucket-{self.files:05d}.safetensors"
            self.files += 1
            self.pending = (fname, msg["names"], meta_bytes(msg))
            return {"go": True, "path": os.path.join(self.dir, fname)}
        if msg["op"] == "delivered":
            (fname, names, size), self.pending = self.pending, None
            if not msg["ok"]:
                raise EngineFailure(self.urls, f"stage {stage}'s lead could not write {fname}: {msg['error']}")
            self.weight_map.update({n: fname for n in names})
            self.total += size
            return {"go": True}
        raise ValueError(f"unknown weight-sync message {msg['op']!r} for the disk transport")

    def finish(self) -> None:
        with open(os.path.join(self.dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": self.weight_map}, f)
        config = dict(self.hf_config)
        if self.cfg.fp8 is not None:  # the files hold FP8 weights: say so as an FP8 checkpoint does
            config["quantization_config"] = self.cfg.fp8.hf_dict()
        if self.cfg.int4 is not None:  # packed int4 weights: as the served checkpoint says
            config["quantization_config"] = self.cfg.int4.hf_dict()
        with open(os.path.join(self.dir, "config.json"), "w") as f:
            json.dump(config, f)
        self.http.call_all(self.urls, "/update_weights_from_disk",
                           {"model_path": self.dir, "weight_version": str(self.version), "flush_cache": True})
        self._remove_older()

    def _remove_older(self) -> None:
        for name in os.listdir(self.cfg.disk_dir):
            path = os.path.join(self.cfg.disk_dir, name)
            if name.startswith("policy_") and path != self.dir:
                shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        self.urls = ()


# ------------------------------------------------------------------------------------------- the stage leads' side
class LocalLink:
    """Rank 0's own stage talks to the driver by calling it."""

    def __init__(self, driver, stage: int = 0):
        self.driver, self.stage = driver, stage

    def request(self, msg: dict) -> dict:
        return self.driver(self.stage, msg)

    def end(self) -> None:
        pass


class RemoteLink:
    """A stage lead on another rank talks to the driver (global rank 0) point-to-point."""

    def request(self, msg: dict) -> dict:
        send_json(msg, 0)
        return recv_json(0)

    def end(self) -> None:
        send_json({"op": "end"}, 0)


def serve_stage(driver, stage: int, src: int) -> None:
    """Rank 0: answer stage ``stage``'s lead (global rank ``src``) until it ends its pass."""
    while True:
        msg = recv_json(src)
        if msg.get("op") == "end":
            return
        send_json(driver(stage, msg), src)


class StageSender:
    """One pipeline stage's lead: hosts the stage's weight-update group and sends the stage's buckets itself."""

    def __init__(self, config, stage: int, stages: int):
        self.cfg, self.stage, self.stages = config, stage, stages
        self.generation = None
        self.store = self.group = None
        self.addr = None

    def run(self, buckets, link, generation: int) -> None:
        """Send every bucket of ``buckets`` (this stage's, from :func:`gather.iter_stage_buckets`) through the
        driver's protocol; after a refusal or an error, only walk the rest (the stage's gathers go on)."""
        ok = True
        for bucket in buckets:
            if ok and self.cfg.transport == "distributed" and (self.group is None or self.generation != generation):
                ok = self._open(link, generation)
            if ok:
                ok = self._send(link, bucket)
        link.end()

    def _drop_group(self, destroy: bool = True) -> None:
        """Release this lead's side of its group (NCCL communicators hold GPU memory); best effort. A group that
        saw a failed collective is only let go (``destroy=False``): shutting it down could wait on its dead work."""
        if self.group is not None and destroy:
            try:
                dist.destroy_process_group(self.group)
            except Exception as exc:  # noqa: BLE001 - a broken group may refuse; it is dropped either way
                log.debug("weight sync: destroying the old group: %s", exc)
        self.store = self.group = None

    def _open(self, link, generation: int) -> bool:
        cfg = self.cfg
        self._drop_group()
        if self.addr is None:
            self.addr = advertised_addr(cfg.master_addr, cfg.engine_urls[0])
        port = (cfg.master_port + (generation - 1) * self.stages + self.stage if cfg.master_port
                else free_port(self.addr))
        reply = link.request({"op": "open", "addr": self.addr, "port": port})
        if not reply["go"]:
            return False
        status, made = _run(make_group, self.addr, port, reply["world"], reply["name"], cfg.backend, cfg.timeout_s)
        if made is not None:
            (self.store, self.group), self.generation = made, generation
        return link.request({"op": "opened", **status})["go"] and status["ok"]

    def _send(self, link, bucket) -> bool:
        reply = link.request({"op": "bucket", **describe(bucket)})
        if not reply["go"]:
            return False
        status, _ = _run(self._deliver, bucket, reply)
        if not status["ok"]:
            self._drop_group(destroy=False)  # a group that saw a failed collective is not used again
        return link.request({"op": "delivered", **status})["go"] and status["ok"]

    def _deliver(self, bucket, reply: dict) -> bool:
        if self.cfg.transport == "disk":
            save_file({n: t.cpu().contiguous() for n, t in bucket}, reply["path"], metadata={"format": "pt"})
            return True
        device = torch.device("cuda", torch.cuda.current_device()) if self.cfg.backend == "nccl" else None
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for _, t in bucket:
            t = t.contiguous() if device is None else t.to(device).contiguous()
            self.group.broadcast([wire_view(t, self.cfg.backend)], opts).wait()
        return True

    def close(self) -> None:
        self._drop_group()


def _run(fn, *args) -> tuple[dict, object]:
    """(status message, result or None): a sender-side step's outcome, reported to the driver as it is."""
    try:
        return {"ok": True, "error": ""}, fn(*args)
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which excludes engines and retries
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, None
