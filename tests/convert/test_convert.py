"""Checkpoint conversion (0 GPUs; 1 gloo rank): HF -> Megatron -> HF is bit-exact for every family and layout,
resharding keeps every tensor, the converted Megatron model of every family computes the HF model's
logits, and bad inputs fail with errors that name the problem. (TP=2 / PP=2 / EP=2 models loaded from converted
checkpoints are compared with the HF original in tests/weight_sync, which starts those trainers anyway.)
"""

import glob
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from forge_megatron.bridge import Bridge, MappingError, ParallelLayout, UnsupportedModelError
from forge_megatron.convert import checkpoint as ckpt
from forge_megatron.convert.cli import main as cli_main
from tests.convert.mcore_forward import forward_logits, load_converted
from tests.dist_utils import run_distributed

ARCHS = ("qwen2", "llama", "qwen3", "qwen3_moe", "glm4_moe", "mistral", "deepseek_v3", "glm4_moe_lite", "gpt_oss",
         "minimax_m2", "qwen3_5", "qwen3_5_moe", "qwen3_5_vl", "qwen3_next", "olmo2", "olmo3", "gemma3", "gemma3_vl", "qwen3_vl", "qwen3_vl_moe", "smollm3",
         "seed_oss", "glm4", "kimi_k25", "glm4v", "glm4v_moe", "ministral3", "ministral3_vl", "deepseek_v32",
         "glm_moe_dsa", "mistral4", "mistral4_vl", "olmo_hybrid", "kimi_linear", "gemma4", "gemma4_vl",
         "gemma4_moe", "gemma4_e", "glm46v", "qwen2_5_vl", "qwen2_vl", "ernie4_5", "ernie4_5_moe", "hunyuan_v1_dense",
         "hunyuan_v1_moe", "olmoe", "mimo_v2_flash", "minimax_m3", "minimax_m3_text", "longcat_flash", "dots1",
         "solar_open", "mixtral", "phi3", "qwen2_moe", "exaone4", "exaone_moe", "youtu",
         "granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "granitemoehybrid_moe",
         "granitemoehybrid_mamba", "nemotron_h", "nemotron_h_moe", "lfm2", "lfm2_moe", "gemma2", "llama4", "arcee",
         "granite_swa", "granitemoe_swa", "exaone4_5", "ministral",
         "cohere", "cohere2", "cohere2_moe", "bamba", "apertus", "falcon_h1", "flex_olmo", "afmoe",
         "deepseek_v2", "cwm", "phi4_mini", "nemotron_h_latent", "axk1", "minicpm5_moe", "mellum",
         "kolibri1", "lfm3", "hy_v3", "hyperclovax", "jais2", "glm", "minimax01", "gemma", "starcoder2", "laguna",
         "flint")
