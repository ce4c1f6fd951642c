"""Gemma 4 in Megatron-Core (the text model: Gemma4ForCausalLM, and the language model of
Gemma4ForConditionalGeneration): its attention, layer scalars, per-layer inputs, KV sharing and MoE block. Its
per-layer attention also builds MiMo-V2-Flash's layers (value heads of their own size, scaled values, sinks in some
layers: :class:`Gemma4SelfAttention`'s ``value_channels``, ``value_scale``, ``softmax_type``).

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

E2B / E4B add per-layer inputs (:class:`PerLayerInputs`, made from the token ids and embeddings by a hook on the
embedding and gated into every layer's output by :func:`finish_layers`) and KV sharing: their last layers have no
key or value projection and attend to the normed, unrotated keys and the values an earlier layer of their kind left
in the model's ``kv_store`` during the forward (rotated again by the reuser's own table, which is the keeper's). The
store holds them until the next forward overwrites them. 26B-A4B runs routed experts beside the dense MLP (the MoE
block, below).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec, build_module


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
    proportional RoPE, None to use the table it is handed.

    Laguna: ``num_attention_heads``, this layer's query heads; ``partial_rotary``: (base, fraction) of this layer's
    plain RoPE over the first fraction of each head; ``head_gate``: (activation, per_element) of a gate per head from
    its own projection (mcore/head_gate.py).

    MiMo-V2-Flash: ``value_channels``, value heads of their own size (its queries and keys have 192 channels, its
    values 128: ``linear_qkv`` holds per query group the group's queries, its key, then its narrower value, and
    ``linear_proj`` takes heads x value_channels); ``value_scale``, the values multiplied by it as projected;
    ``softmax_type``, this layer's (``"learnable"``: a sink logit per head, in the sliding-window layers only)."""

    def __init__(self, config, submodules, layer_number, *args, kv_channels: int | None = None,
                 num_query_groups: int | None = None, values_from_keys: bool = False, value_norm: bool = False,
                 rotary: tuple[float, float, float] | None = None, kv_store: dict | None = None,
                 kv_from: int | None = None, keep_kv: bool = False, value_channels: int | None = None,
                 value_scale: float | None = None, softmax_type: str | None = None,
                 num_attention_heads: int | None = None, partial_rotary: tuple[float, float] | None = None,
                 head_gate: tuple[str, bool] | None = None, **kwargs):
        if kv_channels is not None or num_query_groups is not None or softmax_type is not None or \
                num_attention_heads is not None:
            config = copy.copy(config)  # this layer's geometry; everything else is the model's
            config.kv_channels = kv_channels or config.kv_channels
            config.num_query_groups = num_query_groups or config.num_query_groups
            config.softmax_type = softmax_type or config.softmax_type
            config.num_attention_heads = num_attention_heads or config.num_attention_heads
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        if head_gate is not None:  # (Laguna: a softplus gate per head, or per channel, from its own projection)
            from forge_megatron.mcore.head_gate import attach_head_gate

            attach_head_gate(self, *head_gate)
        tp = self.config.num_attention_heads // self.num_attention_heads_per_partition
        if self.config.num_query_groups % tp:
            raise ValueError(f"layer {layer_number}: tensor parallelism {tp} must divide its "
                             f"{self.config.num_query_groups} key heads")
        self.values_from_keys = values_from_keys
        # KV sharing (Gemma 4 E2B / E4B): a layer that keeps its normed keys and values (pre-RoPE) in ``kv_store``
        # under its 0-based number, and later layers that reuse them (``kv_from``) with a query projection only
        self.kv_store, self.kv_from, self.keep_kv = kv_store, kv_from, keep_kv
        if (kv_from is not None or keep_kv) and kv_store is None:
            raise ValueError("KV sharing needs the model's kv_store")
        if kv_from is not None:
            self.k_layernorm = None  # (a consumer has no key norm of its own)
        if values_from_keys or kv_from is not None:  # [q heads of the group, its key] per query group, or queries
            self.linear_qkv_out_dim = self.query_projection_size + (0 if kv_from is not None
                                                                    else self.kv_projection_size)
            self.linear_qkv = submodules.linear_qkv(
                self.config.hidden_size, self.linear_qkv_out_dim, config=self.config,
                init_method=self.config.init_method, gather_output=False,
                bias=self.config.add_bias_linear or self.config.add_qkv_bias, skip_bias_add=False, is_expert=False,
                tp_comm_buffer_name="qkv", tp_group=self.pg_collection.tp)
        self.value_channels = value_channels if value_channels != self.hidden_size_per_attention_head else None
        self.value_scale = value_scale
        if self.value_channels is not None:
            if values_from_keys or kv_from is not None or keep_kv:
                raise ValueError("value heads of their own size need a value projection of their own")
            self._value_heads_of_their_own(submodules, self.value_channels)
        self.value_norm_eps = self.config.layernorm_epsilon if value_norm else None
        # a plain attribute, not a buffer: Float16Module would round a buffer to bf16
        self.rotary_inv_freq = (proportional_inv_freq(self.hidden_size_per_attention_head, *rotary)
                                if rotary is not None else None)
        if partial_rotary is not None:  # (Laguna's global layers: plain RoPE over the first fraction of the head)
            if rotary is not None:
                raise ValueError("a layer rotates with proportional RoPE (rotary) or partial plain RoPE, not both")
            base, fraction = partial_rotary
            dim = int(self.hidden_size_per_attention_head * fraction)
            self.rotary_inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    def _value_heads_of_their_own(self, submodules, dv: int) -> None:
        """Rebuild ``linear_qkv`` ([queries, key, value] per query group, the value ``dv`` wide) and ``linear_proj``
        (heads x ``dv`` in) for values whose heads differ in size from the queries' and keys' (Megatron sizes both
        from ``kv_channels``)."""
        from megatron.core.transformer.spec_utils import build_module

        self.val_hidden_size = dv
        self.linear_qkv_out_dim = self.query_projection_size + self.kv_projection_size + \
            self.config.num_query_groups * dv
        self.linear_qkv = submodules.linear_qkv(
            self.config.hidden_size, self.linear_qkv_out_dim, config=self.config,
            init_method=self.config.init_method, gather_output=False,
            bias=self.config.add_bias_linear or self.config.add_qkv_bias, skip_bias_add=False, is_expert=False,
            tp_comm_buffer_name="qkv", tp_group=self.pg_collection.tp)
        self.linear_proj = build_module(
            submodules.linear_proj, self.config.num_attention_heads * dv, self.config.hidden_size,
            config=self.config, init_method=self.config.output_layer_init_method, bias=self.config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_comm_buffer_name="proj",
            tp_group=self.pg_collection.tp)

    def forward(self, *args, **kwargs):
        table = kwargs.get("rotary_pos_emb")
        if self.rotary_inv_freq is not None and table is not None:
            kwargs["rotary_pos_emb"] = (tuple(self._own_table(t) for t in table) if isinstance(table, tuple)
                                        else self._own_table(table))
        return super().forward(*args, **kwargs)

    def _own_table(self, table: torch.Tensor) -> torch.Tensor:
        """This layer's angles [S, 1, 1, 2 F] for the positions of the model's table [S, 1, 1, D] (its channel 0's
        angle: position * base^0; the halves repeat the F frequencies, Megatron's non-interleaved layout; F < head_dim
        / 2: Megatron rotates the first 2 F channels only)."""
        pos_S = table.reshape(table.shape[0], -1)[:, 0].float()
        freqs = pos_S[:, None] * self.rotary_inv_freq.to(pos_S.device)
        return torch.cat([freqs, freqs], dim=-1).view(table.shape[0], *([1] * (table.dim() - 2)), -1).to(table.dtype)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True,
                                    **kwargs):
        if not self.values_from_keys and self.value_norm_eps is None and self.kv_from is None and not self.keep_kv \
                and self.value_channels is None and self.value_scale is None:
            return super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate=output_gate,
                                                       split_qkv=split_qkv, **kwargs)
        if key_value_states is not None or output_gate or not split_qkv:
            raise ValueError("per-layer attention: self-attention with the unfused q/k/v split only (no output gate, "
                             "no cross-attention, no fused single-QKV RoPE)")
        mixed, _ = self.linear_qkv(hidden_states)
        groups = self.num_query_groups_per_partition
        per_group = self.num_attention_heads_per_partition // groups
        d = self.hidden_size_per_attention_head
        if self.kv_from is not None:
            if self.kv_from not in self.kv_store:
                raise RuntimeError(f"layer {self.layer_number} reuses layer {self.kv_from + 1}'s keys and values, "
                                   "which did not run in this forward")
            query = mixed.view(*mixed.shape[:2], -1, d)
            if self.q_layernorm is not None:
                query = self.q_layernorm(query)
            key, value = self.kv_store[self.kv_from]
            return query, key, value
        mixed = mixed.view(*mixed.shape[:-1], groups, -1)
        if self.values_from_keys:
            query, key = mixed.split([per_group * d, d], dim=-1)
            value = key  # the keys as projected: the key norm and RoPE come after
        else:
            query, key, value = mixed.split([per_group * d, d, self.value_channels or d], dim=-1)
        query = query.reshape(*query.shape[:2], -1, d)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        if self.value_norm_eps is not None:
            value = _rms(value, self.value_norm_eps)
        if self.value_scale is not None:  # (MiMo-V2-Flash: in the activations' dtype, as transformers scales them)
            value = value * self.value_scale
        key, value = key.contiguous(), value.contiguous()
        if self.keep_kv:
            self.kv_store[self.layer_number - 1] = (key, value)
        return query, key, value


