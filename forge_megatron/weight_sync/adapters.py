"""``--weight-sync-lora adapter``: a LoRA run's policy reaches the engines as an adapter, not as merged weights.

The engines keep the checkpoint's weights and serve the trained adapter beside them (SGLang ``--enable-lora``). A sync
moves a few MB (the adapters) instead of the whole model, and nothing pauses: a call already running finishes with the
adapter it started with, and the gateway names the new one in every call it sends from then on, so each call's tokens
come from one policy version, recorded as such.

Protocol (global rank 0 drives it; every rank takes part in the gathers):
  1. all ranks: each pipeline stage's adapters are gathered over TP on its lead and put in PEFT form (HF module
     names: :func:`forge_megatron.mcore.lora.peft_tensors`); the leads of the other stages send theirs to rank 0,
     which writes ``<dir>/forge-<run>-v<version>/`` (``adapter_config.json`` + ``adapter_model.safetensors``,
     written aside and renamed into place: an engine never reads half an adapter);
  2. engines in service = configured ones minus excluded ones, plus excluded ones that answer ``/health`` again;
     each gets ``POST /load_lora_adapter {lora_name, lora_path}``. One that fails it is excluded and paused (it
     would be asked for an adapter it does not hold); an excluded one that loads it again is continued;
  3. gateway ``POST /forge/admin/resume {policy_version, lora_name}``: calls from now on name the new adapter;
  4. in the background, every engine unloads the older ``forge-*`` adapters it holds but the one the gateway named
     until now (calls may still be starting with it; a newer one, loaded by a sync that overtook this retirement,
     stays); SGLang's unload waits for the calls that use an adapter to finish. Adapter directories other than the
     newest two are removed.

The policy version becomes ``version`` when at least one engine loaded the adapter. Version 0 is the checkpoint
itself (B starts at zero): the engines' base model, no adapter named.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil

import torch.distributed as dist

from forge_megatron.rollout.lora_serving import policy_adapter_name, policy_adapter_version
from forge_megatron.weight_sync import buckets as bk
from forge_megatron.weight_sync.gather import _all_gather, global_layers, is_stage_lead, unwrap
from forge_megatron.weight_sync.transport import EngineFailure

log = logging.getLogger("forge.weight_sync")


def stage_adapters(bridge, chunks) -> tuple[dict, int | None, float | None]:
    """PEFT tensors of this rank's pipeline stage's adapters (complete on the stage lead), with their rank and
    alpha. A collective over the stage's TP group: every rank of the stage must call it."""
    from megatron.core import parallel_state as ps

    from forge_megatron.mcore.lora import COLUMN, joined_factors, peft_tensors

    tp_group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    out, rank, alpha = {}, None, None
    for chunk in chunks:
        model = unwrap(chunk)
        offset = global_layers(model).start
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        for local, A in params.items():
            if not local.endswith(".lora_A"):
                continue
            prefix = local[: -len("lora_A")]
            B, scaling = params[prefix + "lora_B"], float(buffers[prefix + "lora_scaling"])
            weight = bridge.rename(prefix + "weight", offset, 0)
            if bridge.is_expert(weight):
                raise ValueError("--weight-sync-lora adapter: the routed experts' adapters (--lora-target-modules "
                                 "experts) have no PEFT form for the engines to load; use --weight-sync-lora merged")
            A, B = A.detach(), B.detach()
            column = weight.rsplit(".", 2)[-2] in COLUMN  # (only the split factor crosses TP)
            A, B = joined_factors(bridge, weight, [A] if column or tp == 1 else _all_gather(A, tp_group),
                                  [B] if not column or tp == 1 else _all_gather(B, tp_group))
            out.update(peft_tensors(bridge, weight, A.cpu(), B.cpu()))
            rank, alpha = A.shape[0], round(scaling * A.shape[0], 6)
    return out, rank, alpha


