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

The fp32 masters of ``--bf16`` runs are restored the same way. Megatron's distributed optimizer (state sharded
over the data-parallel ranks) keeps the same ``param_states``, whole parameters gathered on each data-parallel
group's rank 0 (:func:`sharded_param_states`); a rank of the new job takes its data-parallel slice of what it would
hold whole, so either optimizer resumes the other's checkpoints, in any layout. Not covered: checkpoints written
before ``param_states`` existed (2026-12-01; the distributed optimizer's before 2026-12-02).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

import torch

from forge_megatron.bridge import Bridge

KINDS = ("exp_avg", "exp_avg_sq")


class _Row(NamedTuple):
    """One parameter the optimizer steps: chunk index ``v`` and local ``name`` of model parameter ``p``; ``opt`` the
    Megatron optimizer (of a chain) holding it, ``inner`` its torch optimizer, ``q`` the tensor ``inner`` steps (the
    fp32 master of a half-precision ``p``, else ``p``; with the distributed optimizer, this data-parallel rank's
    slice ``flat`` of ``p`` flattened)."""

    v: int
    name: str
    opt: object
    inner: torch.optim.Optimizer
    q: torch.Tensor
    p: torch.nn.Parameter
    flat: slice | None


def _names(model_chunks) -> dict[int, tuple[int, str]]:
    from forge_megatron.weight_sync.gather import unwrap

    return {id(p): (v, name) for v, chunk in enumerate(model_chunks) for name, p in unwrap(chunk).named_parameters()}


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def is_distributed(opt) -> bool:
    """Whether Megatron optimizer ``opt`` (one of a chain) is the distributed optimizer (state sharded over DP)."""
    return hasattr(opt, "get_parameter_state_dp_zero")


def owned_grad_slices(optimizer, params) -> list[torch.Tensor] | None:
    """The slices of the reduced gradients (``main_grad``) of ``params`` that this data-parallel rank owns under the
    distributed optimizer (its shard of each; a parameter in no optimizer of the chain has none); None when no
    optimizer of the chain is distributed (every data-parallel rank then holds the whole reduced gradients)."""
    wanted = {id(p) for p in params}
    sharded = [o for o in _sub_optimizers(optimizer) if is_distributed(o)]
    if not sharded:
        return None
    out = []
    for opt in sharded:
        for p, _ in _main_shards(opt):
            if id(p) in wanted:
                span = opt._get_model_param_range_map(p)["param"]
                out.append(p.main_grad.reshape(-1)[span.start:span.end])
    return out


def _main_shards(opt) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(model parameter, the slice of it this data-parallel rank steps: an fp32 view of an fp32 parameter, the fp32
    master of a half-precision one) of distributed optimizer ``opt``. Not through Megatron's
    ``model_param_group_index_map``: when a parameter group mixes fp32 and half-precision parameters (the norms of forge's
    models stay fp32 under --bf16) its group order does not match the optimizer's parameter list (fp32 shards
    first), and Megatron's own ``save_parameter_state`` then copies other parameters' state (megatron-core 0.16)."""
    if opt.config.use_precision_aware_optimizer:
        raise NotImplementedError("checkpoints of the precision-aware distributed optimizer (its masters live in "
                                  "the fused Adam): train without --use-precision-aware-optimizer")
    pairs = []
    for model_groups, main_groups in ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                                      (opt.model_fp32_groups, opt.shard_fp32_groups)):
        for model_group, main_group in zip(model_groups, main_groups):
            pairs += zip(model_group, main_group)
    return pairs


def _param_rows(model_chunks, optimizer) -> list[_Row]:
    names = _names(model_chunks)
    rows = []
    for opt in _sub_optimizers(optimizer):
        if is_distributed(opt):
            for p, q in _main_shards(opt):
                span = opt._get_model_param_range_map(p)["param"]
                rows.append(_Row(*names[id(p)], opt, opt.optimizer, q, p, slice(span.start, span.end)))
            continue
        masters = {id(q): p for model_group, main_group in zip(getattr(opt, "float16_groups", []),
                                                               getattr(opt, "fp32_from_float16_groups", []))
                   for p, q in zip(model_group, main_group)}
        for group in opt.optimizer.param_groups:
            for q in group["params"]:
                p = masters.get(id(q), q)
                rows.append(_Row(*names[id(p)], opt, opt.optimizer, q, p, None))
    return rows


def _half(p: torch.Tensor) -> bool:
    """Whether the optimizer steps an fp32 master copy of ``p`` rather than ``p`` itself."""
    return p.dtype in (torch.float16, torch.bfloat16)


def param_states(model_chunks, optimizer) -> dict[str, dict]:
    """``"<chunk>:<name>"`` -> {exp_avg, exp_avg_sq, step, main (the fp32 master of a half-precision parameter)}:
    the live tensors (no copies) of every parameter with optimizer state (not the distributed optimizer's:
    :func:`sharded_param_states`)."""
    out = {}
    for row in _param_rows(model_chunks, optimizer):
        state = row.inner.state.get(row.q)
        if not state:
            continue  # no step taken yet
        entry = {k: state[k] for k in (*KINDS, "step") if k in state}
        if row.q is not row.p:
            entry["main"] = row.q
        out[f"{row.v}:{row.name}"] = entry
    return out


def _step_of(opt) -> torch.Tensor | None:
    """The Adam step count of Megatron optimizer ``opt`` (kept per parameter by torch's Adam, per group by fused
    ones), as torch's Adam keeps it (a float tensor); None before the first step."""
    for state in opt.optimizer.state.values():
        if "step" in state:
            return torch.as_tensor(state["step"], dtype=torch.float32).detach().clone().cpu()
    for group in opt.optimizer.param_groups:
        if group.get("step"):
            return torch.tensor(float(group["step"]))
    return None