class WidthMLP(MLP):
    """Megatron's MLP of ``ffn_hidden_size`` (Gemma 4's double-wide MLPs in the KV-shared layers): built with a
    config copy of that width, since Megatron-Core 0.16 sizes ``linear_fc2``'s input by the config's."""

    def __init__(self, config, submodules, *args, ffn_hidden_size: int | None = None, **kwargs):
        if ffn_hidden_size is not None:
            config = copy.copy(config)
            config.ffn_hidden_size = ffn_hidden_size
        super().__init__(config, submodules, *args, ffn_hidden_size=ffn_hidden_size, **kwargs)


def attention_spec(attn_spec, **params):
    """``attn_spec`` (a SelfAttention ModuleSpec) built as :class:`Gemma4SelfAttention` with ``params``."""
    return dataclasses.replace(attn_spec, module=Gemma4SelfAttention, params={**(attn_spec.params or {}), **params})


class _WeightedRMSNorm(torch.nn.Module):
    """transformers' Gemma4RMSNorm (x * (mean(x^2) + eps)^-0.5 * weight, in fp32), for the per-layer-input norms."""

    def __init__(self, dim: int, eps: float, config):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel  # replicated: gradients summed over TP under SP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5) * self.weight.float()).to(x.dtype)


def _replicated_linear(n_in: int, n_out: int, config) -> torch.nn.Linear:
    linear = torch.nn.Linear(n_in, n_out, bias=False, dtype=config.params_dtype)
    linear.weight.sequence_parallel = config.sequence_parallel
    return linear


