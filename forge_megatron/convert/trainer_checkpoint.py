"""Export a forge trainer checkpoint (``<save>/iter_<N>/rank_<R>.pt``) to a Hugging Face safetensors directory.

The RL run's policy, ready to serve or evaluate, without a GPU or the job's process layout: every rank wrote a
``rank_<R>.json`` next to its ``.pt`` (its TP/PP/EP/DP/CP coordinates, the layout with the virtual-pipeline size,
the HF config and the HF checkpoint the run started from). One shard per (TP, PP, EP) coordinate is opened
(memory-mapped: the optimizer state in the same file is never read), its model chunks are joined piece by piece
(pipeline stage, or virtual-pipeline chunk v of stage p holding layers ``(v * PP + p) * L_c ...``) exactly as
``forge-convert mcore-to-hf`` joins a Megatron checkpoint, and written with the HF names. Tokenizer files are copied
from the run's HF checkpoint when it is still there (or from ``tokenizer_from``).

    forge-convert trainer-to-hf --save-dir runs/x/checkpoints --out models/policy-500 [--iteration 500]
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from dataclasses import dataclass

import torch

from forge_megatron.bridge import Bridge, MappingError, ParallelLayout
from forge_megatron.convert.checkpoint import join_piece, save_hf, vision_tower

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


def _latest(save_dir: str) -> int:
    from forge_megatron.training.checkpoint import latest_iteration

    iteration = latest_iteration(save_dir)
    if iteration is None:
        raise FileNotFoundError(f"{save_dir!r} has no complete trainer checkpoint (no 'latest' marker)")
    return iteration


def read_rank_metadata(save_dir: str, iteration: int) -> list[dict]:
    """The ``rank_<R>.json`` files of one checkpoint, checked to describe one complete job."""
    it_dir = os.path.join(save_dir, f"iter_{iteration:07d}")
    if not os.path.isdir(it_dir):
        raise FileNotFoundError(f"no checkpoint directory {it_dir!r}")
    metas = []
    for path in sorted(glob.glob(os.path.join(it_dir, "rank_*.json"))):
        with open(path) as f:
            metas.append(json.load(f))
    if not metas:
        raise FileNotFoundError(f"{it_dir!r} has no rank_*.json (written by trainers from 2026-11-30 on); an older "
                                f"checkpoint cannot be exported offline: resume it for one step to rewrite it")
    layout = metas[0]["layout"]
    if any(m["layout"] != layout for m in metas):
        raise ValueError(f"{it_dir!r}: the ranks disagree on the parallel layout")
    world = layout["tp"] * layout["pp"] * layout["cp"] * layout["dp"]
    if len(metas) != world:
        raise FileNotFoundError(f"{it_dir!r} holds {len(metas)} rank files, the job had {world} ranks")
    return metas


@dataclass
class SavedJob:
    """How a checkpoint's job split the model: its layout, P pipeline stages of V chunks, the global layers of each
    piece (``chunks[v * P + p]``: chunk v of stage p; uneven first / last stages included), and the lowest rank
    holding each (TP, PP, EP) shard (any data-parallel replica has the same weights)."""

    layout: ParallelLayout
    P: int
    V: int
    chunks: list[range]
    owner: dict[tuple[int, int, int], int]

    def piece_of_layer(self, layer: int) -> int:
        """The piece index c (= v * P + p) holding global ``layer``."""
        return next(c for c, r in enumerate(self.chunks) if layer in r)


def saved_job(metas: list[dict], bridge: Bridge) -> SavedJob:
    from forge_megatron.mcore.parallel import pipeline_chunks

    layout = metas[0]["layout"]
    P, V = layout["pp"], layout.get("vpp", 1)
    chunks = pipeline_chunks(bridge.cfg.num_layers, P, V if V > 1 else None, layout.get("first"), layout.get("last"))
    owner: dict[tuple[int, int, int], int] = {}
    for m in sorted(metas, key=lambda m: m["rank"]):
        owner.setdefault((m["tp"], m["pp"], m["ep"]), m["rank"])
    return SavedJob(ParallelLayout(layout["tp"], P, layout["ep"], layout.get("etp"), layout.get("first"),
                                   layout.get("last")), P, V, chunks, owner)


def model_chunks(state: dict) -> list[dict]:
    """The model chunks of a rank file's state, with the names the GPTModel itself gives its tensors."""
    chunks = [state["model"]] if "model" in state else state["model_chunks"]
    return [{_strip_wrappers(k): v for k, v in chunk.items()} for chunk in chunks]


def _raw_chunks(path: str) -> list[dict]:
    return model_chunks(torch.load(path, map_location="cpu", weights_only=False, mmap=True))


def _model_chunks(path: str, frozen=None) -> list[dict]:
    """A rank file's model chunks as the export writes them: a --lora-rank run's adapters merged into their
    weights (W + scaling * B A, this shard's), so the HF checkpoint is the trained model. A rank file that holds the
    adapters alone (``frozen_from_hf``) gets the frozen weights of chunk v from ``frozen(v)``."""
    from forge_megatron.mcore.lora import merge_state

    state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    chunks = model_chunks(state)
    if state.get("frozen_from_hf"):
        chunks = [{**frozen(v), **chunk} for v, chunk in enumerate(chunks)]
    return [merge_state(c) for c in chunks]


