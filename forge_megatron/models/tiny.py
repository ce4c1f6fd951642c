"""Tiny, fully local model assets: a byte-level BPE tokenizer with a Qwen-style chat template, and tiny HF causal LMs.

Why: tests and the demo need a real tokenizer and real HF checkpoints (config.json + model.safetensors) that
``transformers.AutoTokenizer`` / ``AutoModelForCausalLM`` load offline, without any model hub. Everything is built
here from code and a built-in corpus, deterministically:

- the tokenizer is a byte-level BPE (256 byte symbols + a few hundred merges learnt from ``_CORPUS``), so any text
  round-trips; the chat markers ``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``, ``<tool_call>``,
  ``</tool_call>``, ``<tool_response>``, ``</tool_response>`` are single special tokens; vocabulary <= 512;
- the chat template follows Qwen2.5's layout: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, tools listed
  as JSON lines inside ``<tools></tools>`` in the system turn, assistant tool calls rendered as
  ``<tool_call>\\n{"name": .., "arguments": ..}\\n</tool_call>``, consecutive tool results grouped into one user turn of
  ``<tool_response>`` blocks, and ``add_generation_prompt`` opening ``<|im_start|>assistant\\n``;
- models are randomly initialised from ``seed`` (hidden 64, 2 layers, 4 heads, 2 KV heads, MLP 128; the MoE variant
  has 4 experts, top-2, expert MLP 32), saved in fp32.
"""

from __future__ import annotations

import json
import os
import string

VOCAB_LIMIT = 512
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
# a vision-language tokenizer's image tokens (Qwen-VL's names), added after the BPE vocabulary (build_tiny_tokenizer)
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
# the tiny image processor: 4 x 4 patches, 2 x 2 merged per token, images of 8 x 8 to 32 x 32 pixels (1 to 16 tokens)
TINY_IMAGE_PROCESSOR = dict(patch_size=4, temporal_patch_size=2, merge_size=2,
                            size={"shortest_edge": 8 * 8, "longest_edge": 32 * 32})
ARCHS = ("qwen2", "llama", "qwen3", "qwen3_moe", "glm4_moe", "mistral", "deepseek_v3", "glm4_moe_lite", "gpt_oss",
         "minimax_m2", "qwen3_5", "qwen3_5_moe", "qwen3_5_vl", "qwen3_5_moe_vl", "qwen3_next", "olmo2", "olmo3",
         "gemma3", "gemma3_vl", "qwen3_vl", "qwen3_vl_moe", "smollm3", "seed_oss", "glm4", "kimi_k25", "glm4v",
         "glm4v_moe", "ministral3", "ministral3_vl", "deepseek_v32", "glm_moe_dsa", "mistral4", "mistral4_vl",
         "olmo_hybrid", "kimi_linear", "gemma4", "gemma4_vl", "gemma4_moe", "gemma4_e", "glm46v", "qwen2_5_vl",
         "qwen2_vl", "ernie4_5", "ernie4_5_moe", "hunyuan_v1_dense", "hunyuan_v1_moe", "olmoe",
         "mimo_v2_flash", "minimax_m3", "minimax_m3_text", "longcat_flash", "dots1", "solar_open", "mixtral",
         "phi3", "qwen2_moe", "exaone4", "exaone_moe", "youtu",
         "granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "granitemoehybrid_moe",
         "granitemoehybrid_mamba", "nemotron_h", "nemotron_h_moe", "lfm2",
         "lfm2_moe", "gemma2", "llama4", "arcee", "granite_swa", "granitemoe_swa", "exaone4_5", "ministral",
         "cohere", "cohere2", "cohere2_moe", "bamba", "apertus", "falcon_h1", "flex_olmo", "afmoe",
         "deepseek_v2", "cwm", "phi4_mini", "nemotron_h_latent", "axk1", "minicpm5_moe", "mellum", "kolibri1",
         "lfm3", "minimax01", "hy_v3", "hyperclovax", "jais2", "glm", "gemma", "starcoder2", "laguna", "flint")
