"""Trainer checkpoints: one ``torch.save`` file per rank, plus a ``latest`` marker, and HF weight loading.

Megatron's ``dist_checkpointing`` does not run on CPU (see docs/training.md), so forge keeps the format simple and
robust everywhere: ``<save>/iter_<NNNNNNN>/rank_<RRRRR>.pt`` holds this rank's model and optimizer state, the LR
scheduler, the iteration, the policy version and the id of the last data-pool batch trained on. Megatron's distributed
optimizer (``--use-distributed-optimizer``) keeps its fp32 master weights and Adam moments sharded over the
data-parallel ranks outside ``state_dict()``: they are gathered on the data-parallel rank 0 of each optimizer's group
and written there by parameter name (``reshard.sharded_param_states``); without them a resumed run would write stale
masters over the model (checkpoints of before 2026-12-02 hold them in ``rank_<RRRRR>_optim_params.pt``, Megatron's
``save_parameter_state`` format, still read in their own layout). Rank 0 writes
``<save>/latest`` (the iteration) only after every rank has written its file, so a crash mid-save leaves the previous
checkpoint as the one that loads. ``rank_<RRRRR>.json`` records the rank's coordinates in the job and the HF config,
for ``forge-convert trainer-to-hf`` (an offline HF export) and for resuming under another parallel layout: the file
also holds the optimizer state keyed by parameter name (``param_states``), from which
:mod:`forge_megatron.training.reshard` rebuilds every rank's shards when the layout or the optimizer changed.

After a checkpoint is complete the trainer commits the pool's delivered batches up to that batch id; on resume it
asks the pool to re-serve everything delivered but not committed (``requeue_uncommitted``), so no group is lost and
none is trained twice across a restart.

``--async-save`` (:class:`AsyncCheckpointSaver`): the rank's state is copied to host memory at the save (the
collective parts, such as the distributed optimizer's gather, run then) and written by a background thread while
training goes on; after each step the ranks agree (one all-reduce of two flags) whether every rank has written, and
only then is ``latest`` moved and the pool committed, so an unfinished checkpoint is never the one that loads.
``--keep-checkpoints K``: once a checkpoint is ``latest``, rank 0 deletes the iteration directories older than the
newest K.

A ``--lora-rank`` run's rank files hold what training changes only: the adapters (and the model's buffers), not the
frozen weights, which a resume and the HF export read from the run's ``--hf-checkpoint`` again (``frozen_from_hf``;
the checkpoint's ``hf_fingerprint``, :func:`forge_megatron.convert.checkpoint.weights_fingerprint`, must match it):
a few MB per rank instead of the model's size.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections import OrderedDict

import torch
import torch.distributed as dist

LATEST = "latest"


def _iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _rank_file(root: str, iteration: int) -> str:
    return os.path.join(_iter_dir(root, iteration), f"rank_{dist.get_rank():05d}.pt")


def _param_state_file(root: str, iteration: int) -> str:
    return os.path.join(_iter_dir(root, iteration), f"rank_{dist.get_rank():05d}_optim_params.pt")


def has_sharded_param_state(optimizer) -> bool:
    """Whether (any optimizer chained in) ``optimizer`` is Megatron's distributed optimizer."""
    from forge_megatron.training.reshard import is_distributed

    return any(is_distributed(o) for o in getattr(optimizer, "chained_optimizers", [optimizer]))


def _half_params(chunks) -> bool:
    """Whether the model trains half-precision weights (--bf16 / --fp16: the optimizer keeps fp32 masters)."""
    return any(p.dtype in (torch.bfloat16, torch.float16) for c in chunks for p in c.parameters())


def _saved_half(state: dict) -> bool:
    if "half_params" in state:
        return state["half_params"]
    weights = [state["model"]] if "model" in state else state.get("model_chunks", [])  # before 2026-12-02
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16)
               for chunk in weights for t in chunk.values())