def sharded_param_states(model_chunks, optimizer) -> dict[str, dict]:
    """The distributed optimizer's state as :func:`param_states` gives it, whole parameters (this rank's TP / EP
    shard) by name. Each optimizer of the chain gathers, bucket by bucket, its data-parallel ranks' contiguous
    shards of the master weights and moments on its data-parallel rank 0 (the gather of Megatron's
    ``get_parameter_state_dp_zero``, a collective on every rank; over the gloo group when Megatron made one), which
    returns views of its parameters in the gathered buckets (no copies); the others get ``{}`` for it. Resuming
    reads every rank's slice, in this layout or another, from the holder's file."""
    import torch.distributed as dist

    names = _names(model_chunks)
    out = {}
    for opt in _sub_optimizers(optimizer):
        if not is_distributed(opt):
            continue
        group = getattr(opt, "data_parallel_group_gloo", None) or opt.data_parallel_group
        device = torch.device("cpu") if dist.get_backend(group) == "gloo" else \
            torch.device("cuda", torch.cuda.current_device())
        size, holder, mine = group.size(), dist.get_global_rank(group, 0), group.rank() == 0
        step = _step_of(opt)  # agreed over the group: a rank whose slices are all padding has no state of its own
        agreed = torch.tensor([-1.0 if step is None else float(step)], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        if agreed.item() < 0:
            continue  # no step taken yet
        step = torch.tensor(agreed.item())
        main = dict(_main_shards(opt))
        for index, buffer in enumerate(opt.buffers):
            (bucket_maps,) = opt.gbuf_ranges[index].values()  # one dtype per buffer
            for bucket, ranges in zip(buffer.buckets, bucket_maps):
                local = bucket.grad_data.numel() // size
                shard = torch.zeros(1 + len(KINDS), local, dtype=torch.float32)  # main, exp_avg, exp_avg_sq
                for p, where in ranges["param_map"].items():
                    q, span = main[p], where["gbuf_local"]
                    state = opt.optimizer.state.get(q, {})  # none for a parameter that never had a gradient
                    for row, t in enumerate((q, *(state.get(k) for k in KINDS))):
                        if t is not None:
                            shard[row, span.start:span.end] = t.detach().reshape(-1).float().cpu()
                parts = [torch.empty_like(shard, device=device) for _ in range(size)] if mine else None
                dist.gather(shard.to(device), parts, dst=holder, group=group)
                if not mine:
                    continue
                world = torch.cat([t.cpu() for t in parts], dim=1)  # [3, bucket numel]
                for p in bucket.params_list:
                    start = buffer.param_index_map[p][0] - bucket.offset
                    view = world[:, start:start + p.numel()]
                    v, name = names[id(p)]
                    out[f"{v}:{name}"] = {"exp_avg": view[1].view(p.shape), "exp_avg_sq": view[2].view(p.shape),
                                          "step": step, **({"main": view[0].view(p.shape)} if _half(p) else {})}
    return out


def restore(row: _Row, full, step: torch.Tensor) -> None:
    """Set ``row``'s optimizer state from ``full(kind)`` (``kind`` one of KINDS or "main": the whole tensor of this
    rank's TP / EP shard of the parameter) and the step count; the distributed optimizer takes its slice."""
    def take(t: torch.Tensor) -> torch.Tensor:
        return t if row.flat is None else t.reshape(-1)[row.flat]

    with torch.no_grad():
        if _half(row.p):  # the fp32 master of a half-precision parameter
            row.q.copy_(take(full("main")))
        # the files load on the CPU: the moments go where the parameter is (the first GPU run's resume failed in
        # Adam's foreach kernels, "cuda:0 and cpu"); the step where torch's Adam keeps it (on the device only for
        # its fused or capturable forms)
        state = {k: take(full(k)).to(device=row.q.device, dtype=row.q.dtype, copy=True) for k in KINDS}
    on_device = any(g.get("fused") or g.get("capturable") for g in row.inner.param_groups)
    row.inner.state[row.q] = {"step": step.to(row.q.device if on_device else "cpu", copy=True), **state}
    if not isinstance(row.inner, (torch.optim.Adam, torch.optim.AdamW)):  # fused Adams count steps per group
        for group in row.inner.param_groups:
            group["step"] = int(step)


def load_sharded_param_states(root: str, iteration: int, model_chunks, optimizer) -> None:
    """The distributed optimizer's state in the layout it was saved in: every rank takes its slice of each
    parameter's state from the rank file of its data-parallel group's rank 0 (:func:`sharded_param_states`)."""
    import torch.distributed as dist

    files: dict[int, dict] = {}
    for row in _param_rows(model_chunks, optimizer):
        holder = dist.get_global_rank(row.opt.data_parallel_group, 0)
        if holder not in files:
            path = os.path.join(root, f"iter_{iteration:07d}", f"rank_{holder:05d}.pt")
            files[holder] = torch.load(path, map_location="cpu", weights_only=False, mmap=True)["param_states"]
        entry = files[holder].get(f"{row.v}:{row.name}")
        if entry is None:
            continue  # saved before the first step
        restore(row, entry.__getitem__, entry["step"])


class _Source:
    """The old layout's rank files (memory-mapped), asked for canonical tensors one at a time."""

    def __init__(self, root: str, iteration: int, metas: list[dict], bridge: Bridge):
        from forge_megatron.convert.trainer_checkpoint import saved_job

        self.it_dir = os.path.join(root, f"iter_{iteration:07d}")
        self.bridge = bridge
        job = saved_job(metas, bridge)
        self.job = job
        self.layout, self.P, self.V, self.owner = job.layout, job.P, job.V, job.owner
        self.replicas: dict[tuple[int, int, int], list[int]] = {}  # every rank holding each (TP, PP, EP) shard
        for m in sorted(metas, key=lambda m: m["rank"]):
            self.replicas.setdefault((m["tp"], m["pp"], m["ep"]), []).append(m["rank"])
        self.files: dict[int, dict] = {}
        self.weights: dict[int, list[dict]] = {}  # rank -> its model chunks, wrapper prefixes gone

    def state(self, rank: int) -> dict:
        if rank not in self.files:
            path = os.path.join(self.it_dir, f"rank_{rank:05d}.pt")
            self.files[rank] = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
            if "param_states" not in self.files[rank] and self.files[rank].get("optimizer") is not None:
                raise ValueError(f"{path} has no per-parameter optimizer state (written before 2026-12-01, or with "
                                 "--use-distributed-optimizer before 2026-12-02): resume it in the layout and with "
                                 "the optimizer it was saved with")
        return self.files[rank]

    def optimizer_state(self, coords: tuple[int, int, int], key: str) -> dict | None:
        """The per-parameter optimizer state ``key`` ("<chunk>:<local name>") of the (TP, PP, EP) shard
        ``coords``: any replica's (the distributed optimizer's is on its data-parallel rank 0 only)."""
        for rank in self.replicas.get(coords, []):
            found = self.state(rank)["param_states"].get(key)
            if found is not None:
                return found
        return None

    def _entries(self) -> dict:
        """The per-parameter optimizer states of the first rank file that has any ({} before the first step)."""
        for ranks in self.replicas.values():
            for rank in ranks:
                if self.state(rank)["param_states"]:
                    return self.state(rank)["param_states"]
        return {}

    def step(self) -> torch.Tensor | None:
        """The Adam step count (every parameter is stepped together); None if saved before the first step."""
        return next((entry["step"] for entry in self._entries().values()), None)

    def half(self) -> bool:
        """Whether the run trained half-precision weights (its optimizer kept fp32 masters: ``main``)."""
        rank0 = self.state(self.owner[(0, 0, 0)])
        if "half_params" in rank0:
            return rank0["half_params"]
        return any("main" in entry for entry in self._entries().values())  # before 2026-12-02

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
            c = self.job.piece_of_layer(idx["layer"])
        else:
            c = 0 if name == EMBEDDING else self.P * self.V - 1
        v, p = divmod(c, self.P)
        return p, v, self.job.chunks[c]

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
                if kind == "weight":
                    found = self.chunk_weights(rank, v).get(local)
                else:
                    found = (self.optimizer_state((tp, p, ep), f"{v}:{local}") or {}).get(kind)
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


def load_resharded(root: str, iteration: int, model_chunks, optimizer, scheduler, metas: list[dict],
                   fresh=None) -> dict:
    """Fill this rank's model, optimizer and scheduler from checkpoint ``iteration`` saved under another layout
    (``metas``: its rank_*.json); returns the saved run state of its rank 0 (iteration, policy version, ...).

    ``fresh``: (bridge, weights) for a model with parameters the checkpoint lacks (a trained vision tower, when a
    run saved with it frozen resumes with --train-vision-tower): ``bridge`` names all of this model's parameters,
    ``weights(name)`` gives the full tensor of one the checkpoint lacks (the HF checkpoint's), and its optimizer
    state starts empty (torch's Adam counts its steps from the next one; a fused Adam that counts steps per
    parameter group applies the group's bias correction to its zero moments: a gentler first update)."""
    from megatron.core import parallel_state as ps

    from forge_megatron.convert.checkpoint import EMBEDDING, TIED_HEAD, piece_state
    from forge_megatron.weight_sync.gather import global_layers, unwrap

    if "hf_config" not in metas[0]:
        raise ValueError("the checkpoint's rank_*.json has no hf_config: resume it in the layout it was saved in")
    saved = Bridge(metas[0]["hf_config"], vision_tower=bool(metas[0].get("vision_tower")))
    src = _Source(root, iteration, metas, saved)
    bridge, fresh_weights = fresh if fresh is not None else (saved, None)
    known = set(saved.canonical_names())
    from forge_megatron.convert.checkpoint import job_layout

    here = job_layout()
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

    src_half = src.half()
    masters_to_weights = src_half and not any(_half(p) for c in model_chunks for p in c.parameters())

    def weight(name: str) -> torch.Tensor:
        if name not in known:
            return fresh_weights(name)
        if masters_to_weights:  # an fp32 job from a half-precision run: its fp32 masters, where it kept them
            try:
                return src.full(name, "main")
            except ValueError:  # buffers, fp32 parameters (norms), parameters without optimizer state
                pass
        return src.full(name, "weight")

    def state(name: str, kind: str) -> torch.Tensor:
        if kind == "main" and not src_half:  # a half-precision job from an fp32 run: its weights are the masters
            return src.full(name, "weight").float()
        return src.full(name, kind)

    pieces = []
    for chunk in model_chunks:  # the weights (and buffers: routers' expert biases), as load_hf_weights fills them
        gpt = unwrap(chunk)
        layers, first, last = global_layers(gpt), gpt.pre_process, gpt.post_process
        pieces.append(layers)
        weights = _Lazy(weight)
        missing, unexpected = gpt.load_state_dict(piece_state(bridge, weights, here, tp, ep, layers, first, last),
                                                  strict=False)
        missing = [m for m in missing if not m.endswith("_extra_state")]
        unexpected = [u for u in unexpected if not u.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"checkpoint {src.it_dir} does not fit the model: missing {missing[:5]}, unexpected "
                             f"{unexpected[:5]}")
    rank0 = src.state(src.owner[(0, 0, 0)])
    scheduler.load_state_dict(rank0["scheduler"])
    step = src.step()
    if step is None:
        return rank0  # saved before the first step: no optimizer state yet
    for row in _param_rows(model_chunks, optimizer):
        name = canonical(row.name, pieces[row.v])
        if name not in known:  # no saved state: its master from the weight just loaded, Adam's state made lazily
            if _half(row.p):
                with torch.no_grad():
                    full = local_shard(name, row.name, weight(name)).float()
                    row.q.copy_(full if row.flat is None else full.reshape(-1)[row.flat])
            continue
        restore(row, lambda kind: local_shard(name, row.name, state(name, kind)), step)
    return rank0
