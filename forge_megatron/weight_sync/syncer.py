"""Push a trainer's weights to the rollout engines: the sync protocol the trainer calls after an optimizer step.

    syncer = WeightSyncer(WeightSyncConfig(engine_urls=[...], transport="distributed"), hf_config_or_bridge)
    report = syncer.sync(model_chunks, policy_version)     # collective over all trainer ranks
    syncer.close()

Protocol (global rank 0 drives it; every rank takes part in the gathers):
  1. engines in service = configured engines minus excluded ones, plus excluded ones that answer ``/health`` again
     (they get the full weights like everyone else: that is their re-sync);
  2. gateway ``POST /forge/admin/pause`` (when ``gateway_url`` is set); every engine ``POST /pause_generation``
     then ``POST /flush_cache``;
  3. send every parameter: each pipeline stage's lead sends its own stage's tensors (non-expert buckets, then expert
     buckets) over its own weight-update group (or writes its own files), stage after stage, while rank 0 announces
     each bucket to the engines (see :mod:`transport`); nothing is relayed through rank 0;
  4. an engine that fails in 2 is excluded and resumed at once (no weight reached it: it goes on serving the previous
     version, tagged as such); one that fails in 3 is excluded and left paused (it serves nothing with
     half-updated weights); the send is repeated from the start for the engines still in service, up to
     ``max_attempts`` passes;
  5. ``POST /continue_generation`` on the updated engines, gateway ``POST /forge/admin/resume {policy_version}``.

The policy version becomes ``policy_version`` only if every engine in service ended with the full new weights;
:class:`SyncReport` says which engines were updated and which are excluded.

A LoRA run can instead send its adapters alone (``lora="adapter"``; :mod:`adapters`): no pause, a few MB per sync.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from forge_megatron.bridge import Bridge
from forge_megatron.weight_sync.adapters import AdapterSync
from forge_megatron.weight_sync import buckets as bk
from forge_megatron.weight_sync.fp8 import Fp8Config
from forge_megatron.weight_sync.int4 import Int4Config
from forge_megatron.weight_sync.gather import is_stage_lead, iter_stage_buckets
from forge_megatron.weight_sync.transport import (
    DiskTransport, DistributedTransport, EngineFailure, EngineHTTP, LocalLink, RemoteLink, StageSender, serve_stage,
)

log = logging.getLogger("forge.weight_sync")

TRANSPORTS = ("distributed", "disk")
PAUSE_MODES = ("abort", "in_place", "retract")
LORA_SYNCS = ("merged", "adapter")


@dataclass
class WeightSyncConfig:
    """How weights reach the engines; the same on every rank. ``engine_urls`` and the HTTP settings are used on
    global rank 0 (the stage leads read the first URL to find their route to the engines)."""

    engine_urls: list[str]
    transport: str = "distributed"  # "distributed" (process-group broadcast) | "disk" (safetensors on shared disk)
    bucket_bytes: int = 512 << 20  # tensors per engine request, by bytes
    disk_dir: str | None = None  # transport="disk": a directory every engine can read
    gateway_url: str | None = None  # paused/resumed around the sync when set
    gateway_token: str | None = None  # the gateway's admin token, if it has one
    master_addr: str = "127.0.0.1"  # where stage leads host their weight-update groups (reachable by engines);
    # a lead that cannot listen on it (another node) uses the address it routes to the engines through
    master_port: int | None = None  # None: a free port per group; else master_port + (k - 1) * PP + s for stage s's
    # group of the k-th generation
    backend: str | None = None  # weight-update group backend; None: "nccl" with CUDA, else "gloo"
    ranks_per_engine: int = 1  # GPUs (TP ranks) of one engine: each joins the group
    pause_mode: str = "abort"  # SGLang /pause_generation mode (the gateway continues aborted calls)
    dtype: str | None = None  # cast before sending ("bfloat16", ...); None: the parameters' dtype
    fp8: Fp8Config | None = None  # engines serve a block-wise FP8 checkpoint: projection weights go as FP8 + scales
    int4: Int4Config | None = None  # engines serve a compressed-tensors int4 checkpoint: its quantized projections
    # go packed with their group scales and shapes
    max_attempts: int = 2  # send passes per sync when engines fail mid-way
    timeout_s: float = 120.0  # HTTP calls and group collectives
    lora: str = "merged"  # a LoRA run's policy: "merged" (W + scaling B A, full weights) | "adapter" (the adapters
    # alone, into disk_dir, loaded by engines serving LoRA: see adapters.py)
    hf_checkpoint: str | None = None  # lora="adapter": the adapters' base_model_name_or_path

    def __post_init__(self):
        if not self.engine_urls or not all(isinstance(u, str) and u.startswith("http") for u in self.engine_urls):
            raise ValueError(f"engine_urls must be a non-empty list of http(s) URLs, got {self.engine_urls!r}")
        if len(set(self.engine_urls)) != len(self.engine_urls):
            raise ValueError(f"engine_urls has duplicates: {self.engine_urls}")
        self.engine_urls = [u.rstrip("/") for u in self.engine_urls]
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.transport == "disk" and not self.disk_dir:
            raise ValueError("transport='disk' needs disk_dir (a directory every engine can read)")
        if self.lora not in LORA_SYNCS:
            raise ValueError(f"lora must be one of {LORA_SYNCS}, got {self.lora!r}")
        if self.lora == "adapter" and not self.disk_dir:
            raise ValueError("lora='adapter' needs disk_dir (a directory the engines read the adapters from)")
        if self.lora == "adapter" and (self.fp8 is not None or self.int4 is not None):
            raise ValueError("lora='adapter' sends no base weights: fp8 / int4 describe how full weights are sent")
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {self.bucket_bytes}")
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {self.pause_mode!r}")
        if self.fp8 is not None and not isinstance(self.fp8, Fp8Config):
            raise ValueError(f"fp8 must be an Fp8Config or None, got {self.fp8!r}")
        if self.int4 is not None and not isinstance(self.int4, Int4Config):
            raise ValueError(f"int4 must be an Int4Config or None, got {self.int4!r}")
        if self.fp8 is not None and self.int4 is not None:
            raise ValueError("fp8 and int4: the engines serve one checkpoint, quantized one way")
        if self.dtype == "float8_e4m3fn":
            raise ValueError("dtype float8_e4m3fn would drop the scales: set fp8=Fp8Config(...) instead")
        floats = sorted(name for name, t in bk.DTYPES.items() if t.is_floating_point)
        if self.dtype is not None and self.dtype not in floats:
            raise ValueError(f"dtype must be one of {floats} or None, got {self.dtype!r}")
        if self.backend is None:
            self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {self.backend!r}")
        if self.ranks_per_engine < 1 or self.max_attempts < 1:
            raise ValueError("ranks_per_engine and max_attempts must be >= 1")


@dataclass
class SyncReport:
    """Outcome of one :meth:`WeightSyncer.sync` (filled on rank 0; other ranks see ``policy_version`` only)."""

    policy_version: int | None  # the version now served by every engine in service (previous one if not synced)
    updated: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    bytes: int = 0  # bytes delivered in the successful pass
    buckets: int = 0
    attempts: int = 0
    seconds: float = 0.0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class WeightSyncer:
    """Sends a Megatron model's weights to SGLang-compatible engines under HF names (see the module docstring)."""

    def __init__(self, config: WeightSyncConfig, hf_config_or_bridge):
        self.cfg = config
        self.bridge = hf_config_or_bridge if isinstance(hf_config_or_bridge, Bridge) else Bridge(hf_config_or_bridge)
        self.dtype = bk.DTYPES[config.dtype] if config.dtype else None
        self.rank = dist.get_rank()
        self.sender = self.leads = self.adapters = None
        self.policy_version: int | None = None
        self.excluded: set[str] = set()
        self.http = self.transport = None
        if config.lora == "adapter":
            if self.rank == 0:
                self.http = EngineHTTP(config.timeout_s, _admin_headers(config))
                self.adapters = AdapterSync(config, self.http, config.hf_checkpoint)
            return
        if is_stage_lead():
            from megatron.core import parallel_state as ps

            self.sender = StageSender(config, ps.get_pipeline_model_parallel_rank(),
                                      ps.get_pipeline_model_parallel_world_size())
            if self.rank == 0:  # rank 0's pipeline: one lead per stage, in stage order
                self.leads = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
        if self.rank == 0:
            self.http = EngineHTTP(config.timeout_s, _admin_headers(config))
            if config.transport == "disk":
                self.transport = DiskTransport(config, self.http, self.bridge.hf_config)
            else:
                self.transport = DistributedTransport(config, self.http)

    # --- the collective entry point -----------------------------------------------------------------------------
    def sync(self, model_chunks, policy_version: int, on_bucket=None) -> SyncReport:
        """Send ``model_chunks`` (this rank's model chunk list) to every engine as ``policy_version``.

        ``on_bucket(index, meta)``, if given, is called on rank 0 after each delivered bucket, with the bucket's
        ``{stage, names, dtypes, shapes}`` (progress/logging).
        """
        chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        report = SyncReport(policy_version=self.policy_version)
        start = time.perf_counter()
        if self.cfg.lora == "adapter":
            tensors, rank, alpha = AdapterSync.gather(self.bridge, chunks)
            if self.rank == 0:
                try:
                    self._adapter_pass(tensors, rank, alpha, policy_version, report)
                except Exception:  # noqa: BLE001 - rank 0 must reach the broadcast the other ranks wait in
                    log.exception("weight sync: the adapter sync of version %s failed", policy_version)
            report.policy_version = self.policy_version = _bcast_version(self.policy_version)
            report.seconds = time.perf_counter() - start
            return report
        live = self._prepare() if self.rank == 0 else []
        while _bcast_flag(bool(live)):
            report.attempts += 1
            ok = self._send_pass(chunks, live, policy_version, report, on_bucket)
            if self.rank == 0 and not ok:
                live = [u for u in live if u not in self.excluded]
            retry = self.rank == 0 and not ok and bool(live) and report.attempts < self.cfg.max_attempts
            if not _bcast_flag(retry):
                break
        if self.rank == 0:
            self._finish(live, policy_version, report)
        report.policy_version = self.policy_version = _bcast_version(self.policy_version)
        report.seconds = time.perf_counter() - start
        return report

    # --- rank 0: protocol steps ----------------------------------------------------------------------------------
    def _prepare(self) -> list[str]:
        self.excluded = set(self.http.unhealthy(self.excluded))
        live = [u for u in self.cfg.engine_urls if u not in self.excluded]
        self._gateway("/forge/admin/pause", {})
        for route, body in (("/pause_generation", {"mode": self.cfg.pause_mode}), ("/flush_cache", None)):
            before = live
            live = self._call_live(live, route, body)
            self._release([u for u in before if u not in live])
        return live

    def _adapter_pass(self, tensors: dict, rank: int, alpha: float, version: int, report: SyncReport) -> None:
        """Rank 0's side of an adapter sync (adapters.py): write, load on the engines in service, tell the gateway,
        retire the old adapters. An error (the directory cannot be written, ...) leaves the policy version as it
        was, logged: training goes on and the next sync tries again."""
        report.attempts = 1
        name, path, size = self.adapters.write(tensors, rank, alpha, version)
        self.excluded = set(self.http.unhealthy(self.excluded))
        live = [u for u in self.cfg.engine_urls if u not in self.excluded]
        updated, failure = self.adapters.deliver(live, name, path) if live else ([], None)
        if failure is not None:
            self._exclude(failure)
            self.adapters.pause(failure.urls)
        if updated:
            self.adapters.resume(updated)  # those it paused after an earlier failure
            self.policy_version = version
            self._gateway("/forge/admin/resume", {"policy_version": version, "lora_name": name})
            self.adapters.retire(updated, name)
            report.updated, report.bytes, report.buckets = updated, size, 1
        report.excluded = sorted(self.excluded)

    def _release(self, urls: list[str]) -> None:
        """Engines that failed before any weight reached them still hold the previous weights whole: let them go on
        serving (best effort; a dead one just fails again). Left paused, a fleet whose only engine failed here would
        produce no rollouts, the trainer would wait for a batch and no later sync would come to re-include it."""
        for url in urls:
            try:
                self.http.call_all([url], "/continue_generation", None)
            except EngineFailure as exc:
                log.warning("weight sync: %s stays paused: %s", url, exc)

    def _call_live(self, live: list[str], route: str, body) -> list[str]:
        try:
            self.http.call_all(live, route, body)
        except EngineFailure as exc:
            self._exclude(exc)
        return [u for u in live if u not in self.excluded]

    def _exclude(self, exc: EngineFailure) -> None:
        log.warning("weight sync: excluding %s", exc)
        self.excluded.update(exc.urls)

    def _finish(self, live: list[str], version: int, report: SyncReport) -> None:
        if report.bytes:  # the last pass reached every engine still in service
            self.policy_version = version
            live = self._call_live(live, "/continue_generation", None)
            report.updated = live
        else:  # out of attempts: whoever holds partial weights stays paused until a later sync succeeds
            self.excluded.update(live)
        self._gateway("/forge/admin/resume", {} if self.policy_version is None else
                      {"policy_version": self.policy_version})
        report.excluded = sorted(self.excluded)

    def _gateway(self, route: str, body: dict) -> None:
        """Tell the gateway (if any); a gateway that does not answer must not stop the sync (engines are paused)."""
        if not self.cfg.gateway_url:
            return
        try:
            self.http.post(self.cfg.gateway_url, route, body)
        except RuntimeError as exc:
            log.warning("weight sync: gateway %s%s failed: %s", self.cfg.gateway_url, route, exc)

    # --- all ranks: one pass over the model ----------------------------------------------------------------------
    def _send_pass(self, chunks, live, version, report, on_bucket) -> bool:
        """Gather and deliver every tensor once; True on rank 0 if every engine in ``live`` got all of them."""
        generation, failure = -1, None
        if self.rank == 0:
            failure = _attempt(live, self.transport.begin, live, version)
            generation = -1 if failure is not None else self.transport.generation
        generation = _bcast_int(generation)
        if generation < 0:  # nothing was sent: every rank skips the pass
            if self.rank == 0:
                self._exclude(failure)
            return self.rank != 0
        driver = _PassDriver(self.transport, live, on_bucket) if self.rank == 0 else None
        lead = self.sender is not None  # only leads send: the others need not quantize
        buckets = iter_stage_buckets(self.bridge, chunks, self.cfg.bucket_bytes, self.dtype,
                                     self.cfg.fp8 if lead else None, self.cfg.int4 if lead else None)
        if self.sender is not None:
            self.sender.run(buckets, LocalLink(driver) if self.rank == 0 else RemoteLink(), generation)
        else:
            for _ in buckets:  # the gathers of this rank's stage
                pass
        if self.rank != 0:
            return True
        for stage, lead in enumerate(self.leads[1:], start=1):
            serve_stage(driver, stage, lead)
        failure = driver.failure or _attempt(live, self.transport.finish)
        if failure is not None:
            self._exclude(failure)
            return False
        report.bytes, report.buckets = driver.bytes, driver.buckets
        return True

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.transport is not None:
            self.transport.close()
            self.http.close()
            self.transport = self.http = None


