"""Int4 quantization-aware training: the trainer computes with the int4 rounding the engines serve.

With ``--weight-sync-int4`` the engines sample from the group-wise int4 rounding of the trainer's weights
(weight_sync/int4.py), so every rollout comes from a slightly different policy than the one the trainer scores.
``--int4-qat`` (Kimi-K2-Thinking was trained so) closes that gap: each Megatron weight whose HF module the release
quantizes is used in the forward as ``dequantize(quantize(w))``, exactly what the engine loads, with a straight-through
gradient (the update goes to the full-precision weight, which is what the optimizer, checkpoints and the sync keep).

Which weights: those whose HF tensors :meth:`Int4Config.quantizes` (all of a joined weight's parts, or none: a
mixed one is refused), through the bridge's mapping with global layer and expert numbers. Groups run along the
columns of this rank's shard, which are HF's columns when the weight is split by rows (column-parallel, the QKV
and GLU layouts, expert TP 1) and, for a row-parallel weight, when each rank's columns are a whole number of groups
(checked). Megatron's fc1 stacks gate and up rows: per-row groups do not care.

How: a forward pre-hook on the module that owns the weight puts ``w + (q(w) - w).detach()`` in the parameter's place
for the forward and a forward hook (``always_call``) puts the parameter back, so autograd saves and uses q(w) in the
backward and hands the parameter its gradient unchanged; a recomputed layer runs the hooks again. Needs Megatron's
own linear layers without gradient-accumulation fusion (what the trainer builds).
"""

from __future__ import annotations

import torch

from forge_megatron.weight_sync.int4 import Int4Config, round_to_groups

_JOINS = ("copy", "glu", "qkv")  # layouts that stack whole HF rows: per-row groups are HF's


def fake_quantize(w: torch.Tensor, group: int) -> torch.Tensor:
    """``dequantize(quantize(w))`` of weight_sync/int4.py in ``w``'s dtype, without packing (the tests check it
    equals the two steps bit for bit)."""
    q, scale = round_to_groups(w, group)
    return (q.float() * scale.float().repeat_interleave(group, dim=1)[:, :w.shape[1]]).to(w.dtype)


def _straight_through(w: torch.Tensor, group: int) -> torch.Tensor:
    return w + (fake_quantize(w.detach(), group) - w).detach()


def quantized_weights(bridge, chunk, cfg: Int4Config, layer_offset: int, expert_offset: int, tp: int,
                      expert_tp: int) -> list[tuple[str, torch.nn.Module]]:
    """(canonical name, owning module) of the weights of ``chunk`` (a GPTModel) to fake-quantize; ValueError for a
    weight the rounding could not follow exactly."""
    from forge_megatron.weight_sync.gather import unwrap

    model = unwrap(chunk)
    probe = torch.empty(2, 2, device="meta")
    out = []
    for module_name, module in model.named_modules():
        param = module._parameters.get("weight")
        if param is None or param.dim() != 2:
            continue
        local = f"{module_name}.weight"
        if local == "output_layer.weight" and bridge.cfg.tie_word_embeddings:
            continue
        canonical = bridge.rename(local, layer_offset, 0)
        if bridge.is_expert(canonical):
            canonical = bridge.rename(canonical, 0, expert_offset)
        hf = bridge.hf_names(canonical)
        quantized = [cfg.quantizes(h, probe) for h in hf]
        if not any(quantized):
            continue
        rule, _ = bridge.rule(canonical)
        if not all(quantized) or rule.join not in _JOINS:
            raise ValueError(f"--int4-qat: {canonical!r} joins HF tensors {hf} of which the release quantizes "
                             f"{[h for h, q in zip(hf, quantized) if q]} (layout {rule.join!r}): not supported")
        split = expert_tp if bridge.is_expert(canonical) else tp
        if rule.tp == "row" and split > 1 and param.shape[1] % cfg.group:
            raise ValueError(f"--int4-qat: {canonical!r} is split by columns over {split} ranks into "
                             f"{param.shape[1]}, not a multiple of the group size {cfg.group}")
        out.append((canonical, module))
    return out


def install(bridge, chunks, cfg: Int4Config) -> list[str]:
    """Fake-quantize, in every forward, the weights of ``chunks`` (this rank's model chunks) that the int4 release
    described by ``cfg`` quantizes; returns their canonical names (this rank's)."""
    from megatron.core import parallel_state as ps

    from forge_megatron.weight_sync.gather import global_layers, unwrap

    ep_rank = ps.get_expert_model_parallel_rank() if ps.model_parallel_is_initialized() else 0
    ep = ps.get_expert_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    etp = ps.get_expert_tensor_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    expert_offset = ep_rank * ((bridge.cfg.num_moe_experts or 0) // ep)
    names = []
    for chunk in chunks:
        model = unwrap(chunk)
        if getattr(model.config, "gradient_accumulation_fusion", False):
            raise ValueError("--int4-qat needs gradient-accumulation fusion off (it writes the weight's gradient "
                             "past the straight-through estimator)")
        offset = global_layers(model).start
        for name, module in quantized_weights(bridge, model, cfg, offset, expert_offset, tp, etp):
            _hook(module, cfg.group)
            names.append(name)
    return names


def _hook(module: torch.nn.Module, group: int) -> None:
    def swap_in(mod, args):
        param = mod._parameters["weight"]
        mod._forge_qat_param = param
        mod._parameters["weight"] = _straight_through(param, group)

    def swap_back(mod, args, output):
        param = getattr(mod, "_forge_qat_param", None)
        if param is not None:
            mod._parameters["weight"] = param
            mod._forge_qat_param = None

    module.register_forward_pre_hook(swap_in)
    module.register_forward_hook(swap_back, always_call=True)
