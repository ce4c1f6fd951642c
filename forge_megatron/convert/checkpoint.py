"""Offline checkpoint conversion: HF safetensors <-> Megatron per-rank ``torch`` checkpoints, and resharding.

Conversion runs in one process and computes every rank's shard directly with :class:`forge_megatron.bridge.Bridge`
(no torch.distributed), one pipeline stage at a time, so peak memory is about one stage of the model plus the
shards being written.

Megatron ``torch`` format (what ``megatron.training.checkpointing`` loads with ``--ckpt-format torch``)::

    <dir>/latest_checkpointed_iteration.txt                  "release"
    <dir>/release/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt
        {"model": local state dict, "checkpoint_version": 3.0, "iteration": 0, "forge_bridge": {hf_config, layout}}

The ``_{pp:03d}`` part appears when PP > 1 and ``_{ep:03d}`` when EP > 1, as in Megatron's ``get_checkpoint_name``.
``forge_bridge`` keeps the HF config and layout so the reverse conversion needs nothing else.

HF output: ``model-XXXXX-of-YYYYY.safetensors`` shards of at most ``max_shard_bytes``, ``model.safetensors.index.json``
and ``config.json``.
"""

from __future__ import annotations

import json
import re
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from forge_megatron.bridge import Bridge, MappingError, ParallelLayout

CHECKPOINT_VERSION = 3.0
RELEASE = "release"
TIED_HEAD = "output_layer.weight"
EMBEDDING = "embedding.word_embeddings.weight"


# --- HF side -------------------------------------------------------------------------------------------------
_FUSED_EXPERTS = re.compile(r"\.experts\.[a-z_]+$")  # a tensor of every expert of a layer (gpt-oss)


# Names some checkpoints give tensors transformers holds under another (its loader renames them; the bridge uses
# the second): OLMo Hybrid's linear-attention layers' norms as OLMo-core writes them
NAME_ALIASES = ((".attention_layer_norm.", ".input_layernorm."),
                (".feedforward_layer_norm.", ".post_attention_layernorm."))
# Names read under another prefix when the asked one is absent: Gemma 3's SigLIP tower, released (and served by
# SGLang) as vision_tower.vision_model.*, saved by transformers 5 as vision_tower.*
STORED_PREFIXES = (("vision_tower.vision_model.", "vision_tower."),)


def _canonical_name(name: str) -> str:
    for theirs, ours in NAME_ALIASES:
        if theirs in name:
            return name.replace(theirs, ours)
    return name


def weights_fingerprint(hf_dir: str, sample_bytes: int = 1 << 20) -> str:
    """A cheap identity of a HF checkpoint's weights: sha256 over every ``*.safetensors`` file's header (names,
    dtypes, shapes, offsets) and the first and last ``sample_bytes`` of its data, in file-name order. Two
    checkpoints of one architecture with other weights (a base and its fine-tune) differ in the sampled bytes; the
    whole files are never read (a 235B checkpoint would take minutes)."""
    import hashlib
    import struct

    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{hf_dir!r} has no *.safetensors files")
    digest = hashlib.sha256()
    for fname in files:
        path = os.path.join(hf_dir, fname)
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            digest.update(fname.encode() + f.read(n))
            data = size - 8 - n
            digest.update(f.read(min(sample_bytes, data)))
            if data > sample_bytes:
                f.seek(max(8 + n + sample_bytes, size - sample_bytes))
                digest.update(f.read())
    return digest.hexdigest()[:32]