def lora_base(metas: list[dict], hf_checkpoint: str | None = None) -> str:
    """The HF checkpoint a --lora-rank run's adapters-only checkpoint leaves its frozen weights to: ``hf_checkpoint``
    or the run's, checked to hold the weights the run trained over (``weights_fingerprint``)."""
    from forge_megatron.convert.checkpoint import weights_fingerprint

    base = hf_checkpoint or metas[0].get("hf_checkpoint")
    if not base or not os.path.isdir(base):
        raise FileNotFoundError(f"the checkpoint holds a --lora-rank run's adapters alone, and its frozen weights' HF "
                                f"checkpoint {base!r} is not here: give it with --hf-checkpoint")
    saved = metas[0].get("hf_fingerprint")
    here = weights_fingerprint(base) if saved is not None else None
    if here != saved:
        raise ValueError(f"{base!r} holds other weights than the run's --hf-checkpoint "
                         f"{metas[0].get('hf_checkpoint')!r} (weights fingerprint {here}, the run's {saved}): give the "
                         "checkpoint the run trained over")
    return base


def _strip_wrappers(key: str) -> str:
    """DDP and Float16Module each add ``module.`` in front of the GPTModel's own names."""
    while key.startswith("module."):
        key = key[len("module."):]
    return key


def export_trainer_checkpoint(save_dir: str, out_dir: str, iteration: int | None = None,
                              tokenizer_from: str | None = None, max_shard_bytes: int = 5 << 30,
                              vision_from: str | None = None, hf_checkpoint: str | None = None) -> dict:
    """Write the model of trainer checkpoint ``iteration`` (default: the latest) as HF safetensors in ``out_dir``.
    A --lora-rank run's checkpoint holds its adapters alone: the frozen weights come from ``hf_checkpoint`` (default:
    the run's). Returns a summary (iteration, policy version, layout, tensors written, tokenizer source)."""
    iteration = _latest(save_dir) if iteration is None else iteration
    metas = read_rank_metadata(save_dir, iteration)
    layout = metas[0]["layout"]
    if "hf_config" not in metas[0]:
        raise MappingError("the checkpoint's rank_*.json has no hf_config")
    bridge = Bridge(metas[0]["hf_config"], vision_tower=bool(metas[0].get("vision_tower")))
    job = saved_job(metas, bridge)
    pl, P, V, owner = job.layout, job.P, job.V, job.owner
    it_dir = os.path.join(save_dir, f"iter_{iteration:07d}")
    cache: dict[int, list[dict]] = {}
    base = {}  # the frozen weights' reader, for an adapters-only (LoRA) checkpoint, made when first needed

    def frozen(tp: int, pp: int, ep: int):
        def piece(v: int) -> dict:
            from forge_megatron.convert.checkpoint import HFReader, piece_inputs, piece_state

            if "reader" not in base:
                base["reader"] = HFReader(lora_base(metas, hf_checkpoint))
            c = v * P + pp
            layers, first, last = job.chunks[c], c == 0, c == P * V - 1
            full = {n: bridge.from_hf(n, base["reader"].get(bridge.hf_names(n)))
                    for n in piece_inputs(bridge, layers, first, last)
                    if bridge.expert_rank(n, pl) in (None, ep)}  # (another EP rank's experts: never read)
            return piece_state(bridge, full, pl, tp, ep, layers, first, last)
        return piece

    def chunks_of(tp: int, pp: int, ep: int) -> list[dict] | None:
        if (tp, pp, ep) not in owner:
            if pl.expert_tp == 1 and pl.tp > 1:
                return None  # expert TP 1: the EP group spans the TP ranks, so not every pair is a rank
            raise FileNotFoundError(f"{it_dir!r} has no shard for TP {tp}, PP {pp}, EP {ep}")
        rank = owner[(tp, pp, ep)]
        if rank not in cache:
            cache[rank] = _model_chunks(os.path.join(it_dir, f"rank_{rank:05d}.pt"), frozen(tp, pp, ep))
            if len(cache[rank]) != V:
                raise ValueError(f"rank {rank} holds {len(cache[rank])} model chunks, the layout says {V}")
        return cache[rank]

    count = [0]

    def tensors():
        for p in range(P):
            for v in range(V):
                full = join_piece(bridge, pl, lambda tp, ep: (chunks_of(tp, p, ep) or [None] * V)[v],
                                  job.chunks[v * P + p],
                                  p == 0 and v == 0, p == P - 1 and v == V - 1,
                                  f"pipeline rank {p}, chunk {v} of {it_dir!r}")
                for hf_name, hf_t in bridge.export(full.items()):
                    count[0] += 1
                    yield hf_name, hf_t
            cache.clear()  # one stage's shards in memory at a time

    # a vision-language model (Qwen3.5 as released): its vision tower, untouched by RL, from the run's checkpoint
    vision = vision_tower(bridge, vision_from or metas[0].get("hf_checkpoint"))

    def with_vision():
        yield from tensors()
        yield from vision

    save_hf(with_vision(), out_dir, bridge.hf_config, max_shard_bytes)
    source = tokenizer_from or metas[0].get("hf_checkpoint")
    copied = []
    if source and os.path.isdir(source):
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(source, name)):
                shutil.copy2(os.path.join(source, name), os.path.join(out_dir, name))
                copied.append(name)
    elif tokenizer_from:
        raise FileNotFoundError(f"--tokenizer-from {tokenizer_from!r} is not a directory")
    return {"iteration": iteration, "policy_version": metas[0].get("policy_version"), "layout": layout,
            "tensors": count[0], "tokenizer_from": source if copied else None, "tokenizer_files": copied}


