"""Gemma 4's attention and layer scalars in Megatron-Core (the text model: Gemma4ForCausalLM, and the language model
of Gemma4ForConditionalGeneration).

Gemma 4 interleaves local layers (a sliding window, plain RoPE of base 10k on heads of ``head_dim``) with global
ones that have their own geometry: heads of ``global_head_dim`` (512), ``num_global_key_value_heads`` key heads and,
with ``attention_k_eq_v``, no value projection at all (the values are the keys as projected, before the key norm).
Every layer normalises its values by a scale-free RMSNorm (``v_norm``), queries and keys by per-head RMSNorms, and
scales attention by 1. The global layers rotate with *proportional* RoPE: frequencies base^(-2i / d) over the whole
head (d = 512) for the first ``partial_rotary_factor`` * d / 2 pairs and 0 for the rest, the pairs being (i, i + d/2)
as in rotate_half, so the head's two halves each keep their last 3/4 unrotated. Each layer's output (the residual
stream itself, after both sublayers) is multiplied by a ``layer_scalar`` the checkpoint holds.

Megatron builds one attention geometry (``kv_channels``, ``num_query_groups``) and one rotary table for a model.
:class:`Gemma4SelfAttention` is a ``SelfAttention`` built with a per-layer copy of the config (its own head size and
key heads, hence its own ``linear_qkv``, ``linear_proj``, q/k norms and core attention), ``linear_qkv`` holding per
query group the group's queries then its key (and its value unless the values are the keys). A global layer turns the
rotary table it is handed (the model's: plain RoPE of the local layers, whose first frequency is base^0 = 1, so the
angle of channel 0 is the token's position, or its depth in a prefix tree) into its own proportional one, so the tree
model's depth-indexed table and a recomputed layer both work unchanged.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.transformer.attention import SelfAttention


def proportional_inv_freq(head_dim: int, base: float, fraction: float = 1.0, factor: float = 1.0) -> torch.Tensor:
    """transformers' "proportional" RoPE frequencies [head_dim / 2]: base^(-2i / head_dim) for the first
    int(fraction * head_dim / 2) pairs, 0 (no rotation) for the others; all divided by ``factor``."""
    rotated = int(fraction * head_dim // 2)
    inv = 1.0 / (base ** (torch.arange(0, 2 * rotated, 2, dtype=torch.float32) / head_dim))
    return torch.cat([inv, torch.zeros(head_dim // 2 - rotated)]) / factor


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """A scale-free RMSNorm over the last dim in fp32 (transformers' Gemma4RMSNorm(with_scale=False))."""
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)