class HFReader:
    """Lazy reader of the tensors of a HF safetensors directory (single file or sharded with an index).

    Block-wise FP8 checkpoints (``quantization_config.quant_method: fp8`` with ``weight_block_size``: the releases of
    DeepSeek-V3, Kimi-K2, MiniMax-M2, Qwen3-*-FP8) are read dequantized: each float8_e4m3fn weight comes back as
    ``weight * weight_scale_inv`` block by block in the checkpoint's ``torch_dtype`` (bf16 by default) and the scale
    tensors are not listed, so training and conversion start from the published FP8 files (the engines serve them;
    ``--weight-sync-fp8`` quantizes the updates back to the same grid)."""

    def __init__(self, hf_dir: str):
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        else:
            files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"{hf_dir!r} has no *.safetensors files")
            weight_map = {}
            for fname in files:
                with safe_open(os.path.join(hf_dir, fname), "pt") as f:
                    weight_map.update({k: fname for k in f.keys()})
        self.dir = hf_dir
        # by the names the bridge asks for (NAME_ALIASES), each with the name it is stored under
        self.stored = {_canonical_name(n): n for n in weight_map}
        if len(self.stored) != len(weight_map):
            raise ValueError(f"{hf_dir!r} holds some tensors under two names (NAME_ALIASES)")
        self.weight_map = {ours: weight_map[theirs] for ours, theirs in self.stored.items()}
        # The last tensors read: a gpt-oss fused expert tensor is asked for once per expert (each takes its slice)
        self._recent: dict[str, torch.Tensor] = {}
        self.fp8, self.fp8_dtype = _fp8_source(hf_dir)
        # Kimi-K2.5's tower as released (MoonViT's names, a fused wqkv): asked for under transformers' names
        # (model.vision_tower.*, model.mm_projector.*: a trained tower's), derived from the release's on first use
        self._kimi_heads = _kimi_released_tower_heads(hf_dir, self.weight_map)
        self._kimi_tower: dict[str, torch.Tensor] | None = None

    def names(self) -> set[str]:
        """The tensors of the checkpoint (an FP8 checkpoint's scales are part of their weights, not listed)."""
        from forge_megatron.weight_sync.fp8 import SCALE_SUFFIX

        if self.fp8 is None:
            return set(self.weight_map)
        return {n for n in self.weight_map if not n.endswith(SCALE_SUFFIX)}

    def get(self, names) -> dict[str, torch.Tensor]:
        """Load ``names`` (missing ones are left out: the bridge reports them by name); FP8 weights dequantized, their
        scales read in the same pass over the files."""
        from forge_megatron.weight_sync.fp8 import scale_name

        names = list(names)
        scales = [scale_name(n) for n in names if n.endswith("weight")] if self.fp8 is not None else []
        by_file: dict[str, list[str]] = {}
        out = {n: self._recent[n] for n in names if n in self._recent}
        if self._kimi_heads:
            derived = [n for n in names if n not in self.weight_map and n.startswith(_KIMI_TOWER)]
            if derived:
                out.update({n: t for n, t in self._kimi_derived().items() if n in derived})
        for n in names + scales:
            if n in self.weight_map and n not in out:
                by_file.setdefault(self.weight_map[n], []).append(n)
            elif n not in out and (held := self._under_other_prefix(n)) is not None:
                by_file.setdefault(self.weight_map[held], []).append(n)
        for fname, wanted in by_file.items():
            with safe_open(os.path.join(self.dir, fname), "pt") as f:
                out.update({n: f.get_tensor(self.stored[n if n in self.stored else self._under_other_prefix(n)])
                            for n in wanted})
        if self.fp8 is not None:
            out = self._dequantized(out, set(scales) - set(names))
        self._recent = {n: t for n, t in out.items() if _FUSED_EXPERTS.search(n)}
        return out

    def _kimi_derived(self) -> dict[str, torch.Tensor]:
        """Kimi-K2.5's released tower under transformers' names (read once; a tower is small)."""
        if self._kimi_tower is None:
            from forge_megatron.multimodal.families import kimi_k25_tower_state

            released = [n for n in self.weight_map if n.startswith(("vision_tower.", "mm_projector."))]
            tower = kimi_k25_tower_state(self.get(released), self._kimi_heads)
            self._kimi_tower = {"model." + n: t for n, t in tower.items()}
        return self._kimi_tower

    def _under_other_prefix(self, name: str) -> str | None:
        """The name ``name`` is held under (:data:`STORED_PREFIXES`), or None."""
        for asked, held in STORED_PREFIXES:
            if name.startswith(asked) and (other := held + name[len(asked):]) in self.weight_map:
                return other
        return None

    def _dequantized(self, out: dict[str, torch.Tensor], scale_names: set[str]) -> dict[str, torch.Tensor]:
        """``out`` with every float8 weight joined to its scales (loaded with it), the scales themselves left out."""
        from forge_megatron.weight_sync.fp8 import FP8_DTYPE, dequantize, scale_name

        for name, t in out.items():
            if t.dtype != FP8_DTYPE:
                continue
            scale = scale_name(name)
            if scale not in out:
                raise MappingError(f"float8 tensor {name!r} of the FP8 checkpoint {self.dir!r} has no {scale!r}")
            try:
                out[name] = dequantize(t, out[scale], self.fp8.block, self.fp8_dtype)
            except ValueError as exc:
                raise MappingError(f"{name!r} in {self.dir!r}: {exc}") from exc
        return {n: t for n, t in out.items() if n not in scale_names}