# vision-language checkpoints as Qwen3.5 is released: the language model of the arch without "_vl" inside
# Qwen3_5(Moe)ForConditionalGeneration with a one-block vision tower
_VL = {"qwen3_5_vl": ("qwen3_5", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
       "gemma3_vl": ("gemma3", "Gemma3Config", "Gemma3ForConditionalGeneration"),
       "gemma4_vl": ("gemma4", "Gemma4Config", "Gemma4ForConditionalGeneration"),
       "qwen3_vl": ("qwen3", "Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
       "qwen3_vl_moe": ("qwen3_moe", "Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration"),
       "kimi_k25": ("deepseek_v3", "Kimi_K25Config", "Kimi_K25ForConditionalGeneration"),
       "glm4v": ("glm4", "Glm4vConfig", "Glm4vForConditionalGeneration"),
       "glm4v_moe": ("glm4_moe", "Glm4vMoeConfig", "Glm4vMoeForConditionalGeneration"),
       # GLM-4.6V as transformers 5.x holds it: GLM-4.1V's layout, the language model built from the model_type its
       # text_config names (glm4v_text here, GLM-4.1V's dense one)
       "glm46v": ("glm4", "Glm46VConfig", "Glm46VForConditionalGeneration"),
       "ministral3_vl": ("ministral3", "Mistral3Config", "Mistral3ForConditionalGeneration"),
       "mistral4_vl": ("mistral4", "Mistral3Config", "Mistral3ForConditionalGeneration"),
       "qwen3_5_moe_vl": ("qwen3_5_moe", "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
       # Qwen2.5-VL / Qwen2-VL: a Qwen2 language model (biases on q/k/v), contiguous mRoPE sections; saved as
       # released (a flat config.json, the language model under model., the tower under visual.)
       "qwen2_5_vl": ("qwen2", "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
       "qwen2_vl": ("qwen2", "Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
       # EXAONE 4.5 as released: EXAONE 4.0's language model beside a Qwen2.5-VL-style tower (2-D RoPE in the tower,
       # plain positions for the language model)
       "exaone4_5": ("exaone4", "Exaone4_5_Config", "Exaone4_5_ForConditionalGeneration"),
       # MiniMax-M3 as released (MiniMaxM3SparseForConditionalGeneration: the language model beside a one-layer
       # tower; the bridge trains the language model, text only)
       "minimax_m3": ("minimax_m3_text", "MiniMaxM3VLConfig", "MiniMaxM3SparseForConditionalGeneration")}


def _glm_vl(arch: str) -> bool:
    """A GLM-4.xV vision-language arch (GLM-4.1V / 4.5V layouts, GLM-4.6V's Glm46V): GLM's image tokens and processor."""
    return arch in _VL and _VL[arch][2].startswith("Glm4")

# A small English + code + JSON corpus: merges learnt from it make common chat text a few characters per token.
_CORPUS = [
    "You are a helpful assistant. The user asks a question and the assistant answers it.",
    "Hello! How can I help you today? What is the weather in Paris? It is sunny and warm.",
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ?",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"type": "function", "function": {"name": "search", "description": "Search the web", '
    '"parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}',
    "system\nuser\nassistant\ntool\n# Tools\nfunction call result answer question task reward",
    "Let me think step by step. First, compute the sum. Then check the answer. The answer is 42.",
    string.ascii_letters + " " + string.digits + " " + string.punctuation,
]

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}"
    "{%- else %}{{- 'You are a helpful assistant.\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call functions. Their signatures are inside <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function, answer with a JSON object inside <tool_call></tool_call> tags:\\n"
    "<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role in ['system', 'user'] %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for tc in message.tool_calls or [] %}"
    "{%- set call = tc.function if tc.function is defined else tc %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tiny_tokenizer(out_dir: str | None = None, vocab_size: int = 400, vision: bool = False):
    """Train the byte-level BPE on the built-in corpus; save it to ``out_dir`` (if given) and return it.

    Returns a ``transformers.PreTrainedTokenizerFast`` with eos ``<|im_end|>`` and pad ``<|endoftext|>``; with
    ``vision`` also the image tokens :data:`VISION_TOKENS` (special tokens after the BPE vocabulary).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if not len(SPECIAL_TOKENS) + 256 <= vocab_size <= VOCAB_LIMIT:
        raise ValueError(f"vocab_size must be in [{len(SPECIAL_TOKENS) + 256}, {VOCAB_LIMIT}], got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[3:]) + (list(VISION_TOKENS) if vision else []),
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        fast.save_pretrained(out_dir)
    return fast


def tiny_config(arch: str = "qwen2", vocab_size: int = 400, tie_word_embeddings: bool = False, **overrides):
    """The HF config of a tiny model of family ``arch`` (one of :data:`ARCHS`); ``overrides`` set config fields (of
    the language model's ``text_config`` for a vision-language arch)."""
    import transformers

    if arch in _VL:
        text_arch, config_class, _ = _VL[arch]
        text = tiny_config(text_arch, vocab_size, tie_word_embeddings, **overrides).to_dict()
        if text_arch == "gemma3":  # a one-layer SigLIP tower, 4 tokens per image; the head tied, as released (and
            # as released no SigLIP pooling head: the projector takes the patches)
            vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          image_size=16, patch_size=4, vision_use_head=False)
            return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                             tie_word_embeddings=True)
        if text_arch == "gemma4":  # a one-layer vision tower (no audio tower), the head tied, as released
            vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
                          position_embedding_size=64)
            return transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                                             tie_word_embeddings=True)
        if text_arch == "deepseek_v3":  # Kimi-K2.5: a one-block MoonViT, 2 x 2 patches merged per token
            vision = dict(patch_size=4, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2, num_attention_heads=2,
                          num_hidden_layers=1, hidden_size=32, intermediate_size=64)
            return transformers.Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=32,
                                               tie_word_embeddings=tie_word_embeddings)
        if text_arch in ("ministral3", "mistral4"):  # a one-layer Pixtral tower, 2 x 2 patches merged per token
            vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          image_size=16, patch_size=4, head_dim=16)
            return transformers.Mistral3Config(text_config=text, vision_config=vision, spatial_merge_size=2,
                                               tie_word_embeddings=tie_word_embeddings)
        if text_arch.startswith("glm4"):  # GLM-4.1V / 4.5V / 4.6V: mRoPE over the 4 rotated pairs of each head
            text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                       "mrope_section": [2, 1, 1]}
            text.pop("use_qk_norm", None)  # GLM-4.5V's attention has no q/k norms (its config no such field)
            if config_class == "Glm46VConfig":  # its text model is whatever model_type the text_config names
                text["model_type"] = "glm4v_text"
            vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                          patch_size=4, spatial_merge_size=2, temporal_patch_size=2, image_size=16)
            return getattr(transformers, config_class)(text_config=text, vision_config=vision,
                                                       tie_word_embeddings=tie_word_embeddings)
        if text_arch == "minimax_m3_text":  # a one-layer tower; the head untied, as released
            vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          patch_size=4)
            return transformers.MiniMaxM3VLConfig(text_config=text, vision_config=vision, projector_hidden_size=64,
                                                  tie_word_embeddings=False)
        if text_arch == "exaone4":  # EXAONE 4.5: a two-block Qwen2.5-VL-style tower
            vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                          out_hidden_size=text["hidden_size"], patch_size=4, spatial_merge_size=2,
                          temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1])
            return transformers.Exaone4_5_Config(text_config=text, vision_config=vision,
                                                 tie_word_embeddings=tie_word_embeddings)
        if text_arch == "qwen2":  # Qwen2.5-VL / Qwen2-VL: contiguous mRoPE sections over the 8 frequencies
            text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
            if config_class == "Qwen2VLConfig":  # LayerNorm blocks, a QuickGELU MLP, every block attending fully
                vision = dict(depth=2, embed_dim=32, hidden_size=text["hidden_size"], mlp_ratio=2, num_heads=2,
                              patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
            else:  # RMSNorm blocks, a SwiGLU MLP; block 0 attends in windows of 2 x 2 merged patches (16 pixels),
                # block 1 over the whole image
                vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                              out_hidden_size=text["hidden_size"], patch_size=4, spatial_merge_size=2,
                              temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1])
            return getattr(transformers, config_class)(text_config=text, vision_config=vision,
                                                       tie_word_embeddings=tie_word_embeddings)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                      patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
        if text_arch == "qwen3_moe":  # Qwen3-VL-MoE's router always renormalises (its config has no such field);
            text.pop("norm_topk_prob", None)  # experts 24 wide: [E, 64, 48] on disk, not square as [E, 64, 64]
            text["moe_intermediate_size"] = 24  # would be (transformers then cannot tell which way it lies)
        if text_arch in ("qwen3", "qwen3_moe"):  # Qwen3-VL: interleaved mRoPE over 8 pairs, deepstack from block 0
            text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                       "mrope_interleaved": True}
            vision["deepstack_visual_indexes"] = [0]
        return getattr(transformers, config_class)(text_config=text, vision_config=vision,
                                                   tie_word_embeddings=tie_word_embeddings)

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=2,  # <|im_end|>
        pad_token_id=0,  # <|endoftext|>
    )
    hybrid = {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
              "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
              "linear_conv_kernel_dim": 4}
    hybrid_moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 48}
    qwen3_5_rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                    "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    # DeepSeek sparse attention layouts: DeepSeek-V3's with an indexer of 32 heads of 16 channels (8 rotated) picking
    # each query's 4 keys (sequences longer than 4 tokens attend sparsely). A key every head's ReLU zeroes scores
    # exactly 0, and engines break such ties each their own way: with 8 heads, 2-3 of 800 queries of 200-token
    # sequences had a tie at the top-4 boundary (transformers' CPU topk picks among them arbitrarily), with 32 none
    # but the padding token's (a zero embedding scores every key 0)
    dsa = {"num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 24, "qk_nope_head_dim": 16,
           "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 4, "n_shared_experts": 1,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1, "topk_group": 1,
           "norm_topk_prob": True, "routed_scaling_factor": 2.5, "index_topk": 4, "index_n_heads": 32,
           "index_head_dim": 16}
    nemotron_h = {"head_dim": 16, "intermediate_size": 96, "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2,
                  "ssm_state_size": 8, "conv_kernel": 4, "expand": 2, "chunk_size": 8, "layer_norm_epsilon": 1e-5,
                  "num_hidden_layers": None}
    granite_swa = {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 4,
                   "layer_rope_theta": [0, 10000.0]}
    granite_scales = {"embedding_multiplier": 2.0, "attention_multiplier": 0.1, "residual_multiplier": 0.5,
                      "logits_scaling": 4.0, "tie_word_embeddings": True}
    per_arch = {
        "qwen2": (transformers.Qwen2Config, {}),
        "llama": (transformers.LlamaConfig, {}),
        "qwen3": (transformers.Qwen3Config, {"head_dim": 16}),
        "qwen3_moe": (
            transformers.Qwen3MoeConfig,
            {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
        ),
        "mistral": (transformers.MistralConfig, {"head_dim": 16, "sliding_window": None}),
        # ERNIE 4.5 layout: Llama's with RoPE on interleaved channel pairs; the MoE one's layer 0 dense, layer 1 4
        # experts (top-2 chosen with a score-correction bias, renormalised softmax weights) and a shared expert
        "ernie4_5": (transformers.Ernie4_5Config, {"head_dim": 16}),
        "ernie4_5_moe": (
            transformers.Ernie4_5_MoeConfig,
            {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "moe_num_shared_experts": 1, "moe_layer_start_index": 1, "moe_layer_end_index": 1,
             "moe_layer_interval": 1},
        ),
        # OLMoE layout: q/k RMSNorms over all heads, 4 experts of intermediate_size, top 2 not renormalised
        "olmoe": (transformers.OlmoeConfig, {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                                             "norm_topk_prob": False, "eos_token_id": 2}),
        # Hunyuan layout: Llama's with q/k RMSNorms after RoPE and an NTK-alpha RoPE base (as released: "dynamic" with
        # a fixed alpha); the MoE one's every layer 4 experts (top 2) beside a shared MLP, all of intermediate_size
        "hunyuan_v1_dense": (
            transformers.HunYuanDenseV1Config,
            {"head_dim": 16, "rope_parameters": {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                                 "rope_theta": 10000.0}},
        ),
        "hunyuan_v1_moe": (
            transformers.HunYuanMoEV1Config,
            {"head_dim": 16, "num_experts": 4, "moe_topk": 2, "intermediate_size": 32,
             "rope_parameters": {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}},
        ),
        # Ministral 3 layout: Mistral's with YaRN and Llama 4's query scaling past position 4 (as past 16k released)
        "ministral3": (
            transformers.Ministral3Config,
            {"head_dim": 16, "sliding_window": None,
             "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 4, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.4}},
        ),
        # GLM-4.5 layout: layer 0 dense, layer 1 MoE (sigmoid router + score bias, a shared expert), half-head RoPE
        "glm4_moe": (
            transformers.Glm4MoeConfig,
            {"head_dim": 16, "partial_rotary_factor": 0.5, "n_routed_experts": 4, "n_shared_experts": 1,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1,
             "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "use_qk_norm": True,
             "attention_bias": True},
        ),
        # dots.llm1 layout: GLM-4.5's MoE (layer 0 dense, a sigmoid router with a score bias and groups of one, a
        # shared expert) with per-head q/k RMSNorms and RoPE over the whole head
        "dots1": (
            transformers.Dots1Config,
            {"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
             "routed_scaling_factor": 2.5, "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0}},
        ),
        # Solar Open layout: GLM-4.5's MoE in every layer (a sigmoid router with a score bias, a shared expert, the
        # top-k renormalised and scaled) under Llama's attention
        "solar_open": (
            transformers.SolarOpenConfig,
            {"head_dim": 16, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
             "routed_scaling_factor": 2.5},
        ),
        # Mixtral layout: Mistral's attention, 4 experts of intermediate_size in every layer, the top 2 renormalised
        "mixtral": (
            transformers.MixtralConfig,
            {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
             "sliding_window": None},
        ),
        # Phi-4-mini layout: Phi-3's below with longrope over 8 original positions (factor 256: attention factor
        # 1.9 on the rotated channels), short and long divisors for its 6 rotated frequencies, tied embeddings
        "phi4_mini": (
            transformers.Phi3Config,
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                 "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                 "long_factor": [2.0, 4.0, 6.0, 8.0, 12.0, 24.0],
                                 "original_max_position_embeddings": 8},
             "original_max_position_embeddings": 8, "sliding_window": None, "pad_token_id": 0,
             "tie_word_embeddings": True},
        ),
        # Phi-3 / Phi-4 layout: Llama's with q/k/v fused in qkv_proj, gate/up in gate_up_proj, RoPE on the first
        # three quarters of each head (Phi-4-mini's fraction)
        "phi3": (
            transformers.Phi3Config,
            {"rope_parameters": {"rope_type": "default", "rope_theta": 250000.0, "partial_rotary_factor": 0.75},
             "sliding_window": None, "pad_token_id": 0},
        ),
        # Qwen2-MoE layout: Qwen2's attention (q/k/v biases), 4 experts of 32 (top 2, not renormalised) and a shared
        # expert of 48 behind a sigmoid gate in every layer
        "qwen2_moe": (
            transformers.Qwen2MoeConfig,
            {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 48, "norm_topk_prob": False, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "use_sliding_window": False},
        ),
        # Youtu-LLM layout: DeepSeek-V3's multi-latent attention (query latent 32, key/value latent 24, heads of 16 +
        # 8 rotated channels, values of 12) in Llama's layers, dense MLPs, the head tied (as released)
        "youtu": (
            transformers.YoutuConfig,
            {"num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 24, "qk_nope_head_dim": 16,
             "qk_rope_head_dim": 8, "v_head_dim": 12, "tie_word_embeddings": True},
        ),
        # Granite layouts: Llama's with muP-style scales (embedding x2, attention 0.1, residual branches x0.5, logits
        # / 4), the head tied; the MoE ones with 4 stacked experts of intermediate_size (top 2 softmaxed), the shared
        # ones with an ungated shared MLP of 48 (Granite 4.0: the MLP itself without experts; with them, no RoPE)
        "granite": (transformers.GraniteConfig, {**granite_scales}),
        "granitemoe": (
            transformers.GraniteMoeConfig,
            {**granite_scales, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
        ),
        # Granite SWA: Granite's scales, layer 0 full attention without RoPE, layer 1 a 4-position window with RoPE,
        # a sink logit per head in both (random in build_tiny_model: zeros would change nothing)
        "granite_swa": (transformers.GraniteSWAConfig, {**granite_scales, **granite_swa}),
        "granitemoe_swa": (
            transformers.GraniteMoeSWAConfig,
            {**granite_scales, **granite_swa, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
             "shared_intermediate_size": 48},
        ),
        "granitemoeshared": (
            transformers.GraniteMoeSharedConfig,
            {**granite_scales, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
             "shared_intermediate_size": 48},
        ),
        "granitemoehybrid": (
            transformers.GraniteMoeHybridConfig,
            {**granite_scales, "num_local_experts": 0, "shared_intermediate_size": 48,
             "layer_types": ["attention", "attention"], "position_embedding_type": "rope"},
        ),
        "granitemoehybrid_moe": (
            transformers.GraniteMoeHybridConfig,
            {**granite_scales, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
             "shared_intermediate_size": 48, "layer_types": ["attention", "attention"],
             "position_embedding_type": "nope"},
        ),
        # Granite 4.0-H layout: a Mamba-2 layer (8 heads of 16 in 2 groups, state 8, kernel 4) before an attention
        # layer without RoPE, 4 experts and the shared MLP in both
        "granitemoehybrid_mamba": (
            transformers.GraniteMoeHybridConfig,
            {**granite_scales, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
             "shared_intermediate_size": 48, "layer_types": ["mamba", "attention"],
             "position_embedding_type": "nope", "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2,
             "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 8},
        ),
        # Apertus layout: Llama's with per-head q/k RMSNorms and a plain MLP with xIELU (each layer's own scalars:
        # set apart below), llama3-scaled RoPE past 8 positions
        "apertus": (transformers.ApertusConfig, {"head_dim": 16, "rope_parameters": {
            "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8, "rope_theta": 12000000.0}}),
        # Falcon-H1 layout: attention (heads of 16) and a Mamba-2 mixer (8 heads of 16 in 2 groups, state 8) side by
        # side in both layers, every muP multiplier set apart from 1 (so that each one bites)
        "falcon_h1": (transformers.FalconH1Config, {
            "head_dim": 16, "mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2,
            "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_chunk_size": 8, "mamba_rms_norm": False,
            "embedding_multiplier": 2.0, "lm_head_multiplier": 0.5, "key_multiplier": 0.7,
            "attention_in_multiplier": 0.8, "attention_out_multiplier": 1.3, "ssm_in_multiplier": 0.9,
            "ssm_out_multiplier": 1.1, "ssm_multipliers": [0.5, 1.2, 0.8, 1.5, 0.7], "mlp_multipliers": [1.4, 0.6],
            "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}),
        # AFMoE (Arcee Trinity) layout: three layers, the first dense (its MLP 96 wide) with a 4-position window that
        # rotates, then a window layer and a NoPE full-attention one; sandwich norms, per-head q/k norms, a sigmoid gate
        # per attention channel; 4 experts 32 wide, top 2 by sigmoid + bias, renormalised, times 2.5, a shared expert;
        # the embedding times sqrt(hidden) (mup_enabled)
        "afmoe": (transformers.AfmoeConfig, {
            "num_hidden_layers": 3, "head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 32,
            "num_dense_layers": 1, "num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 1,
            "route_scale": 2.5, "sliding_window": 4, "layer_types": ["sliding_attention", "sliding_attention",
                                                                      "full_attention"],
            "mup_enabled": True}),
        # FlexOlmo layout: OLMo 2's post-norm layer with OLMoE's experts: 4 of intermediate_size, top 2 of the softmax
        # over all, not renormalised
        "flex_olmo": (transformers.FlexOlmoConfig, {"num_experts": 4, "num_experts_per_tok": 2,
                                                    "intermediate_size": 32}),
        # Bamba layout: a Mamba-2 layer (8 heads of 16 in 2 groups, state 8) then attention with RoPE on half of each
        # head; SwiGLU MLPs (feed_forward) behind pre_ff_layernorm
        "bamba": (transformers.BambaConfig, {"attn_layer_indices": [1], "mamba_n_heads": 8, "mamba_d_head": 16,
                                             "mamba_n_groups": 2, "mamba_d_state": 8, "mamba_d_conv": 4,
                                             "mamba_expand": 2, "mamba_chunk_size": 8}),
        # Nemotron-H layout: a Mamba-2 layer (8 heads of 16 in 2 groups, state 8), a squared-ReLU MLP, a NoPE
        # attention layer and another MLP, each behind its own norm
        "nemotron_h": (transformers.NemotronHConfig, {**nemotron_h, "hybrid_override_pattern": "M-*-"}),
        # Nemotron 3 Nano layout: the same with the MLPs as 4 squared-ReLU experts (top 2 by sigmoid + bias,
        # renormalised, times 2.5) beside a shared one of 48
        "nemotron_h_moe": (
            transformers.NemotronHConfig,
            {**nemotron_h, "hybrid_override_pattern": "ME*E", "n_routed_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48, "routed_scaling_factor": 2.5,
             "n_group": 1, "topk_group": 1, "norm_topk_prob": True},
        ),
        # Nemotron 3 Super / Ultra layout: the same with LatentMoE, the routed experts working in a 24-wide latent
        # space between their own projections (the router and the shared expert read the 64-wide hidden state)
        "nemotron_h_latent": (
            transformers.NemotronHConfig,
            {**nemotron_h, "hybrid_override_pattern": "ME*E", "n_routed_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48, "routed_scaling_factor": 2.5,
             "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "moe_latent_size": 24},
        ),
        # LFM2 layout: a gated short-convolution layer (3 taps) then attention with per-head q/k norms, the MLP's
        # width derived as LFM2 does (2/3 of 144, rounded up to 16: 96), the head tied
        "lfm2": (
            transformers.Lfm2Config,
            {"intermediate_size": 144, "block_multiple_of": 16, "layer_types": ["conv", "full_attention"],
             "tie_word_embeddings": True},
        ),
        # Jais 2 layout: Llama's attention with biases on q, k, v and o, LayerNorms with biases, a plain squared-ReLU
        # MLP with biases
        "jais2": (transformers.Jais2Config, {"head_dim": 16, "layer_norm_eps": 1e-5}),
        # Flint layout: layer 0 a 4-position window (rotating) with a dense MLP (96 wide), layer 1 full attention
        # without RoPE, layer 2 a window again; a sink logit per head in every layer, per-head q/k norms; 4 experts (top
        # 2 of a sigmoid, renormalised) beside an ungated shared expert 48 wide
        "flint": (
            transformers.FlintConfig,
            {"num_hidden_layers": 3, "head_dim": 16, "intermediate_size": 96, "num_experts": 4,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
             "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
             "mlp_only_layers": [0], "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
        ),
        # Laguna layout: layer 0 a 4-position window (4 query heads, plain RoPE over whole heads, base 10k) with a dense
        # MLP (96 wide), layer 1 full attention (8 query heads, RoPE over half of each head, base 500k), layer 2 a
        # window again (4 heads); 2 key heads, per-head q/k norms, a softplus gate per head; 4 experts (top 2 of a
        # sigmoid choosing with its bias, renormalised, times 2.5) beside a shared expert 48 wide
        "laguna": (
            transformers.LagunaConfig,
            {"num_hidden_layers": 3, "head_dim": 16, "intermediate_size": 96, "num_experts": 4,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
             "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
             "mlp_layer_types": ["dense", "sparse", "sparse"], "num_attention_heads_per_layer": [4, 8, 4],
             "moe_routed_scaling_factor": 2.5,
             "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 500000.0,
                                                    "partial_rotary_factor": 0.5},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 1.0}}},
        ),
        # StarCoder2 layout: biases on every projection and LayerNorm, a plain tanh-GELU MLP, every layer a 4-position
        # window (RoPE base 100k)
        "starcoder2": (transformers.Starcoder2Config, {"sliding_window": 4, "norm_epsilon": 1e-5,
                                                      "rope_parameters": {"rope_type": "default",
                                                                          "rope_theta": 100000.0}}),
        # HyperCLOVA X layout: Granite's scales (embedding times 12, attention scale 1/16, residuals times 0.5, the logits
        # times 0.25) with norms after attention and MLP too
        "hyperclovax": (
            transformers.HyperCLOVAXConfig,
            {"head_dim": 16, "embedding_multiplier": 12.0, "attention_multiplier": 0.0625,
             "residual_multiplier": 0.5, "logits_scaling": 0.25, "use_post_norm": True},
        ),
        # Hy3 layout: per-head q/k norms, layer 0 dense, layer 1 4 experts (top 2 by sigmoid + bias, renormalised, times
        # 2.5) beside a shared expert
        "hy_v3": (
            transformers.HYV3Config,
            {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 1,
             "moe_intermediate_size": 32, "router_scaling_factor": 2.5, "mlp_layer_types": ["dense", "sparse"],
             "initializer_range": 0.02},  # (its default, 0.006, leaves a tiny model's logits near uniform)
        ),
        # LFM3 layout: a 4-position sliding window (plain RoPE, base 10k), a short convolution, full attention
        # (proportional RoPE over half the frequencies, base 1M); per-head q/k norms and a sigmoid gate per head, norms
        # after every mixer and MLP (sandwich), MLPs 96 wide as given, the head tied
        "lfm3": (
            transformers.Lfm3Config,
            {"num_hidden_layers": 3, "head_dim": 16, "intermediate_size": 96, "conv_L_cache": 3, "sliding_window": 4,
             "layer_types": ["sliding_attention", "conv", "full_attention"], "tie_word_embeddings": True,
             "norm_eps": 1e-6},
        ),
        # LFM2-MoE layout: the same layers, layer 0's MLP dense (96 wide), layer 1 4 experts of 32 (top 2 by sigmoid
        # + bias, renormalised, times 2.5), no shared expert
        "lfm2_moe": (
            transformers.Lfm2MoeConfig,
            {"intermediate_size": 96, "moe_intermediate_size": 32, "num_dense_layers": 1, "num_experts": 4,
             "num_experts_per_tok": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "use_expert_bias": True,
             "layer_types": ["conv", "full_attention"], "tie_word_embeddings": True},
        ),
        # EXAONE 4.0 layout: norms after attention and MLP, per-head q/k norms, a 4-token window on layer 0 (which
        # rotates) beside a global layer 1 that does not (NoPE)
        "exaone4": (
            transformers.Exaone4Config,
            {"head_dim": 16, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
        ),
        # K-EXAONE layout: the same attention, pre-norm; layer 0 dense, layer 1 4 experts of 32 (top 2 of a sigmoid
        # router with a score bias, renormalised, times 2.5) beside a shared expert
        "exaone_moe": (
            transformers.ExaoneMoeConfig,
            {"head_dim": 16, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
             "mlp_layer_types": ["dense", "sparse"], "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32, "num_shared_experts": 1, "n_group": 1, "topk_group": 1,
             "norm_topk_prob": True, "routed_scaling_factor": 2.5},
        ),
        # DeepSeek-V3 layout: multi-latent attention (query and key/value latents, 24-channel query/key heads of
        # which 8 rotated, 12-channel value heads), layer 0 dense, grouped sigmoid routing (2 groups, 1 chosen)
        "deepseek_v3": (
            transformers.DeepseekV3Config,
            {"num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 24, "qk_nope_head_dim": 16,
             "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 4, "n_shared_experts": 1,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 2,
             "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rope_interleave": True},
        ),
        # A.X K1 layout: DeepSeek-V3's (multi-latent attention, layer 0 dense, grouped sigmoid routing: 2 groups, 1
        # chosen) with an RMSNorm on the MoE layer's output (post_mlp_layernorm)
        "axk1": (
            transformers.AXK1Config,
            {"num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 24, "qk_nope_head_dim": 16,
             "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 4, "n_shared_experts": 1,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_layer_types": ["dense", "sparse"],
             "n_group": 2, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
             "rope_interleave": True},
        ),
        # MiniCPM5-MoE layout: Llama's attention with a sigmoid gate per query channel (q_proj: each head's queries,
        # then its gate), layer 0 dense, then DeepSeek-V3's sigmoid router (fp32, with its bias) over 4 experts (top 2,
        # renormalised, times 2.5) beside a shared expert
        "minicpm5_moe": (
            transformers.MiniCPM5MoeConfig,
            {"head_dim": 16, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32, "mlp_layer_types": ["dense", "sparse"], "n_group": 1, "topk_group": 1,
             "norm_topk_prob": True, "routed_scaling_factor": 2.5},
        ),
        # Mellum 2 layout: Qwen3-MoE's attention (per-head q/k norms); layer 0 a 4-position window with its own RoPE
        # base (10k) and a dense MLP, layer 1 full attention (base 500k) with 4 softmax-routed experts (top 2,
        # renormalised)
        "mellum": (
            transformers.MellumConfig,
            {"head_dim": 16, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
             "mlp_layer_types": ["dense", "sparse"], "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32, "norm_topk_prob": True,
             "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
        ),
        # MiniMax-M1 layout: two lightning-attention layers (4 heads of 16, the decays of layers 0 and 1 of 3), then a
        # softmax-attention layer (GQA); every layer 4 experts (top 2 of a softmax, renormalised); residuals from the
        # norms' outputs, each sublayer's scales its own (M1: alpha 3.56, beta 1)
        "minimax01": (
            transformers.MiniMaxConfig,
            {"num_hidden_layers": 3, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
             "intermediate_size": 32, "layer_types": ["linear_attention", "linear_attention", "full_attention"],
             "full_attn_alpha_factor": 1.8, "full_attn_beta_factor": 0.9, "linear_attn_alpha_factor": 1.6,
             "linear_attn_beta_factor": 1.2, "mlp_alpha_factor": 1.4, "mlp_beta_factor": 0.7, "block_size": 4},
        ),
        # Kolibri 1 layout: EXAONE 4.0's attention (per-head q/k norms; layer 0 a 4-position window that rotates,
        # layer 1 full attention without RoPE) in GLM-4's sandwich norms; every layer 4 experts (top 2 by logit plus
        # bias, weighted by their sigmoids, not renormalised, as released) beside a shared expert 48 wide
        "kolibri1": (
            transformers.Kolibri1Config,
            {"head_dim": 16, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
             "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 48, "norm_topk_prob": False},
        ),
        # DeepSeek-V2-Lite layout: multi-latent attention without a query latent (q_proj), YaRN whose two mscales
        # agree (the softmax scale grows with them), layer 0 dense, a softmax router over all 4 experts (top 2, not
        # renormalised, times 2.5, logits in fp32) beside 2 shared experts
        "deepseek_v2": (
            transformers.DeepseekV2Config,
            {"num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 24, "qk_nope_head_dim": 16,
             "qk_rope_head_dim": 8,
             "v_head_dim": 12, "n_routed_experts": 4, "n_shared_experts": 2, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32, "first_k_dense_replace": 1, "topk_method": "greedy",
             "norm_topk_prob": False, "routed_scaling_factor": 2.5,
             "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "mscale": 0.707, "mscale_all_dim": 0.707}},
        ),
        # Mistral Small 4 layout: DeepSeek-V3's attention (YaRN) with Llama 4's query scaling past position 4, layer 0
        # dense, a softmax router (top-2 of 4, renormalised, scaled) without a score bias, experts stacked on disk
        "mistral4": (
            transformers.Mistral4Config,
            {"num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 24, "qk_nope_head_dim": 16,
             "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 4, "n_shared_experts": 1,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
             "norm_topk_prob": True, "routed_scaling_factor": 2.5,
             "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 4, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.4}},
        ),
        # DeepSeek-V3.2 layout (``dsa`` above; 2 expert groups, 1 chosen)
        "deepseek_v32": (transformers.DeepseekV32Config, {**dsa, "n_group": 2}),
        # GLM-5 layout: the same, no expert groups, the indexer's RoPE on interleaved pairs, and layer 1 "shared"
        # (no indexer: it reuses layer 0's selection)
        "glm_moe_dsa": (transformers.GlmMoeDsaConfig, {**dsa, "n_group": 1, "indexer_types": ["full", "shared"]}),
        # GLM-4.7-Flash layout: multi-latent attention with queries projected directly (no query latent)
        "glm4_moe_lite": (
            transformers.Glm4MoeLiteConfig,
            {"num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 24, "qk_nope_head_dim": 16,
             "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "n_shared_experts": 1,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_layer_types": ["dense", "sparse"],
             "norm_topk_prob": True, "routed_scaling_factor": 1.8},
        ),
        # gpt-oss layout: sinks, a 4-position window on layer 0, biased router and experts (fused in HF), YaRN
        "gpt_oss": (
            transformers.GptOssConfig,
            {"head_dim": 16, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
             "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"], "attention_bias": True,
             "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 512, "rope_theta": 150000.0}},
        ),
        # MiniMax-M2 layout: every layer MoE (sigmoid router + score bias, Mixtral names), RoPE on 8 of 16 channels,
        # q/k RMSNorm over all heads
        "minimax_m2": (
            transformers.MiniMaxM2Config,
            {"head_dim": 16, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
             "rotary_dim": 8},
        ),
        # Qwen3.5 layout (text): a Gated DeltaNet layer (2 key heads of 8, 4 value heads of 8, conv kernel 4) then a
        # gated full-attention one; zero-centred norms; RoPE on a quarter of each 16-channel head
        "qwen3_5": (transformers.Qwen3_5TextConfig, {**hybrid, "rope_parameters": qwen3_5_rope}),
        # Qwen3.5-MoE layout: the same two layers, each MLP 4 experts (top-2, renormalised) and a shared expert
        # behind a sigmoid gate
        "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, {**hybrid, **hybrid_moe, "rope_parameters": qwen3_5_rope}),
        # Qwen3-Next layout: Qwen3.5-MoE's, the Gated DeltaNet input projections fused per key head (qkvz, ba)
        "qwen3_next": (
            transformers.Qwen3NextConfig,
            {**hybrid, **hybrid_moe, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
             "partial_rotary_factor": 0.25},
        ),
        # OLMo 2 layout: norms after attention and MLP (none before), q/k RMSNorm over all heads
        "olmo2": (transformers.Olmo2Config, {}),
        # OLMo 3 layout: OLMo 2's with a 4-position window on layer 0 (plain RoPE there) and YaRN on the
        # full-attention layer 1
        "olmo3": (
            transformers.Olmo3Config,
            {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
             "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                    "beta_slow": 1.0, "original_max_position_embeddings": 512,
                                                    "rope_theta": 10000.0}}},
        ),
        # OLMo Hybrid layout: a pre-norm Gated DeltaNet layer (Qwen3.5's sizes, separate projections, beta in (0, 2))
        # then OLMo 3's post-norm full-attention layer without RoPE (NoPE, as released: rope_theta None)
        "olmo_hybrid": (
            transformers.OlmoHybridConfig,
            {**{k: v for k, v in hybrid.items() if k != "head_dim"}, "linear_allow_neg_eigval": True,
             "rope_parameters": {"rope_type": "default", "rope_theta": None}},
        ),
        # Kimi Linear layout: a Kimi Delta Attention layer (2 heads of 8 channels, a decay per channel) with a dense
        # MLP, then multi-latent attention without RoPE (no query latent) with a MoE (4 experts, top-2, a sigmoid
        # router with score-correction bias, a shared expert)
        "kimi_linear": (
            transformers.KimiLinearConfig,
            {"num_key_value_heads": 4, "kv_lora_rank": 24, "q_lora_rank": None, "qk_nope_head_dim": 16,
             "qk_rope_head_dim": 8, "v_head_dim": 12, "layer_types": ["linear_attention", "full_attention"],
             "mlp_layer_types": ["dense", "sparse"], "linear_num_heads": 2, "linear_head_dim": 8,
             "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 32,
             "num_shared_experts": 1, "routed_scaling_factor": 2.5, "num_expert_group": 1, "topk_group": 1,
             "moe_renormalize": True, "model_max_length": 2048},
        ),
        # GLM-4 dense layout: sandwich norms, fused gate/up, interleaved RoPE on half of each head, q/k/v biases
        "glm4": (transformers.Glm4Config, {"head_dim": 16, "attention_bias": True,
                                           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                               "partial_rotary_factor": 0.5}}),
        # GLM-4 9B layout: GLM-4-0414's attention (q/k/v biases, interleaved RoPE on half of each head) and fused
        # gate / up MLP in Llama's pre-norm layers
        "glm": (transformers.GlmConfig, {"head_dim": 16, "attention_bias": True,
                                         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                             "partial_rotary_factor": 0.5}}),
        # SmolLM3 layout: Llama's with no RoPE in layer 1 (a NoPE layer: position only through the mask)
        "smollm3": (transformers.SmolLM3Config, {"no_rope_layers": [1, 0]}),
        # Seed-OSS layout: Qwen2's (biases on q/k/v, none on o_proj) with its own head size
        "seed_oss": (transformers.SeedOssConfig, {"head_dim": 24, "attention_bias": True,
                                                  "attention_out_bias": False}),
        # Gemma 3 layout (text): sandwich norms (1 + w), GeGLU, the embedding scaled by sqrt(64), attention scaled by
        # 1 / sqrt(24) (not the head size 16), a 4-position window on layer 0 with RoPE base 10k, layer 1 global
        # with base 1M and linear scaling 8, tied embeddings
        "gemma3": (
            transformers.Gemma3TextConfig,
            {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 4,
             "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": True,
             "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                    "rope_theta": 1000000.0}}},
        ),
        # Llama 4 layout (text, Scout's: every layer MoE): layer 0 rotates interleaved pairs (llama3-scaled RoPE past
        # position 8), attends in chunks of 4 positions and norms its q/k heads without weights; layer 1 has no RoPE
        # and an attention temperature from position 3 on (floor_scale 4, attn_scale 0.5: both bite in 12 tokens);
        # four top-1 sigmoid-routed experts fed scaled inputs, a shared expert; Maverick's dense layers: override
        # interleave_moe_layer_step=2 (intermediate_size_mlp their width)
        "llama4": (
            transformers.Llama4TextConfig,
            {"head_dim": 16, "intermediate_size": 32, "intermediate_size_mlp": 96, "num_local_experts": 4,
             "num_experts_per_tok": 1, "no_rope_layers": [1, 0], "attention_chunk_size": 4, "use_qk_norm": True,
             "attn_temperature_tuning": True, "floor_scale": 4, "attn_scale": 0.5, "rms_norm_eps": 1e-5,
             "rope_parameters": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8, "rope_theta": 500000.0}},
        ),
        # Cohere (Command R) layout: attention and MLP in parallel on one bias-free LayerNorm, RoPE on interleaved
        # pairs, logits times 0.25, tied embeddings
        "cohere": (transformers.CohereConfig, {"logit_scale": 0.25, "tie_word_embeddings": True}),
        # Cohere2 (Command R7B / A) layout: Cohere's layer; layer 0 a 4-position window that rotates, layer 1 full
        # attention without RoPE
        "cohere2": (transformers.Cohere2Config, {"logit_scale": 0.25, "tie_word_embeddings": True, "sliding_window": 4,
                                                 "layer_types": ["sliding_attention", "full_attention"]}),
        # Cohere2-MoE (Command A+) layout: three layers, the first dense (an MLP 96 wide) with full attention that
        # rotates (the dense prefix's window pattern 1), then a 4-position window that rotates and full attention that
        # does not; 4 experts 32 wide, top-2 logits softmaxed, a shared expert averaged with them; bias-free
        # LayerNorms (rms_norm_eps None; set it for RMSNorms)
        "cohere2_moe": (
            transformers.Cohere2MoeConfig,
            {"num_hidden_layers": 3, "head_dim": 16, "intermediate_size": 32, "prefix_dense_intermediate_size": 96,
             "num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 1, "first_k_dense_replace": 1,
             "sliding_window_pattern": 2, "sliding_window": 4, "rms_norm_eps": None, "logit_scale": 0.25,
             "tie_word_embeddings": True},
        ),
        # Ministral 8B layout: Mistral's with a 4-position window on layer 0, layer 1 full attention
        "ministral": (transformers.MinistralConfig, {"head_dim": 16, "sliding_window": 4,
                                                     "layer_types": ["sliding_attention", "full_attention"]}),
        # Meta CWM layout: Llama's layer, a 4-position window on three of every four layers (the first full), Llama
        # 3's RoPE scaling past 8 positions
        "cwm": (transformers.CwmConfig, {"head_dim": 16, "sliding_window": 4, "num_hidden_layers": 4, "bos_token_id": 1,
                                         "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0,
                                                             "factor": 4.0, "low_freq_factor": 1.0,
                                                             "high_freq_factor": 4.0,
                                                             "original_max_position_embeddings": 8}}),
        # Arcee AFM layout: Llama's with a plain squared-ReLU MLP (up, down), YaRN past 8 positions
        "arcee": (transformers.ArceeConfig, {"head_dim": 16, "rope_parameters": {
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 10000.0}}),
        # Gemma 2 layout: Gemma 3's without q/k norms, a 4-position window on layer 0, one RoPE base (10k); attention
        # scores capped at 0.05 and logits at 0.5 (the releases' 50 and 30 never bite in a tiny random model, whose
        # scores are small: these do, so a model that skipped a cap would compute something else), tied embeddings
        # Gemma (1) layout: one key head (gemma-2b's multi-query attention), heads of 16, GeGLU, (1 + w) norms, the
        # scaled embedding, the head tied
        "gemma": (
            transformers.GemmaConfig,
            {"head_dim": 16, "num_key_value_heads": 1, "tie_word_embeddings": True,
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
        ),
        "gemma2": (
            transformers.Gemma2Config,
            {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 4,
             "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": True,
             "attn_logit_softcapping": 0.05, "final_logit_softcapping": 0.5,
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
        ),
        # Gemma 4 layout (text, dense): sandwich norms (plain weights), GeGLU, the scaled embedding, attention scale
        # 1, normed values; layer 0 a 4-position window (heads of 16, 4 key heads, RoPE base 10k), layer 1 global
        # (heads of 32, 2 key heads whose projections are also the values', proportional RoPE over a quarter of the
        # head, base 1M); a scalar per layer, soft-capped logits, tied embeddings
        "gemma4": (
            transformers.Gemma4TextConfig,
            {"head_dim": 16, "num_key_value_heads": 4, "global_head_dim": 32, "num_global_key_value_heads": 2,
             "attention_k_eq_v": True,
             "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": True,
             "hidden_size_per_layer_input": 0, "final_logit_softcapping": 0.5,
             "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                    "rope_theta": 1000000.0}}},
        ),
    }
    # MiMo-V2-Flash layout: three layers, full / sliding-window (a query and the 3 keys before it) / full; query and
    # key heads of 24 channels, values of 16 (scaled by 0.707), RoPE on a third of each head with a base per kind;
    # the sliding layer with twice the key heads (4) and a sink logit per head; layer 0 dense, then DeepSeek-V3's
    # grouped sigmoid routing (2 groups, 1 chosen) without shared experts; biases on q / k / v (the release has none:
    # they test the grouped split of the fused bias)
    per_arch["mimo_v2_flash"] = (
        transformers.MiMoV2FlashConfig,
        {"num_hidden_layers": 3, "num_key_value_heads": 2, "head_dim": 24, "v_head_dim": 16,
         "attention_value_scale": 0.707, "sliding_window": 4, "attention_bias": True,
         "layer_types": ["full_attention", "sliding_attention", "full_attention"],
         "mlp_layer_types": ["dense", "sparse", "sparse"], "n_routed_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "n_group": 2, "topk_group": 1, "norm_topk_prob": True,
         "routed_scaling_factor": 2.5,
         "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5000000.0,
                                                "partial_rotary_factor": 0.334},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.334}}})
    # MiniMax-M3 layout (minimax_m3: as released, inside the vision-language model; minimax_m3_text: transformers'
    # MiniMaxM3VLForCausalLM and its names): three layers, the first dense (an MLP 96 wide), then MoE (4 experts 32 wide, 2 per token,
    # scaled by 2, a shared expert 48 wide); every MLP gpt-oss's clamped SwiGLU, clamped at 2 here so that the clamp
    # bites; heads of 24 channels, RoPE on half of each; layers 1 and 2 block-sparse: an indexer head of 16 channels
    # per key head keeps each query's 2 best blocks of 2 positions (its own always), so sequences past 4 tokens
    # attend sparsely
    per_arch["minimax_m3_text"] = (
        transformers.MiniMaxM3VLTextConfig,
        {"num_hidden_layers": 3, "head_dim": 24, "intermediate_size": 32, "dense_intermediate_size": 96,
         "shared_intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2,
         "routed_scaling_factor": 2.0, "swiglu_limit": 2.0, "rotary_dim": 12, "partial_rotary_factor": 0.5,
         "rope_theta": 5000000.0, "index_n_heads": 2, "index_head_dim": 16, "index_block_size": 2,
         "index_topk_blocks": 2, "index_local_blocks": 1,
         "layer_types": ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
         "mlp_layer_types": ["dense", "sparse", "sparse"]})
    # LongCat-Flash layout: two layers (four Megatron layers), each two MLA sublayers (query latent 32, key/value latent
    # 24, heads of 16 + 8 rotated channels, values of 12) with dense MLPs 96 wide and a shortcut MoE of 4 experts 32
    # wide and 2 identity experts, 3 per token, scaled by 6; layer norms' epsilon 1e-5 beside the latent norms' 1e-6
    per_arch["longcat_flash"] = (
        transformers.LongcatFlashConfig,
        {"num_hidden_layers": 4, "num_key_value_heads": 4, "intermediate_size": 96, "rms_norm_eps": 1e-5,
         "q_lora_rank": 32, "kv_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
         "head_dim": 8, "n_routed_experts": 4, "zero_expert_num": 2, "moe_topk": 3, "expert_ffn_hidden_size": 32,
         "routed_scaling_factor": 6.0})
    # Gemma 4 26B-A4B layout: the same, with 4 routed experts (2 per token, 32 wide) beside the dense MLP in every
    # layer
    per_arch["gemma4_moe"] = (transformers.Gemma4TextConfig,
                              {**per_arch["gemma4"][1], "enable_moe_block": True, "num_experts": 4,
                               "top_k_experts": 2, "moe_intermediate_size": 32})
    # Gemma 4 E2B / E4B layout: four layers (window, global, window, global; no shared value projection), per-layer
    # inputs 8 wide from their own table, and the last two layers reusing the keys and values of the first two with
    # MLPs twice as wide
    per_arch["gemma4_e"] = (transformers.Gemma4TextConfig,
                            {**per_arch["gemma4"][1], "attention_k_eq_v": False, "num_hidden_layers": 4,
                             "layer_types": ["sliding_attention", "full_attention"] * 2,
                             "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": vocab_size,
                             "num_kv_shared_layers": 2, "use_double_wide_mlp": True})
    if arch not in per_arch:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    cls, extra = per_arch[arch]
    return cls(**{**common, **extra, **overrides})


def build_tiny_model(out_dir: str, arch: str = "qwen2", seed: int = 0, tie_word_embeddings: bool = False,
                     with_tokenizer: bool = True, images: bool = False, **overrides) -> str:
    """Write config.json + model.safetensors (+ the tiny tokenizer) of a random tiny causal LM to ``out_dir``.

    ``images`` (qwen3_vl, qwen3_vl_moe, qwen3_5_vl, qwen2_5_vl, qwen2_vl, glm4v, glm4v_moe, glm46v, gemma3_vl,
    gemma4_vl, ministral3_vl, mistral4_vl, kimi_k25): the tokenizer has the image tokens
    (the config names them) and the directory an image processor (:data:`TINY_IMAGE_PROCESSOR`; Gemma 3's: 16-pixel
    squares), so the model takes images.

    Deterministic from ``seed``. Returns ``out_dir``. Load with ``AutoModelForCausalLM.from_pretrained(out_dir)``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from forge_megatron.models import FLAT_CONFIGS, save_checkpoint

    if images and arch not in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5_vl", "qwen3_5_moe_vl", "glm4v", "glm4v_moe",
                               "glm46v", "gemma3_vl", "gemma4_vl", "ministral3_vl", "mistral4_vl", "kimi_k25",
                               "qwen2_5_vl", "qwen2_vl"):
        raise ValueError(f"images=True is for the Qwen-VL, GLM-4.xV, Gemma 3 / 4, Ministral 3, Mistral Small 4 and "
                         f"Kimi-K2.5 archs, not {arch!r}")
    tok = build_tiny_tokenizer(vision=images)
    overrides.setdefault("vocab_size", len(tok))
    config = tiny_config(arch, tie_word_embeddings=tie_word_embeddings, **overrides)
    if images:
        start, end, pad = tok.convert_tokens_to_ids(list(VISION_TOKENS))
        if _glm_vl(arch):  # GLM-4.xV's config names them image_start / image_end
            config.image_start_token_id, config.image_end_token_id, config.image_token_id = start, end, pad
        elif arch == "gemma3_vl":  # Gemma 3's: boi / eoi and the image token's index
            config.boi_token_index, config.eoi_token_index, config.image_token_index = start, end, pad
        elif arch in ("ministral3_vl", "mistral4_vl"):  # Mistral 3's image token; its row break and end:
            # processor_config.json below
            config.image_token_index = pad
        elif arch == "gemma4_vl":  # Gemma 4's, and its images' tokens seeing each other in the sliding layers
            config.boi_token_id, config.eoi_token_id, config.image_token_id = start, end, pad
            config.text_config.use_bidirectional_attention = "vision"
        else:
            config.vision_start_token_id, config.vision_end_token_id, config.image_token_id = start, end, pad
    if config.get_text_config().vocab_size < len(tok):
        raise ValueError(f"vocab_size {config.get_text_config().vocab_size} is smaller than the tokenizer's "
                         f"{len(tok)} tokens")
    torch.manual_seed(seed)
    if arch in _VL:
        import transformers

        model = getattr(transformers, _VL[arch][2])(config).to(torch.float32)
    elif arch == "mistral4":  # transformers has no AutoModelForCausalLM entry for it (released as a VLM)
        import transformers

        model = transformers.Mistral4ForCausalLM(config).to(torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # routers' score-correction biases (zeros when initialised): make them matter
        for name, buf in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "feed_forward.expert_bias")):  # (LFM2-MoE's: its name)
                buf.copy_(torch.randn(buf.shape) * 0.1)
            elif name.endswith("layer_scalar"):  # Gemma 4's: each layer's output scaled by its own
                buf.copy_(0.5 + torch.rand(buf.shape))
        for name, p in model.named_parameters():  # gpt-oss: sinks as large as trained ones, biases that matter
            if name.endswith(("e_score_correction_bias", "mlp.expert_bias")):  # (ERNIE 4.5's and AFMoE's are
                p.copy_(torch.randn(p.shape) * 0.1)  # frozen parameters, not buffers)
            elif arch == "afmoe" and name.endswith("norm.weight"):
                p.copy_(1.0 + torch.randn(p.shape) * 0.2)  # four norms per layer and the q/k ones: which is which
            elif name.endswith(".sinks"):
                p.copy_(torch.randn(p.shape))
            elif name.endswith(("_proj_bias", "router.bias")):
                p.copy_(torch.randn(p.shape) * 0.1)
            elif arch.startswith("minimax_m3") and "vision" not in name and name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape) * 0.2)  # (1 + w) norms (zeros when initialised): which is which
            elif (".mamba." in name or arch.startswith("nemotron_h")) and \
                    name.endswith(("D", "dt_bias", "mixer.norm.weight", "mamba.norm.weight", "conv1d.bias")):
                p.copy_(p + torch.randn(p.shape) * 0.3)  # Mamba-2's skip, time-step bias, gated norm, conv bias
            elif arch.startswith("exaone") and name.endswith(("q_norm.weight", "k_norm.weight", "layernorm.weight")):
                p.copy_(1.0 + torch.randn(p.shape) * 0.2)  # per-head and post norms: which is which matters
            elif name.endswith(("act_fn.alpha_p", "act_fn.alpha_n")):  # Apertus' xIELU: each layer its own
                p.copy_(p + torch.randn(p.shape) * 0.5)
            elif arch == "apertus" and name.endswith("norm.weight"):
                p.copy_(1.0 + torch.randn(p.shape) * 0.2)  # input, MLP and q/k norms: which is which matters
            elif arch.startswith("cohere") and name.endswith("norm.weight"):
                p.copy_(1.0 + torch.randn(p.shape) * 0.2)  # one norm per layer and the final one: which is which
            elif arch.startswith(("lfm2", "lfm3")) and name.endswith(("layernorm.weight", "norm.weight")):
                p.copy_(1.0 + torch.randn(p.shape) * 0.2)  # q/k norms and the two norms per layer: which is which
            elif arch in ("jais2", "starcoder2") and name.endswith((".bias", "layernorm.weight", "norm.weight")):
                p.copy_((1.0 if name.endswith("weight") else 0.0) + torch.randn(p.shape) * 0.2)  # (biases that matter)
            elif arch in ("axk1", "mellum", "kolibri1", "hy_v3", "hyperclovax", "minimax01", "laguna", "flint") and \
                    name.endswith(("norm.weight", "layernorm.weight")):
                p.copy_(1.0 + torch.randn(p.shape) * 0.2)  # (A.X K1's norm after the experts: which is which)
            elif arch == "dots1" and name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1.0 + torch.randn(p.shape) * 0.2)  # per-head norms: which is which matters
            elif arch in ("minimax_m2", "olmo2", "olmo3", "olmo_hybrid", "olmoe", "flex_olmo") and \
                    name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1.0 + torch.randn(p.shape) * 0.2)  # norm weights over all heads: slicing them matters
            elif arch in ("olmo2", "olmo3", "glm4", "glm4v", "glm46v", "olmo_hybrid", "flex_olmo") and \
                    name.endswith(("layernorm.weight", "o_norm.weight")):
                p.copy_(1.0 + torch.randn(p.shape) * 0.2)  # the norms after attention and MLP: which is which
            elif name.endswith("mm_input_projection_weight"):  # Gemma 3's projector starts at zeros: images matter
                p.copy_(torch.randn(p.shape) * 0.2)
            elif name.endswith("patch_embedder.position_embedding_table"):  # Gemma 4's starts at ones: a constant
                # that would swamp the pixels (a picture's features then differ by 4 % from another's)
                p.copy_(torch.randn(p.shape) * 0.02)
            elif (arch.startswith(("gemma2", "gemma3")) or arch == "gemma") and name.endswith("norm.weight") and \
                    "vision" not in name:
                p.copy_(torch.randn(p.shape) * 0.2)  # (1 + w) norms: four per layer, which is which matters
            elif arch.startswith("gemma4") and name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
                p.copy_(1.0 + torch.randn(p.shape) * 0.2)  # plain-weight norms (four per layer, q / k's, the MoE
                # block's four), the router's input and per-expert scales
            elif arch.startswith("hunyuan") and name.endswith(("query_layernorm.weight", "key_layernorm.weight")):
                p.copy_(1.0 + torch.randn(p.shape) * 0.3)  # uneven: a norm after RoPE then differs from one before
                # (RoPE rotates channel pairs, which leaves an RMS, and so a norm of equal weights, unchanged)
            elif arch == "kimi_linear" and name.endswith(("layernorm.weight", "o_norm.weight")):
                p.copy_(1.0 + torch.randn(p.shape) * 0.2)  # the norms (the gated one too) and the latent norm
            elif ".indexer.k_norm." in name:  # DSA: the indexer's LayerNorm (weight and bias) matters
                p.copy_((1.0 if name.endswith("weight") else 0.0) + torch.randn(p.shape) * 0.2)
            elif arch.startswith(("qwen3_5", "qwen3_next")) and name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape) * 0.2 + (1.0 if "linear_attn" in name else 0.0))  # (1 + w) or w
    os.makedirs(out_dir, exist_ok=True)
    save_checkpoint(model, out_dir)
    if with_tokenizer:
        tok.save_pretrained(out_dir)
    if images:  # the family's own image processor class
        import transformers

        if arch == "gemma3_vl":
            side = config.vision_config.image_size
            transformers.Gemma3ImageProcessor(size={"height": side, "width": side}).save_pretrained(out_dir)
        elif arch in ("ministral3_vl", "mistral4_vl"):  # 4-pixel patches merged 2 x 2, pictures up to 64 pixels
            # a side; the rows'
            # break and end tokens as Pixtral's processor names them
            vc = config.vision_config
            transformers.PixtralImageProcessor(patch_size={"height": vc.patch_size, "width": vc.patch_size},
                                               size={"longest_edge": 64}).save_pretrained(out_dir)
            with open(os.path.join(out_dir, "processor_config.json"), "w") as f:
                json.dump({"image_token": VISION_TOKENS[2], "image_break_token": VISION_TOKENS[0],
                           "image_end_token": VISION_TOKENS[1], "patch_size": vc.patch_size,
                           "spatial_merge_size": config.spatial_merge_size}, f)
        elif arch == "kimi_k25":  # the release's processor settings: 4-pixel patches merged 2 x 2, at most 64
            # patches (16 tokens) an image and 16 on a side
            vc = config.vision_config
            with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
                json.dump({"media_proc_cfg": {"patch_size": vc.patch_size, "merge_kernel_size": 2,
                                              "in_patch_limit": 64, "patch_limit_on_one_side": 16,
                                              "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                                              "fixed_output_tokens": None}}, f)
        elif arch == "gemma4_vl":  # 4-pixel patches pooled 2 x 2, at most 70 tokens (280 patches) an image
            vc = config.vision_config
            transformers.Gemma4ImageProcessor(patch_size=vc.patch_size, pooling_kernel_size=vc.pooling_kernel_size,
                                              max_soft_tokens=70).save_pretrained(out_dir)
        elif arch in FLAT_CONFIGS:  # as their releases write it: the pixel bounds at the top level,
            # CLIP's mean and std
            with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
                json.dump({"min_pixels": TINY_IMAGE_PROCESSOR["size"]["shortest_edge"],
                           "max_pixels": TINY_IMAGE_PROCESSOR["size"]["longest_edge"],
                           **{k: v for k, v in TINY_IMAGE_PROCESSOR.items() if k != "size"},
                           "image_mean": [0.48145466, 0.4578275, 0.40821073],
                           "image_std": [0.26862954, 0.26130258, 0.27577711],
                           "image_processor_type": "Qwen2VLImageProcessor",
                           "processor_class": "Qwen2_5_VLProcessor" if arch == "qwen2_5_vl" else "Qwen2VLProcessor"},
                          f, indent=2)
        else:
            name = "Glm4vImageProcessor" if _glm_vl(arch) else "Qwen2VLImageProcessor"
            getattr(transformers, name)(**TINY_IMAGE_PROCESSOR).save_pretrained(out_dir)
    with open(os.path.join(out_dir, "forge_tiny.json"), "w") as f:
        json.dump({"arch": arch, "seed": seed, "images": images}, f)
    return out_dir


def build_tiny_teacher(out_dir: str, seed: int = 1, num_hidden_layers: int = 4) -> str:
    """A random tiny qwen2 teacher for on-policy distillation: 1.5x the tiny model's width (hidden 96, six heads of
    16, two key-value heads), ``num_hidden_layers`` layers, the same tokenizer (so it scores the student's token
    ids). Returns ``out_dir``."""
    return build_tiny_model(out_dir, seed=seed, hidden_size=96, intermediate_size=192,
                            num_hidden_layers=num_hidden_layers, num_attention_heads=6, num_key_value_heads=2)


def build_tiny_reward_model(out_dir: str, seed: int = 0, num_labels: int = 1) -> str:
    """Write a random tiny reward model to ``out_dir``: ``Qwen2ForSequenceClassification`` (the qwen2 arch's layers,
    a ``num_labels`` head read at the last token, as Skywork-Reward's Llama / Qwen ones are) with the tiny tokenizer
    and its chat template. Served by forge-engine on SGLang's /classify (rollout/reward_model.py). Returns
    ``out_dir``."""
    import torch
    from transformers import AutoModelForSequenceClassification

    tok = build_tiny_tokenizer()
    config = tiny_config("qwen2", vocab_size=len(tok))
    config.num_labels = num_labels
    config.architectures = ["Qwen2ForSequenceClassification"]
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # a head whose scores spread over a few units, as a trained reward model's do
        model.score.weight.normal_(0.0, 0.5)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def finetune_on_chats(model_dir: str, chats: list[tuple], tools: list | None = None,
                      steps: int = 100, lr: float = 5e-3, seed: int = 0) -> str:
    """Teach the model in ``model_dir`` to answer each chat with its fixed text (greedy), in place; return the dir.

    ``chats`` are (messages before the assistant turn, assistant text) pairs, or triples whose third item holds
    extra chat-template variables for that chat (``tools`` there replaces ``tools`` for that chat); the loss is on
    the answer and the end-of-turn token only (the tokenizer's eos is appended unless the answer ends with one of
    the model's end-of-turn tokens already, e.g. a harmony ``<|call|>``). A few hundred Adam steps on CPU make the
    tiny model reproduce them exactly, which gives tests and demos a model with real weights and logprobs but a
    known output (e.g. a tool call).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from forge_megatron.middleware.gateway_sessions import model_end_ids

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ends = {tok.eos_token_id, *model_end_ids(model_dir)}
    batch = []
    for messages, answer, *kwargs in chats:
        extra = dict(kwargs[0]) if kwargs else {}
        text = tok.apply_chat_template(messages, tools=extra.pop("tools", tools), add_generation_prompt=True,
                                       tokenize=False, **extra)
        prompt = tok.encode(text, add_special_tokens=False)
        target = tok.encode(answer, add_special_tokens=False)
        if not target or target[-1] not in ends:  # an answer may end with another end-of-turn token itself
            target.append(tok.eos_token_id)
        batch.append((torch.tensor([prompt + target]), torch.tensor([[-100] * len(prompt) + target])))
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        sum(model(input_ids=ids, labels=labels).loss for ids, labels in batch).backward()
        opt.step()
    model.save_pretrained(model_dir)
    return model_dir
