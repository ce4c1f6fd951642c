"""``forge-plan``: what a model and a parallel layout put on each GPU, before a job waits in the queue for them.

    forge-plan --hf-checkpoint /models/MiniMax-M2 --world-size 64 --tensor-model-parallel-size 4 \\
        --pipeline-model-parallel-size 2 --expert-model-parallel-size 16 --use-distributed-optimizer --bf16 \\
        --tree-token-budget 32768 --recompute-granularity full --gpu-memory-gib 141

It takes the trainer's own flags (unknown ones are ignored, so a training command line can be reused as is, with
``--world-size`` added) and prints, per pipeline rank, the parameters that rank holds and the memory they need:

* parameters, exactly: every Megatron tensor of the rank's layers is shaped through the bridge's own HF mapping (on
  the meta device: nothing is allocated or read but config.json) and split as the checkpoint conversion splits it
  (TP by rows or columns, EP by whole experts, PP by layers, the embedding on the first rank and the head on the
  last, the head again on the last rank for tied embeddings under PP). ``tests/training/test_plan.py`` compares
  the counts with models built by Megatron under TP, PP, EP and VPP.
* static memory, from the trainer's settings: weights (bf16 or fp32), fp32 gradient buffers (the trainer reduces
  gradients in fp32), Adam (fp32 moments, plus an fp32 master copy of bf16 weights) divided over the data-parallel
  replicas with ``--use-distributed-optimizer`` (dense tensors over DP x CP, expert tensors over the expert-data-
  parallel group DP x CP / EP), and a second copy of the weights for ``--rl-kl-coef`` > 0 (the frozen reference).
* the frozen vision tower of a vision-language checkpoint the trainer takes images for (multimodal/families.py): its
  parameters (counted on the meta device from the config's ``vision_config``), in the weights' dtype, on every rank
  of the first pipeline stage (its weights replicated over TP and CP there, the images shared out over them; once
  more for the KL reference is not needed: the reference shares it). Its activations are transient (no gradients)
  and left out. With ``--train-vision-tower`` the tower is part of the first stage's model instead (``Bridge(vision_tower=True)``):
  counted in ``params_dense`` there, with gradients, optimizer state and (with the KL term) a reference copy (under
  ``--vision-trainable GLOBS`` the parameters the globs leave out, ``params_frozen``, have weights only). Its
  activations are kept for the backward then: ``--image-token-fraction`` (default 0.5) of a micro-batch's tokens
  are taken as image tokens, each ``spatial_merge_size``^2 patches, shared out over the TP x CP ranks as the
  trainer shares the images, times the bytes the tower keeps per patch (:func:`vision_tower_bytes`: measured on a
  narrower copy of the checkpoint's tower, with ``--recompute-vision-tower`` too), for the PP micro-batches in
  flight on the first stage (``vision_activations_gib_estimate``, part of ``activations_gib_estimate``).
* activations, a rough estimate only: the tokens one micro-batch puts on a rank (``--tree-token-budget`` / CP, and /
  TP outside attention with sequence parallelism) times the bytes a layer keeps per token for its backward (with
  ``--recompute-granularity full`` the layer inputs of the rank's layers plus one layer's working set; otherwise
  about 34 x hidden / TP bytes per token per layer with sequence parallelism, (10 + 24 / TP) x hidden without,
  after Korthikanti et al. 2022 with flash-style attention, and 3 x top-k x expert width x 2 / TP bytes for a MoE
  block's expert activations; a Gated DeltaNet layer's mixer counted by :func:`gated_delta_net_bytes` instead of
  attention's 11 x hidden / TP), times the micro-batches in flight (PP - r of them on pipeline rank r under 1F1B). Treat it as the order of
  magnitude; the static part decides whether a layout can work at all.

The verdict compares the total with ``--gpu-memory-gib`` less 10 % (allocator fragmentation, NCCL buffers, the
CUDA context). ``--json`` prints the plan as one JSON object instead of the table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

GIB = 1 << 30


def _shapes(bridge, names: list[str], tp: int, etp: int | None = None) -> dict[str, tuple[int, ...]]:
    """TP-local shape of each canonical tensor in ``names`` (experts split over ``etp``, TP when None), through the
    bridge's HF mapping on the meta device. Tensors of one rule share a shape (every layer, every expert), so each
    rule is shaped once (per kind of layer where those differ: Gemma 4's global layers)."""
    import torch

    from forge_megatron.bridge import ParallelLayout

    layout = ParallelLayout(tp=tp, etp=etp)
    per_kind = bridge.cfg.per_layer_attention  # (Gemma 4: see Bridge.layer_kind)

    by_rule: dict[tuple, tuple[int, ...]] = {}
    out = {}
    for name in names:
        rule, idx = bridge.rule(name)
        key = (id(rule), per_kind and "layer" in idx and bridge.layer_kind(idx["layer"]))
        if key not in by_rule:
            hf = {h: torch.empty(bridge.hf_shape(h), device="meta") for h in bridge.hf_names(name)}
            full = bridge.from_hf(name, hf)
            by_rule[key] = tuple(bridge.shard(name, full, layout, 0).shape)
        out[name] = by_rule[key]
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def rank_layers(num_layers: int, pp: int, vpp: int | None, pp_rank: int, first: int | None = None,
                last: int | None = None) -> list[int]:
    """Global layers a pipeline rank holds: one contiguous block (the first / last stage's own count if given), or
    with VPP its ``vpp`` chunks r, r + pp, ..."""
    from forge_megatron.mcore.parallel import pipeline_chunks

    chunks = pipeline_chunks(num_layers, pp, vpp, first, last)
    return [layer for v in range(vpp or 1) for layer in chunks[v * pp + pp_rank]]


def rank_params(bridge, tp: int, pp: int, ep: int, pp_rank: int, vpp: int | None = None,
                etp: int | None = None, first: int | None = None, last: int | None = None) -> dict[str, int]:
    """{"dense", "expert", "buffers"}: elements this (TP, EP) rank of pipeline rank ``pp_rank`` holds (experts split
    over ``etp`` ranks, TP when None). Buffers are the routers' score-correction biases, Gemma 4's layer scalars and
    Apertus' xIELU constants (state, not parameters)."""
    cfg = bridge.cfg
    layers = rank_layers(cfg.num_layers, pp, vpp, pp_rank, first, last)
    is_first, is_last = pp_rank == 0, pp_rank == pp - 1
    names = bridge.canonical_names(layers)
    if is_first:
        names[:0] = bridge.piece_names(range(0), True, False)  # the embedding (and Gemma 4's per-layer inputs)
    if is_last:  # the final norm (and a LayerNorm's bias: Jais 2) and the head
        names += [n for n in bridge.piece_names(range(0), False, True) if n.startswith("decoder.final_layernorm.")]
        if not cfg.tie_word_embeddings:
            names.append("output_layer.weight")
    shapes = _shapes(bridge, names, tp, etp)
    out = {"dense": 0, "expert": 0, "buffers": 0}
    for name in names:
        n = _numel(shapes[name])
        if name.endswith(("router.expert_bias", "layer_scalar", "activation_func.beta", "activation_func.eps")):
            out["buffers"] += n
        elif bridge.is_expert(name):
            out["expert"] += n // ep  # every EP rank holds 1/EP of each layer's experts
        else:
            out["dense"] += n
    if is_last and cfg.tie_word_embeddings and pp > 1:  # Megatron's head keeps its own copy of the tied embedding
        out["dense"] += _numel(_shapes(bridge, ["embedding.word_embeddings.weight"], tp)[
            "embedding.word_embeddings.weight"])
    return out


def lora_params(bridge, lora, tp: int, pp: int, pp_rank: int, vpp: int | None = None, first: int | None = None,
                last: int | None = None, ep: int = 1, etp: int | None = None, split: bool = False):
    """Adapter elements (--lora-rank, mcore/lora.py) a TP rank of pipeline rank ``pp_rank`` holds: R x (rows +
    columns) of each adapted linear's TP-local weight (A whole and B split, or the reverse, as the linear is
    split), for the targets each layer has (a MoE layer's MLP, linear-attention mixers: none, unless its routed
    experts, 1/EP of them on a rank, and shared expert are named). ``split``: (non-expert, routed experts')."""
    import re

    pattern = re.compile(r"^decoder\.layers\.\d+\.(?:self_attention|mlp)\.(?:(experts)\.local_experts\.\d+\.|"
                         r"(shared_experts)\.)?(\w+)\.weight$")
    layers = rank_layers(bridge.cfg.num_layers, pp, vpp, pp_rank, first, last)
    names = [n for n in bridge.canonical_names(layers)
             if (m := pattern.match(n)) and (m.group(1) or m.group(2) or m.group(3)) in lora.targets]
    shapes = _shapes(bridge, names, tp, etp)
    dense = sum(lora.rank * sum(shapes[n]) for n in names if not bridge.is_expert(n))
    expert = sum(lora.rank * sum(shapes[n]) // ep for n in names if bridge.is_expert(n))
    return (dense, expert) if split else dense + expert


def mamba2_bytes(cfg, tp: int, sp: bool) -> float:
    """Bytes a Mamba-2 mixer (mcore/mamba2.py, bf16: Granite 4.0-H's, Nemotron-H's, Bamba's, Falcon-H1's) keeps per
    token for its backward on one TP rank, its gated norm and recurrence recomputed: the input projection's input
    (split by SP), then per channel of the I = heads x head dim width about 26 bytes (x's convolution input and
    output and the gate z in bf16, the recurrence's output and the skip term in fp32, the norm's saved inputs, the
    output projection's input), per channel of B and C 9 (their convolution's input and output), per head 12 (the
    time step and decay in fp32). Fitted to what the layer really keeps at several widths (tests/training/
    test_plan.py measures it)."""
    h = cfg.hidden_size
    width = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    bc = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    return 2 * h / (tp if sp else 1) + (26 * width + 9 * bc + 12 * cfg.linear_num_value_heads) / tp


def gated_delta_net_bytes(cfg, tp: int, sp: bool) -> float:
    """Bytes a Gated DeltaNet mixer (mcore/gated_delta_net.py, bf16; Kimi Delta Attention's: mcore/kimi_delta.py)
    keeps per token for its backward on one TP
    rank, with its recurrence and gated norm recomputed (the default): the input projection's input (split by SP),
    the convolution's input and its SiLU output (q, k, v: the recurrence's saved inputs), the decays and write
    strengths (fp32, a few per value head), the recurrence's output, the gate z and the output projection's input.
    A test compares it with what the layer really keeps (tests/training/test_plan.py)."""
    h = cfg.hidden_size
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if cfg.linear_attention_kind == "mamba2":  # (Mamba-2's own terms)
        return mamba2_bytes(cfg, tp, sp)
    if cfg.linear_attention_kind == "kimi_delta":  # Kimi Delta Attention (mcore/kimi_delta.py), decays recomputed:
        d = cfg.linear_value_head_dim  # the convolution's input and output, the forget gate's input and b (bf16),
        # the output gate, the rule's output and the output projection's input, the gates' down projection (whole)
        return 2 * h / (tp if sp else 1) + (12 * nv * d + 2 * nv * d + 2 * nv + 6 * nv * d) / tp + 4 * d
    if cfg.linear_attention_kind == "lightning":  # lightning attention (mcore/lightning.py), recurrence recomputed:
        # q, k, v before and after their SiLU (fp32), the gate (bf16), the rule's output and the normed output (fp32),
        # the output projection's input (tests/training/test_plan.py compares it with what the layer keeps)
        return 2 * h / (tp if sp else 1) + (24 + 2 + 4 + 4 + 4 + 2) * nv * cfg.linear_value_head_dim / tp
    channels = nk * 2 * cfg.linear_key_head_dim + nv * cfg.linear_value_head_dim  # q, k, v
    return 2 * h / (tp if sp else 1) + (4 * channels + 6 * nv * cfg.linear_value_head_dim + 16 * nv) / tp


def _activation_bytes(cfg, layers: list[int], moe_layers: int, tokens: float, tp: int, sp: bool,
                      recompute: str | None, in_flight: int) -> float:
    """Rough activation memory of one pipeline rank (see the module docstring)."""
    h = cfg.hidden_size
    outside = tokens / (tp if sp else 1)  # tokens a rank holds outside attention
    # bytes a layer keeps per token (Korthikanti et al., flash-style attention): 34 h / TP with sequence
    # parallelism, (10 + 24 / TP) h without (the norms' and dropout's activations are then not split)
    per_token = 34 * h / tp if sp or tp == 1 else (10 + 24 / tp) * h
    if recompute == "full":
        kept = len(layers) * outside * h * 2  # each layer's input, bf16
        working = tokens * per_token  # one layer re-run in the backward
        return kept * in_flight + working
    dense = len(layers) - moe_layers
    moe_extra = 3 * cfg.moe_router_topk * (cfg.moe_ffn_hidden_size or 0) * 2 / tp if moe_layers else 0.0
    # linear-attention layers: their mixer's bytes instead of attention's 11 h / TP
    linear = sum(bool(cfg.linear_attention[layer]) for layer in layers) if cfg.hybrid else 0
    linear_extra = gated_delta_net_bytes(cfg, tp, sp) - 11 * h / tp if linear else 0.0
    # Falcon-H1: a Mamba-2 mixer beside every layer's attention (its bytes on top of the layer's)
    beside = len(layers) * gated_delta_net_bytes(cfg, tp, sp) if cfg.mamba_beside_attention else 0.0
    return (dense * per_token + moe_layers * (per_token + moe_extra) + linear * linear_extra + beside) * tokens * \
        in_flight


def plan(bridge, world: int, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, vpp: int | None = None,
         bf16: bool = True, distributed_optimizer: bool = False, kl_reference: bool = False,
         tokens: int = 8192, recompute: str | None = None, sequence_parallel: bool = False,
         gpu_memory_gib: float = 80.0, etp: int | None = None, first: int | None = None,
         last: int | None = None, image_token_fraction: float = 0.5, recompute_vision_tower: bool = False,
         vision_trainable: str | None = None, lora=None, lora_reference_copy: bool = False,
         teacher=None, critic=None) -> dict:
    """The plan as a dict: layout, per pipeline rank parameters and memory (GiB), and the verdict. ``first`` /
    ``last``: uneven pipeline stages (the first / last stage's layers). A trained tower (``Bridge(vision_tower=
    True)``): ``image_token_fraction`` of a micro-batch's tokens are image tokens (its activations),
    ``recompute_vision_tower`` as the trainer's flag, ``vision_trainable`` the trainer's globs (the other tower
    parameters keep weights only). ``lora``: --lora-rank's LoraConfig (every parameter frozen, weights only;
    the adapters, ``params_lora``, have gradients and optimizer state; the KL reference is the policy with its
    adapters off, no copy, unless ``lora_reference_copy``: a --ref-hf-checkpoint of its own). ``teacher``: the
    Bridge of an on-policy distillation teacher (--teacher-hf-checkpoint): its weights, split in the same layout, on
    every GPU too (its forward-only activations are freed layer by layer and not counted). ``critic``: the Bridge of
    a learned critic (--critic: a value model, a sequence-classification config): its weights, gradients and optimizer
    state split in the same layout (``critic_gib``); its passes run before the policy's, so the activations are the
    larger of the two models' estimates."""
    from forge_megatron.bridge import ParallelLayout
    from forge_megatron.mcore.parallel import ParallelConfig

    cfg = bridge.cfg
    parallel = ParallelConfig(tp=tp, pp=pp, ep=ep, cp=cp, etp=etp, vpp=vpp, first_stage_layers=first,
                              last_stage_layers=last)
    dp = parallel.data_parallel_size(world)
    parallel.layer_chunks(cfg.num_layers)  # ValueError naming the counts that do not split
    for name, other in (("the teacher", teacher), ("the critic", critic)):
        if other is None:
            continue
        try:
            parallel.layer_chunks(other.cfg.num_layers)
            other.check_layout(ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp, first=first, last=last))
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from exc
    bridge.check_layout(ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp, first=first, last=last))
    weight_bytes = 2 if bf16 else 4
    opt_bytes = 12 if bf16 else 8  # fp32 Adam moments, and an fp32 master copy of bf16 weights
    dense_shards = dp * cp if distributed_optimizer else 1
    # the experts' data-parallel group: the ranks holding the same experts, dp * cp * tp / (etp * ep)
    expert_shards = max(1, dp * cp * tp // (parallel.expert_tp * ep)) if distributed_optimizer else 1
    budget = gpu_memory_gib * 0.9
    tower = vision_tower_params(bridge)
    tower_frozen, tower_act = _trained_tower(bridge, vision_trainable, tokens, image_token_fraction, tp * cp, pp,
                                             recompute_vision_tower)
    ranks = []
    for r in range(pp):
        params = rank_params(bridge, tp, pp, ep, r, vpp, etp, first, last)
        n = params["dense"] + params["expert"]
        frozen = tower_frozen if r == 0 else 0  # a trained tower's parameters outside --vision-trainable
        dense_ad, expert_ad = lora_params(bridge, lora, tp, pp, r, vpp, first, last, ep, etp, split=True) \
            if lora is not None else (0, 0)
        adapters = dense_ad + expert_ad
        if lora is not None:  # the checkpoint's weights frozen, the adapters trained (a routed expert's adapters
            # sharded over the experts' data-parallel group by the distributed optimizer, as its weights would be)
            frozen, n, params = n, n + adapters, {**params, "dense": params["dense"] + adapters}
        layers = rank_layers(cfg.num_layers, pp, vpp, r, first, last)
        moe = sum(bridge.is_moe_layer(layer) for layer in layers)
        in_flight = pp - r  # 1F1B: pipeline rank r holds the activations of PP - r micro-batches
        static = {
            "weights": n * weight_bytes + params["buffers"] * 4,
            "grads": (n - frozen) * 4,
            "optimizer": ((dense_ad if lora is not None else params["dense"] - frozen) * opt_bytes / dense_shards
                          + (expert_ad if lora is not None else params["expert"]) * opt_bytes / expert_shards),
            "reference": (n - adapters) * weight_bytes
            if kl_reference and (lora is None or lora_reference_copy) else 0,
            "vision": tower * weight_bytes if r == 0 else 0,
        }
        if teacher is not None:
            t = rank_params(teacher, tp, pp, ep, r, vpp, etp, first, last)
            static["teacher"] = (t["dense"] + t["expert"]) * weight_bytes + t["buffers"] * 4
        act = _activation_bytes(cfg, layers, moe, tokens / cp, tp, sequence_parallel, recompute, in_flight)
        if critic is not None:  # trained like the policy (its own Adam), its passes before the policy's
            c = rank_params(critic, tp, pp, ep, r, vpp, etp, first, last)
            static["critic"] = ((c["dense"] + c["expert"]) * (weight_bytes + 4) + c["buffers"] * 4
                                + c["dense"] * opt_bytes / dense_shards + c["expert"] * opt_bytes / expert_shards)
            c_layers = rank_layers(critic.cfg.num_layers, pp, vpp, r, first, last)
            act = max(act, _activation_bytes(critic.cfg, c_layers, sum(critic.is_moe_layer(x) for x in c_layers),
                                             tokens / cp, tp, sequence_parallel, recompute, in_flight))
        act += tower_act if r == 0 else 0
        total = sum(static.values()) + act
        ranks.append({"pp_rank": r, "layers": len(layers), "moe_layers": moe, "params_dense": params["dense"],
                      "params_vision_frozen": tower if r == 0 else 0, "params_frozen": frozen,
                      **({"params_lora": adapters} if lora is not None else {}),
                      "vision_activations_gib_estimate": (tower_act if r == 0 else 0) / GIB,
                      "params_expert": params["expert"], **{f"{k}_gib": v / GIB for k, v in static.items()},
                      "activations_gib_estimate": act / GIB, "total_gib": total / GIB,
                      "fits": total / GIB <= budget})
    return {
        "model": bridge.family.name, "world_size": world, "tp": tp, "pp": pp, "ep": ep, "cp": cp, "dp": dp,
        "etp": parallel.expert_tp,
        "vpp": vpp, "first_stage_layers": first, "last_stage_layers": last, "bf16": bf16, "distributed_optimizer": distributed_optimizer, "kl_reference": kl_reference,
        "tree_token_budget": tokens, "recompute": recompute, "sequence_parallel": sequence_parallel,
        "gpu_memory_gib": gpu_memory_gib, "budget_gib": budget, "ranks": ranks,
        **({"image_token_fraction": image_token_fraction, "recompute_vision_tower": recompute_vision_tower,
            "vision_trainable": vision_trainable} if bridge.vision_tower else {}),
        **({"lora_rank": lora.rank, "lora_targets": list(lora.targets)} if lora is not None else {}),
        **({"teacher": teacher.family.name} if teacher is not None else {}),
        **({"critic": critic.family.name} if critic is not None else {}),
        "fits": all(x["fits"] for x in ranks),
    }


# Gemma 4's pictures in the estimate: 14 x 20 = 280 tokens, its processor's default budget (max_soft_tokens): the
# pooling's memory grows with the picture's tokens, so the estimate takes the largest default picture
GEMMA4_GRID = (14, 20)


def vision_tower_bytes(hf_config, recompute: bool = False, width: int = 8,
                       pixtral_patches: int | None = None) -> tuple[float, float]:
    """Bytes a trained bf16 vision tower keeps per image patch for its backward: (per block, the rest: patch
    embedding, position embeddings and the mergers). Measured, not modelled: the checkpoint's tower is built with
    every width divided by ``k = head size / width`` (heads and the layer structure kept) and run with one and with
    two blocks on one and on three small pictures under :class:`~forge_megatron.utils.memory.LiveBytes`; the
    differences give the bytes per patch and per block, free of what a forward keeps once whatever the pictures
    (copies of weights a CPU kernel makes). These grow linearly in the widths (flash-style attention keeps no
    scores), so k times the small tower's is the real one's (Gemma 3's SigLIP tower and projector too, on pictures of
    4 x 4 pooled tokens, its text width narrowed alike; the pictures its patch embedding keeps are not scaled).
    ``recompute``: ``--recompute-vision-tower`` (its blocks keep their inputs only)."""
    import copy
    import gc

    import torch

    from forge_megatron.multimodal.families import (Gemma3Tower, Gemma4Tower, KimiK25Tower, Mistral3Tower, _full_config,
                                                   image_patches, vision_model)
    from forge_megatron.utils.memory import LiveBytes

    config = _full_config(hf_config)
    full = config.vision_config
    gemma3 = config.model_type == "gemma3"  # a SigLIP tower of fixed-size images and its projector
    gemma4 = config.model_type == "gemma4"  # a tower of pooled patches and embed_vision
    mistral3 = config.model_type == "mistral3"  # a Pixtral tower and its projector
    kimi = config.model_type == "kimi_k25"  # MoonViT and its projector
    qwen2_vl = config.model_type == "qwen2_vl"  # its tower is embed_dim wide, hidden_size is the merger's output
    heads = int(getattr(full, "num_heads", None) or full.num_attention_heads)
    k = (full.embed_dim if qwen2_vl else full.hidden_size) / (heads * width)
    slope = []  # bytes per patch, with 1 and 2 blocks
    for depth in (1, 2):
        small = copy.deepcopy(full)
        if qwen2_vl:
            small.embed_dim, small.hidden_size = heads * width, max(1, round(full.hidden_size / k))
        else:
            small.hidden_size = heads * width
        for name in ("intermediate_size", "out_hidden_size"):
            if getattr(small, name, None):
                setattr(small, name, max(1, round(getattr(full, name) / k)))
        setattr(small, "num_hidden_layers" if gemma3 or gemma4 or mistral3 or kimi else "depth", depth)
        if getattr(small, "deepstack_visual_indexes", None):
            small.deepstack_visual_indexes = [0] * len(full.deepstack_visual_indexes)
        if gemma3:  # pictures of 4 x 4 pooled tokens (the real pooling kernel), the projector to a narrow width
            side = 4 * (full.image_size // full.patch_size) // math.isqrt(int(config.mm_tokens_per_image))
            small.image_size = side * full.patch_size
            wrapper = copy.deepcopy(config)
            wrapper.vision_config, wrapper.mm_tokens_per_image = small, 16
            wrapper.text_config.hidden_size = max(1, round(config.text_config.hidden_size / k))
            tower = Gemma3Tower(wrapper).to(torch.bfloat16).train()
        elif mistral3:  # pictures of 4 x 4 merged patches, the heads narrowed too, the projector to a narrow width
            small.head_dim = width
            side = 4 * int(config.spatial_merge_size)
            wrapper = copy.deepcopy(config)
            wrapper.vision_config = small
            wrapper.text_config.hidden_size = max(1, round(config.text_config.hidden_size / k))
            tower = Mistral3Tower(wrapper).to(torch.bfloat16).train()
        elif gemma4:  # pictures of GEMMA4_TOKENS (the processor's default budget), the heads narrowed too,
            # embed_vision to a narrow width
            small.head_dim = width
            side = int(full.pooling_kernel_size) * GEMMA4_GRID[0]
            wrapper = copy.deepcopy(config)
            wrapper.vision_config = small
            wrapper.text_config.hidden_size = max(1, round(config.text_config.hidden_size / k))
            tower = Gemma4Tower(wrapper).to(torch.bfloat16).train()
        elif kimi:  # pictures of 4 x 4 merged patches, the projector (its norm as wide as the tower) narrowed alike
            side = 4 * int(config.vision_config.merge_kernel_size[0])
            wrapper = copy.deepcopy(config)
            wrapper.vision_config, wrapper.projection_hidden_size = small, small.hidden_size
            wrapper.text_config.hidden_size = max(1, round(config.text_config.hidden_size / k))
            tower = KimiK25Tower(wrapper).to(torch.bfloat16).train()
        else:
            tower = vision_model(small).to(torch.bfloat16).train()
            side = 4 * int(getattr(small, "spatial_merge_size", 2))
        if recompute:
            tower.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        held = []
        for images in (1, 3):
            grid = torch.tensor([[1, side, side]] * images)
            if mistral3 or kimi:
                pixels = torch.randn(images * side * side, 3 * full.patch_size ** 2, dtype=torch.bfloat16)
            elif gemma3:
                pixels = image_patches(torch.randn(images, 3, side * full.patch_size, side * full.patch_size),
                                        full.patch_size).to(torch.bfloat16)
            elif gemma4:
                wide = side // GEMMA4_GRID[0] * GEMMA4_GRID[1]
                grid = torch.tensor([[1, side, wide]] * images)
                pixels = torch.rand(images * side * wide, 3 * full.patch_size ** 2, dtype=torch.bfloat16)
            else:
                features = small.in_channels * getattr(small, "temporal_patch_size", 1) * small.patch_size ** 2
                pixels = torch.randn(images * side * side, features, dtype=torch.bfloat16)
            mode = LiveBytes(existing=[pixels])
            with mode:
                gc.collect(0)  # (the young generation: a whole collection takes seconds in a big process)
                before = mode.live
                out = tower(pixels, grid_thw=grid, return_dict=True)
                gc.collect(0)
                held.append(mode.live - before)
            del out
        per_image = int(grid[0].prod())
        slope.append((held[1] - held[0]) / (2 * per_image))
    block = max(slope[1] - slope[0], 0.0)
    # Gemma 3: the patch embedding keeps its input, the pictures put back together from the patches (a copy, bf16),
    # whatever the widths: not scaled with them (the Qwen towers' take a view of the patches, held anyway)
    pixels = 2 * 3 * int(full.patch_size) ** 2 if gemma3 or gemma4 or mistral3 else 0  # (Gemma 4: its scaled copy)
    # Gemma 4's pooling keeps a one-hot [patches, tokens] fp32 per image, Pixtral its block-diagonal attention mask
    # [patches, patches] (bf16) per image: by the picture's size, not the widths (Pixtral's: pictures of its
    # processor's default longest edge, 1024 pixels, unless ``pixtral_patches`` says how many patches a picture has)
    if mistral3:
        measured, real = 2 * side * side, 2 * (pixtral_patches or (1024 // int(full.patch_size)) ** 2)
    elif kimi:  # MoonViT's position grid resampled bicubically: 16 taps a patch, an int64 index and an fp32 weight each
        measured = real = 16 * (8 + 4)
    else:
        measured = real = 4 * GEMMA4_GRID[0] * GEMMA4_GRID[1] if gemma4 else 0
    return block * k, max(slope[0] - block - pixels - measured, 0.0) * k + pixels + real


def vision_activation_bytes(hf_config, patches: float, in_flight: int, recompute: bool) -> float:
    """Activation memory of a trained tower on one rank of the first stage: ``patches`` per micro-batch on the
    rank (its share of the micro-batch's images), for ``in_flight`` micro-batches (1F1B), plus one block's working
    set in the backward when the blocks are recomputed."""
    from forge_megatron.multimodal.families import _vision_config

    vision = _vision_config(hf_config)
    depth = int(getattr(vision, "depth", None) or vision.num_hidden_layers)
    block, rest = vision_tower_bytes(hf_config, recompute)
    kept = (depth * block + rest) * patches * in_flight
    if recompute:
        kept += vision_tower_bytes(hf_config, False)[0] * patches  # one block re-run in the backward
    return kept


def _trained_tower(bridge, trainable: str | None, tokens: int, fraction: float, share: int, pp: int,
                   recompute: bool) -> tuple[int, float]:
    """A trained tower's (parameters outside ``trainable``, activation bytes on a first-stage rank): its images
    are shared out over the ``share`` = TP x CP ranks; (0, 0) when the tower is frozen or absent."""
    if not bridge.vision_tower:
        if trainable or recompute:
            raise ValueError(f"{'--vision-trainable' if trainable else '--recompute-vision-tower'} needs "
                             "--train-vision-tower")
        return 0, 0.0
    if not 0 <= fraction <= 1:
        raise ValueError(f"--image-token-fraction must lie in [0, 1], got {fraction}")
    from forge_megatron.multimodal import vision_spec

    frozen = 0
    if trainable:
        from forge_megatron.mcore.vision import trainable_matches
        from forge_megatron.multimodal.families import meta_vision_tower

        params = dict(meta_vision_tower(bridge.hf_config).named_parameters())
        chosen = trainable_matches(sorted(params), trainable)
        frozen = sum(p.numel() for name, p in params.items() if name not in chosen)
    patches = tokens * fraction * vision_spec(bridge.hf_config).merge ** 2 / share
    return frozen, vision_activation_bytes(bridge.hf_config, patches, pp, recompute) if patches else 0.0


def vision_tower_params(bridge) -> int:
    """Parameters of the frozen vision tower the trainer loads for a checkpoint it takes images for; 0 otherwise (and
    when the tower trains: then it is among the model's parameters)."""
    if not bridge.family.multimodal or bridge.vision_tower:
        return 0
    from forge_megatron.multimodal import vision_spec

    try:
        vision_spec(bridge.hf_config)
    except ValueError:
        return 0
    from forge_megatron.multimodal.families import meta_vision_tower

    return sum(p.numel() for p in meta_vision_tower(bridge.hf_config).parameters())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="forge-plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-checkpoint", required=True, help="HF model directory (or its config.json)")
    p.add_argument("--world-size", type=int, required=True, help="GPUs of the training job")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    p.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="uneven pipeline stages: the first stage's layers (the others share the rest)")
    p.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="uneven pipeline stages: the last stage's layers")
    p.add_argument("--expert-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="1 or the TP size (default)")
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--bf16", action="store_true", help="bf16 weights (the trainer's --bf16; fp32 otherwise)")
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--rl-kl-coef", type=float, default=0.0, help="> 0: a frozen reference copy of the weights")
    p.add_argument("--preference-data", default=None, metavar="JSONL",
                   help="the trainer's DPO mode: a frozen reference copy of the weights, as --rl-kl-coef > 0")
    p.add_argument("--dpo-loss", default="sigmoid", help="with --preference-data: simpo has no reference copy")
    p.add_argument("--reward-model", action="store_true",
                   help="with --preference-data: a reward model (no reference copy; its score head is negligible)")
    p.add_argument("--train-vision-tower", action="store_true",
                   help="a vision-language checkpoint's vision tower trains: part of the first stage's model")
    p.add_argument("--vision-trainable", default=None, metavar="GLOBS",
                   help="with --train-vision-tower: the tower parameters that train (the trainer's flag); the "
                        "others keep weights only")
    p.add_argument("--recompute-vision-tower", action="store_true",
                   help="with --train-vision-tower: its blocks keep their inputs only (the trainer's flag)")
    p.add_argument("--image-token-fraction", type=float, default=0.5,
                   help="with --train-vision-tower: the share of a micro-batch's tokens that are image tokens, for "
                        "the tower's activations (0.5: e.g. screenshots between short turns; one image token is "
                        "spatial_merge_size^2 patches)")
    p.add_argument("--lora-rank", type=int, default=None,
                   help="the trainer's flag: LoRA adapters of this rank train, the checkpoint's weights stay frozen "
                        "(weights only: no gradients, no optimizer state)")
    p.add_argument("--lora-alpha", type=float, default=None, help="the trainer's flag (the plan does not need it)")
    p.add_argument("--ref-hf-checkpoint", default=None,
                   help="the trainer's flag: with --lora-rank a reference other than --hf-checkpoint is a frozen copy "
                        "of its own (else the KL reference is the policy with its adapters off: no copy)")
    p.add_argument("--lora-target-modules", default="all", help="the trainer's flag: which linears get adapters")
    p.add_argument("--teacher-hf-checkpoint", default=None, metavar="DIR",
                   help="the trainer's flag: an on-policy distillation teacher, its weights split in the same layout "
                        "on every GPU")
    p.add_argument("--critic", action="store_true",
                   help="the trainer's flag: a learned critic (a value model of --critic-hf-checkpoint, default "
                        "--hf-checkpoint) trains beside the policy in the same layout")
    p.add_argument("--critic-hf-checkpoint", default=None, metavar="DIR", help="the trainer's flag (implies --critic)")
    p.add_argument("--tree-token-budget", type=int, default=8192, help="unique tokens per micro-batch")
    p.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    p.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU (H100 80, H200 141)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    return p


def _table(result: dict) -> str:
    head = (f"{result['model']}: world {result['world_size']} = TP {result['tp']} x PP {result['pp']} x CP "
            f"{result['cp']} x DP {result['dp']} (EP {result['ep']}"
            f"{', expert TP ' + str(result['etp']) if result.get('etp', result['tp']) != result['tp'] else ''}"
            f"{', VPP ' + str(result['vpp']) if result['vpp'] else ''})"
            f"; {'bf16' if result['bf16'] else 'fp32'} weights, "
            f"{'distributed' if result['distributed_optimizer'] else 'replicated'} Adam, "
            f"{result['tree_token_budget']} tree tokens per micro-batch, recompute {result['recompute'] or 'none'}")
    cols = ("pp_rank", "layers", "params_dense", "params_expert", "weights_gib", "grads_gib", "optimizer_gib",
            "reference_gib", "activations_gib_estimate", "total_gib")
    if any(r["params_vision_frozen"] for r in result["ranks"]):  # a vision-language model that takes images
        cols = cols[:4] + ("params_vision_frozen",) + cols[4:8] + ("vision_gib",) + cols[8:]
    if "image_token_fraction" in result:  # a trained tower: its activations (and its frozen part, if any)
        at = cols.index("activations_gib_estimate")
        cols = cols[:at] + ("vision_activations_gib_estimate",) + cols[at:]
        if any(r["params_frozen"] for r in result["ranks"]):
            cols = cols[:4] + ("params_frozen",) + cols[4:]
        head += (f"; vision tower trained, {result['image_token_fraction']:g} of the tokens image tokens"
                 f"{', its blocks recomputed' if result['recompute_vision_tower'] else ''}")
    if result.get("teacher"):  # a frozen distillation teacher's weights
        at = cols.index("activations_gib_estimate")
        cols = cols[:at] + ("teacher_gib",) + cols[at:]
        head += f"; a {result['teacher']} teacher"
    if result.get("critic"):  # a learned critic's weights, gradients and optimizer state
        at = cols.index("activations_gib_estimate")
        cols = cols[:at] + ("critic_gib",) + cols[at:]
        head += f"; a {result['critic']} critic"
    if result.get("lora_rank"):  # the adapters train, every other parameter is frozen
        cols = cols[:4] + ("params_lora", "params_frozen") + cols[4:]
        head += f"; LoRA rank {result['lora_rank']} (the checkpoint's weights frozen)"
    widths = [max(14, len(c)) for c in cols]
    lines = [head, "  ".join(f"{c:>{w}}" for c, w in zip(cols, widths))]
    for r in result["ranks"]:
        lines.append("  ".join(f"{r[c]:>{w}.2f}" if isinstance(r[c], float) else f"{r[c]:>{w},}"
                               for c, w in zip(cols, widths)))
    verdict = "fits" if result["fits"] else "does NOT fit"
    lines.append(f"{verdict} in {result['gpu_memory_gib']:g} GiB per GPU (budget {result['budget_gib']:.1f} GiB: "
                 "10 % kept for fragmentation, NCCL and the CUDA context; activations are a rough estimate)")
    return "\n".join(lines)


def critic_bridge(hf_dir: str):
    """The Bridge of a learned critic made from ``hf_dir`` (a causal LM or a one-label reward model)."""
    from forge_megatron.bridge import Bridge
    from forge_megatron.bridge.families import load_hf_config, reward_model_config

    return Bridge(reward_model_config(load_hf_config(hf_dir)))


def main(argv: list[str] | None = None) -> int:
    args, _ = build_parser().parse_known_args(argv)
    from forge_megatron.bridge import Bridge, MappingError, UnsupportedModelError
    from forge_megatron.training import arguments

    try:
        bridge = Bridge(args.hf_checkpoint, vision_tower=args.train_vision_tower)
        vpp = args.num_virtual_stages_per_pipeline_rank
        if args.num_layers_per_virtual_pipeline_stage:  # Megatron's other spelling of the interleaved schedule
            vpp = bridge.cfg.num_layers // (args.pipeline_model_parallel_size
                                            * args.num_layers_per_virtual_pipeline_stage)
        result = plan(bridge, args.world_size, args.tensor_model_parallel_size,
                      args.pipeline_model_parallel_size, args.expert_model_parallel_size, args.context_parallel_size,
                      vpp, args.bf16, args.use_distributed_optimizer,
                      arguments.uses_reference_policy(args),
                      args.tree_token_budget, args.recompute_granularity,
                      args.sequence_parallel, args.gpu_memory_gib, args.expert_tensor_parallel_size,
                      args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers,
                      args.image_token_fraction, args.recompute_vision_tower, args.vision_trainable,
                      arguments.lora_config(args), not arguments.lora_reference(args),
                      Bridge(args.teacher_hf_checkpoint) if args.teacher_hf_checkpoint else None,
                      critic_bridge(args.critic_hf_checkpoint or args.hf_checkpoint)
                      if args.critic or args.critic_hf_checkpoint else None)
    except (ValueError, FileNotFoundError, MappingError, UnsupportedModelError) as exc:
        print(f"forge-plan: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else _table(result))
    return 0 if result["fits"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
