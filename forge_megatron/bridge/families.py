"""Model families the bridge knows, and the translation of a Hugging Face ``config.json`` into a :class:`GPTConfig`.

Why a registry: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE and GLM-4.5 share one decoder layout (RMSNorm, RoPE with rotate-half,
GQA attention, SwiGLU MLP) and differ in a few switches: a bias on the fused QKV projection (Qwen2), per-head
RMSNorm on queries and keys before RoPE (Qwen3: ``q_norm``/``k_norm``), and a routed expert MLP (Qwen3-MoE).
A new family is one more :class:`Family` entry; anything in a config that the shared layout cannot express
(another activation, sliding windows, dense layers inside a MoE model, RoPE scaling other than linear / llama3 /
yarn: mcore/rope.py) is refused by name rather than converted into a model that silently computes something else.

Multi-latent attention (``deepseek_v3``: DeepSeek-V3 / V3.1, Kimi-K2, Moonlight; ``glm4_moe_lite``: GLM-4.7-Flash;
``youtu``: Youtu-LLM, with dense MLPs):
Megatron's MLA with the same down/up projections and latent norms, RoPE on the last ``qk_rope_head_dim`` channels of
each query/key head with the rotated key shared by every head. DeepSeek checkpoints rotate interleaved channel pairs
(``rope_interleave``), which is what Megatron's MLA does; YaRN's softmax factor mscale(factor, mscale_all_dim)^2 is
Megatron's too. Their MoE is the GLM-4.5 one below.

Mistral Small 4 (``mistral4``: Mistral4ForCausalLM, released inside Mistral3ForConditionalGeneration with a Pixtral
tower): DeepSeek-V3's attention and MoE layout with three differences. The router is a softmax over all experts
without a score-correction bias (top-k renormalised with ``norm_topk_prob``: Megatron's softmax of the top-k logits,
times ``routed_scaling_factor``); Llama 4's attention temperature scales each query (both its parts) by
1 + beta log(1 + floor(p / original_max)) as Ministral 3's does (rope.scale_queries, on the query projection's output);
and each layer's experts are two checkpoint tensors, ``experts.gate_up_proj`` [E, 2F, D] (gate rows first) and
``experts.down_proj`` [E, D, F]: transformers' own layout, expert e's Megatron weights stacked (``stacked_experts``).

DeepSeek-V2 (``deepseek_v2``: DeepseekV2ForCausalLM; V2 / V2.5 / Coder-V2 236B, V2-Lite, V2-Lite-Chat,
DeepSeek-Coder-V2-Lite): DeepSeek-V3's attention (V2-Lite without a query latent: ``q_proj``) and MoE layout with
Mistral Small 4's softmax router over all experts, no score-correction bias, logits in fp32. transformers keeps the top
k probabilities as they are (it reads no ``norm_topk_prob``: Megatron's pre-softmax top-k) times
``routed_scaling_factor``. ``topk_method`` ``group_limited_greedy`` (the 236B models) first keeps ``topk_group`` of
``n_group`` groups, a group scored by its best expert, which Megatron's grouped routing (the sum of each group's top
few) does not: forge's router (mcore/ernie.py ``GroupLimitedGreedyRouter``, ``moe_greedy_groups``), as SGLang's
grouped top-k for this architecture; ``norm_topk_prob: true`` is refused (transformers ignores it, SGLang
renormalises).

gpt-oss (``gpt_oss``): QKV and output projections with biases, a learned sink logit per head (Megatron's
``softmax_type="learnable"``: the core attention's ``softmax_offset``), a 128-position sliding window on the layers
``layer_types`` marks ``sliding_attention`` (``window_size=(W - 1, 0)`` with a per-layer ``window_attn_skip_freq``
list), a router with a bias choosing the top-k logits and softmaxing them, and experts with biases whose gate and up
columns are interleaved in HF's fused tensors, computing (clamp(up) + 1) * g * sigmoid(1.702 g), g = clamp(gate, max=7)
(Megatron's quick_gelu GLU with ``glu_linear_offset=1`` and ``activation_func_clamp_value``). Megatron has expert
biases only without expert tensor parallelism, so TP must be 1 (EP, PP, CP as usual).

GLM-4.5 (``glm4_moe``, docs/conversion.md): RoPE on the first ``partial_rotary_factor`` of each head, the first
``first_k_dense_replace`` layers dense, a shared expert next to the routed ones, and a sigmoid router choosing by
sigmoid(z) + ``e_score_correction_bias`` and weighting by the normalised sigmoid scores times
``routed_scaling_factor``: Megatron's sigmoid score function with expert bias and top-k scaling computes the same.

dots.llm1 (``dots1``) and Solar Open (``solar_open``) keep GLM-4.5's MoE and names: dots.llm1 with Qwen3's per-head q/k
norms and RoPE over the whole head, Solar Open with Llama's attention and every layer MoE. Mixtral (``mixtral``) puts
Mistral's attention before experts under ``block_sparse_moe`` (``w1`` / ``w3`` / ``w2``) and a softmax router whose top-k
is always renormalised.

Phi-3 / Phi-4 (``phi3``: Phi3ForCausalLM; Phi-4, Phi-4-reasoning(-plus)): Llama's layout with q, k and v in one
checkpoint tensor (``self_attn.qkv_proj``: all query heads, then all key heads, then all value heads; Megatron's fused
QKV groups them per key head: the ``qkv_fused`` join) and the MLP's gate and up in one (``mlp.gate_up_proj``, gate rows
first: Megatron's fc1 as it is); RoPE on the first ``partial_rotary_factor`` of each head. ``longrope`` (Phi-3.5,
Phi-4-mini, Phi-4-mini-reasoning) switches its frequencies with the sequence length at run time; one of its two factor
lists is chosen for the run and the engines pinned to it (mcore/rope.py; the trainer's and reference engine's
``--longrope-factors``), its attention factor scaling the rotated channels only (three quarters of each head). A
``sliding_window`` shorter than the context (Phi-3-mini-4k's 2047) is refused.

Qwen2-MoE (``qwen2_moe``: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases, ``qkv_bias``) and in
every layer ``num_experts`` softmax-routed experts of ``moe_intermediate_size`` (the top ``num_experts_per_tok``,
renormalised only with ``norm_topk_prob``: released without) beside one ``shared_expert`` of
``shared_expert_intermediate_size`` behind a sigmoid gate (``shared_expert_gate``: Megatron's shared-expert gate, as
Qwen3.5-MoE's).

A.X K1 (``axk1``: AXK1ForCausalLM, SK Telecom's 519B-A33B): DeepSeek-V3's layers with an RMSNorm on each MoE layer's
output before the residual adds it (``post_mlp_layernorm``: ``moe_output_norm``, mcore/post_norm.py); the release
stores one for the dense layers too, unused (left out), and has no score-correction bias (zeros).
MiniCPM5-MoE (``minicpm5_moe``): Llama's attention with Qwen3.5's sigmoid gate per query channel (``q_proj`` holds
each head's queries then its gate) and DeepSeek-V3's MoE (an fp32 sigmoid router with a score-correction bias).
Mellum 2 (``mellum``): Qwen3-MoE's layers with OLMo 3's sliding-window layers (their own RoPE base) beside full ones
and dense MLPs where ``mlp_layer_types`` says (Megatron's MoE layer pattern); its MTP layer (``mtp.*``) left out.
GLM-4 9B (``glm``: GlmForCausalLM): GLM-4-0414's attention (q/k/v biases, interleaved RoPE on half of each head) and
fused gate / up MLP in Llama's pre-norm layers.
Jais 2 (``jais2``): Llama's attention with biases on every projection, LayerNorms with biases and a plain squared-ReLU
MLP with biases (Megatron's LayerNorm, ``add_qkv_bias``, ``add_bias_linear``).
StarCoder2 (``starcoder2``: Starcoder2ForCausalLM): Jais 2's LayerNorms and biases (``use_bias``, ``norm_epsilon``)
with a plain tanh-GELU MLP under ``mlp.c_fc`` / ``mlp.c_proj``, every layer a ``sliding_window``; the config's
dropouts are not applied (forge trains without dropout).
HyperCLOVA X SEED (``hyperclovax``): Granite's scales with norms on the attention's and the MLP's outputs too
(``post_norm1`` / ``post_norm2``, before the residual multiplier) and the logits multiplied by ``logits_scaling``.
Hy3 (``hy_v3``: HYV3ForCausalLM, Tencent Hunyuan 3): dots.llm1's layout under its own names and fields (``num_experts``,
``num_shared_experts``, ``router_scaling_factor``; ``mlp.router.gate``, ``mlp.expert_bias``, ``mlp.shared_mlp``), its MTP
layers (numbered after the last) left out.
Kolibri 1 (``kolibri1``): EXAONE 4.0's attention (sliding layers that rotate beside NoPE full ones) in GLM-4's
sandwich norms (``post_attn_norm``, ``post_ffn_norm``), every layer's experts beside a shared one under a router
choosing by logit plus bias and weighting by sigmoid (mcore/ernie.py ``LogitBiasRouter``: Megatron's sigmoid router
adds its bias to the sigmoid, which ranks otherwise).

EXAONE 4.0 (``exaone4``: Exaone4ForCausalLM, 32B and 1.2B) and K-EXAONE (``exaone_moe``: ExaoneMoeForCausalLM,
236B-A23B): per-head q/k RMSNorms before RoPE; with a ``sliding_window``, the layers ``layer_types`` (or
``sliding_window_pattern``: every n-th layer, or a string such as "LLLG", global) marks ``sliding_attention`` see the
window and rotate, the others see everything and do not rotate at all (NoPE: ``nope_layers``); without one, every
layer is global and rotates. EXAONE 4.0 normalises the attention's and the MLP's outputs (OLMo 2's post-norm, no
input norms); K-EXAONE is pre-norm with DeepSeek-V3's MoE (a sigmoid router choosing with a score-correction bias,
stored beside the gate as ``mlp.e_score_correction_bias``, ``num_shared_experts`` shared experts, the first
``first_k_dense_replace`` / ``mlp_layer_types`` layers dense); its MTP module (``mtp.*``) is left out.

Granite (``granite``: Granite 3.x dense; ``granitemoe``, ``granitemoeshared``: Granite 3.x MoE; ``granitemoehybrid``:
Granite 4.0 without Mamba layers, granite-4.0-micro): Llama's layers with muP-style scales: the embedding times
``embedding_multiplier``, attention scaled by ``attention_multiplier`` (not 1 / sqrt(head_dim)), each attention's and
MLP's output times ``residual_multiplier`` before the residual adds it, the logits divided by ``logits_scaling``
(GPTConfig ``residual_multiplier`` / ``logits_scaling``: hooks, mcore/model.py). The MoE ones keep each layer's experts
stacked on disk (``block_sparse_moe.input_linear`` [E, 2F, D] gate rows first, ``output_linear`` [E, D, F]) under a
router (``block_sparse_moe.router.layer``) softmaxing the top-k logits; GraniteMoeShared and Granite 4.0 add an
ungated shared MLP (``shared_mlp.input_linear`` [gate; up], ``output_linear``), which is Granite 4.0's whole MLP where
it has no experts. Granite 4.0-H's Mamba-2 layers (``layer_types`` mamba / linear_attention) are forge's Mamba-2
mixer over prefix trees (mcore/mamba2.py; ``mamba.*`` tensors, ``in_proj`` and the convolution regrouped per group);
``position_embedding_type`` other than rope is NoPE (no layer rotates).

Nemotron-H (``nemotron_h``: NemotronHForCausalLM; Nemotron-H 8B / 47B / 56B, Nemotron Nano 2, Nemotron 3 Nano): each
layer is one sublayer behind its own RMSNorm (``backbone.layers.{i}.norm``, ``.mixer``), of the kind
``hybrid_override_pattern`` (M Mamba-2, * attention, - MLP, E MoE) or transformers' ``layers_block_type`` names: a
Mamba-2 mixer (mcore/mamba2.py, as Granite 4.0-H's), attention without RoPE, a plain MLP with squared ReLU
(``up_proj`` / ``down_proj``), or DeepSeek-V3's sigmoid router with a score-correction bias over squared-ReLU experts
beside a shared one (``moe_shared_expert_intermediate_size``). Megatron builds each as a layer whose other half is
its identity (GPTConfig ``layer_kinds``), as Megatron's own hybrid models do. Nemotron 3 Super / Ultra's LatentMoE
(``moe_latent_size``): the routed experts work in the latent space between ``mixer.fc1_latent_proj`` and
``mixer.fc2_latent_proj`` (Megatron's own latent MoE; mcore/latent_moe.py without Transformer Engine). Refused by name:
biases, another activation, a sliding window; its MTP layers are left out.

LFM2 (``lfm2``: Lfm2ForCausalLM, Liquid AI's 350M-2.6B): layers whose mixer is a gated short convolution (``layer_types``
"conv", or every layer not in ``full_attn_idxs``: ``conv.in_proj`` gives B, C and x, y = C * conv(B * x) over
``conv_L_cache`` taps, ``conv.out_proj``; mcore/short_conv.py, the convolution along each token's ancestors) or
attention with per-head q/k RMSNorms (``q_layernorm`` / ``k_layernorm``, before RoPE) and an ``out_proj``; every
layer's input norm ``operator_norm``, its MLP's ``ffn_norm``, a SwiGLU MLP (``feed_forward.w1`` / ``w3`` / ``w2``)
whose width ``block_auto_adjust_ff_dim`` derives from ``intermediate_size`` (2/3 of it, times
``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``), the final norm ``embedding_norm``, the head tied.
LFM2-MoE (``lfm2_moe``): the first ``num_dense_layers`` layers' MLP as given, the others' experts under a sigmoid
router choosing with its bias (``feed_forward.expert_bias``), renormalised, scaled, no shared expert.

LFM3 (``lfm3``: Lfm3ForCausalLM): LFM2's layers with norms after every mixer and MLP (sandwich), sliding-window
attention layers (plain RoPE, base 10k: the model's table) beside full ones (proportional RoPE, base 1M: their own,
``full_rope_scaling``), Qwen3's attention names and a sigmoid gate per head (``self_attn.gate_proj``: mcore/head_gate.py).

Flint (``flint``: FlintForCausalLM, RecursiveSI): Qwen3-MoE's attention (per-head q/k norms) with a learned sink logit
per head in every layer (``self_attn.softmax_offset`` as released, transformers' ``sinks``: Megatron's
``softmax_type="learnable"``), ``sliding_attention`` layers
that rotate and ``full_attention`` ones without RoPE (``nope_layers``), dense layers where ``mlp_only_layers`` says,
the others' experts under a sigmoid router without a bias (top k of the sigmoids, renormalised; logits in fp32) beside
an ungated shared expert (``mlp.shared_expert``).

Laguna (``laguna``: LagunaForCausalLM, poolside): each layer its own query heads (``num_attention_heads_per_layer``, the
key heads shared; mcore/gemma4.py's per-layer attention), per-head q/k RMSNorms, a softplus gate per head or per
channel (``gating``; ``self_attn.g_proj``, mcore/head_gate.py) on the attention's output; ``sliding_attention`` layers
rotate whole heads with their RoPE (the model's table), ``full_attention`` ones rotate the first
``partial_rotary_factor`` of each head with theirs (``global_partial_rotary``); the first layers dense
(``mlp_layer_types``), the others Qwen2-MoE's experts under DeepSeek-V3's sigmoid router choosing with its bias
(``mlp.experts.e_score_correction_bias`` as released), renormalised, times ``moe_routed_scaling_factor``, beside one
shared expert (``mlp.shared_expert``).

MiniMax-M2 (``minimax_m2``: MiniMax-M2 / M2.1 / M2.5): every layer MoE with Mixtral's checkpoint names
(``block_sparse_moe.experts.{e}.w1/w3/w2``, ``intermediate_size`` is the expert width), the GLM-4.5 sigmoid router
with a score-correction bias (normalised top-k; no groups and no scaling: transformers and SGLang ignore
``routed_scaling_factor`` and ``n_group`` for this architecture; no shared expert), RoPE on the first
``rotary_dim`` channels of each head, and query/key RMSNorms over all heads of a token at once
(``qk_norm_type: per_layer``; mcore/qk_norm.py, TP-aware) rather than per head. The MTP modules
(``num_mtp_modules`` layers after the last) are left out as for GLM-4.5.

MiniMax-Text-01 / MiniMax-M1 (``minimax01``: transformers' MiniMaxForCausalLM and the releases' MiniMaxText01ForCausalLM
/ MiniMaxM1ForCausalLM, whose config names differ: ``attn_type_list`` 0 / 1 for ``layer_types``,
``layernorm_{full_attention,linear_attention,mlp}_{alpha,beta}`` for the ``*_factor`` fields): lightning-attention
layers (linear attention with a fixed decay per head, mcore/lightning.py) with a softmax-attention layer every eighth,
Mixtral's experts and names, and residuals taken from the norms' outputs, alpha * norm(x) + beta * sublayer
(``postnorm``; mcore/post_norm.py NormResidualLayer). RoPE on the first ``rotary_dim`` channels as the engines rotate
them (transformers' port rotates whole heads and has no such field). The lightning layers' decay buffers that
transformers saves are left out (the config fixes them).

ERNIE 4.5 (``ernie4_5``: Ernie4_5ForCausalLM, ``ernie4_5_moe``: Ernie4_5_MoeForCausalLM): Llama's layout with RoPE on
interleaved channel pairs of the whole head (``rotary_interleaved``); the MoE models' first ``moe_layer_start_index``
layers dense, ``moe_num_shared_experts`` shared experts beside the routed ones, and a router whose weights are the
softmax probabilities of the top k experts, renormalised, the top k chosen by those probabilities plus the
``moe_statics.e_score_correction_bias`` (stored [1, E]): Megatron's softmax score function takes no expert bias, so
the router is forge's (mcore/ernie.py). Their MTP tensors (``model.mtp_*``) are left out.

Hunyuan (``hunyuan_v1_dense``: HunYuanDenseV1ForCausalLM, ``hunyuan_v1_moe``: HunYuanMoEV1ForCausalLM): Llama's
layout with per-head q/k RMSNorms (``query_layernorm`` / ``key_layernorm``) applied *after* RoPE
(``qk_norm_after_rope``: mcore/qk_norm.py), and RoPE whose base is stretched by a fixed NTK ``alpha`` (the config's
``rope_parameters`` say ``dynamic`` with ``alpha``; transformers reads it as static: base = theta * alpha ** (d / (d -
2)), d the head size). The MoE models: in every layer ``num_experts`` routed experts and one ``shared_mlp``, all of
``intermediate_size``, a softmax router ``mlp.gate.wg`` (in fp32) whose top ``moe_topk`` probabilities are
renormalised. Per-layer expert counts or top-k (lists) are refused.

OLMo 2 / OLMo 3 (``olmo2``, ``olmo3``): RMSNorms on the attention's and the MLP's outputs instead of their inputs
(``post_norm``: mcore/post_norm.py), q/k RMSNorms over all heads (as MiniMax-M2); OLMo 3's ``layer_types`` put a
sliding window on some layers (as gpt-oss), whose RoPE may differ from the full-attention layers' (its long-context
releases scale only the latter with YaRN: ``sliding_rope_scaling``, mcore/rope.py ``apply_to_sliding_layers``).

OLMo Hybrid (``olmo_hybrid``: OlmoHybridForCausalLM): OLMo 3's full-attention layers (post-norm, q/k RMSNorms over all
heads, no window) between Gated DeltaNet layers that are Llama's pre-norm layers (``linear_pre_norm``). Its Gated
DeltaNet has separate q, k, v, gate (``g_proj``: Qwen3.5's z), b and a projections (regrouped per key head as
Qwen3.5's), a write strength beta = 2 sigmoid(b) with ``linear_allow_neg_eigval`` (``linear_beta_scale``), a gated
output norm with epsilon 1e-5 whatever ``rms_norm_eps`` says (FLA's default, which transformers keeps), and plain
(not zero-centred) norms. Without a ``rope_theta`` (transformers' reading of the config; the released checkpoints
have none) the attention layers rotate nothing: NoPE, position only through the causal (tree) mask.

Kimi Linear (``kimi_linear``: KimiLinearForCausalLM, Kimi-Linear-48B-A3B): Kimi Delta Attention layers (the gated
delta rule with a decay per key channel from a low-rank forget gate, beta per head, a sigmoid-gated output norm
behind a low-rank gate: mcore/kimi_delta.py) and, where ``layer_types`` says ``full_attention``, DeepSeek-V3's
multi-latent attention without any RoPE (its shared key part is kept as projected: Megatron's rotary frequencies are
zeroed, rope.no_rotation); DeepSeek-V3's MoE (sigmoid router with a score-correction bias, shared experts, the first
layers dense) under Mixtral's checkpoint names (``block_sparse_moe``, ``w1`` / ``w3`` / ``w2``). Its config's own
names (``num_experts``, ``num_experts_per_token``, ``moe_renormalize``, ``linear_attn_config``, ...) are read through
transformers' config class (:func:`kimi_linear_view`).

Gemma 3 (``gemma3``, text models: Gemma3ForCausalLM): norms before *and* after attention and MLP (the sandwich:
``pre_norm`` and ``post_norm``), all of them (q/k per-head norms too) scaling by (1 + weight); GeGLU with the tanh
GELU; the embedding multiplied by sqrt(hidden_size) (in the weights' dtype, as HF does); attention scaled by
``query_pre_attn_scalar ** -0.5``; every ``sliding_window_pattern``-th layer global (``layer_types``), the others a
``sliding_window`` with RoPE base ``rope_local_base_freq`` (10k) while the global ones have ``rope_theta`` (1M) and
the checkpoint's ``rope_scaling`` (linear 8 on the larger models). A ``final_logit_softcapping`` (none in Gemma 3's
releases) caps the logits as HF does (GPTConfig.final_logit_softcapping).

Gemma (``gemma``: GemmaForCausalLM, gemma-2b / 7b, CodeGemma, RecurrentGemma excluded): Llama's pre-norm layers and
names with Gemma's norms scaling by (1 + weight), GeGLU with the tanh GELU (the releases say ``gelu``; transformers
runs the tanh approximation, as forge does), the embedding multiplied by sqrt(hidden_size) in the weights' dtype,
attention scaled by head_dim ** -0.5, the head tied; gemma-2b has one key head.

Gemma 2 (``gemma2``: Gemma2ForCausalLM, gemma-2-2b / 9b / 27b): Gemma 3's layer without the q/k norms; every other
layer, the first, a ``sliding_window`` (4096; ``layer_types`` where the config has them), all with one RoPE base
(``rope_theta``, 10k); attention scores soft-capped to c * tanh(s / c) before the softmax (``attn_logit_softcapping``,
50: GPTConfig.attention_softcapping, the tree kernels' ``softcap``) and the logits too (``final_logit_softcapping``,
30); ``query_pre_attn_scalar`` 256 (144 for 27B: hidden / heads).

MiMo-V2-Flash (``mimo_v2_flash``: MiMoV2FlashForCausalLM): sliding-window layers (a query sees itself and the
``sliding_window_size`` keys before it) beside full-attention ones (``hybrid_layer_pattern`` as released,
``layer_types`` as transformers writes it), the sliding ones with ``swa_num_key_value_heads`` key heads (transformers:
twice ``num_key_value_heads``) and a learned sink logit per head (``attention_sink_bias``); query and key heads of
``head_dim`` (192) channels, value heads of ``v_head_dim`` (128), the values multiplied by ``attention_value_scale``
as projected; RoPE on the first ``partial_rotary_factor`` of each head with the base of the layer's kind
(``rope_theta`` / ``swa_rope_theta``). Megatron builds one attention geometry per model: the layers are forge's
per-layer attention (mcore/gemma4.py, GPTConfig ``value_head_dim`` / ``value_scale`` / ``sink_layers``, the
full-attention layers' key heads as Gemma 4's global ones). The MLPs: the first layer(s) dense (``moe_layer_freq`` /
``mlp_layer_types``), the others DeepSeek-V3's sigmoid router with a score-correction bias, no shared expert. The MTP
layers (``model.mtp.*``) are left out.

MiniMax-M3 (``minimax_m3``: MiniMaxM3SparseForConditionalGeneration as released; its language model, text-only RL):
MiniMax-M2's Mixtral checkpoint names and sigmoid router with a score-correction bias, now with
``routed_scaling_factor`` on the routed experts and a shared expert (``shared_intermediate_size``) beside them, the first
layers dense (``moe_layer_freq`` / ``mlp_layer_types``: an MLP of ``dense_intermediate_size``); every MLP gpt-oss's
clamped SwiGLU ((clamp(up) + 1) * g * sigmoid(1.702 g), g = clamp(gate, max=7): ``swigluoai``) on non-interleaved
weights; per-head q/k RMSNorms; every norm scaling by (1 + weight); RoPE on the first ``partial_rotary_factor`` of each
head. The layers ``sparse_attention_freq`` (transformers: ``layer_types`` ``minimax_m3_sparse``) marks have a lightning
indexer choosing, per query and key head, ``sparse_topk_blocks`` blocks of ``sparse_block_size`` positions to attend
to (mcore/block_sparse.py). The vision tower, its projector and patch merger are copied on export, not trained.

LongCat-Flash (``longcat_flash``: LongcatFlashForCausalLM; -Chat, -Thinking): each of its ``num_layers`` layers is two
pre-norm sublayers of DeepSeek-V3's multi-latent attention and a dense MLP (``self_attn.{0,1}``, ``mlps.{0,1}``,
``input_layernorm.{0,1}``, ``post_attention_layernorm.{0,1}``) and a shortcut MoE from the first sublayer's MLP input to
the layer's output (``mlp.router.classifier``, ``mlp.experts.{e}.*``); Megatron builds it as two layers (mcore/longcat.py:
``num_layers`` doubled, the MoE in the first of each pair, its output carried beside the hidden states). The router is a
softmax over the ``n_routed_experts`` and ``zero_expert_num`` identity experts, top ``moe_topk`` chosen with the
score-correction bias, the weights scaled by ``routed_scaling_factor`` and not renormalised; an identity expert returns
its input. Its multi-latent attention scales the query by sqrt(hidden / q_lora_rank) and the key/value latent by
sqrt(hidden / kv_lora_rank) (``mla_scale_q_lora`` / ``mla_scale_kv_lora``, which transformers applies whatever they
say), its latent norms with epsilon 1e-6 beside the layers' ``rms_norm_eps``. Refused by name: other zero-expert
types, a router bias, renormalised top-k, either latent scale off, RoPE scaling. The MTP module (``model.mtp.*``) is left
out.

Router equivalence used for Qwen3-MoE: HF computes ``p = softmax(z)``, keeps the top-k and, with
``norm_topk_prob``, divides by their sum, which equals Megatron's ``softmax(topk(z))``
(``moe_router_pre_softmax=False``); without ``norm_topk_prob`` HF keeps the un-normalised top-k of the softmax,
Megatron's ``moe_router_pre_softmax=True``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from forge_megatron.mcore import rope
from forge_megatron.mcore.model import GPTConfig


@dataclass(frozen=True)
class Family:
    """Switches that tell one Llama-like family from another."""

    name: str
    qkv_bias: bool | None  # None: read ``attention_bias`` from the config
    qk_norm: bool | None  # None: read ``use_qk_norm`` from the config
    moe: bool
    # DeepSeek-V3-style MoE (GLM-4.5, DeepSeek-V3, Kimi-K2): sigmoid router with a score-correction bias, shared
    # experts, the first layers dense (see the module docstring)
    sigmoid_router: bool = False
    mla: bool = False  # multi-latent attention (DeepSeek-V3 layout)
    gpt_oss: bool = False  # sinks, sliding windows, biased experts with interleaved fused HF tensors
    minimax: bool = False  # MiniMax-M2: Mixtral expert names, no shared expert, q/k RMSNorm over all heads
    # Qwen3.5: Gated DeltaNet layers between gated full-attention ones, zero-centred norms (mcore/gated_delta_net.py)
    gated_delta: bool = False
    # a vision-language checkpoint: the language model's config is ``text_config``, its tensors are under
    # ``model.language_model.`` (text_view / Bridge.hf_prefix)
    multimodal: bool = False
    # a vision-language checkpoint's names: its language model's prefix (``text_prefix``; the head stays
    # ``lm_head``) and what is the vision side (copied on export, neither trained nor synced)
    text_prefix: str = "model.language_model."
    vision_prefixes: tuple[str, ...] = ("model.visual.",)
    head_name: str = "lm_head.weight"  # the output layer's checkpoint name (Kimi-K2.5: under language_model.)
    # OLMo 2 / OLMo 3: RMSNorms after attention and MLP instead of before (mcore/post_norm.py), q/k RMSNorms over all
    # heads; OLMo 3 also has sliding-window layers (``layer_types``) whose RoPE may differ from the others'
    olmo: bool = False
    # Gemma 3 (text): norms before and after attention and MLP (zero-centred), GeGLU (tanh GELU), the embedding
    # scaled by sqrt(hidden_size), a softmax scale of query_pre_attn_scalar ** -0.5, and local sliding-window layers
    # with their own RoPE base next to global ones
    gemma: bool = False
    # Gemma 4 (text): Gemma 3's sandwich with plain-weight norms, global layers with their own head size, key heads,
    # values that are the keys (attention_k_eq_v) and proportional RoPE, normed values, attention scale 1, a scalar
    # per layer, soft-capped logits; E2B / E4B's per-layer inputs and KV sharing, 26B-A4B's experts beside the dense
    # MLP (gemma4_view; mcore/gemma4.py)
    gemma4: bool = False
    # Qwen3-VL-MoE: each layer's experts in two checkpoint tensors, ``experts.gate_up_proj`` [E, H, 2F] (gate columns
    # first) and ``experts.down_proj`` [E, F, H], the transposes of the experts' linear weights; the router always
    # renormalises its top-k probabilities
    fused_experts: bool = False
    # DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): a lightning indexer per layer picks each query's ``index_topk``
    # keys (mcore/dsa.py); GLM's indexer rotates interleaved pairs and its "shared" layers reuse an earlier selection
    dsa: bool = False
    # MiniMax-M3: M2's names and router with a shared expert, scaling and dense first layers, gpt-oss's clamped SwiGLU,
    # per-head zero-centred q/k norms, block-sparse attention layers (minimax_m3_view; mcore/block_sparse.py)
    minimax_m3: bool = False
    # Mistral Small 4: DeepSeek-V3's MoE layout (shared experts, the first layers dense) with a softmax router and no
    # score-correction bias
    softmax_router: bool = False
    # each layer's experts in two checkpoint tensors holding expert e's weights at [e], ``experts.gate_up_proj``
    # [E, 2F, D] (gate rows first) and ``experts.down_proj`` [E, D, F] (transformers' layout; Mistral Small 4)
    stacked_experts: bool = False
    # Kimi Linear: Kimi Delta Attention layers (a decay per key channel, low-rank gates: mcore/kimi_delta.py) between
    # multi-latent attention ones without RoPE; DeepSeek-V3's MoE under Mixtral's names (block_sparse_moe, w1/w3/w2)
    kimi_delta: bool = False
    # ERNIE 4.5: interleaved RoPE pairs over the whole head; MoE: a softmax router choosing with a score-correction
    # bias (mcore/ernie.py), dense first layers, shared experts
    ernie: bool = False
    # Hunyuan: q/k norms after RoPE, an NTK-alpha RoPE base; MoE: a shared MLP beside the experts, router mlp.gate.wg
    hunyuan: bool = False
    # MiMo-V2-Flash: sliding-window layers with twice the key heads and a sink logit per head beside full-attention
    # ones, value heads narrower than the query / key heads, scaled values (mimo_view; mcore/gemma4.py's per-layer
    # attention); DeepSeek-V3's sigmoid router without shared experts
    mimo: bool = False
    # LongCat-Flash: two MLA attention + dense MLP sublayers per layer (Megatron layer pairs) and a shortcut MoE from
    # the first sublayer's MLP input to the layer's end, with zero-computation experts (longcat_view; mcore/longcat.py)
    longcat: bool = False
    # EXAONE 4.0 / K-EXAONE: per-head q/k norms before RoPE; with a sliding_window, sliding-window layers that rotate
    # beside full-attention layers that do not (NoPE); EXAONE 4.0's norms after attention and MLP (OLMo 2's),
    # K-EXAONE's before, with DeepSeek-V3's MoE (exaone_view)
    exaone: bool = False
    # Granite (3.x dense, 3.x MoE, 4.0 attention-only): muP-style scales (embedding, attention, residual, logits);
    # the MoE ones' experts stacked on disk (block_sparse_moe.input_linear / output_linear), a shared MLP beside them
    granite: bool = False
    # Nemotron-H (NVIDIA Nemotron-H, Nemotron Nano 2 / 3): layers of one sublayer each (Mamba-2, NoPE attention, a
    # squared-ReLU MLP, or DeepSeek-V3-routed squared-ReLU experts) behind their own norm (nemotron_h_view)
    nemotron_h: bool = False
    # LFM2 (Liquid AI): gated short-convolution layers (mcore/short_conv.py) beside attention with per-head q/k norms
    lfm2: bool = False
    # Llama 4: chunked attention with weightless q/k norms on the layers that rotate (interleaved pairs), NoPE layers
    # with an attention temperature; top-1 sigmoid-routed experts fed their inputs scaled by the router's score,
    # stacked and transposed on disk (``feed_forward.experts.gate_up_proj`` [E, D, 2F]), a shared expert beside them,
    # dense layers interleaved (Maverick)
    llama4: bool = False
    # Cohere (Command R, R7B, A, A+): attention and MLP in parallel on one input norm, a bias-free LayerNorm (Command
    # A+: an RMSNorm where the config gives rms_norm_eps), interleaved RoPE pairs, the logits times logit_scale, tied
    # embeddings; Cohere2's sliding-window layers rotate beside NoPE full-attention ones; Cohere2-MoE's experts
    # under a top-k-then-softmax (or sigmoid) router, shared experts averaged with them, dense first layers
    cohere: bool = False
    # Bamba (IBM's Mamba-2 hybrid): Granite 4.0-H's Mamba-2 and attention layers (RoPE on half of each head) without
    # Granite's scales, under Bamba's names (feed_forward, pre_ff_layernorm, final_layernorm)
    bamba: bool = False
    # Falcon-H1: attention and a Mamba-2 mixer side by side in every layer, muP multipliers on the embedding, the
    # mixers' inputs and outputs, the keys, the Mamba projection's segments, the MLP and the logits
    # (mcore/falcon_h1.py); Bamba's names
    falcon_h1: bool = False
    # AFMoE (Arcee Trinity): Gemma 3's sandwich norms (plain weights), per-head q/k norms and a sigmoid gate on every
    # attention channel from its own projection (gate_proj), window layers that rotate beside NoPE full ones;
    # DeepSeek-V3's sigmoid router (its bias beside it, route_scale) with shared experts, dense first layers
    afmoe: bool = False


_MISTRAL4 = Family("mistral4", qkv_bias=False, qk_norm=False, moe=True, mla=True, softmax_router=True,
                   stacked_experts=True)

FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", qkv_bias=None, qk_norm=False, moe=False),
    "Qwen2ForCausalLM": Family("qwen2", qkv_bias=True, qk_norm=False, moe=False),
    "Qwen3ForCausalLM": Family("qwen3", qkv_bias=None, qk_norm=True, moe=False),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", qkv_bias=None, qk_norm=True, moe=True),
    "Glm4MoeForCausalLM": Family("glm4_moe", qkv_bias=None, qk_norm=None, moe=True, sigmoid_router=True),
    # dots.llm1 (rednote-hilab, 142B-A14B): GLM-4.5's MoE layout and names (sigmoid router with a score-correction
    # bias, shared experts, the first layers dense) with Qwen3's per-head q/k RMSNorms and RoPE over the whole head
    "Dots1ForCausalLM": Family("dots1", qkv_bias=None, qk_norm=True, moe=True, sigmoid_router=True),
    # Solar Open (Upstage, 102B-A12B): GLM-4.5's MoE layout and names in every layer (no dense ones) under Llama's
    # attention (RoPE over the whole head, no q/k norms)
    "SolarOpenForCausalLM": Family("solar_open", qkv_bias=None, qk_norm=False, moe=True, sigmoid_router=True),
    # Mixtral (8x7B, 8x22B): Mistral's attention, every layer's experts under block_sparse_moe (w1 / w3 / w2), a
    # softmax router whose top-k probabilities are renormalised
    "MixtralForCausalLM": Family("mixtral", qkv_bias=False, qk_norm=False, moe=True),
    # MiniMax-Text-01 / MiniMax-M1 (456B-A46B): lightning-attention layers with a softmax one every eighth, Mixtral's
    # experts and names, residuals from the norms' outputs, scaled (see the module docstring)
    "MiniMaxForCausalLM": Family("minimax01", qkv_bias=False, qk_norm=False, moe=True),
    "MiniMaxText01ForCausalLM": Family("minimax01", qkv_bias=False, qk_norm=False, moe=True),
    "MiniMaxM1ForCausalLM": Family("minimax01", qkv_bias=False, qk_norm=False, moe=True),
    # Phi-3 / Phi-4 (Phi-4 14B, Phi-4-reasoning, -reasoning-plus): Llama's layout with q/k/v fused in qkv_proj and
    # gate/up in gate_up_proj (see the module docstring); longrope with one factor list for the run
    "Phi3ForCausalLM": Family("phi3", qkv_bias=False, qk_norm=False, moe=False),
    # Granite 3.x dense (2B / 8B), Granite 3.x MoE (1B-A400M, 3B-A800M), GraniteMoeShared, and Granite 4.0's
    # attention-only models (GraniteMoeHybrid without Mamba layers: granite-4.0-micro): see the module docstring
    "GraniteForCausalLM": Family("granite", qkv_bias=None, qk_norm=False, moe=False, granite=True),
    "GraniteMoeForCausalLM": Family("granitemoe", qkv_bias=None, qk_norm=False, moe=True, granite=True),
    "GraniteMoeSharedForCausalLM": Family("granitemoeshared", qkv_bias=None, qk_norm=False, moe=True, granite=True),
    "GraniteMoeHybridForCausalLM": Family("granitemoehybrid", qkv_bias=None, qk_norm=False, moe=True, granite=True),
    # Granite SWA / MoE SWA: Granite 3.x (dense / MoE with a shared MLP) with sliding-window layers (layer_types), a
    # learned sink logit per head in every layer and a RoPE base per layer (layer_rope_theta; 0: no RoPE)
    "GraniteSWAForCausalLM": Family("granite_swa", qkv_bias=None, qk_norm=False, moe=False, granite=True),
    "GraniteMoeSWAForCausalLM": Family("granitemoe_swa", qkv_bias=None, qk_norm=False, moe=True, granite=True),
    # HyperCLOVA X SEED (Naver: Think-14B, ...): Granite's muP-style scales with norms after attention and MLP too
    # (peri-layer normalisation: post_norm1 / post_norm2, before the residual multiplier) and the logits multiplied by
    # logits_scaling where Granite divides
    "HyperCLOVAXForCausalLM": Family("hyperclovax", qkv_bias=None, qk_norm=False, moe=False, granite=True),
    # Jais 2 (Inception: 8B): Llama's attention with biases on every projection, LayerNorms with biases, a plain
    # squared-ReLU MLP (up, down) with biases
    "Jais2ForCausalLM": Family("jais2", qkv_bias=None, qk_norm=False, moe=False),
    # StarCoder2 (3B, 7B, 15B): Mistral's attention with biases everywhere, LayerNorms with biases, a plain tanh-GELU
    # MLP (c_fc / c_proj, biased), every layer a sliding window
    "Starcoder2ForCausalLM": Family("starcoder2", qkv_bias=None, qk_norm=False, moe=False),
    "GraniteMoeHybridForCausalLM/dense": Family("granitemoehybrid", qkv_bias=None, qk_norm=False, moe=False,
                                                granite=True),
    # Nemotron-H (8B / 47B / 56B, Nemotron Nano 2) and, with "moe" layers, Nemotron 3 Nano: see the module docstring
    "NemotronHForCausalLM": Family("nemotron_h", qkv_bias=False, qk_norm=False, moe=False, nemotron_h=True),
    "NemotronHForCausalLM/moe": Family("nemotron_h", qkv_bias=False, qk_norm=False, moe=True, sigmoid_router=True,
                                       nemotron_h=True),
    # LFM2 (Liquid AI: 350M-2.6B): see the module docstring
    "Lfm2ForCausalLM": Family("lfm2", qkv_bias=False, qk_norm=True, moe=False, lfm2=True),
    # LFM2-MoE (LFM2-8B-A1B): the same layers, the first num_dense_layers with the MLP, the others experts under a
    # sigmoid router choosing with a bias (feed_forward.expert_bias), renormalised, no shared expert
    "Lfm2MoeForCausalLM": Family("lfm2_moe", qkv_bias=False, qk_norm=True, moe=True, sigmoid_router=True, lfm2=True),
    # LFM3 (Liquid AI, 1.7B): LFM2's layers with sandwich norms, sliding-window attention layers (plain RoPE, base 10k)
    # beside full ones (proportional RoPE over half the frequencies, base 1M), a sigmoid gate per attention head
    "Lfm3ForCausalLM": Family("lfm3", qkv_bias=False, qk_norm=True, moe=False, lfm2=True),
    # Laguna (poolside, XS.2): per-layer query heads, per-head q/k norms, a softplus gate per head, sliding-window
    # layers (plain RoPE) beside full ones (RoPE of their own over half of each head), DeepSeek-V3's sigmoid router
    # with a bias beside a shared expert, the first layer dense
    "LagunaForCausalLM": Family("laguna", qkv_bias=False, qk_norm=True, moe=True),
    # Flint (RecursiveSI): Qwen3-MoE's attention with a sink logit per head in every layer, sliding-window layers that
    # rotate beside full ones without RoPE, the first layers dense, experts under a sigmoid router beside a shared one
    "FlintForCausalLM": Family("flint", qkv_bias=False, qk_norm=True, moe=True),
    # Youtu-LLM (Tencent, 2B): DeepSeek-V3's multi-latent attention in Llama's layers with a dense SwiGLU MLP
    "YoutuForCausalLM": Family("youtu", qkv_bias=False, qk_norm=False, moe=False, mla=True),
    # EXAONE 4.0 (32B, 1.2B) and K-EXAONE (236B-A23B): see the module docstring
    "Exaone4ForCausalLM": Family("exaone4", qkv_bias=False, qk_norm=True, moe=False, exaone=True),
    # EXAONE 4.5 as released: EXAONE 4.0's language model under model.language_model. (1-D positions for text) beside a
    # Qwen2.5-VL-style tower under model.visual. (copied on export; text-only RL)
    "Exaone4_5_ForConditionalGeneration": Family("exaone4", qkv_bias=False, qk_norm=True, moe=False, exaone=True,
                                                 multimodal=True),
    "ExaoneMoeForCausalLM": Family("exaone_moe", qkv_bias=False, qk_norm=True, moe=True, sigmoid_router=True,
                                   exaone=True),
    # Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention, softmax-routed experts and a gated shared
    # expert in every layer
    "Qwen2MoeForCausalLM": Family("qwen2_moe", qkv_bias=None, qk_norm=False, moe=True),
    # DeepSeek-V3 / V3.1 / Kimi-K2 / Moonlight (Kimi's configs name this architecture too) and GLM-4.7-Flash
    "DeepseekV3ForCausalLM": Family("deepseek_v3", qkv_bias=False, qk_norm=False, moe=True, sigmoid_router=True,
                                    mla=True),
    # Kimi-K2.5 / K2.6 as released: the Kimi-K2 language model (DeepSeek-V3's layout) under language_model.model.
    # and language_model.lm_head, the MoonViT tower and projector beside it (vision_tower., mm_projector.; the
    # model.-prefixed names are how transformers holds them, as a checkpoint saved from memory has them). Released
    # with int4 experts: train the bf16 copy of forge-convert int4-to-bf16 (engines may serve the release:
    # --weight-sync-int4)
    **{arch: Family("deepseek_v3", qkv_bias=False, qk_norm=False, moe=True, sigmoid_router=True, mla=True,
                    multimodal=True, text_prefix="language_model.model.", head_name="language_model.lm_head.weight",
                    vision_prefixes=("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector."))
       for arch in ("KimiK25ForConditionalGeneration", "Kimi_K25ForConditionalGeneration")},
    # DeepSeek-V3.2 (-Exp, -Speciale): DeepSeek-V3's layers with DeepSeek sparse attention (an indexer in each)
    "DeepseekV32ForCausalLM": Family("deepseek_v32", qkv_bias=False, qk_norm=False, moe=True, sigmoid_router=True,
                                     mla=True, dsa=True),
    # GLM-5: the same layout (no expert groups), the indexer's RoPE on interleaved pairs, ``indexer_types``
    "GlmMoeDsaForCausalLM": Family("glm_moe_dsa", qkv_bias=False, qk_norm=False, moe=True, sigmoid_router=True,
                                   mla=True, dsa=True),
    "Glm4MoeLiteForCausalLM": Family("glm4_moe_lite", qkv_bias=False, qk_norm=False, moe=True, sigmoid_router=True,
                                     mla=True),
    # A.X K1 (SK Telecom, 519B-A33B): DeepSeek-V3's layers with an RMSNorm on each MoE layer's output
    # (post_mlp_layernorm; the release stores one for the dense layers too, unused) and, as released, no
    # score-correction bias (zeros)
    "AXK1ForCausalLM": Family("axk1", qkv_bias=False, qk_norm=False, moe=True, sigmoid_router=True, mla=True),
    # MiniCPM5-MoE (OpenBMB, 15B-A2.5B): Llama's attention with a sigmoid gate per query channel (q_proj holds each
    # head's queries then its gate, Qwen3.5's layout), DeepSeek-V3's MoE (fp32 sigmoid router with a score-correction
    # bias, a shared expert, the first layers dense); the older architecture name too
    **{arch: Family("minicpm5_moe", qkv_bias=None, qk_norm=False, moe=True, sigmoid_router=True)
       for arch in ("MiniCPM5MoeForCausalLM", "MiniCPM5MoEForCausalLM")},
    # Mistral Small 4 (119B-A6B): DeepSeek-V3's layers with a softmax router, Llama 4's query temperature and
    # stacked experts; released inside Mistral3ForConditionalGeneration (family_of tells it by its text_config)
    "Mistral4ForCausalLM": _MISTRAL4,
    # DeepSeek-V2 / V2-Lite / Coder-V2-Lite: DeepSeek-V3's layout with a softmax router (fp32 logits, the top k kept
    # as they are, scaled), no score-correction bias
    "DeepseekV2ForCausalLM": Family("deepseek_v2", qkv_bias=False, qk_norm=False, moe=True, mla=True,
                                    softmax_router=True),
    "KimiLinearForCausalLM": Family("kimi_linear", qkv_bias=False, qk_norm=False, moe=True, sigmoid_router=True,
                                    mla=True, kimi_delta=True),
    "MiniMaxM2ForCausalLM": Family("minimax_m2", qkv_bias=False, qk_norm=True, moe=True, sigmoid_router=True,
                                   minimax=True),
    # Qwen3.5 text models (dense): 3 of every 4 layers Gated DeltaNet (linear attention), the others gated attention
    "Qwen3_5ForCausalLM": Family("qwen3_5", qkv_bias=None, qk_norm=True, moe=False, gated_delta=True),
    # Qwen3-Next (80B-A3B): Qwen3.5-MoE's layers with Gated DeltaNet's input projections fused per key head in the
    # checkpoint (in_proj_qkvz, in_proj_ba)
    "Qwen3NextForCausalLM": Family("qwen3_next", qkv_bias=None, qk_norm=True, moe=True, gated_delta=True),
    # Qwen3.5 as released: the language models above inside a vision-language checkpoint (``text_config``; tensors
    # under ``model.language_model.``, the vision tower under ``model.visual.``): the language model trains
    "Qwen3_5ForConditionalGeneration": Family("qwen3_5", qkv_bias=None, qk_norm=True, moe=False, gated_delta=True,
                                              multimodal=True),
    # Qwen3-VL (dense: 2B-32B): a Qwen3 language model under model.language_model. beside model.visual.; a text
    # token has one position on all three mRoPE axes, so its rotation is plain RoPE
    "Qwen3VLForConditionalGeneration": Family("qwen3", qkv_bias=None, qk_norm=True, moe=False, multimodal=True),
    # Qwen2.5-VL (3B-72B) and Qwen2-VL (2B-72B), the base of many GUI agents: a Qwen2 language model (biases on
    # q/k/v) under model. (as released: a flat config.json, the tower under visual., the head lm_head), contiguous
    # mRoPE sections; their towers are transformers' (Qwen2.5-VL: windowed attention in most blocks)
    "Qwen2_5_VLForConditionalGeneration": Family("qwen2", qkv_bias=True, qk_norm=False, moe=False, multimodal=True,
                                                 text_prefix="model.", vision_prefixes=("visual.",)),
    "Qwen2VLForConditionalGeneration": Family("qwen2", qkv_bias=True, qk_norm=False, moe=False, multimodal=True,
                                              text_prefix="model.", vision_prefixes=("visual.",)),
    # Qwen3-VL-MoE (30B-A3B, 235B-A22B): a Qwen3-MoE language model (experts fused on disk) beside model.visual.
    "Qwen3VLMoeForConditionalGeneration": Family("qwen3_vl_moe", qkv_bias=None, qk_norm=True, moe=True,
                                                 multimodal=True, fused_experts=True),
    "Qwen3_5MoeForConditionalGeneration": Family("qwen3_5_moe", qkv_bias=None, qk_norm=True, moe=True,
                                                 gated_delta=True, multimodal=True),
    # Qwen3.5 MoE text models (35B-A3B, 122B-A10B, 397B-A17B): the same layers, every MLP softmax-routed experts
    # (top-k renormalised) plus one shared expert behind a sigmoid gate
    "Qwen3_5MoeForCausalLM": Family("qwen3_5_moe", qkv_bias=None, qk_norm=True, moe=True, gated_delta=True),
    "GptOssForCausalLM": Family("gpt_oss", qkv_bias=None, qk_norm=False, moe=True, gpt_oss=True),
    # Mistral-Small / Devstral / Magistral text models: the Llama layout (sliding windows refused below)
    "MistralForCausalLM": Family("mistral", qkv_bias=None, qk_norm=False, moe=False),
    # Ministral 3 (3B / 8B / 14B; Devstral 2's text models): the Llama layout, YaRN, and Llama 4's attention
    # temperature past original_max_position_embeddings (rope_parameters' llama_4_scaling_beta: query scaling);
    # released as Mistral3ForConditionalGeneration (Pixtral tower; the language model under language_model.model.,
    # its head language_model.lm_head, as Mistral-Small 3.1 / 3.2 whose text model is Mistral's)
    "Ministral3ForCausalLM": Family("ministral3", qkv_bias=None, qk_norm=False, moe=False),
    "Mistral3ForConditionalGeneration": Family("ministral3", qkv_bias=None, qk_norm=False, moe=False, multimodal=True,
                                               text_prefix="language_model.model.",
                                               head_name="language_model.lm_head.weight",
                                               vision_prefixes=("vision_tower.", "multi_modal_projector.")),
    "Mistral3ForConditionalGeneration/mistral4": replace(
        _MISTRAL4, multimodal=True, text_prefix="language_model.model.", head_name="language_model.lm_head.weight",
        vision_prefixes=("vision_tower.", "multi_modal_projector.")),
    "Olmo2ForCausalLM": Family("olmo2", qkv_bias=False, qk_norm=True, moe=False, olmo=True),
    "Olmo3ForCausalLM": Family("olmo3", qkv_bias=False, qk_norm=True, moe=False, olmo=True),
    # OLMo 3's attention layers (post-norm, q/k norms over all heads, no window; NoPE as released) between pre-norm
    # Gated DeltaNet layers with separate projections and beta in (0, 2)
    "OlmoHybridForCausalLM": Family("olmo_hybrid", qkv_bias=False, qk_norm=True, moe=False, olmo=True,
                                    gated_delta=True),
    # SmolLM3: the Llama layout with RoPE left out of every fourth layer (``no_rope_layers``: 0 = NoPE)
    "SmolLM3ForCausalLM": Family("smollm3", qkv_bias=None, qk_norm=False, moe=False),
    # ERNIE 4.5 (0.3B dense; 21B-A3B / 300B-A47B MoE): see the module docstring
    "Ernie4_5ForCausalLM": Family("ernie4_5", qkv_bias=False, qk_norm=False, moe=False, ernie=True),
    "Ernie4_5_MoeForCausalLM": Family("ernie4_5_moe", qkv_bias=False, qk_norm=False, moe=True, ernie=True),
    # Mellum 2 (JetBrains, 12B-A2.5B): Qwen3-MoE's layers (per-head q/k norms, softmax-routed experts) with
    # sliding-window layers that have their own RoPE base beside full ones, dense layers where mlp_layer_types says
    "MellumForCausalLM": Family("mellum", qkv_bias=None, qk_norm=True, moe=True),
    # Kolibri 1 (Aleph Alpha): EXAONE 4.0's attention (per-head q/k norms; sliding layers that rotate beside NoPE full
    # ones) in GLM-4's sandwich norms, every layer's experts beside a shared one under a router choosing by logit plus
    # bias and weighting by sigmoid (mcore/ernie.py LogitBiasRouter)
    "Kolibri1ForCausalLM": Family("kolibri1", qkv_bias=False, qk_norm=True, moe=True),
    # Hy3 (Tencent Hunyuan 3, HYV3ForCausalLM): dots.llm1's layout (per-head q/k norms before RoPE, the first layers
    # dense, a sigmoid router choosing with a score-correction bias, renormalised and scaled, shared experts) under
    # Hy3's names (mlp.router.gate, mlp.expert_bias, mlp.shared_mlp) and fields (router_scaling_factor)
    "HYV3ForCausalLM": Family("hy_v3", qkv_bias=None, qk_norm=True, moe=True, sigmoid_router=True),
    # OLMoE: Llama's pre-norm layout with q/k RMSNorms over all heads (as OLMo 2's, before RoPE) and a MoE of
    # intermediate_size experts, softmax top-k (renormalised when norm_topk_prob)
    "OlmoeForCausalLM": Family("olmoe", qkv_bias=False, qk_norm=True, moe=True),
    # Hunyuan (dense; A13B MoE): see the module docstring
    "HunYuanDenseV1ForCausalLM": Family("hunyuan_v1_dense", qkv_bias=False, qk_norm=True, moe=False, hunyuan=True),
    "HunYuanMoEV1ForCausalLM": Family("hunyuan_v1_moe", qkv_bias=False, qk_norm=True, moe=True, hunyuan=True),
    # MiniMax-M3 as released: the language model under language_model.model. (head language_model.lm_head) beside a
    # vision tower, its projector and patch merger (see the module docstring)
    "MiniMaxM3SparseForConditionalGeneration": Family(
        "minimax_m3", qkv_bias=False, qk_norm=True, moe=True, sigmoid_router=True, minimax_m3=True, multimodal=True,
        text_prefix="language_model.model.", head_name="language_model.lm_head.weight",
        vision_prefixes=("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.")),
    # MiniMax-M3's language model as transformers holds and saves it (MiniMaxM3VLForCausalLM: a fine-tune saved from
    # it): the same model under transformers' names (fused gate / up of the dense MLP and shared expert, every
    # layer's experts stacked [E, 2F, D] / [E, D, F], the indexer under self_attn.indexer., the router's bias in it)
    "MiniMaxM3VLForCausalLM": Family("minimax_m3", qkv_bias=False, qk_norm=True, moe=True, sigmoid_router=True,
                                     minimax_m3=True, stacked_experts=True),
    # MiMo-V2-Flash (309B-A15B): see the module docstring
    "MiMoV2FlashForCausalLM": Family("mimo_v2_flash", qkv_bias=None, qk_norm=False, moe=True, sigmoid_router=True,
                                     mimo=True),
    # LongCat-Flash (560B-A27B: -Chat, -Thinking): see the module docstring
    "LongcatFlashForCausalLM": Family("longcat_flash", qkv_bias=False, qk_norm=False, moe=True, mla=True,
                                      longcat=True),
    # Seed-OSS-36B: the Qwen2 layout (biases on q/k/v only) with 128-channel heads; its residual dropout is a
    # training-time switch, off here as every dropout is
    "SeedOssForCausalLM": Family("seed_oss", qkv_bias=None, qk_norm=False, moe=False),
    # GLM-4 dense (GLM-4-0414, GLM-Z1): norms before and after attention and MLP, the MLP's gate and up fused in
    # one checkpoint tensor, RoPE on interleaved channel pairs of the first half of each head
    "Glm4ForCausalLM": Family("glm4", qkv_bias=None, qk_norm=False, moe=False),
    # GLM-4 (2024: glm-4-9b, -chat, -chat-1m as transformers holds them): GLM-4-0414's attention (q/k/v biases, RoPE on
    # interleaved pairs of half of each head) and fused gate / up MLP in Llama's pre-norm layers (no sandwich)
    "GlmForCausalLM": Family("glm", qkv_bias=None, qk_norm=False, moe=False),
    # GLM-4.1V-Thinking / GLM-4.6V-Flash: the GLM-4 dense language model (biases on q/k/v always) under
    # model.language_model. beside model.visual.; GLM-4.5V / GLM-4.6V: the GLM-4.5-Air MoE one. A text token has one
    # position on all three mRoPE axes, so its rotation is the language model's own (interleaved / halves)
    "Glm4vForConditionalGeneration": Family("glm4", qkv_bias=True, qk_norm=False, moe=False, multimodal=True),
    "Glm4vMoeForConditionalGeneration": Family("glm4_moe", qkv_bias=None, qk_norm=False, moe=True, sigmoid_router=True,
                                               multimodal=True),
    # GLM-4.6V as transformers 5.x holds it (Glm46VForConditionalGeneration): GLM-4.1V's names and tower, the language
    # model built from the model_type its text_config names; the dense glm4v_text (GLM-4.1V's) is supported
    "Glm46VForConditionalGeneration": Family("glm4", qkv_bias=True, qk_norm=False, moe=False, multimodal=True),
    "Gemma3ForCausalLM": Family("gemma3", qkv_bias=None, qk_norm=True, moe=False, gemma=True),
    "Llama4ForCausalLM": Family("llama4", qkv_bias=None, qk_norm=False, moe=True, llama4=True),
    # Ministral 8B (2410): Mistral's layer with sliding-window layers beside full-attention ones (layer_types)
    "MinistralForCausalLM": Family("ministral", qkv_bias=False, qk_norm=False, moe=False),
    # Meta CWM (Code World Model, 32B): the same, three of every four layers a sliding window (the first of each four
    # full, where the config names no layer_types), Llama 3's RoPE scaling
    "CwmForCausalLM": Family("cwm", qkv_bias=False, qk_norm=False, moe=False),
    # Arcee AFM-4.5B: Llama's layer with a plain (not gated) squared-ReLU MLP (up_proj, down_proj)
    "ArceeForCausalLM": Family("arcee", qkv_bias=None, qk_norm=False, moe=False),
    # Llama 4 Scout / Maverick as released: the text model above under language_model.model. (and its head under
    # language_model.), the vision model and its projector beside it
    "Llama4ForConditionalGeneration": Family("llama4", qkv_bias=None, qk_norm=False, moe=True, llama4=True,
                                             multimodal=True, text_prefix="language_model.model.",
                                             head_name="language_model.lm_head.weight",
                                             vision_prefixes=("vision_model.", "multi_modal_projector.")),
    # Gemma (1: gemma-2b / 7b, CodeGemma): Llama's pre-norm layers with Gemma's (1 + weight) norms, GeGLU, the scaled
    # embedding and the tied head (2B: one key head)
    "GemmaForCausalLM": Family("gemma", qkv_bias=None, qk_norm=False, moe=False),
    # Gemma 2: Gemma 3's layer without the q/k norms, every other layer (the first) a sliding window, one RoPE base,
    # soft-capped attention scores and logits
    "Gemma2ForCausalLM": Family("gemma2", qkv_bias=None, qk_norm=False, moe=False, gemma=True),
    "BambaForCausalLM": Family("bamba", qkv_bias=None, qk_norm=False, moe=False, bamba=True),
    # Apertus (Swiss AI, 8B / 70B): Llama's layer with per-head q/k RMSNorms and a plain MLP whose xIELU activation
    # has two trained scalars per layer (mcore/xielu.py); its norms attention_layernorm / feedforward_layernorm
    "ApertusForCausalLM": Family("apertus", qkv_bias=None, qk_norm=True, moe=False),
    "FalconH1ForCausalLM": Family("falcon_h1", qkv_bias=None, qk_norm=False, moe=False, falcon_h1=True),
    # FlexOlmo: OLMo 2's post-norm layer (q/k norms over all heads) with OLMoE's experts (softmax over all, top k)
    "FlexOlmoForCausalLM": Family("flex_olmo", qkv_bias=False, qk_norm=True, moe=True, olmo=True),
    "AfmoeForCausalLM": Family("afmoe", qkv_bias=False, qk_norm=True, moe=True, afmoe=True),
    # Cohere: Command R (v1 layout), Command R7B / A / A Reasoning (Cohere2: sliding layers rotate, full ones NoPE),
    # Command A+ (Cohere2-MoE)
    "CohereForCausalLM": Family("cohere", qkv_bias=False, qk_norm=False, moe=False, cohere=True),
    "Cohere2ForCausalLM": Family("cohere2", qkv_bias=False, qk_norm=False, moe=False, cohere=True),
    "Cohere2MoeForCausalLM": Family("cohere2_moe", qkv_bias=False, qk_norm=False, moe=True, cohere=True),
    "Gemma4ForCausalLM": Family("gemma4", qkv_bias=False, qk_norm=True, moe=False, gemma4=True),
    # Gemma 4 as released: the text model above under model.language_model. (tied head) beside its vision and audio
    # towers and their embedders
    "Gemma4ForConditionalGeneration": Family("gemma4", qkv_bias=False, qk_norm=True, moe=False, gemma4=True,
                                             multimodal=True,
                                             vision_prefixes=("model.vision_tower.", "model.audio_tower.",
                                                              "model.embed_vision.", "model.embed_audio.")),
    # Gemma 3 4B-27B as released: the text model above under language_model.model. (tied head), a SigLIP vision
    # tower and its projector beside it
    "Gemma3ForConditionalGeneration": Family("gemma3", qkv_bias=None, qk_norm=True, moe=False, gemma=True,
                                             multimodal=True, text_prefix="language_model.model.",
                                             vision_prefixes=("vision_tower.", "multi_modal_projector.")),
}


# vision-language releases whose config.json is flat (no text_config: the language model's fields at the top level,
# RoPE as rope_scaling {"type": "mrope", "mrope_section": ...}); transformers reads them into a text_config
FLAT_VL_CONFIGS = ("Qwen2_5_VLForConditionalGeneration", "Qwen2VLForConditionalGeneration")


class UnsupportedModelError(ValueError):
    """The HF config describes an architecture (or an option of one) that the bridge cannot map exactly."""


def load_hf_config(source) -> dict:
    """A HF config as a plain dict, from a dict, a ``PretrainedConfig``, a model directory or a config.json path."""
    if isinstance(source, dict):
        return dict(source)
    if hasattr(source, "to_dict"):
        return source.to_dict()
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no HF config at {path!r} (expected a model directory with config.json)")
    with open(path) as f:
        return json.load(f)


def text_view(hf: dict) -> dict:
    """The language model's config of a vision-language checkpoint (its ``text_config``, or for a flat release
    config (:data:`FLAT_VL_CONFIGS`) the top level without ``vision_config``, with the top level's ``architectures``,
    ``tie_word_embeddings`` and ``quantization_config``; Qwen2-VL's ``mrope`` RoPE read as plain RoPE, which a text
    token's rotation is); any other config as it is."""
    if not family_of(hf).multimodal:
        return hf
    if isinstance(hf.get("text_config"), dict):
        text = dict(hf["text_config"])
    elif hf["architectures"][0] in FLAT_VL_CONFIGS:  # the language model's fields at the top level, as released
        text = {k: v for k, v in hf.items() if k != "vision_config"}
        text["model_type"] = f"{hf.get('model_type')}_text"
    else:
        raise UnsupportedModelError(f"{hf['architectures'][0]} config has no text_config")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type")) == "mrope":  # Qwen2-VL's name for plain RoPE over 3-D positions
        text.pop("rope_scaling", None)
        text["rope_parameters"] = {**{k: v for k, v in rope.items() if k != "type"}, "rope_type": "default",
                                   "rope_theta": rope.get("rope_theta", text.get("rope_theta", 10000.0))}
    text["architectures"] = hf["architectures"]
    text["tie_word_embeddings"] = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    if hf.get("image_token_id") is not None:  # (Gemma 4 E2B / E4B: its per-layer inputs take images as padding)
        text.setdefault("image_token_id", hf["image_token_id"])
    if hf.get("quantization_config") and not text.get("quantization_config"):  # a quantized release's, either level
        text["quantization_config"] = hf["quantization_config"]
    return text


