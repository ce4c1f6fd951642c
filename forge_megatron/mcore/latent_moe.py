"""Latent MoE (NVIDIA's LatentMoE: Nemotron 3 Super / Ultra, ``moe_latent_size``) without Transformer Engine.

The router reads the hidden state; the routed experts work in a narrower latent space: ``fc1_latent_proj``
(hidden -> latent) before dispatch, the experts latent -> F -> latent, the weighted sum combined in the latent space,
``fc2_latent_proj`` (latent -> hidden) after it; the shared expert reads the hidden state as usual. transformers'
NemotronHMoE computes the same (its experts weight their outputs before ``fc2_latent_proj``, which is linear).

Megatron-Core builds the two projections as Transformer Engine ``TELinear(parallel_mode="duplicated")``: the whole
weight on every tensor-parallel rank, applied to the rank's own tokens. Without TE (CPU, or a GPU job on Megatron's
local spec) :class:`LatentMoELayer` builds Megatron's own ``MoELayer`` with :class:`DuplicatedLinear` in TE's place,
the same parameters under the same names. Under sequence parallelism each TP rank projects other tokens, so the
weights are marked ``sequence_parallel`` and Megatron's ``finalize_model_grads`` sums their gradients over the TP
group (as it does for the norms); without it every TP rank sees every token and holds the same gradient.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.moe_layer import MoELayer


class DuplicatedLinear(torch.nn.Module):
    """``y = x W^T (+ b)`` with the whole weight on every TP rank: the part of TE's ``TELinear`` that Megatron's
    ``MoELayer`` uses for its latent projections (``parallel_mode="duplicated"``); returns ``(y, None)`` as a Megatron
    linear with ``skip_bias_add=False`` does."""

    def __init__(self, input_size: int, output_size: int, *, parallel_mode: str | None, config, init_method,
                 bias: bool, skip_bias_add: bool, skip_weight_param_allocation: bool = False, is_expert: bool = False,
                 **_):
        super().__init__()
        if parallel_mode != "duplicated" or skip_bias_add or skip_weight_param_allocation or is_expert:
            raise ValueError("DuplicatedLinear stands in for TELinear(parallel_mode='duplicated') only (MoE latent "
                             "projections)")
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else \
            torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype,
                                                     device=device))
        self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype, device=device)) \
            if bias else None
        if config.perform_initialization:
            init_method(self.weight)
        for p in self.parameters():  # summed over TP by finalize_model_grads when the job is sequence parallel
            p.sequence_parallel = True

    def forward(self, x: torch.Tensor):
        return F.linear(x, self.weight, self.bias), None


@contextlib.contextmanager
def _duplicated_in_place_of_te():
    """Megatron's ``moe_layer`` module building its latent projections as :class:`DuplicatedLinear` (while a
    :class:`LatentMoELayer` is constructed)."""
    from megatron.core.transformer.moe import moe_layer

    saved = moe_layer.HAVE_TE, getattr(moe_layer, "TELinear", None)
    moe_layer.HAVE_TE, moe_layer.TELinear = True, DuplicatedLinear
    try:
        yield
    finally:
        moe_layer.HAVE_TE = saved[0]
        if saved[1] is None:
            del moe_layer.TELinear
        else:
            moe_layer.TELinear = saved[1]


class LatentMoELayer(MoELayer):
    """Megatron's MoELayer whose ``fc1_latent_proj`` / ``fc2_latent_proj`` are :class:`DuplicatedLinear` (see the
    module docstring)."""

    def __init__(self, *args, **kwargs):
        with _duplicated_in_place_of_te():
            super().__init__(*args, **kwargs)


def latent_spec(spec):
    """``spec`` (a layer or block spec) with Megatron's ``MoELayer`` built as :class:`LatentMoELayer`."""
    from forge_megatron.mcore.model import swap_spec_modules

    return swap_spec_modules(spec, {MoELayer: LatentMoELayer})
