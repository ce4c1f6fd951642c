"""Parallel attention and MLP (Cohere's Command R / R7B / A / A+ layers), and the bias-free LayerNorm they use.

A pre-norm layer runs its sublayers one after the other, each behind its own norm; Cohere's layer runs both on the
same normalised input and adds both outputs to the residual stream at once:

    sequential (Megatron's TransformerLayer)     parallel (Cohere)
    h = x + Attn(Norm_a(x))                       n = Norm(x)
    y = h + MLP(Norm_m(h))                        y = x + Attn(n) + MLP(n)

Since ``x + Attn(n)`` is what Megatron's layer carries from its attention to its MLP as the residual, the parallel
layer is Megatron's with one change: the MLP's input is the input norm's output instead of a second norm of ``h``.
:class:`ParallelTransformerLayer` keeps the input norm's output (a forward hook) and hands it to the MLP in place
of ``pre_mlp_layernorm`` (which the spec makes an identity: the layer has no such weights). Everything else of
Megatron's layer stays: bias-dropout-add, tensor and sequence parallelism (both sublayers take the same [s/tp, b, h]
slice of normalised tokens), MoE, context parallelism, full-layer recomputation (which reruns the hook). The sum
matches transformers' ``residual + attn + mlp`` to the bit, in the same order.

What it refuses: Transformer Engine's spec (it fuses the input norm into ``linear_qkv``, so no module makes the
normalised input the MLP needs), and recomputing the norms alone (``--recompute-modules layernorm``: Megatron frees
the norm's output after the attention's projection has used it).
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import TransformerLayer


class ParallelTransformerLayer(TransformerLayer):
    """Megatron's TransformerLayer whose MLP reads the input norm's output (module docstring)."""

    def __init__(self, config, submodules, *args, **kwargs):
        if submodules.input_layernorm is IdentityOp:
            raise ValueError("a parallel attention + MLP layer needs its input norm as a module of its own (the local "
                             "spec): Transformer Engine's fuses it into linear_qkv")
        super().__init__(config, submodules, *args, **kwargs)
        if getattr(self, "recompute_input_layernorm", False) or getattr(self, "recompute_pre_mlp_layernorm", False):
            raise ValueError("parallel attention + MLP layers (Cohere) cannot recompute their norms alone "
                             "(--recompute-modules layernorm): the MLP reads the input norm's output, which that "
                             "recomputation frees; recompute whole layers instead")
        self._normed = None
        self.input_layernorm.register_forward_hook(self._keep_normed)

    def _keep_normed(self, module, args, output):
        self._normed = output

    def _forward_pre_mlp_layernorm(self, hidden_states):
        normed, self._normed = self._normed, None
        if normed is None:
            raise RuntimeError("the parallel layer's MLP ran before its input norm")
        return normed


def parallel_spec(spec):
    """``spec`` (a layer spec, or a block spec of layer specs) as parallel attention + MLP layers: the MLP reads the
    input norm's output, and the layer builds no norm of its own before the MLP."""
    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(spec, layer_specs=[parallel_spec(s) for s in spec.layer_specs])
    subs = dataclasses.replace(spec.submodules, pre_mlp_layernorm=IdentityOp)
    return dataclasses.replace(spec, module=ParallelTransformerLayer, submodules=subs)


class BiasFreeLayerNorm(torch.nn.Module):
    """LayerNorm with a weight and no bias, computed as transformers' Cohere norm does: centre, normalise and scale
    in fp32, then cast back to the input's dtype. Under sequence parallelism its weight is marked so that
    Megatron sums its gradient over the TP group (each TP rank normalises its own tokens), as for the other norms."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x):
        xf = x.float()
        centred = xf - xf.mean(-1, keepdim=True)
        y = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)


def bias_free_norms(spec):
    """``spec`` (a layer or block spec) with every norm Megatron's local spec builds (its torch-norm wrapper or our
    sequence-parallel one) replaced by :class:`BiasFreeLayerNorm`; a block spec's final norm too."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from forge_megatron.mcore.model import SequenceParallelNorm, swap_spec_modules

    return swap_spec_modules(spec, {WrappedTorchNorm: BiasFreeLayerNorm, SequenceParallelNorm: BiasFreeLayerNorm})