SEQ_CLS = "ForSequenceClassification"


def is_reward_config(hf: dict) -> bool:
    """A sequence-classification checkpoint's config (a reward model: ``Qwen2ForSequenceClassification``, ...)."""
    return str((hf.get("architectures") or [""])[0]).endswith(SEQ_CLS)


def reward_labels(hf: dict) -> int:
    """A sequence classifier's outputs as transformers reads its config: ``id2label``'s entries, else
    ``num_labels``, else transformers' default of 2 (transformers 5 leaves the default's labels out of the
    config.json it saves, so a two-label model's config names none)."""
    return len(hf.get("id2label") or {}) or int(hf.get("num_labels", 2))


def reward_model_config(hf: dict) -> dict:
    """The config of a reward model made from a causal LM's (``<Family>ForSequenceClassification``, one label), or
    a sequence-classification config as it is. ValueError when transformers has no such class for the family, or the
    model is not a text-only causal LM."""
    import transformers

    if is_reward_config(hf):
        return dict(hf)
    arch = str((hf.get("architectures") or [""])[0])
    if not arch.endswith("ForCausalLM"):
        raise ValueError(f"{arch or 'a config without architectures'}: reward models are made from text-only causal "
                         f"language models (*ForCausalLM) or sequence-classification checkpoints")
    name = arch[:-len("ForCausalLM")] + SEQ_CLS
    if not hasattr(transformers, name):
        raise ValueError(f"transformers has no {name}: a reward model of {arch} could not be loaded or served")
    return {**hf, "architectures": [name], "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}


def family_of(hf: dict) -> Family:
    archs = list(hf.get("architectures") or [])
    if not archs:
        raise UnsupportedModelError("HF config has no 'architectures' entry; cannot tell the model family")
    if archs[0].endswith(SEQ_CLS):  # a reward model: its language model's family, and a score head (Bridge)
        archs[0] = archs[0][:-len(SEQ_CLS)] + "ForCausalLM"
    if archs[0] not in FAMILIES:
        raise UnsupportedModelError(
            f"unsupported architecture {archs[0]!r}; supported: {sorted(k for k in FAMILIES if '/' not in k)}"
        )
    text = hf["text_config"] if isinstance(hf.get("text_config"), dict) else hf  # (or its text view)
    if archs[0] == "Mistral3ForConditionalGeneration":  # Ministral 3 / Mistral Small 3.x, or Mistral Small 4 inside
        if text.get("model_type") == "mistral4":
            return FAMILIES["Mistral3ForConditionalGeneration/mistral4"]
    if archs[0] == "NemotronHForCausalLM" and "moe" in nemotron_h_kinds(text):
        return FAMILIES["NemotronHForCausalLM/moe"]  # (Nemotron 3 Nano: "E" layers)
    if archs[0] == "GraniteMoeHybridForCausalLM" and not text.get("num_local_experts", 8):
        return FAMILIES["GraniteMoeHybridForCausalLM/dense"]  # (granite-4.0-micro: the shared MLP alone)
    if archs[0] == "Glm46VForConditionalGeneration" and text.get("model_type", "glm4v_text") != "glm4v_text":
        # transformers writes such a checkpoint's MoE experts fused, in a layout no release is known to use
        raise UnsupportedModelError(
            f"Glm46VForConditionalGeneration with a {text.get('model_type')!r} language model is not supported: its "
            "language model must be glm4v_text (GLM-4.1V's dense one); GLM-4.5V / 4.6V as released "
            "(Glm4vMoeForConditionalGeneration) are")
    return FAMILIES[archs[0]]


LAYER_TYPES = ("sliding_attention", "full_attention")


def rope_parameters(hf: dict, layer_type: str = "full_attention") -> dict:
    """transformers 5's ``rope_parameters`` of ``layer_type``'s layers: the dict itself, or, where a model gives
    each layer type its own (OLMo 3: ``{"sliding_attention": {...}, "full_attention": {...}}``), that type's."""
    params = hf.get("rope_parameters") or {}
    if any(t in params for t in LAYER_TYPES):
        return dict(params.get(layer_type) or {})
    return dict(params)


def rope_theta(hf: dict) -> float:
    """RoPE base from either the classic ``rope_theta`` field or transformers 5's ``rope_parameters``."""
    return float(hf.get("rope_theta") or rope_parameters(hf).get("rope_theta") or 10000.0)


def rope_scaling(hf: dict, layer_type: str = "full_attention") -> dict | None:
    """The config's RoPE scaling (``rope_scaling``, or transformers 5's ``rope_parameters``) checked by
    mcore/rope.py: linear, llama3 and yarn are mapped; None for plain RoPE. ``layer_type``: the RoPE of that kind
    of layer in a model whose kinds differ (OLMo 3 scales its full-attention layers' only, and a top-level
    ``rope_scaling`` means those)."""
    if layer_type != "full_attention":
        params = rope_parameters(hf, layer_type)
    else:
        params = dict(hf.get("rope_scaling") or rope_parameters(hf) or {})
    if "original_max_position_embeddings" in hf and rope.rope_type(params) in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings", hf["original_max_position_embeddings"])
    try:
        return rope.check(params, hf.get("max_position_embeddings", 4096))
    except ValueError as exc:
        raise UnsupportedModelError(str(exc)) from exc


def partial_rotary(hf: dict) -> float:
    """The fraction of each head RoPE rotates (``partial_rotary_factor``, top level or in ``rope_parameters``; or
    MiniMax-M2's ``rotary_dim`` channels of ``head_dim``)."""
    params = rope_parameters(hf)
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if factor is None and hf.get("rotary_dim"):
        factor = hf["rotary_dim"] / (hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    return float(factor or 1.0)


def layer_types(hf: dict, family: Family) -> list[str] | None:
    """Each layer's ``sliding_attention`` / ``full_attention`` (``layer_types``; older Gemma 3 configs give only
    ``sliding_window_pattern``: every n-th layer full, default 6); None for models without them."""
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    if family.gemma:  # (Gemma 2: every other layer, the first sliding)
        n = int(hf.get("sliding_window_pattern") or (2 if family.name == "gemma2" else 6))
        return ["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(hf["num_hidden_layers"])]
    return None


def cohere_view(hf: dict) -> dict:
    """A Cohere config with what transformers derives from it: Cohere2's ``head_dim`` (always hidden / heads) and
    ``layer_types`` (from ``sliding_window_pattern``, every n-th layer full, where a config has none: Command R7B /
    A's older configs), Cohere2-MoE's ``layer_types`` / ``mlp_layer_types`` (from ``first_k_dense_replace`` and the
    dense prefix's own window pattern), and ``cohere_rotates``: the layers that apply RoPE (Cohere: all; Cohere2:
    the sliding-window ones, and Cohere2-MoE's dense prefix where its pattern is 1)."""
    hf = dict(hf)
    n = hf["num_hidden_layers"]
    name = family_of(hf).name
    if name == "cohere":
        hf["cohere_rotates"] = [True] * n
        return hf
    if name == "cohere2":
        hf["head_dim"] = hf["hidden_size"] // hf["num_attention_heads"]
        pattern = int(hf.get("sliding_window_pattern") or 4)
        hf["layer_types"] = list(hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)])
        dense = [False] * n
        prefix_pattern = None
    else:
        k = int(hf.get("first_k_dense_replace") or 0)
        prefix_pattern = int(hf.get("prefix_dense_sliding_window_pattern") or 1)
        pattern = int(hf.get("sliding_window_pattern") or 4)
        hf["layer_types"] = list(hf.get("layer_types") or (
            ["sliding_attention" if (i + 1) % prefix_pattern else "full_attention" for i in range(k)] +
            ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n - k)]))
        hf["mlp_layer_types"] = list(hf.get("mlp_layer_types") or ["dense" if i < k else "sparse" for i in range(n)])
        dense = [t == "dense" for t in hf["mlp_layer_types"]]
    if len(hf["layer_types"]) != n or not set(hf["layer_types"]) <= set(LAYER_TYPES):
        raise UnsupportedModelError(f"layer_types {hf['layer_types']}: one of {LAYER_TYPES} per layer ({n})")
    window = hf.get("sliding_window")  # (none: no layer has a window, and only forced ones rotate)
    hf["cohere_rotates"] = [bool(window) and t == "sliding_attention" or (d and prefix_pattern == 1)
                            for t, d in zip(hf["layer_types"], dense)]
    return hf


