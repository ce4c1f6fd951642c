"""Gemma 4 pieces that the family-wide tests (tests/convert, tests/mcore/test_tree_exact.py, tests/training) do not
single out: the proportional RoPE frequencies against transformers' own, and what the E2B / E4B layout refuses
(pipeline stages, recomputation) or the bridge refuses by name. CPU, gloo."""

import pytest
import torch

from forge_megatron.bridge import UnsupportedModelError, gpt_config_from_hf
from forge_megatron.mcore.gemma4 import proportional_inv_freq
from forge_megatron.mcore.parallel import ParallelConfig
from forge_megatron.models.tiny import tiny_config
from tests.dist_utils import run_distributed


def _hf(arch="gemma4_e", **overrides):
    return {**tiny_config(arch, **overrides).to_dict(), "architectures": ["Gemma4ForCausalLM"]}


@pytest.mark.parametrize("fraction,factor", [(0.25, 1.0), (0.5, 2.0), (1.0, 1.0)])
def test_proportional_rope_is_transformers(fraction, factor):
    from transformers import Gemma4TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Gemma4TextConfig(head_dim=16, global_head_dim=32, layer_types=["sliding_attention", "full_attention"],
                              num_hidden_layers=2, rope_parameters={
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                  "full_attention": {"rope_type": "proportional", "partial_rotary_factor": fraction,
                                                     "rope_theta": 1e6, "factor": factor}})
    want, _ = ROPE_INIT_FUNCTIONS["proportional"](config, None, layer_type="full_attention")
    got = proportional_inv_freq(32, 1e6, fraction, factor)
    assert got.shape == want.shape and torch.equal(got, want.float())
    assert int((got == 0).sum()) == 16 - int(fraction * 16)  # the unrotated pairs


def _build_body(rank, world_size, hf, overrides):
    from forge_megatron.mcore.tree_attention import build_tree_gpt

    try:
        build_tree_gpt(gpt_config_from_hf(hf), **overrides)
    except ValueError as exc:
        return str(exc)
    return None


def test_per_layer_inputs_and_shared_keys_refuse_pipeline_stages_and_recomputation():
    """The per-layer inputs are made with the embedding and the shared keys by earlier layers: not across pipeline
    stages, and a recomputed consumer would read keys made without gradients."""
    errors = run_distributed(_build_body, world_size=2, parallel=ParallelConfig(pp=2), hf=_hf(), overrides={})
    assert all("train without pipeline parallelism" in e for e in errors), errors
    no_ple = _hf(hidden_size_per_layer_input=0)
    errors = run_distributed(_build_body, world_size=2, parallel=ParallelConfig(pp=2), hf=no_ple, overrides={})
    assert all("KV sharing across layers" in e for e in errors), errors
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    (error,) = run_distributed(_build_body, world_size=1, hf=_hf(), overrides=recompute)
    assert "without --recompute-granularity" in error
    (error,) = run_distributed(_build_body, world_size=1, hf=_hf(num_kv_shared_layers=0), overrides=recompute)
    assert error is None  # per-layer inputs alone recompute fine


def test_the_bridge_reads_the_e_layout_and_refuses_what_it_cannot_compute():
    cfg = gpt_config_from_hf(_hf())
    assert cfg.kv_shared_from == (None, None, 0, 1) and cfg.layer_ffn_sizes == (128, 128, 256, 256)
    assert cfg.per_layer_input_size == 8 and cfg.per_layer_input_vocab == cfg.vocab_size
    assert gpt_config_from_hf(_hf(use_double_wide_mlp=False)).layer_ffn_sizes is None
    for overrides, message in (({"use_bidirectional_attention": "all"}, "bidirectional attention"),
                               ({"attention_bias": True}, "attention biases"),
                               ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                                 "moe_intermediate_size": 32}, "per-layer inputs beside the MoE block")):
        with pytest.raises(UnsupportedModelError, match=message):
            gpt_config_from_hf(_hf(**overrides))
