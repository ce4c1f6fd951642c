"""A sigmoid gate per attention head from its own projection (LFM3's ``g_proj``; Laguna's softplus one, per head or
per channel).

LFM3's attention scales each head's output o_n (the softmax-weighted values, before the output projection) by one
scalar per token and head:

    o_n <- o_n * sigmoid(x . g_n)        x: the attention's input (after its norm), g_n: row n of g_proj [heads, hidden]

Megatron's ``attention_output_gate`` (Qwen3.5's) gates every channel of every head from the query projection's second
half; a gate per head is not that (copies of one row per channel would train apart), so :class:`HeadGatedSelfAttention`
keeps the rows as their own column-parallel linear ``linear_gate`` (each TP rank the rows of its heads: Megatron's
heads are the checkpoint's in order, whole query groups per rank) and applies them by hooks: one before the attention
computes the gates from its input (with sequence parallelism the linear gathers the sequence, as ``linear_qkv`` does),
one before ``linear_proj`` multiplies them in. The core attention in between may be anything that keeps Megatron's
output layout [tokens, batch, heads x head_dim] (the tree attention does), so the tree model gates the same.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.attention import SelfAttention


class HeadGatedSelfAttention(SelfAttention):
    """Megatron's SelfAttention with a gate per head (module docstring); ``activation`` "sigmoid" (LFM3) or "softplus"
    (Laguna), ``per_element``: a gate per channel of every head (Laguna's ``gating: per-element``)."""

    def __init__(self, config, submodules, *args, activation: str = "sigmoid", per_element: bool = False, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        attach_head_gate(self, activation, per_element)


def attach_head_gate(attn, activation: str = "sigmoid", per_element: bool = False) -> None:
    """Give ``attn`` (a Megatron SelfAttention, its ``config`` holding its own head count) a column-parallel
    ``linear_gate`` and the two hooks that compute the gates from its input and multiply them into ``linear_proj``'s.
    Sigmoid in the activations' dtype (LFM3, as transformers); softplus in fp32, cast back (Laguna, as transformers)."""
    if activation not in ("sigmoid", "softplus"):
        raise ValueError(f"a head gate's activation is 'sigmoid' or 'softplus', got {activation!r}")
    config = attn.config
    heads = config.num_attention_heads
    width = heads * attn.hidden_size_per_attention_head if per_element else heads
    attn.linear_gate = ColumnParallelLinear(
        config.hidden_size, width, config=config, init_method=config.init_method,
        gather_output=False, bias=False, skip_bias_add=True, is_expert=False)
    state = {"gates": None}

    def compute(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        logits, _ = attn.linear_gate(hidden)
        state["gates"] = torch.sigmoid(logits) if activation == "sigmoid" else \
            torch.nn.functional.softplus(logits.float()).to(logits.dtype)  # [tokens, batch, this rank's gates]
        return None

    def apply(module, args):
        gates, state["gates"] = state["gates"], None
        if gates is None:
            raise RuntimeError("head gate: linear_proj ran without the gates of this forward")
        out = args[0]
        if per_element:
            return (out * gates.to(out.dtype), *args[1:])
        n = gates.shape[-1]
        gated = out.view(*out.shape[:-1], n, out.shape[-1] // n) * gates.unsqueeze(-1).to(out.dtype)
        return (gated.view(out.shape), *args[1:])

    attn.register_forward_pre_hook(compute, with_kwargs=True)
    attn.linear_proj.register_forward_pre_hook(apply)


def head_gate_spec(spec, activation: str = "sigmoid", per_element: bool = False):
    """``spec`` (a layer or block spec) with every standard self-attention a :class:`HeadGatedSelfAttention` (other
    mixers, such as a hybrid model's convolutions, are left as they are)."""
    import dataclasses

    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(spec, layer_specs=[head_gate_spec(s, activation, per_element)
                                                      for s in spec.layer_specs])
    attn = spec.submodules.self_attention
    if getattr(attn, "module", None) is not SelfAttention:
        raise TypeError(f"a gate per head needs Megatron's SelfAttention, got {getattr(attn, 'module', attn)!r}")
    attn = dataclasses.replace(attn, module=HeadGatedSelfAttention,
                               params={**(attn.params or {}), "activation": activation, "per_element": per_element})
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn))