SEQ = 12
# long-context RoPE (mcore/rope.py), with original lengths below SEQ so the scaling reaches the positions used
ROPE_SCALED = [
    ("llama_llama3", "llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8}),
    ("qwen2_yarn", "qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
    ("qwen3_linear", "qwen3", {"rope_type": "linear", "factor": 2.0}),
    # DeepSeek-V3 / Kimi-K2 style: YaRN on the rotated channels, softmax scale mscale(factor, mscale_all_dim)^2
    ("deepseek_yarn", "deepseek_v3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                      "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
    # YaRN on part of each head: its attention factor scales the rotated channels only (rope.scale_rotated_channels;
    # a softmax scale, as for whole-head RoPE, was 7e-3 / 4e-2 off): GLM-4 (half, q/k/v biases), Qwen3.5 (a quarter,
    # after zero-centred q/k norms, gated attention)
    ("glm4_yarn_partial", "glm4", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                   "partial_rotary_factor": 0.5}),
    ("qwen3_5_yarn_partial", "qwen3_5", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                         "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                                         "mrope_interleaved": True}),
]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    from forge_megatron.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("hf")
    dirs = {arch: build_tiny_model(str(root / arch), arch=arch, seed=1, with_tokenizer=False) for arch in ARCHS}
    dirs["qwen3_5_moe_vl"] = build_tiny_model(str(root / "qwen3_5_moe_vl"), arch="qwen3_5_moe_vl", seed=1,
                                              with_tokenizer=False)
    dirs["deepseek_v3_3l"] = build_tiny_model(str(root / "deepseek_v3_3l"), arch="deepseek_v3", seed=5,
                                              with_tokenizer=False, num_hidden_layers=3)
    dirs["qwen3_tied"] = build_tiny_model(str(root / "qwen3_tied"), arch="qwen3", seed=2, with_tokenizer=False,
                                          tie_word_embeddings=True)
    # gpt-oss with a clamp that bites (activations of random weights are ~0.1): Megatron's clamped quick-GELU GLU
    dirs["gpt_oss_clamped"] = build_tiny_model(str(root / "gpt_oss_clamped"), arch="gpt_oss", seed=4,
                                               with_tokenizer=False, swiglu_limit=0.02)
    # OLMo Hybrid with RoPE on its attention layers (the tiny arch, as released, has none: NoPE)
    dirs["olmo_hybrid_rope"] = build_tiny_model(str(root / "olmo_hybrid_rope"), arch="olmo_hybrid", seed=6,
                                                with_tokenizer=False,
                                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    # Moonlight's RoPE: plain, base 50000 (multi-latent attention builds its own rotary module from the config's base)
    dirs["deepseek_v3_base50k"] = build_tiny_model(str(root / "deepseek_v3_base50k"), arch="deepseek_v3", seed=9,
                                                   with_tokenizer=False,
                                                   rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    # Llama 4 Maverick's layout: dense layers (intermediate_size_mlp wide) between the MoE ones
    dirs["llama4_maverick"] = build_tiny_model(str(root / "llama4_maverick"), arch="llama4", seed=10,
                                               with_tokenizer=False, interleave_moe_layer_step=2)
    # Command A+'s other options: RMSNorms, sigmoid expert scores (renormalised), the shared expert summed
    dirs["cohere2_moe_rms"] = build_tiny_model(str(root / "cohere2_moe_rms"), arch="cohere2_moe", seed=11,
                                               with_tokenizer=False, rms_norm_eps=1e-6, expert_selection_fn="sigmoid",
                                               shared_expert_combination_strategy="sum")
    # DeepSeek-V2 236B's layout: a query latent, group_limited_greedy routing (a group scored by its best expert: the
    # best of 2 groups of 4 kept, its top 2 experts, scaled by 16; greedy top 2 or Megatron's group rule differ)
    dirs["deepseek_v2_grouped"] = build_tiny_model(str(root / "deepseek_v2_grouped"), arch="deepseek_v2", seed=12,
                                                   with_tokenizer=False, q_lora_rank=32, n_routed_experts=8,
                                                   topk_method="group_limited_greedy", n_group=2, topk_group=1,
                                                   routed_scaling_factor=16.0)
    from forge_megatron.models.tiny import build_tiny_reward_model

    dirs["qwen2_rm"] = build_tiny_reward_model(str(root / "qwen2_rm"), seed=8)  # a reward model: its score head
    for name, arch, params in ROPE_SCALED:
        dirs[name] = build_tiny_model(str(root / name), arch=arch, seed=3, with_tokenizer=False,
                                      rope_parameters={**params, "rope_theta": 10000.0})
    return dirs


def _hf_tensors(d):
    out = {}
    for f in glob.glob(os.path.join(d, "*.safetensors")):
        out.update(load_file(f))
    return out


def _assert_bit_exact(src, dst):
    a, b = _hf_tensors(src), _hf_tensors(dst)
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


LAYOUTS = [
    ("qwen2", ParallelLayout(tp=2)), ("qwen2", ParallelLayout(pp=2)), ("llama", ParallelLayout(tp=2, pp=2)),
    ("qwen3", ParallelLayout()), ("qwen3_tied", ParallelLayout(tp=2, pp=2)), ("qwen3_moe", ParallelLayout(ep=2)),
    ("qwen3_moe", ParallelLayout(tp=2, pp=2, ep=2)), ("glm4_moe", ParallelLayout(tp=2, pp=2, ep=2)),
    ("deepseek_v3", ParallelLayout(tp=2, pp=2, ep=2)), ("glm4_moe_lite", ParallelLayout(tp=2)),
    ("gpt_oss", ParallelLayout(pp=2, ep=2)),  # experts fused per layer in HF: sliced on import, stacked on export
    ("minimax_m2", ParallelLayout(tp=2, pp=2, ep=2)),  # q/k norm weights split with the heads
    ("qwen3_5", ParallelLayout(tp=2, pp=2)),  # Gated DeltaNet projections regrouped per key head, gated q_proj
    ("qwen3_5_moe", ParallelLayout(tp=2, ep=2)),  # ... with experts and a gated shared expert
    ("qwen3_5_moe_vl", ParallelLayout(tp=2, ep=2)),  # as released: model.language_model.*, the vision tower copied
    ("qwen3_next", ParallelLayout(tp=2, pp=2)),  # Gated DeltaNet projections fused per key head in the checkpoint
    ("olmo3", ParallelLayout(tp=2, pp=2)),  # norms after attention and MLP, q/k norms over all heads split with them
    ("gemma3", ParallelLayout(tp=2, pp=2)),  # sandwich norms, tied embeddings across the two stages
    # Llama 4 Maverick: experts stacked and transposed on disk, split per EP rank; dense and MoE layers interleaved
    ("llama4_maverick", ParallelLayout(tp=2, pp=2, ep=2)),
    ("glm4", ParallelLayout(tp=2, pp=2)),  # GLM-4's fused gate/up split into Megatron's per-rank [gate_i; up_i]
    ("gemma3_vl", ParallelLayout(tp=2)),  # as released: language_model.model.*, the SigLIP tower and projector copied
    ("qwen3_vl_moe", ParallelLayout(tp=2, pp=2, ep=2)),  # experts fused and transposed on disk, split per EP rank
    ("kimi_k25", ParallelLayout(tp=2, pp=2, ep=2)),  # DeepSeek-V3's layout under language_model.*, the head too
    ("glm4v", ParallelLayout(tp=2, pp=2)), ("glm4v_moe", ParallelLayout(tp=2, pp=2, ep=2)),  # model.language_model.*
    ("glm46v", ParallelLayout(tp=2, pp=2)),  # GLM-4.6V: the language model its text_config names, dense
    # Qwen2.5-VL as released: a flat config.json, the language model under model.*, the tower under visual.* copied
    ("qwen2_5_vl", ParallelLayout(tp=2, pp=2)),
    ("ministral3_vl", ParallelLayout(tp=2, pp=2)),  # language_model.model.*, language_model.lm_head, Pixtral copied
    ("deepseek_v32", ParallelLayout(tp=2, pp=2, ep=2)),  # the DSA indexer replicated over TP
    ("glm_moe_dsa", ParallelLayout(tp=2, pp=2, ep=2)),  # layer 1 "shared": no indexer tensors
    ("mistral4_vl", ParallelLayout(tp=2, pp=2, ep=2)),  # experts stacked on disk, under language_model.model.*
    # OLMo Hybrid: six Gated DeltaNet projections and three convolutions regrouped per key head, post-norm attention
    ("olmo_hybrid", ParallelLayout(tp=2, pp=2)),
    # Kimi Linear: Kimi Delta Attention beside multi-latent attention, one self_attn prefix; experts one by one
    ("kimi_linear", ParallelLayout(tp=2, pp=2, ep=2)),
    # Gemma 4: the global layer's q/k (its values are the keys) grouped with its own head size and key heads
    ("gemma4", ParallelLayout(tp=2, pp=2)),
    ("gemma4_vl", ParallelLayout(tp=2)),  # as released: model.language_model.*, the vision tower and embedder copied
    # Gemma 4 26B-A4B: the dense branch in the shared-expert slot, experts stacked per layer and split over EP
    ("gemma4_moe", ParallelLayout(tp=2, pp=2, ep=2)),
    # Gemma 4 E2B / E4B: per-layer inputs (replicated), KV-shared layers' query-only projections, double-wide MLPs
    ("gemma4_e", ParallelLayout(tp=2, pp=2)),
    # uneven pipeline stages (Megatron's num_layers_in_first/last_pipeline_stage): 3 layers as 1 + 2 and 2 + 1
    ("deepseek_v3_3l", ParallelLayout(tp=2, pp=2, ep=2, first=1)), ("deepseek_v3_3l", ParallelLayout(pp=2, last=1)),
    # experts whole on every TP rank (expert TP 1): gpt-oss's biased experts under TP
    ("qwen3_moe", ParallelLayout(tp=2, ep=2, etp=1)), ("gpt_oss", ParallelLayout(tp=2, pp=2, ep=2, etp=1)),
    # a reward model (Qwen2ForSequenceClassification): score.weight replicated on the last stage, no LM head
    ("qwen2_rm", ParallelLayout(tp=2, pp=2)),
    # ERNIE 4.5: interleaved RoPE; the MoE one's score-correction bias [1, E] in HF, experts one by one over EP
    ("ernie4_5", ParallelLayout(tp=2, pp=2)), ("ernie4_5_moe", ParallelLayout(tp=2, pp=2, ep=2)),
    # Hunyuan: q/k norms (applied after RoPE) replicated; the MoE one's router gate.wg and shared_mlp, experts over EP
    ("hunyuan_v1_dense", ParallelLayout(tp=2, pp=2)), ("hunyuan_v1_moe", ParallelLayout(tp=2, pp=2, ep=2)),
    # OLMoE: q/k norms over all heads replicated whole over TP, experts one by one over EP
    ("olmoe", ParallelLayout(tp=2, pp=2, ep=2)),
    # MiMo-V2-Flash: each kind of layer's q/k/v grouped with its own key heads, values narrower; sinks in the sliding
    # layer only; the dense first layer alone on the first stage
    ("mimo_v2_flash", ParallelLayout(tp=2, pp=2, ep=2, first=1)),
    # MiniMax-M3: Mixtral's expert names with a shared expert, the block-sparse layers' indexers replicated over TP,
    # the vision tower, projector and patch merger copied
    ("minimax_m3", ParallelLayout(tp=2, pp=2, ep=2, first=1)),
    # ... and as transformers saves its language model: fused gate / up, experts stacked per layer (split over EP)
    ("minimax_m3_text", ParallelLayout(tp=2, ep=2)),
    # LongCat-Flash: each checkpoint layer two Megatron layers (self_attn.{0,1}, mlps.{0,1}: the first's in the
    # shared-expert slot), a pair per stage; the router's rows for routed and identity experts replicated
    ("longcat_flash", ParallelLayout(tp=2, pp=2, ep=2)),
    ("dots1", ParallelLayout(tp=2, pp=2, ep=2)),  # GLM-4.5's names with per-head q/k norms, replicated over TP
    ("solar_open", ParallelLayout(tp=2, pp=2, ep=2)),  # GLM-4.5's MoE names in every layer
    ("mixtral", ParallelLayout(tp=2, pp=2, ep=2)),  # block_sparse_moe's w1 / w3 / w2
    ("phi3", ParallelLayout(tp=2, pp=2)),  # qkv_proj regrouped per key head, split over TP; gate_up_proj halves
    ("qwen2_moe", ParallelLayout(tp=2, pp=2, ep=2)),  # q/k/v biases, the gated shared expert
    ("exaone4", ParallelLayout(tp=2, pp=2)),  # post norms, per-head q/k norms replicated
    ("exaone_moe", ParallelLayout(tp=2, pp=2, ep=2)),  # the score bias beside the gate
    ("youtu", ParallelLayout(tp=2, pp=2)),  # multi-latent attention with dense MLPs, the head tied
    ("granite", ParallelLayout(tp=2, pp=2)),  # Llama's names, the scales in the config
    ("granitemoeshared", ParallelLayout(tp=2, pp=2, ep=2)),  # stacked experts over EP, the shared MLP's halves
    ("granitemoehybrid", ParallelLayout(tp=2, pp=2)),  # the shared MLP as the layer's MLP
    # Granite 4.0-H: the Mamba-2 layer's projection and convolution regrouped per group, TP splitting the groups
    ("granitemoehybrid_mamba", ParallelLayout(tp=2, pp=2, ep=2)),
    # Nemotron-H: one sublayer per layer (the norm the input or the pre-MLP norm by the layer's kind)
    ("nemotron_h", ParallelLayout(tp=2, pp=2)),
    ("nemotron_h_moe", ParallelLayout(tp=2, pp=2, ep=2)),
    ("nemotron_h_latent", ParallelLayout(tp=2, ep=2)),  # LatentMoE: the latent projections whole on every rank
    # Cohere: one (bias-free) norm per layer, the head tied across two stages; Cohere2-MoE: the dense first layer
    # alone on the first stage, experts one by one over EP, the shared expert split over TP
    ("cohere", ParallelLayout(tp=2, pp=2)), ("cohere2_moe", ParallelLayout(tp=2, pp=2, ep=2, first=1)),
    ("bamba", ParallelLayout(tp=2, pp=2)),  # Granite 4.0-H's Mamba-2 regrouping under Bamba's names
    ("apertus", ParallelLayout(tp=2, pp=2)),  # each layer's xIELU scalars and constants replicated over TP
    ("falcon_h1", ParallelLayout(tp=2, pp=2)),  # attention and the Mamba-2 mixer (mamba.*) in every layer
    ("flex_olmo", ParallelLayout(tp=2, pp=2, ep=2)),  # OLMo 2's post norms, experts one by one over EP
    # AFMoE: q, gate, k, v fused per query group; the router's bias beside it; the dense layer alone on stage 0
    ("afmoe", ParallelLayout(tp=2, pp=2, ep=2, first=1)),
    ("deepseek_v2", ParallelLayout(tp=2, pp=2, ep=2)),  # DeepSeek-V2-Lite: q_proj (no query latent), softmax router
    ("lfm2", ParallelLayout(tp=2, pp=2)),  # the short convolution's projection interleaved per channel, split by TP
    ("lfm2_moe", ParallelLayout(tp=2, pp=2, ep=2)),  # a dense short-convolution layer, then experts
    ("axk1", ParallelLayout(tp=2, pp=2, ep=2)),  # the norm after the experts on the MoE layer's stage only
    ("minicpm5_moe", ParallelLayout(tp=2, pp=2, ep=2)),  # each head's queries and gate in q_proj, split by TP
    ("mellum", ParallelLayout(tp=2, pp=2, ep=2)),  # the dense first layer beside a MoE one, q/k norms replicated
    ("kolibri1", ParallelLayout(tp=2, pp=2, ep=2)),  # four norms per layer under Kolibri's names, the router's bias
    ("lfm3", ParallelLayout(tp=2, pp=2, first=1)),  # the gate per head split over TP with the heads, sandwich norms
    ("hy_v3", ParallelLayout(tp=2, pp=2, ep=2)),  # Hy3's router, bias and shared-expert names
    ("hyperclovax", ParallelLayout(tp=2, pp=2)),  # four norms per layer (post_norm1 / 2), replicated over TP
    ("jais2", ParallelLayout(tp=2, pp=2)),  # biases: q/k/v and fc1 split over TP, o_proj's and fc2's replicated
    ("glm", ParallelLayout(tp=2, pp=2)),  # q/k/v biases regrouped per key head, gate_up_proj's halves over TP
    # MiniMax-M1: lightning layers' per-head q/k/v, gate and norm split over TP (the decay tables as released: none)
    ("minimax01", ParallelLayout(tp=2, pp=2, ep=2, first=1)),
    ("gemma", ParallelLayout(pp=2)),  # one key head (gemma-2b): TP 1; the tied head on the last stage
    ("starcoder2", ParallelLayout(tp=2, pp=2)),  # c_fc's and the q/k/v biases split over TP, c_proj's whole
    # Laguna: each layer's own query heads (4, 8, 4) and gate rows split over TP, the experts' bias as released
    ("laguna", ParallelLayout(tp=2, pp=2, ep=2, first=1)),
    ("flint", ParallelLayout(tp=2, pp=2, ep=2, first=1)),  # the sinks (softmax_offset as released) split over TP
]


@pytest.mark.parametrize("arch,layout", LAYOUTS, ids=[f"{a}-tp{l.tp}pp{l.pp}ep{l.ep}" + ("etp1" if l.etp != l.tp else "")
                                                      + (f"first{l.first}" if l.first else "")
                                                      + (f"last{l.last}" if l.last else "") for a, l in LAYOUTS])
def test_round_trip_bit_exact(hf_dirs, tmp_path, arch, layout):
    ckpt.hf_to_megatron(hf_dirs[arch], str(tmp_path / "mcore"), layout)
    n_files = len(glob.glob(str(tmp_path / "mcore/release/mp_rank_*/model_optim_rng.pt")))
    assert n_files == layout.tp * layout.pp * layout.ep
    ckpt.megatron_to_hf(str(tmp_path / "mcore"), str(tmp_path / "hf"), max_shard_bytes=64 << 10,
                        vision_from=hf_dirs[arch] if Bridge(hf_dirs[arch]).family.multimodal else None)
    _assert_bit_exact(hf_dirs[arch], tmp_path / "hf")
    index = json.load(open(tmp_path / "hf/model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    assert json.load(open(tmp_path / "hf/config.json")) == json.load(open(os.path.join(hf_dirs[arch], "config.json")))


def test_vision_language_export_needs_the_vision_tower(hf_dirs, tmp_path):
    """Qwen3.5 as released: the language model converts (the vision tower is not trained), and an export without
    the checkpoint to copy the vision tower from is refused before anything is written, naming the flag."""
    ckpt.hf_to_megatron(hf_dirs["qwen3_5_vl"], str(tmp_path / "mcore"))
    bridge, _ = ckpt.read_meta(str(tmp_path / "mcore"))
    assert bridge.hf_prefix == "model.language_model." and bridge.cfg.hybrid
    with pytest.raises(ValueError, match="vision-language checkpoint: the export needs the original checkpoint"):
        ckpt.megatron_to_hf(str(tmp_path / "mcore"), str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf")
    with pytest.raises(ValueError, match="has no model.visual"):
        ckpt.megatron_to_hf(str(tmp_path / "mcore"), str(tmp_path / "hf"), vision_from=hf_dirs["qwen3_5"])
    assert cli_main(["mcore-to-hf", "--mcore-dir", str(tmp_path / "mcore"), "--out", str(tmp_path / "hf"),
                     "--vision-from", hf_dirs["qwen3_5_vl"]]) == 0
    _assert_bit_exact(hf_dirs["qwen3_5_vl"], tmp_path / "hf")


def test_olmo_core_norm_names_are_read_as_transformers_does(hf_dirs, tmp_path):
    """OLMo Hybrid checkpoints written by OLMo-core name the linear layers' norms ``attention_layer_norm`` and
    ``feedforward_layer_norm`` (transformers renames them on loading): they convert to the same Megatron weights as
    transformers' names, and the export writes transformers' (SGLang's loader reads those)."""
    src = _hf_tensors(hf_dirs["olmo_hybrid"])
    renamed = {n.replace(".0.input_layernorm.", ".0.attention_layer_norm.")
               .replace(".0.post_attention_layernorm.", ".0.feedforward_layer_norm."): t for n, t in src.items()}
    assert set(renamed) != set(src)
    os.makedirs(tmp_path / "core")
    save_file(renamed, str(tmp_path / "core" / "model.safetensors"))
    shutil.copy(os.path.join(hf_dirs["olmo_hybrid"], "config.json"), tmp_path / "core")
    for name, d in (("a", hf_dirs["olmo_hybrid"]), ("b", str(tmp_path / "core"))):
        ckpt.hf_to_megatron(d, str(tmp_path / name))
    ckpt.megatron_to_hf(str(tmp_path / "b"), str(tmp_path / "back"))
    _assert_bit_exact(hf_dirs["olmo_hybrid"], tmp_path / "back")
    norm = src["model.layers.0.input_layernorm.weight"].clone()
    duplicated = {**renamed, "model.layers.0.input_layernorm.weight": norm}
    save_file(duplicated, str(tmp_path / "core" / "model.safetensors"))
    with pytest.raises(ValueError, match="holds some tensors under two names"):
        ckpt.hf_to_megatron(str(tmp_path / "core"), str(tmp_path / "c"))


def test_reshard_then_export_is_bit_exact(hf_dirs, tmp_path):
    ckpt.hf_to_megatron(hf_dirs["qwen3_moe"], str(tmp_path / "a"), ParallelLayout(tp=2, ep=2))
    ckpt.reshard(str(tmp_path / "a"), str(tmp_path / "b"), ParallelLayout(pp=2, ep=1))
    assert os.path.isfile(tmp_path / "b/release/mp_rank_00_001/model_optim_rng.pt")
    ckpt.megatron_to_hf(str(tmp_path / "b"), str(tmp_path / "hf"))
    _assert_bit_exact(hf_dirs["qwen3_moe"], tmp_path / "hf")


def test_reshard_reads_one_target_stage_at_a_time(hf_dirs, tmp_path, monkeypatch):
    """Resharding writes each target stage from the source stages that hold its tensors, joining only those tensors:
    PP 2 -> PP 2 x TP 2 reads source stage s for target stage s alone (the tied head's embedding from stage 0 for the
    last one), PP 2 -> PP 1 both; the results export bit-exact."""
    src = hf_dirs["qwen3_tied"]
    ckpt.hf_to_megatron(src, str(tmp_path / "a"), ParallelLayout(pp=2))
    calls = []
    real = ckpt.load_megatron_stage

    def recorded(bridge, mcore_dir, layout, pp, names=None):
        out = real(bridge, mcore_dir, layout, pp, names)
        calls.append((pp, sorted(out)))
        return out

    monkeypatch.setattr(ckpt, "load_megatron_stage", recorded)
    ckpt.reshard(str(tmp_path / "a"), str(tmp_path / "b"), ParallelLayout(tp=2, pp=2))
    assert [pp for pp, _ in calls] == [0, 0, 1]
    assert all(n.startswith(("embedding.", "decoder.layers.0.")) for n in calls[0][1])
    assert calls[1][1] == [ckpt.EMBEDDING]  # (target stage 1's tied head)
    assert calls[2][1] and not any(n.startswith(("embedding.", "decoder.layers.0.")) for n in calls[2][1])
    calls.clear()
    ckpt.reshard(str(tmp_path / "a"), str(tmp_path / "c"), ParallelLayout())
    assert [pp for pp, _ in calls] == [0, 1]
    for out in ("b", "c"):
        ckpt.megatron_to_hf(str(tmp_path / out), str(tmp_path / f"hf_{out}"))
        _assert_bit_exact(src, tmp_path / f"hf_{out}")


def test_uneven_pipeline_stages_hold_their_layers_and_reshard(hf_dirs, tmp_path):
    """3 layers over PP = 2 with the first stage holding one (the CLI's Megatron-LM flag): stage 0's file has layer 0,
    stage 1's layers 1 and 2 as its local 0 and 1; the metadata records the split, resharding to PP = 3 (even) and
    exporting is bit-exact; a split the layers cannot take is refused naming the counts."""
    src = hf_dirs["deepseek_v3_3l"]
    assert cli_main(["hf-to-mcore", "--hf-dir", src, "--out", str(tmp_path / "a"), "--pp", "2",
                     "--decoder-first-pipeline-num-layers", "1"]) == 0
    assert ckpt.read_meta(str(tmp_path / "a"))[1] == ParallelLayout(pp=2, first=1)
    for pp, local in ((0, {"0"}), (1, {"0", "1"})):
        state = ckpt.load_rank_state(str(tmp_path / "a"), tp=0, pp=pp, ep=0)
        assert {k.split(".")[2] for k in state if k.startswith("decoder.layers.")} == local
    ckpt.reshard(str(tmp_path / "a"), str(tmp_path / "b"), ParallelLayout(pp=3))
    ckpt.megatron_to_hf(str(tmp_path / "b"), str(tmp_path / "hf"))
    _assert_bit_exact(src, tmp_path / "hf")
    with pytest.raises(ValueError, match="3 layers do not split into 3 pipeline stages with first stage 2 layers"):
        ckpt.hf_to_megatron(src, str(tmp_path / "c"), ParallelLayout(pp=3, first=2))
    with pytest.raises(ValueError, match="uneven pipeline stages .* need --pipeline-model-parallel-size >= 2"):
        ParallelLayout(first=1)


def test_tp_shards_are_megatron_layout(hf_dirs, tmp_path):
    """QKV shard r holds whole query groups [q.. | k | v]; fc1 shard r holds [gate_r; up_r]."""
    ckpt.hf_to_megatron(hf_dirs["qwen2"], str(tmp_path / "m"), ParallelLayout(tp=2))
    hf = _hf_tensors(hf_dirs["qwen2"])
    r1 = ckpt.load_rank_state(str(tmp_path / "m"), tp=1, pp=0, ep=0)
    h = 16  # head dim: 64 / 4 heads; 2 heads per group, groups 0 and 1 -> rank 1 holds group 1
    qkv = r1["decoder.layers.1.self_attention.linear_qkv.weight"]
    q = hf["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(qkv[: 2 * h], q[2 * h: 4 * h])
    assert torch.equal(qkv[2 * h: 3 * h], hf["model.layers.1.self_attn.k_proj.weight"][h: 2 * h])
    assert torch.equal(qkv[3 * h:], hf["model.layers.1.self_attn.v_proj.weight"][h: 2 * h])
    fc1 = r1["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:64], hf["model.layers.0.mlp.gate_proj.weight"][64:])
    assert torch.equal(fc1[64:], hf["model.layers.0.mlp.up_proj.weight"][64:])


# ------------------------------------------------------------------------------------- logits vs transformers
def _tokens():
    return torch.randint(0, 400, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _hf_logits(hf_dir):
    from forge_megatron.models import load_causal_lm

    model = load_causal_lm(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=_tokens()).logits


def _megatron_logits_body(rank, world_size, mcore_dirs, tp2_dir):
    """Load each converted checkpoint into a Megatron model for this rank and return the full logits; also return
    the error of loading a TP=2 checkpoint into this TP=1 job."""
    out = {}
    for key, d in mcore_dirs.items():
        _, model = load_converted(d)
        out[key] = forward_logits(model, _tokens())
    try:
        load_converted(tp2_dir)
    except ValueError as exc:
        out["layout_error"] = str(exc)
    return out


def _convert_all(hf_dirs, root, archs, layout):
    dirs = {}
    for arch in archs:
        dirs[arch] = str(root / f"{arch}-{layout.tp}{layout.pp}{layout.ep}")
        ckpt.hf_to_megatron(hf_dirs[arch], dirs[arch], layout)
    return dirs


def test_megatron_logits_equal_hf_every_family(hf_dirs, tmp_path):
    # (gemma2: soft-capped attention scores and logits, caps that bite in the tiny model)
    archs = ARCHS + ("qwen3_tied", "gpt_oss_clamped", "olmo_hybrid_rope", "deepseek_v3_base50k", "llama4_maverick",
                     "cohere2_moe_rms", "deepseek_v2_grouped") + \
        tuple(name for name, _, _ in ROPE_SCALED)
    ckpt.hf_to_megatron(hf_dirs["qwen2"], str(tmp_path / "tp2"), ParallelLayout(tp=2))
    (out,) = run_distributed(_megatron_logits_body, world_size=1, tp2_dir=str(tmp_path / "tp2"),
                             mcore_dirs=_convert_all(hf_dirs, tmp_path, archs, ParallelLayout()))
    for arch in archs:
        diff = (out[arch] - _hf_logits(hf_dirs[arch])).abs().max().item()
        assert diff <= 1e-4, (arch, diff)
    assert "has layout ParallelLayout(tp=2, pp=1, ep=1, etp=2), this job runs ParallelLayout(tp=1, pp=1, ep=1, etp=1)" in \
        out["layout_error"]


def _sum_logprob(logits_bsV):
    tokens = _tokens()
    logp = torch.log_softmax(logits_bsV.float(), dim=-1)[:, :-1]
    return logp.gather(-1, tokens[:, 1:, None]).sum()


def _megatron_grads_body(rank, world_size, mcore_dirs):
    """Each converted model's gradients (canonical names) of the summed next-token logprobs of ``_tokens()``."""
    from forge_megatron.mcore.model import causal_mask

    out = {}
    for key, d in mcore_dirs.items():
        _, model = load_converted(d)
        tokens = _tokens()
        positions = torch.arange(tokens.shape[1])[None].expand_as(tokens)
        _sum_logprob(model(tokens, positions, causal_mask(tokens.shape[1]))).backward()
        out[key] = {name: p.grad.clone() if p.grad is not None else torch.zeros_like(p)  # unrouted experts
                    for name, p in model.named_parameters()}
    return out


GRAD_ARCHS = ARCHS + ("qwen3_tied", "llama4_maverick", "cohere2_moe_rms", "deepseek_v2_grouped")


def test_megatron_gradients_equal_hf(hf_dirs, tmp_path):
    """Logits equal at one point do not show that every parameter is used as HF uses it (a detached norm, a swapped
    pair of norms fed the same input): the gradients of every parameter equal transformers'. HF's gradients are
    written out by ``save_pretrained`` (models.save_checkpoint) in place of the weights, so they carry the checkpoint's names (transformers 5
    renames and fuses some families' tensors in memory) and the bridge's export of the Megatron gradients lines up
    with them name for name."""
    from forge_megatron.models import load_causal_lm, save_checkpoint

    (out,) = run_distributed(_megatron_grads_body, world_size=1,
                             mcore_dirs=_convert_all(hf_dirs, tmp_path, GRAD_ARCHS, ParallelLayout()))
    for arch in GRAD_ARCHS:
        hf = load_causal_lm(hf_dirs[arch], dtype=torch.float32)
        _sum_logprob(hf(input_ids=_tokens()).logits).backward()
        with torch.no_grad():
            for p in hf.parameters():
                p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
        save_checkpoint(hf, str(tmp_path / f"{arch}_grads"))
        expected = _hf_tensors(str(tmp_path / f"{arch}_grads"))
        exported = dict(Bridge(hf_dirs[arch]).export(out[arch].items()))
        # buffers (score-correction biases) have no gradient; tied heads are saved once
        assert set(exported) <= set(expected), (arch, sorted(set(exported) - set(expected)))
        for hf_name, g in exported.items():
            ref = expected[hf_name]
            err = ((g - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
            # Gated DeltaNet's decay parameters: sums over every token of terms that largely cancel, in another
            # order than HF's chunked recurrence (tests/mcore/test_tree_exact.py says more)
            assert err <= (1e-2 if hf_name.endswith(("A_log", "dt_bias")) else 1e-4), (arch, hf_name, err)
        assert any(g.any() for g in exported.values())


def test_glm_multi_token_prediction_layers_are_left_out(tmp_path):
    """GLM-4.5 checkpoints append num_nextn_predict_layers MTP layers (layer index num_hidden_layers, ...): the
    conversion leaves them out; any other tensor it does not use is still an error."""
    from forge_megatron.models.tiny import build_tiny_model

    d = build_tiny_model(str(tmp_path / "glm"), arch="glm4_moe", seed=1, with_tokenizer=False,
                         num_nextn_predict_layers=1)
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)  # the MTP layer's own projection
    save_file(tensors, path, metadata={"format": "pt"})
    ckpt.hf_to_megatron(d, str(tmp_path / "out"))
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)  # past the MTP layers: not expected
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(MappingError, match=r"model.layers.3.eh_proj.weight.*not used by the 'glm4_moe' mapping"):
        ckpt.hf_to_megatron(d, str(tmp_path / "out2"))


# ------------------------------------------------------------------------------------------------ bad input
def test_unsupported_architecture(hf_dirs, tmp_path):
    bad = tmp_path / "gpt2"
    shutil.copytree(hf_dirs["llama"], bad)
    cfg = json.load(open(bad / "config.json"))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(bad / "config.json", "w"))
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'GPT2LMHeadModel'"):
        ckpt.hf_to_megatron(str(bad), str(tmp_path / "out"))


def test_missing_and_mismatched_tensor(hf_dirs, tmp_path):
    tensors = _hf_tensors(hf_dirs["qwen2"])
    missing = tmp_path / "missing"
    shutil.copytree(hf_dirs["qwen2"], missing)
    os.remove(missing / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.bias"},
              str(missing / "model.safetensors"))
    with pytest.raises(MappingError, match=r"'model.layers.1.self_attn.k_proj.bias' .* is missing"):
        ckpt.hf_to_megatron(str(missing), str(tmp_path / "o1"))
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(100, 64)
    save_file(tensors, str(missing / "model.safetensors"))
    with pytest.raises(MappingError, match=r"'model.layers.0.mlp.up_proj.weight' has shape \(100, 64\), "
                                           r"the config implies \(128, 64\)"):
        ckpt.hf_to_megatron(str(missing), str(tmp_path / "o2"))


def test_parallel_size_must_divide(hf_dirs, tmp_path):
    with pytest.raises(ValueError, match="2 layers do not split into 3 pipeline stages: give the first"):
        ckpt.hf_to_megatron(hf_dirs["qwen2"], str(tmp_path / "o"), ParallelLayout(pp=3))
    with pytest.raises(ValueError, match="tp=4 does not divide num_query_groups=2"):
        ckpt.hf_to_megatron(hf_dirs["qwen2"], str(tmp_path / "o"), ParallelLayout(tp=4))
    with pytest.raises(ValueError, match="ep=3 does not divide num_moe_experts=4"):
        ckpt.hf_to_megatron(hf_dirs["qwen3_moe"], str(tmp_path / "o"), ParallelLayout(ep=3))
    with pytest.raises(ValueError, match="ep=2 needs a MoE model"):
        ckpt.hf_to_megatron(hf_dirs["qwen2"], str(tmp_path / "o"), ParallelLayout(ep=2))
    with pytest.raises(ValueError, match="tp=2: the experts have biases.*add --expert-tensor-parallel-size 1"):
        ckpt.hf_to_megatron(hf_dirs["gpt_oss"], str(tmp_path / "o"), ParallelLayout(tp=2))
    with pytest.raises(ValueError, match="LongCat-Flash's checkpoint layers are pairs of Megatron layers"):
        ckpt.hf_to_megatron(hf_dirs["longcat_flash"], str(tmp_path / "o"), ParallelLayout(pp=2, first=1))
    with pytest.raises(ValueError, match="etp=1 needs a MoE model"):
        ckpt.hf_to_megatron(hf_dirs["qwen2"], str(tmp_path / "o"), ParallelLayout(tp=2, etp=1))
    with pytest.raises(ValueError, match="expert tensor parallel size 2 must be 1 or the TP size \\(4\\)"):
        ParallelLayout(tp=4, etp=2)
    mxfp4 = {**json.load(open(os.path.join(hf_dirs["gpt_oss"], "config.json"))),
             "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(UnsupportedModelError, match="a mxfp4 checkpoint: train and serve a bf16 copy"):
        Bridge(mxfp4)


def _to_mxfp4(w_EDF: torch.Tensor):
    """A test-side MXFP4 quantiser (the released gpt-oss layout): the bf16 parameter [E, D, F] transposed to
    [E, F, D], 32-value blocks along D, each scaled by 2^e so its largest value fits 6, rounded to the nearest e2m1
    value, two per byte (low nibble first), e stored as e + 127."""
    from forge_megatron.convert.checkpoint import FP4_E2M1

    x = w_EDF.float().transpose(1, 2)  # [E, F, D]
    E, F, D = x.shape
    x = x.reshape(E, F, D // 32, 32)
    e = torch.ceil(torch.log2(x.abs().amax(-1).clamp_min(1e-30) / 6.0)).clamp(-127, 127)
    lut = torch.tensor(FP4_E2M1)
    idx = ((x / torch.exp2(e)[..., None])[..., None] - lut).abs().argmin(-1).to(torch.uint8)  # [E, F, G, 32]
    blocks = idx[..., 0::2] | (idx[..., 1::2] << 4)
    return blocks.contiguous(), (e + 127).to(torch.uint8).contiguous()


def test_mxfp4_checkpoints_become_bf16_copies(hf_dirs, tmp_path):
    """forge-convert mxfp4-to-bf16 on a gpt-oss checkpoint in the released MXFP4 layout: the dequantisation equals
    transformers' own (bit for bit), the copy has no quantization_config, keeps every other tensor, and converts and
    computes like the bf16 model it encodes."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from forge_megatron.convert.checkpoint import HFReader, dequantize_mxfp4, save_hf

    src = hf_dirs["gpt_oss"]
    tensors = _hf_tensors(src)
    config = json.load(open(os.path.join(src, "config.json")))
    packed, expected = {}, {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _to_mxfp4(t)
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            expected[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
            assert torch.equal(dequantize_mxfp4(blocks, scales), expected[name])
            assert (expected[name].float() - t).abs().max() < t.abs().max() / 4  # really an encoding of t
        else:
            packed[name] = t
    mx = tmp_path / "mxfp4"
    save_hf(packed.items(), str(mx), {**config, "quantization_config": {"quant_method": "mxfp4"}})
    assert cli_main(["mxfp4-to-bf16", "--hf-dir", str(mx), "--out", str(tmp_path / "bf16")]) == 0
    out = _hf_tensors(tmp_path / "bf16")
    assert set(out) == set(tensors)
    for name, t in out.items():
        assert torch.equal(t, expected.get(name, tensors[name])), name
    assert "quantization_config" not in json.load(open(tmp_path / "bf16" / "config.json"))
    ckpt.hf_to_megatron(str(tmp_path / "bf16"), str(tmp_path / "m"), ParallelLayout(ep=2))  # trains as gpt-oss
    assert HFReader(str(tmp_path / "bf16")).names() == set(tensors)
    assert cli_main(["mxfp4-to-bf16", "--hf-dir", src, "--out", str(tmp_path / "x")]) == 2  # not MXFP4: refused


@pytest.mark.parametrize("arch", ["deepseek_v3", "kimi_k25"])
def test_int4_checkpoints_become_bf16_copies(hf_dirs, tmp_path, arch):
    """forge-convert int4-to-bf16 on a DeepSeek-V3-layout checkpoint (Kimi-K2-Thinking's; Kimi-K2.5's, its
    quantization_config in text_config) in compressed-tensors' pack-quantized int4 format, packed by the
    compressed-tensors library itself: the dequantisation equals the library's (bit for bit), the copy has no
    quantization_config, keeps every other tensor and converts as the model it encodes; asymmetric and other
    formats are refused by name."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    from forge_megatron.convert.checkpoint import dequantize_int4, save_hf

    group = 32
    src = hf_dirs[arch]
    tensors = _hf_tensors(src)
    config = json.load(open(os.path.join(src, "config.json")))
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    packed, expected = {}, {}
    for name, t in tensors.items():
        if name.endswith("proj.weight") and t.dim() == 2 and t.shape[1] % group == 0:  # Linear layers
            w = t.float()
            scale = (w.reshape(w.shape[0], -1, group).abs().amax(-1) / 7.0).clamp_min(1e-8).to(torch.bfloat16)
            full = scale.float().repeat_interleave(group, dim=1)
            q = torch.round(w / full).clamp(-8, 7).to(torch.int8)
            base = name[: -len(".weight")]
            packed[base + ".weight_packed"] = pack_to_int32(q, 4)
            packed[base + ".weight_scale"] = scale
            packed[base + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int32)
            unpacked = unpack_from_int32(packed[base + ".weight_packed"], 4, t.shape)
            expected[name] = dequantize(unpacked, scale, args=args, dtype=torch.bfloat16)
            assert torch.equal(dequantize_int4(packed[base + ".weight_packed"], scale, t.shape, group),
                               expected[name]), name
            assert (expected[name].float() - w).abs().max() <= w.abs().max() / 4  # really an encoding of t
        else:
            packed[name] = t
    assert len(expected) > 10
    quantization = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                       "strategy": "group", "group_size": group}}}}
    def with_quantization(q):
        if "text_config" in config:
            return {**config, "text_config": {**config["text_config"], "quantization_config": q}}
        return {**config, "quantization_config": q}

    q_dir = tmp_path / "int4"
    save_hf(packed.items(), str(q_dir), with_quantization(quantization))
    with pytest.raises(UnsupportedModelError, match="a compressed-tensors checkpoint: .* forge-convert int4-to-bf16"):
        Bridge(str(q_dir))  # not trained as is: the bridge points to the copy
    assert cli_main(["int4-to-bf16", "--hf-dir", str(q_dir), "--out", str(tmp_path / "bf16")]) == 0
    out = _hf_tensors(tmp_path / "bf16")
    assert set(out) == set(tensors)
    for name, t in out.items():
        assert torch.equal(t, expected.get(name, tensors[name])), name
    assert "quantization_config" not in open(tmp_path / "bf16" / "config.json").read()
    ckpt.hf_to_megatron(str(tmp_path / "bf16"), str(tmp_path / "m"), ParallelLayout(ep=2))
    asym = json.loads(json.dumps(quantization))
    asym["config_groups"]["group_0"]["weights"]["symmetric"] = False
    save_hf(packed.items(), str(tmp_path / "asym"), with_quantization(asym))
    assert cli_main(["int4-to-bf16", "--hf-dir", str(tmp_path / "asym"), "--out", str(tmp_path / "x")]) == 2
    assert cli_main(["int4-to-bf16", "--hf-dir", src, "--out", str(tmp_path / "y")]) == 2  # not int4: refused


def test_cli_help_names_every_architecture_the_bridge_converts():
    from forge_megatron.bridge import FAMILIES
    from forge_megatron.convert import cli

    assert [a for a in FAMILIES if a.split("/")[0] not in cli.__doc__] == []  # "Arch/text model_type" variants


def test_cli_round_trip_and_error_exit(hf_dirs, tmp_path, capsys):
    assert cli_main(["hf-to-mcore", "--hf-dir", hf_dirs["llama"], "--out", str(tmp_path / "m"), "--tp", "2"]) == 0
    assert cli_main(["reshard", "--mcore-dir", str(tmp_path / "m"), "--out", str(tmp_path / "r"), "--pp", "2"]) == 0
    assert cli_main(["mcore-to-hf", "--mcore-dir", str(tmp_path / "r"), "--out", str(tmp_path / "h")]) == 0
    _assert_bit_exact(hf_dirs["llama"], tmp_path / "h")
    assert cli_main(["hf-to-mcore", "--hf-dir", hf_dirs["llama"], "--out", str(tmp_path / "x"), "--tp", "3"]) == 2
    assert "tp=3 does not divide" in capsys.readouterr().err


def _long_dsa_logits_body(rank, world_size, mcore_dirs, tokens):
    """Logits of each converted DSA model on ``tokens``, with chunks small enough that the indexer and the attention
    over the selection run in many query chunks."""
    from forge_megatron.mcore import dsa

    dsa.CHUNK_ELEMENTS = 4096
    out = {}
    for key, d in mcore_dirs.items():
        _, model = load_converted(d)
        out[key] = forward_logits(model, tokens)
    return out


def test_sparse_attention_long_sequences_equal_hf(hf_dirs, tmp_path):
    """DeepSeek-V3.2 / GLM-5 layouts on 200-token sequences (196 of 200 queries pick 4 of up to 200 keys; the indexer
    and the selected-keys attention in chunks of a few queries) give transformers' logits. The padding token is left
    out: its zero embedding scores every key 0, a tie transformers' top-k breaks arbitrarily."""
    archs = ("deepseek_v32", "glm_moe_dsa")
    tokens = torch.randint(1, 400, (2, 200), generator=torch.Generator().manual_seed(0))
    (out,) = run_distributed(_long_dsa_logits_body, world_size=1, tokens=tokens,
                             mcore_dirs=_convert_all(hf_dirs, tmp_path, archs, ParallelLayout()))
    from forge_megatron.models import load_causal_lm

    for arch in archs:
        with torch.no_grad():
            ref = load_causal_lm(hf_dirs[arch], dtype=torch.float32).eval()(input_ids=tokens).logits
        assert (out[arch] - ref).abs().max().item() <= 1e-4, arch


def _long_block_sparse_logits_body(rank, world_size, mcore_dirs, tokens):
    """MiniMax-M3's logits on ``tokens`` with the deep queries' keys masked and gathered, in chunks of a few
    queries."""
    from forge_megatron.mcore import block_sparse

    block_sparse.CHUNK_ELEMENTS = 4096
    _, model = load_converted(mcore_dirs["minimax_m3"])
    out = {}
    for gather in (False, True):
        block_sparse.GATHER_KEYS = gather
        out[gather] = forward_logits(model, tokens)
    return out


def test_block_sparse_attention_long_sequences_equal_hf(hf_dirs, tmp_path):
    """MiniMax-M3's layout on 64-token sequences (60 of 64 queries keep 2 blocks of 2 positions): the attention over
    every earlier key masked to the kept blocks and over the kept blocks' keys gathered both give transformers'
    logits, chunk by chunk."""
    tokens = torch.randint(1, 400, (2, 64), generator=torch.Generator().manual_seed(0))
    (out,) = run_distributed(_long_block_sparse_logits_body, world_size=1, tokens=tokens,
                             mcore_dirs=_convert_all(hf_dirs, tmp_path, ("minimax_m3",), ParallelLayout()))
    from forge_megatron.models import load_causal_lm

    with torch.no_grad():
        ref = load_causal_lm(hf_dirs["minimax_m3"], dtype=torch.float32).eval()(input_ids=tokens).logits
    for gather, logits in out.items():
        assert (logits - ref).abs().max().item() <= 1e-4, gather