_KIMI_TOWER = ("model.vision_tower.", "model.mm_projector.")


def _kimi_released_tower_heads(hf_dir: str, weight_map: dict) -> int:
    """The tower's attention heads of a Kimi-K2.5 checkpoint holding its tower as released (a fused wqkv), else 0."""
    if not any(n.startswith("vision_tower.encoder.blocks.") and ".wqkv." in n for n in weight_map):
        return 0
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        config = json.load(f)
    if config.get("model_type") != "kimi_k25":
        return 0
    return int((config.get("vision_config") or {}).get("num_attention_heads", 16))


def _fp8_source(hf_dir: str):
    """(Fp8Config, dtype to dequantize into) of a block-wise FP8 checkpoint directory, (None, None) otherwise."""
    from forge_megatron.weight_sync.fp8 import Fp8Config

    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        return None, None
    with open(path) as f:
        config = json.load(f)
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        return None, None
    dtype = {"float32": torch.float32, "float16": torch.float16}.get(
        config.get("torch_dtype") or config.get("dtype"), torch.bfloat16)
    return Fp8Config.from_hf(quant), dtype


def save_hf(tensors, out_dir: str, hf_config: dict, max_shard_bytes: int = 5 << 30, total: int | None = None) -> None:
    """Write ``(name, tensor)`` pairs as sharded safetensors with an index json, plus ``config.json``."""
    os.makedirs(out_dir, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tqdm(tensors, desc="tensors", unit="t", total=total, leave=False):
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    weight_map, total_bytes = {}, 0
    for i, shard in enumerate(tqdm(shards, desc="writing shards", unit="file")):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
        total_bytes += sum(t.numel() * t.element_size() for t in shard.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)


# --- Megatron side -------------------------------------------------------------------------------------------
def rank_dir(root: str, layout: ParallelLayout, tp: int, pp: int, ep: int) -> str:
    name = f"mp_rank_{tp:02d}"
    if layout.pp > 1:
        name += f"_{pp:03d}"
    if layout.ep > 1:
        name += f"_{ep:03d}"
    return os.path.join(root, RELEASE, name)


def rank_file(root: str, layout: ParallelLayout, tp: int, pp: int, ep: int) -> str:
    return os.path.join(rank_dir(root, layout, tp, pp, ep), "model_optim_rng.pt")


# multi-latent attention's down projections (plain replicated torch linears in the local spec: mcore/model.py) and
# the DSA indexer's (mcore/dsa.py)
_PLAIN_LINEARS = ("linear_q_down_proj", "linear_kv_down_proj", "linear_wq_b", "linear_wk", "linear_weights_proj")


def _with_extra_state(state: dict) -> dict:
    """Add the ``_extra_state`` entries that Megatron's linear layers put in their state dict (None locally)."""
    out = {}
    for name, t in state.items():
        out[name] = t
        module = name.rsplit(".", 1)[0]
        leaf = module.rsplit(".", 1)[-1]
        if leaf.startswith(("linear_", "output_layer")) and leaf not in _PLAIN_LINEARS:
            out[module + "._extra_state"] = None
    return out


def local_state(bridge: Bridge, full: dict[str, torch.Tensor], layout: ParallelLayout, tp: int, pp: int,
                ep: int) -> dict[str, torch.Tensor]:
    """The local state dict of rank (tp, pp, ep) from the full canonical tensors of stage ``pp``."""
    return piece_state(bridge, full, layout, tp, ep, bridge.stage_layers(layout, pp), pp == 0, pp == layout.pp - 1)


def piece_state(bridge: Bridge, full: dict[str, torch.Tensor], layout: ParallelLayout, tp: int, ep: int,
                layers: range, first: bool, last: bool) -> dict[str, torch.Tensor]:
    """The local state dict of the model piece (a stage or a virtual-pipeline chunk) holding global ``layers``, on
    rank (tp, ep), from the full canonical tensors of :func:`piece_inputs`."""
    expert_offset = ep * bridge.local_experts(layout)
    state = {}
    for name in bridge.piece_names(layers, first, last):
        owner = bridge.expert_rank(name, layout)
        if owner is not None and owner != ep:
            continue
        tensor = full[name]
        local = bridge.rename(name, -layers.start, -expert_offset)
        state[local] = bridge.shard(name, tensor, layout, tp).clone()
    if _tied_head(bridge, first, last):
        state[TIED_HEAD] = full[EMBEDDING].chunk(layout.tp, dim=0)[tp].clone()
    return _with_extra_state(state)


def piece_inputs(bridge: Bridge, layers: range, first: bool, last: bool) -> list[str]:
    """Canonical tensors needed to write a model piece (its own, plus the embedding for a tied head)."""
    names = bridge.piece_names(layers, first, last)
    return names + [EMBEDDING] if _tied_head(bridge, first, last) else names


def _tied_head(bridge: Bridge, first: bool, last: bool) -> bool:
    """With tied embeddings, a last piece that is not also the first keeps its own copy of the embedding as head."""
    return bridge.cfg.tie_word_embeddings and last and not first


def stage_inputs(bridge: Bridge, layout: ParallelLayout, pp: int) -> list[str]:
    """Canonical tensors needed to write stage ``pp`` (its own, plus the embedding for a tied head)."""
    return piece_inputs(bridge, bridge.stage_layers(layout, pp), pp == 0, pp == layout.pp - 1)


def save_rank_state(bridge: Bridge, layout: ParallelLayout, tp: int, pp: int, ep: int, state: dict,
                    out_dir: str) -> None:
    """Write one rank's local model state dict (and the tracker file) in the ``torch`` format."""
    meta = {"hf_config": bridge.hf_config, "layout": layout.as_dict()}
    path = rank_file(out_dir, layout, tp, pp, ep)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"model": state, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0, "forge_bridge": meta}, path)
    _write_tracker(out_dir)


