"""Bridge unit tests (0 GPUs, no process groups): HF config -> GPTConfig per family, refusals of options the shared
layout cannot express, and the tensor transforms (QKV per query group, GLU halves, TP split/join) against
hand-built layouts.
"""

import pytest
import torch
import transformers

from forge_megatron.bridge import Bridge, MappingError, ParallelLayout, UnsupportedModelError, gpt_config_from_hf
from forge_megatron.models.tiny import tiny_config


def _hf(arch, **kw):
    cfg = tiny_config(arch, **kw).to_dict()
    cfg["architectures"] = {"qwen2": ["Qwen2ForCausalLM"], "llama": ["LlamaForCausalLM"], "qwen3": ["Qwen3ForCausalLM"],
                            "qwen3_moe": ["Qwen3MoeForCausalLM"], "mistral": ["MistralForCausalLM"]}[arch]
    return cfg


def test_config_per_family():
    q2, ll, q3, moe = (gpt_config_from_hf(_hf(a)) for a in ("qwen2", "llama", "qwen3", "qwen3_moe"))
    assert (q2.add_qkv_bias, q2.qk_layernorm, q2.num_moe_experts) == (True, False, None)
    assert (ll.add_qkv_bias, ll.qk_layernorm) == (False, False)
    assert (q3.add_qkv_bias, q3.qk_layernorm, q3.head_dim) == (False, True, 16)
    assert (moe.num_moe_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size) == (4, 2, 32)
    assert moe.moe_router_pre_softmax is False  # norm_topk_prob=True: softmax over the top-k logits
    assert gpt_config_from_hf(_hf("qwen3_moe", norm_topk_prob=False)).moe_router_pre_softmax is True
    assert gpt_config_from_hf(_hf("llama", rope_theta=500000.0)).rotary_base == 500000.0
    assert gpt_config_from_hf(_hf("llama", attention_bias=True)).add_qkv_bias is True
    llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = gpt_config_from_hf({**_hf("llama"), "rope_scaling": llama31, "rope_theta": 500000.0})
    assert (cfg.rope_scaling, cfg.rotary_base) == (llama31, 500000.0)
    old_style = gpt_config_from_hf({**_hf("qwen2"), "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                                     "original_max_position_embeddings": 32768}})
    assert old_style.rope_scaling["rope_type"] == "yarn"
    assert gpt_config_from_hf(_hf("qwen3")).rope_scaling is None  # transformers 5 writes a "default" entry


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'"),
    ({"architectures": []}, "no 'architectures' entry"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "RoPE scaling type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "'llama3' needs 'low_freq_factor'"),
    ({"rope_scaling": {"type": "yarn"}}, "'yarn' needs a positive 'factor'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor != 1 is not supported for this family"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ({"use_sliding_window": True}, "use_sliding_window=True"),
])
def test_unsupported_options_are_refused(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        gpt_config_from_hf({**_hf("llama"), **change})


def _glm(**kw):
    return {**tiny_config("glm4_moe", **kw).to_dict(), "architectures": ["Glm4MoeForCausalLM"]}


def test_glm4_moe_config_maps_to_megatrons_sigmoid_router_shared_experts_and_dense_layers():
    cfg = gpt_config_from_hf(_glm())
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.ffn_hidden_size) == (4, 2, 32, 128)
    assert (cfg.moe_dense_layers, cfg.moe_shared_ffn_hidden_size, cfg.rotary_percent) == (1, 32, 0.5)
    assert (cfg.add_qkv_bias, cfg.qk_layernorm) == (True, True)
    assert cfg.extra == {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                         "moe_router_bias_update_rate": 0.0, "moe_router_topk_scaling_factor": 2.5,
                         "moe_router_num_groups": None, "moe_router_group_topk": None, "moe_router_dtype": "fp32"}
    assert gpt_config_from_hf(_glm(use_qk_norm=False, routed_scaling_factor=1.0)).extra[
        "moe_router_topk_scaling_factor"] is None
    grouped = gpt_config_from_hf(_glm(n_routed_experts=8, n_group=2, topk_group=1)).extra
    assert (grouped["moe_router_num_groups"], grouped["moe_router_group_topk"]) == (2, 1)  # top-2 / 1 group = 2
    bridge = Bridge(_glm())
    layer0 = [n for n in bridge.canonical_names() if ".layers.0." in n]
    layer1 = [n for n in bridge.canonical_names() if ".layers.1." in n]
    assert "decoder.layers.0.mlp.linear_fc1.weight" in layer0 and not any("router" in n for n in layer0)
    assert {"decoder.layers.1.mlp.router.expert_bias", "decoder.layers.1.mlp.shared_experts.linear_fc1.weight"} \
        <= set(layer1) and "decoder.layers.1.mlp.linear_fc1.weight" not in layer1
    assert bridge.hf_names("decoder.layers.1.mlp.router.expert_bias") == \
        ["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bridge.hf_shape("model.layers.1.mlp.shared_experts.up_proj.weight") == (32, 64)


@pytest.mark.parametrize("change,message", [
    ({"n_routed_experts": 8, "n_group": 2, "topk_group": 2}, "topk_group != 2"),
    ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    ({"n_shared_experts": 0}, "n_shared_experts=0"),
])
def test_glm4_moe_options_megatron_cannot_match_are_refused(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        gpt_config_from_hf({**_glm(), **change})


def _minimax(**kw):
    return {**tiny_config("minimax_m2", **kw).to_dict(), "architectures": ["MiniMaxM2ForCausalLM"]}


def test_minimax_m2_config_maps_to_all_heads_qk_norms_and_mixtral_expert_names():
    cfg = gpt_config_from_hf(_minimax())
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.moe_dense_layers) == (4, 2, 32, 0)
    assert (cfg.qk_layernorm, cfg.qk_layernorm_all_heads, cfg.add_qkv_bias, cfg.rotary_dim) == (True, True, False, 8)
    assert cfg.moe_shared_ffn_hidden_size is None and cfg.extra["moe_router_topk_scaling_factor"] is None
    # fields transformers' and SGLang's MiniMax-M2 routers do not read are not applied either
    ignored = gpt_config_from_hf({**_minimax(), "routed_scaling_factor": 2.0, "n_group": 4, "topk_group": 1}).extra
    assert ignored["moe_router_topk_scaling_factor"] is None and ignored["moe_router_num_groups"] is None
    assert cfg.extra["moe_router_score_function"] == "sigmoid" and cfg.extra["moe_router_enable_expert_bias"]
    # the released configs give the rotary width as rotary_dim only
    raw = {k: v for k, v in _minimax().items() if k != "rope_parameters"}
    assert gpt_config_from_hf({**raw, "rope_theta": 5e6, "rotary_dim": 8}).rotary_percent == 0.5
    bridge = Bridge(_minimax(num_mtp_modules=1))
    assert bridge.hf_names("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight") == \
        ["model.layers.1.block_sparse_moe.experts.3.w1.weight", "model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    assert bridge.hf_names("decoder.layers.0.mlp.router.expert_bias") == \
        ["model.layers.0.block_sparse_moe.e_score_correction_bias"]
    assert bridge.hf_shape("model.layers.0.self_attn.q_norm.weight") == (64,)  # 4 heads x 16
    assert bridge.hf_shape("model.layers.0.self_attn.k_norm.weight") == (32,)  # 2 key heads x 16
    q_norm = "decoder.layers.0.self_attention.q_layernorm.weight"
    assert all(torch.equal(t, torch.arange(64.0)) for t in bridge.tp_split(q_norm, torch.arange(64.0), 2))  # whole
    assert bridge.is_mtp_tensor("model.layers.2.self_attn.q_proj.weight")  # layer num_hidden_layers: an MTP module
    assert not bridge.is_mtp_tensor("model.layers.3.self_attn.q_proj.weight")


@pytest.mark.parametrize("change,message", [
    ({"qk_norm_type": "per_head"}, "qk_norm_type='per_head'"),
    ({"use_routing_bias": False}, "use_routing_bias=False"),
    ({"shared_intermediate_size": 64}, "shared experts are not supported by the minimax_m2 family"),
    ({"attn_type_list": [0, 1]}, "lightning"),
    ({"num_experts_per_tok": 1}, "norm_topk_prob"),
])
def test_minimax_m2_options_megatron_cannot_match_are_refused(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        gpt_config_from_hf({**_minimax(), **change})


def test_quantized_checkpoints_other_than_block_fp8_are_refused():
    """Block-wise FP8 checkpoints are read dequantized (tests/weight_sync/test_fp8.py); the bridge's own config is
    then unquantized. Other methods, and FP8 without blocks, are refused by name."""
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    bridge = Bridge({**_hf("qwen3"), "quantization_config": fp8})
    assert "quantization_config" not in bridge.hf_config and bridge.source_quantization == fp8
    with pytest.raises(UnsupportedModelError, match="a awq checkpoint: only block-wise fp8 checkpoints are read"):
        gpt_config_from_hf({**_hf("qwen3"), "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(UnsupportedModelError, match="no weight_block_size"):
        gpt_config_from_hf({**_hf("qwen3"), "quantization_config": {"quant_method": "fp8"}})


def test_mistral_is_the_llama_layout_without_a_sliding_window():
    cfg = gpt_config_from_hf(_hf("mistral"))
    assert (cfg.add_qkv_bias, cfg.qk_layernorm, cfg.head_dim, cfg.rope_scaling) == (False, False, 16, None)
    with pytest.raises(UnsupportedModelError, match="sliding_window=512 is not supported"):
        gpt_config_from_hf({**_hf("mistral"), "sliding_window": 512})
    assert gpt_config_from_hf({**_hf("mistral"), "sliding_window": 4096}).num_layers == 2  # >= the context: none


def test_moe_with_dense_layers_is_refused():
    with pytest.raises(UnsupportedModelError, match="dense layers"):
        gpt_config_from_hf(_hf("qwen3_moe", mlp_only_layers=[0]))


def test_qkv_is_grouped_per_query_group():
    bridge = Bridge(_hf("qwen2"))  # 4 heads, 2 groups, head dim 16
    h, d = 16, 64
    q = torch.arange(4 * h * d, dtype=torch.float32).reshape(4 * h, d)
    k, v = -torch.arange(2 * h * d, dtype=torch.float32).reshape(2 * h, d), torch.rand(2 * h, d)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    hf = {"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
          "model.layers.0.self_attn.v_proj.weight": v}
    qkv = bridge.from_hf(name, hf)
    expected = torch.cat([q[:2 * h], k[:h], v[:h], q[2 * h:], k[h:], v[h:]])  # [q0 q1 k0 v0 | q2 q3 k1 v1]
    assert torch.equal(qkv, expected)
    assert all(torch.equal(a, hf[n]) for n, a in bridge.to_hf(name, qkv).items())


def test_tp_split_and_join_are_inverse():
    bridge = Bridge(_hf("qwen3_moe"))
    full = torch.randn(64, 64)
    fc1 = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    shards = bridge.tp_split(fc1, full, 2)
    assert torch.equal(shards[1], torch.cat([full[16:32], full[48:64]]))  # [gate_1; up_1]
    assert torch.equal(bridge.tp_join(fc1, shards), full)
    proj = "decoder.layers.0.self_attention.linear_proj.weight"
    assert torch.equal(bridge.tp_split(proj, full, 4)[2], full[:, 32:48])
    router = "decoder.layers.0.mlp.router.weight"
    assert all(s is full for s in bridge.tp_split(router, full, 2))


def test_names_offsets_and_ownership():
    bridge = Bridge(_hf("qwen3_moe"))
    layout = ParallelLayout(pp=2, ep=2)
    assert bridge.rename("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight", 1, 2) == \
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"
    assert bridge.expert_rank("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight", layout) == 1
    stage1 = bridge.stage_names(layout, 1)
    assert stage1[-2:] == ["decoder.final_layernorm.weight", "output_layer.weight"]
    assert "embedding.word_embeddings.weight" not in stage1 and all(".layers.0." not in n for n in stage1)
    assert len(bridge.canonical_names()) == 2 + 1 + 2 * (4 + 2 + 1 + 2 * 4)  # embed, norm, head + 2 layers
    with pytest.raises(MappingError, match="has no mapping for family 'qwen3_moe'"):
        bridge.rule("decoder.layers.0.mlp.linear_fc1.weight")


def test_padded_vocabulary_rows_are_zero_in_and_dropped_out():
    bridge = Bridge(_hf("llama", vocab_size=400), vocab_size=512)  # Megatron pads to a multiple of 128
    emb = torch.randn(400, 64)
    full = bridge.from_hf("embedding.word_embeddings.weight", {"model.embed_tokens.weight": emb})
    assert full.shape == (512, 64) and torch.equal(full[:400], emb) and not full[400:].any()
    assert torch.equal(bridge.to_hf("output_layer.weight", full)["lm_head.weight"], emb)
    with pytest.raises(ValueError, match=r"vocab_size 300 is smaller than the HF vocabulary \(400\)"):
        Bridge(_hf("llama", vocab_size=400), vocab_size=300)


# Qwen2.5-VL-7B-Instruct's config.json as released (flat: no text_config), its vision_config shortened
QWEN2_5_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 128000,
    "max_window_layers": 28, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2}}


def test_qwen2_5_vl_release_config_maps_as_transformers_reads_it():
    """Qwen2.5-VL's flat release config (RoPE as rope_scaling {"type": "mrope"}) maps to the Qwen2 layout with biases
    on q/k/v, its RoPE plain (a text token's mRoPE), the names as released (model.*, visual.*); transformers' nested
    reading of the same file maps alike; images: contiguous sections, the tower under visual.; a flat config is
    refused for a release that has a text_config."""
    import transformers

    from forge_megatron.bridge.families import text_view
    from forge_megatron.multimodal import vision_spec

    flat = Bridge(QWEN2_5_VL_7B)
    cfg = flat.cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_query_groups, cfg.add_qkv_bias, cfg.qk_layernorm) == \
        (28, 3584, 4, True, False)
    assert cfg.rotary_base == 1000000.0 and cfg.rope_scaling is None and cfg.rotary_percent == 1.0
    assert flat.hf_names("embedding.word_embeddings.weight") == ["model.embed_tokens.weight"]
    assert flat.hf_names("output_layer.weight") == ["lm_head.weight"]
    assert flat.hf_names("decoder.final_layernorm.weight") == ["model.norm.weight"]
    assert text_view(QWEN2_5_VL_7B)["rope_parameters"] == {"mrope_section": [16, 24, 24], "rope_type": "default",
                                                           "rope_theta": 1000000.0}
    nested = transformers.Qwen2_5_VLConfig(**{k: v for k, v in QWEN2_5_VL_7B.items() if k != "torch_dtype"})
    assert Bridge({**nested.to_dict(), "architectures": QWEN2_5_VL_7B["architectures"]}).cfg == cfg
    spec = vision_spec(QWEN2_5_VL_7B)
    assert (spec.image_token_id, spec.merge, spec.mrope_section, spec.interleaved, spec.vision_prefix) == \
        (151655, 2, (16, 24, 24), False, "visual.")
    qwen3_vl = {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
                **{k: v for k, v in QWEN2_5_VL_7B.items() if k not in ("architectures", "model_type")}}
    with pytest.raises(UnsupportedModelError, match="Qwen3VLForConditionalGeneration config has no text_config"):
        Bridge(qwen3_vl)


def test_vision_language_releases_configs_as_published():
    """The released config.json files of the vision-language models whose language model trains (written as the hub
    has them, transformers 4 style: rope_theta and rope_scaling in text_config, the text model_type of the release)
    map to the language model the bridge builds; the Kimi-K2.5 release's int4 quantization_config in its
    text_config is seen and pointed to int4-to-bf16, and its bf16 copy (none) maps. Sizes shrunk, fields kept."""
    qwen3_vl_moe = {"architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe",
                    "tie_word_embeddings": False, "text_config": {
                        "model_type": "qwen3_vl_moe_text", "hidden_size": 64, "intermediate_size": 96,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                        "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6, "vocab_size": 400,
                        "max_position_embeddings": 262144, "rope_theta": 5000000, "rope_scaling": {
                            "rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}},
                    "vision_config": {"depth": 27}}
    cfg = Bridge(qwen3_vl_moe).cfg
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.rotary_base) == (8, 2, 24, 5e6)
    assert (cfg.moe_router_topk_renorm, cfg.qk_layernorm, cfg.rope_scaling, cfg.tie_word_embeddings) == \
        (True, True, None, False)
    kimi_text = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
                 "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1,
                 "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                 "routed_scaling_factor": 2.827, "norm_topk_prob": True, "q_lora_rank": 32, "kv_lora_rank": 24,
                 "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "vocab_size": 400,
                 "rms_norm_eps": 1e-5, "max_position_embeddings": 262144, "rope_theta": 50000.0,
                 "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                                  "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                 "tie_word_embeddings": False}
    int4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                           "group_size": 32}}}, "ignore": ["lm_head", "re:.*self_attn.*"]}
    kimi = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": {**kimi_text, "quantization_config": int4}, "vision_config": {"hidden_size": 1152}}
    with pytest.raises(UnsupportedModelError, match="compressed-tensors .*int4-to-bf16.*--weight-sync-int4"):
        Bridge(kimi)
    bridge = Bridge({**kimi, "text_config": kimi_text})
    cfg = bridge.cfg
    assert (bridge.family.name, cfg.multi_latent_attention, cfg.num_moe_experts, cfg.moe_dense_layers) == \
        ("deepseek_v3", True, 8, 1)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 64.0
    assert bridge.hf_names("output_layer.weight") == ["language_model.lm_head.weight"]
    assert bridge.hf_names("embedding.word_embeddings.weight") == ["language_model.model.embed_tokens.weight"]
    glm45v = {"architectures": ["Glm4vMoeForConditionalGeneration"], "model_type": "glm4v_moe",
              "text_config": {"model_type": "glm4v_moe_text", "hidden_size": 64, "intermediate_size": 128,
                              "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "head_dim": 16, "partial_rotary_factor": 0.5,
                              "attention_bias": True, "n_routed_experts": 8, "n_shared_experts": 1,
                              "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                              "norm_topk_prob": True, "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-5,
                              "vocab_size": 400, "max_position_embeddings": 65536, "rope_theta": 10000.0,
                              "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1]},
                              "tie_word_embeddings": False}}
    cfg = Bridge(glm45v).cfg
    assert (cfg.add_qkv_bias, cfg.qk_layernorm, cfg.rotary_percent, cfg.rotary_interleaved) == (True, False, 0.5, False)
    # GLM-4.6V as transformers 5.x holds it: the dense language model its text_config names (GLM-4.1V's); an MoE one
    # is refused by name
    from forge_megatron.models.tiny import tiny_config

    glm46v = {**tiny_config("glm46v", vocab_size=400).to_dict(), "architectures": ["Glm46VForConditionalGeneration"]}
    bridge = Bridge(glm46v)
    assert (bridge.family.name, bridge.family.multimodal, bridge.cfg.add_qkv_bias, bridge.cfg.num_moe_experts) == \
        ("glm4", True, True, None)
    assert bridge.hf_names("embedding.word_embeddings.weight") == ["model.language_model.embed_tokens.weight"]
    with pytest.raises(UnsupportedModelError, match="'glm4v_moe_text' language model is not supported"):
        Bridge({**glm46v, "text_config": glm45v["text_config"]})
    ministral = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
                 "text_config": {"model_type": "ministral3", "hidden_size": 64, "intermediate_size": 128,
                                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "head_dim": 16, "vocab_size": 400, "rms_norm_eps": 1e-5, "sliding_window": None,
                                 "max_position_embeddings": 262144, "rope_parameters": {
                                     "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                                     "original_max_position_embeddings": 16384, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}},
                 "vision_config": {"hidden_size": 1024}}
    bridge = Bridge(ministral)
    assert bridge.cfg.query_scaling == (0.1, 16384) and bridge.cfg.rope_scaling["factor"] == 16.0
    assert bridge.hf_names("output_layer.weight") == ["language_model.lm_head.weight"]
    small31 = {**ministral, "text_config": {**ministral["text_config"], "model_type": "mistral",
                                            "rope_parameters": {"rope_type": "default", "rope_theta": 1e9}}}
    assert Bridge(small31).cfg.query_scaling is None  # Mistral-Small 3.1's text model: no query scaling
    with pytest.raises(UnsupportedModelError, match="sliding_window=4096 is not supported"):
        Bridge({**ministral, "text_config": {**ministral["text_config"], "sliding_window": 4096}})


def test_mistral_small_4_config_as_published():
    """Mistral Small 4 (119B-A6B) as transformers documents its release (Mistral4Config's defaults: the
    checkpoint's sizes) inside Mistral3ForConditionalGeneration: multi-latent attention with YaRN (factor 128 over
    8192 positions) and Llama 4's query scaling, 128 softmax-routed experts (4 per token, renormalised) plus one
    shared, stacked on disk; group-limited routing and a sigmoid scoring function are refused by name."""
    from transformers import Mistral4Config

    text = Mistral4Config().to_dict()
    release = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
               "text_config": text, "vision_config": {"hidden_size": 1024}}
    bridge = Bridge(release)
    cfg = bridge.cfg
    assert bridge.family.name == "mistral4" and bridge.family.multimodal and cfg.multi_latent_attention
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.q_lora_rank,
            cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == (36, 4096, 32, 256, 1024, 64, 64, 128)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.moe_shared_ffn_hidden_size,
            cfg.moe_dense_layers, cfg.moe_router_pre_softmax) == (128, 4, 2048, 2048, 0, False)
    assert cfg.extra["moe_router_score_function"] == "softmax" and "moe_router_enable_expert_bias" not in cfg.extra
    assert cfg.query_scaling == (0.1, 8192) and cfg.rope_scaling["factor"] == 128.0 and cfg.rotary_percent == 1.0
    assert bridge.hf_names("decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight") == \
        ["language_model.model.layers.3.mlp.experts.gate_up_proj"]
    assert bridge.hf_shape("language_model.model.layers.3.mlp.experts.gate_up_proj") == (128, 4096, 4096)
    assert bridge.hf_shape("language_model.model.layers.3.mlp.experts.down_proj") == (128, 4096, 2048)
    assert Bridge({**text, "architectures": ["Mistral4ForCausalLM"]}).hf_names("output_layer.weight") == \
        ["lm_head.weight"]
    assert Bridge({**text, "architectures": ["Mistral4ForCausalLM"], "norm_topk_prob": False}).cfg \
        .moe_router_pre_softmax
    with pytest.raises(UnsupportedModelError, match="n_group=8, topk_group=4: group-limited softmax routing"):
        Bridge({**text, "architectures": ["Mistral4ForCausalLM"], "n_group": 8, "topk_group": 4})
    with pytest.raises(UnsupportedModelError, match="scoring_func='sigmoid'"):
        Bridge({**text, "architectures": ["Mistral4ForCausalLM"], "scoring_func": "sigmoid"})


