"""One parameter mapping between Megatron-Core and Hugging Face, used by checkpoint conversion and weight sync.

A Megatron parameter is named here by its *canonical* name: the name it has in a model built with TP = PP = EP = 1,
so layer and expert numbers are global (``decoder.layers.{layer}.mlp.experts.local_experts.{expert}...``).
:class:`Bridge` converts between canonical names/tensors and HF names/tensors, and between full tensors and the
shards that one TP/PP/EP rank holds:

- fused QKV, per query group g (Megatron's layout):   rows ``[q_{g,0} .. q_{g,Q-1} | k_g | v_g]``, H rows each,
  so ``qkv_GRD`` with ``R = (Q + 2) * H``; HF keeps ``q_proj`` (N*H rows, head n in group n // Q), ``k_proj``, ``v_proj``;
- GLU ``linear_fc1`` = ``[gate_F; up_F]`` on one rank; TP shard i holds ``[gate_i; up_i]``;
- TP: column-parallel weights (QKV, fc1, embedding, output layer) split along dim 0 — for QKV whole query groups
  go to each rank — row-parallel weights (attention output, fc2) along dim 1, norms and the router replicated;
- PP: stage s holds global layers ``[offset_s, offset_s + layers_per_stage)`` as local layers ``0..``;
- EP: rank e holds global experts ``[e * E / ep, (e + 1) * E / ep)`` as ``local_experts.0..``; experts are further
  split over TP exactly like dense MLPs (Megatron's expert-TP size defaults to TP).

Legend: N = query heads, G = query groups (KV heads), Q = N / G, H = head dim, D = hidden, F = MLP hidden,
V = vocabulary, E = experts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from forge_megatron.bridge.families import Family, family_of, gpt_config_from_hf, load_hf_config, text_view
from forge_megatron.mcore.model import GPTConfig

LAYER = "decoder.layers.{layer}."
EXPERT = "mlp.experts.local_experts.{expert}."
HF_LAYER = "model.layers.{layer}."
# MiniMax-01's lightning layers' decay tables as transformers saves them (buffers derived from the config; the
# release has none, and SGLang's loader would reject them)
_LIGHTNING_BUFFERS = tuple(f".self_attn.{name}" for name in ("slope_rate", "query_decay", "key_decay",
                                                             "diagonal_decay"))
VISION = "vision_tower."  # the trainable vision tower's parameters on the first model piece (mcore/vision.py)


# Rule.layers selectors of Gemma 4's kinds of layer, where several rules may name one Megatron tensor
_PER_KIND = ("local", "global", "local_own", "global_own", "kv_shared", "kv_own")


SCORE_HEAD = "score_head.weight"
"""A reward model's score head (``GPTConfig.score_head``), HF ``score.weight``."""


class MappingError(ValueError):
    """A tensor is missing, unexpected, or has the wrong shape for the model described by the config."""


@dataclass(frozen=True)
class Rule:
    """One canonical Megatron parameter and the HF tensor(s) it is made of.

    ``join``: ``copy`` (one HF tensor), ``qkv`` (q, k, v grouped per query group), ``qkv_fused`` (one HF tensor of
    every q, then every k, then every v row: Phi-3's, regrouped per query group), ``glu`` (gate, up stacked),
    ``vocab`` (rows past the HF vocabulary are Megatron's padding: zeros in, dropped out); for HF tensors that hold
    every expert of a layer (gpt-oss), expert e's slice of it: ``experts_glu`` ([E, D, 2F] with gate and up columns
    interleaved -> [gate; up] rows), ``experts_glu_bias`` ([E, 2F] interleaved), ``experts_t`` (expert e's
    transpose: [E, F, D] -> [D, F]; Qwen3-VL-MoE's [E, D, 2F] -> [2F, D], gate rows first), ``experts_row``
    ([E, D] -> row e; also [E, 2F, D] -> [2F, D] and [E, D, F] -> [D, F]: Mistral Small 4's stacked experts).
    :meth:`Bridge.export` stacks them back.
    ``tp``: ``rep`` (replicated), ``col`` (dim 0), ``row`` (dim 1), ``glu`` (gate and up halves split separately).
    """

    mcore: str
    hf: tuple[str, ...]
    join: str = "copy"
    tp: str = "rep"
    layers: str = "all"  # "dense" / "moe": only layers with a dense MLP / a MoE layer have it; "linear" / "full":
    # only Gated DeltaNet / full-attention layers of a hybrid model; "indexer": layers with their own DSA indexer;
    # "block_sparse": MiniMax-M3's layers with a block indexer; "sinks": layers with a sink logit per head
    # (GPTConfig.sink_layers: MiMo-V2-Flash's sliding-window layers);
    # Gemma 4's kinds (_PER_KIND: several rules may name one Megatron tensor, each for its kind of layer): "local" /
    # "global" (sliding-window layers or not), "local_own" / "global_own" (and with keys and values of their own),
    # "kv_shared" / "kv_own" (reusing an earlier layer's keys and values, or not)

    @property
    def is_expert(self) -> bool:
        return "{expert}" in self.mcore

    @property
    def fused(self) -> bool:
        """The HF tensor holds every expert of the layer (one slice per canonical expert parameter)."""
        return self.join.startswith("experts_")


@dataclass(frozen=True)
class ParallelLayout:
    """A TP/PP/EP layout of a checkpoint (DP and CP replicas hold copies, so they do not appear). ``etp``: the
    experts' TP size, TP (None) or 1 (each expert whole; every TP rank's file then holds its EP rank's experts
    whole, as Megatron-LM's per-rank checkpoints do)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    first: int | None = None  # uneven pipeline stages: the first / last stage's layers (mcore/parallel.py
    last: int | None = None  # pipeline_chunks); None: every stage alike

    def __post_init__(self):
        for name in ("tp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)  # the default: experts split as the rest
        if self.etp not in (1, self.tp):
            raise ValueError(f"expert tensor parallel size {self.etp} must be 1 or the TP size ({self.tp})")
        from forge_megatron.mcore.parallel import check_pipeline_split

        check_pipeline_split(self.pp, self.first, self.last)

    @property
    def expert_tp(self) -> int:
        return self.etp

    def __repr__(self) -> str:  # the uneven split only where there is one
        split = "".join(f", {k}={getattr(self, k)}" for k in ("first", "last") if getattr(self, k) is not None)
        return f"ParallelLayout(tp={self.tp}, pp={self.pp}, ep={self.ep}, etp={self.etp}{split})"

    def as_dict(self) -> dict:
        """For checkpoint metadata (``etp`` only when it differs from TP, so older readers see what they knew)."""
        out = {"tp": self.tp, "pp": self.pp, "ep": self.ep}
        if self.expert_tp != self.tp:
            out["etp"] = self.expert_tp
        return {**out, **{k: getattr(self, k) for k in ("first", "last") if getattr(self, k) is not None}}

    def ranks(self):
        """Every (tp_rank, pp_rank, ep_rank) that holds a distinct shard, in file-name order."""
        return [(t, p, e) for p in range(self.pp) for t in range(self.tp) for e in range(self.ep)]


def _pattern(template: str) -> re.Pattern:
    escaped = re.escape(template).replace(r"\{layer\}", r"(?P<layer>\d+)").replace(r"\{expert\}", r"(?P<expert>\d+)")
    return re.compile(escaped + "$")


def _mla_rules(cfg: GPTConfig) -> list[Rule]:
    """Multi-latent attention: the up projections are column-parallel, the down projections and the latent norms
    replicated (mcore/model.py ``_local_mla``; Transformer Engine's spec replicates them too)."""
    attn = HF_LAYER + "self_attn."
    if cfg.q_lora_rank is None:
        query = [Rule(LAYER + "self_attention.linear_q_proj.weight", (attn + "q_proj.weight",), tp="col")]
    else:
        query = [Rule(LAYER + "self_attention.linear_q_down_proj.weight", (attn + "q_a_proj.weight",)),
                 Rule(LAYER + "self_attention.q_layernorm.weight", (attn + "q_a_layernorm.weight",)),
                 Rule(LAYER + "self_attention.linear_q_up_proj.weight", (attn + "q_b_proj.weight",), tp="col")]
    if cfg.sparse_attention:  # DeepSeek sparse attention: the indexer, replicated (mcore/dsa.py)
        ours, theirs = LAYER + "self_attention.core_attention.indexer.", attn + "indexer."
        query += [Rule(ours + a, (theirs + b,), layers="indexer") for a, b in (
            ("linear_wq_b.weight", "wq_b.weight"), ("linear_wk.weight", "wk.weight"),
            ("k_norm.weight", "k_norm.weight"), ("k_norm.bias", "k_norm.bias"),
            ("linear_weights_proj.weight", "weights_proj.weight"))]
    return [Rule(LAYER + "input_layernorm.weight", (HF_LAYER + "input_layernorm.weight",))] + query + [
        Rule(LAYER + "self_attention.linear_kv_down_proj.weight", (attn + "kv_a_proj_with_mqa.weight",)),
        Rule(LAYER + "self_attention.kv_layernorm.weight", (attn + "kv_a_layernorm.weight",)),
        Rule(LAYER + "self_attention.linear_kv_up_proj.weight", (attn + "kv_b_proj.weight",), tp="col"),
        Rule(LAYER + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), tp="row"),
        Rule(LAYER + "pre_mlp_layernorm.weight", (HF_LAYER + "post_attention_layernorm.weight",)),
    ]


def _gpt_oss_rules(cfg: GPTConfig) -> list[Rule]:
    """gpt-oss: biased attention with sinks, a biased router and experts fused per layer in the HF checkpoint."""
    attn, mlp = HF_LAYER + "self_attn.", HF_LAYER + "mlp."
    rules = [
        Rule(LAYER + "input_layernorm.weight", (HF_LAYER + "input_layernorm.weight",)),
        Rule(LAYER + "self_attention.linear_qkv.weight", tuple(attn + f"{p}_proj.weight" for p in "qkv"), "qkv", "col"),
        Rule(LAYER + "self_attention.linear_qkv.bias", tuple(attn + f"{p}_proj.bias" for p in "qkv"), "qkv", "col"),
        Rule(LAYER + "self_attention.core_attention.softmax_offset", (attn + "sinks",), tp="col"),
        Rule(LAYER + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), tp="row"),
        Rule(LAYER + "self_attention.linear_proj.bias", (attn + "o_proj.bias",)),
        Rule(LAYER + "pre_mlp_layernorm.weight", (HF_LAYER + "post_attention_layernorm.weight",)),
        Rule(LAYER + "mlp.router.weight", (mlp + "router.weight",)),
        Rule(LAYER + "mlp.router.bias", (mlp + "router.bias",)),
        Rule(LAYER + EXPERT + "linear_fc1.weight", (mlp + "experts.gate_up_proj",), "experts_glu", "glu"),
        Rule(LAYER + EXPERT + "linear_fc1.bias", (mlp + "experts.gate_up_proj_bias",), "experts_glu_bias", "glu"),
        Rule(LAYER + EXPERT + "linear_fc2.weight", (mlp + "experts.down_proj",), "experts_t", "row"),
        Rule(LAYER + EXPERT + "linear_fc2.bias", (mlp + "experts.down_proj_bias",), "experts_row"),
    ]
    top = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", "col"),
           Rule("decoder.final_layernorm.weight", ("model.norm.weight",))]
    if not cfg.tie_word_embeddings:
        top.append(Rule("output_layer.weight", ("lm_head.weight",), "vocab", "col"))
    return top[:1] + rules + top[1:]