def _chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def rank_coordinates() -> dict:
    """This rank's place in the job (what an offline export needs to pick and join the shards)."""
    from megatron.core import parallel_state as ps

    from forge_megatron.mcore.parallel import pipeline_split

    first, last = pipeline_split()
    return {
        "rank": dist.get_rank(), "tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
        "ep": ps.get_expert_model_parallel_rank(), "dp": ps.get_data_parallel_rank(),
        "cp": ps.get_context_parallel_rank(),
        "layout": {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
                   "ep": ps.get_expert_model_parallel_world_size(), "cp": ps.get_context_parallel_world_size(),
                   "dp": ps.get_data_parallel_world_size(),
                   "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
                   "etp": ps.get_expert_tensor_parallel_world_size(),
                   # uneven pipeline stages: the first / last stage's layers (None: every stage alike)
                   "first": first, "last": last},
    }


def layout_changes(saved: dict, here: dict) -> str:
    """What differs between the layout a checkpoint was saved under and this job's ("tp 2 -> 1, pp 1 -> 2"; ""
    when nothing does: then the rank files fit as they are)."""
    saved = {**saved, "etp": saved.get("etp", saved["tp"])}  # written before expert TP was recorded: TP
    return ", ".join(f"{k} {saved.get(k)} -> {here[k]}" for k in here if saved.get(k) != here[k])