def test_olmo_hybrid_config_as_published():
    """OLMo Hybrid 7B as transformers documents it (OlmoHybridConfig's defaults): 32 layers, every fourth OLMo 3's
    post-norm attention (30 heads), the others pre-norm Gated DeltaNet (30 key and value heads of 96 and 192
    channels, beta in (0, 2)); RoPE exactly where transformers' model builds a rotary embedding (no rope_theta: the
    released checkpoints' NoPE); the released names of the linear layers' norms and convolutions."""
    from transformers import OlmoHybridConfig, OlmoHybridModel

    base = {**OlmoHybridConfig().to_dict(), "architectures": ["OlmoHybridForCausalLM"]}
    bridge = Bridge(base)
    cfg = bridge.cfg
    assert bridge.family.name == "olmo_hybrid" and cfg.hybrid and cfg.linear_pre_norm and cfg.post_norm
    assert not cfg.pre_norm and not cfg.zero_centered_norm and not cfg.attention_output_gate
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim) == \
        (32, 3840, 30, 30, 128)
    assert "".join("LF"[not x] for x in cfg.linear_attention) == "LLLF" * 8
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, cfg.linear_beta_scale, cfg.linear_norm_epsilon) == (30, 30, 96, 192, 2.0, 1e-5)
    assert bridge.hf_names("decoder.layers.0.input_layernorm.weight") == ["model.layers.0.input_layernorm.weight"]
    assert bridge.hf_names("decoder.layers.0.pre_mlp_layernorm.weight") == \
        ["model.layers.0.post_attention_layernorm.weight"]
    assert bridge.hf_names("decoder.layers.3.post_self_attn_layernorm.weight") == \
        ["model.layers.3.post_attention_layernorm.weight"]
    assert bridge.hf_shape("model.layers.0.linear_attn.k_conv1d.weight") == (2880, 1, 4)
    assert bridge.hf_shape("model.layers.0.linear_attn.v_conv1d.weight") == (5760, 1, 4)
    assert bridge.hf_shape("model.layers.0.linear_attn.o_proj.weight") == (3840, 5760)
    assert bridge.hf_shape("model.layers.3.self_attn.o_proj.weight") == (3840, 3840)
    assert Bridge({**base, "linear_allow_neg_eigval": False}).cfg.linear_beta_scale == 1.0
    small = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, intermediate_size=64, vocab_size=128,
                 pad_token_id=0, eos_token_id=1)
    for rope in ({"rope_theta": None}, {"rope_parameters": None}, {"rope_parameters": {"rope_type": "default",
                                                                                       "rope_theta": 5e5}}):
        hf = OlmoHybridConfig.from_dict({**small, **rope})
        nope = OlmoHybridModel(hf).rotary_emb is None
        cfg = Bridge({**hf.to_dict(), "architectures": ["OlmoHybridForCausalLM"]}).cfg
        assert (cfg.nope_layers is not None and all(cfg.nope_layers)) == nope, rope
    assert nope is False and cfg.rotary_base == 5e5
    with pytest.raises(UnsupportedModelError, match="sliding_window / clip_qkv in an OLMo Hybrid config"):
        Bridge({**base, "sliding_window": 4096})


def test_kimi_linear_config_as_published():
    """Kimi-Linear-48B-A3B as its config states it (Moonshot's field names: ``linear_attn_config`` with 1-indexed
    full-attention layers, ``num_experts``, ``num_experts_per_token``, ...; transformers' KimiLinearConfig resolves
    them): 27 layers, 7 of them multi-latent attention without RoPE (no query latent), the others Kimi Delta
    Attention (32 heads of 128); 256 sigmoid-routed experts (8 per token, scaled 2.446) and a shared one after a
    dense first layer; the layers' shared ``self_attn.`` names take their kind's shapes."""
    full = [4, 8, 12, 16, 20, 24, 27]
    release = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 163840,
               "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_hidden_layers": 27,
               "num_attention_heads": 32, "num_key_value_heads": 32, "num_experts": 256, "num_experts_per_token": 8,
               "num_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.446,
               "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
               "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
               "v_head_dim": 128, "model_max_length": 1048576, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
               "linear_attn_config": {"full_attn_layers": full, "kda_layers": [i for i in range(1, 28) if i not in full],
                                      "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4}}
    bridge = Bridge(release)
    cfg = bridge.cfg
    assert bridge.family.name == "kimi_linear" and cfg.linear_attention_kind == "kimi_delta"
    assert [i + 1 for i, x in enumerate(cfg.linear_attention) if not x] == full
    assert cfg.multi_latent_attention and cfg.q_lora_rank is None and all(cfg.nope_layers) and cfg.rope_scaling is None
    assert (cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_conv_kernel) == (32, 128, 4)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.moe_shared_ffn_hidden_size,
            cfg.moe_dense_layers, cfg.max_position_embeddings) == (256, 8, 1024, 1024, 1, 1048576)
    assert cfg.extra["moe_router_topk_scaling_factor"] == 2.446 and cfg.extra["moe_router_enable_expert_bias"]
    assert bridge.hf_shape("model.layers.0.self_attn.q_proj.weight") == (4096, 2304)  # Kimi Delta Attention
    assert bridge.hf_shape("model.layers.3.self_attn.q_proj.weight") == (32 * 192, 2304)  # MLA (layer 4)
    assert bridge.hf_shape("model.layers.0.self_attn.A_log") == (1, 1, 32, 1)
    assert bridge.hf_names("decoder.layers.5.mlp.experts.local_experts.7.linear_fc1.weight") == \
        ["model.layers.5.block_sparse_moe.experts.7.w1.weight", "model.layers.5.block_sparse_moe.experts.7.w3.weight"]
    assert bridge.hf_names("decoder.layers.5.mlp.shared_experts.linear_fc2.weight") == \
        ["model.layers.5.block_sparse_moe.shared_experts.down_proj.weight"]
    assert bridge.hf_names("decoder.layers.0.mlp.linear_fc2.weight") == ["model.layers.0.mlp.down_proj.weight"]
    with pytest.raises(UnsupportedModelError, match="moe_router_activation_func='softmax'"):
        Bridge({**release, "moe_router_activation_func": "softmax"})
    with pytest.raises(ValueError, match="tp=3 does not divide num_query_groups=32"):
        bridge.check_layout(ParallelLayout(tp=3))
    small = Bridge({**release, "linear_attn_config": {**release["linear_attn_config"], "head_dim": 3}})
    with pytest.raises(ValueError, match="tp=4 does not divide 2 \\* linear_head_dim=6"):
        small.check_layout(ParallelLayout(tp=4))  # the gates' down projections, split over TP then gathered


