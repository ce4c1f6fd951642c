"""Full HF-named tensors from a live TP/PP/EP-sharded Megatron model (a collective over the model's ranks).

Every rank of a pipeline stage walks its parameters in the same order and takes part in the gathers; the result
(``(hf_name, tensor)`` pairs) is only sent on by the stage *lead* (TP rank 0, DP rank 0, CP rank 0), straight to the
engines (see :mod:`forge_megatron.weight_sync.syncer`):

- non-expert parameter: all-gather over the TP group, then :meth:`Bridge.tp_join` (QKV groups, GLU halves);
- expert parameter: all-gather over the expert-TP group, joined the same way, then all-gather over the EP group:
  EP rank r's local expert j is global expert ``r * E / ep + j``;
- names: the local layer number plus the chunk's first global layer (``layer_number - 1`` of its first layer), so
  PP stages and virtual-pipeline chunks each name their own layers.

Non-expert and expert parameters are yielded as two separate streams (:func:`iter_dense`, :func:`iter_experts`) so
they travel in separate buckets.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from forge_megatron.bridge import Bridge


def unwrap(chunk):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def global_layers(model) -> range:
    """Global (0-based) numbers of the transformer layers a model chunk holds: Megatron numbers each layer by its
    place in the whole model, so PP stages and virtual-pipeline chunks know their own."""
    numbers = [layer.layer_number - 1 for layer in unwrap(model).decoder.layers]
    if numbers and numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        raise ValueError(f"a model chunk's layers are not consecutive: {[n + 1 for n in numbers]}")
    return range(numbers[0], numbers[-1] + 1) if numbers else range(0)


def is_stage_lead() -> bool:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    size = dist.get_world_size(group)
    if size == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _params(bridge: Bridge, chunk, experts: bool):
    """(canonical name, param) of ``chunk``, expert or non-expert ones only (expert ids still local), and the
    buffers the bridge maps to HF tensors (a MoE router's score-correction bias: GLM-4.5's
    ``e_score_correction_bias``, replicated)."""
    from forge_megatron.mcore.lora import is_lora_name, merged

    model = unwrap(chunk)
    layer_offset = global_layers(model).start if hasattr(model, "decoder") else 0
    named = dict(model.named_parameters())
    adapters = {n: t for n, t in [*named.items(), *model.named_buffers()] if is_lora_name(n)}
    for local, p in named.items():
        if local == "output_layer.weight" and bridge.cfg.tie_word_embeddings:
            continue  # the last stage's copy of the tied embedding
        if getattr(p, "is_vision_tower", False) and not p.requires_grad:
            continue  # outside --vision-trainable: the checkpoint's, which the engines loaded too
        if is_lora_name(local):
            continue  # --lora-rank: merged into its weight (W + scaling * B A, this shard's)
        canonical = bridge.rename(local, layer_offset, 0)
        if bridge.is_expert(canonical) == experts:
            yield canonical, merged(adapters, local, p) if adapters else p
    if experts:
        return
    for local, buf in model.named_buffers():
        if local.endswith(".expert_bias"):  # the bridge maps it whenever the router has one
            yield bridge.rename(local, layer_offset, 0), buf


def iter_dense(bridge: Bridge, chunks, dtype: torch.dtype | None = None):
    """Yield (hf_name, full tensor) for this stage's non-expert parameters (meaningful on the stage lead)."""
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    for chunk in chunks:
        for name, p in _params(bridge, chunk, experts=False):
            t = p.detach() if dtype is None else p.detach().to(dtype)
            # split or not as the bridge's rule says (the layout conversion is tested against): a module that does
            # not mark its TP-split parameter (Megatron's DotProductAttention and its softmax_offset, gpt-oss's
            # sinks) would otherwise reach the engines as one rank's slice
            if tp > 1 and bridge.rule(name)[0].tp != "rep":
                t = bridge.tp_join(name, _all_gather(t, tp_group))
            yield from bridge.to_hf(name, t).items()


def iter_experts(bridge: Bridge, chunks, dtype: torch.dtype | None = None):
    """Yield (hf_name, full tensor) for this stage's experts, all EP ranks' experts with global ids."""
    from megatron.core import parallel_state as ps

    etp_group = ps.get_expert_tensor_parallel_group()
    ep_group = ps.get_expert_model_parallel_group()
    local_experts = (bridge.cfg.num_moe_experts or 0) // ps.get_expert_model_parallel_world_size()
    def canonical():
        for chunk in chunks:
            for name, p in _params(bridge, chunk, experts=True):
                t = p.detach() if dtype is None else p.detach().to(dtype)
                t = bridge.tp_join(name, _all_gather(t, etp_group))
                for ep_rank, full in enumerate(_all_gather(t, ep_group)):
                    yield bridge.rename(name, 0, ep_rank * local_experts), full

    # gpt-oss's HF tensors hold every expert of a layer: export holds a layer's expert slices until the last local
    # expert's (each all-gathered over EP) has come, then stacks them: one layer's experts in memory at a time
    yield from bridge.export(canonical())


def iter_stage_buckets(bridge: Bridge, chunks, bucket_bytes: int, dtype: torch.dtype | None = None, fp8=None,
                       int4=None):
    """Collective over the ranks of this rank's pipeline stage: yields every HF tensor the stage holds (all its
    chunks), in buckets of at most ``bucket_bytes``, non-expert buckets first, then expert buckets. With ``fp8``
    (an :class:`~forge_megatron.weight_sync.fp8.Fp8Config`) projection weights go as float8 + block scales, each
    weight in the bucket of its scales; with ``int4`` (an :class:`~forge_megatron.weight_sync.int4.Int4Config`) the
    quantized projections go as packed int4 + group scales + shape, together; tensors SGLang fuses on load go in
    one bucket (``buckets.LOADED_TOGETHER``).

    Every rank of the stage must run the generator to its end (they take part in the gathers); only the stage
    lead's buckets (:func:`is_stage_lead`) are sent to the engines.
    """
    from forge_megatron.weight_sync import buckets as bk
    from forge_megatron.weight_sync import fp8 as fp8_format, int4 as int4_format

    for stream in (iter_dense, iter_experts):
        named = stream(bridge, chunks, dtype)
        named = named if fp8 is None else fp8_format.quantize_named(named, fp8)
        named = named if int4 is None else int4_format.quantize_named(named, int4)
        yield from bk.make_buckets(bk.keep_together(named), bucket_bytes)
