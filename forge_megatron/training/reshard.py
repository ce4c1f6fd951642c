"""Resume a trainer checkpoint under another parallel layout (TP, PP, virtual pipeline, EP, expert TP; DP and CP
hold replicas): the model, the Adam moments, the fp32 master weights and the step count of every parameter, the LR
schedule and the run's position, exactly as if the run had continued in its old layout.

Each rank's checkpoint file keeps, next to Megatron's index-keyed optimizer state, ``param_states``: the same state
tensors keyed by ``"<chunk>:<parameter name>"`` (torch.save stores a storage once, so this costs no space). On
resume, every rank of the new layout builds its own shard of each tensor it holds: the checkpoint's shards of that
canonical tensor (global layer and expert numbers) are read from the memory-mapped rank files of the old layout,
joined over its TP ranks and split for the new one with the bridge's rules, one tensor at a time, the same
rearrangements ``forge-convert reshard`` applies to weights (moments and master weights have their parameter's
shape and split the same way). A tied output layer on the last stage (its own copy of the embedding, whose
gradients Megatron keeps equal to the embedding's) takes the embedding's state.

The fp32 masters of ``--bf16`` runs are restored the same way but untested (Megatron's bf16 optimizer does not
build on CPU, and a layout change needs two GPUs). Not covered: Megatron's distributed optimizer (its state is
sharded by bucket offsets, not by parameter; resume it in its own layout, or export with ``forge-convert
trainer-to-hf`` and start from the HF weights), and checkpoints written before ``param_states`` existed
(2026-12-01).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from forge_megatron.bridge import Bridge, ParallelLayout

KINDS = ("exp_avg", "exp_avg_sq")


def _param_rows(model_chunks, optimizer):
    """(chunk index, local name, inner torch optimizer, stepped param q, model param p) of every parameter the
    optimizer steps: q is the fp32 master copy of a half-precision p (Megatron's Float16 optimizer), else p."""
    from forge_megatron.weight_sync.gather import unwrap

    names = {}
    for v, chunk in enumerate(model_chunks):
        for name, p in unwrap(chunk).named_parameters():
            names[id(p)] = (v, name)
    rows = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        masters = {id(q): p for model_group, main_group in zip(getattr(opt, "float16_groups", []),
                                                               getattr(opt, "fp32_from_float16_groups", []))
                   for p, q in zip(model_group, main_group)}
        for group in opt.optimizer.param_groups:
            for q in group["params"]:
                p = masters.get(id(q), q)
                v, name = names[id(p)]
                rows.append((v, name, opt.optimizer, q, p))
    return rows


def param_states(model_chunks, optimizer) -> dict[str, dict]:
    """``"<chunk>:<name>"`` -> {exp_avg, exp_avg_sq, step, main (the fp32 master of a half-precision parameter)}:
    the live tensors (no copies) of every parameter with optimizer state."""
    out = {}
    for v, name, inner, q, p in _param_rows(model_chunks, optimizer):
        state = inner.state.get(q)
        if not state:
            continue  # no step taken yet
        entry = {k: state[k] for k in (*KINDS, "step") if k in state}
        if q is not p:
            entry["main"] = q
        out[f"{v}:{name}"] = entry
    return out


class _Source:
    """The old layout's rank files (memory-mapped), asked for canonical tensors one at a time."""

    def __init__(self, root: str, iteration: int, metas: list[dict], bridge: Bridge):
        from forge_megatron.convert.trainer_checkpoint import saved_job

        self.it_dir = os.path.join(root, f"iter_{iteration:07d}")
        self.bridge = bridge
        job = saved_job(metas, bridge)
        self.layout, self.P, self.V, self.per_chunk, self.owner = job.layout, job.P, job.V, job.per_chunk, job.owner
        self.files: dict[int, dict] = {}
        self.weights: dict[int, list[dict]] = {}  # rank -> its model chunks, wrapper prefixes gone

    def state(self, rank: int) -> dict:
        if rank not in self.files:
            path = os.path.join(self.it_dir, f"rank_{rank:05d}.pt")
            self.files[rank] = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
            if "param_states" not in self.files[rank] and self.files[rank].get("optimizer") is not None:
                raise ValueError(f"{path} has no per-parameter optimizer state (written before 2026-12-01, or with "
                                 "--use-distributed-optimizer): resume it in the layout it was saved in")
        return self.files[rank]

    def chunk_weights(self, rank: int, v: int) -> dict:
        from forge_megatron.convert.trainer_checkpoint import model_chunks

        if rank not in self.weights:
            self.weights[rank] = model_chunks(self.state(rank))
        return self.weights[rank][v]

    def _piece(self, name: str) -> tuple[int, int, range]:
        """(pipeline rank, virtual chunk, its global layers) of the piece holding canonical ``name``."""
        from forge_megatron.convert.checkpoint import EMBEDDING

        _, idx = self.bridge.rule(name)
        if idx:
            c = idx["layer"] // self.per_chunk
        else:
            c = 0 if name == EMBEDDING else self.P * self.V - 1
        v, p = divmod(c, self.P)
        return p, v, range(c * self.per_chunk, (c + 1) * self.per_chunk)

    def full(self, name: str, kind: str) -> torch.Tensor:
        """Canonical tensor ``name``: the weight (``kind`` "weight") or its optimizer state ``kind``, joined over
        the old layout's TP ranks."""
        b, pl = self.bridge, self.layout
        p, v, layers = self._piece(name)
        owner_ep = b.expert_rank(name, pl)
        by_tp: dict[int, torch.Tensor] = {}
        for ep in ([owner_ep] if owner_ep is not None else range(pl.ep)):
            local = b.rename(name, -layers.start, -ep * b.local_experts(pl))
            for tp in range(pl.tp):
                rank = self.owner.get((tp, p, ep))
                if tp in by_tp or rank is None:
                    continue
                state = self.state(rank)
                if kind == "weight":
                    found = self.chunk_weights(rank, v).get(local)
                else:
                    found = state["param_states"].get(f"{v}:{local}", {}).get(kind)
                if found is not None:
                    by_tp[tp] = found
        if pl.expert_tp == 1 and b.is_expert(name) and by_tp:
            return next(iter(by_tp.values()))
        missing = [tp for tp in range(pl.tp) if tp not in by_tp]
        if missing:
            raise ValueError(f"{self.it_dir}: no {kind} of {name} on TP rank(s) {missing} (pipeline rank {p}, "
                             f"chunk {v})")
        return b.tp_join(name, [by_tp[tp] for tp in range(pl.tp)])


class _Lazy(Mapping):
    """Canonical weights read on demand: ``piece_state`` takes one at a time and keeps only this rank's shard."""

    def __init__(self, read):
        self.read = read

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read(name)

    def __iter__(self):
        raise TypeError("read one canonical tensor at a time")

    def __len__(self) -> int:
        raise TypeError("read one canonical tensor at a time")


def load_resharded(root: str, iteration: int, model_chunks, optimizer, scheduler, metas: list[dict]) -> dict:
    """Fill this rank's model, optimizer and scheduler from checkpoint ``iteration`` saved under another layout
    (``metas``: its rank_*.json); returns the saved run state of its rank 0 (iteration, policy version, ...)."""
    from megatron.core import parallel_state as ps

    from forge_megatron.convert.checkpoint import EMBEDDING, TIED_HEAD, piece_state
    from forge_megatron.training.checkpoint import has_sharded_param_state
    from forge_megatron.weight_sync.gather import global_layers, unwrap

    if has_sharded_param_state(optimizer):
        raise ValueError("resuming under another parallel layout needs per-parameter optimizer state, which "
                         "Megatron's distributed optimizer does not keep: resume without --use-distributed-optimizer "
                         "in the new layout, or in the checkpoint's own layout")
    if "hf_config" not in metas[0]:
        raise ValueError("the checkpoint's rank_*.json has no hf_config: resume it in the layout it was saved in")
    bridge = Bridge(metas[0]["hf_config"])
    src = _Source(root, iteration, metas, bridge)
    here = ParallelLayout(ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                          ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size())
    bridge.check_layout(here)
    tp, ep = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    expert_offset = ep * bridge.local_experts(here)

    def canonical(local: str, layers: range) -> str:
        return EMBEDDING if local == TIED_HEAD and bridge.cfg.tie_word_embeddings else \
            bridge.rename(local, layers.start, expert_offset)

    def local_shard(name: str, local: str, full: torch.Tensor) -> torch.Tensor:
        if local == TIED_HEAD and bridge.cfg.tie_word_embeddings:
            return full.chunk(here.tp, dim=0)[tp]
        return bridge.shard(name, full, here, tp)

    pieces = []
    for chunk in model_chunks:  # the weights (and buffers: routers' expert biases), as load_hf_weights fills them
        gpt = unwrap(chunk)
        layers, first, last = global_layers(gpt), gpt.pre_process, gpt.post_process
        pieces.append(layers)
        weights = _Lazy(lambda name: src.full(name, "weight"))
        missing, unexpected = gpt.load_state_dict(piece_state(bridge, weights, here, tp, ep, layers, first, last),
                                                  strict=False)
        missing = [m for m in missing if not m.endswith("_extra_state")]
        unexpected = [u for u in unexpected if not u.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"checkpoint {src.it_dir} does not fit the model: missing {missing[:5]}, unexpected "
                             f"{unexpected[:5]}")
    rank0 = src.state(src.owner[(0, 0, 0)])
    scheduler.load_state_dict(rank0["scheduler"])
    saved = rank0["param_states"]
    if not saved:
        return rank0  # saved before the first step: no optimizer state yet
    step = next(iter(saved.values()))["step"]  # every parameter is stepped together
    for v, local, inner, q, p in _param_rows(model_chunks, optimizer):
        name = canonical(local, pieces[v])
        with torch.no_grad():
            if q is not p:  # the fp32 master of a half-precision parameter
                q.copy_(local_shard(name, local, src.full(name, "main")))
            state = {k: local_shard(name, local, src.full(name, k)).to(q.dtype).clone() for k in KINDS}
        inner.state[q] = {"step": step.clone(), **state}
    return rank0
