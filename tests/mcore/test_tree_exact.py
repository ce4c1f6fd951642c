"""Tree-packed training equals unmerged training inside Megatron-Core (fp32, CPU, gloo; 0 GPUs, 1-2 ranks).

Per-sample logprobs (and entropies) from ONE tree-packed forward of a GPTModel with TreeAttention + depth RoPE
are compared with each sample run alone through a standard causal GPTModel holding the same weights; and the
parameter gradients of a per-sample weighted loss sum_s w_s sum_t logp_st are compared too. Forests: identical
samples, a sample that is a prefix of another, no shared prefix, a deep chain, a wide fan and random tries.
Runs: one rank (dense + MoE + error messages), TP=2 (vocab-parallel logprobs without gathering the
vocabulary), PP=2 (through Megatron's pipeline schedule with variable-length micro-batches).
"""

import random

import pytest
import torch

from forge_megatron.mcore.parallel import ParallelConfig
from tests.dist_utils import run_distributed

VOCAB = 96
LOGP_ATOL = 1e-5
GRAD_RTOL = 1e-5


def _cfg(**kw):
    from forge_megatron.mcore.model import GPTConfig

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                vocab_size=VOCAB, max_position_embeddings=256)
    base.update(kw)
    return GPTConfig(**base)


def _toks(rng, n):
    return [rng.randrange(VOCAB) for _ in range(n)]


def _random_trie(rng, n_samples):
    """Samples grown by branching off random points of earlier samples."""
    samples = [_toks(rng, rng.randint(3, 12))]
    for _ in range(n_samples - 1):
        base = rng.choice(samples)
        cut = rng.randint(0, len(base))
        samples.append(base[:cut] + _toks(rng, rng.randint(1, 8)))
    return samples


def forest_cases(seed=0):
    rng = random.Random(seed)
    prompt, chain = _toks(rng, 6), _toks(rng, 40)
    same = _toks(rng, 9)
    return {
        "identical": [same, list(same), list(same)],
        "prefix_of_another": [prompt, prompt + _toks(rng, 5), prompt + _toks(rng, 2)],
        "no_shared_prefix": [[t] + _toks(rng, rng.randint(2, 7)) for t in rng.sample(range(VOCAB), 4)],
        "deep_chain": [chain, chain[:33] + _toks(rng, 7)],
        "wide_fan": [prompt + _toks(rng, rng.randint(1, 4)) for _ in range(12)],
        "random_trie": _random_trie(rng, 10),
    }



def all_samples(seed=0):
    return [s for samples in forest_cases(seed).values() for s in samples]


def family_samples(seed=0):
    """A smaller forest with every kind of case (identical samples, prefixes, unshared roots, a deep chain, a fan, a
    random trie) for the loop over model families: 19 samples instead of all_samples' 34 (the loop runs ~70 models)."""
    cases = forest_cases(seed)
    return (cases["identical"] + cases["prefix_of_another"] + cases["no_shared_prefix"][:2] + cases["deep_chain"]
            + cases["wide_fan"][:4] + cases["random_trie"][:5])


def _weights(samples):
    g = torch.Generator().manual_seed(5)
    return torch.rand(len(samples), generator=g) + 0.5


def _weighted_loss(logp_M, layout_or_lengths, w_S):
    """sum_s w_s * sum_t logp_st, with per-sample target counts from the layout (or L_s - 1 lists)."""
    counts = (layout_or_lengths.next_token_index()[2].diff() if hasattr(layout_or_lengths, "next_token_index")
              else torch.tensor(layout_or_lengths))
    return (logp_M * torch.repeat_interleave(w_S, counts)).sum()


def _twin_models(cfg, **kw):
    """A tree GPTModel and a standard causal GPTModel with identical weights (this rank's TP/PP shard)."""
    from forge_megatron.mcore.model import build_gpt
    from forge_megatron.mcore.tree_attention import build_tree_gpt

    torch.manual_seed(3)
    tree = build_tree_gpt(cfg, **kw)
    causal = build_gpt(cfg, **kw)
    causal.load_state_dict(tree.state_dict())
    return tree, causal


def _grad_rel_diff(a, b):
    """max over parameters of max|g_a - g_b| / max|g_b| (grads of params that got one)."""
    worst = 0.0
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        ga, gb = _grad(pa), _grad(pb)
        assert (ga is None) == (gb is None), name
        if ga is not None:
            worst = max(worst, ((ga - gb).abs().max() / gb.abs().max().clamp_min(1e-30)).item())
    return worst


def _grad(p):
    return getattr(p, "main_grad", None) if getattr(p, "grad", None) is None else p.grad


def _exactness(tree, causal, samples):
    """(max |logp diff|, max |entropy diff|, grad rel diff) for one forest."""
    from forge_megatron.mcore.forward import sample_logprobs_unmerged, tree_logprobs
    from forge_megatron.tree import build_tree

    layout = build_tree(samples)
    tree.zero_grad()
    causal.zero_grad()
    logp_t, ent_t = tree_logprobs(tree, layout, with_entropy=True)
    logp_u, ent_u = sample_logprobs_unmerged(causal, samples, with_entropy=True)
    w_S = _weights(samples)
    _weighted_loss(logp_t, layout, w_S).backward()
    _weighted_loss(logp_u, [len(s) - 1 for s in samples], w_S).backward()
    return ((logp_t - logp_u).abs().max().item(), (ent_t - ent_u).abs().max().item(), _grad_rel_diff(tree, causal),
            layout.unique_tokens, layout.total_tokens)