class _PassDriver:
    """Rank 0's answers to the stage leads during one pass (see :mod:`transport` for the messages): the first
    failure anywhere stops every stage's sending; delivered buckets are counted."""

    def __init__(self, transport, live: list[str], on_bucket=None):
        self.transport, self.live, self.on_bucket = transport, live, on_bucket
        self.failure: EngineFailure | None = None
        self.bytes = self.buckets = 0
        self.announced = None

    def __call__(self, stage: int, msg: dict) -> dict:
        if self.failure is not None:
            return {"go": False}
        try:
            reply = self.transport.handle(stage, msg)
        except EngineFailure as exc:
            self.failure = exc
            return {"go": False}
        except Exception as exc:  # noqa: BLE001 - an engine request that could not even start, a bad message
            self.failure = EngineFailure(self.live, f"{type(exc).__name__}: {exc}")
            return {"go": False}
        if msg["op"] == "bucket":
            self.announced = {"stage": stage, **{k: msg[k] for k in ("names", "dtypes", "shapes")}}
        elif msg["op"] == "delivered":
            self.bytes += bk.meta_bytes(self.announced)
            self.buckets += 1
            if self.on_bucket is not None:
                self.on_bucket(self.buckets - 1, self.announced)
        return reply


def _admin_headers(config: WeightSyncConfig) -> dict:
    return {"X-Forge-Admin-Token": config.gateway_token} if config.gateway_token else {}


def _attempt(live: list[str], fn, *args) -> EngineFailure | None:
    """Run a transport step on rank 0; any error becomes a failure of the engines it concerns (all of ``live`` if it
    does not say), so rank 0 never leaves the collective that the other ranks are in."""
    try:
        fn(*args)
    except EngineFailure as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 - e.g. the group's port is taken; retried with a new group
        return EngineFailure(live, f"{type(exc).__name__}: {exc}")
    return None


def _bcast_flag(flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank of the default group."""
    return bool(_bcast_int(int(flag)))


def _bcast_int(value: int) -> int:
    """Rank 0's ``value`` on every rank of the default group."""
    t = torch.tensor([value], dtype=torch.int64, device=bk.comm_device())
    dist.broadcast(t, src=0)
    return int(t.item())


def _bcast_version(current: int | None) -> int | None:
    value = _bcast_int(-1 if current is None else current)
    return None if value < 0 else value
