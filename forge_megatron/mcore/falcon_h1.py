"""Falcon-H1's parallel hybrid layers: attention and a Mamba-2 mixer side by side on one normalised input, with its
muP multipliers.

    n = RMSNorm(x)
    h = x + c_ao Attn(c_ai n) + c_mo Mamba2(n)        (Mamba2 scales its own input and in_proj segments)
    y = h + c_down MLP_gate(c_gate)(RMSNorm(h))

:class:`ParallelHybridLayer` is Megatron's TransformerLayer with one more submodule, ``mamba`` (forge's tree
Mamba-2 mixer, mcore/mamba2.py), run beside ``self_attention``: a forward pre-hook on the attention keeps its input
(the input norm's output) and its keyword arguments (the tree's packed params and mask) and hands the attention
``c_ai n``; a forward hook then returns ``c_ao attn + c_mo mamba(n)`` as the attention's output, which Megatron's
bias-dropout-add joins to the residual. The attention spec stays Megatron's (the tree model swaps in TreeAttention
as for any layer), and tensor, sequence and context parallelism apply to each mixer as they do on their own (both
read the same [s/tp, b, h] slice under sequence parallelism; the Mamba-2 mixer trades tokens for groups under CP as
in Granite 4.0-H's layers). The key multiplier is the attention's softmax scale (q . c k = c q . k), and the MLP's
gate and down multipliers are hooks on ``linear_fc1`` (each TP rank's gate rows are the first half of its output)
and on the MLP (:func:`scale_mlps`).
"""

from __future__ import annotations

import dataclasses

from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules


@dataclasses.dataclass
class ParallelHybridSubmodules(TransformerLayerSubmodules):
    """Megatron's layer submodules plus the Mamba-2 mixer run beside the attention."""

    mamba: ModuleSpec | type | None = None


class ParallelHybridLayer(TransformerLayer):
    """Megatron's TransformerLayer whose attention output is ``c_ao Attn(c_ai n) + c_mo Mamba2(n)`` (module
    docstring); ``multipliers`` = (c_ai, c_ao, c_mo)."""

    def __init__(self, config, submodules: ParallelHybridSubmodules, *args,
                 multipliers: tuple[float, float, float] = (1.0, 1.0, 1.0), **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.mamba = build_module(submodules.mamba, config=self.config, layer_number=self.layer_number,
                                  pg_collection=kwargs.get("pg_collection"))
        self.attention_in, self.attention_out, self.mamba_out = (float(x) for x in multipliers)
        self._mixer_input = None
        self.self_attention.register_forward_pre_hook(self._keep_input, with_kwargs=True)
        self.self_attention.register_forward_hook(self._add_mamba, with_kwargs=True)

    def _keep_input(self, module, args, kwargs):
        self._mixer_input = (args[0], kwargs.get("attention_mask"), kwargs.get("packed_seq_params"))
        if self.attention_in == 1.0:
            return None
        return (args[0] * self.attention_in, *args[1:]), kwargs

    def _add_mamba(self, module, args, kwargs, output):
        (normed, mask, packed), self._mixer_input = self._mixer_input, None
        out, bias = output
        mixed, mixed_bias = self.mamba(normed, attention_mask=mask, packed_seq_params=packed)
        if bias is not None or mixed_bias is not None:
            raise ValueError("Falcon-H1's mixers have no output biases (projectors_bias)")
        return out * self.attention_out + mixed * self.mamba_out, None


def parallel_hybrid_spec(spec, mamba: ModuleSpec, multipliers: tuple[float, float, float]):
    """``spec`` (a layer or block spec) with every layer a :class:`ParallelHybridLayer` running ``mamba`` beside its
    attention."""
    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(spec, layer_specs=[parallel_hybrid_spec(s, mamba, multipliers)
                                                      for s in spec.layer_specs])
    fields = {f.name: getattr(spec.submodules, f.name) for f in dataclasses.fields(spec.submodules) if f.init}
    return dataclasses.replace(spec, module=ParallelHybridLayer, submodules=ParallelHybridSubmodules(**fields,
                                                                                                    mamba=mamba),
                               params={**(spec.params or {}), "multipliers": tuple(multipliers)})


def scale_mlps(model, gate: float, down: float) -> None:
    """Falcon-H1's MLP multipliers as hooks on every dense MLP: the activation's input (the gate rows of each TP
    rank's ``linear_fc1`` output, its first half) times ``gate``, the MLP's output times ``down``."""
    from megatron.core.transformer.mlp import MLP

    def scale_gate(module, args, output):
        out, bias = output
        if bias is not None:
            raise ValueError("Falcon-H1's MLPs have no biases (mlp_bias)")
        return out * _gate_scale(out, gate), None

    def scale_out(module, args, output):
        out, bias = output
        return out * down, (bias * down if bias is not None else None)

    for module in list(model.modules()):
        if isinstance(module, MLP):
            if gate != 1.0:
                module.linear_fc1.register_forward_hook(scale_gate)
            if down != 1.0:
                module.register_forward_hook(scale_out)


def _gate_scale(out, gate: float):
    """The fc1 output's scale along its last dim: ``gate`` on its first half (this TP rank's gate rows), 1 on the
    rest (its up rows), in ``out``'s dtype and device."""
    import torch

    scale = torch.ones(out.shape[-1], dtype=out.dtype, device=out.device)
    scale[:out.shape[-1] // 2] = gate
    return scale