def test_sparse_attention_releases_configs_as_published():
    """DeepSeek-V3.2's config.json as its FP8 release has it (transformers 4 style) and GLM-5's map to DeepSeek
    sparse attention with the release's indexer sizes and RoPE pairs; GLM's shared-indexer schedule leaves those
    layers without indexer tensors; fields of later GLM releases the bridge does not compute are refused by name.
    Sizes shrunk, fields kept."""
    dsv32 = {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "hidden_size": 64,
             "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
             "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 4,
             "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
             "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "q_lora_rank": 32,
             "kv_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
             "index_head_dim": 16, "index_n_heads": 8, "index_topk": 2048, "vocab_size": 400, "rms_norm_eps": 1e-6,
             "max_position_embeddings": 163840, "rope_theta": 10000,
             "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
             "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
             "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}}
    bridge = Bridge(dsv32)
    cfg = bridge.cfg
    assert (cfg.dsa_index_heads, cfg.dsa_index_head_dim, cfg.dsa_index_topk, cfg.dsa_rope_interleaved,
            cfg.dsa_shared_layers) == (8, 16, 2048, False, None)
    assert cfg.multi_latent_attention and cfg.rope_scaling["factor"] == 40 and cfg.moe_dense_layers == 1
    assert bridge.hf_names("decoder.layers.2.self_attention.core_attention.indexer.linear_wq_b.weight") == \
        ["model.layers.2.self_attn.indexer.wq_b.weight"]
    assert bridge.hf_shape("model.layers.0.self_attn.indexer.k_norm.bias") == (16,)
    assert bridge.is_mtp_tensor("model.layers.3.self_attn.indexer.wk.weight")  # the MTP layer's indexer left out
    glm5 = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": 64,
            "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
            "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
            "norm_topk_prob": True, "q_lora_rank": 32, "kv_lora_rank": 24, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8, "v_head_dim": 16, "index_head_dim": 16, "index_n_heads": 4, "index_topk": 2048,
            "rope_interleave": True, "indexer_rope_interleave": True, "vocab_size": 400, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 202752, "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
            "num_nextn_predict_layers": 1, "tie_word_embeddings": False}
    cfg = Bridge(glm5).cfg
    assert (cfg.dsa_index_heads, cfg.dsa_rope_interleaved, cfg.dsa_shared_layers, cfg.rotary_base) == \
        (4, True, None, 1e6)
    assert Bridge({**glm5, "indexer_rope_interleave": False}).cfg.dsa_rope_interleaved is False
    shared = Bridge({**glm5, "index_topk_freq": 2, "index_skip_topk_offset": 1})
    assert shared.cfg.dsa_shared_layers == (False, True, False, True)
    indexer_layers = {int(n.split(".")[2]) for n in shared.canonical_names() if ".indexer." in n}
    assert indexer_layers == {0, 2}
    for key, value in (("index_kpool", 4), ("mla_use_nope", True), ("mhc", True)):
        with pytest.raises(UnsupportedModelError, match=key):
            Bridge({**glm5, key: value})
    with pytest.raises(UnsupportedModelError, match="DeepseekV32ForCausalLM / GlmMoeDsaForCausalLM"):
        Bridge({**dsv32, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"})


def _mimo_released():
    """MiMo-V2-Flash's config.json as released (its own field names; the layer pattern transformers assumes)."""
    n = 48
    pattern = [0 if i == 0 or (i + 1) % 6 == 0 else 1 for i in range(n)]
    return {"architectures": ["MiMoV2FlashForCausalLM"], "model_type": "mimo_v2_flash", "num_hidden_layers": n,
            "hidden_size": 4096, "intermediate_size": 16384, "num_attention_heads": 64, "num_key_value_heads": 4,
            "head_dim": 192, "v_head_dim": 128, "vocab_size": 152576, "max_position_embeddings": 131072,
            "rope_theta": 5000000, "swa_rope_theta": 10000, "partial_rotary_factor": 0.334, "rope_scaling": None,
            "layernorm_epsilon": 1e-5, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
            "hybrid_layer_pattern": pattern, "sliding_window_size": 128, "sliding_window": 128,
            "swa_num_attention_heads": 64, "swa_num_key_value_heads": 8, "swa_head_dim": 192, "swa_v_head_dim": 128,
            "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
            "attention_value_scale": 0.707, "moe_layer_freq": [0] + [1] * (n - 1), "n_routed_experts": 256,
            "moe_intermediate_size": 2048, "num_experts_per_tok": 8, "scoring_func": "sigmoid",
            "n_shared_experts": None, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
            "norm_topk_prob": True, "routed_scaling_factor": None}


def test_mimo_v2_flash_config_as_released_and_as_transformers_writes_it():
    """MiMo-V2-Flash read from its released config.json (hybrid_layer_pattern, swa_*, moe_layer_freq,
    sliding_window_size, sink flags) maps to the model transformers builds from its own defaults (the same
    release): sliding layers with 8 key heads and sinks, full ones with 4, 192-channel query/key heads with 128-channel
    values, RoPE per kind; and the shapes of every attention tensor follow the layer's kind."""
    from transformers import MiMoV2FlashConfig

    released = Bridge(_mimo_released())
    cfg = released.cfg
    ours = Bridge({**MiMoV2FlashConfig().to_dict(), "architectures": ["MiMoV2FlashForCausalLM"]}).cfg
    assert cfg == ours
    assert (cfg.num_query_groups, cfg.global_num_query_groups, cfg.head_dim, cfg.value_head_dim) == (8, 4, 192, 128)
    assert cfg.value_scale == 0.707 and cfg.rotary_dim == 64 and cfg.extra["window_size"] == (128, 0)
    assert (cfg.rotary_base, cfg.sliding_rotary_base, cfg.norm_epsilon) == (5e6, 1e4, 1e-5)
    assert cfg.sink_layers == tuple(bool(x) for x in _mimo_released()["hybrid_layer_pattern"])
    assert cfg.moe_dense_layers == 1 and cfg.moe_shared_ffn_hidden_size is None and cfg.num_moe_experts == 256
    assert released.hf_shape("model.layers.1.self_attn.k_proj.weight") == (8 * 192, 4096)  # sliding
    assert released.hf_shape("model.layers.5.self_attn.k_proj.weight") == (4 * 192, 4096)  # full
    assert released.hf_shape("model.layers.1.self_attn.v_proj.weight") == (8 * 128, 4096)
    assert released.hf_shape("model.layers.0.self_attn.o_proj.weight") == (4096, 64 * 128)
    names = set(released.canonical_names())
    assert "decoder.layers.1.self_attention.core_attention.softmax_offset" in names
    assert "decoder.layers.5.self_attention.core_attention.softmax_offset" not in names
    assert released.hf_names("decoder.layers.1.self_attention.core_attention.softmax_offset") == \
        ["model.layers.1.self_attn.attention_sink_bias"]
    assert released.is_left_out("model.mtp.layers.0.self_attn.q_proj.weight")
    released.check_layout(ParallelLayout(tp=4, ep=8))
    with pytest.raises(ValueError, match="tp=8 does not divide global_num_query_groups=4"):
        released.check_layout(ParallelLayout(tp=8))


@pytest.mark.parametrize("change,message", [
    ({"swa_head_dim": 128}, "swa_head_dim=128 differs"),
    ({"n_shared_experts": 1}, "without shared experts"),
    ({"scoring_func": "softmax"}, "sigmoid router"),
    ({"partial_rotary_factor": 0.5, "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}}},
     "rotated fractions"),
    ({"moe_layer_freq": [1, 0] + [1] * 46}, "not some dense layers then MoE"),
])
def test_mimo_v2_flash_options_megatron_cannot_match_are_refused(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        Bridge({**_mimo_released(), **change})


def _minimax_m3_released():
    """MiniMax-M3's config.json as released (the language model's fields under text_config, its sparse attention
    under sparse_attention_config; values as published)."""
    n = 60
    sparse = [0, 0, 0] + [1] * (n - 3)
    text = {"hidden_size": 6144, "intermediate_size": 3072, "num_hidden_layers": n, "num_attention_heads": 64,
            "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 200064, "rms_norm_eps": 1e-06,
            "rope_theta": 5000000, "rotary_dim": 64, "partial_rotary_factor": 0.5, "use_qk_norm": True,
            "tie_word_embeddings": False, "dense_intermediate_size": 12288, "shared_intermediate_size": 3072,
            "num_local_experts": 128, "num_experts_per_tok": 4, "n_shared_experts": 1, "scoring_func": "sigmoid",
            "use_routing_bias": True, "moe_layer_freq": [0, 0, 0] + [1] * (n - 3), "qk_norm_type": "per_head",
            "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "routed_scaling_factor": 2.0, "hidden_act": "swigluoai",
            "max_position_embeddings": 524288, "model_type": "minimax_m3_vl_text",
            "sparse_attention_config": {"use_sparse_attention": True, "sparse_index_dim": 128,
                                        "sparse_num_index_heads": 4, "sparse_topk_blocks": 16,
                                        "sparse_block_size": 128, "sparse_disable_index_value": sparse,
                                        "sparse_attention_freq": sparse}}
    return {"architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl",
            "text_config": text, "vision_config": {"hidden_size": 1280, "num_hidden_layers": 32},
            "image_token_index": 200025, "tie_word_embeddings": False}


def test_minimax_m3_config_as_released_and_as_transformers_writes_it():
    """MiniMax-M3 read from its released config.json (sparse_attention_config, moe_layer_freq, swigluoai,
    rotary_dim with partial_rotary_factor) maps to the same model as the config transformers writes after reading
    it (layer_types, mlp_layer_types, index_*, rope_parameters): three dense layers then MoE ones with a shared
    expert, block-sparse attention from layer 3 on; and the indexers' tensors are the sparse layers' only."""
    from transformers import MiniMaxM3VLConfig

    released = Bridge(_minimax_m3_released())
    cfg = released.cfg
    written = {**MiniMaxM3VLConfig(**_minimax_m3_released()).to_dict(),
               "architectures": ["MiniMaxM3SparseForConditionalGeneration"]}
    assert "sparse_attention_config" not in written["text_config"] and written["text_config"]["layer_types"][3] == \
        "minimax_m3_sparse"
    assert Bridge(written).cfg == cfg
    assert cfg.block_sparse_layers == (False,) * 3 + (True,) * 57
    assert (cfg.block_index_heads, cfg.block_index_head_dim, cfg.block_size, cfg.block_topk, cfg.block_local) == \
        (4, 128, 128, 16, 1)
    assert (cfg.moe_dense_layers, cfg.ffn_hidden_size, cfg.moe_ffn_hidden_size, cfg.moe_shared_ffn_hidden_size) == \
        (3, 12288, 3072, 3072)
    assert cfg.rotary_percent == 0.5 and cfg.zero_centered_norm and not cfg.qk_layernorm_all_heads
    assert cfg.extra["moe_router_topk_scaling_factor"] == 2.0 and cfg.extra["activation_func_clamp_value"] == 7.0
    assert released.hf_shape("language_model.model.layers.3.self_attn.index_q_proj.weight") == (4 * 128, 6144)
    names = set(released.canonical_names())
    assert "decoder.layers.3.self_attention.core_attention.indexer.q_proj.weight" in names
    assert not any(n.startswith("decoder.layers.2.") and ".indexer." in n for n in names)
    assert released.hf_names("decoder.layers.3.self_attention.core_attention.indexer.k_norm.weight") == \
        ["language_model.model.layers.3.self_attn.index_k_norm.weight"]
    assert released.hf_names("decoder.layers.3.mlp.shared_experts.linear_fc2.weight") == \
        ["language_model.model.layers.3.block_sparse_moe.shared_experts.down_proj.weight"]
    assert released.hf_names("output_layer.weight") == ["language_model.lm_head.weight"]
    assert released.is_left_out("language_model.model.mtp.layers.0.self_attn.q_proj.weight")  # (transformers: too)
    assert released.is_left_out("mtp.0.enorm.weight") and released.is_left_out("vision_tower.vision_model.x.weight")
    assert not released.is_left_out("language_model.model.layers.59.self_attn.q_proj.weight")
    released.check_layout(ParallelLayout(tp=4, ep=8))
    # its language model as transformers holds it (MiniMaxM3VLForCausalLM): the same model under transformers' names
    text = Bridge({**written["text_config"], "architectures": ["MiniMaxM3VLForCausalLM"]})
    assert text.cfg == cfg
    assert text.hf_names("decoder.layers.3.self_attention.core_attention.indexer.k_norm.weight") == \
        ["model.layers.3.self_attn.indexer.k_norm.weight"]
    assert text.hf_names("decoder.layers.3.mlp.shared_experts.linear_fc1.weight") == \
        ["model.layers.3.mlp.shared_experts.gate_up_proj.weight"]
    assert text.hf_shape("model.layers.3.mlp.experts.gate_up_proj") == (128, 2 * 3072, 6144)
    assert text.hf_shape("model.layers.0.mlp.gate_up_proj.weight") == (2 * 12288, 6144)


@pytest.mark.parametrize("change,message", [
    ({"partial_rotary_factor": None}, "rotary_dim=64 with partial_rotary_factor=None"),
    ({"swiglu_alpha": 1.5}, "swiglu_alpha=1.5"),
    ({"hidden_act": "gelu"}, "swigluoai"),
    ({"qk_norm_type": "per_layer"}, "per_head"),
    ({"n_shared_experts": 2}, "one shared"),
    ({"scoring_func": "softmax"}, "sigmoid router"),
    ({"moe_layer_freq": [1, 0] + [1] * 58}, "not some dense layers then MoE"),
    ({"sparse_attention_config": {"sparse_num_index_heads": 8, "sparse_attention_freq": [1] * 60}},
     "index_n_heads=8"),
    ({"sparse_attention_config": {"sparse_attention_freq": [1] * 60, "sparse_disable_index_value": [0] * 60}},
     "sparse_disable_index_value"),
])
def test_minimax_m3_options_megatron_cannot_match_are_refused(change, message):
    config = _minimax_m3_released()
    config["text_config"] = {**config["text_config"], **change}
    with pytest.raises(UnsupportedModelError, match=message):
        Bridge(config)


def _longcat_released():
    """LongCat-Flash-Chat's config.json as released (the fields the bridge reads)."""
    return {"architectures": ["LongcatFlashForCausalLM"], "model_type": "longcat_flash", "attention_method": "MLA",
            "vocab_size": 131072, "hidden_size": 6144, "ffn_hidden_size": 12288, "expert_ffn_hidden_size": 2048,
            "num_layers": 28, "num_attention_heads": 64, "kv_lora_rank": 512, "q_lora_rank": 1536,
            "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 512,
            "moe_topk": 12, "zero_expert_num": 256, "zero_expert_type": "identity", "routed_scaling_factor": 6.0,
            "norm_topk_prob": False, "router_bias": False, "rope_theta": 10000000.0,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "mla_scale_q_lora": True,
            "mla_scale_kv_lora": True, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}


def test_longcat_flash_config_as_released_and_as_transformers_writes_it():
    """LongCat-Flash: 28 checkpoint layers are 56 Megatron layers, the MoE in the first of each pair with 512 routed
    and 256 identity experts (12 per token, scaled by 6), the dense MLPs 12288 wide, the latents scaled by
    sqrt(6144 / 1536) and sqrt(6144 / 512) with their norms' own epsilon; the names of a pair's two sublayers; the
    MTP module left out; pipeline stages of whole pairs only."""
    from transformers import LongcatFlashConfig

    released = Bridge(_longcat_released())
    cfg = released.cfg
    written = {**LongcatFlashConfig(**_longcat_released()).to_dict(), "architectures": ["LongcatFlashForCausalLM"]}
    assert Bridge(written).cfg == cfg
    assert (cfg.num_layers, cfg.shortcut_moe, cfg.num_moe_experts, cfg.moe_zero_experts, cfg.moe_router_topk) == \
        (56, True, 512, 256, 12)
    assert (cfg.ffn_hidden_size, cfg.moe_ffn_hidden_size, cfg.moe_shared_ffn_hidden_size, cfg.moe_dense_layers) == \
        (12288, 2048, None, 0)
    assert cfg.mla_latent_scales == pytest.approx((2.0, 12 ** 0.5)) and cfg.mla_latent_norm_epsilon == 1e-6
    assert (cfg.norm_epsilon, cfg.rotary_base, cfg.extra["moe_router_topk_scaling_factor"]) == (1e-5, 1e7, 6.0)
    assert [released.is_moe_layer(i) for i in range(4)] == [True, False, True, False]
    assert released.hf_names("decoder.layers.55.self_attention.linear_kv_up_proj.weight") == \
        ["model.layers.27.self_attn.1.kv_b_proj.weight"]
    assert released.hf_names("decoder.layers.54.mlp.shared_experts.linear_fc2.weight") == \
        ["model.layers.27.mlps.0.down_proj.weight"]
    assert released.hf_names("decoder.layers.55.mlp.linear_fc1.weight") == \
        ["model.layers.27.mlps.1.gate_proj.weight", "model.layers.27.mlps.1.up_proj.weight"]
    assert released.hf_names("decoder.layers.2.pre_mlp_layernorm.weight") == \
        ["model.layers.1.post_attention_layernorm.0.weight"]
    assert released.hf_names("decoder.layers.2.mlp.router.expert_bias") == \
        ["model.layers.1.mlp.router.e_score_correction_bias"]
    assert released.hf_names("decoder.layers.2.mlp.experts.local_experts.511.linear_fc2.weight") == \
        ["model.layers.1.mlp.experts.511.down_proj.weight"]
    assert released.hf_shape("model.layers.1.mlp.router.classifier.weight") == (768, 6144)
    assert released.hf_shape("model.layers.1.input_layernorm.1.weight") == (6144,)
    names = set(released.canonical_names())
    assert "decoder.layers.1.mlp.router.weight" not in names and "decoder.layers.1.mlp.linear_fc1.weight" in names
    assert released.is_left_out("model.mtp.layers.0.self_attn.q_a_proj.weight")
    released.check_layout(ParallelLayout(tp=8, pp=4, ep=8))  # 14 Megatron layers (7 pairs) a stage
    with pytest.raises(ValueError, match="pairs of Megatron layers"):
        released.check_layout(ParallelLayout(pp=4, first=13, last=15))


@pytest.mark.parametrize("change,message", [
    ({"zero_expert_type": "const"}, "zero_expert_type='const'"),
    ({"router_bias": True}, "router_bias=True"),
    ({"norm_topk_prob": True}, "norm_topk_prob=True"),
    ({"mla_scale_kv_lora": False}, "mla_scale_kv_lora=false"),
    ({"q_lora_rank": None}, "query latent"),
    ({"attention_method": "GQA"}, "attention_method='GQA'"),
    ({"qk_head_dim": 128}, "qk_head_dim=128"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}},
     "RoPE scaling"),
    ({"num_key_value_heads": 8}, "num_key_value_heads == num_attention_heads"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
])
def test_longcat_flash_options_megatron_cannot_match_are_refused(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        Bridge({**_longcat_released(), **change})


def test_dots1_config_as_released():
    """dots.llm1 (dots.llm1.inst's config.json): GLM-4.5's sigmoid router (6 of 128 experts, renormalised, scaled by
    2.5; groups of one), two shared experts' width, the first layer dense, per-head q/k norms, RoPE over the whole
    head with base 1e7; sliding-window layers refused by name."""
    released = {"architectures": ["Dots1ForCausalLM"], "model_type": "dots1", "attention_bias": False,
                "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 10944,
                "max_position_embeddings": 32768, "max_window_layers": 62, "moe_intermediate_size": 1408,
                "n_group": 1, "n_routed_experts": 128, "n_shared_experts": 2, "norm_topk_prob": True,
                "num_attention_heads": 32, "num_experts_per_tok": 6, "num_hidden_layers": 62,
                "num_key_value_heads": 32, "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 10000000,
                "routed_scaling_factor": 2.5, "sliding_window": None, "tie_word_embeddings": False, "topk_group": 1,
                "use_sliding_window": False, "vocab_size": 152064}
    bridge = Bridge(released)
    cfg = bridge.cfg
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.moe_shared_ffn_hidden_size,
            cfg.moe_dense_layers) == (128, 6, 1408, 2816, 1)
    assert cfg.qk_layernorm and not cfg.qk_layernorm_all_heads and cfg.rotary_percent == 1.0
    assert cfg.rotary_base == 1e7 and cfg.extra["moe_router_topk_scaling_factor"] == 2.5
    assert bridge.hf_names("decoder.layers.1.mlp.router.expert_bias") == \
        ["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bridge.hf_names("decoder.layers.5.self_attention.q_layernorm.weight") == \
        ["model.layers.5.self_attn.q_norm.weight"]
    with pytest.raises(UnsupportedModelError, match="dots.llm1 with sliding-window layers"):
        Bridge({**released, "layer_types": ["sliding_attention"] * 62})


def test_solar_open_config_as_transformers_defaults_it():
    """Solar Open (transformers' defaults, its docs' upstage/Solar-Open-100B): GLM-4.5's sigmoid router (8 of 128
    experts, renormalised; groups of one) and a shared expert in every layer, even if the config carries GLM's
    first_k_dense_replace (transformers' model ignores it), Llama's attention (no q/k norms, RoPE over the whole head)."""
    hf = {**transformers.SolarOpenConfig().to_dict(), "architectures": ["SolarOpenForCausalLM"]}
    bridge = Bridge(hf)
    cfg = bridge.cfg
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.moe_shared_ffn_hidden_size,
            cfg.moe_dense_layers, cfg.num_query_groups) == (128, 8, 1280, 1280, 0, 8)
    assert not cfg.qk_layernorm and cfg.rotary_percent == 1.0 and cfg.extra["moe_router_score_function"] == "sigmoid"
    assert Bridge({**hf, "first_k_dense_replace": 3}).cfg.moe_dense_layers == 0
    assert bridge.hf_names("decoder.layers.0.mlp.router.expert_bias") == \
        ["model.layers.0.mlp.gate.e_score_correction_bias"]


def test_mixtral_config_as_released():
    """Mixtral-8x7B-v0.1's config.json: 8 experts of 14336 in every layer, the top 2 of the softmax renormalised (the
    config has no norm_topk_prob), Mixtral's checkpoint names; router jitter and a sliding window refused by name."""
    released = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
                "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
                "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
                "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
                "rms_norm_eps": 1e-5, "rope_theta": 1e6, "router_aux_loss_coef": 0.02, "sliding_window": None,
                "tie_word_embeddings": False, "vocab_size": 32000}
    bridge = Bridge(released)
    cfg = bridge.cfg
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.moe_shared_ffn_hidden_size,
            cfg.moe_dense_layers) == (8, 2, 14336, None, 0)
    assert cfg.moe_router_topk_renorm and not cfg.moe_router_pre_softmax and cfg.rotary_base == 1e6
    assert bridge.hf_names("decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight") == \
        ["model.layers.3.block_sparse_moe.experts.5.w1.weight", "model.layers.3.block_sparse_moe.experts.5.w3.weight"]
    assert bridge.hf_names("decoder.layers.3.mlp.router.weight") == ["model.layers.3.block_sparse_moe.gate.weight"]
    with pytest.raises(UnsupportedModelError, match="router_jitter_noise"):
        Bridge({**released, "router_jitter_noise": 0.1})
    with pytest.raises(UnsupportedModelError, match="sliding_window=4096"):
        Bridge({**released, "sliding_window": 4096})


def test_phi4_config_as_released():
    """Phi-4's config.json (microsoft/phi-4, Phi3ForCausalLM): 40 query heads over 10 key heads of 128 channels,
    plain RoPE (base 250000) over the whole head, q/k/v fused in qkv_proj (regrouped per key head: every q row, then
    every k row, then every v row on disk) and gate/up in gate_up_proj; Phi-4-mini's longrope read; Phi-3-mini-4k's
    sliding window refused by name."""
    released = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "attention_bias": False,
                "attention_dropout": 0.0, "bos_token_id": 100257, "embd_pdrop": 0.0, "eos_token_id": 100265,
                "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 17920,
                "max_position_embeddings": 16384, "num_attention_heads": 40, "num_hidden_layers": 40,
                "num_key_value_heads": 10, "original_max_position_embeddings": 16384, "pad_token_id": 100349,
                "resid_pdrop": 0.0, "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 250000,
                "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 100352}
    bridge = Bridge(released)
    cfg = bridge.cfg
    assert (cfg.num_query_groups, cfg.head_dim, cfg.ffn_hidden_size, cfg.rotary_base, cfg.rotary_percent,
            cfg.add_qkv_bias) == (10, 128, 17920, 250000.0, 1.0, False)
    assert bridge.hf_names("decoder.layers.7.self_attention.linear_qkv.weight") == \
        ["model.layers.7.self_attn.qkv_proj.weight"]
    assert bridge.hf_names("decoder.layers.7.mlp.linear_fc1.weight") == ["model.layers.7.mlp.gate_up_proj.weight"]
    assert bridge.hf_shape("model.layers.7.self_attn.qkv_proj.weight") == ((40 + 2 * 10) * 128, 5120)
    # the regrouping: query group g's rows are its 4 query heads, then key head g, then value head g
    small = Bridge({**released, "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "intermediate_size": 8, "num_hidden_layers": 1, "vocab_size": 10})
    rows = torch.arange(8 * 4, dtype=torch.float32)[:, None].expand(-1, 16)  # q heads 0-3, k 0-1, v 0-1: 4 rows each
    fused = small.from_hf("decoder.layers.0.self_attention.linear_qkv.weight",
                          {"model.layers.0.self_attn.qkv_proj.weight": rows})
    head = [int(r) // 4 for r in fused[::4, 0]]  # which on-disk head each Megatron block of 4 rows is
    assert head == [0, 1, 4, 6, 2, 3, 5, 7]  # group 0: q0 q1 k0 v0; group 1: q2 q3 k1 v1
    assert torch.equal(small.to_hf("decoder.layers.0.self_attention.linear_qkv.weight", fused)[
        "model.layers.0.self_attn.qkv_proj.weight"], rows)
    mini = {**released, "partial_rotary_factor": 0.75, "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}}
    assert Bridge(mini).cfg.rope_scaling["rope_type"] == "longrope"  # (test_phi4_mini_config_as_released)
    assert Bridge({**released, "partial_rotary_factor": 0.75}).cfg.rotary_percent == 0.75
    with pytest.raises(UnsupportedModelError, match="sliding_window=2047"):
        Bridge({**released, "sliding_window": 2047, "max_position_embeddings": 4096})


def test_qwen2_moe_config_as_released():
    """Qwen1.5-MoE-A2.7B's config.json: 60 experts of 1408 (top 4, not renormalised: no norm_topk_prob) and a shared
    expert of 5632 behind a sigmoid gate in every layer, q/k/v biases (transformers' qkv_bias default); dense layers
    among the MoE ones refused by name."""
    released = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_act": "silu",
                "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
                "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
                "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 24,
                "decoder_sparse_step": 1, "max_position_embeddings": 8192, "max_window_layers": 21,
                "rms_norm_eps": 1e-6, "rope_theta": 1e6, "sliding_window": 32768, "use_sliding_window": False,
                "output_router_logits": False, "router_aux_loss_coef": 0.001, "tie_word_embeddings": False,
                "vocab_size": 151936}
    bridge = Bridge(released)
    cfg = bridge.cfg
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.moe_shared_ffn_hidden_size,
            cfg.moe_dense_layers) == (60, 4, 1408, 5632, 0)
    assert cfg.add_qkv_bias and cfg.moe_router_pre_softmax and not cfg.moe_router_topk_renorm
    assert cfg.extra["moe_shared_expert_gate"]
    assert bridge.hf_names("decoder.layers.2.mlp.shared_experts.gate_weight") == \
        ["model.layers.2.mlp.shared_expert_gate.weight"]
    assert bridge.hf_names("decoder.layers.2.mlp.shared_experts.linear_fc1.weight") == \
        ["model.layers.2.mlp.shared_expert.gate_proj.weight", "model.layers.2.mlp.shared_expert.up_proj.weight"]
    assert not Bridge({**released, "qkv_bias": False}).cfg.add_qkv_bias
    assert Bridge({**released, "norm_topk_prob": True}).cfg.moe_router_topk_renorm
    with pytest.raises(UnsupportedModelError, match="decoder_sparse_step"):
        Bridge({**released, "decoder_sparse_step": 2})


def test_exaone4_layer_kinds_and_norms():
    """EXAONE 4.0: with a window, the sliding layers (sliding_window_pattern as a count or as released, a string of L
    and G; layer_types when given) see it and rotate, the global ones see everything without RoPE; without a window
    (the 1.2B) every layer is global and rotates. Norms after attention and MLP, per-head q/k norms."""
    base = {"architectures": ["Exaone4ForCausalLM"], "model_type": "exaone4", "hidden_size": 5120,
            "intermediate_size": 27392, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
            "num_hidden_layers": 8, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "vocab_size": 102400,
            "rope_theta": 1e6, "sliding_window": 4096, "tie_word_embeddings": False,
            "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "original_max_position_embeddings": 8192,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0}}
    cfg = Bridge({**base, "sliding_window_pattern": "LLLG"}).cfg
    assert cfg.nope_layers == (False, False, False, True) * 2
    assert cfg.extra["window_size"] == (4095, 0) and cfg.extra["window_attn_skip_freq"] == [1, 1, 1, 0] * 2
    assert cfg.post_norm and not cfg.pre_norm and cfg.qk_layernorm and not cfg.qk_layernorm_all_heads
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.sliding_rope_scaling is None
    assert Bridge({**base, "sliding_window_pattern": 4}).cfg.nope_layers == cfg.nope_layers
    types = ["sliding_attention", "full_attention"] * 4
    assert Bridge({**base, "layer_types": types}).cfg.nope_layers == (False, True) * 4
    small = Bridge({**base, "sliding_window": None, "sliding_window_pattern": 0}).cfg
    assert small.nope_layers is None and not small.extra.get("window_size")
    bridge = Bridge({**base, "sliding_window_pattern": "LLLG"})
    assert bridge.hf_names("decoder.layers.3.post_mlp_layernorm.weight") == \
        ["model.layers.3.post_feedforward_layernorm.weight"]
    with pytest.raises(UnsupportedModelError, match="sliding_window_pattern='LLXG'"):
        Bridge({**base, "sliding_window_pattern": "LLXG"})


def test_exaone_moe_config_as_transformers_defaults_it():
    """K-EXAONE (transformers' ExaoneMoeConfig defaults): pre-norm, every 4th layer global without RoPE, layer 0 dense,
    64 experts (top 8 by sigmoid + bias, renormalised, times 2.5) and one shared expert, the score bias stored beside
    the gate; its MTP tensors left out."""
    hf = {**transformers.ExaoneMoeConfig().to_dict(), "architectures": ["ExaoneMoeForCausalLM"]}
    bridge = Bridge(hf)
    cfg = bridge.cfg
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.moe_shared_ffn_hidden_size,
            cfg.moe_dense_layers) == (64, 8, 1024, 1024, 1)
    assert cfg.pre_norm and not cfg.post_norm and cfg.extra["moe_router_score_function"] == "sigmoid"
    assert cfg.extra["moe_router_topk_scaling_factor"] == 2.5
    assert cfg.nope_layers == (False, False, False, True) * 8
    assert bridge.hf_names("decoder.layers.1.mlp.router.expert_bias") == ["model.layers.1.mlp.e_score_correction_bias"]
    assert bridge.is_mtp_tensor("mtp.layers.0.self_attn.q_proj.weight")
    assert not bridge.is_mtp_tensor("model.layers.0.self_attn.q_proj.weight")


def test_youtu_config_as_transformers_defaults_it():
    """Youtu-LLM (transformers' YoutuConfig defaults, the 2B release's sizes): DeepSeek-V3's multi-latent attention
    (query latent 1536, key/value latent 512, 128 + 64 rotated channels per query/key head, values of 128) in Llama's
    layers with dense MLPs, the head tied: no experts, DeepSeek-V3's attention names."""
    hf = {**transformers.YoutuConfig().to_dict(), "architectures": ["YoutuForCausalLM"]}
    bridge = Bridge(hf)
    cfg = bridge.cfg
    assert cfg.multi_latent_attention and not cfg.num_moe_experts and cfg.tie_word_embeddings
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim,
            cfg.ffn_hidden_size) == (1536, 512, 128, 64, 128, 6144)
    assert bridge.hf_names("decoder.layers.3.mlp.linear_fc1.weight") == \
        ["model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.up_proj.weight"]
    assert "output_layer.weight" not in [r.mcore for r in bridge.rules]


def test_granite_scales_and_refusals():
    """A config shaped like Granite 3.3 8B's: the muP-style scales reach the Megatron config (attention scaled by
    attention_multiplier, not 1 / sqrt(head_dim)); scales of 1 are none. Granite 4.0 without experts (granite-4.0-
    micro's shape) is dense with the shared MLP as its MLP; Granite 4.0-H's Mamba-2 layers become the Mamba-2 mixer
    (a config without layer_types is all Mamba-2, as transformers builds it), TP splitting whole groups."""
    dense = {"architectures": ["GraniteForCausalLM"], "model_type": "granite", "hidden_act": "silu",
             "hidden_size": 4096, "intermediate_size": 12800, "num_attention_heads": 32, "num_key_value_heads": 8,
             "num_hidden_layers": 40, "vocab_size": 49159, "rms_norm_eps": 1e-5, "rope_theta": 1e7,
             "max_position_embeddings": 131072, "tie_word_embeddings": True, "attention_multiplier": 0.0078125,
             "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 16.0}
    cfg = Bridge(dense).cfg
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling, cfg.softmax_scale) == \
        (12.0, 0.22, 16.0, 0.0078125)
    plain = Bridge({**dense, "embedding_multiplier": 1.0, "residual_multiplier": 1, "logits_scaling": 1.0}).cfg
    assert plain.embedding_multiplier is None and plain.residual_multiplier is None and plain.logits_scaling is None
    micro = {**dense, "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
             "num_local_experts": 0, "shared_intermediate_size": 8192, "layer_types": ["attention"] * 40,
             "position_embedding_type": "rope"}
    bridge = Bridge(micro)
    assert not bridge.cfg.num_moe_experts and bridge.cfg.ffn_hidden_size == 8192 and bridge.cfg.nope_layers is None
    assert bridge.hf_names("decoder.layers.2.mlp.linear_fc1.weight") == ["model.layers.2.shared_mlp.input_linear.weight"]
    assert Bridge({**micro, "position_embedding_type": "nope"}).cfg.nope_layers == (True,) * 40
    moe = Bridge({**micro, "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 512})
    assert (moe.cfg.num_moe_experts, moe.cfg.moe_ffn_hidden_size, moe.cfg.moe_shared_ffn_hidden_size) == (8, 512, 8192)
    assert moe.hf_names("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight") == \
        ["model.layers.1.block_sparse_moe.input_linear.weight"]
    assert moe.hf_names("decoder.layers.1.mlp.router.weight") == ["model.layers.1.block_sparse_moe.router.layer.weight"]
    # Granite 4.0-H: Mamba-2 layers (one group: TP 1 for them), time_step_limit as transformers writes infinity
    hybrid = Bridge({**micro, "layer_types": ["mamba", "mamba", "mamba", "attention"] * 10, "mamba_n_heads": 128,
                     "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_head": 64, "mamba_expand": 2,
                     "mamba_d_conv": 4, "time_step_limit": [0.0, {"__float__": "Infinity"}]})
    c = hybrid.cfg
    assert c.linear_attention == (True, True, True, False) * 10 and c.linear_attention_kind == "mamba2"
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
            c.mamba_dt_limit) == (1, 128, 128, 64, None)
    assert hybrid.hf_names("decoder.layers.0.self_attention.in_proj.weight") == ["model.layers.0.mamba.in_proj.weight"]
    assert hybrid.hf_shape("model.layers.0.mamba.in_proj.weight") == (2 * 8192 + 2 * 128 + 128, 4096)
    with pytest.raises(ValueError, match="tp=2 does not divide linear_num_key_heads=1"):  # (a padded vocabulary)
        Bridge(hybrid.hf_config, vocab_size=49160).check_layout(ParallelLayout(tp=2))
    assert Bridge({**micro, "layer_types": ["mamba"] * 40, "time_step_limit": [0.001, 0.1]}).cfg.mamba_dt_limit == \
        (0.001, 0.1)
    no_types = Bridge({k: v for k, v in micro.items() if k != "layer_types"}).cfg  # (transformers: all Mamba-2)
    assert no_types.linear_attention == (True,) * 40
    with pytest.raises(UnsupportedModelError, match="mamba_proj_bias"):
        Bridge({**micro, "layer_types": ["mamba"] * 40, "mamba_proj_bias": True})


def test_granite_scale_fields_are_checked():
    """GPTConfig refuses non-positive Granite scales and logits_scaling beside a final soft-cap (whose order would
    matter: no model has both)."""
    from forge_megatron.mcore.model import GPTConfig

    base = dict(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, vocab_size=10)
    with pytest.raises(ValueError, match="residual_multiplier must be > 0"):
        GPTConfig(**base, residual_multiplier=0.0)
    with pytest.raises(ValueError, match="logits_scaling must be > 0"):
        GPTConfig(**base, logits_scaling=-2.0)
    with pytest.raises(ValueError, match="logits_scaling with final_logit_softcapping"):
        GPTConfig(**base, logits_scaling=2.0, final_logit_softcapping=30.0)
    assert GPTConfig(**base, residual_multiplier=0.22, logits_scaling=16.0).logits_scaling == 16.0


def test_nemotron_h_layer_kinds_from_the_released_pattern():
    """Nemotron-H configs as released give hybrid_override_pattern (M Mamba-2, * attention, - MLP, E MoE): each layer
    one sublayer, its norm the Megatron layer's input norm (mixers) or pre-MLP norm (MLP, experts); squared-ReLU plain
    MLPs, NoPE attention, the Mamba-2 sizes; a pattern with E (Nemotron 3 Nano's shape) has the sigmoid router, the
    shared expert its own width. Latent expert projections and other activations are refused by name."""
    dense = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 4096,
             "hybrid_override_pattern": "M-M-M*-M-", "num_attention_heads": 32, "num_key_value_heads": 8,
             "head_dim": 128, "intermediate_size": 21504, "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8,
             "ssm_state_size": 128, "conv_kernel": 4, "expand": 2, "mlp_hidden_act": "relu2",
             "layer_norm_epsilon": 1e-5, "vocab_size": 131072, "tie_word_embeddings": False,
             "max_position_embeddings": 8192}
    bridge = Bridge(dense)
    cfg = bridge.cfg
    assert cfg.layer_kinds == ("mamba", "mlp", "mamba", "mlp", "mamba", "attention", "mlp", "mamba", "mlp")
    assert cfg.linear_attention == tuple(k == "mamba" for k in cfg.layer_kinds) and cfg.nope_layers == (True,) * 9
    assert (cfg.activation, cfg.swiglu, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
            cfg.linear_key_head_dim, cfg.linear_value_head_dim) == ("relu2", False, 8, 128, 128, 64)
    assert bridge.hf_names("decoder.layers.5.input_layernorm.weight") == ["backbone.layers.5.norm.weight"]
    assert bridge.hf_names("decoder.layers.6.pre_mlp_layernorm.weight") == ["backbone.layers.6.norm.weight"]
    assert bridge.hf_names("decoder.layers.6.mlp.linear_fc1.weight") == ["backbone.layers.6.mixer.up_proj.weight"]
    names = {r.mcore for r in bridge.rules if bridge.layer_has(r, 6)}
    assert "decoder.layers.{layer}.input_layernorm.weight" not in names  # (an MLP layer: no input norm)
    assert bridge.hf_shape("backbone.layers.0.mixer.in_proj.weight") == (2 * 8192 + 2 * 8 * 128 + 128, 4096)
    assert bridge.hf_shape("backbone.layers.6.mixer.up_proj.weight") == (21504, 4096)
    moe_hf = {**dense, "hybrid_override_pattern": "MEMEM*EME", "n_routed_experts": 128, "num_experts_per_tok": 6,
              "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712, "routed_scaling_factor": 2.5,
              "n_group": 1, "topk_group": 1, "norm_topk_prob": True}
    moe = Bridge(moe_hf)
    c = moe.cfg
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size, c.moe_shared_ffn_hidden_size) == \
        (128, 6, 1856, 3712)
    assert c.extra["moe_router_score_function"] == "sigmoid" and c.extra["moe_router_topk_scaling_factor"] == 2.5
    assert [moe.is_moe_layer(i) for i in range(9)] == [k == "moe" for k in c.layer_kinds]
    assert moe.hf_names("decoder.layers.1.mlp.router.expert_bias") == \
        ["backbone.layers.1.mixer.gate.e_score_correction_bias"]
    assert moe.is_mtp_tensor("mtp.layers.0.mixer.q_proj.weight")
    # Nemotron 3 Super / Ultra (LatentMoE): routed experts work in the latent width, shared experts in the hidden one
    latent = Bridge({**moe_hf, "moe_latent_size": 1024})
    assert latent.cfg.moe_latent_size == 1024 and moe.cfg.moe_latent_size is None
    assert latent.hf_names("decoder.layers.1.mlp.fc1_latent_proj.weight") == \
        ["backbone.layers.1.mixer.fc1_latent_proj.weight"]
    assert latent.hf_shape("backbone.layers.1.mixer.fc1_latent_proj.weight") == (1024, 4096)
    assert latent.hf_shape("backbone.layers.1.mixer.fc2_latent_proj.weight") == (4096, 1024)
    assert latent.hf_shape("backbone.layers.1.mixer.experts.0.up_proj.weight") == (1856, 1024)
    assert latent.hf_shape("backbone.layers.1.mixer.shared_experts.up_proj.weight") == (3712, 4096)
    assert Bridge({**dense, "moe_latent_size": 1024}).cfg.moe_latent_size is None  # (no MoE layer: nothing latent)
    with pytest.raises(UnsupportedModelError, match="mlp_hidden_act='gelu'"):
        Bridge({**dense, "mlp_hidden_act": "gelu"})
    with pytest.raises(UnsupportedModelError, match=r"layer kinds \['X'\]"):
        Bridge({**dense, "hybrid_override_pattern": "M-X-"})


def test_layer_kinds_and_squared_relu_are_checked():
    """GPTConfig: layer_kinds one known kind per layer, moe layers exactly with experts, mamba layers exactly where
    linear_attention says; squared ReLU only in a plain (not gated) MLP."""
    from forge_megatron.mcore.model import GPTConfig

    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, vocab_size=10)
    with pytest.raises(ValueError, match="layer_kinds needs one of"):
        GPTConfig(**base, layer_kinds=("attention", "conv"))
    with pytest.raises(ValueError, match="moe layers exactly when num_moe_experts"):
        GPTConfig(**base, layer_kinds=("attention", "moe"))
    with pytest.raises(ValueError, match="mamba layers exactly where linear_attention says"):
        GPTConfig(**base, layer_kinds=("mamba", "mlp"))
    with pytest.raises(ValueError, match="in a plain one 'relu2'"):
        GPTConfig(**base, activation="relu2")  # (swiglu defaults on)
    ok = GPTConfig(**base, layer_kinds=("attention", "mlp"), activation="relu2", swiglu=False)
    assert ok.layer_kinds == ("attention", "mlp")


