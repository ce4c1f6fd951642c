"""Build Megatron-Core GPT models (dense and MoE) from one small config dataclass.

The trainer, the bridge (HF <-> Megatron conversion), the tests and the demo all build models here, so the
mapping from "a Llama/Qwen-style architecture" to Megatron's ``TransformerConfig`` + layer spec lives in one
place. Layer specs: the local (pure Megatron-Core) spec everywhere, Transformer Engine's when it is installed
and requested. Tree attention is swapped in through :mod:`forge_megatron.mcore.tree_attention` specs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GPTConfig:
    """Architecture of a decoder-only LM. Defaults describe a tiny Qwen2-like model for CPU tests."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2  # GQA: key/value heads
    ffn_hidden_size: int = 128
    vocab_size: int = 256
    max_position_embeddings: int = 4096
    kv_channels: int | None = None  # head dim; None = hidden_size // num_attention_heads
    normalization: str = "RMSNorm"  # "RMSNorm" | "LayerNorm"
    # LayerNorm without a bias (Cohere: transformers' CohereLayerNorm, computed in fp32; mcore/parallel_block.py);
    # False needs normalization "LayerNorm"
    norm_bias: bool = True
    # Cohere: attention and MLP both read the layer's input norm and add their outputs to the residual together
    # (y = x + Attn(n) + MLP(n), n = Norm(x): mcore/parallel_block.py); the layer has no norm before its MLP
    parallel_block: bool = False
    norm_epsilon: float = 1e-6
    swiglu: bool = True
    add_qkv_bias: bool = True  # Qwen2: True, Llama/Qwen3: False
    add_bias_linear: bool = False
    qk_layernorm: bool = False  # Qwen3
    # MiniMax-M2: one RMSNorm over all query heads of a token (and one over all key heads) instead of one per head
    # (mcore/qk_norm.py); needs qk_layernorm
    qk_layernorm_all_heads: bool = False
    # Hunyuan: the per-head q/k RMSNorms follow RoPE instead of preceding it (mcore/qk_norm.py); needs qk_layernorm
    qk_norm_after_rope: bool = False
    # where a layer's norms sit (mcore/post_norm.py): before attention and MLP (pre_norm: Llama, Qwen, ...), on their
    # outputs before the residual adds (post_norm without pre_norm: OLMo 2 / 3), or both (Gemma 3's sandwich)
    pre_norm: bool = True
    post_norm: bool = False
    # A.X K1: an RMSNorm on each MoE layer's MLP output (experts plus shared expert) before the residual adds it,
    # dense layers without (mcore/post_norm.py moe_output_norm_spec); needs experts and pre_norm without post_norm
    moe_output_norm: bool = False
    # the GLU's activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU); a plain MLP's: "relu2" (squared ReLU) or
    # "xielu" (Apertus: two trained scalars per MLP, mcore/xielu.py)
    activation: str = "silu"
    # the embedding's output is multiplied by this: Gemma's sqrt(hidden_size), rounded to the output's dtype first as
    # HF does (embedding_multiplier_rounded); Granite's, Falcon-H1's and AFMoE's, a Python float as HF multiplies by
    embedding_multiplier: float | None = None
    embedding_multiplier_rounded: bool = True
    softmax_scale: float | None = None  # attention's scale before any YaRN factor; None: 1 / sqrt(head_dim)
    # the logits are soft-capped to c * tanh(logits / c) (Gemma 2 / 4's final_logit_softcapping); None: not capped.
    # Megatron's output layer caps its logits (a hook); the fused logprobs cap each chunk they make
    final_logit_softcapping: float | None = None
    # Gemma 2: every attention score s (scaled q . k) soft-capped to c * tanh(s / c) before the softmax (the tree
    # kernels' ``softcap``; the causal model's core attention: CausalCoreAttention); None: not capped
    attention_softcapping: float | None = None
    # Llama 4: the layers that rotate (not nope_layers) attend within chunks of this many positions (a query sees the
    # keys of its own chunk: the tree kernels' ``chunk``); None: every layer sees all earlier keys
    attention_chunk_size: int | None = None
    # Llama 4: a weightless RMS norm (Megatron's L2Norm) on every query and key head of the layers that rotate (it
    # commutes with RoPE's rotation, so Megatron's place for q/k norms, before RoPE, computes HF's after it)
    qk_l2_norm: bool = False
    # Cohere2-MoE's "average" shared-expert combination: every MoE layer's output (routed and shared experts
    # together) times this (0.5); None: their sum, as Megatron's MoE layer makes it
    moe_output_multiplier: float | None = None
    # Cohere's logit_scale: the logits are multiplied by it (the output layer's input is: the same logits, and the
    # fused logprobs see them too); None: not scaled
    logit_multiplier: float | None = None
    # Granite's muP-style scales: each attention's and MLP's output is multiplied by ``residual_multiplier`` before
    # the residual adds it, and the logits are divided by ``logits_scaling`` (the output layer's input is: the same
    # logits, and the fused logprobs see them too); None: neither
    residual_multiplier: float | None = None
    logits_scaling: float | None = None
    rotary_base: float = 10000.0
    rope_scaling: dict | None = None  # HF RoPE scaling (linear / llama3 / yarn: mcore/rope.py); None: plain RoPE
    # the sliding-window layers' RoPE scaling where it differs from the others' (OLMo 3: YaRN on the full-attention
    # layers only; {"rope_type": "default"}: plain); None: every layer has ``rope_scaling``
    sliding_rope_scaling: dict | None = None
    sliding_rotary_base: float | None = None  # their RoPE base where it differs (Gemma 3: 10k local, 1M global)
    # the other way round: the full-attention layers' RoPE where it differs, rope_scaling / rotary_base then being the
    # sliding layers' (LFM3: proportional RoPE, base 1M, on its full layers beside plain base-10k sliding ones: some
    # of its frequencies are 0, so it cannot be the model's table; mcore/rope.py apply_to_sliding_layers)
    full_rope_scaling: dict | None = None
    full_rotary_base: float | None = None
    # a sigmoid gate per attention head from its own projection (``linear_gate`` [heads, hidden]) scaling that head's
    # output before linear_proj (LFM3's g_proj; mcore/head_gate.py); its activation ("sigmoid", or Laguna's
    # "softplus") and, with head_gate_per_element, a gate per channel of every head ([heads x head_dim, hidden])
    attention_head_gate: bool = False
    head_gate_activation: str = "sigmoid"
    head_gate_per_element: bool = False
    # layers that rotate nothing (SmolLM3's NoPE layers, every fourth): True where RoPE is left out; None: none
    nope_layers: tuple[bool, ...] | None = None
    rotary_percent: float = 1.0  # the fraction of each head RoPE rotates (its first channels; GLM-4.5: 0.5)
    rotary_interleaved: bool = False  # rotate interleaved channel pairs (GLM-4 dense), not the two halves
    # Ministral 3 / Llama 4's attention temperature: (beta, original_max_position_embeddings); queries at position p
    # are multiplied by 1 + beta * log(1 + floor(p / original_max)) (rope.scale_queries)
    query_scaling: tuple[float, int] | None = None
    # Llama 4's attention temperature on its NoPE layers only: (attn_scale, floor_scale), queries at position p
    # multiplied by 1 + attn_scale * log(1 + floor((p + 1) / floor_scale))
    nope_query_scaling: tuple[float, int] | None = None
    tie_word_embeddings: bool = False
    init_method_std: float = 0.02
    # MoE (num_moe_experts=None: dense)
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_token_dispatcher_type: str = "alltoall"
    moe_aux_loss_coeff: float = 0.0
    moe_router_pre_softmax: bool = False  # Qwen3-MoE: softmax over all experts then top-k (False), renormalised
    moe_router_topk_renorm: bool = True  # norm_topk_prob in HF Qwen3-MoE
    moe_shared_ffn_hidden_size: int | None = None  # shared experts' MLP width (GLM-4.5); None: no shared experts
    # LatentMoE (Nemotron 3 Super / Ultra): the routed experts work in this narrower space, projected to it before
    # dispatch and back after the combine (mcore/latent_moe.py); the router and shared experts read the hidden state
    moe_latent_size: int | None = None
    moe_dense_layers: int = 0  # the first layers of a MoE model that have a dense MLP (GLM-4.5's first_k_dense)
    # which layers are MoE where dense ones are interleaved with them (Llama 4 Maverick's every other layer); None:
    # all but the first moe_dense_layers
    moe_layer_pattern: tuple[bool, ...] | None = None
    # Nemotron-H: each layer one sublayer behind its own norm: "mamba" (a Mamba-2 mixer: linear_attention marks it),
    # "attention", "mlp" or "moe" (the others built as Megatron's identities); None: attention and MLP in every layer
    layer_kinds: tuple[str, ...] | None = None
    # ERNIE 4.5: the top k chosen by the softmax probabilities plus a score-correction bias (``router.expert_bias``),
    # their probabilities renormalised (mcore/ernie.py; Megatron's softmax router takes no expert bias)
    moe_softmax_bias_router: bool = False
    # Kolibri 1: the top k chosen by the router logits plus a bias (``router.expert_bias``), weighted by their
    # sigmoids, renormalised over the k with moe_router_topk_renorm (mcore/ernie.py LogitBiasRouter)
    moe_logit_bias_router: bool = False
    # DeepSeek-V2 / V2.5's group_limited_greedy: (groups, groups kept per token), a group scored by its best expert's
    # softmax probability, the top k of the kept groups' experts weighted by their probabilities (mcore/ernie.py)
    moe_greedy_groups: tuple[int, int] | None = None
    # Gemma 4 26B-A4B: every layer's routed experts run beside a dense MLP of ffn_hidden_size, each branch with its
    # own input and output norms, the router on the un-normalised input (mcore/gemma4.py); needs post_norm / pre_norm
    moe_beside_dense: bool = False
    # LongCat-Flash (mcore/longcat.py): Megatron layers in pairs, one checkpoint layer each (num_layers counts Megatron
    # layers: twice the checkpoint's); the first of a pair runs the routed experts beside a dense MLP of
    # ffn_hidden_size on its MLP input, the dense output added at once, the routed output carried beside the hidden
    # states to the end of the second, whose MLP is dense; moe_zero_experts zero-computation (identity) experts join
    # the routed ones under LongCat's router (softmax over all, chosen with the score-correction bias, scaled)
    shortcut_moe: bool = False
    moe_zero_experts: int = 0
    # Multi-latent attention (DeepSeek-V3, Kimi-K2, Moonlight; Megatron's MLA names): keys and values come from a
    # kv_lora_rank-wide latent, queries from a q_lora_rank-wide one (None: projected directly); a query/key head is
    # qk_head_dim channels without RoPE then qk_pos_emb_head_dim rotated ones (the rotated key is shared by every
    # head); a value head is v_head_dim wide. kv_lora_rank=None: standard attention.
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # LongCat-Flash: the query (after its up projection) and the key/value latent (after its norm) multiplied by these
    # (sqrt(hidden / q_lora_rank), sqrt(hidden / kv_lora_rank)); the latent norms' own epsilon. None: as DeepSeek-V3
    mla_latent_scales: tuple[float, float] | None = None
    mla_latent_norm_epsilon: float | None = None
    # DeepSeek sparse attention (DeepSeek-V3.2, GLM-5; mcore/dsa.py), on multi-latent attention with a query latent: an
    # indexer of dsa_index_heads heads of dsa_index_head_dim channels picks the dsa_index_topk keys each query attends
    # to; its RoPE rotates the halves (DeepSeek-V3.2) or interleaved pairs (dsa_rope_interleaved: GLM-5); GLM's
    # dsa_shared_layers (True: no indexer) reuse the last full layer's selection. dsa_index_heads=None: dense.
    dsa_index_heads: int | None = None
    dsa_index_head_dim: int = 128
    dsa_index_topk: int = 2048
    dsa_rope_interleaved: bool = False
    dsa_shared_layers: tuple[bool, ...] | None = None
    dsa_indexer_loss_coeff: float = 0.0  # > 0: the indexer trains on its KL to the main attention (mcore/dsa.py)
    # MiniMax-M3's block-sparse attention (mcore/block_sparse.py) in the layers block_sparse_layers marks: an indexer
    # of one head of block_index_head_dim channels per key head keeps, per query, block_topk blocks of block_size
    # positions (the block_local ones ending at the query's always). None: dense everywhere
    block_sparse_layers: tuple[bool, ...] | None = None
    block_index_heads: int = 4
    block_index_head_dim: int = 128
    block_size: int = 128
    block_topk: int = 16
    block_local: int = 1
    # Qwen3.5 / Qwen3-Next: norms scale by (1 + weight) (weights stored zero-centred), a sigmoid gate on every
    # attention head's output (the query projection's second half), and Gated DeltaNet (linear attention) layers
    # where ``linear_attention[i]`` is true (mcore/gated_delta_net.py); the linear_* sizes are theirs
    zero_centered_norm: bool = False
    attention_output_gate: bool = False
    linear_attention: tuple[bool, ...] | None = None
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel: int = 4
    # OLMo Hybrid: the Gated DeltaNet layers normalise their sublayers' inputs (Llama's pre-norm layer) whatever
    # pre_norm / post_norm say of the full-attention layers (OLMo 3's post-norm ones there)
    linear_pre_norm: bool = False
    # the write strength beta = scale * sigmoid(b) (OLMo Hybrid's allow_neg_eigval: 2, so beta in (0, 2): the state
    # transition I - beta k k^T may have negative eigenvalues)
    linear_beta_scale: float = 1.0
    linear_norm_epsilon: float | None = None  # the gated output norm's epsilon; None: norm_epsilon
    # the linear-attention layers' kind: "gated_delta" (Gated DeltaNet: Qwen3.5, Qwen3-Next, OLMo Hybrid),
    # "kimi_delta" (Kimi Delta Attention: a decay per key channel, low-rank gates; mcore/kimi_delta.py) or "mamba2"
    # (Mamba-2: Granite 4.0-H; mcore/mamba2.py: linear_num_key_heads its groups, linear_num_value_heads its heads,
    # linear_key_head_dim its state size, linear_value_head_dim its head dim) or "short_conv" (LFM2's gated short
    # convolutions over the hidden channels, linear_conv_kernel taps; mcore/short_conv.py) or "lightning"
    # (MiniMax-01 / M1's linear attention with a fixed decay per head: linear_num_*_heads its heads,
    # linear_*_head_dim its head dim; mcore/lightning.py)
    linear_attention_kind: str = "gated_delta"
    # MiniMax-01 / M1 (mcore/post_norm.py NormResidualLayer): each sublayer's residual is its input norm's output,
    # alpha * norm(x) + beta * sublayer(norm(x)); ((alpha, beta) of the full-attention layers' attention, of the
    # linear-attention layers', of every MLP). None: Megatron's residuals (x + sublayer(norm(x)))
    norm_residual_scales: tuple | None = None
    # Falcon-H1: a Mamba-2 mixer (the linear_* sizes, linear_attention_kind "mamba2") beside the attention in every
    # layer, both on the input norm's output (mcore/falcon_h1.py), with its muP multipliers: (attention input,
    # attention output, Mamba output), the Mamba input's and its in_proj segments' [z, x, B, C, dt], the MLP's
    # (gate, down); mamba_gated_norm False: y * silu(z) without the gated RMSNorm (Falcon-H1's mamba_rms_norm)
    mamba_beside_attention: bool = False
    hybrid_multipliers: tuple[float, float, float] | None = None
    mamba_in_multiplier: float | None = None
    mamba_segment_multipliers: tuple[float, float, float, float, float] | None = None
    mamba_gated_norm: bool = True
    mlp_multipliers: tuple[float, float] | None = None
    mamba_conv_bias: bool = True  # Mamba-2: a bias on the short convolution
    short_conv_bias: bool = False  # "short_conv" (LFM2's gated short convolutions, mcore/short_conv.py): a conv bias
    mamba_dt_limit: tuple[float, float] | None = None  # Mamba-2: the time step clamped to (min, max); None: (0, inf)
    # Laguna (mcore/gemma4.py's per-layer attention): each layer's query heads (its key heads the model's), and the
    # global (not sliding-window) layers' plain RoPE of their own over the first fraction of each head (base,
    # fraction), the sliding layers rotating whole heads with the model's table. None: as every other model
    layer_attention_heads: tuple[int, ...] | None = None
    global_partial_rotary: tuple[float, float] | None = None
    # Gemma 4 (mcore/gemma4.py): the global (not sliding-window) layers' own head size and key heads, values that
    # are the projected keys there (attention_k_eq_v), and their proportional RoPE (base, rotated fraction, factor)
    # in place of the model's table; a scale-free RMSNorm on every layer's values; a checkpoint scalar multiplying
    # each layer's output. None / False: as every other model
    global_kv_channels: int | None = None
    global_num_query_groups: int | None = None
    global_values_from_keys: bool = False
    global_rotary: tuple[float, float, float] | None = None
    value_norm: bool = False
    layer_scalars: bool = False
    # MiMo-V2-Flash (mcore/gemma4.py's per-layer attention): value heads of value_head_dim channels where they differ
    # from the query / key heads' kv_channels (None: the same), the values multiplied by value_scale as projected
    # (None: not scaled), and a learned sink logit per head in the layers sink_layers marks (None: every layer or
    # none, as extra's softmax_type says)
    value_head_dim: int | None = None
    value_scale: float | None = None
    sink_layers: tuple[bool, ...] | None = None
    # Gemma 4 E2B / E4B: per-layer inputs of this width from their own embedding table of per_layer_input_vocab rows
    # (0: none); kv_shared_from[i]: the earlier layer whose keys and values layer i reuses (None: its own); each
    # layer's MLP width where they differ (the KV-shared layers' double-wide MLP); all in mcore/gemma4.py
    per_layer_input_size: int = 0
    per_layer_input_vocab: int | None = None
    # ... and of a vision-language release, (image token, pad token): an image token's per-layer inputs are the pad
    # token's identity row and the projection of its image features (transformers' Gemma4Model)
    per_layer_image_token: tuple[int, int] | None = None
    kv_shared_from: tuple[int | None, ...] | None = None
    layer_ffn_sizes: tuple[int, ...] | None = None
    params_dtype: torch.dtype = torch.float32
    bf16: bool = False
    # a reward model (a sequence-classification checkpoint): this many scores from a linear head on the last stage's
    # final hidden states (``score_head``, HF ``score.weight``); 0: a language model
    score_head: int = 0
    extra: dict = field(default_factory=dict)  # passed through to TransformerConfig

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads and self.kv_channels is None:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}) unless kv_channels is given"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_query_groups "
                f"({self.num_query_groups})"
            )
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"normalization must be 'RMSNorm' or 'LayerNorm', got {self.normalization!r}")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            raise ValueError(f"final_logit_softcapping must be > 0 or None, got {self.final_logit_softcapping!r}")
        if self.attention_chunk_size is not None or self.qk_l2_norm or self.nope_query_scaling is not None:
            if self.multi_latent_attention or self.per_layer_attention or self.hybrid or self.qk_layernorm \
                    or self.block_sparse_layers is not None:
                raise ValueError("attention_chunk_size / qk_l2_norm / nope_query_scaling (Llama 4) are for standard "
                                 "attention without q/k layernorms")
            if self.attention_chunk_size is not None and self.attention_chunk_size < 1:
                raise ValueError(f"attention_chunk_size must be >= 1 or None, got {self.attention_chunk_size}")
            if self.nope_query_scaling is not None:
                beta, floor = self.nope_query_scaling
                self.nope_query_scaling = (float(beta), int(floor))
                if floor < 1 or self.query_scaling is not None or not (self.nope_layers and any(self.nope_layers)):
                    raise ValueError("nope_query_scaling needs floor_scale >= 1, NoPE layers to scale (nope_layers) "
                                     "and no query_scaling beside it")
        if self.moe_layer_pattern is not None:
            self.moe_layer_pattern = tuple(bool(x) for x in self.moe_layer_pattern)
            if len(self.moe_layer_pattern) != self.num_layers or not any(self.moe_layer_pattern) \
                    or not self.num_moe_experts or self.moe_dense_layers or self.layer_kinds is not None \
                    or self.shortcut_moe or self.hybrid:
                raise ValueError("moe_layer_pattern marks each layer (num_layers of them, one at least) MoE or dense, "
                                 "in a MoE model without moe_dense_layers, layer_kinds, shortcut_moe or linear "
                                 "attention")
        if self.moe_latent_size is not None and (not self.num_moe_experts or self.moe_latent_size <= 0 or
                                                 self.moe_beside_dense or self.shortcut_moe or
                                                 self.moe_softmax_bias_router or self.moe_logit_bias_router):
            raise ValueError("moe_latent_size needs routed experts in Megatron's own MoE layer (no Gemma 4 / "
                             "LongCat / ERNIE layouts) and must be > 0")
        if self.attention_softcapping is not None:
            if not self.attention_softcapping > 0:
                raise ValueError(f"attention_softcapping must be > 0 or None, got {self.attention_softcapping!r}")
            if self.multi_latent_attention or self.per_layer_attention or self.block_sparse_layers is not None:
                raise ValueError("attention_softcapping with multi-latent, per-layer or block-sparse attention: no "
                                 "model has both; Gemma 2's standard attention only")
        if not self.norm_bias and self.normalization != "LayerNorm":
            raise ValueError("norm_bias=False is a LayerNorm without its bias: it needs normalization 'LayerNorm'")
        if self.parallel_block and (self.post_norm or not self.pre_norm or self.multi_latent_attention
                                    or self.hybrid or self.layer_kinds is not None or self.shortcut_moe
                                    or self.moe_beside_dense or self.per_layer_attention):
            raise ValueError("parallel_block (Cohere: attention and MLP on one input norm) is supported for pre-norm "
                             "layers of standard attention and an MLP or MoE (no post-norms, MLA, linear attention, "
                             "layer_kinds, per-layer attention or LongCat / Gemma 4 MoE layouts)")
        if self.mamba_beside_attention and (self.linear_attention is not None or self.linear_attention_kind != "mamba2"
                                            or self.multi_latent_attention or self.num_moe_experts or self.post_norm
                                            or self.parallel_block or self.layer_kinds is not None
                                            or self.per_layer_attention or self.add_bias_linear):
            raise ValueError("mamba_beside_attention (Falcon-H1) runs a Mamba-2 mixer (linear_attention_kind "
                             "'mamba2', no linear_attention layers) beside standard attention in every pre-norm "
                             "layer of a dense model without biases")
        if not self.mamba_beside_attention and (self.hybrid_multipliers is not None or
                                                self.mamba_segment_multipliers is not None or
                                                self.mamba_in_multiplier is not None):
            raise ValueError("hybrid_multipliers / mamba_in_multiplier / mamba_segment_multipliers are Falcon-H1's: "
                             "they need mamba_beside_attention")
        if self.moe_output_multiplier is not None and not self.num_moe_experts:
            raise ValueError("moe_output_multiplier scales MoE layers' outputs: it needs num_moe_experts")
        for name in ("residual_multiplier", "logits_scaling", "logit_multiplier", "moe_output_multiplier"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name} must be > 0 or None, got {value!r}")
        if self.logits_scaling is not None and self.logit_multiplier is not None:
            raise ValueError("logits_scaling (Granite: divides) with logit_multiplier (Cohere: multiplies): give one")
        if (self.logits_scaling is not None or self.logit_multiplier is not None) and \
                self.final_logit_softcapping is not None:
            raise ValueError("logits_scaling with final_logit_softcapping: no model has both (the cap would have to "
                             "follow the division)")
        from forge_megatron.mcore import rope

        self.rope_scaling = rope.check(self.rope_scaling, self.max_position_embeddings)
        if self.rotary_interleaved and (self.multi_latent_attention or self.sliding_rope_scaling is not None):
            raise ValueError("rotary_interleaved is supported with standard attention and one RoPE for every layer")
        if self.sliding_rope_scaling is not None:
            self.sliding_rope_scaling = rope.check(self.sliding_rope_scaling, self.max_position_embeddings) or \
                {"rope_type": "default"}
            if not self.extra.get("window_size") or self.multi_latent_attention:
                raise ValueError("sliding_rope_scaling needs sliding-window layers (extra window_size) and standard "
                                 "attention")
        if self.full_rope_scaling is not None:
            self.full_rope_scaling = rope.check(self.full_rope_scaling, self.max_position_embeddings) or \
                {"rope_type": "default"}
            if not self.extra.get("window_size") or self.multi_latent_attention or self.rotary_percent != 1.0 or \
                    self.sliding_rope_scaling is not None or self.rotary_interleaved or self.per_layer_attention:
                raise ValueError("full_rope_scaling needs sliding-window layers (extra window_size), standard attention "
                                 "rotating whole heads in halves, and no sliding_rope_scaling beside it")
        if self.attention_head_gate and (self.multi_latent_attention or self.attention_output_gate or
                                         self.block_sparse_layers is not None or self.value_head_dim or
                                         self.kv_shared_from or self.global_values_from_keys):
            raise ValueError("attention_head_gate (a gate per head: LFM3, Laguna) is supported with standard attention "
                             "without Megatron's own output gate")
        if self.head_gate_activation not in ("sigmoid", "softplus"):
            raise ValueError(f"head_gate_activation must be 'sigmoid' or 'softplus', got {self.head_gate_activation!r}")
        if self.rotated_channels_scale != 1.0:
            if self.sliding_rope_scaling is not None or self.per_layer_attention or self.qk_norm_after_rope:
                raise ValueError("a RoPE attention factor (YaRN, longrope) on part of each head is supported with one "
                                 "RoPE for every layer, one head size and q/k norms (if any) before RoPE")
        elif self.rotary_percent != 1.0 and self.sliding_rope_scaling is not None and \
                rope.attention_factor(self.sliding_rope_scaling) != 1.0:
            raise ValueError("a YaRN attention factor on the sliding layers' RoPE over part of each head is not "
                             "supported")
        if self.qk_norm_after_rope and rope.attention_factor(self.rope_scaling) != 1.0:
            raise ValueError("a RoPE attention factor (YaRN, longrope) with q/k norms after RoPE is not supported")
        if self.multi_latent_attention:
            if self.num_query_groups != self.num_attention_heads:
                raise ValueError("multi-latent attention has one key/value head per query head: num_query_groups "
                                 f"({self.num_query_groups}) must equal num_attention_heads "
                                 f"({self.num_attention_heads})")
            if rope.attention_factor(self.rope_scaling) != 1.0:
                raise ValueError("multi-latent attention with a YaRN attention factor != 1 (mscale != mscale_all_dim) "
                                 "is not supported: it scales the rotated channels of each head only")
            if self.rotary_percent != 1.0:
                raise ValueError("multi-latent attention rotates all qk_pos_emb_head_dim channels: rotary_percent "
                                 "must be 1")
        if self.sparse_attention:
            if not self.multi_latent_attention or self.q_lora_rank is None:
                raise ValueError("DeepSeek sparse attention (dsa_index_heads) needs multi-latent attention with a "
                                 "query latent (kv_lora_rank and q_lora_rank)")
            if self.dsa_indexer_loss_coeff < 0:
                raise ValueError(f"dsa_indexer_loss_coeff must be >= 0, got {self.dsa_indexer_loss_coeff}")
            if self.dsa_index_topk < 1 or self.dsa_index_head_dim < self.qk_pos_emb_head_dim:
                raise ValueError(f"dsa_index_topk ({self.dsa_index_topk}) must be >= 1 and dsa_index_head_dim "
                                 f"({self.dsa_index_head_dim}) hold the {self.qk_pos_emb_head_dim} rotated channels")
            if self.dsa_shared_layers is not None:
                self.dsa_shared_layers = tuple(bool(x) for x in self.dsa_shared_layers)
                if len(self.dsa_shared_layers) != self.num_layers or self.dsa_shared_layers[0]:
                    raise ValueError(f"dsa_shared_layers needs one entry per layer ({self.num_layers}), the first "
                                     "layer with its own indexer")
        elif self.dsa_shared_layers is not None:
            raise ValueError("dsa_shared_layers without DeepSeek sparse attention (dsa_index_heads)")
        if self.block_sparse_layers is not None:
            self.block_sparse_layers = tuple(bool(x) for x in self.block_sparse_layers)
            if len(self.block_sparse_layers) != self.num_layers:
                raise ValueError(f"block_sparse_layers needs one entry per layer ({self.num_layers}), got "
                                 f"{len(self.block_sparse_layers)}")
            if self.multi_latent_attention or self.per_layer_attention or self.linear_attention is not None:
                raise ValueError("block-sparse attention (block_sparse_layers) goes with standard attention only")
            if self.block_index_heads != self.num_query_groups:
                raise ValueError(f"block_index_heads ({self.block_index_heads}) must equal num_query_groups "
                                 f"({self.num_query_groups}): one block selection per key head")
            rotated = int(self.kv_channels * self.rotary_percent)
            if min(self.block_size, self.block_topk) < 1 or not 0 <= self.block_local <= self.block_topk \
                    or self.block_index_head_dim < rotated:
                raise ValueError(f"block_size ({self.block_size}) and block_topk ({self.block_topk}) must be >= 1, "
                                 f"block_local ({self.block_local}) in [0, block_topk], and block_index_head_dim "
                                 f"({self.block_index_head_dim}) hold the {rotated} rotated channels")
        if self.qk_layernorm_all_heads and (not self.qk_layernorm or self.multi_latent_attention
                                            or self.normalization != "RMSNorm"):
            raise ValueError("qk_layernorm_all_heads is an RMSNorm over all query / key heads: it needs "
                             "qk_layernorm, RMSNorm and standard (not multi-latent) attention")
        if self.qk_norm_after_rope and (not self.qk_layernorm or self.qk_layernorm_all_heads
                                        or self.multi_latent_attention or self.normalization != "RMSNorm"):
            raise ValueError("qk_norm_after_rope moves the per-head q/k RMSNorms after RoPE: it needs qk_layernorm, "
                             "RMSNorm and standard attention (not qk_layernorm_all_heads or multi-latent attention)")
        if self.query_scaling is not None:
            beta, original = self.query_scaling
            self.query_scaling = (float(beta), int(original))
            if self.attention_output_gate or self.post_norm or original < 1:
                raise ValueError("query_scaling (beta, original_max_position_embeddings >= 1) is supported with "
                                 "standard or multi-latent attention only")
        if self.nope_layers is not None:
            self.nope_layers = tuple(bool(x) for x in self.nope_layers)
            if len(self.nope_layers) != self.num_layers or (self.multi_latent_attention and
                                                            not all(self.nope_layers)):
                raise ValueError(f"nope_layers has {len(self.nope_layers)} entries for {self.num_layers} layers (and "
                                 "needs standard attention, or multi-latent attention without RoPE in any layer)")
        if self.post_norm and (self.add_bias_linear or self.multi_latent_attention or
                               (self.hybrid and not self.linear_pre_norm and self.linear_attention_kind != "short_conv")):
            raise ValueError("post_norm (norms after attention and MLP: OLMo, Gemma 3 / 4) is supported with standard "
                             "attention and no linear biases (and, in a hybrid model, pre-norm Gated DeltaNet "
                             "layers: linear_pre_norm)")
        if not self.pre_norm and not self.post_norm:
            raise ValueError("a layer needs its norms before (pre_norm) or after (post_norm) its sublayers, or both")
        if self.moe_greedy_groups is not None:
            self.moe_greedy_groups = tuple(int(x) for x in self.moe_greedy_groups)
        routers = [self.moe_softmax_bias_router, self.moe_logit_bias_router, self.moe_greedy_groups is not None]
        if any(routers) and (not self.num_moe_experts or sum(routers) > 1 or self.moe_beside_dense):
            raise ValueError("moe_softmax_bias_router (ERNIE 4.5), moe_logit_bias_router (Kolibri 1) and "
                             "moe_greedy_groups (DeepSeek-V2) replace the router of Megatron's MoE layers: one of "
                             "them, with experts")
        if self.moe_greedy_groups is not None:
            groups, kept = self.moe_greedy_groups
            if groups < 1 or self.num_moe_experts % groups or not 1 <= kept <= groups or \
                    self.moe_router_topk > kept * (self.num_moe_experts // groups):
                raise ValueError(f"moe_greedy_groups {self.moe_greedy_groups}: groups must divide the "
                                 f"{self.num_moe_experts} experts and the kept groups hold the top "
                                 f"{self.moe_router_topk}")
        if self.moe_output_norm and (not self.num_moe_experts or self.post_norm or not self.pre_norm
                                     or self.moe_beside_dense or self.shortcut_moe or self.layer_kinds is not None):
            raise ValueError("moe_output_norm (A.X K1: a norm after each MoE layer's MLP) needs experts in a pre-norm "
                             "model without post_norm, Gemma 4's experts beside the MLP, LongCat's shortcut MoE or "
                             "layer kinds")
        if self.activation not in ("silu", "gelu_tanh", "relu2", "xielu") or \
                (self.activation in ("relu2", "xielu") and self.swiglu):
            raise ValueError(f"activation must be 'silu', 'gelu_tanh' (Gemma's GeGLU, StarCoder2's plain MLP), or in a "
                             f"plain one 'relu2' (squared "
                             f"ReLU) or 'xielu' (Apertus); got {self.activation!r} (swiglu={self.swiglu})")
        if self.activation == "xielu" and (self.num_moe_experts or self.add_bias_linear):
            raise ValueError("the xielu activation is for dense MLPs without biases (Apertus)")
        if self.layer_kinds is not None:
            self.layer_kinds = tuple(self.layer_kinds)
            kinds = set(self.layer_kinds)
            if len(self.layer_kinds) != self.num_layers or kinds - set(LAYER_KINDS):
                raise ValueError(f"layer_kinds needs one of {LAYER_KINDS} per layer ({self.num_layers}), got "
                                 f"{self.layer_kinds}")
            if ("moe" in kinds) != bool(self.num_moe_experts) or self.moe_dense_layers or \
                    ("mamba" in kinds) != bool(self.linear_attention and any(self.linear_attention)) or \
                    (self.linear_attention and tuple(k == "mamba" for k in self.layer_kinds) !=
                     tuple(bool(x) for x in self.linear_attention)):
                raise ValueError("layer_kinds: moe layers exactly when num_moe_experts (no moe_dense_layers), mamba "
                                 "layers exactly where linear_attention says")
        if self.linear_attention is not None:
            self.linear_attention = tuple(bool(x) for x in self.linear_attention)
            if len(self.linear_attention) != self.num_layers:
                raise ValueError(f"linear_attention has {len(self.linear_attention)} entries for {self.num_layers} "
                                 "layers")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                                 f"linear_num_key_heads ({self.linear_num_key_heads})")
            if self.linear_attention_kind not in ("gated_delta", "kimi_delta", "mamba2", "short_conv", "lightning"):
                raise ValueError("linear_attention_kind must be 'gated_delta', 'kimi_delta', 'mamba2', 'short_conv' or "
                                 f"'lightning', got {self.linear_attention_kind!r}")
            kda = self.linear_attention_kind == "kimi_delta"
            if self.mamba_dt_limit is not None:
                low, high = (float(x) for x in self.mamba_dt_limit)
                if not 0 <= low < high:
                    raise ValueError(f"mamba_dt_limit must be (min, max) with 0 <= min < max, got {self.mamba_dt_limit}")
                self.mamba_dt_limit = (low, high)
            # (Mamba-2 and short convolutions: beside dense-then-MoE layers too; LFM2-MoE's first layers are dense)
            if (self.multi_latent_attention or self.moe_dense_layers) and not kda and \
                    self.linear_attention_kind not in ("mamba2", "short_conv"):
                raise ValueError("Gated DeltaNet layers are supported with standard attention, in dense models or "
                                 "MoE models whose every layer is MoE")
            if (kda or self.linear_attention_kind == "lightning") and \
                    (self.linear_num_key_heads != self.linear_num_value_heads or
                        self.linear_key_head_dim != self.linear_value_head_dim):
                raise ValueError("Kimi Delta Attention and lightning attention have as many key as value heads, all "
                                 "of one size")
            if not 0 < self.linear_beta_scale <= 2:
                raise ValueError(f"linear_beta_scale must be in (0, 2], got {self.linear_beta_scale}")
        if self.norm_residual_scales is not None:
            self.norm_residual_scales = tuple((float(a), float(b)) for a, b in self.norm_residual_scales)
            if len(self.norm_residual_scales) != 3 or self.post_norm or not self.pre_norm or self.parallel_block or \
                    self.layer_kinds is not None or self.shortcut_moe or self.moe_beside_dense or \
                    self.mamba_beside_attention or self.moe_output_norm or self.add_bias_linear:
                raise ValueError("norm_residual_scales (MiniMax-01: residuals from the norms' outputs) takes three "
                                 "(alpha, beta) pairs (full attention, linear attention, MLP) for pre-norm layers of "
                                 "Megatron's own kind, without linear biases")
        if self.per_layer_attention:
            window = self.extra.get("window_size")
            if (self.global_kv_channels or self.global_num_query_groups or self.global_values_from_keys
                    or self.global_rotary or self.global_partial_rotary) and not window:
                raise ValueError("global-layer attention settings (Gemma 4) need sliding-window layers beside them "
                                 "(extra window_size / window_attn_skip_freq)")
            if self.multi_latent_attention or self.hybrid or self.attention_output_gate or self.qk_layernorm_all_heads:
                raise ValueError("per-layer attention (Gemma 4, MiMo-V2-Flash) is standard attention, with per-head "
                                 "q/k norms if any")
            if (self.global_rotary is not None or self.global_partial_rotary is not None) and \
                    (self.rope_scaling is not None or self.rotary_percent != 1.0 or self.rotary_interleaved):
                raise ValueError("global_rotary / global_partial_rotary read positions off the model's table: the "
                                 "local layers' RoPE must be plain over whole heads (rope_scaling None, rotary_percent "
                                 "1)")
            if self.global_rotary is not None and self.global_partial_rotary is not None:
                raise ValueError("global_rotary (proportional) and global_partial_rotary: one RoPE for the global "
                                 "layers")
            if self.global_partial_rotary is not None:
                base, fraction = self.global_partial_rotary
                self.global_partial_rotary = (float(base), float(fraction))
                if not 0 < fraction <= 1 or int(self.head_dim * fraction) % 2:
                    raise ValueError(f"global_partial_rotary {self.global_partial_rotary}: a fraction in (0, 1] of "
                                     "an even number of channels")
            if self.layer_attention_heads is not None:
                self.layer_attention_heads = tuple(int(x) for x in self.layer_attention_heads)
                if len(self.layer_attention_heads) != self.num_layers or \
                        any(n % self.num_query_groups for n in self.layer_attention_heads) or \
                        self.global_num_query_groups:
                    raise ValueError(f"layer_attention_heads {self.layer_attention_heads}: one per layer "
                                     f"({self.num_layers}), each a multiple of the {self.num_query_groups} key heads")
            groups = self.global_num_query_groups or self.num_query_groups
            if self.num_attention_heads % groups:
                raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                                 f"global_num_query_groups ({groups})")
        if self.sink_layers is not None:
            self.sink_layers = tuple(bool(x) for x in self.sink_layers)
            if len(self.sink_layers) != self.num_layers or self.extra.get("softmax_type") not in (None, "vanilla"):
                raise ValueError(f"sink_layers has {len(self.sink_layers)} entries for {self.num_layers} layers (and "
                                 "replaces extra's softmax_type)")
        if self.value_head_dim is not None and (self.value_head_dim < 1 or self.global_values_from_keys
                                                or self.kv_shared_from is not None):
            raise ValueError(f"value_head_dim ({self.value_head_dim}) must be >= 1, with values projected in every "
                             "layer (not global_values_from_keys or kv_shared_from)")
        if self.kv_shared_from is not None:
            if len(self.kv_shared_from) != self.num_layers or any(
                    src is not None and not 0 <= src < i for i, src in enumerate(self.kv_shared_from)):
                raise ValueError("kv_shared_from names, for each layer, an earlier layer or None")
        if self.layer_ffn_sizes is not None and (len(self.layer_ffn_sizes) != self.num_layers
                                                 or self.num_moe_experts):
            raise ValueError("layer_ffn_sizes gives each layer of a dense model its MLP width")
        if self.per_layer_input_size and not self.per_layer_input_vocab:
            raise ValueError("per-layer inputs need their table's vocabulary (per_layer_input_vocab)")
        if self.moe_beside_dense and not (self.num_moe_experts and self.pre_norm and self.post_norm
                                          and not self.moe_dense_layers and not self.moe_shared_ffn_hidden_size):
            raise ValueError("moe_beside_dense (Gemma 4) needs experts in every layer, sandwich norms (pre_norm and "
                             "post_norm) and no shared experts of its own")
        if self.num_moe_experts is not None and self.moe_router_topk > self.num_moe_experts:
            raise ValueError(f"moe_router_topk ({self.moe_router_topk}) > num_moe_experts ({self.num_moe_experts})")
        if self.shortcut_moe and (not self.num_moe_experts or self.num_layers % 2 or self.moe_dense_layers
                                  or self.moe_shared_ffn_hidden_size or self.post_norm or self.hybrid
                                  or self.per_layer_attention or self.moe_beside_dense or self.moe_softmax_bias_router
                                  or self.moe_logit_bias_router
                                  or self.block_sparse_layers is not None):
            raise ValueError("shortcut_moe (LongCat-Flash) pairs pre-norm layers, a MoE in the first of each: it needs "
                             "experts, an even num_layers, no dense first layers, shared experts, post-norms, linear "
                             "attention, per-layer attention or block-sparse layers")
        if self.moe_zero_experts < 0 or (self.moe_zero_experts and not self.shortcut_moe):
            raise ValueError(f"moe_zero_experts ({self.moe_zero_experts}) must be >= 0, and zero-computation experts "
                             "come with LongCat-Flash's router (shortcut_moe)")
        if self.mla_latent_scales is not None:
            self.mla_latent_scales = tuple(float(x) for x in self.mla_latent_scales)
            if len(self.mla_latent_scales) != 2 or not self.multi_latent_attention or self.q_lora_rank is None:
                raise ValueError("mla_latent_scales (query, key/value latent) needs multi-latent attention with a "
                                 "query latent (q_lora_rank)")
        if self.mla_latent_norm_epsilon is not None and not self.multi_latent_attention:
            raise ValueError("mla_latent_norm_epsilon needs multi-latent attention")

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def per_layer_attention(self) -> bool:
        """Per-layer attention (mcore/gemma4.py): some layers' geometry, RoPE or sinks differ, or values are normed,
        scaled or of their own head size (Gemma 4, MiMo-V2-Flash)."""
        return bool(self.global_kv_channels or self.global_num_query_groups or self.global_values_from_keys
                    or self.global_rotary or self.value_norm or self.kv_shared_from or self.layer_ffn_sizes
                    or self.value_head_dim or self.value_scale is not None or self.sink_layers
                    or self.layer_attention_heads or self.global_partial_rotary)

    @property
    def hybrid(self) -> bool:
        """Some layers are Gated DeltaNet (linear attention) layers."""
        return bool(self.linear_attention) and any(self.linear_attention)

    @property
    def multi_latent_attention(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def sparse_attention(self) -> bool:
        """DeepSeek sparse attention (an indexer picks each query's keys: mcore/dsa.py)."""
        return self.dsa_index_heads is not None

    @property
    def rotated_channels_scale(self) -> float:
        """The attention factor of RoPE on part of each head (YaRN, longrope), which scales the rotated channels of
        queries and keys (rope.scale_rotated_channels); 1 with RoPE on the whole head (a softmax scale stands for it
        there) and under multi-latent attention."""
        from forge_megatron.mcore import rope

        if self.multi_latent_attention or self.rotary_percent == 1.0:
            return 1.0
        return rope.attention_factor(self.rope_scaling)

    @property
    def rotary_dim(self) -> int:
        """Channels RoPE rotates per head: MLA's positional part, else ``rotary_percent`` of the head."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        return int(self.head_dim * self.rotary_percent)


LAYER_KINDS = ("mamba", "attention", "mlp", "moe")


def _activation(cfg: GPTConfig):
    import functools

    if cfg.activation == "relu2":  # (Nemotron-H's plain MLPs and experts)
        from megatron.core.activations import squared_relu

        return squared_relu
    if cfg.activation == "gelu_tanh":
        return functools.partial(torch.nn.functional.gelu, approximate="tanh")
    if cfg.activation == "xielu":  # (Apertus: each MLP its own, with trained scalars: mcore/xielu.py)
        from forge_megatron.mcore.xielu import unset

        return unset
    return torch.nn.functional.silu if cfg.swiglu else torch.nn.functional.gelu


def transformer_config(cfg: GPTConfig, **overrides):
    """Megatron ``TransformerConfig`` for ``cfg`` under the current parallel state."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    from forge_megatron.mcore import rope

    kwargs = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        kv_channels=cfg.head_dim,
        normalization=cfg.normalization,
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=cfg.swiglu,
        activation_func=_activation(cfg),
        add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_qkv_bias,
        qk_layernorm=cfg.qk_layernorm,
        init_method_std=cfg.init_method_std,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
        params_dtype=cfg.params_dtype,
        bf16=cfg.bf16,
        pipeline_dtype=cfg.params_dtype,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        # The interleaved schedule decides every chunk's sends and receives from this: it must match the parallel
        # state (without it, a VPP job deadlocks in its first pipeline exchange).
        virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        # With PP = 2 the previous and next stage are one rank: only the unbatched exchange (which tells the two
        # directions apart) is safe, and it is Megatron-LM's default for the interleaved schedule.
        overlap_p2p_comm=bool(ps.get_virtual_pipeline_model_parallel_world_size()),
        batch_p2p_comm=not ps.get_virtual_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        sequence_parallel=False,
        # YaRN's / longrope's attention factor on whole-head RoPE (on part of each head it scales those channels:
        # rope.scale_rotated_channels below); else None
        softmax_scale=cfg.softmax_scale if cfg.rotated_channels_scale != 1.0 else
        rope.softmax_scale(cfg.rope_scaling, cfg.head_dim, cfg.softmax_scale),
    )
    config_class = TransformerConfig
    if cfg.multi_latent_attention:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config_class = MLATransformerConfig
        params = cfg.rope_scaling or {}
        kwargs.update(
            q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_head_dim=cfg.qk_head_dim,
            qk_pos_emb_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim,
            # Megatron's plain rotary module, given the checkpoint's (scaled) frequencies by rope.apply; YaRN's
            # softmax scale mscale(factor, mscale_all_dim)^2 / sqrt(q_head_dim), as HF computes it, comes from these
            # two (1 / sqrt(q_head_dim) when mscale_all_dim is 0: HF's rule too)
            rope_type="rope", softmax_scale=None,
            # MLA builds its own rotary module from the config's base (rope.apply replaces its frequencies only
            # where RoPE is scaled): without this, plain RoPE would rotate with Megatron's default base of 10000
            rotary_base=cfg.rotary_base,
            rotary_scaling_factor=float(params.get("factor", 1.0)) if rope.rope_type(params) != "default" else 1.0,
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0) if rope.rope_type(params) != "default" else 0.0,
        )
    if cfg.sparse_attention:
        # Megatron's MLA then hands core attention the attention's input and query latent (mcore/dsa.py); its own
        # DSA fields only describe the model (our SparseTreeAttention takes its sizes from the layer spec)
        if "experimental_attention_variant" not in TransformerConfig.__dataclass_fields__:
            raise ValueError("DeepSeek sparse attention needs megatron-core >= 0.15 (experimental_attention_variant)")
        kwargs.update(experimental_attention_variant="dsa", dsa_indexer_n_heads=cfg.dsa_index_heads,
                      dsa_indexer_head_dim=cfg.dsa_index_head_dim, dsa_indexer_topk=cfg.dsa_index_topk)
    if ps.get_pipeline_model_parallel_world_size() > 1:  # uneven stages (mcore/parallel.pipeline_split)
        from forge_megatron.mcore.parallel import pipeline_split

        first, last = pipeline_split()
        kwargs.update(num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    if TransformerConfig.__dataclass_fields__.get("cuda_graph_scope") is not None and \
            TransformerConfig.__dataclass_fields__["cuda_graph_scope"].default == "full":
        kwargs["cuda_graph_scope"] = []  # 0.16's default "full" warns that it is deprecated; [] means the same
    if cfg.zero_centered_norm:
        kwargs["layernorm_zero_centered_gamma"] = True
    if cfg.rotary_interleaved:
        kwargs["rotary_interleaved"] = True
    if cfg.attention_output_gate:
        kwargs["attention_output_gate"] = True
    if cfg.hybrid or cfg.mamba_beside_attention:
        kwargs.update(linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads,
                      linear_key_head_dim=cfg.linear_key_head_dim, linear_value_head_dim=cfg.linear_value_head_dim,
                      linear_conv_kernel_dim=cfg.linear_conv_kernel)
    if cfg.hybrid or cfg.per_layer_attention:
        # dist checkpoints key each layer on its own (the Gated DeltaNet's parameters are in some layers only; Gemma
        # 4's global layers have other shapes); Megatron spells the switch this way in 0.16
        for name in ("hetereogenous_dist_checkpoint", "heterogeneous_dist_checkpoint"):
            if name in TransformerConfig.__dataclass_fields__:
                kwargs[name] = True
    if cfg.num_moe_experts is not None:
        kwargs.update(
            num_moe_experts=cfg.num_moe_experts,
            moe_router_topk=cfg.moe_router_topk,
            moe_ffn_hidden_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
            moe_token_dispatcher_type=cfg.moe_token_dispatcher_type,
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
            moe_router_pre_softmax=cfg.moe_router_pre_softmax,
            moe_grouped_gemm=False,
            moe_router_load_balancing_type="aux_loss" if cfg.moe_aux_loss_coeff > 0 else "none",
            # Gemma 4: the dense branch is built where Megatron builds shared experts (mcore/gemma4.py)
            moe_shared_expert_intermediate_size=cfg.ffn_hidden_size if cfg.moe_beside_dense
            else cfg.moe_shared_ffn_hidden_size,
        )
        if cfg.moe_latent_size is not None:
            kwargs["moe_latent_size"] = cfg.moe_latent_size
        if cfg.moe_dense_layers:
            kwargs["moe_layer_freq"] = [0] * cfg.moe_dense_layers + [1] * (cfg.num_layers - cfg.moe_dense_layers)
        if cfg.moe_layer_pattern is not None:  # (Llama 4 Maverick: dense and MoE layers interleaved)
            kwargs["moe_layer_freq"] = [int(x) for x in cfg.moe_layer_pattern]
        if cfg.layer_kinds is not None:  # (Nemotron-H: its "moe" layers; the others' MLP slot is dense or empty)
            kwargs["moe_layer_freq"] = [int(k == "moe") for k in cfg.layer_kinds]
        if cfg.shortcut_moe:  # (LongCat-Flash: the first layer of each pair; its dense MLP in the shared-expert slot)
            kwargs.update(moe_layer_freq=[1, 0] * (cfg.num_layers // 2),
                          moe_shared_expert_intermediate_size=cfg.ffn_hidden_size, moe_router_dtype="fp32")
    kwargs.update(cfg.extra)
    kwargs.update(overrides)
    variant = kwargs.get("experimental_attention_variant")
    if variant == "dsa" and kwargs.get("context_parallel_size", 1) > 1:
        # Megatron refuses CP for its own DSAttention; ours (mcore/dsa.py) shards the queries and gathers the keys.
        # The field only has MLA hand core attention the layer input and query latent: set it after the check.
        del kwargs["experimental_attention_variant"]
        config = config_class(**kwargs)
        config.experimental_attention_variant = variant
        return config
    return config_class(**kwargs)


class CausalCoreAttention(torch.nn.Module):
    """Causal core attention of the local spec where Megatron's ``DotProductAttention`` assumes one head size:
    multi-latent attention (query/key heads wider than its value heads) and MiMo-V2-Flash (values of their own head
    size, grouped keys and values, sliding windows, sink logits in some layers). Inputs [s, b, heads, dim] as the
    attention hands them, with the boolean mask convention (True = masked; None = causal). ``softmax_offset``: the
    layer's learned sink logit per head where its config's ``softmax_type`` is ``"learnable"`` (split over TP with
    the heads, as :class:`~forge_megatron.mcore.tree_attention.TreeAttention`'s, whose name it has); ``softcap``:
    Gemma 2's soft-capped scores (c * tanh(s / c) before the mask; None: none); ``chunk``: Llama 4's chunked attention
    (a query sees the keys of its own chunk of positions; None: all earlier ones). Training uses TreeAttention instead
    (tree_attention.py); this serves the plain causal model (conversion checks, evaluation)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, k_channels: int | None = None,
                 v_channels: int | None = None, softcap: float | None = None, chunk: int | None = None):
        super().__init__()
        if config.context_parallel_size > 1:
            raise ValueError("the causal model of this attention has no context parallelism (the tree model has)")
        from forge_megatron.mcore.tree_attention import _layer_window

        self.config = config
        self.softmax_scale = softmax_scale
        self.softcap, self.chunk = softcap, chunk
        self.window = _layer_window(config, max(1, layer_number))
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type == "learnable":
            from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

            heads = config.num_attention_heads // config.tensor_model_parallel_size
            self.softmax_offset = torch.nn.Parameter(torch.zeros(heads, dtype=config.params_dtype))
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
        elif softmax_type == "vanilla":
            self.softmax_offset = None
        else:
            raise ValueError(f"causal core attention: softmax_type {softmax_type!r} is not supported (vanilla, "
                             "learnable)")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None:
            raise ValueError("the causal core attention takes no packed sequences (use the tree model)")
        s, b = query.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, dim]
        if k.shape[1] != q.shape[1]:  # grouped keys and values: each serves heads / groups query heads
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        if attention_mask is None and not self.window and self.softmax_offset is None and not self.softcap \
                and not self.chunk:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
            return o.permute(2, 0, 1, 3).reshape(s, b, -1)
        masked = attention_mask if attention_mask is not None else \
            torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        if self.window:  # a query sees itself and the window - 1 keys before it
            masked = masked | torch.ones(s, s, dtype=torch.bool, device=q.device).tril(-self.window)
        if self.chunk:  # ... and only the keys of its own chunk of positions
            block = torch.arange(s, device=q.device) // self.chunk
            masked = masked | (block[:, None] != block[None, :])
        if self.softmax_offset is None and not self.softcap:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=~masked, scale=self.softmax_scale)
            return o.permute(2, 0, 1, 3).reshape(s, b, -1)
        scale = self.softmax_scale or q.shape[-1] ** -0.5
        scores = q @ k.transpose(-1, -2) * scale
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.masked_fill(masked, float("-inf"))
        if self.softmax_offset is None:
            return (torch.softmax(scores, dim=-1).to(v.dtype) @ v).permute(2, 0, 1, 3).reshape(s, b, -1)
        sink = self.softmax_offset.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # the sink takes its share
        return (probs.to(v.dtype) @ v).permute(2, 0, 1, 3).reshape(s, b, -1)


def _local_mla(spec):
    """``spec`` (a layer or block spec) with multi-latent attention made trainable in the local spec: the core
    attention :class:`CausalCoreAttention`, and the down projections replicated linears (what Transformer Engine's
    spec uses too). Megatron's local spec makes them column-parallel and all-gathers their outputs, whose backward
    keeps only this rank's slice of the rotated key's gradient although every TP rank's heads use the whole of it:
    under TP the shared-key projection would train on a fraction of its gradient. Replicated, the rotated key is
    all-gathered over the sequence-parallel region instead (its backward sums the ranks' parts) and the weights,
    marked sequence-parallel, have their gradients summed over TP. That needs sequence parallelism under TP, which the
    trainer requires of MoE models anyway (every MLA family is one)."""
    from megatron.core.post_training.modelopt.layers import Linear

    def local(attn_subs):
        swap = {"core_attention": CausalCoreAttention, "linear_kv_down_proj": Linear}
        if attn_subs.linear_q_down_proj is not None:
            swap["linear_q_down_proj"] = Linear
        return swap

    return _with_attention_submodules(spec, local)


def _with_attention_submodules(spec, swaps):
    """``spec`` (a layer or block spec) with each self-attention's submodules updated by ``swaps(submodules)``, a
    dict of field -> module."""
    import dataclasses

    from forge_megatron.mcore.gated_delta_net import is_gated_delta_net

    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(spec, layer_specs=[_with_attention_submodules(s, swaps) for s in spec.layer_specs])
    attn = spec.submodules.self_attention
    if is_gated_delta_net(attn):
        return spec
    subs = dataclasses.replace(attn.submodules, **swaps(attn.submodules))
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, self_attention=dataclasses.replace(attn, submodules=subs)))


def layer_spec(cfg: GPTConfig, use_te: bool = False, vp_stage: int | None = None):
    """The standard (causal) layer spec: local Megatron-Core modules, or Transformer Engine's when asked. A MoE
    model with dense first layers gets Megatron's block spec of this pipeline stage's (``vp_stage``'s) layers."""
    spec = pre_norm = _layer_spec(cfg, use_te, vp_stage)
    if cfg.post_norm:
        if use_te:
            raise ValueError("post-norm models (OLMo 2 / 3, Gemma 3 / 4) build with the local spec: Transformer "
                             "Engine's fuses the input norms into the projections")
        from forge_megatron.mcore.post_norm import post_norm_spec

        spec = post_norm_spec(spec, keep_pre_norms=cfg.pre_norm)
    if cfg.moe_output_norm:  # (A.X K1: after the MoE layers' MLPs only)
        from forge_megatron.mcore.post_norm import moe_output_norm_spec

        spec = moe_output_norm_spec(spec)
    if cfg.attention_head_gate and not cfg.per_layer_attention:  # (LFM3: a sigmoid gate per head; before a hybrid
        # model's mixers replace some; the per-layer attention builds its own: Laguna)
        from forge_megatron.mcore.head_gate import head_gate_spec

        spec = head_gate_spec(spec, cfg.head_gate_activation, cfg.head_gate_per_element)
    if cfg.mamba_beside_attention:  # (Falcon-H1: every layer a Mamba-2 mixer beside its attention)
        if use_te:
            raise ValueError("Falcon-H1's layers build with the local spec")
        from forge_megatron.mcore.falcon_h1 import parallel_hybrid_spec
        from forge_megatron.mcore.mamba2 import mamba2_spec

        mamba = mamba2_spec(cfg.mamba_conv_bias, cfg.mamba_dt_limit, cfg.linear_norm_epsilon,
                            gated_norm=cfg.mamba_gated_norm, in_scale=cfg.mamba_in_multiplier,
                            segment_scales=cfg.mamba_segment_multipliers)
        spec = parallel_hybrid_spec(spec, mamba, cfg.hybrid_multipliers or (1.0, 1.0, 1.0))
    if cfg.parallel_block or not cfg.norm_bias:
        if use_te:
            raise ValueError("Cohere's layers (parallel attention + MLP, bias-free LayerNorms) build with the local "
                             "spec: Transformer Engine's fuses the input norm into the projections")
        import dataclasses

        from forge_megatron.mcore import parallel_block

        if cfg.parallel_block:
            spec = parallel_block.parallel_spec(spec)
        if not cfg.norm_bias:  # (the final norm too: a block spec of this stage's layers names it)
            offset, bases = _stage_layer_specs(cfg, spec, vp_stage)
            spec = dataclasses.replace(_with_layer_specs(spec, bases), layer_norm=parallel_block.BiasFreeLayerNorm)
            spec = parallel_block.bias_free_norms(spec)
    if cfg.moe_beside_dense:
        from forge_megatron.mcore.gemma4 import moe_layer_spec

        spec = moe_layer_spec(spec)
    if cfg.moe_softmax_bias_router:
        from forge_megatron.mcore.ernie import with_router

        spec = with_router(spec)
    if cfg.moe_logit_bias_router:  # (Kolibri 1)
        from forge_megatron.mcore import ernie

        spec = ernie.with_router(spec, ernie.LogitBiasRouter if cfg.moe_router_topk_renorm
                                 else ernie.LogitBiasRouterKeepingWeights)
    if cfg.moe_greedy_groups is not None:  # (DeepSeek-V2 / V2.5: group_limited_greedy)
        from forge_megatron.mcore import ernie

        spec = ernie.with_router(spec, ernie.group_limited_greedy(*cfg.moe_greedy_groups))
    if cfg.shortcut_moe:
        from forge_megatron.mcore.longcat import shortcut_spec

        spec = shortcut_spec(spec, cfg.moe_zero_experts)
    if cfg.per_layer_attention:
        spec = _per_layer_attention_spec(cfg, spec, vp_stage)
    if cfg.block_sparse_layers is not None and any(cfg.block_sparse_layers):  # (MiniMax-M3)
        if use_te:  # (Transformer Engine fuses the input norm into linear_qkv: the indexer's input would be un-normed)
            raise ValueError("block-sparse attention (MiniMax-M3) builds with the local spec: its indexer reads the "
                             "attention's normalised input, which Transformer Engine's spec fuses away")
        spec = _block_sparse_spec(cfg, spec, vp_stage)
    if cfg.value_head_dim or cfg.sink_layers:  # (MiMo-V2-Flash; the tree model swaps in TreeAttention)
        spec = _with_attention_submodules(spec, lambda subs: {"core_attention": CausalCoreAttention})
    if cfg.attention_softcapping:  # (Gemma 2; the tree model swaps in TreeAttention with the same cap)
        from megatron.core.transformer.spec_utils import ModuleSpec

        core = ModuleSpec(module=CausalCoreAttention, params={"softcap": float(cfg.attention_softcapping)})
        spec = _with_attention_submodules(spec, lambda subs: {"core_attention": core})
    if cfg.attention_chunk_size or cfg.qk_l2_norm:  # (Llama 4: per layer, by whether it rotates)
        spec = _llama4_attention_spec(cfg, spec, vp_stage)
    if cfg.hybrid:  # (OLMo Hybrid: post-norm attention layers, pre-norm Gated DeltaNet ones)
        spec = _hybrid_block_spec(cfg, spec, pre_norm if cfg.linear_pre_norm else spec, vp_stage)
    if cfg.layer_kinds is not None:  # (Nemotron-H: one sublayer per layer)
        spec = _layer_kinds_spec(cfg, spec, vp_stage)
    if cfg.norm_residual_scales is not None:  # (MiniMax-01 / M1: residuals from the norms' outputs, scaled)
        if use_te:
            raise ValueError("MiniMax-01's layers build with the local spec: their residuals are the norms' outputs, "
                             "which Transformer Engine's spec fuses into the projections")
        from forge_megatron.mcore.post_norm import norm_residual_specs

        offset, bases = _stage_layer_specs(cfg, spec, vp_stage)
        full, linear, mlp = cfg.norm_residual_scales
        kinds = cfg.linear_attention or (False,) * cfg.num_layers
        spec = _with_layer_specs(spec, norm_residual_specs(
            bases, [(linear if kinds[offset + i] else full, mlp) for i in range(len(bases))]))
    if cfg.moe_latent_size is not None:
        from forge_megatron.utils import env

        if not env.has_te():  # (Megatron builds the latent projections with TE's TELinear: ours stand in for it)
            from forge_megatron.mcore.latent_moe import latent_spec

            spec = latent_spec(spec)
    if cfg.qk_norm_after_rope:
        from forge_megatron.mcore.qk_norm import KeyNormAfterRope, QueryNormAfterRope

        spec = _with_attention_submodules(spec, lambda subs: {"q_layernorm": QueryNormAfterRope,
                                                              "k_layernorm": KeyNormAfterRope})
    if cfg.qk_layernorm_all_heads:
        from forge_megatron.mcore.qk_norm import KeyNormAllHeads, QueryNormAllHeads

        spec = _with_attention_submodules(spec, lambda subs: {"q_layernorm": QueryNormAllHeads,
                                                              "k_layernorm": KeyNormAllHeads})
    if not cfg.multi_latent_attention:
        return spec
    from forge_megatron.utils import env

    if not env.has_te():
        # Without Transformer Engine Megatron's TE names are placeholders that MLA's isinstance checks reject.
        from megatron.core.transformer import multi_latent_attention

        multi_latent_attention.HAVE_TE = False
    spec = spec if use_te else _local_mla(spec)
    if cfg.sparse_attention:
        spec = _with_attention_submodules(spec, lambda subs: {"core_attention": dsa_core_attention(cfg)})
    return spec


def _stage_layer_specs(cfg: GPTConfig, spec, vp_stage: int | None) -> tuple[int, list]:
    """(the global number of this pipeline stage's (``vp_stage``'s) first layer, one layer spec per layer it builds):
    ``spec`` for every layer, or a MoE model's block spec's own (its dense first layers: this stage's layers)."""
    from megatron.core.transformer import transformer_block as tb
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    tcfg = transformer_config(cfg)
    offset = get_transformer_layer_offset(tcfg, vp_stage=vp_stage)
    count = tb.get_num_layers_to_build(tcfg, vp_stage=vp_stage)
    bases = spec.layer_specs if hasattr(spec, "layer_specs") else [spec] * count
    if len(bases) != count:
        raise ValueError(f"the block spec has {len(bases)} layers, this stage {count}")
    return offset, bases


def _with_layer_specs(spec, layer_specs: list):
    """``spec``'s block with ``layer_specs`` (a block spec's copy, or a new block around a single layer spec)."""
    import dataclasses

    from megatron.core.transformer import transformer_block as tb

    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(spec, layer_specs=layer_specs)
    return tb.TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=tb.LayerNormImpl)


def _llama4_attention_spec(cfg: GPTConfig, spec, vp_stage: int | None):
    """The block spec of this pipeline stage's layers of a Llama 4 model: the layers that rotate (not
    ``cfg.nope_layers``) attend in chunks of ``attention_chunk_size`` (:class:`CausalCoreAttention`'s ``chunk``,
    which the tree spec hands to TreeAttention) and, with ``qk_l2_norm``, norm their query and key heads with
    Megatron's weightless L2Norm; the NoPE layers attend to every earlier key, unnormed."""
    import dataclasses

    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import L2Norm

    offset, bases = _stage_layer_specs(cfg, spec, vp_stage)
    nope = cfg.nope_layers or (False,) * cfg.num_layers
    layer_specs = []
    for i, base in enumerate(bases):
        rotates = not nope[offset + i]
        attn = base.submodules.self_attention
        swaps = {"q_layernorm": L2Norm if cfg.qk_l2_norm and rotates else IdentityOp,
                 "k_layernorm": L2Norm if cfg.qk_l2_norm and rotates else IdentityOp}
        if cfg.attention_chunk_size and rotates:
            swaps["core_attention"] = ModuleSpec(module=CausalCoreAttention,
                                                 params={"chunk": int(cfg.attention_chunk_size)})
        attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, **swaps))
        layer_specs.append(dataclasses.replace(base, submodules=dataclasses.replace(base.submodules,
                                                                                    self_attention=attn)))
    return _with_layer_specs(spec, layer_specs)


def _layer_kinds_spec(cfg: GPTConfig, spec, vp_stage: int | None):
    """The block spec of this pipeline stage's layers of a model whose layers hold one sublayer each
    (``cfg.layer_kinds``, Nemotron-H): a mixer layer ("mamba", "attention") keeps its input norm and mixer and builds
    Megatron's identities for the MLP, its norm and its residual add; an "mlp" / "moe" layer keeps its MLP and the
    norm before it and builds identities for the attention side (Megatron's hybrid models build theirs so)."""
    import dataclasses

    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp

    offset, bases = _stage_layer_specs(cfg, spec, vp_stage)
    count = len(bases)
    layer_specs = []
    for kind, base in zip(cfg.layer_kinds[offset: offset + count], bases):
        if kind in ("mamba", "attention"):
            subs = dataclasses.replace(base.submodules, pre_mlp_layernorm=IdentityOp, mlp=IdentityOp,
                                       mlp_bda=IdentityFuncOp)
        else:
            subs = dataclasses.replace(base.submodules, input_layernorm=IdentityOp, self_attention=IdentityOp,
                                       self_attn_bda=IdentityFuncOp)
        layer_specs.append(dataclasses.replace(base, submodules=subs))
    return _with_layer_specs(spec, layer_specs)


def _per_layer_attention_spec(cfg: GPTConfig, spec, vp_stage: int | None):
    """The block spec of this pipeline stage's layers of a model whose attention differs by layer (Gemma 4,
    MiMo-V2-Flash): each layer's self-attention a :class:`~forge_megatron.mcore.gemma4.Gemma4SelfAttention`, the global
    (not sliding-window) ones with their own geometry, values and RoPE, the layers ``sink_layers`` marks with a learned
    sink logit per head. ``spec``: one layer spec for every layer, or a MoE model's block spec (its dense first
    layers: this stage's layers)."""
    import dataclasses

    from megatron.core.transformer.utils import is_layer_window_attention

    from forge_megatron.mcore.gemma4 import attention_spec

    tcfg = transformer_config(cfg)
    offset, bases = _stage_layer_specs(cfg, spec, vp_stage)
    count = len(bases)
    shared = cfg.kv_shared_from or (None,) * cfg.num_layers
    if any(x is not None for x in shared):
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() > 1:
            raise ValueError("KV sharing across layers (Gemma 4 E2B / E4B): train without pipeline parallelism")
    kv_store = {}  # this model's keys and values of the layers others reuse, per forward
    layer_specs = []
    for number, base in zip(range(offset + 1, offset + count + 1), bases):
        params = {"value_norm": cfg.value_norm, "value_channels": cfg.value_head_dim, "value_scale": cfg.value_scale}
        if cfg.sink_layers is not None:
            params["softmax_type"] = "learnable" if cfg.sink_layers[number - 1] else "vanilla"
        if not is_layer_window_attention(tcfg.window_size, tcfg.window_attn_skip_freq, number):
            params.update(kv_channels=cfg.global_kv_channels, num_query_groups=cfg.global_num_query_groups,
                          values_from_keys=cfg.global_values_from_keys, rotary=cfg.global_rotary,
                          partial_rotary=cfg.global_partial_rotary)
        if cfg.layer_attention_heads is not None:  # (Laguna: each layer's query heads)
            params["num_attention_heads"] = cfg.layer_attention_heads[number - 1]
        if cfg.attention_head_gate:  # (Laguna: the gate per head inside the per-layer attention)
            params["head_gate"] = (cfg.head_gate_activation, cfg.head_gate_per_element)
        if shared[number - 1] is not None or number - 1 in shared:
            params.update(kv_store=kv_store, kv_from=shared[number - 1], keep_kv=number - 1 in shared)
        attn = attention_spec(base.submodules.self_attention, **params)
        subs = dataclasses.replace(base.submodules, self_attention=attn)
        if cfg.layer_ffn_sizes is not None and cfg.layer_ffn_sizes[number - 1] != cfg.ffn_hidden_size:
            from forge_megatron.mcore.gemma4 import WidthMLP

            subs = dataclasses.replace(subs, mlp=dataclasses.replace(
                subs.mlp, module=WidthMLP,
                params={**(subs.mlp.params or {}), "ffn_hidden_size": cfg.layer_ffn_sizes[number - 1]}))
        layer_specs.append(dataclasses.replace(base, submodules=subs))
    return _with_layer_specs(spec, layer_specs)


def _block_sparse_spec(cfg: GPTConfig, spec, vp_stage: int | None):
    """The block spec of this pipeline stage's layers, those ``cfg.block_sparse_layers`` marks with MiniMax-M3's
    block-sparse attention (mcore/block_sparse.py: an :class:`IndexedSelfAttention` whose core attention is a
    :class:`BlockSparseAttention`, in the tree model too) and the others as ``spec`` has them."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    from forge_megatron.mcore.block_sparse import BlockSparseAttention, IndexedSelfAttention, block_sparse_spec_params

    offset, bases = _stage_layer_specs(cfg, spec, vp_stage)
    count = len(bases)
    core = ModuleSpec(module=BlockSparseAttention, params=block_sparse_spec_params(cfg))
    layer_specs = []
    for number, base in zip(range(offset + 1, offset + count + 1), bases):
        if cfg.block_sparse_layers[number - 1]:
            attn = base.submodules.self_attention
            attn = dataclasses.replace(attn, module=IndexedSelfAttention,
                                       submodules=dataclasses.replace(attn.submodules, core_attention=core))
            base = dataclasses.replace(base, submodules=dataclasses.replace(base.submodules, self_attention=attn))
        layer_specs.append(base)
    return _with_layer_specs(spec, layer_specs)


def dsa_core_attention(cfg: GPTConfig):
    """The core attention spec of a DeepSeek-sparse-attention layer (mcore/dsa.py): tree and causal models alike."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from forge_megatron.mcore.dsa import SparseTreeAttention, dsa_spec_params

    return ModuleSpec(module=SparseTreeAttention, params=dsa_spec_params(cfg))


def _hybrid_block_spec(cfg: GPTConfig, spec, linear_base, vp_stage: int | None):
    """The block spec of this pipeline stage's layers: the layer spec ``spec`` where ``cfg.linear_attention`` says
    full attention, else a copy of ``linear_base`` (``spec``, or OLMo Hybrid's pre-norm layer) whose self-attention
    is a Gated DeltaNet."""
    import dataclasses

    from megatron.core.transformer import transformer_block as tb
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from forge_megatron.mcore.gated_delta_net import gated_delta_net_spec

    tcfg = transformer_config(cfg)
    if cfg.linear_attention_kind == "kimi_delta":
        from forge_megatron.mcore.kimi_delta import kimi_delta_spec

        mixer = kimi_delta_spec()
    elif cfg.linear_attention_kind == "mamba2":
        from forge_megatron.mcore.mamba2 import mamba2_spec

        mixer = mamba2_spec(cfg.mamba_conv_bias, cfg.mamba_dt_limit, cfg.linear_norm_epsilon)
    elif cfg.linear_attention_kind == "short_conv":
        from forge_megatron.mcore.short_conv import short_conv_spec

        mixer = short_conv_spec(cfg.short_conv_bias)
    elif cfg.linear_attention_kind == "lightning":
        from forge_megatron.mcore.lightning import lightning_spec

        mixer = lightning_spec(cfg.linear_norm_epsilon)
    else:
        mixer = gated_delta_net_spec(cfg.linear_beta_scale, cfg.linear_norm_epsilon)

    def linear(base):
        return dataclasses.replace(base, submodules=dataclasses.replace(base.submodules, self_attention=mixer))

    offset = get_transformer_layer_offset(tcfg, vp_stage=vp_stage)
    layers = cfg.linear_attention[offset: offset + tb.get_num_layers_to_build(tcfg, vp_stage=vp_stage)]
    if hasattr(spec, "layer_specs"):  # a MoE model's block spec with dense first layers: this stage's layers
        if linear_base is not spec:
            raise ValueError("pre-norm linear-attention layers beside post-norm ones (linear_pre_norm) in a MoE "
                             "model with dense layers are not supported")
        if len(spec.layer_specs) != len(layers):
            raise ValueError(f"the block spec has {len(spec.layer_specs)} layers, this stage {len(layers)}")
        return dataclasses.replace(spec, layer_specs=[linear(s) if x else s for s, x in zip(spec.layer_specs, layers)])
    return tb.TransformerBlockSubmodules(layer_specs=[linear(linear_base) if x else spec for x in layers],
                                         layer_norm=tb.LayerNormImpl)


def _layer_spec(cfg: GPTConfig, use_te: bool, vp_stage: int | None):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if cfg.hybrid and use_te:
        raise ValueError("Gated DeltaNet models build with the local spec (Megatron's own linears), not Transformer "
                         "Engine's")
    if cfg.num_moe_experts and (cfg.moe_dense_layers or cfg.shortcut_moe or cfg.layer_kinds is not None
                                or cfg.moe_layer_pattern is not None):
        if use_te:
            from forge_megatron.utils import env

            env.require("te", "the Transformer Engine layer spec")
        return specs.get_gpt_decoder_block_spec(transformer_config(cfg), use_transformer_engine=use_te,
                                                normalization=cfg.normalization, vp_stage=vp_stage)

    if use_te:
        from forge_megatron.utils import env

        env.require("te", "the Transformer Engine layer spec")
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=cfg.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=cfg.qk_layernorm,
            multi_latent_attention=cfg.multi_latent_attention,
        )
    return specs.get_gpt_layer_local_spec(
        num_experts=cfg.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=cfg.qk_layernorm,
        normalization=cfg.normalization, multi_latent_attention=cfg.multi_latent_attention,
    )