def _gated_delta_rules(cfg: GPTConfig, family: Family) -> list[Rule]:
    """Qwen3.5: Gated DeltaNet layers (``linear_attn``: four input projections regrouped per key head, the
    depthwise convolution likewise; Qwen3-Next's two are grouped per key head already) and gated full-attention
    layers (``q_proj`` holds each head's query then its gate: ``qkv_gate``)."""
    lin, attn = HF_LAYER + "linear_attn.", HF_LAYER + "self_attn."
    gdn = LAYER + "self_attention."
    if family.name == "qwen3_next":
        in_proj = Rule(gdn + "in_proj.weight", (lin + "in_proj_qkvz.weight", lin + "in_proj_ba.weight"),
                       "gdn_in_grouped", "col", layers="linear")
    else:
        in_proj = Rule(gdn + "in_proj.weight", tuple(lin + f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")),
                       "gdn_in", "col", layers="linear")
    return [
        Rule(LAYER + "input_layernorm.weight", (HF_LAYER + "input_layernorm.weight",)),
        in_proj,
        Rule(gdn + "conv1d_weight", (lin + "conv1d.weight",), "gdn_conv", "col", layers="linear"),
        Rule(gdn + "A_log", (lin + "A_log",), tp="col", layers="linear"),
        Rule(gdn + "dt_bias", (lin + "dt_bias",), tp="col", layers="linear"),
        Rule(gdn + "norm_weight", (lin + "norm.weight",), layers="linear"),
        Rule(gdn + "out_proj.weight", (lin + "out_proj.weight",), tp="row", layers="linear"),
        Rule(gdn + "linear_qkv.weight", tuple(attn + f"{p}_proj.weight" for p in "qkv"), "qkv_gate", "col",
             layers="full"),
        Rule(gdn + "linear_proj.weight", (attn + "o_proj.weight",), tp="row", layers="full"),
        Rule(gdn + "q_layernorm.weight", (attn + "q_norm.weight",), layers="full"),
        Rule(gdn + "k_layernorm.weight", (attn + "k_norm.weight",), layers="full"),
        Rule(LAYER + "pre_mlp_layernorm.weight", (HF_LAYER + "post_attention_layernorm.weight",)),
    ]


def _mamba2_rules(cfg: GPTConfig, hf: str = HF_LAYER + "mamba.", mixer: str = LAYER + "self_attention.",
                  layers: str = "linear") -> list[Rule]:
    """Mamba-2 mixers (Granite 4.0-H's ``mamba.*``, Nemotron-H's ``mixer.*``: ``hf``; mcore/mamba2.py): ``in_proj``
    ([z | x | B | C | dt] over all groups) and the convolution ([x | B | C]) regrouped per group (``mamba_in``,
    ``mamba_conv``), the per-head and per-channel tensors split over TP with their groups. (Falcon-H1: the mixer
    beside the attention, ``mixer`` = ``mamba.`` in every layer, no gated norm without ``mamba_gated_norm``.)"""
    rules = [
        Rule(mixer + "in_proj.weight", (hf + "in_proj.weight",), "mamba_in", "col", layers=layers),
        Rule(mixer + "conv1d_weight", (hf + "conv1d.weight",), "mamba_conv", "col", layers=layers),
        Rule(mixer + "A_log", (hf + "A_log",), tp="col", layers=layers),
        Rule(mixer + "dt_bias", (hf + "dt_bias",), tp="col", layers=layers),
        Rule(mixer + "D", (hf + "D",), tp="col", layers=layers),
        Rule(mixer + "norm_weight", (hf + "norm.weight",), tp="col", layers=layers),
        Rule(mixer + "out_proj.weight", (hf + "out_proj.weight",), tp="row", layers=layers),
    ]
    if not cfg.mamba_gated_norm:
        rules = [r for r in rules if not r.mcore.endswith("norm_weight")]
    if cfg.mamba_conv_bias:
        rules.append(Rule(mixer + "conv1d_bias", (hf + "conv1d.bias",), "mamba_conv_bias", "col", layers=layers))
    return rules


def _lfm2_rules(cfg: GPTConfig, family: Family) -> list[Rule]:
    """LFM2: short-convolution layers (``conv.*``: ``in_proj`` interleaved per channel as ``shortconv_in``, the
    depthwise convolution squeezed) and attention layers (``self_attn.out_proj``, ``q_layernorm`` / ``k_layernorm``);
    every layer's ``operator_norm`` before its mixer, ``ffn_norm`` before its MLP (``feed_forward.w1`` / ``w3`` /
    ``w2``), the final ``embedding_norm``. LFM3: Qwen3's attention names (``o_proj``, ``q_norm`` / ``k_norm``), the
    gate per head (``self_attn.gate_proj``, transformers' ``g_proj``), the norms on the mixer's and the MLP's outputs
    (``post_operator_norm``, ``post_ffn_norm``)."""
    conv, attn, mixer = HF_LAYER + "conv.", HF_LAYER + "self_attn.", LAYER + "self_attention."
    rules = [
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", "col"),
        Rule(LAYER + "input_layernorm.weight", (HF_LAYER + "operator_norm.weight",)),
        Rule(mixer + "in_proj.weight", (conv + "in_proj.weight",), "shortconv_in", "col", layers="linear"),
        Rule(mixer + "conv1d_weight", (conv + "conv.weight",), "shortconv_conv", "col", layers="linear"),
        Rule(mixer + "out_proj.weight", (conv + "out_proj.weight",), tp="row", layers="linear"),
        Rule(mixer + "linear_qkv.weight", tuple(attn + f"{p}_proj.weight" for p in "qkv"), "qkv", "col",
             layers="full"),
        Rule(mixer + "linear_proj.weight", (attn + "out_proj.weight",), tp="row", layers="full"),
        Rule(mixer + "q_layernorm.weight", (attn + "q_layernorm.weight",), layers="full"),
        Rule(mixer + "k_layernorm.weight", (attn + "k_layernorm.weight",), layers="full"),
        Rule(LAYER + "pre_mlp_layernorm.weight", (HF_LAYER + "ffn_norm.weight",)),
        Rule(LAYER + "mlp.linear_fc1.weight", (HF_LAYER + "feed_forward.w1.weight", HF_LAYER + "feed_forward.w3.weight"),
             "glu", "glu", layers="dense"),
        Rule(LAYER + "mlp.linear_fc2.weight", (HF_LAYER + "feed_forward.w2.weight",), tp="row", layers="dense"),
        Rule("decoder.final_layernorm.weight", ("model.embedding_norm.weight",)),
    ]
    if family.name == "lfm3":  # Qwen3's attention names, the gate per head (gate_proj as released), sandwich norms
        rules = [r for r in rules if not r.mcore.startswith(tuple(mixer + p for p in ("linear_proj", "q_layernorm",
                                                                                      "k_layernorm")))]
        rules += [Rule(mixer + "linear_proj.weight", (attn + "o_proj.weight",), tp="row", layers="full"),
                  Rule(mixer + "q_layernorm.weight", (attn + "q_norm.weight",), layers="full"),
                  Rule(mixer + "k_layernorm.weight", (attn + "k_norm.weight",), layers="full")]
        if cfg.attention_head_gate:
            rules.append(Rule(mixer + "linear_gate.weight", (attn + "gate_proj.weight",), tp="col", layers="full"))
        if cfg.post_norm:
            rules += [Rule(LAYER + "post_self_attn_layernorm.weight", (HF_LAYER + "post_operator_norm.weight",)),
                      Rule(LAYER + "post_mlp_layernorm.weight", (HF_LAYER + "post_ffn_norm.weight",))]
    if cfg.short_conv_bias:
        rules.append(Rule(mixer + "conv1d_bias", (conv + "conv.bias",), tp="col", layers="linear"))
    if cfg.num_moe_experts:  # LFM2-MoE: experts one by one on disk (w1 gate, w3 up, w2 down), the router's bias beside
        ff, expert = HF_LAYER + "feed_forward.", HF_LAYER + "feed_forward.experts.{expert}."
        rules += [Rule(LAYER + "mlp.router.weight", (ff + "gate.weight",), layers="moe"),
                  Rule(LAYER + "mlp.router.expert_bias", (ff + "expert_bias",), layers="moe"),
                  Rule(LAYER + EXPERT + "linear_fc1.weight", (expert + "w1.weight", expert + "w3.weight"), "glu", "glu",
                       layers="moe"),
                  Rule(LAYER + EXPERT + "linear_fc2.weight", (expert + "w2.weight",), tp="row", layers="moe")]
    if not cfg.tie_word_embeddings:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), "vocab", "col"))
    return rules


def _nemotron_h_rules(cfg: GPTConfig, family: Family) -> list[Rule]:
    """Nemotron-H: each layer's norm and its one sublayer (``backbone.layers.{i}.norm`` / ``.mixer``): the norm is
    the Megatron layer's input norm before a Mamba-2 or attention mixer, its pre-MLP norm before an MLP or experts
    (``Rule.layers`` "kind:..." selects by GPTConfig.layer_kinds); plain (not gated) MLPs and experts."""
    block = "backbone.layers.{layer}."
    mixer, attn = block + "mixer.", LAYER + "self_attention."
    rules = [
        Rule("embedding.word_embeddings.weight", ("backbone.embeddings.weight",), "vocab", "col"),
        Rule(LAYER + "input_layernorm.weight", (block + "norm.weight",), layers="kind:mixer"),
        Rule(LAYER + "pre_mlp_layernorm.weight", (block + "norm.weight",), layers="kind:ffn"),
        Rule(attn + "linear_qkv.weight", tuple(mixer + f"{p}_proj.weight" for p in "qkv"), "qkv", "col",
             layers="kind:attention"),
        Rule(attn + "linear_proj.weight", (mixer + "o_proj.weight",), tp="row", layers="kind:attention"),
        Rule(LAYER + "mlp.linear_fc1.weight", (mixer + "up_proj.weight",), tp="col", layers="kind:mlp"),
        Rule(LAYER + "mlp.linear_fc2.weight", (mixer + "down_proj.weight",), tp="row", layers="kind:mlp"),
    ]
    if cfg.hybrid:
        rules += _mamba2_rules(cfg, mixer)
    if family.moe:
        expert = mixer + "experts.{expert}."
        rules += [
            Rule(LAYER + "mlp.router.weight", (mixer + "gate.weight",), layers="moe"),
            Rule(LAYER + "mlp.router.expert_bias", (mixer + "gate.e_score_correction_bias",), layers="moe"),
            Rule(LAYER + EXPERT + "linear_fc1.weight", (expert + "up_proj.weight",), tp="col", layers="moe"),
            Rule(LAYER + EXPERT + "linear_fc2.weight", (expert + "down_proj.weight",), tp="row", layers="moe"),
            Rule(LAYER + "mlp.shared_experts.linear_fc1.weight", (mixer + "shared_experts.up_proj.weight",), tp="col",
                 layers="moe"),
            Rule(LAYER + "mlp.shared_experts.linear_fc2.weight", (mixer + "shared_experts.down_proj.weight",),
                 tp="row", layers="moe"),
        ]
        if cfg.moe_latent_size is not None:  # (LatentMoE: the projections around the experts, whole on every rank)
            rules += [Rule(LAYER + f"mlp.{p}_latent_proj.weight", (mixer + f"{p}_latent_proj.weight",), layers="moe")
                      for p in ("fc1", "fc2")]
    rules.append(Rule("decoder.final_layernorm.weight", ("backbone.norm_f.weight",)))
    if not cfg.tie_word_embeddings:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), "vocab", "col"))
    return rules


def _olmo_hybrid_rules() -> list[Rule]:
    """OLMo Hybrid: pre-norm Gated DeltaNet layers (six separate input projections and three convolutions,
    regrouped per key head as Qwen3.5's: ``gdn_in_separate``, ``gdn_conv_separate``; their norms ``input_layernorm``
    before the mixer, ``post_attention_layernorm`` before the MLP, the names SGLang's loader reads and transformers
    holds; OLMo-core's ``attention_layer_norm`` / ``feedforward_layer_norm`` are read as those: convert/checkpoint.py
    NAME_ALIASES) and OLMo 3's post-norm attention layers (``post_attention_layernorm`` on the attention's output,
    ``post_feedforward_layernorm`` on the MLP's)."""
    lin, attn = HF_LAYER + "linear_attn.", HF_LAYER + "self_attn."
    mixer = LAYER + "self_attention."
    return [
        Rule(LAYER + "input_layernorm.weight", (HF_LAYER + "input_layernorm.weight",), layers="linear"),
        Rule(mixer + "in_proj.weight", tuple(lin + f"{p}_proj.weight" for p in "qkvgba"), "gdn_in_separate", "col",
             layers="linear"),
        Rule(mixer + "conv1d_weight", tuple(lin + f"{p}_conv1d.weight" for p in "qkv"), "gdn_conv_separate", "col",
             layers="linear"),
        Rule(mixer + "A_log", (lin + "A_log",), tp="col", layers="linear"),
        Rule(mixer + "dt_bias", (lin + "dt_bias",), tp="col", layers="linear"),
        Rule(mixer + "norm_weight", (lin + "o_norm.weight",), layers="linear"),
        Rule(mixer + "out_proj.weight", (lin + "o_proj.weight",), tp="row", layers="linear"),
        Rule(LAYER + "pre_mlp_layernorm.weight", (HF_LAYER + "post_attention_layernorm.weight",), layers="linear"),
        Rule(mixer + "linear_qkv.weight", tuple(attn + f"{p}_proj.weight" for p in "qkv"), "qkv", "col",
             layers="full"),
        Rule(mixer + "linear_proj.weight", (attn + "o_proj.weight",), tp="row", layers="full"),
        Rule(mixer + "q_layernorm.weight", (attn + "q_norm.weight",), layers="full"),
        Rule(mixer + "k_layernorm.weight", (attn + "k_norm.weight",), layers="full"),
        Rule(LAYER + "post_self_attn_layernorm.weight", (HF_LAYER + "post_attention_layernorm.weight",),
             layers="full"),
        Rule(LAYER + "post_mlp_layernorm.weight", (HF_LAYER + "post_feedforward_layernorm.weight",), layers="full"),
    ]


def _kimi_linear_rules(cfg: GPTConfig) -> list[Rule]:
    """Kimi Linear: multi-latent attention in the full-attention layers, Kimi Delta Attention (mcore/kimi_delta.py)
    in the others, under the same ``self_attn.`` prefix (their q/k/v, b projections regrouped per head: ``kda_in``;
    the forget and output gates' down projections stacked: ``glu``, split whole over TP; the three convolutions
    regrouped per head; ``A_log`` [1, 1, H, 1] on disk)."""
    from dataclasses import replace

    attn, mixer = HF_LAYER + "self_attn.", LAYER + "self_attention."
    mla = [replace(r, layers="full") if r.mcore.startswith(mixer) else r for r in _mla_rules(cfg)]
    kda = [
        Rule(mixer + "in_proj.weight", tuple(attn + f"{p}_proj.weight" for p in "qkvb"), "kda_in", "col",
             layers="linear"),
        Rule(mixer + "gate_down.weight", (attn + "f_a_proj.weight", attn + "g_a_proj.weight"), "glu", "col",
             layers="linear"),
        Rule(mixer + "f_b_weight", (attn + "f_b_proj.weight",), tp="col", layers="linear"),
        Rule(mixer + "g_b_weight", (attn + "g_b_proj.weight",), tp="col", layers="linear"),
        Rule(mixer + "conv1d_weight", tuple(attn + f"{p}_conv1d.weight" for p in "qkv"), "gdn_conv_separate", "col",
             layers="linear"),
        Rule(mixer + "A_log", (attn + "A_log",), "flat", "col", layers="linear"),
        Rule(mixer + "dt_bias", (attn + "dt_bias",), tp="col", layers="linear"),
        Rule(mixer + "norm_weight", (attn + "o_norm.weight",), layers="linear"),
        Rule(mixer + "out_proj.weight", (attn + "o_proj.weight",), tp="row", layers="linear"),
    ]
    return mla[:1] + kda + mla[1:]