def save_megatron_stage(bridge: Bridge, full: dict, layout: ParallelLayout, pp: int, out_dir: str) -> None:
    for tp in range(layout.tp):
        for ep in range(layout.ep):
            save_rank_state(bridge, layout, tp, pp, ep, local_state(bridge, full, layout, tp, pp, ep), out_dir)


def _write_tracker(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(RELEASE)


def read_meta(mcore_dir: str) -> tuple[Bridge, ParallelLayout]:
    """The bridge and layout recorded in a checkpoint written by this module."""
    release = os.path.join(mcore_dir, RELEASE)
    if not os.path.isdir(release):
        raise FileNotFoundError(f"{mcore_dir!r} is not a Megatron torch checkpoint (no {RELEASE}/ directory)")
    first = sorted(d for d in os.listdir(release) if d.startswith("mp_rank_"))
    if not first:
        raise FileNotFoundError(f"{release!r} has no mp_rank_* directories")
    ckpt = torch.load(os.path.join(release, first[0], "model_optim_rng.pt"), map_location="cpu", weights_only=True)
    meta = ckpt.get("forge_bridge")
    if meta is None:
        raise MappingError(f"{mcore_dir!r} has no 'forge_bridge' metadata; pass --hf-config of the model")
    return Bridge(meta["hf_config"]), ParallelLayout(**meta["layout"])


def load_megatron_stage(bridge: Bridge, mcore_dir: str, layout: ParallelLayout, pp: int,
                        names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Full canonical tensors of stage ``pp``: TP shards joined, experts renamed to global ids; only ``names`` (None:
    all; the rank files are memory-mapped, so the others are never read)."""
    def state(tp: int, ep: int) -> dict | None:
        path = rank_file(mcore_dir, layout, tp, pp, ep)
        if not os.path.isfile(path):
            if layout.expert_tp == 1 and layout.tp > 1:
                return None  # expert TP 1: a job's EP group spans its TP ranks, so not every pair had a rank
            raise FileNotFoundError(f"missing checkpoint file {path!r} for layout {layout}")
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)["model"]

    return join_piece(bridge, layout, state, bridge.stage_layers(layout, pp), pp == 0, pp == layout.pp - 1,
                      f"stage {pp} of {mcore_dir!r}", names)


def join_piece(bridge: Bridge, layout: ParallelLayout, state, layers: range, first: bool, last: bool,
               where: str, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Full canonical tensors of one model piece (a pipeline stage or a virtual-pipeline chunk holding global
    ``layers``) from ``state(tp, ep)``, the local state dict of each of its TP x EP shards (None for a pair no rank
    held: with expert TP 1 the EP group spans the TP ranks): TP shards joined, layers and experts renamed to global
    numbers, checked against the names the piece must hold; only ``names`` are joined (None: all). A dense tensor
    comes from any EP rank's copy of each TP shard, an expert from its own EP rank."""
    per_name: dict[str, dict[int, torch.Tensor]] = {}
    found = set()
    for ep in range(layout.ep):
        for tp in range(layout.tp):
            local_state = state(tp, ep)
            for local, t in (local_state or {}).items():
                if t is None or local.endswith("._extra_state") or local == TIED_HEAD and bridge.cfg.tie_word_embeddings:
                    continue
                name = bridge.rename(local, layers.start, ep * bridge.local_experts(layout))
                found.add(name)
                if names is None or name in names:
                    per_name.setdefault(name, {}).setdefault(tp, t)
    _check_names(set(bridge.piece_names(layers, first, last)), found, where)
    full = {}
    for name, by_tp in per_name.items():
        if layout.expert_tp == 1 and bridge.is_expert(name):
            full[name] = next(iter(by_tp.values()))  # whole on every TP rank of its EP rank
            continue
        missing = [tp for tp in range(layout.tp) if tp not in by_tp]
        if missing:
            raise MappingError(f"{where}: no TP shard {missing} of {name}")
        full[name] = bridge.tp_join(name, [by_tp[tp] for tp in range(layout.tp)])
    return full


def _check_names(expected: set, found: set, where: str) -> None:
    missing, extra = sorted(expected - found), sorted(found - expected)
    if missing:
        raise MappingError(f"{where}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if extra:
        raise MappingError(f"{where}: unexpected tensor(s) {extra[:5]}{' ...' if len(extra) > 5 else ''}")


# --- conversions ---------------------------------------------------------------------------------------------
def hf_to_megatron(hf_dir: str, out_dir: str, layout: ParallelLayout = ParallelLayout()) -> None:
    """Convert a HF model directory to a Megatron ``torch`` checkpoint with ``layout``."""
    bridge = Bridge(hf_dir)
    bridge.check_layout(layout)
    reader = HFReader(hf_dir)
    used = set()
    for pp in tqdm(range(layout.pp), desc="pipeline stages", unit="stage"):
        names = stage_inputs(bridge, layout, pp)
        hf_names = [h for n in names for h in bridge.hf_names(n)]
        hf = reader.get(hf_names)
        full = {n: bridge.from_hf(n, hf) for n in tqdm(names, desc=f"stage {pp}", unit="param", leave=False)}
        used.update(hf_names)
        save_megatron_stage(bridge, full, layout, pp, out_dir)
    extra = reader.names() - used - ({bridge.family.head_name} if bridge.cfg.tie_word_embeddings else set())
    extra = {n for n in extra if not bridge.is_left_out(n)}
    if extra:
        raise MappingError(f"HF tensor(s) {sorted(extra)[:5]} are not used by the {bridge.family.name!r} mapping")


def _held_as(name: str, owned: set) -> bool:
    """``name`` (as a checkpoint stores it) is one of ``owned`` (as the bridge names them), under its own name or
    another prefix (:data:`STORED_PREFIXES`)."""
    return name in owned or any(name.startswith(held) and asked + name[len(held):] in owned
                                for asked, held in STORED_PREFIXES)


def vision_tower(bridge: Bridge, hf_dir: str | None, batch: int = 64):
    """(name, tensor) pairs of the vision tower of the vision-language checkpoint at ``hf_dir`` (Qwen3.5 as released:
    ``model.visual.``; Gemma 3: ``vision_tower.`` and ``multi_modal_projector.``), which RL on text leaves as it is,
    to complete an export; nothing for other models. A
    vision-language model exported without ``hf_dir`` raises, naming the flag, rather than writing a checkpoint whose
    vision tower would load randomly initialised."""
    if not bridge.family.multimodal:
        return iter(())
    if bridge.vision_tower and (not hf_dir or not os.path.isdir(hf_dir)):
        return iter(())  # (a trained tower is among the model's own tensors)
    if not hf_dir or not os.path.isdir(hf_dir):
        raise ValueError(f"{bridge.hf_config['architectures'][0]} is a vision-language checkpoint: the export needs "
                         "the original checkpoint to copy its vision tower from (--vision-from HF_DIR; the trainer's "
                         f"--hf-checkpoint by default), got {hf_dir!r}")
    reader = HFReader(hf_dir)
    prefixes = bridge.family.vision_prefixes
    names = sorted(n for n in reader.names() if n.startswith(prefixes))
    if bridge.vision_tower:  # a trained tower is the model's own: only what it leaves out (Gemma 4's audio tower)
        owned = bridge.vision_tensor_names
        return (item for item in reader.get(n for n in names if not _held_as(n, owned)).items())
    if not names:
        raise ValueError(f"{hf_dir!r} has no {' / '.join(p + '*' for p in prefixes)} tensors (not the checkpoint this "
                         "model came from?)")
    return (item for i in range(0, len(names), batch) for item in reader.get(names[i:i + batch]).items())


def megatron_to_hf(mcore_dir: str, out_dir: str, max_shard_bytes: int = 5 << 30, vision_from: str | None = None) -> None:
    """Convert a Megatron ``torch`` checkpoint written with any layout to a sharded HF safetensors directory (a
    vision-language model's vision tower copied from ``vision_from``, the HF checkpoint it was converted from)."""
    bridge, layout = read_meta(mcore_dir)
    vision = vision_tower(bridge, vision_from)  # checks the source before anything is written

    def tensors():
        for pp in range(layout.pp):
            yield from bridge.export(load_megatron_stage(bridge, mcore_dir, layout, pp).items())
        yield from vision

    save_hf(tensors(), out_dir, bridge.hf_config, max_shard_bytes)


def reshard(mcore_dir: str, out_dir: str, layout: ParallelLayout) -> None:
    """Rewrite a Megatron ``torch`` checkpoint with another TP/PP/EP layout, one target stage at a time: each is
    joined from the source stages that hold its layers (their rank files memory-mapped, only its tensors read), so
    host memory holds about one target stage, not the model."""
    bridge, src = read_meta(mcore_dir)
    bridge.check_layout(layout)
    held = [set(bridge.piece_names(bridge.stage_layers(src, s), s == 0, s == src.pp - 1)) for s in range(src.pp)]
    for pp in tqdm(range(layout.pp), desc="writing stages", unit="stage"):
        needed = set(stage_inputs(bridge, layout, pp))
        full: dict[str, torch.Tensor] = {}
        for s in range(src.pp):
            want = (needed & held[s]) - set(full)
            if want:
                full.update(load_megatron_stage(bridge, mcore_dir, src, s, want))
        _check_names(needed, set(full), f"stage {pp} of the new layout {layout}")
        save_megatron_stage(bridge, full, layout, pp, out_dir)
        del full


def load_rank_state(mcore_dir: str, tp: int, pp: int, ep: int) -> dict:
    """The ``model`` state dict of rank (tp, pp, ep), ready for ``model.load_state_dict(..., strict=True)``."""
    _, layout = read_meta(mcore_dir)
    return torch.load(rank_file(mcore_dir, layout, tp, pp, ep), map_location="cpu", weights_only=True)["model"]


def job_layout() -> ParallelLayout:
    """The layout of the running job (Megatron's parallel state, and the uneven pipeline split
    ``mcore.parallel.initialize`` recorded)."""
    from megatron.core import parallel_state as ps

    from forge_megatron.mcore.parallel import pipeline_split

    return ParallelLayout(ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                          ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size(),
                          *pipeline_split())


def load_into(model, mcore_dir: str) -> None:
    """Load the shard of the calling rank (its TP/PP/EP ranks in Megatron's parallel state) into ``model``, a
    ``GPTModel`` built from ``read_meta(mcore_dir)[0].cfg`` under the checkpoint's layout (strict)."""
    from megatron.core import parallel_state as ps

    _, layout = read_meta(mcore_dir)
    here = job_layout()
    if here != layout:
        raise ValueError(f"checkpoint {mcore_dir!r} has layout {layout}, this job runs {here}; "
                         f"reshard it first (forge-convert reshard)")
    model.load_state_dict(load_rank_state(mcore_dir, ps.get_tensor_model_parallel_rank(),
                                          ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank()),
                          strict=True)


# --- FP8 serving checkpoint -----------------------------------------------------------------------------------
def hf_to_fp8(hf_dir: str, out_dir: str, block: tuple[int, int] = (128, 128), skip: tuple[str, ...] = (),
              max_shard_bytes: int = 5 << 30) -> dict:
    """Write a block-wise FP8 copy of the HF checkpoint ``hf_dir`` (what ``--weight-sync-fp8`` sends, see
    :mod:`forge_megatron.weight_sync.fp8`) for SGLang to serve: projection weights as float8_e4m3fn +
    ``weight_scale_inv``, the rest unchanged, config.json with the ``quantization_config``, the tokenizer files
    copied. Tensors are read and quantized one at a time. Returns a summary (tensors, quantized, bytes in and out)."""
    from forge_megatron.weight_sync.fp8 import Fp8Config, quantize_named

    if os.path.abspath(hf_dir) == os.path.abspath(out_dir):
        raise ValueError("--out must differ from --hf-dir")
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf_config = json.load(f)
    if hf_config.get("quantization_config"):
        raise ValueError(f"{hf_dir!r} is already quantized ({hf_config['quantization_config'].get('quant_method')})")
    cfg = Fp8Config(block=tuple(block), skip=tuple(skip))
    reader = HFReader(hf_dir)
    stats = {"tensors": 0, "quantized": 0, "bytes_in": 0, "bytes_out": 0}

    def tensors():
        def one_by_one():
            for name in sorted(reader.names()):
                t = reader.get([name])[name]
                stats["tensors"] += 1
                stats["bytes_in"] += t.numel() * t.element_size()
                yield name, t

        for item in quantize_named(one_by_one(), cfg):
            group = item if isinstance(item, list) else [item]
            stats["quantized"] += isinstance(item, list)
            for name, t in group:
                stats["bytes_out"] += t.numel() * t.element_size()
                yield name, t

    save_hf(tensors(), out_dir, {**hf_config, "quantization_config": cfg.hf_dict()}, max_shard_bytes,
            total=len(reader.names()))
    _copy_tokenizer(hf_dir, out_dir)
    return stats


# MXFP4 (OCP microscaling, gpt-oss's released checkpoints): 4-bit e2m1 values, two per byte (low nibble first), one
# shared power-of-two scale per 32 values stored as a biased exponent (e8m0, bias 127).
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``*_blocks`` uint8 [..., R, G, 16] and ``*_scales`` uint8 [..., R, G] -> [..., G * 32, R] in ``dtype`` (the
    last two dims transposed: the layout of the bf16 parameter, e.g. gpt-oss ``gate_up_proj`` [E, D, 2F])."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks [..., G, 16] and scales [..., G] (uint8) do not match: "
                         f"{tuple(blocks.shape)} {blocks.dtype}, {tuple(scales.shape)} {scales.dtype}")
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = values.flatten(-2) * torch.exp2(scales.float() - 127.0)[..., None]  # [..., G, 32]
    return values.flatten(-2).transpose(-1, -2).to(dtype).contiguous()


def mxfp4_to_bf16(hf_dir: str, out_dir: str, max_shard_bytes: int = 5 << 30) -> dict:
    """Write a bf16 copy of an MXFP4 HF checkpoint (gpt-oss as released: each ``X_blocks`` / ``X_scales`` pair becomes
    the bf16 tensor ``X``; the rest is copied; config.json without its ``quantization_config``; the tokenizer files
    copied). One tensor at a time, so a 120B checkpoint needs memory for one layer's experts, not the model.
    Returns a summary (tensors in, dequantized, bytes out)."""
    if os.path.abspath(hf_dir) == os.path.abspath(out_dir):
        raise ValueError("--out must differ from --hf-dir")
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf_config = json.load(f)
    quant = (hf_config.get("quantization_config") or {}).get("quant_method")
    if quant != "mxfp4":
        raise ValueError(f"{hf_dir!r} is not an MXFP4 checkpoint (quantization_config quant_method: {quant})")
    return _dequantized_copy(hf_dir, out_dir, hf_config, ("_blocks", "_scales"), lambda base: base,
                             lambda blocks, scales: dequantize_mxfp4(blocks, scales), max_shard_bytes)


def _dequantized_copy(hf_dir: str, out_dir: str, hf_config: dict, parts: tuple[str, ...], out_name, dequant,
                      max_shard_bytes: int, check=None) -> dict:
    """Copy the checkpoint ``hf_dir`` to ``out_dir`` tensor by tensor, each quantized group (``base + parts[0]`` and
    its companions ``base + parts[1:]``) replaced by ``out_name(base)`` = ``dequant(*group)``; the config less its
    ``quantization_config``; the tokenizer files. ``check(base, names)`` may refuse a group. Returns a summary."""
    reader = HFReader(hf_dir)
    names = reader.names()
    stats = {"tensors": len(names), "dequantized": 0, "bytes_out": 0}

    def tensors():
        for name in sorted(names):
            base = next((name[: -len(p)] for p in parts[1:] if name.endswith(p)), None)
            if base is not None and base + parts[0] in names:
                continue  # a companion, read with its group
            if name.endswith(parts[0]):
                base = name[: -len(parts[0])]
                missing = [base + p for p in parts if base + p not in names]
                if missing:
                    raise ValueError(f"{name!r} has no {missing[0]!r} beside it")
                if check is not None:
                    check(base, names)
                got = reader.get([base + p for p in parts])
                t, name = dequant(*(got[base + p] for p in parts)), out_name(base)
                stats["dequantized"] += 1
            else:
                t = reader.get([name])[name]
            stats["bytes_out"] += t.numel() * t.element_size()
            yield name, t

    config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    if isinstance(config.get("text_config"), dict):  # a vision-language release may keep it in its text_config
        config["text_config"] = {k: v for k, v in config["text_config"].items() if k != "quantization_config"}
    save_hf(tensors(), out_dir, config, max_shard_bytes, total=len(names))
    _copy_tokenizer(hf_dir, out_dir)
    return stats


def _copy_tokenizer(hf_dir: str, out_dir: str) -> None:
    from forge_megatron.convert.trainer_checkpoint import TOKENIZER_FILES

    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(hf_dir, name)):
            with open(os.path.join(hf_dir, name), "rb") as src, open(os.path.join(out_dir, name), "wb") as dst:
                dst.write(src.read())


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, shape, group_size: int) -> torch.Tensor:
    """bf16 [rows, cols] of a compressed-tensors ``pack-quantized`` int4 weight (weight_sync/int4.py describes the
    format): w = q x scale[row, col // group_size]."""
    from forge_megatron.weight_sync.int4 import dequantize

    return dequantize(packed, scale, shape, group_size, torch.bfloat16)