class PerLayerInputs(MegatronModule):
    """Gemma 4 E2B / E4B's per-layer embeddings (PLE): for every token a [layers, width] table of inputs, one row per
    layer, (N(W x * hidden^-0.5) + E[token] * sqrt(width)) / sqrt(2) with x the (scaled) token embedding, W the
    ``model_projection``, N an RMSNorm over each row and E the ``word_embeddings`` table (vocabulary x layers * width).
    Replicated on every TP rank (the trainer refuses PP for these models)."""

    def __init__(self, config, num_layers: int, width: int, vocab: int, pad: int | None = None):
        super().__init__(config=config)
        self.num_layers, self.width = num_layers, width
        # (``pad``: the pad token's row takes no gradient, as transformers' table has it: images look it up)
        self.word_embeddings = torch.nn.Embedding(vocab, num_layers * width, padding_idx=pad,
                                                  dtype=config.params_dtype)
        self.word_embeddings.weight.sequence_parallel = config.sequence_parallel
        self.model_projection = _replicated_linear(config.hidden_size, num_layers * width, config)
        self.projection_norm = _WeightedRMSNorm(width, config.layernorm_epsilon, config)

    def forward(self, input_ids: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """[s, b, layers, width] for ``embeddings`` [s, b, hidden] (this rank's tokens: under sequence parallelism
        a contiguous slice of the sequence) of ``input_ids`` [b, S]."""
        ids = input_ids.t()  # [S, b]
        if ids.shape[0] != embeddings.shape[0]:  # sequence parallel: this rank's slice
            from megatron.core import parallel_state as ps

            s = embeddings.shape[0]
            rank = ps.get_tensor_model_parallel_rank()
            ids = ids[rank * s:(rank + 1) * s]
        table = self.word_embeddings(ids)
        table = table * torch.tensor(self.width ** 0.5, dtype=table.dtype)  # (the scale in the weights' dtype, as HF)
        proj = self.model_projection(embeddings) * self.config.hidden_size ** -0.5
        proj = self.projection_norm(proj.view(*proj.shape[:2], self.num_layers, self.width))
        return (proj + table.view_as(proj)) * 2.0 ** -0.5


def finish_layers(model, cfg) -> None:
    """Each layer of ``model`` (a GPTModel stage) ends as Gemma 4's does (a forward hook on the layer): with per-layer
    inputs (``cfg.per_layer_input_size``), h + N(P(gelu(G(h)) * input_l)) with G ``per_layer_input_gate`` (hidden ->
    width), P ``per_layer_projection`` and N ``post_per_layer_input_norm``; then, with ``cfg.layer_scalars``, times
    the layer's ``layer_scalar`` buffer (1 until a checkpoint sets it). The per-layer inputs are made from the token
    ids (kept by a hook on the embedding) and the first layer's input (:class:`PerLayerInputs`,
    ``model.embedding.per_layer``, by a pre-hook on the first layer): the embeddings, or for a vision-language
    release's images (``cfg.per_layer_image_token``) the image features mcore/vision.py put there, their ids the pad
    token's, as transformers' Gemma4Model makes them."""
    config = model.config
    holder = {}
    width = cfg.per_layer_input_size
    if width:
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() > 1:
            raise ValueError("per-layer inputs (Gemma 4 E2B / E4B) are made on the first pipeline stage and used by "
                             "every layer: train these models without pipeline parallelism")
        pad = cfg.per_layer_image_token[1] if cfg.per_layer_image_token is not None else None
        model.embedding.per_layer = PerLayerInputs(config, cfg.num_layers, width, cfg.per_layer_input_vocab, pad)

        def keep_ids(module, args, kwargs, output):  # (GPTModel passes input_ids by keyword)
            ids = args[0] if args else kwargs["input_ids"]
            if cfg.per_layer_image_token is not None:
                image, pad = cfg.per_layer_image_token
                ids = torch.where(ids == image, torch.full_like(ids, pad), ids)
            holder["ids"] = ids

        def make_inputs(module, args, kwargs):  # the first layer's input: the embeddings, images' features in place
            h = args[0] if args else kwargs["hidden_states"]
            holder["inputs"] = model.embedding.per_layer(holder["ids"], h.unwrap() if hasattr(h, "unwrap") else h)

        model.embedding.register_forward_hook(keep_ids, with_kwargs=True)
        model.decoder.layers[0].register_forward_pre_hook(make_inputs, with_kwargs=True)

    def finish(module, args, output):
        h = output[0] if isinstance(output, tuple) else output
        if width:
            inputs = holder["inputs"][..., module.layer_number - 1, :]
            g = torch.nn.functional.gelu(module.per_layer_input_gate(h), approximate="tanh") * inputs.to(h.dtype)
            h = h + module.post_per_layer_input_norm(module.per_layer_projection(g))
        if cfg.layer_scalars:
            h = h * module.layer_scalar.to(h.dtype)
        return (h,) + tuple(output[1:]) if isinstance(output, tuple) else h

    for layer in model.decoder.layers:
        weight = next(layer.parameters())
        if cfg.layer_scalars:
            layer.register_buffer("layer_scalar", torch.ones(1, dtype=weight.dtype, device=weight.device))
        if width:
            layer.per_layer_input_gate = _replicated_linear(config.hidden_size, width, config).to(weight.device)
            layer.per_layer_projection = _replicated_linear(width, config.hidden_size, config).to(weight.device)
            layer.post_per_layer_input_norm = _WeightedRMSNorm(config.hidden_size, config.layernorm_epsilon,
                                                               config).to(weight.device)
        layer.register_forward_hook(finish)


# ------------------------------------------------------------------------------------- the MoE block (26B-A4B)
# Gemma 4's MoE layers run a dense MLP and routed experts side by side on the attention block's output h:
#     y = h + N(N1(MLP(P1(h))) + N2(Experts_{router(h)}(P2(h))))
# with P1 / P2 the two branches' input norms, N1 / N2 their output norms and N the layer's post-MLP norm. In Megatron
# this is a MoELayer fed h itself (the layer's pre-MLP norm an identity) whose "shared expert" is the dense branch
# with its own norms (:class:`Gemma4DenseBranch`), which normalises the experts' input and output
# (:class:`Gemma4MoELayer`), and whose router is :class:`Gemma4Router`.


class Gemma4Router(TopKRouter):
    """Gemma 4's router: the logits of the token's scale-free RMSNorm times a learnt per-channel ``scale`` and
    hidden_size^-0.5; the softmax of the top k logits (transformers' softmax over every expert, top k, renormalised);
    each chosen expert's weight times its ``per_expert_scale``."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.scale = torch.nn.Parameter(torch.ones(config.hidden_size, dtype=config.params_dtype))
        self.per_expert_scale = torch.nn.Parameter(torch.ones(config.num_moe_experts, dtype=config.params_dtype))
        for p in (self.scale, self.per_expert_scale):  # replicated over TP: gradients summed under SP
            setattr(p, "sequence_parallel", config.sequence_parallel)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        x = _rms(input, self.config.layernorm_epsilon) * self.scale.to(input.dtype) * self.config.hidden_size ** -0.5
        return super().gating(x)

    def routing(self, logits: torch.Tensor, *args, **kwargs):
        probs, routing_map = super().routing(logits, *args, **kwargs)
        return probs * self.per_expert_scale.to(probs.dtype), routing_map


@dataclasses.dataclass
class Gemma4DenseSubmodules:
    """The dense branch of a Gemma 4 MoE layer: its input norm, its MLP, its output norm."""

    pre_norm: ModuleSpec | type = None
    mlp: ModuleSpec | type = None
    post_norm: ModuleSpec | type = None


class Gemma4DenseBranch(MegatronModule):
    """N1(MLP(P1(h))), built where Megatron's MoELayer builds its shared experts (its output is added to the experts'
    after their output norm); the MLP is the model's dense one (``ffn_hidden_size``)."""

    def __init__(self, config, submodules: Gemma4DenseSubmodules, pg_collection=None, gate: bool = False, **kwargs):
        super().__init__(config=config)
        if gate:
            raise ValueError("Gemma 4's dense branch has no shared-expert gate")
        norm = dict(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
        self.pre_norm = build_module(submodules.pre_norm, **norm)
        mlp_kwargs = {"tp_group": pg_collection.tp} if pg_collection is not None else {}
        self.mlp = build_module(submodules.mlp, config=config, **mlp_kwargs)
        self.post_norm = build_module(submodules.post_norm, **norm)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out, bias = self.mlp(self.pre_norm(hidden_states))
        if bias is not None:
            raise ValueError("Gemma 4's dense branch has no bias")
        return self.post_norm(out)


@dataclasses.dataclass
class Gemma4MoESubmodules(MoESubmodules):
    """Megatron's MoE submodules plus the experts' input and output norms."""

    pre_experts_norm: ModuleSpec | type = None
    post_experts_norm: ModuleSpec | type = None


class Gemma4MoELayer(MoELayer):
    """Megatron's MoELayer fed the attention block's output h: routed by :class:`Gemma4Router` on h, the experts run
    on P2(h) and their combined output is normalised by N2 before the dense branch's (the "shared experts") is
    added."""

    def __init__(self, config, submodules: Gemma4MoESubmodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        norm = dict(config=self.config, hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon)
        self.pre_experts_norm = build_module(submodules.pre_experts_norm, **norm)
        self.post_experts_norm = build_module(submodules.post_experts_norm, **norm)
        if not self.use_shared_expert or getattr(self, "shared_expert_overlap", False):
            raise ValueError("Gemma 4's MoE layer needs its dense branch as Megatron's (unoverlapped) shared expert")

    def preprocess(self, hidden_states, probs, routing_map, *args, **kwargs):
        return super().preprocess(self.pre_experts_norm(hidden_states), probs, routing_map, *args, **kwargs)

    def postprocess(self, output, shared_expert_output):
        output = self.token_dispatcher.combine_postprocess(output)
        return self.post_experts_norm(output) + shared_expert_output


def moe_layer_spec(layer_spec):
    """A Gemma 4 MoE layer from ``layer_spec``: a (post-norm) layer spec whose MLP is Megatron's MoELayer spec. Its
    pre-MLP norm moves into the dense branch (the MoE layer is fed h); the branches' norms are that norm's class."""
    subs = layer_spec.submodules
    norm = subs.pre_mlp_layernorm
    moe = subs.mlp
    if not isinstance(moe, ModuleSpec) or not isinstance(moe.submodules, MoESubmodules):
        raise TypeError(f"expected a MoE layer spec, got MLP {moe!r}")
    experts_subs = moe.submodules.experts.submodules  # the experts' linears: the dense MLP uses the same kinds
    dense = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=experts_subs.linear_fc1,
                                                            linear_fc2=experts_subs.linear_fc2))
    branch = ModuleSpec(module=Gemma4DenseBranch,
                        submodules=Gemma4DenseSubmodules(pre_norm=norm, mlp=dense, post_norm=norm))
    fields = {f.name: getattr(moe.submodules, f.name) for f in dataclasses.fields(moe.submodules) if f.init}
    fields.update(router=Gemma4Router, shared_experts=branch, pre_experts_norm=norm, post_experts_norm=norm)
    mlp = dataclasses.replace(moe, module=Gemma4MoELayer, submodules=Gemma4MoESubmodules(**fields))
    from megatron.core.transformer.identity_op import IdentityOp

    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(subs, mlp=mlp, pre_mlp_layernorm=IdentityOp))