def _gemma4_rules(cfg: GPTConfig) -> list[Rule]:
    """Gemma 4: the sliding layers' q/k/v grouped as usual; the global layers' with their own geometry and, with
    ``attention_k_eq_v``, no ``v_proj`` (``qkv_global``); Gemma 3's sandwich norm names; each layer's scalar."""
    attn = HF_LAYER + "self_attn."
    qkv = LAYER + "self_attention.linear_qkv.weight"
    global_parts = "qk" if cfg.global_values_from_keys else "qkv"
    rules = [
        Rule(qkv, tuple(attn + f"{p}_proj.weight" for p in "qkv"), "qkv", "col", layers="local_own"),
        Rule(qkv, tuple(attn + f"{p}_proj.weight" for p in global_parts), "qkv_global", "col", layers="global_own"),
        # a layer reusing an earlier layer's keys and values (E2B / E4B): its query projection only
        Rule(qkv, (attn + "q_proj.weight",), tp="col", layers="kv_shared"),
        Rule(LAYER + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), tp="row"),
        Rule(LAYER + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",)),
        Rule(LAYER + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), layers="kv_own"),
        Rule(LAYER + "input_layernorm.weight", (HF_LAYER + "input_layernorm.weight",)),
        Rule(LAYER + "post_self_attn_layernorm.weight", (HF_LAYER + "post_attention_layernorm.weight",)),
        Rule(LAYER + "pre_mlp_layernorm.weight", (HF_LAYER + "pre_feedforward_layernorm.weight",), layers="dense"),
        Rule(LAYER + "post_mlp_layernorm.weight", (HF_LAYER + "post_feedforward_layernorm.weight",)),
        Rule(LAYER + "layer_scalar", (HF_LAYER + "layer_scalar",)),
    ]
    if cfg.per_layer_input_size:  # E2B / E4B: the per-layer inputs' table, projection and norm, each layer's gate
        rules += [Rule("embedding.per_layer.word_embeddings.weight", ("model.embed_tokens_per_layer.weight",)),
                  Rule("embedding.per_layer.model_projection.weight", ("model.per_layer_model_projection.weight",)),
                  Rule("embedding.per_layer.projection_norm.weight", ("model.per_layer_projection_norm.weight",))]
        rules += [Rule(LAYER + f"{name}.weight", (HF_LAYER + f"{name}.weight",))
                  for name in ("per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm")]
    return rules + (_gemma4_moe_rules() if cfg.moe_beside_dense else [])


def _gemma4_moe_rules() -> list[Rule]:
    """Gemma 4's MoE block (26B-A4B; mcore/gemma4.py): the dense branch (Megatron's shared-expert slot) with its
    input and output norms, the experts' norms, the router's projection, input scale and per-expert scales, and the
    experts stacked per layer directly under the layer ([E, 2F, D] gate rows first, [E, D, F])."""
    dense = LAYER + "mlp.shared_experts."
    return [
        Rule(dense + "pre_norm.weight", (HF_LAYER + "pre_feedforward_layernorm.weight",), layers="moe"),
        Rule(dense + "mlp.linear_fc1.weight", (HF_LAYER + "mlp.gate_proj.weight", HF_LAYER + "mlp.up_proj.weight"),
             "glu", "glu", layers="moe"),
        Rule(dense + "mlp.linear_fc2.weight", (HF_LAYER + "mlp.down_proj.weight",), tp="row", layers="moe"),
        Rule(dense + "post_norm.weight", (HF_LAYER + "post_feedforward_layernorm_1.weight",), layers="moe"),
        Rule(LAYER + "mlp.pre_experts_norm.weight", (HF_LAYER + "pre_feedforward_layernorm_2.weight",),
             layers="moe"),
        Rule(LAYER + "mlp.post_experts_norm.weight", (HF_LAYER + "post_feedforward_layernorm_2.weight",),
             layers="moe"),
        Rule(LAYER + "mlp.router.weight", (HF_LAYER + "router.proj.weight",), layers="moe"),
        Rule(LAYER + "mlp.router.scale", (HF_LAYER + "router.scale",), layers="moe"),
        Rule(LAYER + "mlp.router.per_expert_scale", (HF_LAYER + "router.per_expert_scale",), layers="moe"),
        Rule(LAYER + EXPERT + "linear_fc1.weight", (HF_LAYER + "experts.gate_up_proj",), "experts_row", "glu",
             layers="moe"),
        Rule(LAYER + EXPERT + "linear_fc2.weight", (HF_LAYER + "experts.down_proj",), "experts_row", "row",
             layers="moe"),
    ]


def _mimo_rules(cfg: GPTConfig) -> list[Rule]:
    """MiMo-V2-Flash: q/k/v grouped per query group with each kind of layer's key heads (``qkv`` for the
    sliding-window layers, ``qkv_global`` for the full-attention ones), the value heads narrower; the sink logits
    (``attention_sink_bias``, as released and as transformers saves them) in the layers that have them."""
    attn = HF_LAYER + "self_attn."
    qkv = LAYER + "self_attention.linear_qkv."
    rules = [
        Rule(qkv + "weight", tuple(attn + f"{p}_proj.weight" for p in "qkv"), "qkv", "col", layers="local"),
        Rule(qkv + "weight", tuple(attn + f"{p}_proj.weight" for p in "qkv"), "qkv_global", "col", layers="global"),
        Rule(LAYER + "self_attention.core_attention.softmax_offset", (attn + "attention_sink_bias",), tp="col",
             layers="sinks"),
        Rule(LAYER + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), tp="row"),
        Rule(LAYER + "input_layernorm.weight", (HF_LAYER + "input_layernorm.weight",)),
        Rule(LAYER + "pre_mlp_layernorm.weight", (HF_LAYER + "post_attention_layernorm.weight",)),
    ]
    if cfg.add_qkv_bias:
        rules[2:2] = [
            Rule(qkv + "bias", tuple(attn + f"{p}_proj.bias" for p in "qkv"), "qkv", "col", layers="local"),
            Rule(qkv + "bias", tuple(attn + f"{p}_proj.bias" for p in "qkv"), "qkv_global", "col", layers="global")]
    return rules


def _longcat_rules(cfg: GPTConfig) -> list[Rule]:
    """LongCat-Flash: checkpoint layer i is Megatron layers 2i and 2i+1 (``{hf_layer}`` = i, ``{sub}`` = 0 or 1 in
    the HF names: :meth:`Bridge.hf_names`); each sublayer's attention and norms are DeepSeek-V3's MLA rules under
    ``self_attn.{sub}.`` / ``input_layernorm.{sub}`` / ``post_attention_layernorm.{sub}``, its dense MLP ``mlps.{sub}``
    (the first sublayer's in Megatron's shared-expert slot); the first sublayer also holds the routed experts
    (``mlp.experts.{e}.*``) and the router (``mlp.router.classifier`` over routed and identity experts, its
    ``e_score_correction_bias`` the buffer ``expert_bias``)."""
    hf_layer = "model.layers.{hf_layer}."

    def per_sublayer(name: str) -> str:
        name = name.replace(HF_LAYER + "self_attn.", hf_layer + "self_attn.{sub}.")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            name = name.replace(HF_LAYER + f"{norm}.weight", hf_layer + f"{norm}.{{sub}}.weight")
        return name

    from dataclasses import replace

    attn = [replace(r, hf=tuple(per_sublayer(n) for n in r.hf)) for r in _mla_rules(cfg)]
    mlp, moe, expert = hf_layer + "mlps.{sub}.", hf_layer + "mlp.", hf_layer + "mlp.experts.{expert}."
    rules = attn + [
        Rule(LAYER + "mlp.linear_fc1.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"), "glu", "glu",
             layers="dense"),
        Rule(LAYER + "mlp.linear_fc2.weight", (mlp + "down_proj.weight",), tp="row", layers="dense"),
        Rule(LAYER + "mlp.shared_experts.linear_fc1.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"), "glu",
             "glu", layers="moe"),
        Rule(LAYER + "mlp.shared_experts.linear_fc2.weight", (mlp + "down_proj.weight",), tp="row", layers="moe"),
        Rule(LAYER + "mlp.router.weight", (moe + "router.classifier.weight",), layers="moe"),
        Rule(LAYER + "mlp.router.expert_bias", (moe + "router.e_score_correction_bias",), layers="moe"),
        Rule(LAYER + EXPERT + "linear_fc1.weight", (expert + "gate_proj.weight", expert + "up_proj.weight"), "glu",
             "glu", layers="moe"),
        Rule(LAYER + EXPERT + "linear_fc2.weight", (expert + "down_proj.weight",), tp="row", layers="moe"),
    ]
    top = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", "col"),
           Rule("decoder.final_layernorm.weight", ("model.norm.weight",))]
    if not cfg.tie_word_embeddings:
        top.append(Rule("output_layer.weight", ("lm_head.weight",), "vocab", "col"))
    return top[:1] + rules + top[1:]