def test_lfm2_config_shaped_like_the_1_2b_release():
    """A config shaped like LFM2-1.2B's: full_attn_idxs name the attention layers, the rest gated short convolutions
    (3 taps); the MLP's width is what its MLP derives (2/3 of intermediate_size, times the multiplier, rounded up to
    block_multiple_of); the short convolution's projection interleaved per channel and back."""
    released = {"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "hidden_size": 2048,
                "intermediate_size": 12288, "num_hidden_layers": 16, "num_attention_heads": 32,
                "num_key_value_heads": 8, "full_attn_idxs": [2, 5, 8, 10, 12, 14], "block_multiple_of": 256,
                "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True, "conv_L_cache": 3,
                "conv_bias": False, "norm_eps": 1e-5, "rope_theta": 1e6, "vocab_size": 65536,
                "max_position_embeddings": 128000, "tie_word_embeddings": True}
    bridge = Bridge(released)
    cfg = bridge.cfg
    assert cfg.linear_attention == tuple(i not in (2, 5, 8, 10, 12, 14) for i in range(16))
    assert (cfg.linear_attention_kind, cfg.linear_conv_kernel, cfg.ffn_hidden_size, cfg.qk_layernorm,
            cfg.tie_word_embeddings, cfg.norm_epsilon) == ("short_conv", 3, 8192, True, True, 1e-5)
    assert Bridge({**released, "block_ffn_dim_multiplier": 1.3}).cfg.ffn_hidden_size == 10752  # 10649 -> 42 x 256
    assert bridge.hf_names("decoder.layers.2.self_attention.linear_proj.weight") == \
        ["model.layers.2.self_attn.out_proj.weight"]
    assert bridge.hf_names("decoder.layers.0.self_attention.in_proj.weight") == ["model.layers.0.conv.in_proj.weight"]
    small = Bridge({**released, "hidden_size": 4, "num_attention_heads": 2, "num_key_value_heads": 2,
                    "intermediate_size": 12, "num_hidden_layers": 1, "full_attn_idxs": [], "vocab_size": 8})
    rows = torch.arange(12, dtype=torch.float32)[:, None].expand(-1, 4)  # B rows 0-3, C 4-7, x 8-11
    mine = small.from_hf("decoder.layers.0.self_attention.in_proj.weight", {"model.layers.0.conv.in_proj.weight": rows})
    assert mine[:, 0].tolist() == [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]  # per channel its B, C, x
    assert torch.equal(small.to_hf("decoder.layers.0.self_attention.in_proj.weight", mine)[
        "model.layers.0.conv.in_proj.weight"], rows)
    with pytest.raises(UnsupportedModelError, match="conv or full_attention"):
        Bridge({**released, "layer_types": ["conv", "sliding_attention"] * 8})