# ----------------------------------------------------------------------------------------------- bodies
def _body_one_rank(rank, world_size):
    from forge_megatron.mcore.forward import tree_logprobs
    from forge_megatron.tree import build_tree

    tree, causal = _twin_models(_cfg())
    out = {name: _exactness(tree, causal, samples) for name, samples in forest_cases(0).items()}
    out["forest_of_all"] = _exactness(tree, causal, all_samples(1))
    # The segment backend (automatic on CPU) against the dense reference backend, same model.
    layout = build_tree(all_samples(2))
    with torch.no_grad():
        seg, _ = tree_logprobs(tree, layout)
        ref, _ = tree_logprobs(tree, layout, backend="reference")
    out["segment_vs_reference"] = (seg - ref).abs().max().item()
    moe_tree, moe_causal = _mixed_moe_models()
    out["moe"] = _exactness(moe_tree, moe_causal, all_samples(3))
    out["moe_layers"] = [type(layer.mlp).__name__ for layer in moe_tree.decoder.layers]
    out["errors"] = _error_messages(tree, causal, layout)
    out["rope_by_offset"] = _offset_rope_error(tree, causal)
    # YaRN-scaled RoPE (mcore/rope.py): scaled frequencies indexed by depth, the attention factor as softmax scale
    yarn_tree, yarn_causal = _twin_models(_cfg(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 8}))
    out["yarn"] = _exactness(yarn_tree, yarn_causal, all_samples(1))
    out["yarn_scales"] = [m.decoder.layers[0].self_attention.core_attention.softmax_scale
                          for m in (yarn_tree, yarn_causal)]
    # the GLM-4.5 layout from its HF config: RoPE on half of each head, a dense layer then a sigmoid-routed MoE
    # layer with a shared expert (Megatron's block spec)
    from forge_megatron.bridge import gpt_config_from_hf
    from forge_megatron.models.tiny import tiny_config

    glm = {**tiny_config("glm4_moe", vocab_size=VOCAB).to_dict(), "architectures": ["Glm4MoeForCausalLM"]}
    glm_tree, glm_causal = _twin_models(gpt_config_from_hf(glm))
    out["glm4_moe"] = _exactness(glm_tree, glm_causal, all_samples(3))
    out["glm4_moe_layers"] = [type(layer.mlp).__name__ for layer in glm_tree.decoder.layers]
    out["glm4_moe_rotary_dim"] = glm_tree.rotary_pos_emb.inv_freq.numel() * 2
    # MiniMax-M2 layout: every layer sigmoid-routed MoE, q/k RMSNorms over all heads, RoPE on half of each head
    mm = {**tiny_config("minimax_m2", vocab_size=VOCAB).to_dict(), "architectures": ["MiniMaxM2ForCausalLM"]}
    mm_tree, mm_causal = _twin_models(gpt_config_from_hf(mm))
    out["minimax_m2"] = _exactness(mm_tree, mm_causal, all_samples(3))
    out["minimax_m2_norms"] = type(mm_tree.decoder.layers[0].self_attention.q_layernorm).__name__
    # OLMo 3 layout: norms after attention and MLP, q/k norms over all heads, a 4-token window on layer 0 (plain
    # RoPE there) and YaRN on the full-attention layer 1
    olmo = {**tiny_config("olmo3", vocab_size=VOCAB).to_dict(), "architectures": ["Olmo3ForCausalLM"]}
    olmo_tree, olmo_causal = _twin_models(gpt_config_from_hf(olmo))
    out["olmo3"] = _exactness(olmo_tree, olmo_causal, all_samples(3))
    out["olmo3_layers"] = [(type(layer).__name__, layer.self_attention.core_attention.softmax_scale)
                           for layer in olmo_tree.decoder.layers]
    # Gemma 3: sandwich norms (1 + w), GeGLU, the scaled embedding, query_pre_attn_scalar, a window on layer 0 with
    # its own RoPE base, tied embeddings; SmolLM3: layer 1 without RoPE (position only through the ancestor mask);
    # GLM-4 dense: sandwich norms, RoPE on interleaved pairs of half of each head (the depth-indexed table);
    # Ministral 3: queries scaled by their depth past position 4 (read off the depth-indexed table)
    # Hunyuan: q/k norms after RoPE (applied by the core attention, tree or causal), the NTK-alpha base; experts
    # beside a shared MLP
    # LongCat-Flash: layer pairs, the shortcut MoE's output carried from the first to the second beside the hidden
    # states, identity experts, the latent scales
    # Gemma 4: a window layer, then a global one with its own head size and key heads, values that are its keys and
    # proportional RoPE (its own table of the depths), normed values, layer scalars (1 here: Megatron's init), the
    # logits soft-capped; with 26B-A4B's routed experts beside the dense MLP; and E2B / E4B's per-layer inputs, the
    # last two layers reusing the first two's keys and values (on the tree's positions) with double-wide MLPs
    # Granite MoE SWA: a sink logit per head in both layers, layer 0 full attention without RoPE, layer 1 a window
    # Llama 4: layer 0 chunked (chunks of 4 depths) with weightless q/k norms and interleaved llama3 RoPE, layer 1 NoPE
    # with the attention temperature of each token's depth; top-1 experts fed scaled inputs beside a shared expert
    # A.X K1: DeepSeek-V3's layers, a norm after the MoE layer's MLP; MiniCPM5-MoE: a sigmoid gate per query channel
    # on the tree attention's output; Mellum 2: a 4-position window with its own RoPE base beside a full layer; Kolibri 1:
    # EXAONE's window beside a NoPE layer in GLM-4's sandwich, experts chosen by logit plus bias; LFM3: a window (plain
    # RoPE), a convolution along the ancestors, a full layer (proportional RoPE, base 1M), gates per head, sandwich;
    # MiniMax-M1: lightning attention's fixed decays along every path, residuals from the norms' outputs, scaled;
    # Gemma (1): one key head for all queries; StarCoder2: a 4-position window on every layer, biases, LayerNorms;
    # Laguna: each layer's query heads, softplus gates per head, the full layer's RoPE over half of each head; Flint:
    # sinks in every layer, windows that rotate beside a full layer without RoPE
    for arch, cls in (("gemma3", "Gemma3ForCausalLM"), ("smollm3", "SmolLM3ForCausalLM"), ("glm4", "Glm4ForCausalLM"),
                      ("ministral3", "Ministral3ForCausalLM"), ("gemma4", "Gemma4ForCausalLM"),
                      ("gemma4_moe", "Gemma4ForCausalLM"), ("gemma4_e", "Gemma4ForCausalLM"),
                      ("hunyuan_v1_dense", "HunYuanDenseV1ForCausalLM"), ("hunyuan_v1_moe", "HunYuanMoEV1ForCausalLM"),
                      ("olmoe", "OlmoeForCausalLM"), ("mimo_v2_flash", "MiMoV2FlashForCausalLM"),
                      ("longcat_flash", "LongcatFlashForCausalLM"), ("dots1", "Dots1ForCausalLM"),
                      ("solar_open", "SolarOpenForCausalLM"), ("mixtral", "MixtralForCausalLM"),
                      ("phi3", "Phi3ForCausalLM"), ("qwen2_moe", "Qwen2MoeForCausalLM"),
                      ("exaone4", "Exaone4ForCausalLM"), ("exaone_moe", "ExaoneMoeForCausalLM"),
                      ("youtu", "YoutuForCausalLM"), ("granite", "GraniteForCausalLM"),
                      ("granitemoeshared", "GraniteMoeSharedForCausalLM"),
                      ("granitemoehybrid_moe", "GraniteMoeHybridForCausalLM"),
                      ("granitemoehybrid_mamba", "GraniteMoeHybridForCausalLM"),
                      ("nemotron_h", "NemotronHForCausalLM"), ("nemotron_h_moe", "NemotronHForCausalLM"),
                      ("lfm2", "Lfm2ForCausalLM"), ("lfm2_moe", "Lfm2MoeForCausalLM"),
                      ("llama4", "Llama4ForCausalLM"), ("granitemoe_swa", "GraniteMoeSWAForCausalLM"),
                      ("bamba", "BambaForCausalLM"), ("apertus", "ApertusForCausalLM"),
                      ("flex_olmo", "FlexOlmoForCausalLM"), ("afmoe", "AfmoeForCausalLM"),
                      ("phi4_mini", "Phi3ForCausalLM"), ("axk1", "AXK1ForCausalLM"),
                      ("minicpm5_moe", "MiniCPM5MoeForCausalLM"), ("mellum", "MellumForCausalLM"),
                      ("kolibri1", "Kolibri1ForCausalLM"), ("lfm3", "Lfm3ForCausalLM"),
                      ("hy_v3", "HYV3ForCausalLM"), ("hyperclovax", "HyperCLOVAXForCausalLM"),
                      ("jais2", "Jais2ForCausalLM"), ("glm", "GlmForCausalLM"),
                      ("minimax01", "MiniMaxM1ForCausalLM"), ("gemma", "GemmaForCausalLM"),
                      ("starcoder2", "Starcoder2ForCausalLM"), ("laguna", "LagunaForCausalLM"),
                      ("flint", "FlintForCausalLM")):
        hf = {**tiny_config(arch, vocab_size=VOCAB).to_dict(), "architectures": [cls]}
        # (Mamba-2's A_log gradients sum terms that nearly cancel: on the smaller forest they come 6.6e-5 apart, on the
        # whole one within the bound below, so those families keep it)
        mamba = arch in ("granitemoehybrid_mamba", "nemotron_h", "nemotron_h_moe", "bamba")
        out[arch] = _exactness(*_twin_models(gpt_config_from_hf(hf)), all_samples(3) if mamba else family_samples(3))
    # Gemma 2: soft-capped attention scores (the tree kernel's softcap; the unmerged samples through the causal
    # core attention's) and final-logit soft-capping (the fused logprobs cap the chunks they make, Megatron's output
    # layer its logits); and each cap really changes them
    from forge_megatron.mcore.forward import tree_logprobs
    from forge_megatron.tree import build_tree

    capped = {**tiny_config("gemma2", vocab_size=VOCAB).to_dict(), "architectures": ["Gemma2ForCausalLM"]}
    capped_tree, capped_causal = _twin_models(gpt_config_from_hf(capped))
    out["gemma2"] = _exactness(capped_tree, capped_causal, all_samples(3))
    layout = build_tree(all_samples(3))
    with torch.no_grad():
        logp = tree_logprobs(capped_tree, layout)[0]
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
            plain_tree, _ = _twin_models(gpt_config_from_hf({**capped, cap: None}))
            out[f"gemma2_{cap}_effect"] = (logp - tree_logprobs(plain_tree, layout)[0]).abs().max().item()
    # Cohere: attention and MLP in parallel on one bias-free LayerNorm, interleaved RoPE, the logits scaled; Cohere2:
    # a window layer that rotates then a NoPE full one; Cohere2-MoE: a dense first layer that rotates, experts
    # averaged with a shared expert. Each of its switches shown to change the logprobs (same weights, one switch off)
    for arch, cls in (("cohere2", "Cohere2ForCausalLM"), ("cohere2_moe", "Cohere2MoeForCausalLM")):
        hf = {**tiny_config(arch, vocab_size=VOCAB).to_dict(), "architectures": [cls]}
        tree, causal = _twin_models(gpt_config_from_hf(hf))
        out[arch] = _exactness(tree, causal, all_samples(3))
        out[f"{arch}_layers"] = [type(layer).__name__ for layer in tree.decoder.layers]
        out[f"{arch}_norms"] = {type(m).__name__ for name, m in tree.named_modules() if name.endswith("norm")}
        if arch == "cohere2_moe":
            with torch.no_grad():
                logp = tree_logprobs(tree, layout)[0]
                for name, switch in (("parallel_block", dict(parallel_block=False)),
                                     ("rotary_interleaved", dict(rotary_interleaved=False)),
                                     ("nope_layers", dict(nope_layers=None)),
                                     ("window", dict(extra={"window_size": None, "window_attn_skip_freq": None})),
                                     ("logit_multiplier", dict(logit_multiplier=None)),
                                     ("moe_output_multiplier", dict(moe_output_multiplier=None))):
                    other, _ = _twin_models(gpt_config_from_hf(hf, **switch))
                    missing, _ = other.load_state_dict(tree.state_dict(), strict=False)  # (the same weights)
                    assert all("pre_mlp_layernorm" in m for m in missing), missing
                    out[f"cohere2_moe_{name}_effect"] = (logp - tree_logprobs(other, layout)[0]).abs().max().item()
    # Falcon-H1: attention and a Mamba-2 mixer side by side in every layer (the mixer's recurrence and convolution
    # along every root-to-leaf path), every muP multiplier apart from 1; each group of them shown to change the
    # logprobs (same weights, that group at 1)
    falcon = {**tiny_config("falcon_h1", vocab_size=VOCAB).to_dict(), "architectures": ["FalconH1ForCausalLM"]}
    tree, causal = _twin_models(gpt_config_from_hf(falcon))
    out["falcon_h1"] = _exactness(tree, causal, all_samples(3))
    out["falcon_h1_layers"] = [(type(layer).__name__, type(layer.self_attention.core_attention).__name__,
                                type(layer.mamba).__name__) for layer in tree.decoder.layers]
    with torch.no_grad():
        logp = tree_logprobs(tree, layout)[0]
        for name in ("hybrid_multipliers", "mamba_in_multiplier", "mamba_segment_multipliers", "mlp_multipliers",
                     "embedding_multiplier", "logit_multiplier"):
            other, _ = _twin_models(gpt_config_from_hf(falcon, **{name: None}))
            other.load_state_dict(tree.state_dict())
            out[f"falcon_h1_{name}_effect"] = (logp - tree_logprobs(other, layout)[0]).abs().max().item()
    # Qwen3.5 layout: a Gated DeltaNet layer (the recurrence and its convolution along every root-to-leaf path)
    # then gated full attention; the trees here nest several levels of segments
    q35 = {**tiny_config("qwen3_5", vocab_size=VOCAB).to_dict(), "architectures": ["Qwen3_5ForCausalLM"]}
    q35_tree, q35_causal = _twin_models(gpt_config_from_hf(q35))
    out["qwen3_5"] = _exactness(q35_tree, q35_causal, all_samples(3))
    out["qwen3_5_mixers"] = [type(layer.self_attention).__name__ for layer in q35_tree.decoder.layers]
    out["qwen3_5_grads"] = {name: ((pa.grad - pb.grad).abs().max() / pb.grad.abs().max()).item()
                            for (name, pa), pb in zip(q35_tree.named_parameters(), q35_causal.parameters())}
    q35m = {**tiny_config("qwen3_5_moe", vocab_size=VOCAB).to_dict(), "architectures": ["Qwen3_5MoeForCausalLM"]}
    q35m_tree, q35m_causal = _twin_models(gpt_config_from_hf(q35m))
    out["qwen3_5_moe"] = _exactness(q35m_tree, q35m_causal, all_samples(4))
    out["qwen3_5_moe_grads"] = {name: ((pa.grad - pb.grad).abs().max() / pb.grad.abs().max()).item()
                                for (name, pa), pb in zip(q35m_tree.named_parameters(), q35m_causal.parameters())
                                if pb.grad is not None}
    out["qwen3_5_moe_layers"] = [type(layer.mlp).__name__ for layer in q35m_tree.decoder.layers]
    # OLMo Hybrid layout: a pre-norm Gated DeltaNet layer (beta = 2 sigmoid(b)) then OLMo 3's post-norm attention
    # without RoPE (NoPE: position only through the ancestor mask)
    oh = {**tiny_config("olmo_hybrid", vocab_size=VOCAB).to_dict(), "architectures": ["OlmoHybridForCausalLM"]}
    oh_tree, oh_causal = _twin_models(gpt_config_from_hf(oh))
    out["olmo_hybrid"] = _exactness(oh_tree, oh_causal, all_samples(3))
    out["olmo_hybrid_layers"] = [(type(layer).__name__, type(layer.self_attention).__name__,
                                  getattr(layer.self_attention, "beta_scale", None)) for layer in oh_tree.decoder.layers]
    out["olmo_hybrid_grads"] = {name: ((pa.grad - pb.grad).abs().max() / pb.grad.abs().max()).item()
                                for (name, pa), pb in zip(oh_tree.named_parameters(), oh_causal.parameters())}
    # Kimi Linear layout: a Kimi Delta Attention layer (a decay per key channel along every path) with a dense MLP,
    # then multi-latent attention without RoPE and a MoE layer
    kl = {**tiny_config("kimi_linear", vocab_size=VOCAB).to_dict(), "architectures": ["KimiLinearForCausalLM"]}
    kl_tree, kl_causal = _twin_models(gpt_config_from_hf(kl))
    out["kimi_linear"] = _exactness(kl_tree, kl_causal, all_samples(5))
    out["kimi_linear_mixers"] = [type(layer.self_attention).__name__ for layer in kl_tree.decoder.layers]
    out["kimi_linear_grads"] = {name: ((pa.grad - pb.grad).abs().max() / pb.grad.abs().max()).item()
                                for (name, pa), pb in zip(kl_tree.named_parameters(), kl_causal.parameters())
                                if pb.grad is not None}
    # DeepSeek-V3 layout (multi-latent attention: per-layer rotary tables indexed by depth, value heads narrower
    # than query/key heads) with YaRN, and the same model rotating by packed offset as the negative control
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 1.0,
            "mscale_all_dim": 1.0, "rope_theta": 10000.0}
    ds = {**tiny_config("deepseek_v3", vocab_size=VOCAB, rope_parameters=yarn).to_dict(),
          "architectures": ["DeepseekV3ForCausalLM"]}
    ds_tree, ds_causal = _twin_models(gpt_config_from_hf(ds))
    out["deepseek_v3"] = _exactness(ds_tree, ds_causal, all_samples(3))
    out["deepseek_v3_modules"] = [type(ds_tree.decoder.layers[0].self_attention.core_attention).__name__,
                                  type(ds_causal.decoder.layers[0].self_attention.core_attention).__name__]
    out["deepseek_v3_by_offset"] = _offset_rope_error(ds_tree, ds_causal)
    # Mistral Small 4 layout: multi-latent attention with YaRN and queries scaled by their depth past position 4 (the
    # packed params' depths, on the query projection's output), a softmax router without a score bias
    m4 = {**tiny_config("mistral4", vocab_size=VOCAB).to_dict(), "architectures": ["Mistral4ForCausalLM"]}
    m4_tree, m4_causal = _twin_models(gpt_config_from_hf(m4))
    out["mistral4"] = _exactness(m4_tree, m4_causal, all_samples(3))
    out["mistral4_by_offset"] = _offset_rope_error(m4_tree, m4_causal)
    # DeepSeek-V3.2 / GLM-5 layouts: DeepSeek sparse attention picking 4 keys (these samples reach depth 40, so most
    # tokens attend sparsely): a tree token's indexer must choose among its ancestors only; GLM's layer 1 reuses
    # layer 0's selection
    for arch, cls in (("deepseek_v32", "DeepseekV32ForCausalLM"), ("glm_moe_dsa", "GlmMoeDsaForCausalLM")):
        hf = {**tiny_config(arch, vocab_size=VOCAB).to_dict(), "architectures": [cls]}
        dsa_tree, dsa_causal = _twin_models(gpt_config_from_hf(hf))
        out[arch] = _exactness(dsa_tree, dsa_causal, all_samples(3))
        out[arch + "_sparse_rows"] = sum(index.shape[0] for index, _ in next(
            v for v in dsa_causal.decoder.layers[0].self_attention.core_attention.selection_store.values()).values())
    # MiniMax-M3 layout: layers 1 and 2 block-sparse, each query keeping 2 blocks of 2 positions per key head (the
    # samples reach depth 40: most tokens drop blocks); a tree token's blocks are cut by its depth, its indexer
    # scoring its ancestors only
    m3 = {**tiny_config("minimax_m3", vocab_size=VOCAB).to_dict(),
          "architectures": ["MiniMaxM3SparseForConditionalGeneration"]}
    m3_tree, m3_causal = _twin_models(gpt_config_from_hf(m3))
    out["minimax_m3"] = _exactness(m3_tree, m3_causal, all_samples(3))
    out["minimax_m3_modules"] = [type(layer.self_attention.core_attention).__name__ for layer in m3_tree.decoder.layers]
    from forge_megatron.mcore import block_sparse

    block_sparse.CHUNK_ELEMENTS, whole = 1, block_sparse.CHUNK_ELEMENTS  # one query per chunk: a chunk's keys then
    try:  # include other branches' deeper tokens
        out["minimax_m3_chunked"] = _exactness(m3_tree, m3_causal, all_samples(3))
    finally:
        block_sparse.CHUNK_ELEMENTS = whole
    # gpt-oss attention: learned sinks (Megatron's softmax_type="learnable") and a 3-position sliding window on every
    # other layer; the oracle is Megatron's own attention with the same config (SoftmaxOne, sliding-window mask)
    oss_cfg = _cfg(extra={"softmax_type": "learnable", "window_size": (2, 0), "window_attn_skip_freq": 2})
    oss_tree, oss_causal = _twin_models(oss_cfg)
    with torch.no_grad():  # sinks as large as trained ones (initialised ~0.02, they would hardly matter)
        for layer in oss_tree.decoder.layers:
            layer.self_attention.core_attention.softmax_offset.normal_(0.0, 2.0)
    oss_causal.load_state_dict(oss_tree.state_dict())
    out["gpt_oss"] = _exactness(oss_tree, oss_causal, all_samples(3))
    out["gpt_oss_windows"] = [layer.self_attention.core_attention.window for layer in oss_tree.decoder.layers]
    out["gpt_oss_sink_grads"] = [layer.self_attention.core_attention.softmax_offset.grad.abs().sum().item()
                                 for layer in oss_tree.decoder.layers]
    # the whole gpt-oss layout from its HF config: YaRN, biased experts with the clamped GLU, a biased router
    hf = {**tiny_config("gpt_oss", vocab_size=VOCAB, swiglu_limit=0.05).to_dict(),
          "architectures": ["GptOssForCausalLM"]}
    hf_tree, hf_causal = _twin_models(gpt_config_from_hf(hf))
    out["gpt_oss_hf"] = _exactness(hf_tree, hf_causal, all_samples(3))
    return out