def _rules(cfg: GPTConfig, family: Family) -> list[Rule]:
    if family.afmoe:  # Gemma 3's sandwich and the default MoE rules under AFMoE's names; q, the gate, k, v fused
        import dataclasses

        names = ((".post_feedforward_layernorm.", ".post_mlp_layernorm."),
                 (".pre_feedforward_layernorm.", ".pre_mlp_layernorm."),
                 (".mlp.gate.weight", ".mlp.router.gate.weight"),
                 (".mlp.gate.e_score_correction_bias", ".mlp.expert_bias"))
        rules = []
        for r in _rules(cfg, dataclasses.replace(family, afmoe=False)):
            if r.mcore == LAYER + "self_attention.linear_qkv.weight":
                r = dataclasses.replace(r, hf=tuple(HF_LAYER + f"self_attn.{p}_proj.weight"
                                                    for p in ("q", "gate", "k", "v")), join="qgkv")
            hf = r.hf
            for old, new in names:
                hf = tuple(h.replace(old, new) for h in hf)
            rules.append(dataclasses.replace(r, hf=hf))
        return rules
    if family.bamba or family.falcon_h1:  # Granite 4.0-H's layers (the default rules' Mamba-2 branch) under Bamba's
        # names; Falcon-H1: those names, the Mamba-2 mixer beside the attention in every layer
        import dataclasses

        names = ((".post_attention_layernorm.", ".pre_ff_layernorm."), (".mlp.", ".feed_forward."),
                 ("model.norm.weight", "model.final_layernorm.weight"))

        def renamed(hf: str) -> str:
            for old, new in names:
                hf = hf.replace(old, new)
            return hf

        rules = _rules(cfg, dataclasses.replace(family, bamba=False, falcon_h1=False))
        if family.falcon_h1:
            rules = rules[:1] + _mamba2_rules(cfg, mixer=LAYER + "mamba.", layers="all") + rules[1:]
        return [dataclasses.replace(r, hf=tuple(renamed(h) for h in r.hf)) for r in rules]
    if family.nemotron_h:
        return _nemotron_h_rules(cfg, family)
    if family.lfm2:
        return _lfm2_rules(cfg, family)
    if family.longcat:
        return _longcat_rules(cfg)
    if family.mimo:
        return _with_mlp_and_ends(cfg, family, _mimo_rules(cfg))
    if family.gemma4:
        return _with_mlp_and_ends(cfg, family, _gemma4_rules(cfg))
    if family.kimi_delta:
        return _with_mlp_and_ends(cfg, family, _kimi_linear_rules(cfg))
    if family.name == "olmo_hybrid":
        return _with_mlp_and_ends(cfg, family, _olmo_hybrid_rules())
    if family.gated_delta:
        return _with_mlp_and_ends(cfg, family, _gated_delta_rules(cfg, family))
    if family.gpt_oss:
        return _gpt_oss_rules(cfg)
    if family.mla:
        return _with_mlp_and_ends(cfg, family, _mla_rules(cfg))
    attn = [
        Rule(LAYER + "self_attention.linear_qkv.weight",
             tuple(HF_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv", "col"),
        Rule(LAYER + "self_attention.linear_proj.weight", (HF_LAYER + "self_attn.o_proj.weight",), tp="row"),
    ]
    if family.name == "phi3":  # Phi-3 / Phi-4: [all q; all k; all v] in one tensor
        attn[0] = Rule(LAYER + "self_attention.linear_qkv.weight", (HF_LAYER + "self_attn.qkv_proj.weight",),
                       "qkv_fused", "col")
    if family.name == "minicpm5_moe":  # each head's queries then its gate in q_proj (Qwen3.5's layout)
        attn[0] = Rule(LAYER + "self_attention.linear_qkv.weight",
                       tuple(HF_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv_gate", "col")
    if family.name == "hyperclovax" and cfg.post_norm:  # Llama's norms and its peri-layer ones (post_norm1 / 2)
        attn += [Rule(LAYER + "input_layernorm.weight", (HF_LAYER + "input_layernorm.weight",)),
                 Rule(LAYER + "post_self_attn_layernorm.weight", (HF_LAYER + "post_norm1.weight",)),
                 Rule(LAYER + "pre_mlp_layernorm.weight", (HF_LAYER + "post_attention_layernorm.weight",)),
                 Rule(LAYER + "post_mlp_layernorm.weight", (HF_LAYER + "post_norm2.weight",))]
    elif family.name == "kolibri1":  # GLM-4's sandwich under Kolibri's names (post_attn_norm, post_ffn_norm)
        attn += [Rule(LAYER + "input_layernorm.weight", (HF_LAYER + "input_layernorm.weight",)),
                 Rule(LAYER + "post_self_attn_layernorm.weight", (HF_LAYER + "post_attn_norm.weight",)),
                 Rule(LAYER + "pre_mlp_layernorm.weight", (HF_LAYER + "post_attention_layernorm.weight",)),
                 Rule(LAYER + "post_mlp_layernorm.weight", (HF_LAYER + "post_ffn_norm.weight",))]
    elif family.name == "glm4":  # GLM-4's sandwich names: post_attention_layernorm is the MLP's input norm
        attn += [Rule(LAYER + "input_layernorm.weight", (HF_LAYER + "input_layernorm.weight",)),
                 Rule(LAYER + "post_self_attn_layernorm.weight", (HF_LAYER + "post_self_attn_layernorm.weight",)),
                 Rule(LAYER + "pre_mlp_layernorm.weight", (HF_LAYER + "post_attention_layernorm.weight",)),
                 Rule(LAYER + "post_mlp_layernorm.weight", (HF_LAYER + "post_mlp_layernorm.weight",))]
    elif cfg.post_norm:  # OLMo, Gemma 3: HF's post_attention_layernorm normalises the attention's output
        attn += [Rule(LAYER + "post_self_attn_layernorm.weight", (HF_LAYER + "post_attention_layernorm.weight",)),
                 Rule(LAYER + "post_mlp_layernorm.weight", (HF_LAYER + "post_feedforward_layernorm.weight",))]
        if cfg.pre_norm:  # Gemma 3's sandwich: the MLP's input norm is pre_feedforward_layernorm
            attn += [Rule(LAYER + "input_layernorm.weight", (HF_LAYER + "input_layernorm.weight",)),
                     Rule(LAYER + "pre_mlp_layernorm.weight", (HF_LAYER + "pre_feedforward_layernorm.weight",))]
    elif family.name == "apertus":  # its own norm names; the MLP's xIELU scalars (and constants: buffers)
        attn += [Rule(LAYER + "input_layernorm.weight", (HF_LAYER + "attention_layernorm.weight",)),
                 Rule(LAYER + "pre_mlp_layernorm.weight", (HF_LAYER + "feedforward_layernorm.weight",))]
        attn += [Rule(LAYER + f"mlp.activation_func.{name}", (HF_LAYER + f"mlp.act_fn.{name}",),
                      "scalar" if name in ("beta", "eps") else "copy")
                 for name in ("alpha_p", "alpha_n", "beta", "eps")]
    elif cfg.parallel_block:  # Cohere: one norm, which attention and MLP both read
        attn.append(Rule(LAYER + "input_layernorm.weight", (HF_LAYER + "input_layernorm.weight",)))
    else:
        attn += [Rule(LAYER + "input_layernorm.weight", (HF_LAYER + "input_layernorm.weight",)),
                 Rule(LAYER + "pre_mlp_layernorm.weight", (HF_LAYER + "post_attention_layernorm.weight",))]
    if cfg.add_qkv_bias:
        attn.append(Rule(LAYER + "self_attention.linear_qkv.bias",
                         tuple(HF_LAYER + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv", "col"))
    if family.name in ("jais2", "starcoder2"):  # the LayerNorms' biases; the output projection's and the MLP's
        # (fc2's replicated; StarCoder2's MLP is c_fc / c_proj)
        up, down = ("c_fc", "c_proj") if family.name == "starcoder2" else ("up_proj", "down_proj")
        attn += [Rule(LAYER + "input_layernorm.bias", (HF_LAYER + "input_layernorm.bias",)),
                 Rule(LAYER + "pre_mlp_layernorm.bias", (HF_LAYER + "post_attention_layernorm.bias",))]
        if cfg.add_bias_linear:
            attn += [Rule(LAYER + "self_attention.linear_proj.bias", (HF_LAYER + "self_attn.o_proj.bias",)),
                     Rule(LAYER + "mlp.linear_fc1.bias", (HF_LAYER + f"mlp.{up}.bias",), tp="col"),
                     Rule(LAYER + "mlp.linear_fc2.bias", (HF_LAYER + f"mlp.{down}.bias",))]
    if cfg.qk_layernorm:  # replicated, also over all heads (MiniMax-M2: mcore/qk_norm.py says why)
        q, k = ("query_layernorm", "key_layernorm") if family.hunyuan else ("q_norm", "k_norm")  # (Hunyuan: after RoPE)
        attn += [Rule(LAYER + "self_attention.q_layernorm.weight", (HF_LAYER + f"self_attn.{q}.weight",)),
                 Rule(LAYER + "self_attention.k_layernorm.weight", (HF_LAYER + f"self_attn.{k}.weight",))]
    if cfg.extra.get("softmax_type") == "learnable":  # (Granite SWA: a sink logit per head in every layer; Flint's
        # release names it softmax_offset, transformers sinks)
        sinks = "softmax_offset" if family.name == "flint" else "sinks"
        attn.append(Rule(LAYER + "self_attention.core_attention.softmax_offset", (HF_LAYER + f"self_attn.{sinks}",),
                         tp="col"))
    if cfg.linear_attention_kind == "mamba2" and cfg.hybrid:  # Granite 4.0-H: Mamba-2 layers beside attention ones
        import dataclasses

        attn = [dataclasses.replace(r, layers="full") if r.mcore.startswith(LAYER + "self_attention.") else r
                for r in attn] + _mamba2_rules(cfg)
    if family.name == "laguna" and cfg.attention_head_gate:  # its gate per head (or per channel), split with the heads
        attn.append(Rule(LAYER + "self_attention.linear_gate.weight", (HF_LAYER + "self_attn.g_proj.weight",),
                         tp="col"))
    if cfg.linear_attention_kind == "lightning" and cfg.hybrid:  # MiniMax-01 / M1: lightning layers beside softmax
        import dataclasses  # attention ones (mcore/lightning.py), every name under self_attn.

        lin, mixer = HF_LAYER + "self_attn.", LAYER + "self_attention."
        attn = [dataclasses.replace(r, layers="full") if r.mcore.startswith(mixer) else r for r in attn] + [
            Rule(mixer + "in_proj.weight", (lin + "qkv_proj.weight",), tp="col", layers="linear"),  # per head q, k, v
            Rule(mixer + "gate_proj.weight", (lin + "output_gate.weight",), tp="col", layers="linear"),
            Rule(mixer + "norm_weight", (lin + "norm.weight",), layers="linear"),  # (whole on every TP rank)
            Rule(mixer + "out_proj.weight", (lin + "out_proj.weight",), tp="row", layers="linear")]
    if cfg.block_sparse_layers is not None:  # MiniMax-M3's indexers (mcore/block_sparse.py), replicated over TP
        where = "self_attn.indexer." if family.stacked_experts else "self_attn.index_"  # (transformers' / release's)
        attn += [Rule(LAYER + f"self_attention.core_attention.indexer.{name}.weight",
                      (HF_LAYER + f"{where}{name}.weight",), layers="block_sparse")
                 for name in ("q_proj", "k_proj", "q_norm", "k_norm")]
    return _with_mlp_and_ends(cfg, family, attn)


def _with_mlp_and_ends(cfg: GPTConfig, family: Family, attn: list[Rule]) -> list[Rule]:
    """The embedding, ``attn`` (one layer's attention rules), the MLP rules, the final norm and the head."""
    fc1 = Rule(LAYER + "mlp.linear_fc1.weight", (HF_LAYER + "mlp.gate_proj.weight", HF_LAYER + "mlp.up_proj.weight"),
               "glu", "glu", layers="dense")
    # GLM-4, Phi-3 and transformers' MiniMax-M3 keep [gate; up] in one tensor, Megatron's fc1 layout already
    if family.name in ("glm4", "glm", "phi3") or (family.minimax_m3 and family.stacked_experts):
        fc1 = Rule(LAYER + "mlp.linear_fc1.weight", (HF_LAYER + "mlp.gate_up_proj.weight",), tp="glu", layers="dense")
    up, down = ("c_fc", "c_proj") if family.name == "starcoder2" else ("up_proj", "down_proj")  # (StarCoder2's)
    if not cfg.swiglu:  # a plain MLP (Arcee: up_proj, the activation, down_proj)
        fc1 = Rule(LAYER + "mlp.linear_fc1.weight", (HF_LAYER + f"mlp.{up}.weight",), tp="col", layers="dense")
    dense = [
        fc1,
        Rule(LAYER + "mlp.linear_fc2.weight", (HF_LAYER + f"mlp.{down}.weight",), tp="row", layers="dense"),
    ]
    mlp = dense
    if family.moe:
        # MiniMax-M2 keeps Mixtral's names: block_sparse_moe, experts' w1 (gate), w3 (up), w2 (down), and the
        # score-correction bias on the block rather than on its gate
        # (Kimi Linear's and MiniMax-M3's MoE layers have these names too, the latter as released)
        mixtral = family.minimax or family.kimi_delta or (family.minimax_m3 and not family.stacked_experts) or \
            family.name in ("mixtral", "minimax01")
        moe = HF_LAYER + ("block_sparse_moe." if mixtral else "mlp.")
        gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        hf_expert = moe + "experts.{expert}."
        mlp = (dense if cfg.moe_dense_layers or cfg.moe_layer_pattern is not None else []) + [
            Rule(LAYER + "mlp.router.weight", (moe + ("gate.wg.weight" if family.hunyuan else "router.gate.weight"
                                                      if family.name == "hy_v3" else "gate.weight"),), layers="moe"),
            Rule(LAYER + EXPERT + "linear_fc1.weight", (hf_expert + f"{gate}.weight", hf_expert + f"{up}.weight"),
                 "glu", "glu", layers="moe"),
            Rule(LAYER + EXPERT + "linear_fc2.weight", (hf_expert + f"{down}.weight",), tp="row", layers="moe"),
        ]
        if family.fused_experts:  # Qwen3-VL-MoE: [E, D, 2F] and [E, F, D], expert e's weights transposed
            mlp[-2:] = [Rule(LAYER + EXPERT + "linear_fc1.weight", (moe + "experts.gate_up_proj",), "experts_t", "glu",
                             layers="moe"),
                        Rule(LAYER + EXPERT + "linear_fc2.weight", (moe + "experts.down_proj",), "experts_t", "row",
                             layers="moe")]
        if family.stacked_experts:  # Mistral Small 4: [E, 2F, D] (gate rows first) and [E, D, F], as Megatron's
            mlp[-2:] = [Rule(LAYER + EXPERT + "linear_fc1.weight", (moe + "experts.gate_up_proj",), "experts_row",
                             "glu", layers="moe"),
                        Rule(LAYER + EXPERT + "linear_fc2.weight", (moe + "experts.down_proj",), "experts_row", "row",
                             layers="moe")]
        if cfg.moe_logit_bias_router:  # Kolibri 1's (mcore/ernie.py), as released: beside the layer's MLP
            mlp.append(Rule(LAYER + "mlp.router.expert_bias", (HF_LAYER + "moe.router.expert_bias",), layers="moe"))
        if cfg.moe_softmax_bias_router:  # ERNIE 4.5's (mcore/ernie.py): also a buffer, stored [1, E]
            mlp.append(Rule(LAYER + "mlp.router.expert_bias", (moe + "moe_statics.e_score_correction_bias",), "row1",
                            layers="moe"))
        if cfg.extra.get("moe_router_enable_expert_bias"):  # a buffer: selection only, no gradient
            # (K-EXAONE's beside its gate, as MiniMax's)
            bias = moe + ("e_score_correction_bias" if family.minimax or mixtral and family.minimax_m3 or
                          family.name == "exaone_moe" else "expert_bias" if family.name == "hy_v3" else
                          "experts.e_score_correction_bias" if family.name == "laguna" else
                          "gate.e_score_correction_bias")
            mlp.append(Rule(LAYER + "mlp.router.expert_bias", (bias,), layers="moe"))
        if cfg.moe_shared_ffn_hidden_size:
            # Qwen3.5-MoE: one ``shared_expert`` whose output a sigmoid gate scales (Megatron's gate_weight)
            shared = HF_LAYER + ("mlp.shared_expert." if family.gated_delta or family.name in ("qwen2_moe", "laguna",
                                                                                             "flint") else
                                 "block_sparse_moe.shared_experts." if family.kimi_delta or mixtral else
                                 "mlp.shared_mlp." if family.hunyuan or family.name == "hy_v3" else
                                 "mlp.shared_experts.")
            fc1_hf = (shared + "gate_up_proj.weight",) if family.minimax_m3 and family.stacked_experts else \
                (shared + "gate_proj.weight", shared + "up_proj.weight")  # (transformers' MiniMax-M3: fused)
            mlp += [Rule(LAYER + "mlp.shared_experts.linear_fc1.weight", fc1_hf, "glu" if len(fc1_hf) == 2 else "copy",
                         "glu", layers="moe"),
                    Rule(LAYER + "mlp.shared_experts.linear_fc2.weight", (shared + "down_proj.weight",), tp="row",
                         layers="moe")]
            if cfg.extra.get("moe_shared_expert_gate"):
                mlp.append(Rule(LAYER + "mlp.shared_experts.gate_weight", (HF_LAYER + "mlp.shared_expert_gate.weight",),
                                layers="moe"))
    if cfg.moe_output_norm:  # A.X K1: the norm after each MoE layer's MLP (beside the layer's norms on disk)
        mlp.append(Rule(LAYER + "post_mlp_layernorm.weight", (HF_LAYER + "post_mlp_layernorm.weight",), layers="moe"))
    if family.granite:  # each layer's experts stacked under block_sparse_moe; the shared MLP's [gate; up] fused
        shared_mlp = HF_LAYER + "shared_mlp."
        if family.moe:
            moe = HF_LAYER + "block_sparse_moe."
            # (Granite MoE SWA: transformers' names, router.weight and experts.gate_up_proj / down_proj, the same
            # stacked [E, 2F, D] / [E, D, F] layout)
            swa = family.name == "granitemoe_swa"
            mlp = [Rule(LAYER + "mlp.router.weight", (moe + ("router.weight" if swa else "router.layer.weight"),),
                        layers="moe"),
                   Rule(LAYER + EXPERT + "linear_fc1.weight",
                        (moe + ("experts.gate_up_proj" if swa else "input_linear.weight"),), "experts_row", "glu",
                        layers="moe"),
                   Rule(LAYER + EXPERT + "linear_fc2.weight",
                        (moe + ("experts.down_proj" if swa else "output_linear.weight"),), "experts_row", "row",
                        layers="moe")]
            if cfg.moe_shared_ffn_hidden_size:
                mlp += [Rule(LAYER + "mlp.shared_experts.linear_fc1.weight", (shared_mlp + "input_linear.weight",),
                             tp="glu", layers="moe"),
                        Rule(LAYER + "mlp.shared_experts.linear_fc2.weight", (shared_mlp + "output_linear.weight",),
                             tp="row", layers="moe")]
        elif family.name == "granitemoehybrid":  # Granite 4.0 without experts: the shared MLP is the MLP
            mlp = [Rule(LAYER + "mlp.linear_fc1.weight", (shared_mlp + "input_linear.weight",), tp="glu"),
                   Rule(LAYER + "mlp.linear_fc2.weight", (shared_mlp + "output_linear.weight",), tp="row")]
    if family.llama4:  # everything under feed_forward.: the router, experts stacked and transposed (Qwen3-VL-MoE's
        # layout), the shared expert; Maverick's dense layers' MLP
        ff = HF_LAYER + "feed_forward."
        shared = ff + "shared_expert."
        mlp = [Rule(LAYER + "mlp.router.weight", (ff + "router.weight",), layers="moe"),
               Rule(LAYER + EXPERT + "linear_fc1.weight", (ff + "experts.gate_up_proj",), "experts_t", "glu",
                    layers="moe"),
               Rule(LAYER + EXPERT + "linear_fc2.weight", (ff + "experts.down_proj",), "experts_t", "row",
                    layers="moe"),
               Rule(LAYER + "mlp.shared_experts.linear_fc1.weight",
                    (shared + "gate_proj.weight", shared + "up_proj.weight"), "glu", "glu", layers="moe"),
               Rule(LAYER + "mlp.shared_experts.linear_fc2.weight", (shared + "down_proj.weight",), tp="row",
                    layers="moe")]
        if cfg.moe_layer_pattern is not None:
            mlp += [Rule(LAYER + "mlp.linear_fc1.weight", (ff + "gate_proj.weight", ff + "up_proj.weight"), "glu",
                         "glu", layers="dense"),
                    Rule(LAYER + "mlp.linear_fc2.weight", (ff + "down_proj.weight",), tp="row", layers="dense")]
    top = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", "col"),
           Rule("decoder.final_layernorm.weight", ("model.norm.weight",))]
    if family.name in ("jais2", "starcoder2"):  # (its final LayerNorm's bias)
        top.append(Rule("decoder.final_layernorm.bias", ("model.norm.bias",)))
    if not cfg.tie_word_embeddings:
        top.append(Rule("output_layer.weight", ("lm_head.weight",), "vocab", "col"))
    return top[:1] + attn + mlp + top[1:]


class Bridge:
    """HF <-> Megatron-Core mapping for one model (built from its HF config).

    ``gpt_overrides`` change the Megatron side's :class:`GPTConfig`; ``vocab_size=`` larger than the HF vocabulary
    is Megatron's padded vocabulary (``make_vocab_size_divisible_by``): padding rows are zeros on import and dropped
    on export.

    ``vision_tower=True`` (a vision-language checkpoint whose images the trainer takes, ``--train-vision-tower``): the
    vision tower is part of the model, a submodule ``vision_tower`` of the first piece (``mcore.vision.attach_tower``)
    whose tensors map one to one, replicated over TP, to the checkpoint's (``model.visual.*``): loaded, checkpointed,
    resharded, synced to the engines and exported with the language model. Without it the tower is left out (the
    trainer runs the checkpoint's own, frozen).
    """

    def __init__(self, hf_config, vision_tower: bool = False, **gpt_overrides):
        self.hf_config = load_hf_config(hf_config)
        self.family = family_of(self.hf_config)
        self.cfg = gpt_config_from_hf(self.hf_config, **gpt_overrides)
        # A block-wise FP8 checkpoint is read dequantized (convert/checkpoint.py HFReader): the model, and every
        # checkpoint written from it, is unquantized, so its config must not say fp8
        self.source_quantization = self.hf_config.pop("quantization_config", None)
        text = self.hf_config.get("text_config")
        if isinstance(text, dict) and "quantization_config" in text:  # a vision-language release's (either level)
            self.source_quantization = self.source_quantization or text["quantization_config"]
            self.hf_config["text_config"] = {k: v for k, v in text.items() if k != "quantization_config"}
        # a vision-language checkpoint (Qwen3.5, Gemma 3 as released): its language model's tensors are under
        # Family.text_prefix, its head is Family.head_name (lm_head but for Kimi-K2.5 and Mistral3); the vision tower
        # is neither trained nor exported (but with vision_tower=True: below)
        self.hf_prefix = self.family.text_prefix if self.family.multimodal else "model."
        self.hf_vocab = text_view(self.hf_config)["vocab_size"]
        if self.cfg.vocab_size < self.hf_vocab:
            raise ValueError(f"vocab_size {self.cfg.vocab_size} is smaller than the HF vocabulary ({self.hf_vocab})")
        self.rules = _rules(self.cfg, self.family)
        if self.cfg.score_head:  # a reward model (sequence-classification checkpoint): its score head, replicated
            self.rules.append(Rule(SCORE_HEAD, ("score.weight",)))
        self._patterns = [(_pattern(r.mcore), r) for r in self.rules]
        self.vision_tower = bool(vision_tower)
        self._vision: dict[str, Rule] = {}  # canonical name -> its rule (exact names: looked up, not matched)
        self._vision_shapes: dict[str, tuple[int, ...]] = {}  # HF name -> shape
        # Kimi-K2.5's tower as released (MoonViT's names, a fused wqkv): the rules read transformers' names (HFReader
        # derives them from the release's) and export writes the release's (held per layer for its wqkv)
        self._kimi_heads = 0
        if self.vision_tower:
            from forge_megatron.multimodal.families import tower_tensor_shapes, vision_spec

            spec = vision_spec(self.hf_config)  # ValueError naming the supported families
            prefix = spec.vision_prefix
            for name, shape in tower_tensor_shapes(self.hf_config).items():
                self._vision[VISION + name] = Rule(VISION + name, (prefix + name,))
                self._vision_shapes[prefix + name] = shape
            self.rules = self.rules + list(self._vision.values())
            if spec.kimi:
                self._kimi_heads = int(self.hf_config["vision_config"].get("num_attention_heads", 16))
        # joins that regroup HF tensors into one Megatron tensor: (split Megatron -> HF parts, join HF parts -> one)
        self._layouts = {"qkv": (self._split_qkv, self._join_qkv),
                         # Phi-3's qkv_proj: every query head, then every key head, then every value head
                         "qkv_fused": (lambda t: (torch.cat(self._split_qkv(t)),), self._join_qkv_fused),
                         # ERNIE 4.5's score-correction bias: [1, E] in HF, [E] in Megatron
                         "row1": (lambda t: (t.reshape(1, -1),), lambda t: t.reshape(-1)),
                         # Apertus' xIELU constants: 0-dim in HF, one element in Megatron
                         "scalar": (lambda t: (t.reshape(()),), lambda t: t.reshape(1)),
                         "qkv_gate": (self._split_qkv_gate, self._join_qkv_gate),
                         # AFMoE: q, the gate, k, v as four HF tensors -> per query group [q; gate; k; v]
                         "qgkv": (self._split_qgkv, self._join_qkv),
                         # Mamba-2 (Granite 4.0-H): regrouped per group
                         "mamba_in": (self._split_mamba_in, self._join_mamba_in),
                         "mamba_conv": (lambda t: (self._mamba_conv_hf(t)[:, None],),
                                        lambda t: self._mamba_conv_grouped(t[:, 0])),
                         "mamba_conv_bias": (lambda t: (self._mamba_conv_hf(t),), self._mamba_conv_grouped),
                         # LFM2's short convolutions: HF's [B; C; x] rows -> per channel (B, C, x); [D, 1, K] -> [D, K]
                         "shortconv_in": (lambda t: (t.reshape(-1, 3, *t.shape[1:]).transpose(0, 1)
                                                     .reshape(t.shape),),
                                          lambda t: t.reshape(3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)),
                         "shortconv_conv": (lambda t: (t[:, None],), lambda t: t[:, 0]),
                         "qkv_global": (self._split_qkv_global, self._join_qkv_global),
                         "gdn_in": (self._split_gdn_in, self._join_gdn_in),
                         "gdn_in_grouped": (self._split_gdn_in_grouped, self._join_gdn_in_grouped),
                         "gdn_in_separate": (self._split_gdn_in_separate, self._join_gdn_in_separate),
                         "gdn_conv_separate": (self._split_gdn_conv_separate, self._join_gdn_conv_separate),
                         "kda_in": (self._split_kda_in, self._join_kda_in),
                         "flat": (lambda t: [t.reshape(1, 1, -1, 1)], lambda t: t.reshape(-1)),  # Kimi's A_log
                         "gdn_conv": (self._split_gdn_conv, self._join_gdn_conv)}

    # --- names ----------------------------------------------------------------------------------------------
    @property
    def vision_tensor_names(self) -> set[str]:
        """The checkpoint names of the trained vision tower's tensors (``vision_tower=True``; empty otherwise;
        Kimi-K2.5: the release's, as :meth:`export` writes them)."""
        if self._kimi_heads:
            from forge_megatron.multimodal.families import kimi_k25_released_state

            meta = {n[len("model."):]: torch.empty(s, device="meta") for n, s in self._vision_shapes.items()}
            return set(kimi_k25_released_state(meta, self._kimi_heads))
        return set(self._vision_shapes)

    def rule(self, name: str) -> tuple[Rule, dict]:
        """The rule of canonical (or local) Megatron name ``name`` and its ``layer``/``expert`` numbers."""
        if name in self._vision:
            return self._vision[name], {}
        for pattern, rule in self._patterns:
            m = pattern.match(name)
            if m:
                idx = {k: int(v) for k, v in m.groupdict().items()}
                if rule.layers in _PER_KIND and not self.layer_has(rule, idx["layer"]):
                    continue  # the other kind of layer's rule for this name
                return rule, idx
        raise MappingError(f"Megatron parameter {name!r} has no mapping for family {self.family.name!r}")

    def canonical_names(self, layers=None) -> list[str]:
        """Every canonical Megatron name of the model (or of global ``layers`` only, without the non-layer ones)."""
        cfg = self.cfg
        experts = range(cfg.num_moe_experts or 0)
        names = []
        for rule in self.rules:
            if "{layer}" not in rule.mcore:
                if layers is None:
                    names.append(rule.mcore)
                continue
            for layer in range(cfg.num_layers) if layers is None else layers:
                if not self.layer_has(rule, layer):
                    continue
                for expert in (experts if rule.is_expert else [None]):
                    names.append(rule.mcore.format(layer=layer, expert=expert))
        return names

    def is_mtp_tensor(self, hf_name: str) -> bool:
        """A tensor of the multi-token-prediction layers some checkpoints append (GLM-4.5, DeepSeek-V3:
        ``num_nextn_predict_layers``, MiniMax-M2: ``num_mtp_modules`` layers numbered from ``num_hidden_layers``;
        Qwen3.5: ``mtp.*``; ERNIE 4.5: ``model.mtp_*``; MiMo-V2-Flash: ``model.mtp.*``; MiniMax-M3 and
        K-EXAONE: any ``mtp.`` module): the trainer neither trains nor exports them (SGLang uses them for speculative decoding only)."""
        hf = self.hf_config
        if self.family.gated_delta and hf_name.startswith("mtp."):
            return True
        if self.family.ernie and hf_name.startswith(self.hf_prefix + "mtp_"):  # ERNIE 4.5's (model.mtp_block.*)
            return True
        if (self.family.mimo or self.family.longcat) and hf_name.startswith(self.hf_prefix + "mtp."):
            return True  # MiMo-V2-Flash's and LongCat-Flash's (model.mtp.*)
        if self.family.name == "mellum" and hf_name.startswith("mtp."):  # (Mellum 2's: mtp.*)
            return True
        if self.family.name == "hy_v3":  # (Hy3's MTP layers: numbered after the last, as transformers drops them)
            m = re.match(r"model\.layers\.(\d+)\.", hf_name)
            return bool(m) and int(m.group(1)) >= self.cfg.num_layers
        if (self.family.name == "exaone_moe" or self.family.nemotron_h) and re.search(r"(^|\.)mtp\.", hf_name):
            return True  # K-EXAONE's (transformers drops any mtp.* tensor)
        if self.family.minimax_m3:  # (transformers drops any ``mtp.`` module of MiniMax-M3's, at any depth)
            if re.search(r"(^|\.)mtp\.", hf_name):
                return True
            hf = hf.get("text_config") or hf  # (M2's numbered MTP layers, counted in the language model's config)
        extra = int(hf.get("num_nextn_predict_layers") or hf.get("num_mtp_modules") or 0)
        m = re.match(re.escape(self.hf_prefix) + r"layers\.(\d+)\.", hf_name)
        return bool(extra and m) and self.cfg.num_layers <= int(m.group(1)) < self.cfg.num_layers + extra

    def is_left_out(self, hf_name: str) -> bool:
        """A checkpoint tensor the trainer neither trains nor exports: multi-token-prediction layers
        (:meth:`is_mtp_tensor`), a vision-language checkpoint's vision side (``Family.vision_prefixes``; but for
        the tower's tensors with ``vision_tower=True``), and the norms A.X K1's release stores for its dense layers,
        which use none (transformers drops them too)."""
        if self.cfg.linear_attention_kind == "lightning" and hf_name.endswith(_LIGHTNING_BUFFERS):
            return True  # (transformers' decay buffers: fixed by the config, rebuilt by transformers and the engines)
        if self.cfg.moe_output_norm:
            m = re.fullmatch(re.escape(self.hf_prefix) + r"layers\.(\d+)\.post_mlp_layernorm\.weight", hf_name)
            if m is not None and int(m.group(1)) < self.cfg.num_layers and not self.is_moe_layer(int(m.group(1))):
                return True
        return self.is_mtp_tensor(hf_name) or (self.family.multimodal and hf_name not in self._vision_shapes and
                                               hf_name.startswith(self.family.vision_prefixes))

    def absent_default(self, hf_name: str) -> torch.Tensor | None:
        """The value of HF tensor ``hf_name`` where a checkpoint may lack it, None where it must have it: A.X K1's
        release routes without a score-correction bias (transformers fills in zeros)."""
        if self.family.name == "axk1" and hf_name.endswith(".mlp.gate.e_score_correction_bias"):
            return torch.zeros(self.hf_shape(hf_name))
        return None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` has a MoE MLP (the first ``moe_dense_layers`` of a MoE model do not; of
        LongCat-Flash's layer pairs, the first)."""
        if self.cfg.shortcut_moe:
            return layer % 2 == 0
        if self.cfg.layer_kinds is not None:  # (Nemotron-H: its "moe" layers)
            return self.cfg.layer_kinds[layer] == "moe"
        if self.cfg.moe_layer_pattern is not None:  # (Llama 4 Maverick: dense and MoE layers interleaved)
            return self.cfg.moe_layer_pattern[layer]
        return bool(self.cfg.num_moe_experts) and layer >= self.cfg.moe_dense_layers

    def is_global_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` is not a sliding-window layer (Megatron's window_attn_skip_freq)."""
        flags = self.cfg.extra.get("window_attn_skip_freq")
        return not (self.cfg.extra.get("window_size") and (flags is None or flags[layer]))

    def is_kv_shared_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` reuses an earlier layer's keys and values (Gemma 4 E2B / E4B)."""
        return bool(self.cfg.kv_shared_from) and self.cfg.kv_shared_from[layer] is not None

    def layer_kind(self, layer: int) -> tuple:
        """What sets the shapes of a layer's tensors beyond the rule naming them (Gemma 4: global or not, keys and
        values of its own or not, its MLP width)."""
        ffn = self.cfg.layer_ffn_sizes[layer] if self.cfg.layer_ffn_sizes else None
        heads = self.cfg.layer_attention_heads[layer] if self.cfg.layer_attention_heads else None  # (Laguna)
        return self.is_global_layer(layer), self.is_kv_shared_layer(layer), ffn, heads

    def layer_has(self, rule: Rule, layer: int) -> bool:
        if rule.layers.startswith("kind:"):  # (Nemotron-H's one sublayer per layer: GPTConfig.layer_kinds)
            kind, want = self.cfg.layer_kinds[layer], rule.layers[len("kind:"):]
            return kind in {"mixer": ("mamba", "attention"), "ffn": ("mlp", "moe")}.get(want, (want,))
        if rule.layers in _PER_KIND:
            kind = rule.layers.split("_")[0]
            if kind in ("local", "global") and (kind == "global") != self.is_global_layer(layer):
                return False
            if rule.layers == "kv_shared":
                return self.is_kv_shared_layer(layer)
            return not (rule.layers.endswith("_own") and self.is_kv_shared_layer(layer))
        if rule.layers == "indexer":
            return not (self.cfg.dsa_shared_layers and self.cfg.dsa_shared_layers[layer])
        if rule.layers == "block_sparse":  # (MiniMax-M3: the layers with an indexer)
            return bool(self.cfg.block_sparse_layers and self.cfg.block_sparse_layers[layer])
        if rule.layers == "sinks":  # (MiMo-V2-Flash: the sliding-window layers')
            return bool(self.cfg.sink_layers and self.cfg.sink_layers[layer])
        if rule.layers in ("linear", "full"):
            return (rule.layers == "linear") == bool(self.cfg.linear_attention and self.cfg.linear_attention[layer])
        return rule.layers == "all" or (rule.layers == "moe") == self.is_moe_layer(layer)

    def hf_names(self, name: str) -> list[str]:
        rule, idx = self.rule(name)
        if self.cfg.shortcut_moe and "layer" in idx:  # LongCat-Flash: checkpoint layer, sublayer
            idx = {**idx, "hf_layer": idx["layer"] // 2, "sub": idx["layer"] % 2}
        names = [t.format(**idx) for t in rule.hf]
        if name in self._vision:
            return names  # the checkpoint's own names
        if self.hf_prefix != "model.":
            names = [self.hf_prefix + n[len("model."):] if n.startswith("model.") else
                     self.family.head_name if n == "lm_head.weight" else n for n in names]
        return names

    # --- full tensors ---------------------------------------------------------------------------------------
    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Full canonical Megatron tensor -> {HF name: tensor}. Parameters whose HF tensor holds every expert of a
        layer (``Rule.fused``) go through :meth:`export`, which stacks the experts."""
        rule, _ = self.rule(name)
        if rule.fused:
            raise MappingError(f"{name!r} is one expert's slice of a fused HF tensor: use Bridge.export")
        names = self.hf_names(name)
        if rule.join in self._layouts:
            parts = self._layouts[rule.join][0](tensor)
        elif rule.join == "glu":
            parts = tensor.chunk(2, dim=0)
        elif rule.join == "vocab":
            parts = (tensor[: self.hf_vocab],)
        else:
            parts = (tensor,)
        return {n: p.contiguous() for n, p in zip(names, parts)}

    def export(self, items):
        """(canonical name, full tensor) pairs -> (HF name, tensor) pairs, in order; the experts of a fused HF tensor
        are held until all of its layer's experts have come, then sent stacked (the converter and the weight gather
        produce a layer's experts together, so one layer's are held at a time)."""
        held: dict[str, dict[int, torch.Tensor]] = {}
        experts = self.cfg.num_moe_experts or 0
        kimi_qkv: dict[str, dict[str, torch.Tensor]] = {}  # Kimi-K2.5's tower: a layer's q / k / v until all came
        for name, tensor in items:
            rule, idx = self.rule(name)
            if self._kimi_heads and name in self._vision:
                yield from self._kimi_released(name, tensor, kimi_qkv)
                continue
            if not rule.fused:
                yield from self.to_hf(name, tensor).items()
                continue
            hf_name = self.hf_names(name)[0]
            pieces = held.setdefault(hf_name, {})
            pieces[idx["expert"]] = self._fused_piece(rule.join, tensor)
            if len(pieces) == experts:
                yield hf_name, torch.stack([pieces.pop(e) for e in range(experts)]).contiguous()
                del held[hf_name]
        if held:
            name, pieces = next(iter(held.items()))
            raise MappingError(f"{name!r}: only experts {sorted(pieces)} of {experts} were exported")
        if kimi_qkv:
            name, parts = next(iter(kimi_qkv.items()))
            raise MappingError(f"the vision tower's {name!r}: only {sorted(parts)} of q_proj / k_proj / v_proj were "
                               "exported")

    def _kimi_released(self, name: str, tensor: torch.Tensor, held: dict):
        """Kimi-K2.5's tower tensor ``name`` under the release's name (:func:`kimi_k25_released_state`); a layer's
        q / k / v projections are held until all three have come, then sent as its wqkv."""
        from forge_megatron.multimodal.families import kimi_k25_released_state

        tower_name = name[len(VISION):]
        m = re.fullmatch(r"(vision_tower\.layers\.\d+\.attn)\.(q_proj|k_proj|v_proj)\.(\w+)", tower_name)
        if m is None:
            yield from kimi_k25_released_state({tower_name: tensor}, self._kimi_heads).items()
            return
        key = f"{m.group(1)}.*.{m.group(3)}"
        parts = held.setdefault(key, {})
        parts[m.group(2)] = tensor
        if len(parts) == 3:
            del held[key]
            yield from kimi_k25_released_state({f"{m.group(1)}.{p}.{m.group(3)}": t for p, t in parts.items()},
                                               self._kimi_heads).items()

    @staticmethod
    def _fused_piece(join: str, t: torch.Tensor) -> torch.Tensor:
        """Expert e's canonical tensor -> its slice of the fused HF tensor."""
        if join in ("experts_glu", "experts_glu_bias"):
            gate, up = t.chunk(2, dim=0)
            inter = torch.stack([gate, up], dim=1).reshape(-1, *t.shape[1:])  # rows g0, u0, g1, u1, ...
            return inter.t() if join == "experts_glu" else inter
        return t.t() if join == "experts_t" else t

    @staticmethod
    def _from_fused(join: str, fused: torch.Tensor, expert: int) -> torch.Tensor:
        x = fused[expert]
        if join == "experts_glu":
            return torch.cat([x[:, 0::2].t(), x[:, 1::2].t()]).contiguous()
        if join == "experts_glu_bias":
            return torch.cat([x[0::2], x[1::2]]).contiguous()
        return x.t().contiguous() if join == "experts_t" else x.clone()

    def from_hf(self, name: str, hf: dict[str, torch.Tensor]) -> torch.Tensor:
        """{HF name: tensor} (must hold this parameter's HF tensors) -> full canonical Megatron tensor."""
        rule, idx = self.rule(name)
        parts = []
        for hf_name in self.hf_names(name):
            t = hf.get(hf_name)
            if t is None:
                t = self.absent_default(hf_name)
            if t is None:
                raise MappingError(f"HF tensor {hf_name!r} (needed for {name!r}) is missing")
            want = self.hf_shape(hf_name)
            if tuple(t.shape) != want:
                raise MappingError(f"HF tensor {hf_name!r} has shape {tuple(t.shape)}, the config implies {want}")
            parts.append(t)
        if rule.fused:
            return self._from_fused(rule.join, parts[0], idx["expert"])
        if rule.join in self._layouts:
            return self._layouts[rule.join][1](*parts)
        if rule.join == "vocab" and self.cfg.vocab_size > self.hf_vocab:
            padding = parts[0].new_zeros(self.cfg.vocab_size - self.hf_vocab, *parts[0].shape[1:])
            return torch.cat([parts[0], padding])
        return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]

    def hf_shape(self, hf_name: str) -> tuple[int, ...]:
        """The shape the config implies for HF tensor ``hf_name``."""
        if hf_name in self._vision_shapes:
            return self._vision_shapes[hf_name]
        cfg = self.cfg
        if cfg.linear_attention_kind == "kimi_delta":  # its two kinds of layers share names (self_attn.q_proj)
            m = re.search(r"layers\.(\d+)\.self_attn\.(.+)$", hf_name)
            if m and int(m.group(1)) < cfg.num_layers and cfg.linear_attention[int(m.group(1))]:
                heads, dim, d = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.hidden_size
                kda = {"q_proj.weight": (heads * dim, d), "k_proj.weight": (heads * dim, d),
                       "v_proj.weight": (heads * dim, d), "b_proj.weight": (heads, d), "f_a_proj.weight": (dim, d),
                       "g_a_proj.weight": (dim, d), "f_b_proj.weight": (heads * dim, dim),
                       "g_b_proj.weight": (heads * dim, dim), "dt_bias": (heads * dim,), "A_log": (1, 1, heads, 1),
                       "o_norm.weight": (dim,), "o_proj.weight": (d, heads * dim)}
                kda.update({f"{p}_conv1d.weight": (heads * dim, 1, cfg.linear_conv_kernel) for p in "qkv"})
                if m.group(2) not in kda:
                    raise MappingError(f"no shape rule for HF tensor {hf_name!r}")
                return kda[m.group(2)]
        d, h, g, n = cfg.hidden_size, cfg.head_dim, cfg.num_query_groups, cfg.num_attention_heads
        m = re.search(r"layers\.(\d+)\.self_attn\.", hf_name)
        if cfg.layer_attention_heads and m and int(m.group(1)) < cfg.num_layers:
            n = cfg.layer_attention_heads[int(m.group(1))]  # (Laguna: each layer's query heads)
        if cfg.per_layer_attention and m and int(m.group(1)) < cfg.num_layers \
                and self.is_global_layer(int(m.group(1))):
            h, g = cfg.global_kv_channels or h, cfg.global_num_query_groups or g  # Gemma 4's global layers
        dv = cfg.value_head_dim or h  # (MiMo-V2-Flash's value heads are narrower)
        m = re.search(r"layers\.(\d+)\.mlp\.", hf_name)
        if cfg.layer_ffn_sizes and m and int(m.group(1)) < cfg.num_layers:
            f_layer = cfg.layer_ffn_sizes[int(m.group(1))]  # (Gemma 4's double-wide MLPs)
        else:
            f_layer = None
        shared = (".shared_experts.", ".shared_expert.", ".shared_mlp.")  # (Hunyuan's: shared_mlp)
        # (Granite 4.0 without experts: its shared MLP is the layer's MLP)
        f = (cfg.moe_shared_ffn_hidden_size or cfg.ffn_hidden_size) if any(x in hf_name for x in shared) else \
            cfg.moe_ffn_hidden_size if ".experts." in hf_name else f_layer or cfg.ffn_hidden_size
        table = {
            "embed_tokens.weight": (self.hf_vocab, d), "lm_head.weight": (self.hf_vocab, d),
            "norm.weight": (d,), "layernorm.weight": (d,),
            "q_proj.weight": (n * h, d), "k_proj.weight": (g * h, d), "v_proj.weight": (g * dv, d),
            "q_proj.bias": (n * h,), "k_proj.bias": (g * h,), "v_proj.bias": (g * dv,),
            "qkv_proj.weight": (n * h + g * h + g * dv, d),
            "o_proj.weight": (d, n * dv), "q_norm.weight": (h,), "k_norm.weight": (h,),
            "attention_sink_bias": (n,),
            "gate_proj.weight": (f, d), "up_proj.weight": (f, d), "down_proj.weight": (d, f), "gate_up_proj.weight": (2 * f, d),
            "w1.weight": (f, d), "w3.weight": (f, d), "w2.weight": (d, f),
            "gate.weight": (cfg.num_moe_experts or 0, d), "e_score_correction_bias": (cfg.num_moe_experts or 0,),
            "shared_expert_gate.weight": (1, d), "layer_scalar": (1,), "score.weight": (cfg.score_head, d),
            "act_fn.alpha_p": (1,), "act_fn.alpha_n": (1,), "act_fn.beta": (), "act_fn.eps": (),  # (Apertus' xIELU)
            "moe_statics.e_score_correction_bias": (1, cfg.num_moe_experts or 0),
            "query_layernorm.weight": (h,), "key_layernorm.weight": (h,), "gate.wg.weight": (cfg.num_moe_experts or 0, d),
        }
        if cfg.qk_layernorm_all_heads:
            table.update({"q_norm.weight": (n * h,), "k_norm.weight": (g * h,)})
        if cfg.attention_output_gate and not self.family.afmoe:  # (AFMoE's gate is its own gate_proj)
            table["q_proj.weight"] = (2 * n * h, d)
        if self.family.name in ("jais2", "starcoder2"):  # (its biases; StarCoder2's MLP names)
            table.update({"up_proj.bias": (f,), "down_proj.bias": (d,), "norm.bias": (d,), "layernorm.bias": (d,),
                          "c_fc.weight": (f, d), "c_fc.bias": (f,), "c_proj.weight": (d, f), "c_proj.bias": (d,),
                          "o_proj.bias": (d,)})
        if self.family.name == "hyperclovax":  # (its peri-layer norms)
            table.update({"post_norm1.weight": (d,), "post_norm2.weight": (d,)})
        if self.family.name == "laguna":  # (its gate per head or per channel)
            table["self_attn.g_proj.weight"] = (n * h if cfg.head_gate_per_element else n, d)
        if self.family.afmoe or self.family.name == "hy_v3":  # (Hy3's router and its bias: AFMoE's names)
            table.update({"self_attn.gate_proj.weight": (n * h, d), "mlp.expert_bias": (cfg.num_moe_experts or 0,),
                          "router.gate.weight": (cfg.num_moe_experts or 0, d)})
        if cfg.hybrid:
            nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
            dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
            table.update({"in_proj_qkvz.weight": (2 * nk * dk + 2 * nv * dv, d), "in_proj_ba.weight": (2 * nv, d),
                          "in_proj_qkv.weight": (2 * nk * dk + nv * dv, d), "in_proj_z.weight": (nv * dv, d),
                          "in_proj_b.weight": (nv, d), "in_proj_a.weight": (nv, d),
                          "conv1d.weight": (2 * nk * dk + nv * dv, 1, cfg.linear_conv_kernel), "A_log": (nv,),
                          "dt_bias": (nv,), "linear_attn.norm.weight": (dv,), "out_proj.weight": (d, nv * dv),
                          # OLMo Hybrid's separate projections
                          "linear_attn.q_proj.weight": (nk * dk, d), "linear_attn.k_proj.weight": (nk * dk, d),
                          "linear_attn.v_proj.weight": (nv * dv, d), "linear_attn.g_proj.weight": (nv * dv, d),
                          "linear_attn.b_proj.weight": (nv, d), "linear_attn.a_proj.weight": (nv, d),
                          "linear_attn.o_proj.weight": (d, nv * dv), "linear_attn.o_norm.weight": (dv,),
                          "q_conv1d.weight": (nk * dk, 1, cfg.linear_conv_kernel),
                          "k_conv1d.weight": (nk * dk, 1, cfg.linear_conv_kernel),
                          "v_conv1d.weight": (nv * dv, 1, cfg.linear_conv_kernel)})
        if cfg.hybrid and cfg.linear_attention_kind == "lightning":  # (MiniMax-01: its linear layers' names)
            width = cfg.linear_num_value_heads * cfg.linear_value_head_dim
            table.update({"self_attn.qkv_proj.weight": (3 * width, d), "self_attn.output_gate.weight": (width, d),
                          "self_attn.norm.weight": (width,), "self_attn.out_proj.weight": (d, width)})
        if (cfg.hybrid or cfg.mamba_beside_attention) and cfg.linear_attention_kind == "mamba2":
            # Granite 4.0-H's / Nemotron-H's / Falcon-H1's Mamba-2 mixers
            G, H, N, P = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
                cfg.linear_value_head_dim
            conv = H * P + 2 * G * N
            where = "mixer." if self.family.nemotron_h else "mamba."
            table.update({f"{where}in_proj.weight": (H * P + conv + H, d),
                          f"{where}conv1d.weight": (conv, 1, cfg.linear_conv_kernel), f"{where}conv1d.bias": (conv,),
                          f"{where}A_log": (H,), f"{where}dt_bias": (H,), f"{where}D": (H,),
                          f"{where}norm.weight": (H * P,), f"{where}out_proj.weight": (d, H * P)})
        if self.family.lfm2:  # its short convolutions' and attention's own names (LFM2-MoE: its router's bias)
            table.update({"expert_bias": (cfg.num_moe_experts or 0,), "conv.in_proj.weight": (3 * d, d), "conv.conv.weight": (d, 1, cfg.linear_conv_kernel),
                          "conv.conv.bias": (d,), "conv.out_proj.weight": (d, d),
                          "self_attn.out_proj.weight": (d, n * h), "q_layernorm.weight": (h,),
                          "k_layernorm.weight": (h,), "self_attn.gate_proj.weight": (n, d)})
        if self.family.nemotron_h:  # its embedding and final norm's names
            table.update({"embeddings.weight": (self.hf_vocab, d), "norm_f.weight": (d,)})
            if cfg.moe_latent_size is not None:  # (LatentMoE: the routed experts between the latent projections)
                latent = cfg.moe_latent_size
                table.update({"fc1_latent_proj.weight": (latent, d), "fc2_latent_proj.weight": (d, latent)})
                if ".experts." in hf_name:
                    table.update({"up_proj.weight": (f, latent), "down_proj.weight": (latent, f)})
        e = cfg.num_moe_experts or 0
        if cfg.moe_logit_bias_router:  # (Kolibri 1's router bias)
            table["moe.router.expert_bias"] = (e,)
        table.update({"sinks": (n,), "self_attn.softmax_offset": (n,), "o_proj.bias": (d,), "router.weight": (e, d),
                      "router.bias": (e,),
                      "experts.gate_up_proj": (e, d, 2 * f), "experts.gate_up_proj_bias": (e, 2 * f),
                      "experts.down_proj": (e, f, d), "experts.down_proj_bias": (e, d)})
        if self.family.stacked_experts or self.family.gemma4 or self.family.name == "granitemoe_swa":
            table.update({"experts.gate_up_proj": (e, 2 * f, d), "experts.down_proj": (e, d, f)})
        if self.family.granite:  # stacked experts, the router's layer, the shared MLP (Granite 4.0's whole MLP)
            fe, fs = cfg.moe_ffn_hidden_size, cfg.moe_shared_ffn_hidden_size or cfg.ffn_hidden_size
            table.update({"block_sparse_moe.input_linear.weight": (e, 2 * (fe or 0), d),
                          "block_sparse_moe.output_linear.weight": (e, d, fe or 0), "router.layer.weight": (e, d),
                          "shared_mlp.input_linear.weight": (2 * fs, d), "shared_mlp.output_linear.weight": (d, fs)})
        if cfg.shortcut_moe:  # LongCat-Flash's router: a row per routed and per identity expert
            table.update({"layernorm.0.weight": (d,), "layernorm.1.weight": (d,),  # (its sublayers' norms)
                          "router.classifier.weight": (e + cfg.moe_zero_experts, d),
                          "router.e_score_correction_bias": (e + cfg.moe_zero_experts,)})
        if self.family.gemma4:  # its router (MoE block, 26B-A4B)
            table.update({"router.proj.weight": (e, d), "router.scale": (d,), "router.per_expert_scale": (e,),
                          "layernorm_1.weight": (d,), "layernorm_2.weight": (d,)})  # (its branches' norms)
            w = cfg.per_layer_input_size  # and its per-layer inputs (E2B / E4B)
            table.update({"embed_tokens_per_layer.weight": (cfg.per_layer_input_vocab, cfg.num_layers * w),
                          "per_layer_model_projection.weight": (cfg.num_layers * w, d),
                          "per_layer_projection_norm.weight": (w,), "per_layer_input_gate.weight": (w, d),
                          "per_layer_projection.weight": (d, w), "post_per_layer_input_norm.weight": (d,)})
        if cfg.multi_latent_attention:
            qk = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
            table.update({
                "q_proj.weight": (n * qk, d), "q_a_proj.weight": (cfg.q_lora_rank, d),
                "q_a_layernorm.weight": (cfg.q_lora_rank,), "q_b_proj.weight": (n * qk, cfg.q_lora_rank),
                "kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim, d),
                "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
                "kv_b_proj.weight": (n * (cfg.qk_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                "o_proj.weight": (d, n * cfg.v_head_dim),
            })
        if cfg.sparse_attention:
            hi, di = cfg.dsa_index_heads, cfg.dsa_index_head_dim
            table.update({"indexer.wq_b.weight": (hi * di, cfg.q_lora_rank), "indexer.wk.weight": (di, d),
                          "indexer.k_norm.weight": (di,), "indexer.k_norm.bias": (di,),
                          "indexer.weights_proj.weight": (hi, d)})
        if cfg.block_sparse_layers is not None:  # (MiniMax-M3's indexers, as released and as transformers names them)
            hi, di = cfg.block_index_heads, cfg.block_index_head_dim
            for where in ("index_", "indexer."):
                table.update({f"{where}q_proj.weight": (hi * di, d), f"{where}k_proj.weight": (di, d),
                              f"{where}q_norm.weight": (di,), f"{where}k_norm.weight": (di,)})
        for suffix in sorted(table, key=len, reverse=True):  # q_norm.weight before norm.weight
            if hf_name.endswith(suffix):
                return table[suffix]
        raise MappingError(f"no shape rule for HF tensor {hf_name!r}")

    def _split_qkv(self, qkv):
        cfg = self.cfg
        h = cfg.head_dim
        dv = cfg.value_head_dim or h
        q_per_g = (qkv.shape[0] // cfg.num_query_groups - h - dv) // h  # (from the rows: Laguna's differ by layer)
        grouped = qkv.reshape(cfg.num_query_groups, q_per_g * h + h + dv, *qkv.shape[1:])
        q, k, v = grouped.split([q_per_g * h, h, dv], dim=1)
        return [t.reshape(-1, *qkv.shape[1:]) for t in (q, k, v)]

    def _join_qkv_fused(self, qkv):
        cfg = self.cfg
        n, g, h = cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim
        return self._join_qkv(*qkv.split([n * h, g * h, g * (cfg.value_head_dim or h)]))

    def _join_qkv(self, q, *rest):
        """HF's q, k, v (AFMoE: q, gate, k, v) -> Megatron's fused rows, per query group its part of each."""
        g = self.cfg.num_query_groups
        per_group = [t.reshape(g, -1, *t.shape[1:]) for t in (q, *rest)]
        return torch.cat(per_group, dim=1).reshape(-1, *q.shape[1:])

    def _global_geometry(self):
        cfg = self.cfg
        return (cfg.global_num_query_groups or cfg.num_query_groups, cfg.global_kv_channels or cfg.head_dim,
                2 if cfg.global_values_from_keys else 3)

    def _split_qkv_global(self, qkv):
        """A global (full-attention) layer's fused projection -> q, k (and v unless the values are the keys: Gemma
        4), with that kind of layer's key heads."""
        g, h, parts = self._global_geometry()
        q_per_g = self.cfg.num_attention_heads // g
        grouped = qkv.reshape(g, -1, *qkv.shape[1:])
        pieces = grouped.split([q_per_g * h, h] + [self.cfg.value_head_dim or h] * (parts - 2), dim=1)
        return [t.reshape(-1, *qkv.shape[1:]) for t in pieces]

    def _join_qkv_global(self, *parts):
        g, _, _ = self._global_geometry()
        per_group = [t.reshape(g, -1, *t.shape[1:]) for t in parts]
        return torch.cat(per_group, dim=1).reshape(-1, *parts[0].shape[1:])

    def _join_qkv_gate(self, q_gate, k, v):
        """Gated attention: HF's ``q_proj`` rows are, per head, its query then its gate; Megatron's fused QKV holds
        per query group its heads' queries, their gates, then the key and the value."""
        n, h = self.cfg.num_attention_heads, self.cfg.head_dim
        pairs = q_gate.reshape(n, 2, h, *q_gate.shape[1:])
        q, gate = pairs[:, 0].reshape(n * h, *q_gate.shape[1:]), pairs[:, 1].reshape(n * h, *q_gate.shape[1:])
        g = self.cfg.num_query_groups
        per_group = [t.reshape(g, -1, *t.shape[1:]) for t in (q, gate, k, v)]
        return torch.cat(per_group, dim=1).reshape(-1, *q.shape[1:])

    def _split_qgkv(self, fused):
        """Megatron's gated fused QKV (per query group: queries, their gates, key, value) -> HF's q, gate, k, v."""
        cfg = self.cfg
        q_per_g, h = cfg.num_attention_heads // cfg.num_query_groups, cfg.head_dim
        grouped = fused.reshape(cfg.num_query_groups, (2 * q_per_g + 2) * h, *fused.shape[1:])
        return [t.reshape(-1, *fused.shape[1:]) for t in grouped.split([q_per_g * h, q_per_g * h, h, h], dim=1)]

    def _split_qkv_gate(self, fused):
        cfg = self.cfg
        n, g, h = cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim
        q_per_g = n // g
        grouped = fused.reshape(g, (2 * q_per_g + 2) * h, *fused.shape[1:])
        q, gate, k, v = grouped.split([q_per_g * h, q_per_g * h, h, h], dim=1)
        q_gate = torch.stack([q.reshape(n, h, *fused.shape[1:]), gate.reshape(n, h, *fused.shape[1:])], dim=1)
        return [q_gate.reshape(2 * n * h, *fused.shape[1:])] + [t.reshape(-1, *fused.shape[1:]) for t in (k, v)]

    def _gdn_sizes(self):
        cfg = self.cfg
        nk, r = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
        return nk, r, cfg.linear_key_head_dim, cfg.linear_value_head_dim

    def _join_gdn_in(self, qkv, z, b, a):
        """HF's four Gated DeltaNet input projections -> one, grouped per key head: [q | k | v | z | b | a]."""
        nk, r, dk, dv = self._gdn_sizes()
        q, k, v = qkv.split([nk * dk, nk * dk, nk * r * dv])
        parts = [t.reshape(nk, -1, t.shape[-1]) for t in (q, k, v, z, b, a)]
        return torch.cat(parts, dim=1).reshape(-1, qkv.shape[-1])

    def _split_gdn_in(self, fused):
        nk, r, dk, dv = self._gdn_sizes()
        q, k, v, z, b, a = fused.reshape(nk, -1, fused.shape[-1]).split([dk, dk, r * dv, r * dv, r, r], dim=1)
        flat = lambda t: t.reshape(-1, fused.shape[-1])  # noqa: E731
        return [torch.cat([flat(q), flat(k), flat(v)]), flat(z), flat(b), flat(a)]

    def _join_gdn_in_separate(self, q, k, v, g, b, a):
        """OLMo Hybrid's six projections (its output gate ``g`` is Qwen3.5's z) -> one, grouped per key head."""
        return self._join_gdn_in(torch.cat([q, k, v]), g, b, a)

    def _split_gdn_in_separate(self, fused):
        nk, r, dk, dv = self._gdn_sizes()
        qkv, g, b, a = self._split_gdn_in(fused)
        return [*qkv.split([nk * dk, nk * dk, nk * r * dv]), g, b, a]

    def _join_gdn_in_grouped(self, qkvz, ba):
        """Qwen3-Next's ``in_proj_qkvz`` ([q | k | v | z] per key head) and ``in_proj_ba`` ([b | a] per key head)
        -> one projection, [q | k | v | z | b | a] per key head."""
        nk = self._gdn_sizes()[0]
        return torch.cat([qkvz.reshape(nk, -1, qkvz.shape[-1]), ba.reshape(nk, -1, ba.shape[-1])],
                         dim=1).reshape(-1, qkvz.shape[-1])

    def _split_gdn_in_grouped(self, fused):
        nk, r, dk, dv = self._gdn_sizes()
        qkvz, ba = fused.reshape(nk, -1, fused.shape[-1]).split([2 * dk + 2 * r * dv, 2 * r], dim=1)
        return [qkvz.reshape(-1, fused.shape[-1]), ba.reshape(-1, fused.shape[-1])]

    def _join_gdn_conv(self, conv):
        """HF's depthwise conv weight [C, 1, K], channels [q | k | v] -> [C, K] grouped per key head."""
        nk, r, dk, dv = self._gdn_sizes()
        q, k, v = conv[:, 0].split([nk * dk, nk * dk, nk * r * dv])
        return torch.cat([t.reshape(nk, -1, conv.shape[-1]) for t in (q, k, v)], dim=1).reshape(-1, conv.shape[-1])

    def _split_gdn_conv(self, conv):
        nk, r, dk, dv = self._gdn_sizes()
        q, k, v = conv.reshape(nk, -1, conv.shape[-1]).split([dk, dk, r * dv], dim=1)
        return [torch.cat([t.reshape(-1, conv.shape[-1]) for t in (q, k, v)])[:, None]]

    def _mamba_sizes(self):
        """(groups G, heads per group r, state size N, head dim P) of the Mamba-2 layers."""
        G, r, N, P = self._gdn_sizes()
        return G, r, N, P

    def _join_mamba_in(self, fused):
        """HF's Mamba-2 ``in_proj`` rows [z (H P) | x (H P) | B (G N) | C (G N) | dt (H)] -> per group
        [z_g | x_g | B_g | C_g | dt_g]."""
        G, r, N, P = self._mamba_sizes()
        parts = fused.split([G * r * P, G * r * P, G * N, G * N, G * r])
        return torch.cat([t.reshape(G, -1, *fused.shape[1:]) for t in parts], dim=1).reshape(fused.shape)

    def _split_mamba_in(self, grouped):
        G, r, N, P = self._mamba_sizes()
        parts = grouped.reshape(G, -1, *grouped.shape[1:]).split([r * P, r * P, N, N, r], dim=1)
        return (torch.cat([t.reshape(-1, *grouped.shape[1:]) for t in parts]),)

    def _mamba_conv_grouped(self, conv):
        """HF's Mamba-2 convolution channels [x (H P) | B (G N) | C (G N)] (a weight [C, K] or a bias [C]) -> per
        group [x_g | B_g | C_g]."""
        G, r, N, P = self._mamba_sizes()
        parts = conv.split([G * r * P, G * N, G * N])
        return torch.cat([t.reshape(G, -1, *conv.shape[1:]) for t in parts], dim=1).reshape(conv.shape)

    def _mamba_conv_hf(self, grouped):
        G, r, N, P = self._mamba_sizes()
        parts = grouped.reshape(G, -1, *grouped.shape[1:]).split([r * P, N, N], dim=1)
        return torch.cat([t.reshape(-1, *grouped.shape[1:]) for t in parts])

    def _join_kda_in(self, q, k, v, b):
        """Kimi Delta Attention's q, k, v [H d, D] and b [H, D] -> one projection, [q | k | v | b] per head."""
        heads = self.cfg.linear_num_value_heads
        return torch.cat([t.reshape(heads, -1, t.shape[-1]) for t in (q, k, v, b)], dim=1).reshape(-1, q.shape[-1])

    def _split_kda_in(self, fused):
        heads, d = self.cfg.linear_num_value_heads, self.cfg.linear_value_head_dim
        parts = fused.reshape(heads, 3 * d + 1, fused.shape[-1]).split([d, d, d, 1], dim=1)
        return [t.reshape(-1, fused.shape[-1]) for t in parts]

    def _join_gdn_conv_separate(self, q, k, v):
        """OLMo Hybrid's ``q_conv1d``, ``k_conv1d``, ``v_conv1d`` [C_x, 1, K] -> [C, K] grouped per key head."""
        return self._join_gdn_conv(torch.cat([q, k, v]))

    def _split_gdn_conv_separate(self, conv):
        nk, r, dk, dv = self._gdn_sizes()
        return list(self._split_gdn_conv(conv)[0].split([nk * dk, nk * dk, nk * r * dv]))

    # --- sharding -------------------------------------------------------------------------------------------
    def check_layout(self, layout: ParallelLayout) -> None:
        """Raise ValueError naming the size that ``layout`` does not divide."""
        from forge_megatron.mcore.parallel import pipeline_chunks

        cfg = self.cfg
        chunks = pipeline_chunks(cfg.num_layers, layout.pp, None, layout.first, layout.last)  # the layers split
        if cfg.shortcut_moe and any(r.start % 2 or len(r) % 2 for r in chunks):
            raise ValueError(f"pp={layout.pp}: LongCat-Flash's checkpoint layers are pairs of Megatron layers that a "
                             f"pipeline stage must hold whole; the stages would hold {[len(r) for r in chunks]} of its "
                             f"{cfg.num_layers} (--decoder-first/last-pipeline-num-layers: even counts)")
        checks = [
            ("num_query_groups", cfg.num_query_groups, "tp", layout.tp),
            ("global_num_query_groups", cfg.global_num_query_groups or cfg.num_query_groups, "tp", layout.tp),
            ("vocab_size", cfg.vocab_size, "tp", layout.tp),
            ("ffn_hidden_size", cfg.ffn_hidden_size, "tp", layout.tp),
        ]
        if cfg.hybrid or cfg.mamba_beside_attention:
            checks.append(("linear_num_key_heads", cfg.linear_num_key_heads, "tp", layout.tp))
            if cfg.linear_attention_kind == "kimi_delta":  # the gates' down projections, split then gathered
                checks.append(("2 * linear_head_dim", 2 * cfg.linear_key_head_dim, "tp", layout.tp))
        if cfg.num_moe_experts:
            checks += [("num_moe_experts", cfg.num_moe_experts, "ep", layout.ep),
                       ("moe_ffn_hidden_size", cfg.moe_ffn_hidden_size, "etp", layout.expert_tp)]
            if cfg.moe_shared_ffn_hidden_size:
                checks.append(("moe_shared_ffn_hidden_size", cfg.moe_shared_ffn_hidden_size, "tp", layout.tp))
        elif layout.ep > 1:
            raise ValueError(f"ep={layout.ep} needs a MoE model; {self.family.name!r} config has no experts")
        if (self.family.gpt_oss or (cfg.num_moe_experts and cfg.add_bias_linear)) and layout.expert_tp > 1:
            raise ValueError(f"tp={layout.tp}: the experts have biases, which Megatron supports only without expert "
                             "tensor parallelism: add --expert-tensor-parallel-size 1 (or use TP = 1)")
        elif layout.expert_tp != layout.tp and not cfg.num_moe_experts:
            raise ValueError(f"etp={layout.expert_tp} needs a MoE model; {self.family.name!r} config has no experts")
        for what, size, axis, parts in checks:
            if size % parts:
                raise ValueError(f"{axis}={parts} does not divide {what}={size}")

    def shard(self, name: str, full: torch.Tensor, layout: ParallelLayout, tp_rank: int) -> torch.Tensor:
        """TP rank ``tp_rank``'s piece of canonical tensor ``name`` under ``layout``: experts are split over the
        experts' TP size, so with ETP = 1 every TP rank holds them whole."""
        if layout.expert_tp == 1 and self.is_expert(name):
            return full
        return self.tp_split(name, full, layout.tp)[tp_rank]

    def tp_split(self, name: str, full: torch.Tensor, tp: int) -> list[torch.Tensor]:
        kind = self.rule(name)[0].tp
        if kind == "rep" or tp == 1:
            return [full] * tp
        if kind == "glu":
            gate, up = full.chunk(2, dim=0)
            return [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))]
        return [t.contiguous() for t in full.chunk(tp, dim=0 if kind == "col" else 1)]

    def tp_join(self, name: str, shards: list[torch.Tensor]) -> torch.Tensor:
        kind = self.rule(name)[0].tp
        if kind == "rep" or len(shards) == 1:
            return shards[0]
        if kind == "glu":
            halves = [s.chunk(2, dim=0) for s in shards]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        return torch.cat(shards, dim=0 if kind == "col" else 1)

    def is_expert(self, name: str) -> bool:
        return self.rule(name)[0].is_expert

    def stage_layers(self, layout: ParallelLayout, pp_rank: int) -> range:
        from forge_megatron.mcore.parallel import pipeline_chunks

        return pipeline_chunks(self.cfg.num_layers, layout.pp, None, layout.first, layout.last)[pp_rank]

    def stage_names(self, layout: ParallelLayout, pp_rank: int) -> list[str]:
        """Canonical names held by pipeline stage ``pp_rank`` (embedding first stage, head and final norm last)."""
        return self.piece_names(self.stage_layers(layout, pp_rank), pp_rank == 0, pp_rank == layout.pp - 1)

    def piece_names(self, layers: range, first: bool, last: bool) -> list[str]:
        """Canonical names of a model piece holding ``layers`` (a pipeline stage, or one virtual-pipeline chunk of
        it): the embedding (and a trained vision tower) when it is the ``first`` piece, the final norm and the head
        when it is the ``last``."""
        names = self.canonical_names(layers)
        if first:
            names[:0] = ["embedding.word_embeddings.weight", *self._vision]
            if self.cfg.per_layer_input_size:  # Gemma 4 E2B / E4B: the per-layer inputs are made with the embedding
                names[1:1] = [r.mcore for r in self.rules if r.mcore.startswith("embedding.per_layer.")]
        if last:
            names.append("decoder.final_layernorm.weight")
            if any(r.mcore == "decoder.final_layernorm.bias" for r in self.rules):  # (a LayerNorm's: Jais 2)
                names.append("decoder.final_layernorm.bias")
            if not self.cfg.tie_word_embeddings:
                names.append("output_layer.weight")
            if self.cfg.score_head:
                names.append(SCORE_HEAD)
        return names

    def initial_score_head(self, seed: int = 0) -> torch.Tensor:
        """A reward model's score head before training, for a checkpoint without one (a causal LM made a reward model):
        normal with the config's ``initializer_range`` (transformers' init), the same on every rank for ``seed``."""
        from forge_megatron.bridge.families import text_view

        std = float(text_view(self.hf_config).get("initializer_range", 0.02))
        generator = torch.Generator().manual_seed(seed)
        return torch.randn((self.cfg.score_head, self.cfg.hidden_size), generator=generator) * std

    def rename(self, name: str, layer_offset: int, expert_offset: int) -> str:
        """Shift the layer and expert numbers of ``name`` (local -> canonical with +offsets, back with -offsets)."""
        rule, idx = self.rule(name)
        if not idx:
            return name
        return rule.mcore.format(layer=idx["layer"] + layer_offset, expert=idx.get("expert", 0) + expert_offset)

    def local_experts(self, layout: ParallelLayout) -> int:
        return (self.cfg.num_moe_experts or 0) // layout.ep

    def expert_rank(self, name: str, layout: ParallelLayout) -> int | None:
        """EP rank that holds canonical expert parameter ``name`` (None for non-expert parameters)."""
        rule, idx = self.rule(name)
        return idx["expert"] // self.local_experts(layout) if rule.is_expert else None