def test_lfm2_moe_config_as_transformers_defaults_it():
    """LFM2-MoE (transformers' Lfm2MoeConfig defaults, the 8B-A1B release's sizes, three short-convolution layers to an
    attention one): the first num_dense_layers layers
    with the MLP as given (no width adjustment), then 32 experts (top 4 by sigmoid + the router's bias, renormalised)
    and no shared expert; the bias beside the router (feed_forward.expert_bias); a router without its bias refused."""
    hf = {**transformers.Lfm2MoeConfig().to_dict(), "architectures": ["Lfm2MoeForCausalLM"],
          "layer_types": ["conv", "conv", "conv", "full_attention"] * 8}  # (the defaults give none)
    bridge = Bridge(hf)
    cfg = bridge.cfg
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.moe_shared_ffn_hidden_size,
            cfg.moe_dense_layers, cfg.ffn_hidden_size) == (32, 4, 1792, None, 2, 7168)
    assert cfg.linear_attention_kind == "short_conv" and cfg.extra["moe_router_score_function"] == "sigmoid"
    assert bridge.hf_names("decoder.layers.3.mlp.router.expert_bias") == ["model.layers.3.feed_forward.expert_bias"]
    assert bridge.hf_names("decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight") == \
        ["model.layers.3.feed_forward.experts.5.w1.weight", "model.layers.3.feed_forward.experts.5.w3.weight"]
    with pytest.raises(UnsupportedModelError, match="use_expert_bias=False"):
        Bridge({**hf, "use_expert_bias": False})