def cap_logits(output_layer, softcap: float) -> None:
    """Soft-cap the logits ``output_layer`` makes to softcap * tanh(logits / softcap) (elementwise, so each TP rank
    caps its vocabulary slice). The cap is kept in ``output_layer.logit_softcap``: while the output layer is fused
    into the loss (``forward.output_layer_deferred``) the layer hands back hidden states, which are left alone, and
    the fused logprobs cap the logits they make."""
    output_layer.logit_softcap = float(softcap)

    def cap(module, args, output):
        if getattr(module, "deferred", False):
            return output
        logits, bias = output
        return logits.div(module.logit_softcap).tanh().mul(module.logit_softcap), bias

    output_layer.register_forward_hook(cap)


def _granite_scales(model, cfg: GPTConfig) -> None:
    """Granite's and Cohere's scales as hooks: every layer's attention and MLP (MoE and shared experts together)
    output times ``residual_multiplier`` before its residual add (their biases too, where a spec hands them to a
    fused add), every MoE layer's output times ``moe_output_multiplier``, and the output layer's input divided by
    ``logits_scaling`` (or multiplied by ``logit_multiplier``): W (h / s) = (W h) / s, the logits HF divides, whether
    the layer makes them or hands its input to the fused logprobs (forward.output_layer_deferred)."""
    if cfg.residual_multiplier is not None:
        c = float(cfg.residual_multiplier)

        def scale(module, args, output):
            out, bias = output if isinstance(output, tuple) else (output, None)
            scaled = out * c
            return (scaled, bias * c if bias is not None else None) if isinstance(output, tuple) else scaled

        for layer in getattr(getattr(model, "decoder", None), "layers", ()):
            layer.self_attention.register_forward_hook(scale)
            layer.mlp.register_forward_hook(scale)
    if cfg.moe_output_multiplier is not None:  # (Cohere2-MoE: routed and shared experts averaged)
        from megatron.core.transformer.moe.moe_layer import MoELayer

        half = float(cfg.moe_output_multiplier)

        def scale_moe(module, args, output):
            out, bias = output
            return out * half, (bias * half if bias is not None else None)

        for layer in getattr(getattr(model, "decoder", None), "layers", ()):
            if isinstance(layer.mlp, MoELayer):
                layer.mlp.register_forward_hook(scale_moe)
    if (cfg.logits_scaling is not None or cfg.logit_multiplier is not None) and \
            getattr(model, "output_layer", None) is not None:
        # (Cohere's logit_scale multiplies: W (c h) = c (W h))
        inv = float(cfg.logit_multiplier) if cfg.logit_multiplier is not None else 1.0 / float(cfg.logits_scaling)

        def divide(module, args):
            return (args[0] * inv, *args[1:])

        model.output_layer.register_forward_pre_hook(divide)