def int4_to_bf16(hf_dir: str, out_dir: str, max_shard_bytes: int = 5 << 30) -> dict:
    """Write a bf16 copy of a compressed-tensors int4 checkpoint (Kimi-K2-Thinking and Kimi-K2.5 as released:
    each ``X.weight_packed`` / ``X.weight_scale`` / ``X.weight_shape`` triple becomes the bf16 ``X.weight``; the rest
    is copied; config.json without its ``quantization_config``, top level or text_config's; the tokenizer files
    copied), one tensor at a time. Returns a summary (tensors in, dequantized, bytes out)."""
    if os.path.abspath(hf_dir) == os.path.abspath(out_dir):
        raise ValueError("--out must differ from --hf-dir")
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf_config = json.load(f)
    from forge_megatron.weight_sync.int4 import group_size_of, quantization_config_of

    group_size = group_size_of(quantization_config_of(hf_config) or {})

    def symmetric(base: str, names: set[str]) -> None:
        if base + ".weight_zero_point" in names:
            raise ValueError(f"{base!r}: asymmetric int4 (a weight_zero_point) is not supported")

    return _dequantized_copy(
        hf_dir, out_dir, hf_config, (".weight_packed", ".weight_scale", ".weight_shape"), lambda base: base + ".weight",
        lambda packed, scale, shape: dequantize_int4(packed, scale, shape.tolist(), group_size), max_shard_bytes,
        check=symmetric)