def test_gemma2_config_shaped_like_the_9b_release():
    """A config shaped like gemma-2-9b-it's (no layer_types: every other layer, the first, a 4096-position window;
    rope_theta 10k on every layer): soft-capped attention scores (50) and logits (30), query_pre_attn_scalar's scale,
    Gemma's sandwich norms without q/k norms; the causal spec's core attention carries the cap, and the tree spec's
    TreeAttention keeps it."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from forge_megatron.mcore.model import CausalCoreAttention, GPTConfig, layer_spec
    from forge_megatron.mcore.tree_attention import TreeAttention, swap_core_attention

    released = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584,
                "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16,
                "num_key_value_heads": 8, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_size": 4096,
                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "rope_theta": 10000.0,
                "rms_norm_eps": 1e-6, "vocab_size": 256000, "max_position_embeddings": 8192,
                "cache_implementation": "hybrid"}
    bridge = Bridge(released)
    cfg = bridge.cfg
    assert (cfg.attention_softcapping, cfg.final_logit_softcapping, cfg.softmax_scale, cfg.rotary_base,
            cfg.sliding_rotary_base, cfg.qk_layernorm, cfg.pre_norm, cfg.post_norm, cfg.zero_centered_norm,
            cfg.tie_word_embeddings) == (50.0, 30.0, 1 / 16, 1e4, None, False, True, True, True, True)
    assert cfg.extra["window_size"] == (4095, 0) and cfg.extra["window_attn_skip_freq"] == [1, 0] * 21
    assert bridge.hf_names("decoder.layers.3.pre_mlp_layernorm.weight") == \
        ["model.layers.3.pre_feedforward_layernorm.weight"]
    small = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=2, num_query_groups=1, ffn_hidden_size=64,
                      vocab_size=8, attention_softcapping=50.0)
    core = layer_spec(small).submodules.self_attention.submodules.core_attention
    assert isinstance(core, ModuleSpec) and core.module is CausalCoreAttention and core.params == {"softcap": 50.0}
    tree_core = swap_core_attention(layer_spec(small)).submodules.self_attention.submodules.core_attention
    assert tree_core.module is TreeAttention and tree_core.params == {"softcap": 50.0}
    assert swap_core_attention(layer_spec(GPTConfig(num_layers=1, vocab_size=8))).submodules.self_attention \
        .submodules.core_attention is TreeAttention
    with pytest.raises(ValueError, match="attention_softcapping must be > 0"):
        GPTConfig(num_layers=1, vocab_size=8, attention_softcapping=0.0)


def _llama4_text(**changes):
    """A text config shaped like Llama-4-Scout-17B-16E's (48 layers, every fourth without RoPE, every layer MoE)."""
    return {"model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
            "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
            "hidden_act": "silu", "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
            "moe_layers": list(range(48)), "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(48)],
            "attention_chunk_size": 8192, "attn_temperature_tuning": 4, "attn_scale": 0.1, "floor_scale": 8192,
            "use_qk_norm": True, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "router_jitter_noise": 0.0,
            "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "max_position_embeddings": 10485760, "vocab_size": 202048, "attention_bias": False, **changes}


def test_llama4_scout_as_released_and_maverick():
    """Llama-4-Scout as released (Llama4ForConditionalGeneration: the text model under language_model.model., its head
    language_model.lm_head, the vision model and projector beside them): chunks of 8192 and weightless q/k norms on
    the layers that rotate (interleaved pairs, llama3-scaled), the temperature on every fourth (NoPE) layer, top-1
    sigmoid experts fed scaled inputs beside a shared expert, stacked and transposed on disk. Maverick's layout
    (Llama4ForCausalLM here): MoE every other layer (moe_layer_pattern; the dense MLP intermediate_size_mlp wide), no
    q/k norms. Refused by name: top-2 routing, router jitter, attention biases, chunked layers that do not rotate."""
    scout = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
             "text_config": _llama4_text(), "vision_config": {"model_type": "llama4_vision_model"},
             "tie_word_embeddings": False}
    bridge = Bridge(scout)
    cfg = bridge.cfg
    assert (cfg.attention_chunk_size, cfg.qk_l2_norm, cfg.nope_query_scaling, cfg.rotary_interleaved,
            cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.moe_shared_ffn_hidden_size,
            cfg.moe_layer_pattern, cfg.rotary_base) == (8192, True, (0.1, 8192), True, 16, 1, 8192, 8192, None, 5e5)
    assert cfg.nope_layers == tuple((i + 1) % 4 == 0 for i in range(48))
    assert cfg.extra == {"moe_router_score_function": "sigmoid", "moe_apply_probs_on_input": True}
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 16.0
    layer = "language_model.model.layers.5."
    assert bridge.hf_names("decoder.layers.5.mlp.router.weight") == [layer + "feed_forward.router.weight"]
    assert bridge.hf_names("decoder.layers.5.mlp.experts.local_experts.3.linear_fc1.weight") == \
        [layer + "feed_forward.experts.gate_up_proj"]
    assert bridge.hf_names("decoder.layers.5.mlp.shared_experts.linear_fc2.weight") == \
        [layer + "feed_forward.shared_expert.down_proj.weight"]
    assert bridge.hf_names("output_layer.weight") == ["language_model.lm_head.weight"]
    assert bridge.hf_names("embedding.word_embeddings.weight") == ["language_model.model.embed_tokens.weight"]

    maverick = Bridge({"architectures": ["Llama4ForCausalLM"], **_llama4_text(
        num_local_experts=128, interleave_moe_layer_step=2, moe_layers=list(range(1, 48, 2)), use_qk_norm=False,
        rope_scaling=None)})
    assert maverick.cfg.moe_layer_pattern == tuple(i % 2 == 1 for i in range(48))
    assert (maverick.cfg.qk_l2_norm, maverick.cfg.ffn_hidden_size, maverick.cfg.rope_scaling) == (False, 16384, None)
    assert maverick.hf_names("decoder.layers.2.mlp.linear_fc1.weight") == \
        ["model.layers.2.feed_forward.gate_proj.weight", "model.layers.2.feed_forward.up_proj.weight"]
    assert maverick.hf_names("decoder.layers.3.mlp.router.weight") == ["model.layers.3.feed_forward.router.weight"]
    from forge_megatron.mcore.model import GPTConfig

    with pytest.raises(ValueError, match="NoPE layers to scale"):  # (the temperature is the NoPE layers' alone)
        GPTConfig(num_layers=1, vocab_size=8, nope_query_scaling=(0.1, 8))
    text = {"architectures": ["Llama4ForCausalLM"], **_llama4_text()}
    for change, message in (({"num_experts_per_tok": 2}, "only top-1 routing"),
                            ({"router_jitter_noise": 0.1}, "router_jitter_noise"),
                            ({"attention_bias": True}, "attention_bias=True"),
                            ({"layer_types": ["chunked_attention"] * 48}, "chunked_attention exactly the layers")):
        with pytest.raises(UnsupportedModelError, match=message):
            Bridge({**text, **change})


@pytest.mark.parametrize("low,high", [(1.0, 1.0), (1.0, 4.0)])
def test_llama3_rope_is_transformers_also_with_equal_frequency_factors(low, high):
    """llama3 RoPE scaling against transformers' own: Llama 4 Scout's release has low_freq_factor = high_freq_factor
    = 1 (no band to blend: each frequency kept or divided by the factor), Llama 3.1's 1 and 4."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from forge_megatron.mcore import rope

    params = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": low, "high_freq_factor": high,
              "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    config = LlamaConfig(hidden_size=5120, num_attention_heads=40, head_dim=128, max_position_embeddings=131072,
                         rope_parameters=params)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, None)
    got = rope.inv_freq(rope.check(params, 131072), 500000.0, 128)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert (got != rope.inv_freq(None, 500000.0, 128)).any()


def test_granite_swa_layer_kinds_sinks_and_rope_bases():
    """Granite SWA's config as transformers defaults it (every fourth layer full attention, the others a 128-position
    window; sinks in every layer; one RoPE base): Megatron's window switches and learnable sinks; layer_rope_theta's
    0 a NoPE layer and a sliding layers' base of their own; two bases within one kind refused by name."""
    hf = {**transformers.GraniteSWAConfig(num_hidden_layers=8).to_dict(), "architectures": ["GraniteSWAForCausalLM"]}
    bridge = Bridge(hf)
    cfg = bridge.cfg
    assert cfg.extra["softmax_type"] == "learnable" and cfg.extra["window_size"] == (127, 0)
    assert cfg.extra["window_attn_skip_freq"] == [0, 1, 1, 1] * 2 and cfg.nope_layers is None
    assert bridge.hf_names("decoder.layers.3.self_attention.core_attention.softmax_offset") == \
        ["model.layers.3.self_attn.sinks"]
    thetas = [0, 1e4, 1e4, 1e4, 1e6, 1e4, 1e4, 1e4]
    mixed = Bridge({**hf, "layer_rope_theta": thetas}).cfg
    assert mixed.nope_layers == (True,) + (False,) * 7
    assert (mixed.rotary_base, mixed.sliding_rotary_base) == (1e6, 1e4)
    with pytest.raises(UnsupportedModelError, match="one RoPE base per layer kind"):
        Bridge({**hf, "layer_rope_theta": [1e4, 1e4, 5e4, 1e4, 1e4, 1e4, 1e4, 1e4]})


def _command_a(**changes):
    """A config shaped like c4ai-command-a-03-2025's (Cohere2: 64 layers, every fourth full attention without RoPE,
    the others 4096-position windows; no layer_types, as older configs give only sliding_window_pattern)."""
    return {"architectures": ["Cohere2ForCausalLM"], "model_type": "cohere2", "hidden_size": 12288,
            "intermediate_size": 36864, "num_hidden_layers": 64, "num_attention_heads": 96, "num_key_value_heads": 8,
            "hidden_act": "silu", "layer_norm_eps": 1e-5, "logit_scale": 0.25, "rope_theta": 50000.0,
            "sliding_window": 4096, "sliding_window_pattern": 4, "max_position_embeddings": 131072,
            "vocab_size": 256000, "tie_word_embeddings": True, "use_qk_norm": False, "attention_bias": False,
            **changes}


def test_cohere_configs_shaped_like_the_releases():
    """Command A's (Cohere2), Command R's (Cohere) and a Command A+-shaped (Cohere2-MoE) config: parallel attention +
    MLP layers on one bias-free LayerNorm (RMSNorm where Cohere2-MoE's config gives rms_norm_eps), interleaved RoPE on
    the window layers only, the logits times logit_scale, the tied head; the checkpoint's one norm per layer; and the
    options no release has, refused by name. (The modules built: tests/mcore/test_tree_exact.py.)"""
    bridge = Bridge(_command_a())
    cfg = bridge.cfg
    assert (cfg.parallel_block, cfg.normalization, cfg.norm_bias, cfg.norm_epsilon, cfg.rotary_interleaved,
            cfg.logit_multiplier, cfg.head_dim, cfg.tie_word_embeddings, cfg.rotary_base) == \
        (True, "LayerNorm", False, 1e-5, True, 0.25, 128, True, 50000.0)
    assert cfg.nope_layers == (False, False, False, True) * 16
    assert cfg.extra["window_size"] == (4095, 0) and cfg.extra["window_attn_skip_freq"] == [1, 1, 1, 0] * 16
    names = bridge.canonical_names()
    assert not any("pre_mlp_layernorm" in n for n in names) and "output_layer.weight" not in names
    assert bridge.hf_names("decoder.layers.3.input_layernorm.weight") == ["model.layers.3.input_layernorm.weight"]
    # Command R (Cohere): every layer rotates, logits times 1/16
    command_r = Bridge({**_command_a(), "architectures": ["CohereForCausalLM"], "model_type": "cohere",
                        "hidden_size": 8192, "num_attention_heads": 64, "logit_scale": 0.0625,
                        "rope_theta": 4000000.0, "num_hidden_layers": 40}).cfg
    assert (command_r.nope_layers, command_r.logit_multiplier, command_r.extra.get("window_size")) == \
        (None, 0.0625, None)
    # Command A+ (Cohere2-MoE): a dense prefix (its own width; its layers full attention that rotates), then MoE
    # layers with Cohere2's window pattern; a shared expert averaged with the routed ones; RMSNorms when so configured
    plus = {**_command_a(), "architectures": ["Cohere2MoeForCausalLM"], "model_type": "cohere2_moe",
            "num_hidden_layers": 8, "head_dim": 128, "intermediate_size": 2048, "prefix_dense_intermediate_size": 24576,
            "num_experts": 64, "num_experts_per_tok": 8, "num_shared_experts": 1, "first_k_dense_replace": 2,
            "rms_norm_eps": 1e-5}
    cfg = Bridge(plus).cfg
    assert (cfg.normalization, cfg.norm_bias, cfg.ffn_hidden_size, cfg.moe_ffn_hidden_size,
            cfg.moe_shared_ffn_hidden_size, cfg.moe_dense_layers, cfg.num_moe_experts, cfg.moe_router_topk,
            cfg.moe_router_pre_softmax, cfg.moe_output_multiplier) == \
        ("RMSNorm", True, 24576, 2048, 2048, 2, 64, 8, False, 0.5)
    assert cfg.nope_layers == (False, False) + (False, False, False, True) + (False, False)
    assert cfg.extra["window_attn_skip_freq"] == [0, 0, 1, 1, 1, 0, 1, 1]
    summed = Bridge({**plus, "shared_expert_combination_strategy": "sum", "expert_selection_fn": "sigmoid"}).cfg
    assert summed.moe_output_multiplier is None and summed.extra["moe_router_score_function"] == "sigmoid"
    interleaved = Bridge({**plus, "mlp_layer_types": ["sparse", "dense"] * 4}).cfg  # dense layers between MoE ones
    assert interleaved.moe_layer_pattern == (True, False) * 4 and interleaved.moe_dense_layers == 0
    for change, message in ((dict(use_qk_norm=True), "use_qk_norm=True"),
                            (dict(attention_bias=True), "attention_bias=True"),
                            (dict(expert_selection_fn="sigmoid", norm_topk_prob=False), "norm_topk_prob=False"),
                            (dict(shared_expert_combination_strategy="max"), "average or sum only"),
                            (dict(expert_selection_fn="sparsemixer"), "softmax or sigmoid only"),
                            (dict(layer_types=["chunked_attention"] * 8), "layer_types")):
        with pytest.raises(UnsupportedModelError, match=message):
            Bridge({**plus, **change})


def _deepseek_v2_lite():
    """DeepSeek-V2-Lite(-Chat)'s config.json (DeepSeek-Coder-V2-Lite's has the same layout)."""
    return {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
            "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
            "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
            "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
            "num_experts_per_tok": 6, "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": False,
            "scoring_func": "softmax", "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
            "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000, "attention_bias": False,
            "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                             "original_max_position_embeddings": 4096, "type": "yarn"},
            "tie_word_embeddings": False}


def test_deepseek_v2_lite_config_as_released():
    """DeepSeek-V2-Lite: multi-latent attention without a query latent (q_proj), YaRN (factor 40, equal mscales),
    the first layer dense, 6 of 64 softmax-routed experts kept as they are (Megatron's pre-softmax top-k, fp32
    logits, no scaling at 1.0, no score-correction bias) beside two shared experts' width."""
    bridge = Bridge(_deepseek_v2_lite())
    cfg = bridge.cfg
    assert bridge.family.name == "deepseek_v2" and cfg.multi_latent_attention and cfg.q_lora_rank is None
    assert (cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == (512, 128, 64, 128)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 40
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.moe_shared_ffn_hidden_size,
            cfg.moe_dense_layers, cfg.ffn_hidden_size) == (64, 6, 1408, 2816, 1, 10944)
    assert cfg.moe_router_pre_softmax and cfg.extra["moe_router_score_function"] == "softmax"
    assert cfg.extra["moe_router_dtype"] == "fp32" and cfg.extra["moe_router_topk_scaling_factor"] is None
    assert not cfg.extra.get("moe_router_enable_expert_bias")
    assert bridge.hf_shape("model.layers.1.self_attn.q_proj.weight") == (16 * 192, 2048)
    assert bridge.hf_shape("model.layers.1.mlp.gate.weight") == (64, 2048)
    hf_names = {n for name in bridge.canonical_names() for n in bridge.hf_names(name)}
    assert "model.layers.1.mlp.gate.weight" in hf_names and "model.layers.1.self_attn.q_proj.weight" in hf_names
    assert not any("e_score_correction_bias" in n or "q_a_proj" in n for n in hf_names)
    # DeepSeek-V2 (236B): greedy routing with groups named but unused is V2-Lite's; scaled by 16
    scaled = Bridge({**_deepseek_v2_lite(), "routed_scaling_factor": 16.0, "n_group": 8, "topk_group": 3})
    assert scaled.cfg.extra["moe_router_topk_scaling_factor"] == 16.0 and scaled.cfg.extra.get(
        "moe_router_num_groups") is None and scaled.cfg.moe_greedy_groups is None
    # ... and its group_limited_greedy routing (V2 / V2.5 236B as released): 3 of 8 groups, forge's router
    grouped = Bridge({**_deepseek_v2_lite(), "routed_scaling_factor": 16.0, "n_group": 8, "topk_group": 3,
                      "topk_method": "group_limited_greedy", "n_routed_experts": 160})
    assert grouped.cfg.moe_greedy_groups == (8, 3) and grouped.cfg.extra.get("moe_router_num_groups") is None