def checkpoint_state(iteration: int, model, optimizer, scheduler, extra: dict) -> dict:
    """This rank's checkpoint (``model``: the model or its list of virtual-pipeline chunks) as one dict of live
    tensors. A collective with the distributed optimizer (its state is gathered)."""
    chunks = _chunks(model)
    lora = is_lora_run(chunks)  # the frozen weights stay out: the run's --hf-checkpoint holds them
    states = [_trained_state(c) if lora else c.state_dict() for c in chunks]
    weights = {"model": states[0]} if len(chunks) == 1 else {"model_chunks": states}  # virtual-pipeline chunks
    state = {"iteration": iteration, **weights, "frozen_from_hf": lora, "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "world_size": dist.get_world_size(), **extra}
    from forge_megatron.training.reshard import param_states, sharded_param_states

    # the optimizer state by parameter name (resume in this layout or another, with either optimizer); the
    # distributed optimizer's gathered on each data-parallel group's rank 0 (a collective)
    sharded = has_sharded_param_state(optimizer)
    state["param_states"] = (sharded_param_states if sharded else param_states)(chunks, optimizer)
    state["sharded_optimizer"] = sharded
    state["half_params"] = _half_params(chunks)
    return state


def is_lora_run(chunks) -> bool:
    from forge_megatron.mcore.lora import is_lora_name

    return any(is_lora_name(n) for c in _chunks(chunks) for n, _ in c.named_parameters())


def _gpt(chunk):
    """The GPTModel inside a chunk's DDP / Float16Module wrappers (whose state_dict is the GPTModel's own)."""
    from forge_megatron.weight_sync.gather import unwrap

    return unwrap(chunk)


def _frozen(chunk) -> set[str]:
    """State-dict names of ``chunk``'s parameters that do not train."""
    return {n for n, p in _gpt(chunk).named_parameters() if not p.requires_grad}


def _trained_state(chunk) -> dict:
    """``chunk.state_dict()`` without its frozen parameters (buffers kept: a router's bias may move)."""
    frozen = _frozen(chunk)
    return OrderedDict((k, v) for k, v in _gpt(chunk).state_dict().items() if k not in frozen)


def _write_whole(path: str, write) -> None:
    """``write(file)`` into ``path`` whole or not at all: a temporary file, flushed to the storage (fsync: ``latest``
    must never name files a node crash could still lose from the page cache), then renamed."""
    with open(path + ".tmp", "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def write_rank_files(root: str, iteration: int, rank: int, state: dict, meta: dict) -> None:
    """``rank_<R>.json`` (``meta``: the rank's coordinates and what the trainer adds) and ``rank_<R>.pt`` (``state``),
    each written whole or not at all (:func:`_write_whole`). No collectives: safe in a background thread."""
    path = os.path.join(_iter_dir(root, iteration), f"rank_{rank:05d}.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _write_whole(path[:-len(".pt")] + ".json", lambda f: f.write(json.dumps(meta).encode()))
    _write_whole(path, lambda f: torch.save(state, f))


def publish_checkpoint(root: str, iteration: int, keep: int | None = None) -> list[int]:
    """Every rank has written ``iteration``: rank 0 moves ``latest`` to it and, with ``keep``, deletes the older
    checkpoints beyond the newest ``keep`` (:func:`prune_checkpoints`; what it deleted is returned on rank 0).
    A collective (barriers before and after)."""
    dist.barrier()
    removed = []
    if dist.get_rank() == 0:
        _write_whole(os.path.join(root, LATEST), lambda f: f.write(str(iteration).encode()))
        if keep is not None:
            removed = prune_checkpoints(root, keep)
    dist.barrier()
    return removed


def saved_iterations(root: str) -> list[int]:
    """The iterations with a directory under ``root`` (complete or not), in increasing order."""
    if not os.path.isdir(root):
        return []
    return sorted(int(d[len("iter_"):]) for d in os.listdir(root)
                  if d.startswith("iter_") and d[len("iter_"):].isdigit())


def prune_checkpoints(root: str, keep: int) -> list[int]:
    """Delete the iteration directories under ``root`` older than the newest ``keep`` at or before ``latest`` (the
    complete ones, as far as anything older than ``latest`` is); a directory newer than ``latest`` (a save under way or
    cut short) is left alone. Returns the deleted iterations."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    latest = latest_iteration(root)
    if latest is None:
        return []
    done = [i for i in saved_iterations(root) if i <= latest]
    old = done[:-keep]
    for i in old:
        shutil.rmtree(_iter_dir(root, i), ignore_errors=True)
    return old


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, extra: dict,
                    meta: dict | None = None, keep: int | None = None) -> str:
    """Write this rank's state (``model``: the model or its list of virtual-pipeline chunks); rank 0 moves ``latest``
    once all ranks are done (and with ``keep`` removes older checkpoints). Returns the iteration dir.

    Next to ``rank_<R>.pt`` goes ``rank_<R>.json``: the rank's coordinates (:func:`rank_coordinates`) plus ``meta``
    (the trainer adds the HF config and checkpoint path), which ``forge-convert trainer-to-hf`` reads to export the
    weights without loading every rank's optimizer state."""
    state = checkpoint_state(iteration, model, optimizer, scheduler, extra)
    write_rank_files(root, iteration, dist.get_rank(), state,
                     {**rank_coordinates(), "iteration": iteration, **(meta or {})})
    publish_checkpoint(root, iteration, keep)
    return _iter_dir(root, iteration)


def host_copy(obj, memo: dict | None = None):
    """``obj`` (a checkpoint state: dicts, lists, tensors, numbers) with every tensor copied to host memory, so
    training can go on changing the originals while the copy is written. A tensor reached twice is copied once (the
    optimizer's state appears under two keys); a module state dict keeps its ``_metadata``."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:  # a device tensor's move to the host is the copy
            t = obj.detach()
            memo[id(obj)] = t.clone() if t.device.type == "cpu" else t.to("cpu")
        return memo[id(obj)]
    if isinstance(obj, dict):
        out = (OrderedDict if isinstance(obj, OrderedDict) else dict)((k, host_copy(v, memo)) for k, v in obj.items())
        if isinstance(out, OrderedDict) and hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(host_copy(v, memo) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v, memo) for v in obj)
    return obj


class AsyncCheckpointSaver:
    """``--async-save``: :meth:`save` copies this rank's state to host memory (the collectives of the save run then)
    and writes it in a background thread; :meth:`poll`, called by every rank at the same points (after each step, and
    with ``block=True`` before the next save and at the end), publishes the checkpoint once every rank has written it
    (``latest``, retention, then ``on_published``: the trainer's pool commit). A write that fails on any rank fails
    :meth:`poll` on every rank, with the rank and its error."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo")  # the flags' all-reduce stays off the accelerator's backend
        self.pending: dict | None = None

    def save(self, root: str, iteration: int, model, optimizer, scheduler, extra: dict, meta: dict | None = None,
             keep: int | None = None, on_published=None) -> float:
        """Start writing checkpoint ``iteration``; returns the seconds the copy to host memory took."""
        self.poll(block=True)
        t0 = time.perf_counter()
        state = host_copy(checkpoint_state(iteration, model, optimizer, scheduler, extra))
        self.start(root, iteration, state, {**rank_coordinates(), "iteration": iteration, **(meta or {})}, keep,
                   on_published)
        return time.perf_counter() - t0

    def start(self, root: str, iteration: int, state: dict, meta: dict, keep: int | None = None,
              on_published=None) -> None:
        """Write ``state`` (host memory, nothing else will change it) and ``meta`` as this rank's files of checkpoint
        ``iteration`` in a background thread; :meth:`poll` publishes it."""
        if self.pending is not None:
            raise RuntimeError(f"checkpoint iteration {self.pending['iteration']} is still pending: poll(block=True) "
                               "first")
        job = {"root": root, "iteration": iteration, "keep": keep, "on_published": on_published, "error": None}

        def write() -> None:
            try:
                write_rank_files(root, iteration, dist.get_rank(), state, meta)
            except BaseException as exc:  # reported by poll() on every rank
                job["error"] = f"{type(exc).__name__}: {exc}"

        job["thread"] = threading.Thread(target=write, name=f"forge-ckpt-{iteration}", daemon=True)
        job["thread"].start()
        self.pending = job

    def poll(self, block: bool = False) -> int | None:
        """Publish the pending checkpoint if every rank has written it (``block``: wait for this rank's write
        first); returns its iteration when published. A collective while a save is pending."""
        job = self.pending
        if job is None:
            return None
        if block:
            job["thread"].join()
        flags = torch.tensor([int(job["thread"].is_alive()), int(job["error"] is not None)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        if flags[1]:
            self.pending = None
            mine = f"rank {dist.get_rank()}: {job['error']}" if job["error"] else "another rank's write failed"
            raise RuntimeError(f"checkpoint iteration {job['iteration']} could not be written ({mine}); "
                               f"{LATEST} still names the previous checkpoint")
        if flags[0]:
            return None  # a rank is still writing
        self.pending = None
        publish_checkpoint(job["root"], job["iteration"], job["keep"])
        if job["on_published"] is not None:
            job["on_published"]()
        return job["iteration"]


def latest_iteration(root: str | None) -> int | None:
    """Iteration named by ``<root>/latest``, or None when there is no complete checkpoint."""
    if not root:
        return None
    marker = os.path.join(root, LATEST)
    if not os.path.isfile(marker):
        return None
    with open(marker) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ValueError(f"{marker} does not hold an iteration number: {text!r}")
    return int(text)


def saved_meta(root: str, iteration: int) -> dict | None:
    """Rank 0's rank_*.json of checkpoint ``iteration`` (its layout, the trainer's meta; None before those)."""
    meta_path = os.path.join(_iter_dir(root, iteration), "rank_00000.json")
    if not os.path.isfile(meta_path):
        return None
    with open(meta_path) as f:
        return json.load(f)


def saved_layout(root: str, iteration: int) -> dict | None:
    """The parallel layout checkpoint ``iteration`` was saved under (rank 0's rank_*.json; None before those)."""
    meta = saved_meta(root, iteration)
    return None if meta is None else meta["layout"]


def load_checkpoint(root: str, iteration: int, model, optimizer, scheduler, log=None) -> dict:
    """Restore this rank's state; returns the saved dict (iteration, policy_version, last_batch_id, ...). A
    checkpoint saved under another parallel layout is resharded into this one (``reshard.load_resharded``; ``log``
    is told so)."""
    layout = saved_layout(root, iteration)
    differ = layout_changes(layout, rank_coordinates()["layout"]) if layout is not None else ""
    path = _rank_file(root, iteration)
    sharded = has_sharded_param_state(optimizer)
    if not differ and layout is not None and os.path.isfile(path):
        saved = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        saved_sharded = saved["sharded_optimizer"] if "sharded_optimizer" in saved else any(  # before 2026-12-02
            name.endswith("_optim_params.pt") for name in os.listdir(_iter_dir(root, iteration)))
        if saved_sharded != sharded:
            differ = "optimizer " + ("distributed -> not" if saved_sharded else "not -> distributed")
        half = _half_params(_chunks(model))
        if _saved_half(saved) != half:  # the optimizer keeps fp32 masters of half-precision weights, or not
            differ = ", ".join(filter(None, [differ, "weights " + ("fp32 -> half" if half else "half -> fp32")]))
    if differ:
        from forge_megatron.convert.trainer_checkpoint import read_rank_metadata
        from forge_megatron.mcore.lora import is_lora_name
        from forge_megatron.training.reshard import load_resharded

        if any(is_lora_name(n) for c in _chunks(model) for n, _ in c.named_parameters()):
            raise ValueError(f"checkpoint {_iter_dir(root, iteration)} was saved under another layout or optimizer "
                             f"({differ}): a --lora-rank run resumes in its own (or export it with "
                             "forge-convert trainer-to-hf, adapters merged, and start from that)")

        if log is not None:
            what = "with another optimizer or precision" if differ.startswith(("optimizer", "weights")) else \
                "under another parallel layout"
            log(f"checkpoint {_iter_dir(root, iteration)} was saved {what} ({differ}): resharding the model and "
                "optimizer state into this one")
        return load_resharded(root, iteration, _chunks(model), optimizer, scheduler,
                              read_rank_metadata(root, iteration))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path} is missing (was it saved with a different number of ranks?)")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state["world_size"] != dist.get_world_size():
        raise ValueError(f"checkpoint {path} was saved by {state['world_size']} ranks, this job has "
                         f"{dist.get_world_size()}, and it has no rank_*.json to reshard it by: resume with the "
                         "layout it was saved in")
    chunks = _chunks(model)
    saved = [state["model"]] if "model" in state else state["model_chunks"]
    if len(saved) != len(chunks):
        raise ValueError(f"checkpoint {path} holds {len(saved)} model chunk(s), this job has {len(chunks)}: resume "
                         f"with the same virtual-pipeline layout")
    for chunk, weights in zip(chunks, saved):
        if not state.get("frozen_from_hf"):
            chunk.load_state_dict(weights)
            continue
        # a LoRA run's: the adapters; the frozen weights were loaded from --hf-checkpoint (the trainer did so)
        missing, unexpected = _gpt(chunk).load_state_dict(weights, strict=False)
        missing = [k for k in missing if k not in _frozen(chunk) and not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"checkpoint {path} does not fit this model: missing {missing[:5]}, unexpected "
                             f"{unexpected[:5]} (a --lora-rank run resumes with its own --lora-target-modules)")
    optimizer.load_state_dict(state["optimizer"])
    if sharded and "sharded_optimizer" in state:
        from forge_megatron.training.reshard import load_sharded_param_states

        load_sharded_param_states(root, iteration, chunks, optimizer)
    elif sharded:  # written before 2026-12-02: Megatron's own file of the gathered state
        optimizer.load_parameter_state(_param_state_file(root, iteration))
    scheduler.load_state_dict(state["scheduler"])
    return state


def load_hf_weights(model_chunks, bridge, hf_dir: str) -> None:
    """Load a HF safetensors checkpoint into this rank's shard of a live Megatron model (any TP/PP/VPP/EP).

    ``model_chunks`` is the rank's model or its list of virtual-pipeline chunks; each chunk is filled by the layers
    it really holds (its layers' global numbers), with the embedding if it is the first piece of the model and the
    final norm and head if it is the last."""
    from megatron.core import parallel_state as ps

    from forge_megatron.convert.checkpoint import HFReader, job_layout, piece_inputs, piece_state
    from forge_megatron.mcore.lora import is_lora_name
    from forge_megatron.weight_sync.gather import global_layers, unwrap

    from forge_megatron.bridge.mapping import SCORE_HEAD

    layout = job_layout()
    ep = ps.get_expert_model_parallel_rank()
    reader = HFReader(hf_dir)
    for chunk in _chunks(model_chunks):
        gpt = unwrap(chunk)
        layers, first, last = global_layers(gpt), gpt.pre_process, gpt.post_process
        full = {}
        for name in piece_inputs(bridge, layers, first, last):
            owner = bridge.expert_rank(name, layout)
            if owner is not None and owner != ep:
                continue  # another EP rank's expert: never read (MoE checkpoints are mostly experts)
            if name == SCORE_HEAD and "score.weight" not in reader.names():
                full[name] = bridge.initial_score_head()  # a causal LM made a reward model: a new head
                continue
            full[name] = bridge.from_hf(name, reader.get(bridge.hf_names(name)))
        state = piece_state(bridge, full, layout, ps.get_tensor_model_parallel_rank(), ep, layers, first, last)
        missing, unexpected = gpt.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.endswith("_extra_state") and not is_lora_name(m)]  # (adapters keep
        # their initial values: B = 0, the checkpoint's model)
        unexpected = [u for u in unexpected if not u.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"HF checkpoint {hf_dir} does not fit the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