def build_gpt(cfg: GPTConfig, spec=None, pre_process: bool | None = None, post_process: bool | None = None,
              vp_stage: int | None = None, **config_overrides):
    """Build this rank's stage of a ``GPTModel`` (RoPE, untied by default) under the current parallel state."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    tcfg = transformer_config(cfg, **config_overrides)
    if cfg.kv_shared_from and any(x is not None for x in cfg.kv_shared_from) and tcfg.recompute_granularity:
        raise ValueError("KV sharing across layers (Gemma 4 E2B / E4B): a recomputed layer would read keys and "
                         "values made by a forward without gradients; train without --recompute-granularity")
    spec = spec if spec is not None else layer_spec(cfg, vp_stage=vp_stage)
    if tcfg.sequence_parallel or tcfg.layernorm_zero_centered_gamma:
        spec = sequence_parallel_norms(spec, tcfg, vp_stage)
    kwargs = dict(
        config=tcfg,
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(cfg.rotary_base) if float(cfg.rotary_base).is_integer() else cfg.rotary_base,
        rotary_percent=cfg.rotary_percent,
    )
    if vp_stage is not None:
        kwargs["vp_stage"] = vp_stage
    model = GPTModel(**kwargs)
    from forge_megatron.mcore import rope

    rope.apply(model, cfg.rope_scaling, cfg.rotary_base, cfg.rotary_dim)
    if cfg.rotated_channels_scale != 1.0:
        rope.scale_rotated_channels(model, cfg.rotated_channels_scale, cfg.rotary_dim)
    if cfg.sliding_rope_scaling is not None:
        rope.apply_to_sliding_layers(model, cfg.sliding_rope_scaling, cfg.rope_scaling, cfg.rotary_base,
                                     cfg.rotary_dim, cfg.head_dim, sliding_base=cfg.sliding_rotary_base,
                                     base_scale=cfg.softmax_scale)
    if cfg.full_rope_scaling is not None:  # (LFM3: the model's table is the sliding layers')
        windows = cfg.extra.get("window_attn_skip_freq")
        full = tuple(not (cfg.linear_attention and cfg.linear_attention[i]) and not (windows is None or windows[i])
                     for i in range(cfg.num_layers))
        rope.apply_to_sliding_layers(model, cfg.full_rope_scaling, cfg.rope_scaling, cfg.rotary_base,
                                     cfg.rotary_dim, cfg.head_dim, sliding_base=cfg.full_rotary_base,
                                     base_scale=cfg.softmax_scale, full_layers=full)
    if cfg.nope_query_scaling is not None:  # (Llama 4: before leave_out hides the table its positions come from)
        rope.scale_queries(model, *cfg.nope_query_scaling, layers=cfg.nope_layers, offset=1)
    if cfg.nope_layers is not None and any(cfg.nope_layers):
        if cfg.multi_latent_attention:  # (every layer: GPTConfig checks) Kimi Linear's MLA rotates nothing
            rope.no_rotation(model)
        else:
            rope.leave_out(model, cfg.nope_layers)
    if cfg.query_scaling is not None:
        rope.scale_queries(model, *cfg.query_scaling)
    if cfg.qk_norm_after_rope:
        from forge_megatron.mcore.qk_norm import link_post_rope_norms

        link_post_rope_norms(model)
    if cfg.embedding_multiplier is not None and getattr(model, "embedding", None) is not None:
        multiplier, rounded = cfg.embedding_multiplier, cfg.embedding_multiplier_rounded

        def scale(module, args, output):  # (Gemma: in the output's dtype, as HF rounds sqrt(hidden) to the weights')
            if not rounded:
                return output * multiplier
            return output * torch.tensor(multiplier, dtype=output.dtype, device=output.device)

        model.embedding.register_forward_hook(scale)
    if cfg.mlp_multipliers is not None:  # (Falcon-H1: the MLP's gate and output scaled)
        from forge_megatron.mcore.falcon_h1 import scale_mlps

        scale_mlps(model, *(float(x) for x in cfg.mlp_multipliers))
    if cfg.activation == "xielu":  # (Apertus: each MLP's own activation with its trained scalars)
        from forge_megatron.mcore import xielu

        xielu.attach(model, cfg.params_dtype)
    if cfg.layer_scalars or cfg.per_layer_input_size:
        from forge_megatron.mcore.gemma4 import finish_layers

        finish_layers(model, cfg)
    if cfg.final_logit_softcapping is not None and getattr(model, "output_layer", None) is not None:
        cap_logits(model.output_layer, cfg.final_logit_softcapping)
    if cfg.residual_multiplier is not None or cfg.logits_scaling is not None or cfg.logit_multiplier is not None \
            or cfg.moe_output_multiplier is not None:
        _granite_scales(model, cfg)
    if cfg.sparse_attention:
        from forge_megatron.mcore.dsa import share_selection_store

        share_selection_store(model)
    if cfg.shortcut_moe or cfg.mla_latent_scales or cfg.mla_latent_norm_epsilon is not None:
        from forge_megatron.mcore.longcat import finish

        finish(model, cfg)
    if cfg.num_moe_experts and cfg.add_bias_linear:
        _own_expert_outputs(model)
    if cfg.num_moe_experts:
        _reduce_whole_experts_over_tp(model)
    if cfg.score_head and post_process:  # replicated over TP: every TP rank has the same hidden states
        model.score_head = torch.nn.Linear(cfg.hidden_size, cfg.score_head, bias=False, dtype=cfg.params_dtype)
    return model


def _reduce_whole_experts_over_tp(model) -> None:
    """Experts whole (expert TP 1) under TP > 1: every TP rank runs its experts on its own share of the tokens
    (sequence parallelism), so each holds a part of its experts' gradients, to be summed over the expert-data-
    parallel group (which then spans the TP ranks); three of Megatron-Core's parameter markings get this wrong, and
    the trainer tests caught them (gradient norm; the TP ranks' expert copies after clipped steps):

    - expert parameters go to that group only when EP > 1 (``allreduce = False``); with EP = 1 they join the dense
      buffers, reduced over DP alone, and each TP rank would step with its own part;
    - an expert's fc2 bias is marked ``sequence_parallel`` like any row-parallel bias, so the TP all-reduce meant for
      norms sums it again over the TP ranks: twice its gradient with EP = 1, and with EP > 1 the sum of different
      experts' biases (each TP rank then holds other experts); and, not being split, it counts as a copy on every
      TP rank but the first, so the gradient norm (clipping) leaves it out there: other experts' biases with EP > 1,
      a rank-dependent clipping factor (replicas drifting apart) with EP = 1.

    Mark them as expert-data-parallel, not sequence-parallel, and never a TP copy (the expert-TP group is one rank)."""
    from megatron.core import parallel_state as ps

    if ps.get_expert_tensor_parallel_world_size() == ps.get_tensor_model_parallel_world_size():
        return
    for name, param in model.named_parameters():
        if ".mlp.experts." in f".{name}":
            param.allreduce = False
            param.sequence_parallel = False
            param.tensor_model_parallel = True  # unique in its expert-TP group (of one): counted in the grad norm


def _own_expert_outputs(model) -> None:
    """Experts with biases (gpt-oss) when neither TP nor EP splits them: Megatron's expert MLP adds the routing-
    weighted bias to fc2's output in place, and that output is then the very tensor the TP all-reduce (a no-op at
    TP = 1) handed back, which autograd forbids modifying. A forward hook gives the MLP its own copy."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    def own_copy(module, args, output):
        out, bias = output
        return out.clone(), bias

    for module in model.modules():
        if isinstance(module, RowParallelLinear) and module.is_expert and not module.explicit_expert_comm \
                and module.skip_bias_add and module.bias is not None:
            module.register_forward_hook(own_copy)


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm scaling by (1 + weight), the weight stored zero-centred (Qwen3.5 / Qwen3-Next; Megatron's
    ``layernorm_zero_centered_gamma``), computed as transformers does: normalise and scale in fp32, then cast."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class SequenceParallelNorm:
    """torch's RMSNorm / LayerNorm (or :class:`ZeroCenteredRMSNorm`) for the local spec under sequence parallelism
    or zero-centred gamma (Megatron's ``WrappedTorchNorm`` refuses both, and apex / Transformer Engine norms are
    GPU-only). Under SP each TP rank normalises its own slice of the tokens, so its weight gradient is partial: the
    weight is marked ``sequence_parallel`` and Megatron's ``finalize_model_grads`` sums it over the TP group, as it
    does for TE's and apex's norms."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        if config.memory_efficient_layer_norm:
            raise ValueError("memory-efficient layer norm needs Transformer Engine's norms")
        if config.layernorm_zero_centered_gamma:
            if config.normalization != "RMSNorm":
                raise ValueError("zero-centred gamma is supported for RMSNorm only")
            norm = ZeroCenteredRMSNorm(hidden_size, eps=eps)
        else:
            kind = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
            norm = kind(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def sequence_parallel_norms(spec, config, vp_stage: int | None = None):
    """``spec`` with Megatron's torch-norm wrapper (which asserts SP is off) replaced by
    :class:`SequenceParallelNorm` wherever it appears, and the final layer norm too when Megatron would build it
    with that wrapper (the layer spec then becomes a block spec of this stage's layers). Norms that support SP
    themselves (Transformer Engine, apex) are kept."""
    from megatron.core.transformer import transformer_block as tb
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if not isinstance(spec, tb.TransformerBlockSubmodules) and tb.LayerNormImpl is WrappedTorchNorm:
        spec = tb.TransformerBlockSubmodules(layer_specs=[spec] * tb.get_num_layers_to_build(config, vp_stage),
                                             layer_norm=WrappedTorchNorm)  # the final norm Megatron would build
    return swap_spec_modules(spec, {WrappedTorchNorm: SequenceParallelNorm})


def swap_spec_modules(spec, swaps: dict):
    """``spec`` (any spec: layer, block, their submodules) with every module class that is a key of ``swaps``
    replaced by its value, wherever it appears."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    def swap(x):
        if isinstance(x, type) and x in swaps:
            return swaps[x]
        if isinstance(x, ModuleSpec):
            return dataclasses.replace(x, module=swap(x.module), submodules=swap(x.submodules))
        if isinstance(x, list):
            return [swap(v) for v in x]
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return dataclasses.replace(x, **{f.name: swap(getattr(x, f.name)) for f in dataclasses.fields(x)
                                             if f.init})
        return x

    return swap(spec)


def causal_mask(seq_len: int, device=None) -> torch.Tensor:
    """Megatron's boolean attention mask convention: [1, 1, s, s], True = masked (future keys)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]