@pytest.mark.parametrize("change,message", [
    ({"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 2}, "groups must divide"),
    ({"topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 9}, "groups must divide"),
    ({"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
    ({"norm_topk_prob": True}, "norm_topk_prob=true"),
    ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
])
def test_deepseek_v2_options_megatron_cannot_match_are_refused(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        Bridge({**_deepseek_v2_lite(), **change})


@pytest.mark.parametrize("layer_types", [None, "named"])
def test_cwm_config_as_released(layer_types):
    """Meta CWM (facebook/cwm): Llama's layer, 64 layers of which every fourth (from the first) attends fully and the
    others in 8192-position windows, whether the config lists the kinds or leaves them to transformers' default;
    Llama 3's RoPE scaling (factor 16 past 8192)."""
    release = {"architectures": ["CwmForCausalLM"], "model_type": "cwm", "vocab_size": 128256, "hidden_size": 6144,
               "intermediate_size": 21504, "num_hidden_layers": 64, "num_attention_heads": 48,
               "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 131072,
               "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "sliding_window": 8192,
               "rope_parameters": {"rope_theta": 1000000.0, "factor": 16.0, "high_freq_factor": 4.0,
                                   "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
                                   "rope_type": "llama3"}}
    kinds = ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(64)]
    if layer_types:
        release["layer_types"] = kinds
    cfg = Bridge(release).cfg
    assert cfg.extra["window_size"] == (8191, 0)
    assert cfg.extra["window_attn_skip_freq"] == [int(k == "sliding_attention") for k in kinds]
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rotary_base == 1e6
    assert transformers.CwmConfig(**{k: v for k, v in release.items() if k not in ("architectures",
                                                                                 "model_type")}).layer_types == kinds


def test_phi4_mini_config_as_released():
    """Phi-4-mini(-instruct / -reasoning): Phi-3's layout with RoPE on three quarters of each 128-channel head under
    longrope (48 short and 48 long divisors, 4096 original positions of 131072: factor 32), the attention factor
    sqrt(1 + ln 32 / ln 4096) on the rotated channels (not a softmax scale), the long list for the run by default
    (the context exceeds the original one), tied embeddings; its 262144-position window never bites."""
    import math

    short, long = [1.0 + 0.01 * i for i in range(48)], [1.0 + 2.0 * i for i in range(48)]
    release = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 200064, "hidden_size": 3072,
               "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 24,
               "num_key_value_heads": 8, "partial_rotary_factor": 0.75, "max_position_embeddings": 131072,
               "original_max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
               "rope_scaling": {"long_factor": long, "short_factor": short, "type": "longrope"},
               "sliding_window": 262144, "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False}
    cfg = Bridge(release).cfg
    assert cfg.rope_scaling["rope_type"] == "longrope" and cfg.rope_scaling["factor"] == 32.0
    assert cfg.rope_scaling["longrope_factors"] == "long" and cfg.rotary_percent == 0.75 and cfg.tie_word_embeddings
    assert cfg.rotated_channels_scale == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    want = 1.0 / (torch.tensor(long) * 10000.0 ** (torch.arange(0, 96, 2).float() / 96))
    assert torch.allclose(rope_inv_freq(cfg), want)
    # a model whose context is its original one rotates with the short list
    assert Bridge({**release, "max_position_embeddings": 4096}).cfg.rope_scaling["longrope_factors"] == "short"
    with pytest.raises(UnsupportedModelError, match="write it as longrope"):
        Bridge({**release, "rope_scaling": {**release["rope_scaling"], "type": "yarn"}})


def rope_inv_freq(cfg):
    from forge_megatron.mcore import rope

    return rope.inv_freq(cfg.rope_scaling, cfg.rotary_base, cfg.rotary_dim)


def test_axk1_config_as_transformers_defaults_it():
    """A.X K1 (transformers' AXK1Config defaults, the 519B release's sizes): DeepSeek-V3's multi-latent attention and
    grouped sigmoid routing (192 experts in 8 groups, 4 chosen, top 8, times 2.5), layer 0 dense, and a norm after each
    MoE layer's MLP; the release's norm for the dense layer is left out, its missing score bias read as zeros."""
    hf = {**transformers.AXK1Config().to_dict(), "architectures": ["AXK1ForCausalLM"]}
    bridge = Bridge(hf)
    cfg = bridge.cfg
    assert cfg.multi_latent_attention and cfg.moe_output_norm and not cfg.post_norm
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_dense_layers, cfg.extra["moe_router_num_groups"],
            cfg.extra["moe_router_group_topk"], cfg.extra["moe_router_topk_scaling_factor"]) == (192, 8, 1, 8, 4, 2.5)
    assert bridge.hf_names("decoder.layers.1.post_mlp_layernorm.weight") == ["model.layers.1.post_mlp_layernorm.weight"]
    assert "decoder.layers.0.post_mlp_layernorm.weight" not in bridge.canonical_names()
    assert bridge.is_left_out("model.layers.0.post_mlp_layernorm.weight")
    assert not bridge.is_left_out("model.layers.1.post_mlp_layernorm.weight")
    bias = bridge.from_hf("decoder.layers.1.mlp.router.expert_bias", {})
    assert bias.shape == (192,) and not bias.any()
    with pytest.raises(MappingError, match="gate.weight"):  # only the bias may be absent
        bridge.from_hf("decoder.layers.1.mlp.router.weight", {})


def test_minicpm5_moe_config_as_transformers_defaults_it():
    """MiniCPM5-MoE (transformers' MiniCPM5MoeConfig defaults, the 15B-A2.5B release's sizes): gated attention (q_proj
    of 2 x 32 heads of 128: each head's queries then its gate), layer 0 dense, 160 experts under an fp32 sigmoid router
    (top 16, renormalised, times 3.66, no groups) beside a shared expert; a partial RoPE factor (which transformers
    would ignore, rotating whole heads) is refused."""
    hf = {**transformers.MiniCPM5MoeConfig().to_dict(), "architectures": ["MiniCPM5MoeForCausalLM"]}
    bridge = Bridge(hf)
    cfg = bridge.cfg
    assert cfg.attention_output_gate and cfg.rotary_percent == 1.0 and not cfg.qk_layernorm
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_dense_layers, cfg.moe_shared_ffn_hidden_size) == \
        (160, 16, 1, 512)
    assert cfg.extra["moe_router_dtype"] == "fp32" and cfg.extra["moe_router_topk_scaling_factor"] == 3.66
    assert cfg.extra["moe_router_num_groups"] is None
    assert bridge.hf_shape("model.layers.0.self_attn.q_proj.weight") == (2 * 32 * 128, 2048)
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
        Bridge({**hf, "rope_parameters": {**hf["rope_parameters"], "partial_rotary_factor": 0.5}})
    assert Bridge({**hf, "architectures": ["MiniCPM5MoEForCausalLM"]}).family.name == "minicpm5_moe"  # (older name)


def test_mellum_config_as_transformers_defaults_it():
    """Mellum 2 (transformers' MellumConfig defaults, the 12B-A2.5B release's sizes): Qwen3-MoE's layers, every one
    full attention and MoE as transformers fills them in; with sliding layers they see a window and rotate with their
    own base; dense layers where mlp_layer_types says; the MTP layer (mtp.*) left out."""
    hf = {**transformers.MellumConfig().to_dict(), "architectures": ["MellumForCausalLM"]}
    cfg = Bridge(hf).cfg
    assert (cfg.num_moe_experts, cfg.moe_ffn_hidden_size, cfg.qk_layernorm, cfg.rotary_base) == (64, 896, True, 5e5)
    assert cfg.moe_layer_pattern is None and not any(cfg.extra["window_attn_skip_freq"])
    n = hf["num_hidden_layers"]
    types = ["sliding_attention", "sliding_attention", "full_attention"] * (n // 3) + ["full_attention"] * (n % 3)
    mixed = Bridge({**hf, "layer_types": types, "mlp_layer_types": ["dense"] + ["sparse"] * (n - 1),
                    "num_nextn_predict_layers": 1})
    cfg = mixed.cfg
    assert cfg.extra["window_size"] == (1023, 0) and cfg.extra["window_attn_skip_freq"][:3] == [1, 1, 0]
    assert (cfg.rotary_base, cfg.sliding_rotary_base) == (5e5, 1e4)
    assert cfg.moe_layer_pattern == (False,) + (True,) * (n - 1) and cfg.ffn_hidden_size == 7168
    assert mixed.hf_names("decoder.layers.0.mlp.linear_fc1.weight") == \
        ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    assert mixed.is_mtp_tensor("mtp.layers.0.self_attn.q_proj.weight")
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):  # (the sliding layers' factor)
        Bridge({**hf, "layer_types": types, "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 5e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}})


def test_kolibri1_config_as_transformers_defaults_it():
    """Kolibri 1 (transformers' Kolibri1Config defaults): EXAONE 4.0's attention (every fifth layer full attention
    without RoPE, the others 513-position windows that rotate) in GLM-4's sandwich norms under Kolibri's names; every
    layer 384 experts (top 6 by logit plus bias, the sigmoids kept as they are) beside a shared expert; a config
    without layer_types gets transformers' pattern, one without a shared expert is refused."""
    hf = {**transformers.Kolibri1Config().to_dict(), "architectures": ["Kolibri1ForCausalLM"]}
    bridge = Bridge(hf)
    cfg = bridge.cfg
    assert cfg.pre_norm and cfg.post_norm and cfg.qk_layernorm and cfg.moe_logit_bias_router
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_shared_ffn_hidden_size, cfg.moe_router_topk_renorm) == \
        (384, 6, 512, False)
    assert cfg.nope_layers[:5] == (False, False, False, False, True) and cfg.extra["window_size"] == (512, 0)
    assert bridge.hf_names("decoder.layers.2.mlp.router.expert_bias") == ["model.layers.2.moe.router.expert_bias"]
    assert bridge.hf_names("decoder.layers.2.post_self_attn_layernorm.weight") == \
        ["model.layers.2.post_attn_norm.weight"]
    assert bridge.hf_names("decoder.layers.2.pre_mlp_layernorm.weight") == \
        ["model.layers.2.post_attention_layernorm.weight"]
    no_types = {k: v for k, v in hf.items() if k != "layer_types"}
    assert Bridge(no_types).cfg.nope_layers == cfg.nope_layers
    with pytest.raises(UnsupportedModelError, match="shared_expert_intermediate_size"):
        Bridge({**hf, "shared_expert_intermediate_size": 0})


def test_lfm3_config_as_transformers_defaults_it():
    """LFM3 (transformers' Lfm3Config defaults, the 1.7B release's sizes): transformers' layer pattern (layer 2 of
    every 4 full attention, layer 0 of every 4 but the first a 256-position window, the others short convolutions),
    sandwich norms, a gate per head; the sliding layers' plain base-10k RoPE is the model's table, the full layers'
    proportional RoPE (half the frequencies, base 1M) their own; the MLP as wide as given; a partial factor on plain
    RoPE refused."""
    hf = {**transformers.Lfm3Config().to_dict(), "architectures": ["Lfm3ForCausalLM"]}
    bridge = Bridge(hf)
    cfg = bridge.cfg
    types = hf["layer_types"]
    assert cfg.pre_norm and cfg.post_norm and cfg.attention_head_gate and cfg.ffn_hidden_size == 7680
    assert cfg.linear_attention == tuple(t == "conv" for t in types) and cfg.linear_attention_kind == "short_conv"
    assert (cfg.rotary_base, cfg.rope_scaling, cfg.rotary_percent) == (1e4, None, 1.0)
    assert cfg.full_rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 1.0}
    assert cfg.full_rotary_base == 1e6 and cfg.extra["window_size"] == (255, 0)
    assert cfg.extra["window_attn_skip_freq"] == [int(t == "sliding_attention") for t in types]
    assert bridge.hf_names("decoder.layers.2.self_attention.linear_gate.weight") == \
        ["model.layers.2.self_attn.gate_proj.weight"]
    assert bridge.hf_names("decoder.layers.1.post_self_attn_layernorm.weight") == \
        ["model.layers.1.post_operator_norm.weight"]
    assert bridge.hf_shape("model.layers.2.self_attn.gate_proj.weight") == (16, 2048)
    with pytest.raises(UnsupportedModelError, match="sliding_attention layers' partial_rotary_factor"):
        Bridge({**hf, "rope_parameters": {**hf["rope_parameters"], "sliding_attention": {
            "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}})


def test_hy_v3_config_as_transformers_defaults_it():
    """Hy3 (transformers' HYV3Config defaults, the preview release's sizes): 80 layers, the first dense (13312 wide),
    then 192 experts (1536 wide) top-8 under a sigmoid router choosing with its bias, renormalised, times 2.826, beside
    one shared expert; per-head q/k norms; Hy3's names; its MTP layer (model.layers.80.*) left out."""
    hf = {**transformers.HYV3Config().to_dict(), "architectures": ["HYV3ForCausalLM"]}
    bridge = Bridge(hf)
    cfg = bridge.cfg
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.moe_shared_ffn_hidden_size,
            cfg.moe_dense_layers, cfg.ffn_hidden_size, cfg.qk_layernorm) == (192, 8, 1536, 1536, 1, 13312, True)
    assert cfg.extra["moe_router_score_function"] == "sigmoid" and cfg.extra["moe_router_topk_scaling_factor"] == 2.826
    assert cfg.extra["moe_router_num_groups"] is None
    assert bridge.hf_names("decoder.layers.1.mlp.router.weight") == ["model.layers.1.mlp.router.gate.weight"]
    assert bridge.hf_names("decoder.layers.1.mlp.router.expert_bias") == ["model.layers.1.mlp.expert_bias"]
    assert bridge.hf_names("decoder.layers.1.mlp.shared_experts.linear_fc2.weight") == \
        ["model.layers.1.mlp.shared_mlp.down_proj.weight"]
    assert bridge.is_mtp_tensor("model.layers.80.self_attn.q_proj.weight")
    assert not bridge.is_mtp_tensor("model.layers.79.self_attn.q_proj.weight")


def test_hyperclovax_config_as_transformers_defaults_it():
    """HyperCLOVA X SEED (transformers' HyperCLOVAXConfig defaults, with a release's muP-style values): Granite's
    scales, norms after attention and MLP too (post_norm1 / post_norm2), the logits multiplied by logits_scaling
    (Cohere's multiplier, not Granite's divisor); the attention scale head_dim ** -0.5 where the config gives none;
    without use_post_norm, Granite's layer."""
    hf = {**transformers.HyperCLOVAXConfig().to_dict(), "architectures": ["HyperCLOVAXForCausalLM"]}
    bridge = Bridge({**hf, "logits_scaling": 0.125, "embedding_multiplier": 10.0, "residual_multiplier": 0.25,
                     "attention_multiplier": 0.0078125})
    cfg = bridge.cfg
    assert cfg.pre_norm and cfg.post_norm and cfg.logits_scaling is None and cfg.logit_multiplier == 0.125
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.softmax_scale) == (10.0, 0.25, 0.0078125)
    assert bridge.hf_names("decoder.layers.0.post_mlp_layernorm.weight") == ["model.layers.0.post_norm2.weight"]
    assert bridge.hf_names("decoder.layers.0.pre_mlp_layernorm.weight") == \
        ["model.layers.0.post_attention_layernorm.weight"]
    plain = Bridge({**hf, "use_post_norm": False}).cfg
    assert not plain.post_norm and plain.softmax_scale == (hf["hidden_size"] // hf["num_attention_heads"]) ** -0.5


def test_jais2_config_as_transformers_defaults_it():
    """Jais 2 (transformers' Jais2Config defaults, the 8B release's sizes): LayerNorms with biases, biases on every
    projection, a plain squared-ReLU MLP 26624 wide; attention and MLP biases that differ are refused (Megatron
    biases the output projection and the MLP together)."""
    hf = {**transformers.Jais2Config().to_dict(), "architectures": ["Jais2ForCausalLM"]}
    bridge = Bridge(hf)
    cfg = bridge.cfg
    assert (cfg.normalization, cfg.norm_bias, cfg.add_bias_linear, cfg.add_qkv_bias, cfg.swiglu, cfg.activation,
            cfg.ffn_hidden_size) == ("LayerNorm", True, True, True, False, "relu2", 26624)
    assert bridge.hf_names("decoder.final_layernorm.bias") == ["model.norm.bias"]
    assert bridge.hf_names("decoder.layers.0.mlp.linear_fc1.bias") == ["model.layers.0.mlp.up_proj.bias"]
    assert "decoder.final_layernorm.bias" in bridge.stage_names(ParallelLayout(pp=2), 1)
    assert "decoder.final_layernorm.bias" not in bridge.stage_names(ParallelLayout(pp=2), 0)
    with pytest.raises(UnsupportedModelError, match="attention_bias and mlp_bias differ"):
        Bridge({**hf, "mlp_bias": False})


def test_glm_config_as_transformers_defaults_it():
    """GLM-4 9B (transformers' GlmConfig defaults): biases on q/k/v, RoPE on interleaved pairs of half of each head,
    gate and up in one checkpoint tensor, pre-norm layers only."""
    hf = {**transformers.GlmConfig().to_dict(), "architectures": ["GlmForCausalLM"]}
    bridge = Bridge(hf)
    cfg = bridge.cfg
    assert (cfg.add_qkv_bias, cfg.rotary_interleaved, cfg.rotary_percent, cfg.pre_norm, cfg.post_norm) == \
        (True, True, 0.5, True, False)
    assert bridge.hf_names("decoder.layers.0.mlp.linear_fc1.weight") == ["model.layers.0.mlp.gate_up_proj.weight"]
    assert bridge.hf_names("decoder.layers.0.pre_mlp_layernorm.weight") == \
        ["model.layers.0.post_attention_layernorm.weight"]


M1_RELEASE = {  # MiniMax-M1-80k's config.json, as released (its own names; transformers' port renames them)
    "architectures": ["MiniMaxM1ForCausalLM"], "model_type": "minimax_m1", "attn_type_list": [0] * 7 + [1],
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 6144, "intermediate_size": 9216,
    "layernorm_full_attention_alpha": 3.5565588200778455, "layernorm_full_attention_beta": 1.0,
    "layernorm_linear_attention_alpha": 3.5565588200778455, "layernorm_linear_attention_beta": 1.0,
    "layernorm_mlp_alpha": 3.5565588200778455, "layernorm_mlp_beta": 1.0, "max_position_embeddings": 10240000,
    "num_attention_heads": 64, "num_experts_per_tok": 2, "num_hidden_layers": 80, "num_key_value_heads": 8,
    "num_local_experts": 32, "postnorm": True, "rms_norm_eps": 1e-05, "rope_theta": 10000000, "rotary_dim": 64,
    "shared_intermediate_size": 0, "tie_word_embeddings": False, "vocab_size": 200064, "block": 256,
}
M1_RELEASE["attn_type_list"] = M1_RELEASE["attn_type_list"] * 10


def test_minimax_m1_config_as_released():
    """MiniMax-M1 (its release's names): seven lightning layers then a softmax one, eighty layers; every residual
    alpha 3.56 of the norm's output plus the sublayer; RoPE on the first 64 of 128 channels, base 1e7; 32 experts,
    top 2 renormalised, under Mixtral's names; the lightning layers' tensors and shapes, their decay tables left out.
    transformers' port reads the same: its field names, its default layer pattern."""
    bridge = Bridge(M1_RELEASE)
    cfg = bridge.cfg
    assert cfg.linear_attention == tuple(c == 0 for c in M1_RELEASE["attn_type_list"])
    assert cfg.linear_attention_kind == "lightning" and sum(not x for x in cfg.linear_attention) == 10
    assert (cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_norm_epsilon) == (64, 128, 1e-6)
    alpha = 3.5565588200778455
    assert cfg.norm_residual_scales == ((alpha, 1.0), (alpha, 1.0), (alpha, 1.0))
    assert (cfg.rotary_percent, cfg.rotary_base, cfg.kv_channels, cfg.num_query_groups) == (0.5, 1e7, 128, 8)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (32, 2, 9216)
    assert cfg.moe_router_topk_renorm and not cfg.moe_router_pre_softmax and not cfg.moe_shared_ffn_hidden_size
    assert bridge.hf_names("decoder.layers.0.self_attention.in_proj.weight") == \
        ["model.layers.0.self_attn.qkv_proj.weight"]
    assert bridge.hf_names("decoder.layers.0.self_attention.gate_proj.weight") == \
        ["model.layers.0.self_attn.output_gate.weight"]
    assert bridge.hf_names("decoder.layers.7.self_attention.linear_qkv.weight") == \
        [f"model.layers.7.self_attn.{p}_proj.weight" for p in "qkv"]
    assert bridge.hf_names("decoder.layers.3.mlp.router.weight") == ["model.layers.3.block_sparse_moe.gate.weight"]
    assert bridge.hf_shape("model.layers.0.self_attn.qkv_proj.weight") == (3 * 8192, 6144)
    assert bridge.hf_shape("model.layers.0.self_attn.norm.weight") == (8192,)
    assert bridge.hf_shape("model.layers.7.self_attn.q_proj.weight") == (8192, 6144)
    assert bridge.is_left_out("model.layers.0.self_attn.slope_rate")
    assert not bridge.is_left_out("model.layers.0.self_attn.norm.weight")
    port = {**transformers.MiniMaxConfig(num_hidden_layers=4).to_dict(), "architectures": ["MiniMaxForCausalLM"]}
    cfg = Bridge(port).cfg  # (transformers' default: every other layer lightning, the first softmax; scales of 1)
    assert cfg.linear_attention == (False, True, False, True) and cfg.rotary_percent == 1.0
    assert cfg.norm_residual_scales == ((1.0, 1.0),) * 3


@pytest.mark.parametrize("change,message", [
    ({"postnorm": False}, "postnorm=False"),
    ({"shared_intermediate_size": 512}, "shared_intermediate_size"),
    ({"sliding_window": 4096}, "sliding_window"),
    ({"attn_type_list": [0, 2] * 40}, "attn_type_list"),
    ({"num_local_experts": [32, 16] * 40}, "num_local_experts per layer"),
])
def test_minimax_m1_options_forge_does_not_build_are_refused(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        Bridge({**M1_RELEASE, **change})


@pytest.mark.parametrize("size", ["2b", "7b"])
def test_gemma_configs_as_released(size):
    """Gemma (1) as released (gemma-2b: one key head; gemma-7b: 16): pre-norm Llama layers with Gemma's (1 + w)
    norms, GeGLU with the tanh GELU (the release's ``gelu``, which transformers reads as it), the embedding scaled by
    sqrt(hidden), heads of 256 scaled by 1 / 16, RoPE base 10k, the head tied, Llama's names."""
    hf = {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "hidden_act": "gelu", "head_dim": 256,
          "hidden_size": {"2b": 2048, "7b": 3072}[size], "intermediate_size": {"2b": 16384, "7b": 24576}[size],
          "num_attention_heads": {"2b": 8, "7b": 16}[size], "num_key_value_heads": {"2b": 1, "7b": 16}[size],
          "num_hidden_layers": {"2b": 18, "7b": 28}[size], "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
          "rope_theta": 10000.0, "attention_bias": False, "vocab_size": 256000}
    bridge = Bridge(hf)
    cfg = bridge.cfg
    assert cfg.zero_centered_norm and cfg.activation == "gelu_tanh" and cfg.swiglu and cfg.tie_word_embeddings
    assert cfg.embedding_multiplier == hf["hidden_size"] ** 0.5 and cfg.pre_norm and not cfg.post_norm
    assert (cfg.kv_channels, cfg.num_query_groups, cfg.rotary_base) == (256, hf["num_key_value_heads"], 1e4)
    assert cfg.softmax_scale is None and not cfg.extra.get("window_size")
    assert bridge.hf_names("decoder.layers.1.pre_mlp_layernorm.weight") == \
        ["model.layers.1.post_attention_layernorm.weight"]
    with pytest.raises(UnsupportedModelError, match="hidden_act 'silu'"):
        Bridge({**hf, "hidden_act": "silu"})


def test_starcoder2_config_as_released():
    """StarCoder2-15B as released: 40 layers of 48 heads of 128 (4 key heads), every layer a 4096-position window,
    RoPE base 100k, LayerNorms (eps 1e-5) and every projection biased, a plain tanh-GELU MLP 24576 wide under c_fc /
    c_proj; the dropout fields are left to transformers' training mode (forge trains without dropout)."""
    hf = {"architectures": ["Starcoder2ForCausalLM"], "model_type": "starcoder2", "hidden_act": "gelu_pytorch_tanh",
          "hidden_size": 6144, "intermediate_size": 24576, "num_attention_heads": 48, "num_key_value_heads": 4,
          "num_hidden_layers": 40, "max_position_embeddings": 16384, "norm_epsilon": 1e-5, "rope_theta": 100000,
          "sliding_window": 4096, "use_bias": True, "vocab_size": 49152, "attention_dropout": 0.1,
          "residual_dropout": 0.1, "embedding_dropout": 0.1}
    bridge = Bridge(hf)
    cfg = bridge.cfg
    assert not cfg.swiglu and cfg.activation == "gelu_tanh" and cfg.normalization == "LayerNorm"
    assert cfg.add_qkv_bias and cfg.add_bias_linear and cfg.norm_epsilon == 1e-5 and cfg.rotary_base == 1e5
    assert (cfg.kv_channels, cfg.num_query_groups, cfg.ffn_hidden_size) == (128, 4, 24576)
    assert cfg.extra["window_size"] == (4095, 0) and cfg.extra["window_attn_skip_freq"] == [1] * 40
    assert bridge.hf_names("decoder.layers.3.mlp.linear_fc1.weight") == ["model.layers.3.mlp.c_fc.weight"]
    assert bridge.hf_names("decoder.layers.3.mlp.linear_fc2.bias") == ["model.layers.3.mlp.c_proj.bias"]
    assert bridge.hf_names("decoder.final_layernorm.bias") == ["model.norm.bias"]
    assert bridge.hf_shape("model.layers.3.mlp.c_fc.weight") == (24576, 6144)
    assert cfg.tie_word_embeddings  # (the config says nothing: transformers' default ties them)
    assert not Bridge({**hf, "sliding_window": None}).cfg.extra.get("window_size")
    assert not Bridge({**hf, "tie_word_embeddings": False}).cfg.tie_word_embeddings


def test_laguna_config_as_transformers_defaults_it():
    """Laguna (transformers' LagunaConfig defaults, XS.2's sizes): 40 full-attention layers of 48 query heads (8 key
    heads of 128) rotating the first half of each head with base 500k (the model's table, no layer of another kind), a
    softplus gate per head, per-head q/k norms; the first layer dense (8192 wide), then 256 experts of 512, top 8 of a
    sigmoid choosing with its bias, beside a shared expert; per-layer heads and windows when the config has them;
    what forge does not build refused by name."""
    hf = {**transformers.LagunaConfig().to_dict(), "architectures": ["LagunaForCausalLM"]}
    bridge = Bridge(hf)
    cfg = bridge.cfg
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (48, 8, 128)
    assert cfg.layer_attention_heads is None and cfg.global_partial_rotary is None
    assert (cfg.rotary_base, cfg.rotary_percent) == (5e5, 0.5) and cfg.qk_layernorm
    assert cfg.attention_head_gate and cfg.head_gate_activation == "softplus" and not cfg.head_gate_per_element
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (256, 8, 512)
    assert cfg.moe_shared_ffn_hidden_size == 512 and cfg.ffn_hidden_size == 8192
    assert cfg.moe_layer_pattern == (False,) + (True,) * 39
    assert cfg.extra["moe_router_score_function"] == "sigmoid" and cfg.extra["moe_router_enable_expert_bias"]
    assert bridge.hf_names("decoder.layers.1.mlp.router.expert_bias") == \
        ["model.layers.1.mlp.experts.e_score_correction_bias"]
    assert bridge.hf_names("decoder.layers.1.mlp.shared_experts.linear_fc2.weight") == \
        ["model.layers.1.mlp.shared_expert.down_proj.weight"]
    assert bridge.hf_names("decoder.layers.0.self_attention.linear_gate.weight") == \
        ["model.layers.0.self_attn.g_proj.weight"]
    assert bridge.hf_shape("model.layers.0.self_attn.g_proj.weight") == (48, 2048)
    mixed = Bridge({**hf, "num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
                    "num_attention_heads_per_layer": [64, 48, 64, 48], "gating": "per-element",
                    "mlp_layer_types": ["dense"] + ["sparse"] * 3})
    cfg = mixed.cfg
    assert cfg.layer_attention_heads == (64, 48, 64, 48) and cfg.head_gate_per_element
    assert (cfg.rotary_base, cfg.rotary_percent, cfg.global_partial_rotary) == (1e4, 1.0, (5e5, 0.5))
    assert cfg.extra["window_size"] == (511, 0) and cfg.extra["window_attn_skip_freq"] == [1, 0, 1, 0]
    assert mixed.hf_shape("model.layers.0.self_attn.q_proj.weight") == (64 * 128, 2048)
    assert mixed.hf_shape("model.layers.1.self_attn.o_proj.weight") == (2048, 48 * 128)
    assert mixed.hf_shape("model.layers.2.self_attn.g_proj.weight") == (64 * 128, 2048)
    for change, message in (({"moe_router_logit_softcapping": 30.0}, "moe_router_logit_softcapping"),
                            ({"attention_bias": True}, "attention_bias"), ({"gating": "per-token"}, "gating"),
                            ({"mlp_layer_types": ["dense"] * 40}, "without a sparse layer")):
        with pytest.raises(UnsupportedModelError, match=message):
            Bridge({**hf, **change})


def test_flint_config_as_transformers_defaults_it():
    """Flint (transformers' FlintConfig defaults, the release's sizes): 49 layers, full attention without RoPE on the
    first two, every fourth from layer 1 and the last, a 513-position window that rotates on the others; a sink logit
    per head in every layer (softmax_offset as released); layers 0 and 1 dense (6144 wide), the others 256 experts of
    512, top 6 of a sigmoid renormalised, beside a shared expert of 1024."""
    hf = {**transformers.FlintConfig().to_dict(), "architectures": ["FlintForCausalLM"]}
    bridge = Bridge(hf)
    cfg = bridge.cfg
    full = [i < 2 or i % 4 == 1 or i == 48 for i in range(49)]
    assert cfg.nope_layers == tuple(full) and cfg.extra["softmax_type"] == "learnable"
    assert cfg.extra["window_size"] == (512, 0) and cfg.extra["window_attn_skip_freq"] == [int(not f) for f in full]
    assert cfg.moe_layer_pattern == (False, False) + (True,) * 47 and cfg.ffn_hidden_size == 6144
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.moe_shared_ffn_hidden_size) == \
        (256, 6, 512, 1024)
    assert cfg.extra["moe_router_score_function"] == "sigmoid" and "moe_router_enable_expert_bias" not in cfg.extra
    assert bridge.hf_names("decoder.layers.4.self_attention.core_attention.softmax_offset") == \
        ["model.layers.4.self_attn.softmax_offset"]
    assert bridge.hf_names("decoder.layers.4.mlp.shared_experts.linear_fc2.weight") == \
        ["model.layers.4.mlp.shared_expert.down_proj.weight"]
    assert bridge.hf_shape("model.layers.4.self_attn.softmax_offset") == (32,)
    with pytest.raises(UnsupportedModelError, match="norm_topk_prob=False"):
        Bridge({**hf, "norm_topk_prob": False})
    with pytest.raises(UnsupportedModelError, match="no MoE layer"):
        Bridge({**hf, "num_hidden_layers": 2, "layer_types": None})