def granite_swa_fields(hf: dict) -> dict:
    """GPTConfig fields of Granite SWA's attention: the sliding-window layers (``layer_types``, ``sliding_window``),
    a learned sink logit per head in every layer (Megatron's ``softmax_type="learnable"``; transformers scales each
    output by sigmoid(lse - sink), which is the sink as one more softmax logit), and ``layer_rope_theta``'s bases: 0 a
    layer without RoPE, the others one base, or one for the sliding layers and one for the full ones."""
    n = hf["num_hidden_layers"]
    types = list(hf.get("layer_types") or ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(n)])
    if not set(types) <= {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(f"layer_types {sorted(set(types))}: only sliding_attention and full_attention")
    thetas = [float(t or 0) for t in (hf.get("layer_rope_theta") or [rope_theta(hf)] * n)]
    bases = {kind: {t for t, k in zip(thetas, types) if k == kind and t} for kind in ("full_attention",
                                                                                        "sliding_attention")}
    if any(len(b) > 1 for b in bases.values()):
        raise UnsupportedModelError(f"layer_rope_theta {thetas}: one RoPE base per layer kind is supported")
    full, sliding = (next(iter(bases[k]), None) for k in ("full_attention", "sliding_attention"))
    out = {"extra": {"softmax_type": "learnable", **sliding_windows({**hf, "layer_types": types})},
           "rotary_base": full or sliding or rope_theta(hf)}
    if 0.0 in thetas:
        out["nope_layers"] = tuple(t == 0.0 for t in thetas)
    if full and sliding and full != sliding:
        out.update(sliding_rotary_base=sliding, sliding_rope_scaling={"rope_type": "default"})
    if out["extra"]["window_size"] is None:
        out["extra"].pop("window_size"), out["extra"].pop("window_attn_skip_freq")
    return out


def llama4_rope_layers(hf: dict) -> list[int]:
    """Llama 4's ``no_rope_layers`` (despite the name: 1 where a layer rotates), transformers' default where the
    config has none: every ``no_rope_layer_interval``-th layer (4) without RoPE."""
    interval = int(hf.get("no_rope_layer_interval") or 4)
    return list(hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(hf["num_hidden_layers"])])