class AdapterSync:
    """Rank 0's half of the adapter protocol (see the module docstring); :meth:`gather` is the collective part."""

    def __init__(self, config, http, base_model: str | None):
        self.cfg, self.http, self.base_model = config, http, base_model
        self.run = secrets.token_hex(4)  # this run's adapter names: a restarted trainer never reuses one
        self.current: str | None = None  # the adapter the gateway was last told of
        self.paused: set[str] = set()  # engines this protocol left paused (excluded after a failed load)

    # --- all ranks ----------------------------------------------------------------------------------------------
    @staticmethod
    def gather(bridge, chunks) -> tuple[dict, int | None, float | None]:
        """Every stage's PEFT tensors on global rank 0 (with the rank and alpha); empty elsewhere. Collective."""
        from megatron.core import parallel_state as ps

        tensors, rank, alpha = stage_adapters(bridge, chunks)
        stage = ps.get_pipeline_model_parallel_rank()
        if dist.get_rank() == 0:
            for src in dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())[1:]:
                header = bk.recv_json(src)
                tensors.update(bk.recv_tensors(src))
                rank, alpha = rank or header["rank"], alpha or header["alpha"]
            return tensors, rank, alpha
        if is_stage_lead() and stage > 0:  # (the stage leads are rank 0's pipeline)
            bk.send_json({"rank": rank, "alpha": alpha}, 0)
            bk.send_tensors(tensors, 0)
        return {}, None, None

    # --- rank 0 -------------------------------------------------------------------------------------------------
    def write(self, tensors: dict, rank: int, alpha: float, version: int) -> tuple[str, str, int]:
        """The adapter's directory (name, path, bytes), written aside and renamed into place."""
        from safetensors.torch import save_file

        from forge_megatron.mcore.lora import peft_config

        if not tensors:
            raise ValueError("--weight-sync-lora adapter: the model has no LoRA adapters (--lora-rank)")
        name = policy_adapter_name(self.run, version)
        path = os.path.join(self.cfg.disk_dir, name)
        tmp = path + ".partial"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"))
        with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
            json.dump(peft_config(rank, alpha, tensors, self.base_model), f, indent=2)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        return name, path, sum(bk.nbytes(t) for t in tensors.values())

    def deliver(self, live: list[str], name: str, path: str) -> tuple[list[str], EngineFailure | None]:
        """Load the adapter on ``live``; returns the engines that hold it and the failure of the others."""
        futures = self.http.submit_all(live, "/load_lora_adapter", lambda i, u: {"lora_name": name,
                                                                                 "lora_path": path})
        try:
            self.http.wait_all(futures, "/load_lora_adapter")
            return list(live), None
        except EngineFailure as exc:
            return [u for u in live if u not in exc.urls], exc

    def pause(self, urls) -> None:
        """Engines that hold an older adapter than the gateway will name: they serve nothing until a later sync."""
        for url in urls:
            try:
                self.http.post(url, "/pause_generation", {"mode": self.cfg.pause_mode})
                self.paused.add(url)
            except RuntimeError as exc:
                log.warning("weight sync: could not pause %s after its failed adapter load: %s", url, exc)

    def resume(self, urls) -> None:
        for url in [u for u in urls if u in self.paused]:
            try:
                self.http.post(url, "/continue_generation", {})
                self.paused.discard(url)
            except RuntimeError as exc:
                log.warning("weight sync: %s loaded the adapter but did not continue: %s", url, exc)

    def retire(self, urls: list[str], name: str) -> None:
        """In the background: each engine unloads the policy adapters it holds but ``name`` and the previous one;
        then the directories of all but those two are removed."""
        previous = self.current
        for url in urls:
            fut = self.http.pool.submit(self._unload_stale, url, name, previous)
            fut.add_done_callback(_log_failure(url))
        self.current = name
        entries = [e for e in os.listdir(self.cfg.disk_dir) if policy_adapter_version(e) is not None]
        for entry in entries:
            if entry not in (name, previous or _newest_other(entries, name)):
                shutil.rmtree(os.path.join(self.cfg.disk_dir, entry), ignore_errors=True)

    def _unload_stale(self, url: str, name: str, previous: str | None) -> None:
        """Unload from ``url`` the policy adapters older than ``name`` but ``previous``. Never a newer one: this runs
        in the background, and a slow one may run after the next sync has loaded its adapter."""
        cards = self.http.get(url, "/v1/models").get("data", [])
        held = [c["id"] for c in cards if c.get("parent") and policy_adapter_version(c.get("id")) is not None]
        older = [n for n in held if policy_adapter_version(n) < policy_adapter_version(name)]
        previous = previous or _newest_other(older, name)
        for stale in older:
            if stale != previous:
                self.http.post(url, "/unload_lora_adapter", {"lora_name": stale})


def _newest_other(names, name: str) -> str | None:
    """The first sync of a trainer (``previous`` unknown): a gateway may still name the newest adapter of an earlier
    run of it, so that one stays until the next sync."""
    others = [n for n in names if n != name]
    return max(others, key=policy_adapter_version) if others else None


def _log_failure(url: str):
    def done(fut):
        exc = fut.exception()
        if exc is not None:
            log.warning("weight sync: retiring old LoRA adapters on %s failed: %s", url, exc)
    return done

