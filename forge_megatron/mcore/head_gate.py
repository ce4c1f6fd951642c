"""A sigmoid gate per attention head from its own projection (LFM3's ``g_proj``).

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
    """Megatron's SelfAttention with a sigmoid gate per head (module docstring)."""

    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.linear_gate = ColumnParallelLinear(
            config.hidden_size, config.num_attention_heads, config=config, init_method=config.init_method,
            gather_output=False, bias=False, skip_bias_add=True, is_expert=False)
        self._gates = None
        self.register_forward_pre_hook(self._compute_gates, with_kwargs=True)
        self.linear_proj.register_forward_pre_hook(self._apply_gates)

    def _compute_gates(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        logits, _ = self.linear_gate(hidden)
        self._gates = torch.sigmoid(logits)  # [tokens, batch, this rank's heads]
        return None

    def _apply_gates(self, module, args):
        gates, self._gates = self._gates, None
        if gates is None:
            raise RuntimeError("HeadGatedSelfAttention: linear_proj ran without the gates of this forward")
        out = args[0]
        heads = gates.shape[-1]
        gated = out.view(*out.shape[:-1], heads, out.shape[-1] // heads) * gates.unsqueeze(-1).to(out.dtype)
        return (gated.view(out.shape), *args[1:])


def head_gate_spec(spec):
    """``spec`` (a layer or block spec) with every standard self-attention a :class:`HeadGatedSelfAttention` (other
    mixers, such as a hybrid model's convolutions, are left as they are)."""
    import dataclasses

    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(spec, layer_specs=[head_gate_spec(s) for s in spec.layer_specs])
    attn = spec.submodules.self_attention
    if getattr(attn, "module", None) is not SelfAttention:
        raise TypeError(f"a gate per head needs Megatron's SelfAttention, got {getattr(attn, 'module', attn)!r}")
    attn = dataclasses.replace(attn, module=HeadGatedSelfAttention)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn))