def llama4_layer_types(hf: dict) -> list[str]:
    """Llama 4's ``layer_types``: ``chunked_attention`` on the layers that rotate when the config has an
    ``attention_chunk_size``, ``full_attention`` elsewhere (transformers' default where the config has none)."""
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    chunked = hf.get("attention_chunk_size") is not None
    return ["chunked_attention" if r and chunked else "full_attention" for r in llama4_rope_layers(hf)]


def llama4_moe_layers(hf: dict) -> list[bool]:
    """Which of Llama 4's layers are MoE: ``moe_layers``, else every ``interleave_moe_layer_step``-th (Scout: 1,
    every layer; Maverick: 2, the odd ones)."""
    n = hf["num_hidden_layers"]
    moe = hf.get("moe_layers")
    if moe is None:
        step = int(hf.get("interleave_moe_layer_step") or 1)
        moe = range(step - 1, n, step)
    moe = set(int(i) for i in moe)
    return [i in moe for i in range(n)]


def _refuse_unsupported(hf: dict, family: Family) -> None:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if family.name == "gemma" and act == "gelu":  # (Gemma 1's releases say gelu; transformers runs the tanh GELU)
        act = "gelu_pytorch_tanh"
    wanted = "gelu_pytorch_tanh" if family.gemma or family.gemma4 or family.name in ("gemma", "starcoder2") else \
        "relu2" if family.name in ("arcee", "jais2") else "xielu" if family.name == "apertus" else "silu"
    if act != wanted:
        glu = {"gelu_pytorch_tanh": "GeGLU with the tanh GELU", "relu2": "a plain squared-ReLU MLP",
               "xielu": "a plain MLP with xIELU"}.get(wanted, "SwiGLU with silu")
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported ({glu} only)")
    if family.llama4:
        if int(hf.get("num_experts_per_tok", 1)) != 1:
            raise UnsupportedModelError(f"num_experts_per_tok={hf['num_experts_per_tok']}: Llama 4's experts take "
                                        "inputs scaled by the router's score, which only top-1 routing defines")
        if hf.get("attention_bias"):
            raise UnsupportedModelError("attention_bias=True is not supported for Llama 4 (biases on q/k/v and o_proj: "
                                        "no release has them)")
        if float(hf.get("router_jitter_noise") or 0.0):
            raise UnsupportedModelError(f"router_jitter_noise={hf['router_jitter_noise']} is not supported (RL "
                                        "trains the routing the engines serve)")
        kinds = set(llama4_layer_types(hf))
        if not kinds <= {"chunked_attention", "full_attention"}:
            raise UnsupportedModelError(f"layer_types {sorted(kinds)}: only chunked_attention and full_attention")
        rotates = [bool(x) for x in llama4_rope_layers(hf)]
        if [t == "chunked_attention" for t in llama4_layer_types(hf)] != \
                [r and bool(hf.get("attention_chunk_size")) for r in rotates]:
            raise UnsupportedModelError("layer_types must mark chunked_attention exactly the layers that rotate "
                                        "(no_rope_layers) when attention_chunk_size is set, as Llama 4 does")
    if family.cohere:
        if hf.get("use_qk_norm"):
            raise UnsupportedModelError("use_qk_norm=True (Command R+'s q/k LayerNorms with a weight per head) is not "
                                        "supported")
        if hf.get("attention_bias"):
            raise UnsupportedModelError("attention_bias=True is not supported for Cohere (biases on q/k/v and o_proj: "
                                        "no release has them)")
        if family.moe:
            fn = hf.get("expert_selection_fn", "softmax")
            if fn not in ("softmax", "sigmoid"):
                raise UnsupportedModelError(f"expert_selection_fn {fn!r}: softmax or sigmoid only")
            if fn == "sigmoid" and not hf.get("norm_topk_prob", True) and int(hf["num_experts_per_tok"]) > 1:
                raise UnsupportedModelError("expert_selection_fn 'sigmoid' with norm_topk_prob=False is not supported "
                                            "(Megatron's sigmoid router renormalises its top-k scores)")
            how = hf.get("shared_expert_combination_strategy", "average")
            if how not in ("average", "sum"):
                raise UnsupportedModelError(f"shared_expert_combination_strategy {how!r}: average or sum only")
            if set(hf["mlp_layer_types"]) - {"dense", "sparse"} or len(hf["mlp_layer_types"]) != \
                    hf["num_hidden_layers"]:
                raise UnsupportedModelError(f"mlp_layer_types {hf['mlp_layer_types']}: dense or sparse per layer")
    if family.gemma:
        if hf.get("use_bidirectional_attention"):
            raise UnsupportedModelError("use_bidirectional_attention=True (an embedding model) is not supported")
    if family.gemma4:
        # "vision": text causal, an image's tokens seeing each other in the sliding layers (tree attention's image
        # blocks, multimodal/families.py); "all" (every token both ways) is not a language model's
        if hf.get("use_bidirectional_attention") not in (None, "vision"):
            raise UnsupportedModelError(f"use_bidirectional_attention={hf['use_bidirectional_attention']!r}: "
                                        "bidirectional attention over text is not supported")
        if hf.get("attention_bias"):
            raise UnsupportedModelError(f"attention_bias={hf['attention_bias']!r}: attention biases are not supported")
        if hf.get("hidden_size_per_layer_input") and hf.get("enable_moe_block"):
            raise UnsupportedModelError("per-layer inputs beside the MoE block: no Gemma 4 release has both; "
                                        "not supported")
        if not set(hf["layer_types"]) <= set(LAYER_TYPES):
            raise UnsupportedModelError(f"layer_types {sorted(set(hf['layer_types']))}: only sliding_attention and "
                                        "full_attention")
        sliding, full = rope_parameters(hf, "sliding_attention"), rope_parameters(hf, "full_attention")
        if sliding.get("rope_type", "default") != "default" or full.get("rope_type", "default") not in (
                "default", "proportional"):
            raise UnsupportedModelError(f"Gemma 4 RoPE {sliding.get('rope_type')!r} (sliding) / "
                                        f"{full.get('rope_type')!r} (full): default on the sliding layers and "
                                        "default or proportional on the full ones only")
    if hf.get("mlp_bias") and family.name != "jais2":  # (Jais 2: attention and MLP biased together)
        raise UnsupportedModelError("mlp_bias=True is not supported (Megatron's add_bias_linear would also add "
                                    "an attention output bias)")
    if hf.get("use_sliding_window"):
        raise UnsupportedModelError("use_sliding_window=True is not supported")
    window = hf.get("sliding_window") if family.name in ("mistral", "ministral3", "mixtral", "phi3") else None
    if window is not None and window < hf.get("max_position_embeddings", 0):
        raise UnsupportedModelError(f"sliding_window={window} is not supported (tree attention sees every ancestor; "
                                    "Mistral-Small 3 / Devstral / Phi-4 configs have none)")
    # (transformers reads Phi-3's older "yarn" as longrope too; "su" rope.rope_type reads so itself)
    if family.name == "phi3" and rope.rope_type(hf.get("rope_scaling") or rope_parameters(hf)) == "yarn":
        raise UnsupportedModelError("rope_scaling type 'yarn' in a Phi-3 config (transformers reads it as longrope): "
                                    "write it as longrope")
    if family.name == "lfm3":  # (a share of the frequencies is part of proportional RoPE's table, not of the head)
        for kind in ("sliding_attention", "full_attention"):
            params = rope_parameters(hf, kind)
            if float(params.get("partial_rotary_factor", 1.0)) != 1.0 and rope.rope_type(params) != "proportional":
                raise UnsupportedModelError(f"{kind} layers' partial_rotary_factor with {rope.rope_type(params)!r} "
                                            "RoPE: LFM3 rotates whole heads (proportional RoPE a share of them)")
        if "sliding_attention" in (hf.get("layer_types") or []) and not hf.get("sliding_window"):
            raise UnsupportedModelError("sliding_attention layers without a sliding_window in an LFM3 config (they "
                                        "would attend fully with their own RoPE) are not supported")
    if partial_rotary(hf) != 1.0 and family.name not in ("glm4_moe", "minimax_m2", "glm4", "glm", "gemma4",
                                                         "mimo_v2_flash", "minimax_m3", "phi3", "bamba", "lfm3",
                                                         "minimax01", "laguna") \
            and not family.gated_delta \
            and not family.mla:  # (MLA rotates qk_rope_head_dim channels: Mistral 4 states it as this fraction)
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported for this family")
    if family.gpt_oss:
        if float(hf.get("swiglu_alpha", 1.702)) != 1.702:
            raise UnsupportedModelError(f"swiglu_alpha={hf['swiglu_alpha']} is not supported (Megatron's quick_gelu "
                                        "uses 1.702, gpt-oss's value)")
        kinds = set(hf.get("layer_types") or [])
        if not kinds <= {"sliding_attention", "full_attention"}:
            raise UnsupportedModelError(f"layer_types {sorted(kinds)}: only sliding_attention and full_attention")
        quant = (hf.get("quantization_config") or {}).get("quant_method")
        if quant:
            raise UnsupportedModelError(f"a {quant} checkpoint: train and serve a bf16 copy "
                                        "(forge-convert mxfp4-to-bf16 --hf-dir DIR --out DIR_BF16)")
    quantization = hf.get("quantization_config") or {}
    if quantization and not family.gpt_oss:  # gpt-oss: its MXFP4 message above
        from forge_megatron.weight_sync.fp8 import Fp8Config

        method = quantization.get("quant_method")
        if method != "fp8":
            hint = " (compressed-tensors int4, e.g. Kimi-K2-Thinking: forge-convert int4-to-bf16 --hf-dir DIR --out " \
                   "DIR_BF16; engines may still serve DIR: --weight-sync-int4 DIR)" if method == "compressed-tensors" \
                else ""
            raise UnsupportedModelError(f"a {method} checkpoint: only block-wise fp8 checkpoints are read "
                                        f"(dequantized); train and serve a bf16 copy of others{hint}")
        try:
            Fp8Config.from_hf(quantization)
        except ValueError as exc:
            raise UnsupportedModelError(f"fp8 checkpoint: {exc}") from exc
    if family.ernie:
        _refuse_unsupported_ernie(hf, family)
    if family.hunyuan:
        _refuse_unsupported_hunyuan(hf, family)
    if family.name == "minimax01":
        _refuse_unsupported_minimax01(hf)
    if family.name == "laguna":
        _refuse_unsupported_laguna(hf)
    if family.name == "flint":
        _refuse_unsupported_flint(hf)
    if family.name in ("mixtral", "minimax01") and float(hf.get("router_jitter_noise") or 0.0) != 0.0:
        raise UnsupportedModelError(f"router_jitter_noise={hf['router_jitter_noise']}: transformers multiplies the "
                                    "router's input by random noise while training (Mixtral releases have none)")
    if family.afmoe:
        types = afmoe_layer_types(hf)
        if len(types) != hf["num_hidden_layers"] or not set(types) <= set(LAYER_TYPES):
            raise UnsupportedModelError(f"layer_types {types}: one of {LAYER_TYPES} per layer")
        if hf.get("attention_bias"):
            raise UnsupportedModelError("attention_bias=True is not supported for AFMoE (no release has it)")
        if not 0 <= int(hf.get("num_dense_layers") or 0) < hf["num_hidden_layers"]:
            raise UnsupportedModelError(f"num_dense_layers={hf.get('num_dense_layers')} leaves no MoE layer")
    if family.falcon_h1:
        for key in ("attention_bias", "mlp_bias", "projectors_bias", "mamba_proj_bias"):
            if hf.get(key):
                raise UnsupportedModelError(f"{key}=True is not supported for Falcon-H1 (no release has these "
                                            "biases)")
        if hf.get("mamba_rms_norm") and hf.get("mamba_norm_before_gate", True):
            raise UnsupportedModelError("mamba_rms_norm with mamba_norm_before_gate is not supported (transformers' "
                                        "fused and unfused paths put the gate on either side of that norm; the "
                                        "releases have no such norm)")
        d_head = falcon_h1_mamba_head_dim(hf)
        if d_head * hf.get("mamba_n_heads", 128) != falcon_h1_mamba_width(hf):
            raise UnsupportedModelError("mamba_n_heads x mamba_d_head must be the Mamba width (mamba_d_ssm)")
    if family.bamba:
        for key in ("attention_bias", "mlp_bias"):
            if hf.get(key):
                raise UnsupportedModelError(f"{key}=True is not supported for Bamba (no release has these biases)")
    if family.name == "granitemoehybrid" or family.bamba:
        kinds = set(granite_layer_kinds(hf))
        if kinds - {"attention", "mamba"}:
            raise UnsupportedModelError(f"layer_types {sorted(set(hf['layer_types']))}: only attention and Mamba-2 "
                                        "(mamba / linear_attention) layers")
        if "mamba" in kinds:
            if hf.get("mamba_proj_bias"):
                raise UnsupportedModelError("mamba_proj_bias=True (biases on the Mamba-2 projections) is not supported "
                                            "(Granite 4.0-H has none)")
            d_head = granite_mamba_head_dim(hf)
            if d_head * hf.get("mamba_n_heads", 128) != hf.get("mamba_expand", 2) * hf["hidden_size"]:
                raise UnsupportedModelError(f"mamba_n_heads x mamba_d_head ({hf.get('mamba_n_heads', 128)} x "
                                            f"{d_head}) must be mamba_expand x hidden_size")
    if family.name == "olmoe" and hf.get("clip_qkv") is not None:
        raise UnsupportedModelError(f"clip_qkv={hf['clip_qkv']}: clamping q, k and v is not supported (OLMoE releases "
                                    "have none)")
    if family.moe and not family.sigmoid_router and not family.softmax_router and not family.gpt_oss \
            and not family.ernie and not family.hunyuan and not family.longcat and not family.granite \
            and not family.llama4 and family.name not in ("kolibri1", "laguna", "flint"):
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            raise UnsupportedModelError("MoE models with dense layers (decoder_sparse_step != 1 or mlp_only_layers) "
                                        "are not supported")
        if hf.get("shared_expert_intermediate_size") and not family.gated_delta and family.name != "qwen2_moe":
            raise UnsupportedModelError("shared experts are not supported by the qwen3_moe family")
    if family.mla:
        if hf.get("attention_bias"):
            raise UnsupportedModelError("attention_bias=True is not supported with multi-latent attention")
        if not hf.get("rope_interleave", True):
            raise UnsupportedModelError("rope_interleave=False is not supported: Megatron's multi-latent attention "
                                        "rotates interleaved channel pairs, as DeepSeek checkpoints do")
        if hf.get("num_key_value_heads", hf["num_attention_heads"]) != hf["num_attention_heads"]:
            raise UnsupportedModelError("multi-latent attention needs num_key_value_heads == num_attention_heads")
        if rope.attention_factor(hf.get("rope_scaling") or rope_parameters(hf)) != 1.0:
            raise UnsupportedModelError("YaRN with mscale != mscale_all_dim is not supported with multi-latent "
                                        "attention (its attention factor scales the rotated channels only)")
        wanted = "softmax" if family.softmax_router or family.longcat else "sigmoid"
        if hf.get("scoring_func", wanted) != wanted:
            raise UnsupportedModelError(f"scoring_func={hf['scoring_func']!r} is not supported ({family.name}: "
                                        f"{wanted} routers only)")
        if (hf.get("index_topk") or hf.get("index_n_heads")) and not family.dsa:
            raise UnsupportedModelError(f"an indexer (DeepSeek sparse attention) in a {family.name} config: the "
                                        "architecture DeepseekV32ForCausalLM / GlmMoeDsaForCausalLM has one")
        if family.dsa:
            if not hf.get("q_lora_rank"):
                raise UnsupportedModelError("DeepSeek sparse attention without a query latent (q_lora_rank)")
            types = set(indexer_types(hf))
            if not types <= {"full", "shared"}:
                raise UnsupportedModelError(f"indexer_types {sorted(types)}: only full and shared")
            for key in ("index_kpool", "mla_use_nope", "mhc", "linear_attn_config"):
                if hf.get(key):
                    raise UnsupportedModelError(f"{key}={hf[key]!r} is not supported (DeepSeek-V3.2 / GLM-5 sparse "
                                                "attention as transformers implements it only)")
    if family.kimi_delta:
        kinds = set(hf.get("layer_types") or [])
        if not kinds <= {"linear_attention", "full_attention"}:
            raise UnsupportedModelError(f"layer_types {sorted(kinds)}: only linear_attention and full_attention")
        if hf.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise UnsupportedModelError(f"moe_router_activation_func={hf['moe_router_activation_func']!r}: Kimi "
                                        "Linear's router is a sigmoid (as transformers computes it)")
    if family.minimax:
        if hf.get("qk_norm_type", "per_layer") != "per_layer" or not hf.get("use_qk_norm", True):
            raise UnsupportedModelError(f"qk_norm_type={hf.get('qk_norm_type')!r}, use_qk_norm="
                                        f"{hf.get('use_qk_norm')}: MiniMax-M2 models normalise q and k over all "
                                        "heads (per_layer), as transformers' and SGLang's implementations do")
        if hf.get("scoring_func", "sigmoid") != "sigmoid" or not hf.get("use_routing_bias", True):
            raise UnsupportedModelError(f"scoring_func={hf.get('scoring_func')!r}, use_routing_bias="
                                        f"{hf.get('use_routing_bias')}: only the sigmoid router with a score-"
                                        "correction bias (MiniMax-M2's) is supported")
        if hf.get("shared_intermediate_size") or hf.get("n_shared_experts"):
            raise UnsupportedModelError("shared experts are not supported by the minimax_m2 family")
        if any(t != 1 for t in hf.get("attn_type_list") or []):
            raise UnsupportedModelError("attn_type_list with linear (lightning) attention layers (MiniMax-01 / M1) "
                                        "is not supported: full attention only")
    if hf.get("attention_out_bias"):
        raise UnsupportedModelError("attention_out_bias=True is not supported (a bias on o_proj alone: Megatron's "
                                    "add_bias_linear would add the MLP's too)")
    if (family.olmo or family.gemma) and not family.gated_delta:
        kinds = set(layer_types(hf, family) or [])
        if not kinds <= set(LAYER_TYPES):
            raise UnsupportedModelError(f"layer_types {sorted(kinds)}: only sliding_attention and full_attention")
        if hf.get("clip_qkv"):
            raise UnsupportedModelError("clip_qkv (OLMo 1's clamped projections) is not supported")
    if family.gated_delta:
        if family.olmo and (hf.get("sliding_window") or hf.get("clip_qkv")):
            raise UnsupportedModelError("sliding_window / clip_qkv in an OLMo Hybrid config: its attention layers "
                                        "have neither")
        kinds = set(hf.get("layer_types") or [])
        if not kinds <= {"linear_attention", "full_attention"}:
            raise UnsupportedModelError(f"layer_types {sorted(kinds)}: only linear_attention and full_attention")
        if len(hf.get("layer_types") or []) != hf["num_hidden_layers"]:
            raise UnsupportedModelError("layer_types must name the kind of every one of num_hidden_layers layers")
        if hf.get("linear_num_value_heads", 1) % hf.get("linear_num_key_heads", 1):
            raise UnsupportedModelError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        # rope_parameters' mrope_section: a text token has the same position on mRoPE's three axes, so its
        # rotation is plain RoPE (partial_rotary_factor of each head)
    if family.name == "minicpm5_moe":
        if hf.get("use_gated_attention") is False:
            raise UnsupportedModelError("MiniCPM5-MoE with use_gated_attention=false is not supported (transformers "
                                        "refuses it too: every release gates its attention)")
    if family.name == "kolibri1":
        n = hf["num_hidden_layers"]
        types = hf.get("layer_types") or []
        if len(types) != n or not set(types) <= set(LAYER_TYPES):
            raise UnsupportedModelError(f"layer_types {sorted(set(types))}: one per layer ({n}), sliding_attention or "
                                        "full_attention")
        if not hf.get("shared_expert_intermediate_size"):
            raise UnsupportedModelError("a Kolibri config without shared_expert_intermediate_size is not supported "
                                        "(every release has a shared expert)")
    if family.name == "mellum":
        types = hf.get("layer_types") or ["full_attention"] * hf["num_hidden_layers"]
        if not set(types) <= set(LAYER_TYPES) or len(types) != hf["num_hidden_layers"]:
            raise UnsupportedModelError(f"layer_types {sorted(set(types))}: one per layer, sliding_attention or "
                                        "full_attention")
        mlp = hf.get("mlp_layer_types") or ["sparse"] * hf["num_hidden_layers"]
        if not set(mlp) <= {"dense", "sparse"} or len(mlp) != hf["num_hidden_layers"] or "sparse" not in mlp:
            raise UnsupportedModelError(f"mlp_layer_types {sorted(set(mlp))}: one per layer, dense or sparse, one "
                                        "sparse at least")
        factors = {float(rope_parameters(hf, t).get("partial_rotary_factor", 1.0)) for t in set(types)}
        if factors != {1.0}:  # (either kind's)
            raise UnsupportedModelError(f"partial_rotary_factor {sorted(factors)} in a Mellum config: each layer "
                                        "rotating its whole head is supported")
    if family.name == "dots1" and "sliding_attention" in (hf.get("layer_types") or []):
        raise UnsupportedModelError("dots.llm1 with sliding-window layers (sliding_window below max_window_layers' "
                                    "layers, or layer_types) is not supported: its releases attend fully")
    if family.sigmoid_router:
        topk, groups, group_topk = hf["num_experts_per_tok"], hf.get("n_group") or 1, hf.get("topk_group") or 1
        if family.minimax:
            groups = 1
        if groups > 1 and topk // group_topk != 2:
            raise UnsupportedModelError(f"n_group={groups} with num_experts_per_tok // topk_group != 2: HF scores a "
                                        "group by its top 2 experts, Megatron by its top topk // group_topk")
        if bool(hf.get("norm_topk_prob", True)) != (topk > 1):
            raise UnsupportedModelError(f"norm_topk_prob={hf.get('norm_topk_prob')} with num_experts_per_tok={topk} "
                                        "is not supported: Megatron's sigmoid router normalises the top-k scores "
                                        "exactly when k > 1")
        if hf.get("n_shared_experts", 1) < 1 and not family.minimax and not family.mimo and not family.lfm2:
            raise UnsupportedModelError(f"n_shared_experts=0 is not supported by the {family.name} family")
    if family.softmax_router:
        groups, group_topk = hf.get("n_group") or 1, hf.get("topk_group") or 1
        if family.name == "deepseek_v2":
            method = hf.get("topk_method") or "greedy"
            if method not in ("greedy", "group_limited_greedy"):
                raise UnsupportedModelError(f"topk_method={method!r}: DeepSeek-V2's router chooses greedy or "
                                            "group_limited_greedy")
            if method == "group_limited_greedy" and groups > 1 and (
                    hf["n_routed_experts"] % groups or not 1 <= group_topk <= groups
                    or hf["num_experts_per_tok"] > group_topk * (hf["n_routed_experts"] // groups)):
                raise UnsupportedModelError(f"topk_method=group_limited_greedy with n_group={groups}, topk_group="
                                            f"{group_topk}: the groups must divide the {hf['n_routed_experts']} "
                                            f"experts and the kept ones hold the top {hf['num_experts_per_tok']}")
            if hf.get("norm_topk_prob"):
                raise UnsupportedModelError("norm_topk_prob=true with DeepseekV2ForCausalLM: transformers keeps the "
                                            "top-k probabilities as they are whatever it says, SGLang renormalises "
                                            "them (the releases say false)")
            groups = 1  # (greedy: no grouping whatever n_group says)
        if groups > 1 and group_topk < groups:
            raise UnsupportedModelError(f"n_group={groups}, topk_group={group_topk}: group-limited softmax routing "
                                        "is not supported (transformers scores a group by its top 2 softmax "
                                        "probabilities; Mistral Small 4 has one group)")
        if hf.get("n_shared_experts", 1) < 1:
            raise UnsupportedModelError(f"n_shared_experts=0 is not supported by the {family.name} family")


def ernie_moe_fields(hf: dict) -> dict:
    """An ERNIE 4.5 MoE config's fields under one spelling (the released config.json writes ``moe_num_experts`` /
    ``moe_k``; transformers' config ``num_experts`` / ``num_experts_per_tok``), and its first MoE layer."""
    experts = hf.get("moe_num_experts", hf.get("num_experts"))
    if isinstance(experts, (list, tuple)):  # (the multimodal releases list one count per modality)
        raise UnsupportedModelError(f"moe_num_experts={experts!r}: one expert count (the text MoE models') only")
    return {"experts": int(experts), "topk": int(hf.get("moe_k", hf.get("num_experts_per_tok"))),
            "shared": int(hf.get("moe_num_shared_experts") or 0), "start": int(hf.get("moe_layer_start_index", 1)),
            "end": hf.get("moe_layer_end_index", -1), "interval": int(hf.get("moe_layer_interval", 1)),
            "norm_min": float(hf.get("moe_norm_min", 1e-12))}


def _refuse_unsupported_ernie(hf: dict, family: Family) -> None:
    if hf.get("use_bias"):
        raise UnsupportedModelError("use_bias=True (biases on every projection) is not supported: ERNIE 4.5 releases "
                                    "have none")
    if not family.moe:
        return
    f = ernie_moe_fields(hf)
    layers = hf["num_hidden_layers"]
    end = layers - 1 if f["end"] in (None, -1) else int(f["end"])
    if f["interval"] != 1 or end != layers - 1 or not 0 <= f["start"] < layers:
        raise UnsupportedModelError(f"moe_layer_start_index={f['start']}, moe_layer_end_index={f['end']}, "
                                    f"moe_layer_interval={f['interval']}: only dense first layers then MoE to the "
                                    "last layer (as released) are supported")
    if f["norm_min"] > 1e-6:
        raise UnsupportedModelError(f"moe_norm_min={f['norm_min']}: the router renormalises with a floor of 1e-12 "
                                    "(as released)")
    if hf.get("moe_use_aux_free") is False:
        raise UnsupportedModelError("moe_use_aux_free=False: the router's score-correction bias is what ERNIE 4.5 "
                                    "releases route with")


def _refuse_unsupported_hunyuan(hf: dict, family: Family) -> None:
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise UnsupportedModelError("attention_bias / mlp_bias: Hunyuan releases have no biases; not supported")
    if hf.get("use_qk_norm") is False:
        raise UnsupportedModelError("use_qk_norm=False: Hunyuan's attention normalises q and k after RoPE")
    if hf.get("use_cla"):
        raise UnsupportedModelError("use_cla=True (cross-layer attention: layers sharing keys and values, "
                                    "Hunyuan-Large) is not supported")
    if family.moe and hf.get("use_mixed_mlp_moe") is False:
        raise UnsupportedModelError("use_mixed_mlp_moe=False (experts without the shared MLP) is not supported")
    params = dict(hf.get("rope_scaling") or rope_parameters(hf) or {})
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "dynamic" and not params.get("alpha"):
        raise UnsupportedModelError("rope type 'dynamic' without 'alpha' (NTK scaling that changes with the length) "
                                    "is not supported; Hunyuan releases give a fixed alpha")
    if not family.moe:
        return
    for name in ("num_experts", "moe_topk"):
        if isinstance(hf.get(name), (list, tuple)) and len(set(hf[name])) != 1:
            raise UnsupportedModelError(f"{name}={hf[name]!r}: expert counts / top-k that differ between layers are "
                                        "not supported")
    for name, want in (("moe_intermediate_size", hf.get("intermediate_size")), ("num_shared_expert", 1)):
        value = hf.get(name)  # (remote-code configs write these; transformers reads neither)
        if value is not None and set(value if isinstance(value, (list, tuple)) else [value]) != {want}:
            raise UnsupportedModelError(f"{name}={value!r}: transformers' HunYuanMoEV1 has one shared MLP and "
                                        "experts of intermediate_size; other layouts are not supported")


def hunyuan_view(hf: dict) -> dict:
    """A Hunyuan config with its RoPE as transformers computes it: a fixed NTK ``alpha`` (``rope_parameters`` of type
    "dynamic" with "alpha") is plain RoPE of base theta * alpha ** (d / (d - 2)), d the head size."""
    params = dict(hf.get("rope_scaling") or rope_parameters(hf) or {})
    if (params.get("rope_type") or params.get("type")) != "dynamic" or not params.get("alpha"):
        return hf
    d = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    base = rope_theta(hf) * float(params["alpha"]) ** (d / (d - 2))
    view = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_theta")}
    view["rope_parameters"] = {"rope_type": "default", "rope_theta": base}
    return view


def gemma4_view(hf: dict) -> dict:
    """A Gemma 4 text config resolved as transformers resolves it (Gemma4TextConfig: the default layer kinds, the
    last layer forced global, each layer's head size and key heads from ``per_layer_config`` or ``global_head_dim`` /
    ``num_global_key_value_heads``), with ``gemma4_global``: the global layers' (head size, key heads)."""
    try:
        from transformers import Gemma4TextConfig
    except ImportError as exc:
        raise UnsupportedModelError("Gemma 4 needs a transformers with Gemma4TextConfig (5.x)") from exc

    c = Gemma4TextConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type", "auto_map")})
    types = list(c.layer_types)
    geometry = [(c.per_layer_config[i].head_dim, c.per_layer_config[i].num_key_value_heads) for i in range(len(types))]
    kinds = {}
    for kind, shape in zip(types, geometry):
        if kinds.setdefault(kind, shape) != shape:
            raise UnsupportedModelError(f"Gemma 4 {kind} layers of different shapes ({kinds[kind]} and {shape} "
                                        "(head_dim, key heads)): one shape per kind of layer only")
    declared = (hf.get("head_dim", 256), hf.get("num_key_value_heads", 4))  # (Gemma4TextConfig's defaults)
    local = kinds.get("sliding_attention", declared)
    if local != declared:
        raise UnsupportedModelError(f"Gemma 4 sliding layers of shape {local}, the config says {declared} "
                                    "(head_dim, num_key_value_heads)")
    return {**hf, "head_dim": local[0], "num_key_value_heads": local[1], "layer_types": types,
            "gemma4_global": kinds.get("full_attention", local), "rope_parameters": dict(c.rope_parameters),
            "sliding_window": c.sliding_window,
            "final_logit_softcapping": c.final_logit_softcapping,
            "hidden_size_per_layer_input": c.hidden_size_per_layer_input,
            "num_kv_shared_layers": c.num_kv_shared_layers, "enable_moe_block": c.enable_moe_block,
            "num_experts": c.num_experts, "top_k_experts": c.top_k_experts,
            "moe_intermediate_size": c.moe_intermediate_size, "attention_k_eq_v": c.attention_k_eq_v,
            "vocab_size_per_layer_input": c.vocab_size_per_layer_input,
            "use_double_wide_mlp": c.use_double_wide_mlp,
            "gemma4_kv_shared_from": _gemma4_kv_sources(types, c.num_kv_shared_layers)}


def _gemma4_kv_sources(types: list[str], shared: int) -> tuple[int | None, ...]:
    """For each layer, the layer whose keys and values it reuses (transformers' kv_sharing_modes): the last
    ``shared`` layers take them from the last earlier layer of their kind; None for the others."""
    first = len(types) - shared
    out = []
    for i, kind in enumerate(types):
        if i < first or not shared:
            out.append(None)
            continue
        sources = [j for j in range(first) if types[j] == kind]
        if not sources:
            raise UnsupportedModelError(f"Gemma 4 layer {i} ({kind}) shares keys and values, but no earlier layer of "
                                        "its kind has its own")
        out.append(sources[-1])
    return tuple(out)


def kimi_linear_view(hf: dict) -> dict:
    """A Kimi Linear config (its own field names, or transformers') with the names the DeepSeek-V3 code paths read,
    resolved by transformers' config class (its aliases, ``linear_attn_config``, the default layer kinds)."""
    try:
        from transformers import KimiLinearConfig
    except ImportError as exc:  # its config's names and layer kinds are read the way transformers reads them
        raise UnsupportedModelError("Kimi Linear needs a transformers with KimiLinearConfig (5.x)") from exc

    keys = set(KimiLinearConfig.__dataclass_fields__) | set(KimiLinearConfig.attribute_map) | \
        set(KimiLinearConfig.attribute_map.values()) | {"linear_attn_config", "first_k_dense_replace"}
    c = KimiLinearConfig.from_dict({k: v for k, v in hf.items() if k in keys and k != "architectures"})
    return {**hf, "n_routed_experts": c.num_local_experts, "num_experts_per_tok": c.num_experts_per_tok,
            "n_shared_experts": c.n_shared_experts, "n_group": c.n_group, "topk_group": c.topk_group,
            "norm_topk_prob": c.norm_topk_prob, "max_position_embeddings": c.max_position_embeddings,
            "layer_types": list(c.layer_types), "mlp_layer_types": list(c.mlp_layer_types),
            "linear_num_heads": c.linear_num_heads, "linear_head_dim": c.linear_head_dim,
            "linear_conv_kernel_dim": c.linear_conv_kernel_dim, "q_lora_rank": c.q_lora_rank,
            "routed_scaling_factor": c.routed_scaling_factor}


def mimo_view(hf: dict) -> dict:
    """A MiMo-V2-Flash config, as released (``hybrid_layer_pattern``, ``swa_*``, ``moe_layer_freq``,
    ``sliding_window_size``, ``add_*_attention_sink_bias``, ``layernorm_epsilon``, ``rope_theta`` /
    ``swa_rope_theta``) or as transformers writes it (``layer_types``, ``mlp_layer_types``, ``rope_parameters`` per kind
    of layer), read into: ``layer_types``, ``mlp_layer_types``, ``sliding_window`` (keys a query sees, itself
    included), ``mimo_kv_heads`` (full, sliding), ``mimo_sinks`` (full, sliding), ``mimo_rope`` (full base, sliding
    base, rotated fraction), ``rms_norm_eps``; anything transformers' model would compute otherwise is refused."""
    n, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    if hf.get("layer_types"):
        types = list(hf["layer_types"])
    elif hf.get("hybrid_layer_pattern") is not None:  # 1: sliding window
        types = ["sliding_attention" if x else "full_attention" for x in hf["hybrid_layer_pattern"]]
    else:  # transformers' default: the first layer and every sixth full
        types = ["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
    if hf.get("mlp_layer_types"):
        mlp = list(hf["mlp_layer_types"])
    elif hf.get("moe_layer_freq") is not None and not isinstance(hf["moe_layer_freq"], int):
        mlp = ["sparse" if x else "dense" for x in hf["moe_layer_freq"]]
    else:
        mlp = ["dense"] + ["sparse"] * (n - 1)
    if len(types) != n or len(mlp) != n or set(types) - set(LAYER_TYPES):
        raise UnsupportedModelError(f"MiMo-V2-Flash: {len(types)} layer kinds and {len(mlp)} MLP kinds for {n} layers")
    kv = int(hf.get("num_key_value_heads") or heads)
    for field, want in (("swa_num_attention_heads", heads), ("swa_head_dim", hf.get("head_dim")),
                        ("swa_v_head_dim", hf.get("v_head_dim"))):
        if hf.get(field) is not None and hf[field] != want:
            raise UnsupportedModelError(f"MiMo-V2-Flash: {field}={hf[field]} differs from the full-attention layers' "
                                        f"{want} (transformers builds both kinds alike)")
    if (hf.get("scoring_func") or "sigmoid") != "sigmoid" or hf.get("n_shared_experts"):
        raise UnsupportedModelError("MiMo-V2-Flash: a sigmoid router (scoring_func) without shared experts is "
                                    "supported")
    params = hf.get("rope_parameters") or {}
    full, sliding = rope_parameters(hf, "full_attention"), rope_parameters(hf, "sliding_attention")
    for kind in (full, sliding):
        if kind.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"MiMo-V2-Flash: RoPE of type {kind['rope_type']!r} is not supported")
    if not any(t in params for t in LAYER_TYPES):  # (as released: one base per kind, one fraction)
        full = {"rope_theta": hf.get("rope_theta", 5e6), "partial_rotary_factor": hf.get("partial_rotary_factor")}
        sliding = {**full, "rope_theta": hf.get("swa_rope_theta", 1e4)}
    fractions = {float(k.get("partial_rotary_factor") or 0.334) for k in (full, sliding)}
    if len(fractions) != 1:
        raise UnsupportedModelError(f"MiMo-V2-Flash: rotated fractions {sorted(fractions)} differ by layer kind")
    window = hf["sliding_window_size"] + 1 if hf.get("sliding_window_size") is not None else hf.get("sliding_window")
    return {**hf, "layer_types": types, "mlp_layer_types": mlp, "sliding_window": int(window or 0),
            "mimo_kv_heads": (kv, int(hf.get("swa_num_key_value_heads") or 2 * kv)),
            "mimo_sinks": (bool(hf.get("add_full_attention_sink_bias", False)),
                           bool(hf.get("add_swa_attention_sink_bias", True))),
            "mimo_rope": (float(full.get("rope_theta") or 5e6), float(sliding.get("rope_theta") or 1e4),
                          fractions.pop()),
            "rms_norm_eps": hf.get("rms_norm_eps") or hf.get("layernorm_epsilon") or 1e-5,
            "routed_scaling_factor": hf.get("routed_scaling_factor") or 1.0, "n_shared_experts": 0}


def olmo_hybrid_rope_theta(hf: dict) -> float | None:
    """OLMo Hybrid's RoPE base as transformers reads the config (its model rotates nothing where this is None: the
    released checkpoints'); transformers' own config class resolves the defaults where it has one."""
    try:
        from transformers import OlmoHybridConfig
    except ImportError:  # transformers before OLMo Hybrid: the rule it follows, read off the dict
        params = hf.get("rope_parameters")
        if "rope_theta" in hf or (isinstance(params, dict) and "rope_theta" in params):
            return hf.get("rope_theta") if "rope_theta" in hf else params["rope_theta"]
        return 10000.0
    keys = {k: hf[k] for k in ("rope_parameters", "rope_theta", "rope_scaling") if k in hf}
    return (OlmoHybridConfig.from_dict(keys).rope_parameters or {}).get("rope_theta")


def _softmax_router(hf: dict, scaling: float) -> dict:
    """Mistral Small 4's router: p = softmax(z) over all experts, the top k kept, renormalised with
    ``norm_topk_prob`` (= Megatron's softmax of the top-k logits) or not (= Megatron's pre-softmax top-k), times
    ``routed_scaling_factor``; no score-correction bias. Its logits are computed in the weights' dtype, as
    transformers does."""
    return {"moe_router_score_function": "softmax",
            "moe_router_topk_scaling_factor": scaling if scaling != 1.0 else None}


MINIMAX_M3_INDEX = {"index_n_heads": ("sparse_num_index_heads", 4), "index_head_dim": ("sparse_index_dim", 128),
                    "index_block_size": ("sparse_block_size", 128), "index_topk_blocks": ("sparse_topk_blocks", 16),
                    "index_local_blocks": ("sparse_local_block", 1)}
"""MiniMax-M3's indexer fields as transformers names them: (the release's name in ``sparse_attention_config``, the
default)."""


def minimax_m3_view(hf: dict) -> dict:
    """A MiniMax-M3 language model's config, as released (``sparse_attention_config``, ``moe_layer_freq``,
    ``hidden_act: swigluoai``, ``rope_theta`` / ``partial_rotary_factor`` / ``rotary_dim``) or as transformers writes it
    (``layer_types``, ``mlp_layer_types``, ``index_*``, ``rope_parameters``), read into ``layer_types``,
    ``mlp_layer_types``, the ``index_*`` fields, ``first_k_dense_replace``, ``partial_rotary_factor`` and
    ``rope_theta``; anything transformers' model would compute otherwise is refused."""
    n = hf["num_hidden_layers"]
    sparse = dict(hf.get("sparse_attention_config") or {})
    if hf.get("layer_types"):
        types = list(hf["layer_types"])
    elif sparse.get("sparse_attention_freq") is not None:
        types = ["minimax_m3_sparse" if f else "full_attention" for f in sparse["sparse_attention_freq"]]
    else:
        types = ["full_attention"] * n
    if len(types) != n or not set(types) <= {"full_attention", "minimax_m3_sparse"}:
        raise UnsupportedModelError(f"layer_types {types}: one per layer ({n}), full_attention or minimax_m3_sparse")
    if sparse.get("use_sparse_attention") is False and "minimax_m3_sparse" in types:
        raise UnsupportedModelError("sparse_attention_config says use_sparse_attention=false beside sparse layers "
                                    "(sparse_attention_freq): transformers would still run them sparse")
    index_value = sparse.get("sparse_disable_index_value")
    if index_value is not None and any(t == "minimax_m3_sparse" and not v for t, v in zip(types, index_value)):
        raise UnsupportedModelError("sparse_disable_index_value=0 on a sparse layer (the indexer's value path) is not "
                                    "supported: transformers implements the released layers, whose value path is off")
    if hf.get("mlp_layer_types"):
        mlp = list(hf["mlp_layer_types"])
    elif hf.get("moe_layer_freq") is not None:
        mlp = ["sparse" if f else "dense" for f in hf["moe_layer_freq"]]
    else:
        mlp = ["sparse"] * n
    index = {flat: sparse[legacy] if legacy in sparse else hf.get(flat, default)
             for flat, (legacy, default) in MINIMAX_M3_INDEX.items()}
    act = hf.get("hidden_act") or "silu"
    if act not in ("swigluoai", "silu"):  # (transformers writes silu, the SwiGLU-OAI gate computed inline)
        raise UnsupportedModelError(f"hidden_act {act!r}: MiniMax-M3's MLPs are SwiGLU-OAI (swigluoai) only")
    if float(hf.get("swiglu_alpha", 1.702)) != 1.702:
        raise UnsupportedModelError(f"swiglu_alpha={hf['swiglu_alpha']} is not supported (Megatron's quick_gelu uses "
                                    "1.702, MiniMax-M3's value)")
    if hf.get("qk_norm_type", "per_head") != "per_head" or hf.get("use_qk_norm") is False:
        raise UnsupportedModelError(f"qk_norm_type={hf.get('qk_norm_type')!r}, use_qk_norm={hf.get('use_qk_norm')}: "
                                    "MiniMax-M3 normalises each query / key head (per_head), as transformers does")
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("use_routing_bias") is False:
        raise UnsupportedModelError(f"scoring_func={hf.get('scoring_func')!r}, use_routing_bias="
                                    f"{hf.get('use_routing_bias')}: only the sigmoid router with a score-correction "
                                    "bias (MiniMax-M3's) is supported")
    if hf.get("n_shared_experts", 1) != 1 or not hf.get("shared_intermediate_size", 3072):
        raise UnsupportedModelError(f"n_shared_experts={hf.get('n_shared_experts')}, shared_intermediate_size="
                                    f"{hf.get('shared_intermediate_size')}: MiniMax-M3's MoE layers have one shared "
                                    "expert (transformers builds one whatever n_shared_experts says)")
    if index["index_n_heads"] != hf["num_key_value_heads"]:
        raise UnsupportedModelError(f"index_n_heads={index['index_n_heads']} with {hf['num_key_value_heads']} key "
                                    "heads: the indexer chooses blocks per key head (one indexer head each)")
    params = rope_parameters(hf)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default" or hf.get("rope_scaling"):
        raise UnsupportedModelError(f"RoPE {kind!r}: MiniMax-M3's RoPE is plain (default)")
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    rotary_dim = hf.get("rotary_dim")
    if rotary_dim is not None and int(head_dim * float(factor or 1.0)) != int(rotary_dim):
        raise UnsupportedModelError(
            f"rotary_dim={rotary_dim} with partial_rotary_factor={factor} (heads of {head_dim}): transformers rotates "
            f"{int(head_dim * float(factor or 1.0))} channels of each head, rotary_dim says {rotary_dim}; give "
            f"partial_rotary_factor {rotary_dim / head_dim} (as MiniMax-M3's release does) so that both agree")
    out = {**hf, **index, "layer_types": types, "mlp_layer_types": mlp, "hidden_act": "silu",
           "partial_rotary_factor": float(factor or 1.0), "rope_theta": rope_theta(hf), "norm_topk_prob": True,
           "num_key_value_heads": hf["num_key_value_heads"]}
    out["first_k_dense_replace"] = dense_layers(out)
    if index["index_local_blocks"] > index["index_topk_blocks"] or index["index_head_dim"] < int(
            head_dim * out["partial_rotary_factor"]):
        raise UnsupportedModelError(f"index_local_blocks={index['index_local_blocks']} must not exceed "
                                    f"index_topk_blocks={index['index_topk_blocks']}, and index_head_dim "
                                    f"({index['index_head_dim']}) must hold the rotated channels")
    return out


_NEMOTRON_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe", "mamba": "mamba", "linear_attention": "mamba",
                   "attention": "attention", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}


def nemotron_h_kinds(hf: dict) -> list[str]:
    """Nemotron-H's layers as mamba / attention / mlp / moe: ``layers_block_type`` (or ``layer_types``) as
    transformers writes it, else the released ``hybrid_override_pattern`` (M, *, -, E)."""
    types = hf.get("layers_block_type") or hf.get("layer_types") or list(hf.get("hybrid_override_pattern") or "")
    if not types:
        raise UnsupportedModelError("a Nemotron-H config needs hybrid_override_pattern or layers_block_type")
    unknown = sorted({str(t) for t in types} - set(_NEMOTRON_KINDS))
    if unknown:
        raise UnsupportedModelError(f"Nemotron-H layer kinds {unknown}: only M / * / - / E (mamba, attention, mlp, "
                                    "moe)")
    return [_NEMOTRON_KINDS[t] for t in types]


def nemotron_h_view(hf: dict) -> dict:
    """Nemotron-H's config under the names the generic translation reads: its layer count and kinds, the norms'
    epsilon, the MLP and the expert fields (DeepSeek-V3's names for the router)."""
    kinds = nemotron_h_kinds(hf)
    for act, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if hf.get(act, want) != want:
            raise UnsupportedModelError(f"{act}={hf[act]!r} is not supported (Nemotron-H's is {want})")
    for key in ("attention_bias", "mlp_bias", "mamba_proj_bias", "sliding_window"):
        if hf.get(key):
            raise UnsupportedModelError(f"{key}={hf[key]!r} is not supported by the nemotron_h family (its released "
                                        "models have none)")
    return {**hf, "num_hidden_layers": len(kinds), "nemotron_kinds": kinds,
            "rms_norm_eps": hf.get("layer_norm_epsilon", 1e-5), "hidden_act": "silu",
            "n_shared_experts": hf.get("n_shared_experts", 1) or 1}


def flint_view(hf: dict) -> dict:
    """Flint's config with what transformers fills in: ``layer_types`` (full attention for the first two layers, every
    fourth from layer 1 and the last; sliding windows for the others) and which layers are MoE (``flint_moe_layers``:
    not in ``mlp_only_layers``, default [0, 1], and every ``decoder_sparse_step``-th)."""
    n = hf["num_hidden_layers"]
    out = dict(hf)
    out["layer_types"] = list(hf.get("layer_types") or [
        "full_attention" if i < 2 or i % 4 == 1 or i == n - 1 else "sliding_attention" for i in range(n)])
    dense = set(hf["mlp_only_layers"] if hf.get("mlp_only_layers") is not None else [0, 1])
    step = int(hf.get("decoder_sparse_step") or 1)
    out["flint_moe_layers"] = [i not in dense and (i + 1) % step == 0 for i in range(n)]
    return out


def _refuse_unsupported_flint(hf: dict) -> None:
    """What forge's Flint layers do not build, by name."""
    n = hf["num_hidden_layers"]
    if len(hf["layer_types"]) != n or not set(hf["layer_types"]) <= {"full_attention", "sliding_attention"}:
        raise UnsupportedModelError(f"layer_types {hf['layer_types']}: full_attention or sliding_attention per layer")
    if not any(hf["flint_moe_layers"]):
        raise UnsupportedModelError("no MoE layer (mlp_only_layers / decoder_sparse_step leave none)")
    if not hf.get("norm_topk_prob", True):
        raise UnsupportedModelError("norm_topk_prob=False: Megatron renormalises a sigmoid router's top k")
    if rope_scaling(hf) is not None:
        raise UnsupportedModelError("scaled RoPE in a Flint config is not supported")


def laguna_view(hf: dict) -> dict:
    """Laguna's config with what transformers fills in: every layer full attention, the first layer dense, every layer
    ``num_attention_heads`` query heads, the RoPE of each kind (full: base 500k over half the head; sliding: base 10k
    over all of it)."""
    n = hf["num_hidden_layers"]
    out = dict(hf)
    out["layer_types"] = list(hf.get("layer_types") or ["full_attention"] * n)
    out["mlp_layer_types"] = list(hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1))
    out["num_attention_heads_per_layer"] = list(hf.get("num_attention_heads_per_layer") or
                                                [hf["num_attention_heads"]] * n)
    if not hf.get("rope_parameters"):
        out["rope_parameters"] = {
            "full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}
    return out


def _refuse_unsupported_laguna(hf: dict) -> None:
    """What forge's Laguna layers do not build, by name."""
    n = hf["num_hidden_layers"]
    for key, kinds in (("layer_types", {"full_attention", "sliding_attention"}), ("mlp_layer_types",
                                                                                 {"dense", "sparse"})):
        if len(hf[key]) != n or not set(hf[key]) <= kinds:
            raise UnsupportedModelError(f"{key} {hf[key]}: one of {sorted(kinds)} per layer ({n})")
    if "sparse" not in hf["mlp_layer_types"]:
        raise UnsupportedModelError("mlp_layer_types without a sparse layer: a Laguna model has experts")
    if len(hf["num_attention_heads_per_layer"]) != n:
        raise UnsupportedModelError(f"num_attention_heads_per_layer has {len(hf['num_attention_heads_per_layer'])} "
                                    f"entries for {n} layers")
    if hf.get("gating", True) not in (True, False, "per-head", "per-element"):
        raise UnsupportedModelError(f"gating={hf['gating']!r}: True / 'per-head', 'per-element' or False")
    if float(hf.get("moe_router_logit_softcapping") or 0.0) > 0.0:
        raise UnsupportedModelError("moe_router_logit_softcapping > 0 (the router's logits capped by tanh before the "
                                    "sigmoid) is not supported for Laguna")
    if hf.get("moe_apply_router_weight_on_input"):
        raise UnsupportedModelError("moe_apply_router_weight_on_input=True is not supported (transformers refuses it "
                                    "too)")
    if hf.get("attention_bias"):
        raise UnsupportedModelError("attention_bias=True is not supported for Laguna (Megatron would bias the "
                                    "experts' projections with o_proj)")
    for kind in ("full_attention", "sliding_attention"):
        params = rope_parameters(hf, kind)
        if params.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"{kind} layers' rope_type {params['rope_type']!r}: Laguna's RoPE is plain")
    if "sliding_attention" in hf["layer_types"]:
        if not hf.get("sliding_window"):
            raise UnsupportedModelError("sliding_attention layers without a sliding_window are not supported")
        if float(rope_parameters(hf, "sliding_attention").get("partial_rotary_factor", 1.0)) != 1.0:
            raise UnsupportedModelError("sliding_attention layers' partial_rotary_factor != 1: forge's sliding layers "
                                        "rotate whole heads (the model's table)")