class Gemma4SelfAttention(SelfAttention):
    """Self-attention of one Gemma 4 layer (see the module docstring).

    ``kv_channels`` / ``num_query_groups``: this layer's head size and key heads (None: the model's);
    ``values_from_keys``: no value projection, the values are the projected keys (``attention_k_eq_v``);
    ``value_norm``: a scale-free RMSNorm on the values; ``rotary``: (base, fraction, factor) of this layer's
    proportional RoPE, None to use the table it is handed."""

    def __init__(self, config, submodules, layer_number, *args, kv_channels: int | None = None,
                 num_query_groups: int | None = None, values_from_keys: bool = False, value_norm: bool = False,
                 rotary: tuple[float, float, float] | None = None, **kwargs):
        if kv_channels is not None or num_query_groups is not None:
            config = copy.copy(config)  # this layer's geometry; everything else is the model's
            config.kv_channels = kv_channels or config.kv_channels
            config.num_query_groups = num_query_groups or config.num_query_groups
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        tp = self.config.num_attention_heads // self.num_attention_heads_per_partition
        if self.config.num_query_groups % tp:
            raise ValueError(f"layer {layer_number}: tensor parallelism {tp} must divide its "
                             f"{self.config.num_query_groups} key heads")
        self.values_from_keys = values_from_keys
        if values_from_keys:  # [q heads of the group, its key] per query group: no value rows
            self.linear_qkv_out_dim = self.query_projection_size + self.kv_projection_size
            self.linear_qkv = submodules.linear_qkv(
                self.config.hidden_size, self.linear_qkv_out_dim, config=self.config,
                init_method=self.config.init_method, gather_output=False,
                bias=self.config.add_bias_linear or self.config.add_qkv_bias, skip_bias_add=False, is_expert=False,
                tp_comm_buffer_name="qkv", tp_group=self.pg_collection.tp)
        self.value_norm_eps = self.config.layernorm_epsilon if value_norm else None
        # a plain attribute, not a buffer: Float16Module would round a buffer to bf16
        self.rotary_inv_freq = (proportional_inv_freq(self.hidden_size_per_attention_head, *rotary)
                                if rotary is not None else None)

    def forward(self, *args, **kwargs):
        table = kwargs.get("rotary_pos_emb")
        if self.rotary_inv_freq is not None and table is not None:
            kwargs["rotary_pos_emb"] = (tuple(self._own_table(t) for t in table) if isinstance(table, tuple)
                                        else self._own_table(table))
        return super().forward(*args, **kwargs)

    def _own_table(self, table: torch.Tensor) -> torch.Tensor:
        """This layer's angles [S, 1, 1, head_dim] for the positions of the model's table [S, 1, 1, D] (its channel
        0's angle: position * base^0; the halves repeat the frequencies, Megatron's non-interleaved layout)."""
        pos_S = table.reshape(table.shape[0], -1)[:, 0].float()
        freqs = pos_S[:, None] * self.rotary_inv_freq.to(pos_S.device)
        return torch.cat([freqs, freqs], dim=-1).view(table.shape[0], *([1] * (table.dim() - 2)), -1).to(table.dtype)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True,
                                    **kwargs):
        if not self.values_from_keys and self.value_norm_eps is None:
            return super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate=output_gate,
                                                       split_qkv=split_qkv, **kwargs)
        if key_value_states is not None or output_gate or not split_qkv:
            raise ValueError("Gemma 4 attention: self-attention with the unfused q/k/v split only (no output gate, "
                             "no cross-attention, no fused single-QKV RoPE)")
        mixed, _ = self.linear_qkv(hidden_states)
        groups = self.num_query_groups_per_partition
        per_group = self.num_attention_heads_per_partition // groups
        d = self.hidden_size_per_attention_head
        mixed = mixed.view(*mixed.shape[:-1], groups, -1)
        if self.values_from_keys:
            query, key = mixed.split([per_group * d, d], dim=-1)
            value = key  # the keys as projected: the key norm and RoPE come after
        else:
            query, key, value = mixed.split([per_group * d, d, d], dim=-1)
        query = query.reshape(*query.shape[:2], -1, d)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        if self.value_norm_eps is not None:
            value = _rms(value, self.value_norm_eps)
        return query, key.contiguous(), value.contiguous()


def attention_spec(attn_spec, **params):
    """``attn_spec`` (a SelfAttention ModuleSpec) built as :class:`Gemma4SelfAttention` with ``params``."""
    import dataclasses

    return dataclasses.replace(attn_spec, module=Gemma4SelfAttention, params={**(attn_spec.params or {}), **params})


def add_layer_scalars(model) -> None:
    """Give each layer of ``model`` (a GPTModel stage) a ``layer_scalar`` buffer (1 until a checkpoint sets it)
    multiplying its output: transformers' ``hidden_states *= self.layer_scalar`` after both residual adds."""

    def scale(module, args, output):
        if isinstance(output, tuple):
            return (output[0] * module.layer_scalar.to(output[0].dtype),) + tuple(output[1:])
        return output * module.layer_scalar.to(output.dtype)

    for layer in model.decoder.layers:
        weight = next(layer.parameters())
        layer.register_buffer("layer_scalar", torch.ones(1, dtype=weight.dtype, device=weight.device))
        layer.register_forward_hook(scale)
