"""Deliver buckets of HF-named tensors to SGLang-compatible engines (runs on the sending trainer rank only).

Two transports with one interface, ``begin(urls, version) -> send(bucket)* -> finish()``:

- :class:`DistributedTransport`: a process group between the trainer (rank 0) and every engine rank, made with
  ``POST /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name, backend}``
  and built on the trainer's side exactly as SGLang builds the engines' (``weight_group.custom_group``); group names
  carry a per-run token, so a restarted trainer never asks long-lived engines for a name they already hold;
  per bucket ``POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache}`` to every
  engine while the trainer broadcasts each tensor from rank 0, in order (SGLang's protocol); NCCL on GPUs, gloo on
  CPU. ``finish`` sends an empty update carrying ``weight_version``. A bucket is only announced after every engine
  answered ``/health``, so an engine that died between buckets is found before the others start waiting for data.
- :class:`DiskTransport`: every bucket becomes one safetensors file in ``<disk_dir>/policy_<version>/`` (with an index
  json and config.json); ``finish`` calls ``POST /update_weights_from_disk {model_path, weight_version}``.

Failures name the engine: :class:`EngineFailure` carries the URLs that failed.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from forge_megatron.weight_sync.buckets import describe, nbytes


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


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def make_group(host: str, port: int, world_size: int, group_name: str, backend: str, timeout_s: float):
    """Host (rank 0) a standalone process group at ``host:port`` that engines join through SGLang's API, built
    exactly as SGLang builds its side (:func:`forge_megatron.rollout.weight_group.custom_group`). (store, group)."""
    from forge_megatron.rollout.weight_group import custom_group

    return custom_group(host, port, 0, world_size, group_name, backend, timeout_s)


class DistributedTransport:
    """Broadcast from the trainer to the engines over a weight-update process group."""

    def __init__(self, config, http: EngineHTTP):
        self.cfg = config
        self.http = http
        self.members: tuple[str, ...] = ()
        self.group = None
        self.store = None
        self.generation = 0
        self.version = None
        self.run_token = secrets.token_hex(4)  # engines outlive trainer restarts and refuse a group name twice

    @property
    def group_name(self) -> str:
        return f"forge_weights_{self.run_token}_{self.generation}"

    def _open(self, urls: tuple[str, ...]) -> None:
        """(Re)build the group for exactly ``urls`` (a new name and port each time, so stale members cannot join)."""
        self.group = self.store = None
        self.generation += 1
        cfg = self.cfg
        port = cfg.master_port + self.generation - 1 if cfg.master_port else free_port(cfg.master_addr)
        world = 1 + len(urls) * cfg.ranks_per_engine
        body = lambda i, u: {"master_address": cfg.master_addr, "master_port": port,  # noqa: E731
                             "rank_offset": 1 + i * cfg.ranks_per_engine, "world_size": world,
                             "group_name": self.group_name, "backend": cfg.backend}
        futures = self.http.submit_all(urls, "/init_weights_update_group", body)
        self.store, self.group = make_group(cfg.master_addr, port, world, self.group_name, cfg.backend,
                                            cfg.timeout_s)
        self.http.wait_all(futures, "/init_weights_update_group")
        self.members = urls

    def begin(self, urls, version: int) -> None:
        urls = tuple(urls)
        if urls != self.members or self.group is None:
            self._open(urls)
        self.version = version

    def send(self, bucket) -> None:
        dead = self.http.unhealthy(self.members)
        if dead:
            raise EngineFailure(dead, "not healthy before a bucket")
        body = {**describe(bucket), "group_name": self.group_name, "flush_cache": False}
        futures = self.http.submit_all(self.members, "/update_weights_from_distributed", lambda i, u: body)
        device = torch.device("cuda", torch.cuda.current_device()) if self.cfg.backend == "nccl" else None
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            for _, t in bucket:
                t = t.contiguous() if device is None else t.to(device).contiguous()
                self.group.broadcast([t], opts).wait()
        except Exception as exc:  # noqa: BLE001 - the group is unusable after a failed collective
            self.group = None
            raise EngineFailure(self.http.unhealthy(self.members) or self.members,
                                f"broadcast failed: {exc}") from exc
        self.http.wait_all(futures, "/update_weights_from_distributed")

    def finish(self) -> None:
        body = {"names": [], "dtypes": [], "shapes": [], "group_name": self.group_name, "flush_cache": True,
                "weight_version": str(self.version)}
        self.http.call_all(self.members, "/update_weights_from_distributed", body)

    def close(self) -> None:
        self.group = self.store = None
        self.members = ()


class DiskTransport:
    """Write safetensors to shared disk, then ask every engine to load them."""

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

    def begin(self, urls, version: int) -> None:
        self.urls = tuple(urls)
        self.version = version
        self.dir = os.path.join(self.cfg.disk_dir, f"policy_{version}")
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir)
        self.weight_map, self.total = {}, 0

    def send(self, bucket) -> None:
        fname = f"bucket-{len(set(self.weight_map.values())):05d}.safetensors"
        save_file({n: t.cpu().contiguous() for n, t in bucket}, os.path.join(self.dir, fname),
                  metadata={"format": "pt"})
        self.weight_map.update({n: fname for n, _ in bucket})
        self.total += sum(nbytes(t) for _, t in bucket)

    def finish(self) -> None:
        with open(os.path.join(self.dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": self.weight_map}, f)
        with open(os.path.join(self.dir, "config.json"), "w") as f:
            json.dump(self.hf_config, f)
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