def minimax01_view(hf: dict) -> dict:
    """MiniMax-Text-01 / M1's config under transformers' names: each layer's kind (``layer_types``; the releases'
    ``attn_type_list``, 0 lightning, 1 softmax attention) and the residual scales (``{full_attn,linear_attn,mlp}_
    {alpha,beta}_factor``; the releases' ``layernorm_{full_attention,linear_attention,mlp}_{alpha,beta}``)."""
    n = hf["num_hidden_layers"]
    out = dict(hf)
    if not hf.get("layer_types"):
        codes = hf.get("attn_type_list") or hf.get("decoder_attention_types")
        if codes is not None:
            if len(codes) != n or not set(codes) <= {0, 1}:
                raise UnsupportedModelError(f"attn_type_list {codes}: 0 (lightning) or 1 (softmax attention), one per "
                                            f"layer ({n})")
            out["layer_types"] = ["linear_attention" if c == 0 else "full_attention" for c in codes]
        elif hf.get("model_type") == "minimax":  # (transformers' default: every other layer, the first full)
            out["layer_types"] = ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(n)]
        else:  # (the engines' default without a list: every layer softmax attention)
            out["layer_types"] = ["full_attention"] * n
    experts = hf.get("num_local_experts")
    if isinstance(experts, (list, tuple)):  # (the releases' format allows one count per layer)
        if len(set(experts)) != 1:
            raise UnsupportedModelError(f"num_local_experts per layer {experts}: forge builds one expert count")
        out["num_local_experts"] = experts[0]
    for kind, release in (("full_attn", "full_attention"), ("linear_attn", "linear_attention"), ("mlp", "mlp")):
        for which in ("alpha", "beta"):
            if f"{kind}_{which}_factor" not in hf and f"layernorm_{release}_{which}" in hf:
                out[f"{kind}_{which}_factor"] = hf[f"layernorm_{release}_{which}"]
    return out