def _mixed_moe_models():
    """Tree/causal twins from Megatron's block spec with a dense layer then a MoE layer (4 experts, top-2)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from forge_megatron.mcore.model import build_gpt, transformer_config
    from forge_megatron.mcore.tree_attention import swap_core_attention, use_depth_rope

    cfg = _cfg(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, extra={"moe_layer_freq": [0, 1]})
    block = get_gpt_decoder_block_spec(transformer_config(cfg), use_transformer_engine=False)
    torch.manual_seed(4)
    tree = build_gpt(cfg, spec=swap_core_attention(block))
    use_depth_rope(tree)
    causal = build_gpt(cfg, spec=block)  # swap_core_attention left the original spec untouched
    causal.load_state_dict(tree.state_dict())
    return tree, causal


def _offset_rope_error(tree, causal):
    """Negative control: rotating tree tokens by packed offset instead of depth must be visibly wrong."""
    import dataclasses

    from forge_megatron.mcore.forward import sample_logprobs_unmerged, tree_logprobs
    from forge_megatron.tree import build_tree

    samples = forest_cases(0)["wide_fan"]
    layout = build_tree(samples)
    by_offset = dataclasses.replace(layout, position_ids=torch.arange(layout.unique_tokens))
    with torch.no_grad():
        wrong, _ = tree_logprobs(tree, by_offset)
        right, _ = sample_logprobs_unmerged(causal, samples)
    return (wrong - right).abs().max().item()


def _error_messages(tree, causal, layout):
    from forge_megatron.mcore.forward import tree_model_inputs, vocab_parallel_logprobs

    messages = []
    inputs = tree_model_inputs(layout)
    for call in (
        lambda: tree(inputs["input_ids"], inputs["position_ids"], None),  # no packed params
        lambda: tree(**dict(inputs, attention_mask=torch.zeros(1, 1, layout.unique_tokens, layout.unique_tokens,
                                                                dtype=torch.bool))),
        lambda: vocab_parallel_logprobs(torch.zeros(3, VOCAB), torch.tensor([0, 1]), torch.tensor([5, VOCAB])),
    ):
        try:
            call()
            messages.append("no error")
        except (TypeError, ValueError) as exc:
            messages.append(str(exc))
    return messages


def _body_tp(rank, world_size):
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from forge_megatron.mcore.forward import tree_model_inputs, vocab_parallel_logprobs
    from forge_megatron.tree import build_tree

    tree, causal = _twin_models(_cfg())
    out = {"exact": _exactness(tree, causal, all_samples(4))}
    # Vocab-parallel logp/entropy against log_softmax over the gathered full vocabulary (test-side only).
    layout = build_tree(all_samples(5))
    with torch.no_grad():
        logits_TV = tree(**tree_model_inputs(layout))[0]
        pred_M, targets_M, _ = layout.next_token_index()
        logp_M, ent_M = vocab_parallel_logprobs(logits_TV, pred_M, targets_M, with_entropy=True)
        full_TV = gather_from_tensor_model_parallel_region(logits_TV).log_softmax(-1)
        ref_logp_M = full_TV[pred_M, targets_M]
        ref_ent_M = -(full_TV.exp() * full_TV).sum(-1)[pred_M]
    out["vocab_parallel"] = ((logp_M - ref_logp_M).abs().max().item(), (ent_M - ref_ent_M).abs().max().item(),
                             logits_TV.shape[-1])
    return out


def _body_pp(rank, world_size):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from forge_megatron.mcore.forward import TreeMicroBatch, make_tree_forward_step
    from forge_megatron.tree import build_tree

    # Megatron's config check rejects variable_seq_lengths with its default (allgather) dispatcher even when dense.
    tree, causal = _twin_models(_cfg(), variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    samples = all_samples(6)
    w_S = _weights(samples)
    half = len(samples) // 2
    groups = [(samples[:half], w_S[:half]), (samples[half:], w_S[half:])]
    run = get_forward_backward_func()

    def tree_loss(logp_M, entropy_M, mb):
        # x num_microbatches: Megatron divides each micro-batch loss by it; undo it to get the plain sum.
        loss = _weighted_loss(logp_M, mb.layout, mb.extras["w_S"]) * len(groups)
        return loss, {"logp": logp_M.detach()}

    batches = [TreeMicroBatch(build_tree(s), {"w_S": w}) for s, w in groups]
    tree_out = run(forward_step_func=make_tree_forward_step(tree_loss), data_iterator=iter(batches), model=[tree],
                   num_microbatches=len(batches), seq_length=1, micro_batch_size=1, forward_only=False)
    causal_out = run(forward_step_func=_causal_forward_step, data_iterator=iter(list(zip(samples, w_S.tolist()))),
                     model=[causal], num_microbatches=len(samples), seq_length=1, micro_batch_size=1,
                     forward_only=False)
    out = {"last": ps.is_pipeline_last_stage(), "grad": _grad_rel_diff(tree, causal),
           "has_grad": any(_grad(p) is not None and _grad(p).abs().sum() > 0 for p in tree.parameters()),
           "fixed_length_error": _fixed_length_error(tree, batches[0])}
    if out["last"]:
        logp_tree = torch.cat([o["logp"] for o in tree_out])
        logp_causal = torch.cat([o["logp"] for o in causal_out])
        out["logp"] = (logp_tree - logp_causal).abs().max().item()
    return out


def _fixed_length_error(model, micro_batch):
    """The tree forward step refuses a PP model whose config fixes the sequence length."""
    from forge_megatron.mcore.forward import make_tree_forward_step

    model.config.variable_seq_lengths = False
    try:
        make_tree_forward_step(lambda *a: None)(iter([micro_batch]), model)
        return "no error"
    except ValueError as exc:
        return str(exc)
    finally:
        model.config.variable_seq_lengths = True


def _causal_forward_step(data_iterator, model):
    """Unmerged oracle under PP: one sample per micro-batch, causal mask, same weighted loss."""
    from forge_megatron.mcore.forward import vocab_parallel_logprobs
    from forge_megatron.mcore.model import causal_mask

    tokens, w = next(data_iterator)
    L = len(tokens)
    tokens_1L = torch.tensor(tokens)[None]
    output = model(tokens_1L, torch.arange(L)[None], causal_mask(L))

    def loss_func(logits_1LV):
        logp, _ = vocab_parallel_logprobs(logits_1LV[0], torch.arange(L - 1), tokens_1L[0, 1:])
        n_microbatches = len(all_samples(6))
        return logp.sum() * w * n_microbatches, {"logp": logp.detach()}

    return output, loss_func


# ----------------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def one_rank():
    (out,) = run_distributed(_body_one_rank, world_size=1)
    return out


@pytest.mark.parametrize("case", [*forest_cases(0), "forest_of_all"])
def test_tree_equals_unmerged_dense(one_rank, case):
    logp, ent, grad, unique, total = one_rank[case]
    assert logp <= LOGP_ATOL and ent <= LOGP_ATOL and grad <= GRAD_RTOL, one_rank[case]
    assert unique <= total


def test_merging_really_shares_tokens(one_rank):
    _, _, _, unique, total = one_rank["identical"]
    assert unique * 3 == total  # three identical samples: one copy in the tree


def test_segment_backend_matches_reference(one_rank):
    assert one_rank["segment_vs_reference"] <= LOGP_ATOL


def test_moe_tree_equals_unmerged(one_rank):
    assert one_rank["moe_layers"] == ["MLP", "MoELayer"]
    logp, ent, grad, _, _ = one_rank["moe"]
    assert logp <= LOGP_ATOL and ent <= LOGP_ATOL and grad <= GRAD_RTOL, one_rank["moe"]


def test_yarn_scaled_rope_tree_equals_unmerged(one_rank):
    import math

    from forge_megatron.mcore import rope

    logp, ent, grad, _, _ = one_rank["yarn"]
    assert logp <= LOGP_ATOL and ent <= LOGP_ATOL and grad <= GRAD_RTOL, one_rank["yarn"]
    m = rope.attention_factor({"rope_type": "yarn", "factor": 4.0})
    assert m > 1 and one_rank["yarn_scales"] == [pytest.approx(m * m / math.sqrt(8))] * 2  # head dim 8


def test_minimax_m2_tree_equals_unmerged(one_rank):
    assert one_rank["minimax_m2_norms"] == "QueryNormAllHeads"
    logp, ent, grad, _, _ = one_rank["minimax_m2"]
    assert logp <= LOGP_ATOL and ent <= LOGP_ATOL and grad <= GRAD_RTOL, one_rank["minimax_m2"]


def test_olmo3_tree_equals_unmerged(one_rank):
    """Post-norm layers, a sliding window and per-layer-type RoPE (plain on the window layer, YaRN's frequencies
    and softmax scale on the full one) on the tree as on each sample alone."""
    from forge_megatron.mcore import rope

    (kind0, scale0), (kind1, scale1) = one_rank["olmo3_layers"]
    assert kind0 == kind1 == "PostNormTransformerLayer"
    m = rope.attention_factor({"rope_type": "yarn", "factor": 4.0})
    assert scale0 == pytest.approx(16 ** -0.5) and scale1 == pytest.approx(m * m / 4)  # head dim 16
    logp, ent, grad, _, _ = one_rank["olmo3"]
    assert logp <= LOGP_ATOL and ent <= LOGP_ATOL and grad <= GRAD_RTOL, one_rank["olmo3"]


@pytest.mark.parametrize("arch", ["gemma3", "smollm3", "glm4", "ministral3", "gemma4", "gemma4_moe", "gemma4_e",
                                  "hunyuan_v1_dense", "hunyuan_v1_moe", "olmoe", "mimo_v2_flash", "longcat_flash", "dots1",
                                  "solar_open", "mixtral", "phi3", "qwen2_moe", "exaone4", "exaone_moe",
                                  "youtu", "granite", "granitemoeshared", "granitemoehybrid_moe",
                                  "granitemoehybrid_mamba", "nemotron_h", "nemotron_h_moe", "lfm2",
                                  "lfm2_moe", "llama4", "granitemoe_swa", "bamba", "apertus", "flex_olmo",
                                  "afmoe", "phi4_mini", "axk1", "minicpm5_moe", "mellum", "kolibri1", "lfm3",
                                  "hy_v3", "hyperclovax", "jais2", "glm", "minimax01",
                                  "gemma", "starcoder2", "laguna", "flint"])
def test_gemma3_smollm3_glm4_ministral3_and_gemma4_trees_equal_unmerged(one_rank, arch):
    logp, ent, grad, _, _ = one_rank[arch]
    # (Gemma 4 E: the shared keys' q/k norm weights sum their gradients over every token and head of two layers,
    # in another order on the tree than per sample: 1.6e-5 relative, the other parameters below 1e-5; LongCat-Flash:
    # the first router's weights sum a softmax gradient over six experts whose terms largely cancel, 1.9e-5, the
    # others below 3e-6)
    rtol = 3 * GRAD_RTOL if arch in ("gemma4_e", "longcat_flash") else GRAD_RTOL
    if arch in ("granitemoehybrid_mamba", "nemotron_h", "nemotron_h_moe", "bamba"):
        # Mamba-2's A_log: its gradient sums over every token terms that nearly cancel, in another order on the tree
        # than per sample (as Gated DeltaNet's decay parameters: test_qwen3_5_gated_delta_net_tree_equals_unmerged);
        # 2.8e-5 of its largest here, every other parameter within 1e-6
        rtol = 5 * GRAD_RTOL
    assert logp <= LOGP_ATOL and ent <= LOGP_ATOL and grad <= rtol, one_rank[arch]


def test_gemma2_soft_capping_tree_equals_unmerged(one_rank):
    """Gemma 2's soft caps: attention scores capped in the tree kernel equal the causal core attention's per sample,
    the fused logprobs on the tree (logits capped chunk by chunk) Megatron's capped logits scored per sample; and
    neither cap is a no-op at this scale."""
    logp, ent, grad, _, _ = one_rank["gemma2"]
    assert logp <= LOGP_ATOL and ent <= LOGP_ATOL and grad <= GRAD_RTOL, one_rank["gemma2"]
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        assert one_rank[f"gemma2_{cap}_effect"] > 1e-4, (cap, one_rank[f"gemma2_{cap}_effect"])


def test_falcon_h1_parallel_hybrid_layers_tree_equals_unmerged(one_rank):
    """Falcon-H1's layers (attention and a Mamba-2 mixer side by side) on the tree equal the samples one at a time
    (the attention through TreeAttention, the mixer along every root-to-leaf path), and each group of its muP
    multipliers changes the logprobs at this scale."""
    logp, ent, grad, _, _ = one_rank["falcon_h1"]
    # (Mamba-2's A_log gradient sums terms that nearly cancel, in another order on the tree: as Granite 4.0-H's)
    assert logp <= LOGP_ATOL and ent <= LOGP_ATOL and grad <= 5 * GRAD_RTOL, one_rank["falcon_h1"]
    assert set(one_rank["falcon_h1_layers"]) == {("ParallelHybridLayer", "TreeAttention", "TreeMamba2Mixer")}
    for name in ("hybrid_multipliers", "mamba_in_multiplier", "mamba_segment_multipliers", "mlp_multipliers",
                 "embedding_multiplier", "logit_multiplier"):
        assert one_rank[f"falcon_h1_{name}_effect"] > 1e-4, (name, one_rank[f"falcon_h1_{name}_effect"])


@pytest.mark.parametrize("arch", ["cohere2", "cohere2_moe"])
def test_cohere_parallel_layers_tree_equals_unmerged(one_rank, arch):
    """Cohere's parallel attention + MLP layers (one bias-free LayerNorm) on the tree equal the samples one at a
    time, windows, NoPE layers and averaged experts included; and each of those switches (and the parallel layout
    itself) changes the logprobs at this scale, so none of them is a no-op the test could miss."""
    logp, ent, grad, _, _ = one_rank[arch]
    assert logp <= LOGP_ATOL and ent <= LOGP_ATOL and grad <= GRAD_RTOL, one_rank[arch]
    assert set(one_rank[f"{arch}_layers"]) == {"ParallelTransformerLayer"}
    # (the input norms and the final one; no norm before the MLP: Megatron's identity there)
    assert one_rank[f"{arch}_norms"] == {"BiasFreeLayerNorm", "IdentityOp"}, one_rank[f"{arch}_norms"]
    if arch == "cohere2_moe":
        for name in ("parallel_block", "rotary_interleaved", "nope_layers", "window", "logit_multiplier",
                     "moe_output_multiplier"):
            assert one_rank[f"cohere2_moe_{name}_effect"] > 1e-4, (name, one_rank[f"cohere2_moe_{name}_effect"])


def test_qwen3_5_gated_delta_net_tree_equals_unmerged(one_rank):
    assert one_rank["qwen3_5_mixers"] == ["TreeGatedDeltaNet", "SelfAttention"]
    logp, ent, _, _, _ = one_rank["qwen3_5"]
    assert logp <= LOGP_ATOL and ent <= LOGP_ATOL, one_rank["qwen3_5"]
    # The decay parameters' gradients are sums over every token of terms that largely cancel (their totals are
    # ~1e-2 against ~15 for the projections): the tree's chunks (per segment) and the samples' (per sequence) sum
    # them in different orders, so they agree to fp32 rounding of the terms, not of the sum (in fp64 the kernel's
    # tree and per-sample decay gradients agree to 1e-10: tests/kernels/test_gated_delta.py)
    for case in ("qwen3_5", "qwen3_5_moe"):
        grads = one_rank[case + "_grads"]
        assert len(grads) > 10
        for name, diff in grads.items():
            assert diff <= (5e-4 if name.endswith(("A_log", "dt_bias")) else GRAD_RTOL), (case, name, diff)
    assert one_rank["qwen3_5_moe_layers"] == ["MoELayer", "MoELayer"]
    assert any("shared_experts.gate_weight" in name for name in one_rank["qwen3_5_moe_grads"])
    logp, ent, _, _, _ = one_rank["qwen3_5_moe"]
    assert logp <= LOGP_ATOL and ent <= LOGP_ATOL, one_rank["qwen3_5_moe"]


def test_olmo_hybrid_tree_equals_unmerged(one_rank):
    """Pre-norm Gated DeltaNet layers beside post-norm NoPE attention ones: the merged tree trains as its samples."""
    assert one_rank["olmo_hybrid_layers"] == [("TransformerLayer", "TreeGatedDeltaNet", 2.0),
                                              ("PostNormTransformerLayer", "SelfAttention", None)]
    logp, ent, _, _, _ = one_rank["olmo_hybrid"]
    assert logp <= LOGP_ATOL and ent <= LOGP_ATOL, one_rank["olmo_hybrid"]
    grads = one_rank["olmo_hybrid_grads"]
    assert len(grads) > 10
    for name, diff in grads.items():  # the decay parameters' sums: test_qwen3_5_gated_delta_net_tree_equals_unmerged
        assert diff <= (5e-4 if name.endswith(("A_log", "dt_bias")) else GRAD_RTOL), (name, diff)


def test_kimi_linear_tree_equals_unmerged(one_rank):
    """Kimi Delta Attention (a decay per key channel) along every root-to-leaf path, beside RoPE-less multi-latent
    attention and a MoE layer: the merged tree trains as its samples."""
    assert one_rank["kimi_linear_mixers"] == ["TreeKimiDeltaAttention", "MLASelfAttention"]
    logp, ent, _, _, _ = one_rank["kimi_linear"]
    assert logp <= LOGP_ATOL and ent <= LOGP_ATOL, one_rank["kimi_linear"]
    grads = one_rank["kimi_linear_grads"]
    assert any(name.endswith("f_b_weight") for name in grads) and len(grads) > 15
    for name, diff in grads.items():  # the decay parameters' sums: test_qwen3_5_gated_delta_net_tree_equals_unmerged
        assert diff <= (5e-4 if name.endswith(("A_log", "dt_bias")) else GRAD_RTOL), (name, diff)


def test_glm4_moe_tree_equals_unmerged(one_rank):
    assert one_rank["glm4_moe_layers"] == ["MLP", "MoELayer"] and one_rank["glm4_moe_rotary_dim"] == 8  # of 16
    logp, ent, grad, _, _ = one_rank["glm4_moe"]
    assert logp <= LOGP_ATOL and ent <= LOGP_ATOL and grad <= GRAD_RTOL, one_rank["glm4_moe"]


def test_multi_latent_attention_tree_equals_unmerged(one_rank):
    """DeepSeek-V3's MLA (query/key heads 24 wide, value heads 12) with YaRN: tree == each sample alone, and
    rotating by packed offset instead of depth is visibly wrong (the per-layer rotary hooks do the work)."""
    assert one_rank["deepseek_v3_modules"] == ["TreeAttention", "CausalCoreAttention"]
    logp, ent, grad, _, _ = one_rank["deepseek_v3"]
    assert logp <= LOGP_ATOL and ent <= LOGP_ATOL and grad <= GRAD_RTOL, one_rank["deepseek_v3"]
    assert one_rank["deepseek_v3_by_offset"] > 20 * LOGP_ATOL


def test_mistral4_query_scaled_latent_attention_tree_equals_unmerged(one_rank):
    logp, ent, grad, _, _ = one_rank["mistral4"]
    assert logp <= LOGP_ATOL and ent <= LOGP_ATOL and grad <= GRAD_RTOL, one_rank["mistral4"]
    assert one_rank["mistral4_by_offset"] > 20 * LOGP_ATOL


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_deepseek_sparse_attention_tree_equals_unmerged(one_rank, arch):
    logp, ent, grad, _, _ = one_rank[arch]
    assert logp <= LOGP_ATOL and ent <= LOGP_ATOL and grad <= GRAD_RTOL, one_rank[arch]
    assert one_rank[arch + "_sparse_rows"] > 0  # the indexer really chose (rows deeper than topk)


def test_minimax_m3_block_sparse_attention_tree_equals_unmerged(one_rank):
    assert one_rank["minimax_m3_modules"] == ["TreeAttention", "BlockSparseAttention", "BlockSparseAttention"]
    for case in ("minimax_m3", "minimax_m3_chunked"):
        logp, ent, grad, _, _ = one_rank[case]
        assert logp <= LOGP_ATOL and ent <= LOGP_ATOL and grad <= GRAD_RTOL, (case, one_rank[case])


def test_gpt_oss_sinks_and_sliding_window_tree_equals_unmerged(one_rank):
    """Megatron's learnable softmax offsets (gpt-oss sinks) and sliding windows through TreeAttention equal each
    sample alone through Megatron's own attention: logprobs, entropies and every gradient (the sinks' included)."""
    assert one_rank["gpt_oss_windows"] == [3, 0]  # layer 1 windowed, layer 2 (2 % 2 == 0) full
    logp, ent, grad, _, _ = one_rank["gpt_oss"]
    assert logp <= LOGP_ATOL and ent <= LOGP_ATOL and grad <= GRAD_RTOL, one_rank["gpt_oss"]
    assert min(one_rank["gpt_oss_sink_grads"]) > 0
    logp, ent, grad, _, _ = one_rank["gpt_oss_hf"]  # the whole layout from a HF config
    assert logp <= LOGP_ATOL and ent <= LOGP_ATOL and grad <= GRAD_RTOL, one_rank["gpt_oss_hf"]


def test_rope_must_follow_depth_not_offset(one_rank):
    assert one_rank["rope_by_offset"] > 20 * LOGP_ATOL  # the exactness tolerance tells a wrong position apart


def test_tree_attention_errors_name_the_problem(one_rank):
    no_params, with_mask, bad_target = one_rank["errors"]
    assert "TreeAttention needs packed_seq_params=TreePackedSeqParams" in no_params
    assert "pass attention_mask=None" in with_mask
    assert f"target token ids must lie in [0, {VOCAB}) (the model's vocabulary), got [5, {VOCAB}]" in bad_target


def test_tp2_tree_equals_unmerged_and_vocab_parallel_is_exact():
    out = run_distributed(_body_tp, world_size=2, parallel=ParallelConfig(tp=2))
    for o in out:
        logp, ent, grad, _, _ = o["exact"]
        assert logp <= LOGP_ATOL and ent <= LOGP_ATOL and grad <= GRAD_RTOL, o
        vp_logp, vp_ent, local_vocab = o["vocab_parallel"]
        assert local_vocab == VOCAB // 2  # each rank really holds half the vocabulary
        assert vp_logp <= LOGP_ATOL and vp_ent <= LOGP_ATOL, o


def test_pp2_schedule_tree_equals_unmerged():
    out = run_distributed(_body_pp, world_size=2, parallel=ParallelConfig(pp=2))
    assert sorted(o["last"] for o in out) == [False, True]
    for o in out:
        assert o["has_grad"] and o["grad"] <= GRAD_RTOL, o
        assert "build the model with variable_seq_lengths=True under PP" in o["fixed_length_error"]
    (last,) = [o for o in out if o["last"]]
    assert last["logp"] <= LOGP_ATOL, last