def export_lora_adapter(save_dir: str, out_dir: str, iteration: int | None = None) -> dict:
    """Write the LoRA adapters of a ``--lora-rank`` run's checkpoint ``iteration`` (default: the latest) as a PEFT
    adapter (``adapter_config.json`` + ``adapter_model.safetensors``, HF module names) for the run's
    ``--hf-checkpoint``: what PEFT, vLLM and SGLang load beside the base model. A fused Megatron linear becomes HF's
    projections: each keeps the shared A and takes its rows of B (q/k/v, gate/up), so B_hf A = the rows of B A that
    the merged export adds to its weight. Returns a summary (iteration, rank, alpha, modules, tensors)."""
    from safetensors.torch import save_file

    from forge_megatron.mcore.lora import joined_factors, peft_config, peft_tensors

    iteration = _latest(save_dir) if iteration is None else iteration
    metas = read_rank_metadata(save_dir, iteration)
    bridge = Bridge(metas[0]["hf_config"], vision_tower=bool(metas[0].get("vision_tower")))
    job = saved_job(metas, bridge)
    pl, it_dir = job.layout, os.path.join(save_dir, f"iter_{iteration:07d}")
    factors: dict[str, dict[str, dict[int, torch.Tensor]]] = {}  # canonical weight -> A/B/scaling -> TP rank
    for (tp, p, _), rank in sorted(job.owner.items()):  # (non-expert adapters: any EP rank's copy; experts refused)
        for v, chunk in enumerate(_raw_chunks(os.path.join(it_dir, f"rank_{rank:05d}.pt"))):
            layers = job.chunks[v * job.P + p]
            for key, t in chunk.items():
                head, _, leaf = key.rpartition(".")
                if leaf in ("lora_A", "lora_B", "lora_scaling"):
                    weight = bridge.rename(f"{head}.weight", layers.start, 0)
                    if bridge.is_expert(weight):
                        raise ValueError(f"{it_dir!r}: the routed experts' adapters (--lora-target-modules experts) "
                                         "have no PEFT form here (transformers holds a layer's experts in fused "
                                         "tensors): export the merged model with trainer-to-hf")
                    factors.setdefault(weight, {}).setdefault(leaf, {}).setdefault(tp, t)
    if not factors:
        raise ValueError(f"{it_dir!r} holds no LoRA adapters (a run without --lora-rank): use trainer-to-hf")
    tensors, ranks, alphas = {}, set(), set()
    for weight, f in sorted(factors.items()):
        shards = [f[k] for k in ("lora_A", "lora_B")]
        if any(len(s) != pl.tp for s in shards):
            raise MappingError(f"{it_dir!r}: {weight}'s adapter lacks TP shards")
        A, B = joined_factors(bridge, weight, [f["lora_A"][t] for t in range(pl.tp)],
                              [f["lora_B"][t] for t in range(pl.tp)])
        rank, scaling = A.shape[0], float(f["lora_scaling"][0])
        ranks.add(rank)
        alphas.add(round(scaling * rank, 6))
        tensors.update(peft_tensors(bridge, weight, A, B, torch.float32))
    if len(ranks) != 1 or len(alphas) != 1:
        raise ValueError(f"{it_dir!r}: adapters of several ranks or scales ({sorted(ranks)}, alpha {sorted(alphas)})")
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    config = peft_config(ranks.pop(), alphas.pop(), tensors, metas[0].get("hf_checkpoint"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    note = None
    mlp = {"gate_proj", "up_proj", "down_proj", "gate_up_proj"}
    if bridge.cfg.num_moe_experts and set(config["target_modules"]) & mlp:
        note = ("this MoE model's adapters include dense MLP projections, which PEFT (0.21, transformers 5) maps onto "
                "the experts when it loads them: use the merged export (trainer-to-hf) there, or train with "
                "--lora-target-modules limited to attention")
    return {"iteration": iteration, "r": config["r"], "lora_alpha": config["lora_alpha"],
            "target_modules": config["target_modules"], "tensors": len(tensors), "note": note}