def _refuse_unsupported_minimax01(hf: dict) -> None:
    """What forge's MiniMax-01 layers do not build, by name."""
    types = hf["layer_types"]
    if len(types) != hf["num_hidden_layers"] or not set(types) <= {"linear_attention", "full_attention"}:
        raise UnsupportedModelError(f"layer_types {types}: linear_attention or full_attention, one per layer")
    if hf.get("model_type") != "minimax" and not hf.get("postnorm", False):
        raise UnsupportedModelError("postnorm=False (residuals from the layers' inputs, scaled): no MiniMax-01 / M1 "
                                    "release has it; forge builds the released residuals from the norms' outputs")
    shared = hf.get("shared_intermediate_size") or 0
    if (max(shared) if isinstance(shared, (list, tuple)) else shared) > 0:
        raise UnsupportedModelError("shared_intermediate_size > 0 (a shared MLP mixed in by a learned coefficient) is "
                                    "not supported for MiniMax-01 (no release has it)")
    if hf.get("sliding_window"):
        raise UnsupportedModelError("sliding_window in a MiniMax-01 config (transformers would window the softmax "
                                    "layers, the engines would not) is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act={hf['hidden_act']!r}: MiniMax-01's experts and lightning layers use "
                                    "silu")


def lfm2_view(hf: dict) -> dict:
    """LFM2's config under the generic names: each layer's kind (``layer_types``, or ``full_attn_idxs``), the
    norms' epsilon, the MLP width its MLP derives."""
    n = hf["num_hidden_layers"]
    lfm3 = hf.get("model_type") == "lfm3"
    types = hf.get("layer_types")
    if types is None and lfm3:  # (transformers' default: layer 2 of every 4 full, layer 0 of every 4 but the first
        # sliding, the others convolutions)
        types = ["full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i > 0 else "conv"
                 for i in range(n)]
    if types is None:
        full = set(hf.get("full_attn_idxs") or range(n))
        types = ["full_attention" if i in full else "conv" for i in range(n)]
    kinds = {"conv", "full_attention"} | ({"sliding_attention"} if lfm3 else set())
    if len(types) != n or set(types) - kinds:
        raise UnsupportedModelError(f"layer_types {types}: {' or '.join(sorted(kinds))}, one per layer ({n})")
    width = hf["intermediate_size"]
    moe = hf.get("model_type") == "lfm2_moe" or "num_experts" in hf
    if hf.get("block_auto_adjust_ff_dim", not moe and not lfm3):  # as transformers' Lfm2MLP derives it (LFM2-MoE's
        # and LFM3's MLPs: as given)
        width = int(2 * width / 3)
        if hf.get("block_ffn_dim_multiplier") is not None:
            multiple = int(hf.get("block_multiple_of", 256))
            width = int(hf["block_ffn_dim_multiplier"] * width)
            width = multiple * ((width + multiple - 1) // multiple)
    out = {**hf, "layer_types": list(types), "intermediate_size": width, "rms_norm_eps": hf.get("norm_eps", 1e-5),
           "tie_word_embeddings": hf.get("tie_word_embeddings", hf.get("tie_embedding", True))}
    if moe:  # LFM2-MoE's experts under DeepSeek-V3's names (no shared expert, no groups)
        if not hf.get("use_expert_bias", True):
            raise UnsupportedModelError("use_expert_bias=False: LFM2-MoE's router without its bias is not supported "
                                        "(the releases have it)")
        out.update(n_routed_experts=hf["num_experts"], n_shared_experts=0,
                   first_k_dense_replace=int(hf.get("num_dense_layers", 2)), n_group=1, topk_group=1)
    return out


def granite_layer_kinds(hf: dict) -> list[str]:
    """Granite 4.0's layers as "attention" or "mamba" (``layer_types``: attention / full_attention, mamba /
    linear_attention as transformers writes them; without any, every layer is Mamba-2, as transformers builds it;
    Bamba's ``attn_layer_indices``: those layers attention, the others Mamba-2)."""
    n = hf["num_hidden_layers"]
    indices = hf.get("attn_layer_indices")
    types = hf.get("layer_types") or hf.get("layers_block_type") or \
        ["full_attention" if indices and i in indices else "linear_attention" for i in range(n)]
    kinds = {"attention": "attention", "full_attention": "attention", "mamba": "mamba", "linear_attention": "mamba"}
    if len(types) != hf["num_hidden_layers"]:
        raise UnsupportedModelError(f"layer_types has {len(types)} entries for {hf['num_hidden_layers']} layers")
    return [kinds.get(t, t) for t in types]


def _json_float(x) -> float:
    """A float of a config.json: a number, or transformers' spelling of one JSON has none ({"__float__": "Infinity"})."""
    return float(x["__float__"]) if isinstance(x, dict) and "__float__" in x else float(x)


def mamba2_fields(kinds: list[str], groups, heads, state, head_dim, kernel, conv_bias, limit) -> dict:
    """GPTConfig's Mamba-2 fields (mcore/mamba2.py) for the layers ``kinds`` marks "mamba": its groups, heads, state
    and head sizes as the linear-attention sizes, the convolution's taps and bias, the time step's clamp
    (``time_step_limit``; (0, inf) is none)."""
    limit = tuple(_json_float(x) for x in limit) if limit else None
    return dict(linear_attention=tuple(k == "mamba" for k in kinds), linear_attention_kind="mamba2",
                linear_num_key_heads=int(groups), linear_num_value_heads=int(heads), linear_key_head_dim=int(state),
                linear_value_head_dim=int(head_dim), linear_conv_kernel=int(kernel), mamba_conv_bias=bool(conv_bias),
                mamba_dt_limit=None if limit is None or limit == (0.0, float("inf")) else limit)


def afmoe_layer_types(hf: dict) -> list[str]:
    """AFMoE's layer kinds: ``layer_types``, or every ``global_attn_every_n_layers``-th layer full attention, the
    others sliding windows, as transformers builds them."""
    n = int(hf.get("global_attn_every_n_layers") or 4)
    return list(hf.get("layer_types") or ["sliding_attention" if (i + 1) % n else "full_attention"
                                          for i in range(hf["num_hidden_layers"])])


def falcon_h1_mamba_width(hf: dict) -> int:
    """Falcon-H1's Mamba-2 width: ``mamba_d_ssm``, or mamba_expand x hidden_size."""
    return int(hf.get("mamba_d_ssm") or hf.get("mamba_expand", 2) * hf["hidden_size"])


def falcon_h1_mamba_head_dim(hf: dict) -> int:
    """Falcon-H1's Mamba-2 head size: ``mamba_d_head``, or for "auto" its width / heads."""
    d_head = hf.get("mamba_d_head", "auto")
    return falcon_h1_mamba_width(hf) // hf.get("mamba_n_heads", 128) if d_head in (None, "auto") else int(d_head)


def granite_mamba_head_dim(hf: dict) -> int:
    """Granite 4.0's Mamba-2 head size: ``mamba_d_head``, or for "auto" mamba_expand x hidden_size / heads."""
    d_head = hf.get("mamba_d_head", "auto")
    if d_head in (None, "auto"):
        return hf.get("mamba_expand", 2) * hf["hidden_size"] // hf.get("mamba_n_heads", 128)
    return int(d_head)


def exaone_view(hf: dict) -> dict:
    """EXAONE 4.0 / K-EXAONE's config with each layer's kind in ``layer_types`` (from ``sliding_window_pattern``
    where the config gives none: every n-th layer global, or a string of L (sliding) and G (global) repeated; every
    layer global without a window) and K-EXAONE's expert fields under DeepSeek-V3's names."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    pattern = hf.get("sliding_window_pattern")
    if not hf.get("sliding_window"):
        types = ["full_attention"] * n  # (transformers: no window, every layer rotates and sees everything)
    elif types is None and isinstance(pattern, str):
        if not pattern or set(pattern) - {"L", "G"}:
            raise UnsupportedModelError(f"sliding_window_pattern={pattern!r}: a string of L (sliding) and G (global)")
        types = ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention" for i in range(n)]
    elif types is None:
        every = int(pattern or 4)
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    if len(types) != n or not set(types) <= set(LAYER_TYPES):
        raise UnsupportedModelError(f"layer_types {types}: one of {LAYER_TYPES} per layer ({n})")
    out = {**hf, "layer_types": list(types)}
    if "num_experts" in hf:  # K-EXAONE
        out.update(n_routed_experts=hf["num_experts"], n_shared_experts=hf.get("num_shared_experts", 1))
    return out


def longcat_view(hf: dict) -> dict:
    """A LongCat-Flash config (as released and as transformers writes it: ``num_layers`` layers of two sublayers each,
    ``ffn_hidden_size``, ``expert_ffn_hidden_size``, ``n_routed_experts``, ``moe_topk``, ``zero_expert_num``) read into
    ``num_hidden_layers`` (Megatron's layers: twice ``num_layers``), ``intermediate_size``, ``moe_intermediate_size``
    and ``num_experts_per_tok``; anything transformers' model would compute otherwise is refused by name."""
    layers = hf.get("num_layers")
    if layers is None:  # (a config naming Megatron's count: transformers' num_hidden_layers property)
        if hf.get("num_hidden_layers", 1) % 2:
            raise UnsupportedModelError(f"LongCat-Flash config without num_layers and an odd num_hidden_layers "
                                        f"({hf.get('num_hidden_layers')}): each layer has two sublayers")
        layers = hf["num_hidden_layers"] // 2
    if hf.get("attention_method", "MLA") != "MLA":
        raise UnsupportedModelError(f"attention_method={hf['attention_method']!r}: LongCat-Flash's attention is "
                                    "multi-latent attention (MLA) only")
    if hf.get("zero_expert_type", "identity") != "identity":
        raise UnsupportedModelError(f"zero_expert_type={hf['zero_expert_type']!r}: only identity zero-computation "
                                    "experts (LongCat-Flash's) are supported")
    if hf.get("router_bias"):
        raise UnsupportedModelError("router_bias=True: transformers builds the router's bias and never adds it, "
                                    "inference engines add it; LongCat-Flash's releases have none")
    if hf.get("norm_topk_prob"):
        raise UnsupportedModelError("norm_topk_prob=True: transformers' LongCat-Flash router never renormalises its "
                                    "top-k weights; LongCat-Flash's releases do not either")
    for key in ("mla_scale_q_lora", "mla_scale_kv_lora"):
        if hf.get(key) is False:
            raise UnsupportedModelError(f"{key}=false: transformers scales the LoRA latents whatever the config says, "
                                        "inference engines follow the flag; LongCat-Flash's releases scale both")
    if not hf.get("q_lora_rank"):
        raise UnsupportedModelError("LongCat-Flash without a query latent (q_lora_rank) is not supported")
    qk = int(hf.get("qk_nope_head_dim", 128)) + int(hf.get("qk_rope_head_dim", 64))
    if hf.get("qk_head_dim") not in (None, qk):
        raise UnsupportedModelError(f"qk_head_dim={hf['qk_head_dim']}: it must be qk_nope_head_dim + qk_rope_head_dim "
                                    f"({qk})")
    params = rope_parameters(hf)
    if (params.get("rope_type") or params.get("type") or "default") != "default" or hf.get("rope_scaling"):
        raise UnsupportedModelError("RoPE scaling is not supported for LongCat-Flash (its releases rotate plainly)")
    return {**hf, "num_hidden_layers": 2 * int(layers), "intermediate_size": hf.get("ffn_hidden_size", 12288),
            "moe_intermediate_size": hf.get("expert_ffn_hidden_size", 2048),
            "n_routed_experts": hf.get("n_routed_experts", 512), "num_experts_per_tok": hf.get("moe_topk", 12),
            "zero_expert_num": int(hf.get("zero_expert_num") or 0),
            "num_key_value_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"]}


def dense_layers(hf: dict) -> int:
    """How many first layers of a DeepSeek-style MoE model have a dense MLP: ``first_k_dense_replace``, or the
    dense prefix of ``mlp_layer_types`` (transformers' GLM-4.7-Flash config; a dense layer after a MoE one is
    refused)."""
    types = hf.get("mlp_layer_types")
    if hf.get("model_type") == "solar_open":  # every layer MoE (transformers ignores first_k_dense_replace)
        return 0
    if types is None:
        return int(hf.get("first_k_dense_replace", 1 if hf.get("model_type") == "glm4_moe_lite" else 0))
    dense = next((i for i, t in enumerate(types) if t != "dense"), len(types))
    if any(t != "sparse" for t in types[dense:]) or len(types) != hf["num_hidden_layers"]:
        raise UnsupportedModelError(f"mlp_layer_types {types} is not some dense layers then MoE ('sparse') ones")
    return dense


def indexer_types(hf: dict) -> list[str]:
    """Each layer's indexer: "full" (its own) or "shared" (GLM's: the last full layer's selection), from
    ``indexer_types``, else ``index_topk_pattern`` ("F" / "S" per layer), else ``index_topk_freq`` and
    ``index_skip_topk_offset`` as transformers derives them (every layer full by default)."""
    n = hf["num_hidden_layers"]
    if hf.get("indexer_types") is not None:
        types = list(hf["indexer_types"])
    elif hf.get("index_topk_pattern") is not None:
        pattern = hf["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else \
            list(pattern)
    else:
        freq, offset = max(int(hf.get("index_topk_freq") or 1), 1), int(hf.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if len(types) != n or (types and types[0] != "full"):
        raise UnsupportedModelError(f"indexer_types {types}: one per layer ({n}), the first full")
    return types


def sliding_windows(hf: dict) -> dict:
    """Megatron's switches for the ``sliding_window`` of the layers ``layer_types`` marks ``sliding_attention``
    (gpt-oss, OLMo 3): ``window_size`` (W - 1 keys before the query, none after) and ``window_attn_skip_freq`` (one
    entry per layer, 1 where the window applies); both None without a window."""
    window = int(hf.get("sliding_window") or 0)
    types = hf.get("layer_types") or ["full_attention"] * hf["num_hidden_layers"]
    return {"window_size": (window - 1, 0) if window else None,
            "window_attn_skip_freq": [int(t == "sliding_attention") for t in types] if window else None}


def gpt_config_from_hf(source, **overrides) -> GPTConfig:
    """The :class:`GPTConfig` that computes exactly what the HF model of ``source`` computes."""
    hf = text_view(load_hf_config(source))
    family = family_of(hf)
    if family.kimi_delta:
        hf = kimi_linear_view(hf)
    if family.gemma4:
        hf = gemma4_view(hf)
    if family.mimo:
        hf = mimo_view(hf)
    if family.minimax_m3:
        hf = minimax_m3_view(hf)
    if family.longcat:
        hf = longcat_view(hf)
    if family.exaone:
        hf = exaone_view(hf)
    if family.nemotron_h:
        hf = nemotron_h_view(hf)
    if family.lfm2:
        hf = lfm2_view(hf)
    if family.cohere:
        hf = cohere_view(hf)
    if family.name == "hy_v3":  # (Hy3's expert fields under DeepSeek-V3's names; no expert groups)
        hf = {**hf, "n_routed_experts": hf["num_experts"], "n_shared_experts": hf.get("num_shared_experts", 1),
              "routed_scaling_factor": hf.get("router_scaling_factor", 1.0), "n_group": 1, "topk_group": 1}
        if hf.get("mlp_layer_types") is None:  # (transformers' default: the first layer dense)
            hf["mlp_layer_types"] = ["dense"] + ["sparse"] * (hf["num_hidden_layers"] - 1)
    if family.name == "minimax01":
        hf = minimax01_view(hf)
    if family.name == "laguna":
        hf = laguna_view(hf)
    if family.name == "flint":
        hf = flint_view(hf)
    if family.name == "kolibri1" and hf.get("layer_types") is None:  # (transformers' default: every fifth layer full)
        hf = {**hf, "layer_types": ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention"
                                    for i in range(hf["num_hidden_layers"])]}
    _refuse_unsupported(hf, family)
    if family.hunyuan:
        hf = hunyuan_view(hf)
    heads = hf["num_attention_heads"]
    qkv_bias = family.qkv_bias if family.qkv_bias is not None else \
        bool(hf.get("qkv_bias", True)) if family.name == "qwen2_moe" else bool(hf.get("attention_bias", False))
    kwargs = dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        # (Solar Open has no dense MLP, nor this field: the experts' width stands in)
        ffn_hidden_size=hf.get("intermediate_size") or hf["moe_intermediate_size"],
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        normalization="RMSNorm",
        norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        swiglu=True,
        add_qkv_bias=qkv_bias,
        add_bias_linear=False,
        qk_layernorm=family.qk_norm if family.qk_norm is not None else bool(hf.get("use_qk_norm", False)),
        qk_layernorm_all_heads=family.minimax or family.olmo or family.name == "olmoe",
        pre_norm=not family.olmo and family.name != "exaone4",
        post_norm=family.olmo or family.gemma or family.name == "exaone4",
        rotary_percent=partial_rotary(hf),
        rotary_base=rope_theta(hf),
        rope_scaling=None if family.gemma4 else rope_scaling(hf),  # (Gemma 4's per layer kind: below)
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    if family.mla:
        kwargs.update(
            num_query_groups=heads, kv_channels=hf["v_head_dim"],
            kv_lora_rank=hf["kv_lora_rank"], q_lora_rank=hf.get("q_lora_rank"), qk_head_dim=hf["qk_nope_head_dim"],
            qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
            qk_layernorm=True,  # Megatron builds MLA's latent norms (q_a_layernorm, kv_a_layernorm) under this switch
            rotary_percent=1.0,  # MLA rotates qk_pos_emb_head_dim channels (Mistral 4 also gives them as a fraction)
        )
    if family.dsa:
        types = indexer_types(hf)
        # the indexer's RoPE pairs: GLM-5's config says indexer_rope_interleave (transformers assumes it per family)
        interleaved = bool(hf.get("indexer_rope_interleave", family.name == "glm_moe_dsa"))
        kwargs.update(dsa_index_heads=hf["index_n_heads"], dsa_index_head_dim=hf["index_head_dim"],
                      dsa_index_topk=hf["index_topk"], dsa_rope_interleaved=interleaved,
                      dsa_shared_layers=tuple(t == "shared" for t in types) if "shared" in types else None)
    if family.gated_delta:
        kwargs.update(
            zero_centered_norm=not family.olmo, attention_output_gate=not family.olmo,
            linear_attention=tuple(t == "linear_attention" for t in hf["layer_types"]),
            linear_num_key_heads=hf["linear_num_key_heads"], linear_num_value_heads=hf["linear_num_value_heads"],
            linear_key_head_dim=hf["linear_key_head_dim"], linear_value_head_dim=hf["linear_value_head_dim"],
            linear_conv_kernel=hf.get("linear_conv_kernel_dim", 4),
        )
    if family.name == "glm4":
        kwargs.update(pre_norm=True, post_norm=True, rotary_interleaved=True)
    if family.name == "glm":  # (GLM-4 9B: the same rotation, pre-norm only)
        kwargs["rotary_interleaved"] = True
    if family.ernie:
        kwargs["rotary_interleaved"] = True
        if family.moe:
            f = ernie_moe_fields(hf)
            kwargs.update(num_moe_experts=f["experts"], moe_router_topk=f["topk"],
                          moe_ffn_hidden_size=hf["moe_intermediate_size"],
                          moe_shared_ffn_hidden_size=hf["moe_intermediate_size"] * f["shared"] or None,
                          moe_dense_layers=f["start"], moe_router_pre_softmax=True, moe_softmax_bias_router=True,
                          extra={"moe_router_dtype": "fp32"})  # (HF computes the router in fp32)
    if family.hunyuan:
        kwargs["qk_norm_after_rope"] = True
        if family.moe:
            def one(v):  # (a list of one value per layer: refused above unless they agree)
                return int(v[0] if isinstance(v, (list, tuple)) else v)

            kwargs.update(num_moe_experts=one(hf["num_experts"]), moe_router_topk=one(hf["moe_topk"]),
                          moe_ffn_hidden_size=hf["intermediate_size"],
                          moe_shared_ffn_hidden_size=hf["intermediate_size"], moe_router_pre_softmax=False,
                          moe_router_topk_renorm=True, extra={"moe_router_dtype": "fp32"})  # (HF's gate is fp32)
    if family.kimi_delta:
        heads, dim = hf["linear_num_heads"], hf["linear_head_dim"]
        kwargs.update(linear_attention=tuple(t == "linear_attention" for t in hf["layer_types"]),
                      linear_attention_kind="kimi_delta", linear_num_key_heads=heads, linear_num_value_heads=heads,
                      linear_key_head_dim=dim, linear_value_head_dim=dim,
                      linear_conv_kernel=hf.get("linear_conv_kernel_dim", 4),
                      nope_layers=(True,) * hf["num_hidden_layers"], rope_scaling=None)  # no layer rotates
    if family.name == "minimax01":  # lightning layers of the attention's heads; residuals from the norms, scaled
        dim = kwargs["kv_channels"]

        def scales(kind):
            return float(hf.get(f"{kind}_alpha_factor", 1.0)), float(hf.get(f"{kind}_beta_factor", 1.0))

        kwargs.update(linear_attention=tuple(t == "linear_attention" for t in hf["layer_types"]),
                      linear_attention_kind="lightning", linear_num_key_heads=heads, linear_num_value_heads=heads,
                      linear_key_head_dim=dim, linear_value_head_dim=dim,
                      linear_norm_epsilon=1e-6,  # (transformers' and MiniMax's code: the norm's default; SGLang 1e-5)
                      norm_residual_scales=(scales("full_attn"), scales("linear_attn"), scales("mlp")))
    if family.name == "olmo_hybrid":
        kwargs.update(linear_pre_norm=True, linear_norm_epsilon=1e-5,
                      linear_beta_scale=2.0 if hf.get("linear_allow_neg_eigval", True) else 1.0)
        if olmo_hybrid_rope_theta(hf) is None:  # NoPE: no attention layer rotates
            kwargs.update(nope_layers=(True,) * hf["num_hidden_layers"], rope_scaling=None)
    params = hf.get("rope_scaling") or rope_parameters(hf)
    if params.get("llama_4_scaling_beta"):  # Ministral 3: queries scaled past the original context
        kwargs["query_scaling"] = (float(params["llama_4_scaling_beta"]),
                                   int(params.get("original_max_position_embeddings") or
                                       hf.get("original_max_position_embeddings") or kwargs["max_position_embeddings"]))
    if family.name == "arcee":  # a plain MLP: up, squared ReLU, down
        kwargs.update(swiglu=False, activation="relu2")
    if family.name == "jais2":  # LayerNorms with biases; biases on every projection; a plain squared-ReLU MLP
        if bool(hf.get("attention_bias", True)) != bool(hf.get("mlp_bias", True)):
            raise UnsupportedModelError("attention_bias and mlp_bias differ in a Jais 2 config: Megatron biases the "
                                        "attention's output projection and the MLP together (the releases bias both)")
        kwargs.update(swiglu=False, activation="relu2", normalization="LayerNorm",
                      norm_epsilon=float(hf.get("layer_norm_eps", 1e-5)),
                      add_bias_linear=bool(hf.get("mlp_bias", True)))
    if family.name == "starcoder2":  # Jais 2's LayerNorms and biases, a plain tanh-GELU MLP, windows on every layer
        bias = bool(hf.get("use_bias", True))
        kwargs.update(swiglu=False, activation="gelu_tanh", normalization="LayerNorm", add_qkv_bias=bias,
                      norm_epsilon=float(hf.get("norm_epsilon", 1e-5)), add_bias_linear=bias,
                      tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)))  # (transformers' default)
        if hf.get("sliding_window"):
            kwargs["extra"] = {**kwargs.get("extra", {}), **sliding_windows(
                {**hf, "layer_types": ["sliding_attention"] * hf["num_hidden_layers"]})}
    if family.name == "apertus":  # a plain MLP: up, xIELU (its own trained scalars), down
        kwargs.update(swiglu=False, activation="xielu")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise UnsupportedModelError("attention_bias / mlp_bias are not supported for Apertus (the releases have "
                                        "no biases)")
    if family.name in ("ministral", "cwm"):  # its sliding-window layers (where the config names none: Ministral's
        # every layer, CWM's three of every four, as transformers fills them in)
        window = hf.get("sliding_window")
        types = hf.get("layer_types")
        if not types and family.name == "cwm":
            types = ["full_attention" if i % 4 == 0 or not window else "sliding_attention"
                     for i in range(hf["num_hidden_layers"])]
        types = types or ["sliding_attention" if window else "full_attention"] * hf["num_hidden_layers"]
        if not set(types) <= set(LAYER_TYPES):
            raise UnsupportedModelError(f"layer_types {sorted(set(types))}: only sliding_attention and full_attention")
        kwargs["extra"] = {**kwargs.get("extra", {}), **sliding_windows({**hf, "layer_types": types})}
    if family.llama4:
        rotates = llama4_rope_layers(hf)
        moe = llama4_moe_layers(hf)
        kwargs.update(
            rotary_interleaved=True,  # (HF rotates complex pairs: channels 2i, 2i + 1)
            nope_layers=tuple(not r for r in rotates) if not all(rotates) else None,
            attention_chunk_size=int(hf["attention_chunk_size"]) if hf.get("attention_chunk_size") else None,
            qk_l2_norm=bool(hf.get("use_qk_norm", True)),
            nope_query_scaling=(float(hf.get("attn_scale", 0.1)), int(hf.get("floor_scale", 8192)))
            if hf.get("attn_temperature_tuning", True) and not all(rotates) else None,
            ffn_hidden_size=int(hf.get("intermediate_size_mlp") or hf["intermediate_size"]),
            num_moe_experts=hf["num_local_experts"], moe_router_topk=1, moe_ffn_hidden_size=hf["intermediate_size"],
            moe_shared_ffn_hidden_size=hf["intermediate_size"],
            moe_layer_pattern=tuple(moe) if not all(moe) else None,
            extra={"moe_router_score_function": "sigmoid", "moe_apply_probs_on_input": True},
        )
        if not any(moe):
            raise UnsupportedModelError("moe_layers is empty: a Llama 4 config without MoE layers is not supported")
    if family.afmoe:  # sandwich norms, gated attention, windows that rotate beside NoPE layers, sigmoid routing
        types = afmoe_layer_types(hf)
        window = hf.get("sliding_window")
        rotates = [t == "sliding_attention" for t in types]  # (by kind: transformers rotates them windowed or not)
        scale = float(hf.get("route_scale") or 1.0)
        kwargs.update(
            pre_norm=True, post_norm=True, attention_output_gate=True,
            nope_layers=tuple(not r for r in rotates) if not all(rotates) else None,
            embedding_multiplier=hf["hidden_size"] ** 0.5 if hf.get("mup_enabled") else None,
            embedding_multiplier_rounded=False,  # (transformers multiplies by the Python float)
            num_moe_experts=hf["num_experts"], moe_router_topk=hf["num_experts_per_tok"],
            moe_ffn_hidden_size=hf["moe_intermediate_size"],
            moe_shared_ffn_hidden_size=hf["moe_intermediate_size"] * int(hf.get("num_shared_experts") or 0) or None,
            moe_dense_layers=int(hf.get("num_dense_layers") or 0),
            extra={**(sliding_windows({**hf, "layer_types": types}) if window else {}),
                   "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                   "moe_router_bias_update_rate": 0.0,  # (kept as the checkpoint has it: RL does not rebalance)
                   "moe_router_topk_scaling_factor": scale if scale != 1.0 else None,
                   "moe_router_dtype": "fp32"})  # (transformers' router logits are fp32)
        if not any(rotates):
            kwargs["rope_scaling"] = None
    if family.falcon_h1:  # a Mamba-2 mixer beside the attention in every layer; muP multipliers
        def one(key):
            value = hf.get(key)
            return 1.0 if value is None else float(value)

        fields = mamba2_fields(["mamba"] * hf["num_hidden_layers"], hf.get("mamba_n_groups", 1),
                               hf.get("mamba_n_heads", 128), hf.get("mamba_d_state", 256),
                               falcon_h1_mamba_head_dim(hf), hf.get("mamba_d_conv", 4),
                               hf.get("mamba_conv_bias", True), hf.get("time_step_limit"))
        fields.pop("linear_attention")  # (no layer is Mamba-2 alone: every one has both)
        segments = tuple(float(x) for x in (hf.get("ssm_multipliers") or (1.0,) * 5))
        mlp = tuple(float(x) for x in (hf.get("mlp_multipliers") or (1.0, 1.0)))
        kwargs.update(fields, mamba_beside_attention=True, mamba_gated_norm=bool(hf.get("mamba_rms_norm")),
                      hybrid_multipliers=(one("attention_in_multiplier"), one("attention_out_multiplier"),
                                          one("ssm_out_multiplier")),
                      mamba_in_multiplier=one("ssm_in_multiplier"),
                      mamba_segment_multipliers=segments if segments != (1.0,) * 5 else None,
                      mlp_multipliers=mlp if mlp != (1.0, 1.0) else None,
                      embedding_multiplier=one("embedding_multiplier") if one("embedding_multiplier") != 1.0
                      else None, embedding_multiplier_rounded=False,  # (a Python float in transformers)
                      logit_multiplier=one("lm_head_multiplier") if one("lm_head_multiplier") != 1.0 else None,
                      softmax_scale=kwargs["kv_channels"] ** -0.5 * one("key_multiplier"))  # (q . c k = c q . k)
    if family.bamba:  # Granite 4.0-H's Mamba-2 layers (mcore/mamba2.py) beside attention with RoPE on half a head
        kinds = granite_layer_kinds(hf)
        kwargs["rotary_percent"] = float(rope_parameters(hf).get("partial_rotary_factor") or
                                         hf.get("partial_rotary_factor") or 0.5)  # (transformers: always 0.5)
        if "mamba" in kinds:
            kwargs.update(mamba2_fields(kinds, hf.get("mamba_n_groups", 1), hf.get("mamba_n_heads", 128),
                                        hf.get("mamba_d_state", 256), granite_mamba_head_dim(hf),
                                        hf.get("mamba_d_conv", 4), hf.get("mamba_conv_bias", True),
                                        hf.get("time_step_limit")))
    if family.cohere:
        rms = hf.get("rms_norm_eps") is not None and family.name == "cohere2_moe"  # (Command A+ may use RMSNorm)
        rotates = hf["cohere_rotates"]
        scale = float(hf.get("logit_scale", 0.0625) if hf.get("logit_scale") is not None else 1.0)
        kwargs.update(normalization="RMSNorm" if rms else "LayerNorm", norm_bias=rms,
                      norm_epsilon=float(hf["rms_norm_eps"] if rms else hf.get("layer_norm_eps", 1e-5)),
                      parallel_block=True, rotary_interleaved=True,  # (HF's repeat_interleave'd cos / sin)
                      logit_multiplier=scale if scale != 1.0 else None,
                      tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
                      nope_layers=tuple(not r for r in rotates) if not all(rotates) else None)
        if not any(rotates):
            kwargs["rope_scaling"] = None
        if hf.get("sliding_window") and "sliding_attention" in (hf.get("layer_types") or ()):
            kwargs["extra"] = {**kwargs.get("extra", {}), **sliding_windows(hf)}
        if family.moe:
            dense = [t == "dense" for t in hf["mlp_layer_types"]]
            k = dense.index(False) if False in dense else len(dense)
            prefix = not any(dense[k:])  # the dense layers are the first k: Megatron's dense first layers
            sigmoid = hf.get("expert_selection_fn", "softmax") == "sigmoid"
            shared = int(hf.get("num_shared_experts") or 0)
            averaged = shared and hf.get("shared_expert_combination_strategy", "average") == "average"
            kwargs.update(
                ffn_hidden_size=int(hf.get("prefix_dense_intermediate_size") or hf["intermediate_size"]),
                num_moe_experts=hf["num_experts"], moe_router_topk=hf["num_experts_per_tok"],
                moe_ffn_hidden_size=hf["intermediate_size"],
                moe_shared_ffn_hidden_size=hf["intermediate_size"] * shared or None,
                moe_router_pre_softmax=False, moe_router_topk_renorm=True,  # (softmax over the top-k logits)
                moe_dense_layers=k if prefix else 0,
                moe_layer_pattern=None if prefix else tuple(not d for d in dense),
                moe_output_multiplier=0.5 if averaged else None)
            if sigmoid:
                kwargs["extra"] = {**kwargs.get("extra", {}), "moe_router_score_function": "sigmoid"}
            if not any(not d for d in dense):
                raise UnsupportedModelError("mlp_layer_types marks no layer sparse: a Cohere2-MoE config without MoE "
                                            "layers is not supported")
    if family.name == "smollm3":
        rope_layers = hf.get("no_rope_layers") or [int((i + 1) % int(hf.get("no_rope_layer_interval") or 4) != 0)
                                                   for i in range(hf["num_hidden_layers"])]
        kwargs["nope_layers"] = tuple(not x for x in rope_layers)
    if family.gemma:
        kwargs.update(zero_centered_norm=True, activation="gelu_tanh", embedding_multiplier=hf["hidden_size"] ** 0.5,
                      softmax_scale=float(hf.get("query_pre_attn_scalar") or kwargs["kv_channels"]) ** -0.5,
                      tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
                      rotary_base=float(hf.get("rope_theta") or rope_parameters(hf).get("rope_theta") or
                                        (1e4 if family.name == "gemma2" else 1e6)),
                      final_logit_softcapping=hf.get("final_logit_softcapping"),
                      attention_softcapping=hf.get("attn_logit_softcapping"))
    if family.name == "gemma":  # (Gemma 1: Gemma's norms, GeGLU, scaled embedding and tied head in pre-norm layers)
        kwargs.update(zero_centered_norm=True, activation="gelu_tanh", embedding_multiplier=hf["hidden_size"] ** 0.5,
                      tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)))
    if family.name == "axk1":  # DeepSeek-V3's layers, a norm after each MoE layer's MLP
        kwargs["moe_output_norm"] = True
    if family.name == "minicpm5_moe":  # a sigmoid gate per query channel, from q_proj's second half of each head
        kwargs.update(attention_output_gate=True)
    if family.name == "lfm3":  # sandwich norms; windows; a gate per head; the sliding layers' RoPE the model's table
        sliding, full = rope_parameters(hf, "sliding_attention"), rope_parameters(hf, "full_attention")
        kwargs.update(pre_norm=True, post_norm=bool(hf.get("use_sandwich_norm", True)),
                      attention_head_gate=bool(hf.get("use_attention_gate", True)), rotary_percent=1.0,
                      rotary_base=float(sliding.get("rope_theta") or 1e4),
                      rope_scaling=rope_scaling(hf, "sliding_attention"))
        if "sliding_attention" in hf["layer_types"] and hf.get("sliding_window"):
            kwargs["extra"] = {**kwargs.get("extra", {}), **sliding_windows(hf)}
            if full != sliding and "full_attention" in hf["layer_types"]:
                kwargs.update(full_rope_scaling=rope_scaling(hf, "full_attention") or {"rope_type": "default"},
                              full_rotary_base=float(full.get("rope_theta") or kwargs["rotary_base"]))
        else:  # (every attention layer full: its RoPE is the model's table)
            kwargs.update(rotary_base=float(full.get("rope_theta") or 1e4), rope_scaling=rope_scaling(hf))
    if family.name == "flint":  # sinks in every layer; windows that rotate; full layers without RoPE
        types = hf["layer_types"]
        kwargs["extra"] = {**kwargs.get("extra", {}), "softmax_type": "learnable", **sliding_windows(hf)}
        if not kwargs["extra"]["window_size"]:
            kwargs["extra"].pop("window_size"), kwargs["extra"].pop("window_attn_skip_freq")
        if "full_attention" in types:
            kwargs["nope_layers"] = tuple(t == "full_attention" for t in types)
    if family.name == "laguna":  # per-layer heads, a softplus gate, windows with the model's RoPE, the full layers' own
        types = hf["layer_types"]
        sliding, full = rope_parameters(hf, "sliding_attention"), rope_parameters(hf, "full_attention")
        heads_per_layer = tuple(int(n) for n in hf["num_attention_heads_per_layer"])
        gating = hf.get("gating", True)
        kwargs.update(layer_attention_heads=heads_per_layer if len(set(heads_per_layer)) > 1 else None,
                      num_attention_heads=heads_per_layer[0] if len(set(heads_per_layer)) == 1 else
                      hf["num_attention_heads"],
                      attention_head_gate=gating is not False, head_gate_activation="softplus",
                      head_gate_per_element=gating == "per-element", rope_scaling=None)
        full_base = float(full.get("rope_theta") or 500000.0)
        full_fraction = float(full.get("partial_rotary_factor", 1.0))
        if "sliding_attention" in types and hf.get("sliding_window"):
            kwargs["extra"] = {**kwargs.get("extra", {}), **sliding_windows(hf)}
            kwargs.update(rotary_base=float(sliding.get("rope_theta") or 10000.0), rotary_percent=1.0)
            if "full_attention" in types:
                kwargs["global_partial_rotary"] = (full_base, full_fraction)
        else:  # (every layer full: their RoPE is the model's table)
            kwargs.update(rotary_base=full_base, rotary_percent=full_fraction)
    if family.name == "kolibri1":  # GLM-4's sandwich norms; EXAONE's windows that rotate beside NoPE full layers
        kwargs.update(pre_norm=True, post_norm=True)
        if hf.get("sliding_window"):
            kwargs["extra"] = {**kwargs.get("extra", {}), **sliding_windows(hf)}
            if "full_attention" in hf["layer_types"]:
                kwargs["nope_layers"] = tuple(t == "full_attention" for t in hf["layer_types"])
    if family.name == "mellum":  # dense layers where mlp_layer_types says
        types = hf.get("mlp_layer_types") or ["sparse"] * hf["num_hidden_layers"]
        kwargs.update(ffn_hidden_size=hf["intermediate_size"],
                      moe_layer_pattern=tuple(t == "sparse" for t in types) if "dense" in types else None)
    if (family.olmo or family.gemma or family.name == "mellum") and not family.gated_delta and \
            layer_types(hf, family):
        kwargs["extra"] = sliding_windows({**hf, "layer_types": layer_types(hf, family)})
        sliding = rope_scaling(hf, "sliding_attention")
        sliding_base = float(rope_parameters(hf, "sliding_attention").get("rope_theta") or
                             hf.get("rope_local_base_freq") or (1e4 if family.gemma else kwargs["rotary_base"]))
        if kwargs["extra"]["window_size"] and (sliding != kwargs["rope_scaling"] or
                                               sliding_base != kwargs["rotary_base"]):
            kwargs.update(sliding_rope_scaling=sliding or {"rope_type": "default"}, sliding_rotary_base=sliding_base)
    if family.gemma4:
        full, sliding = rope_parameters(hf, "full_attention"), rope_parameters(hf, "sliding_attention")
        head_dim, groups = hf["gemma4_global"]
        proportional = full.get("rope_type", "default") == "proportional"
        kwargs.update(
            pre_norm=True, post_norm=True, activation="gelu_tanh", embedding_multiplier=hf["hidden_size"] ** 0.5,
            softmax_scale=1.0, tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            final_logit_softcapping=hf.get("final_logit_softcapping"), value_norm=True, layer_scalars=True,
            rotary_base=float(sliding.get("rope_theta") or 1e4), rope_scaling=None, rotary_percent=1.0,
            global_kv_channels=head_dim, global_num_query_groups=groups,
            global_values_from_keys=bool(hf.get("attention_k_eq_v")),
            global_rotary=(float(full.get("rope_theta") or 1e6),
                           float(full.get("partial_rotary_factor", 1.0)) if proportional else 1.0,
                           float(full.get("factor", 1.0)) if proportional else 1.0),
            extra=sliding_windows(hf))
        width = int(hf.get("hidden_size_per_layer_input") or 0)
        if width:  # E2B / E4B: per-layer inputs from their own embedding table
            kwargs.update(per_layer_input_size=width,
                          per_layer_input_vocab=int(hf.get("vocab_size_per_layer_input") or hf["vocab_size"]))
            if hf.get("image_token_id") is not None:  # as released (vision-language): images' per-layer inputs
                kwargs["per_layer_image_token"] = (int(hf["image_token_id"]), int(hf.get("pad_token_id") or 0))
        sources = hf["gemma4_kv_shared_from"]
        if any(x is not None for x in sources):  # E2B / E4B: the last layers reuse earlier layers' keys and values
            kwargs["kv_shared_from"] = sources
            if hf.get("use_double_wide_mlp"):  # ... and have twice as wide an MLP
                kwargs["layer_ffn_sizes"] = tuple(hf["intermediate_size"] * (2 if x is not None else 1)
                                                  for x in sources)
        if hf.get("enable_moe_block"):  # 26B-A4B: experts beside the dense MLP in every layer
            kwargs.update(num_moe_experts=hf["num_experts"], moe_router_topk=hf["top_k_experts"],
                          moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_router_pre_softmax=False,
                          moe_beside_dense=True)
    if family.gpt_oss:
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        kwargs.update(
            num_moe_experts=hf["num_local_experts"], moe_router_topk=hf["num_experts_per_tok"],
            moe_ffn_hidden_size=hf["intermediate_size"], moe_router_pre_softmax=False,  # top-k logits, softmaxed
            add_bias_linear=True,  # o_proj, router and expert biases (Megatron has no switch for each)
            extra={
                "softmax_type": "learnable",  # the sinks
                **sliding_windows(hf),
                "activation_func": quick_gelu, "glu_linear_offset": 1.0,
                "activation_func_clamp_value": float(hf.get("swiglu_limit", 7.0)),
            },
        )
    if family.sigmoid_router or family.softmax_router:
        dense = dense_layers(hf)
        if not 0 <= dense < hf["num_hidden_layers"]:
            raise UnsupportedModelError(f"first_k_dense_replace={dense} leaves no MoE layer")
        groups = hf.get("n_group") or 1
        scaling = float(hf.get("routed_scaling_factor", 1.0) or 1.0)
        if family.minimax:  # transformers' and SGLang's MiniMax-M2 routers use neither field, whatever it says
            groups, scaling = 1, 1.0
        if family.minimax_m3:  # (M3's router scales: routed_scaling_factor; no groups)
            groups = 1
        if family.softmax_router:  # one group, or every group chosen (refused otherwise): no grouping
            groups = 1
        mixtral = family.minimax or family.minimax_m3  # (Mixtral's field names)
        expert_width = hf["intermediate_size"] if mixtral else hf["moe_intermediate_size"]
        kwargs.update(
            num_moe_experts=hf["num_local_experts"] if mixtral else hf["n_routed_experts"],
            moe_router_topk=hf["num_experts_per_tok"],
            moe_ffn_hidden_size=expert_width,
            moe_shared_ffn_hidden_size=None if family.minimax else
            expert_width * hf.get("n_shared_experts", 1) or None,  # (MiMo-V2-Flash, LFM2-MoE: 0, none)
            moe_dense_layers=dense,
            extra=_softmax_router(hf, scaling) if family.softmax_router else {
                "moe_router_score_function": "sigmoid",
                "moe_router_enable_expert_bias": True,  # HF's e_score_correction_bias (selection only)
                "moe_router_bias_update_rate": 0.0,  # kept as the checkpoint has it: RL does not rebalance
                "moe_router_topk_scaling_factor": scaling if scaling != 1.0 else None,
                "moe_router_num_groups": groups if groups > 1 else None,
                "moe_router_group_topk": hf.get("topk_group") if groups > 1 else None,
                "moe_router_dtype": "fp32",  # HF computes the router logits in fp32
            },
        )
        if family.softmax_router:
            kwargs["moe_router_pre_softmax"] = not bool(hf.get("norm_topk_prob", True)) or family.name == "deepseek_v2"
            if family.name == "deepseek_v2":  # (transformers computes its router logits in fp32)
                kwargs["extra"] = {**kwargs["extra"], "moe_router_dtype": "fp32"}
                groups, kept = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
                if hf.get("topk_method") == "group_limited_greedy" and 1 < groups and kept < groups:
                    kwargs["moe_greedy_groups"] = (groups, kept)  # (a group scored by its best expert: forge's)
    elif family.longcat:
        scaling = float(hf.get("routed_scaling_factor", 1.0) or 1.0)
        d = hf["hidden_size"]
        kwargs.update(
            ffn_hidden_size=hf["intermediate_size"], num_moe_experts=hf["n_routed_experts"],
            moe_router_topk=hf["num_experts_per_tok"], moe_ffn_hidden_size=hf["moe_intermediate_size"],
            shortcut_moe=True, moe_zero_experts=hf["zero_expert_num"],
            mla_latent_scales=((d / hf["q_lora_rank"]) ** 0.5, (d / hf["kv_lora_rank"]) ** 0.5),
            mla_latent_norm_epsilon=1e-6,  # (transformers' latent norms keep their default; the others rms_norm_eps)
            extra={"moe_router_topk_scaling_factor": scaling if scaling != 1.0 else None})
    elif family.name == "flint":  # a sigmoid router without a bias (renormalised), a shared expert, dense layers
        kwargs.update(
            num_moe_experts=hf["num_experts"], moe_router_topk=hf["num_experts_per_tok"],
            moe_ffn_hidden_size=hf["moe_intermediate_size"], ffn_hidden_size=hf["intermediate_size"],
            moe_shared_ffn_hidden_size=hf.get("shared_expert_intermediate_size") or None,
            moe_layer_pattern=tuple(hf["flint_moe_layers"]) if not all(hf["flint_moe_layers"]) else None,
            extra={**kwargs.get("extra", {}), "moe_router_score_function": "sigmoid",
                   "moe_router_dtype": "fp32"})  # (HF: the logits in fp32)
    elif family.name == "laguna":  # DeepSeek-V3's sigmoid router with its bias, a shared expert, dense first layers
        types = hf["mlp_layer_types"]
        scaling = float(hf.get("moe_routed_scaling_factor", 1.0) or 1.0)
        kwargs.update(
            num_moe_experts=hf["num_experts"], moe_router_topk=hf["num_experts_per_tok"],
            moe_ffn_hidden_size=hf["moe_intermediate_size"], ffn_hidden_size=hf["intermediate_size"],
            moe_shared_ffn_hidden_size=hf.get("shared_expert_intermediate_size") or None,
            moe_layer_pattern=tuple(t == "sparse" for t in types) if "dense" in types else None,
            extra={**kwargs.get("extra", {}), "moe_router_score_function": "sigmoid",
                   "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.0,
                   "moe_router_topk_scaling_factor": scaling if scaling != 1.0 else None,
                   "moe_router_dtype": "fp32"})  # (HF: the logits in fp32)
    elif family.name == "kolibri1":  # every layer's experts beside a shared one; the logit-plus-bias router
        kwargs.update(
            num_moe_experts=hf.get("num_experts") or hf["num_local_experts"],  # (transformers 5 writes the latter)
            moe_router_topk=hf["num_experts_per_tok"], moe_ffn_hidden_size=hf["moe_intermediate_size"],
            moe_shared_ffn_hidden_size=hf.get("shared_expert_intermediate_size") or None,
            moe_logit_bias_router=True, moe_router_topk_renorm=bool(hf.get("norm_topk_prob", False)),
            extra={**kwargs.get("extra", {}), "moe_router_dtype": "fp32"})  # (HF: the logits in fp32)
    elif family.moe and not family.gpt_oss and not family.ernie and not family.hunyuan and not family.granite \
            and not family.llama4 and not family.cohere and not family.afmoe:
        # Qwen3.5-MoE's router always renormalises its top-k probabilities (its config has no norm_topk_prob);
        # Qwen3-Next's does unless its config says otherwise; so does Qwen3-VL-MoE's (no such field either)
        # Mixtral's always does (no such field)
        norm_topk = bool(hf.get("norm_topk_prob", family.gated_delta or family.fused_experts or
                                family.name in ("mixtral", "minimax01")))
        kwargs.update(
            num_moe_experts=hf.get("num_experts") or hf["num_local_experts"],  # transformers 5 renamed it
            moe_router_topk=hf["num_experts_per_tok"],
            moe_ffn_hidden_size=hf.get("moe_intermediate_size") or hf["intermediate_size"],  # (OLMoE: the latter)
            moe_router_pre_softmax=not norm_topk,
            moe_router_topk_renorm=norm_topk,
        )
        if (family.gated_delta or family.name == "qwen2_moe") and hf.get("shared_expert_intermediate_size"):
            kwargs.update(moe_shared_ffn_hidden_size=hf["shared_expert_intermediate_size"],
                          extra={**kwargs.get("extra", {}), "moe_shared_expert_gate": True})
    if family.nemotron_h:  # one sublayer per layer; NoPE attention; squared-ReLU MLPs and experts; Mamba-2 mixers
        kinds = hf["nemotron_kinds"]
        kwargs.update(layer_kinds=tuple(kinds), swiglu=False, activation="relu2",
                      nope_layers=(True,) * len(kinds), rope_scaling=None)
        if "mamba" in kinds:
            kwargs.update(mamba2_fields(kinds, hf.get("n_groups", 8), hf.get("mamba_num_heads", 128),
                                        hf.get("ssm_state_size", 128), hf.get("mamba_head_dim", 64),
                                        hf.get("conv_kernel", 4), hf.get("use_conv_bias", True),
                                        hf.get("time_step_limit")))
        if family.moe:  # (the sigmoid router's fields above; the shared expert has its own width)
            kwargs["moe_shared_ffn_hidden_size"] = int(hf.get("moe_shared_expert_intermediate_size") or
                                                       hf["moe_intermediate_size"])
            if hf.get("moe_latent_size"):  # (Nemotron 3 Super / Ultra: LatentMoE, mcore/latent_moe.py)
                kwargs["moe_latent_size"] = int(hf["moe_latent_size"])
    if family.lfm2 and "conv" in hf["layer_types"]:  # LFM2's gated short convolutions (mcore/short_conv.py)
        kwargs.update(linear_attention=tuple(t == "conv" for t in hf["layer_types"]), linear_attention_kind="short_conv",
                      linear_conv_kernel=int(hf.get("conv_L_cache", 3)), short_conv_bias=bool(hf.get("conv_bias")))
    if family.exaone and hf.get("sliding_window"):  # the sliding layers rotate, the global ones do not
        kwargs["extra"] = {**kwargs.get("extra", {}), **sliding_windows(hf)}
        if "full_attention" in hf["layer_types"]:
            kwargs["nope_layers"] = tuple(t == "full_attention" for t in hf["layer_types"])
    if family.granite:
        def scale(key):  # (1 or none: no scaling)
            value = hf.get(key)
            return float(value) if value not in (None, 1, 1.0) else None

        kwargs.update(embedding_multiplier=scale("embedding_multiplier"), embedding_multiplier_rounded=False,
                      residual_multiplier=scale("residual_multiplier"), logits_scaling=scale("logits_scaling"),
                      softmax_scale=float(hf.get("attention_multiplier") or 1.0))
        if family.name == "hyperclovax":  # peri-layer norms; its logits multiplied by logits_scaling, not divided
            kwargs.update(post_norm=bool(hf.get("use_post_norm", True)), logits_scaling=None,
                          logit_multiplier=scale("logits_scaling"),  # (Cohere's: multiplies)
                          softmax_scale=float(hf.get("attention_multiplier") or
                                              (hf.get("head_dim") or hf["hidden_size"] // heads) ** -0.5))
        if family.name == "granitemoehybrid" and hf.get("position_embedding_type") != "rope":
            kwargs.update(nope_layers=(True,) * hf["num_hidden_layers"], rope_scaling=None)  # (Granite 4.0-H)
        kinds = granite_layer_kinds(hf) if family.name == "granitemoehybrid" else []
        if "mamba" in kinds:  # Granite 4.0-H: Mamba-2 layers (mcore/mamba2.py) beside the attention ones
            kwargs.update(mamba2_fields(kinds, hf.get("mamba_n_groups", 1), hf.get("mamba_n_heads", 128),
                                        hf.get("mamba_d_state", 256), granite_mamba_head_dim(hf),
                                        hf.get("mamba_d_conv", 4), hf.get("mamba_conv_bias", True),
                                        hf.get("time_step_limit")))
        shared = hf.get("shared_intermediate_size") if family.name in ("granitemoeshared", "granitemoehybrid",
                                                                       "granitemoe_swa") else None
        if family.name in ("granite_swa", "granitemoe_swa"):
            kwargs.update(granite_swa_fields(hf))
        if family.moe:
            kwargs.update(num_moe_experts=hf["num_local_experts"], moe_router_topk=hf["num_experts_per_tok"],
                          moe_ffn_hidden_size=hf["intermediate_size"], moe_router_pre_softmax=False,
                          moe_shared_ffn_hidden_size=shared or None)
        elif shared:  # Granite 4.0 without experts: the shared MLP is the layer's MLP
            kwargs["ffn_hidden_size"] = shared
    if family.mimo:
        (full_kv, sliding_kv), (full_sinks, sliding_sinks) = hf["mimo_kv_heads"], hf["mimo_sinks"]
        full_base, sliding_base, fraction = hf["mimo_rope"]
        windows = sliding_windows(hf)
        if not windows["window_size"]:
            raise UnsupportedModelError("MiMo-V2-Flash without a sliding window (sliding_window_size) is not supported")
        value_dim, scale = int(hf.get("v_head_dim") or kwargs["kv_channels"]), hf.get("attention_value_scale", 0.707)
        kwargs.update(
            num_query_groups=sliding_kv, global_num_query_groups=full_kv,  # (the sliding layers' are the model's)
            value_head_dim=value_dim if value_dim != kwargs["kv_channels"] else None,
            value_scale=float(scale) if scale is not None and scale != 1.0 else None,
            sink_layers=tuple(sliding_sinks if t == "sliding_attention" else full_sinks for t in hf["layer_types"]),
            rotary_percent=fraction, rotary_base=full_base, rope_scaling=None,
            sliding_rope_scaling={"rope_type": "default"} if sliding_base != full_base else None,
            sliding_rotary_base=sliding_base if sliding_base != full_base else None,
            extra={**kwargs.get("extra", {}), **windows})
    if family.minimax_m3:
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        types = hf["layer_types"]
        kwargs.update(
            ffn_hidden_size=hf["dense_intermediate_size"], moe_shared_ffn_hidden_size=hf["shared_intermediate_size"],
            zero_centered_norm=True,
            block_sparse_layers=tuple(t == "minimax_m3_sparse" for t in types) if "minimax_m3_sparse" in types
            else None,
            block_index_heads=hf["index_n_heads"], block_index_head_dim=hf["index_head_dim"],
            block_size=hf["index_block_size"], block_topk=hf["index_topk_blocks"],
            block_local=hf["index_local_blocks"],
            extra={**kwargs.get("extra", {}), "activation_func": quick_gelu, "glu_linear_offset": 1.0,
                   "activation_func_clamp_value": float(hf["swiglu_limit"])})
    if is_reward_config(hf):  # a score head on the last hidden state; the LM head is never made or read
        kwargs.update(score_head=reward_labels(hf), tie_word_embeddings=True)
    if "extra" in overrides:
        overrides = {**overrides, "extra": {**kwargs.get("extra", {}), **overrides["extra"]}}
    kwargs.update(overrides)
    return GPTConfig(**kwargs)
