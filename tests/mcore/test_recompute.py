"""Activation recomputation (Megatron's recompute_granularity) with tree packing: same gradients, and the layers
really run again in the backward (fp32, CPU, 1 rank), for standard and multi-latent attention (whose per-layer
depth RoPE must find its micro-batch's positions again when a layer reruns). The trainer's --recompute-* flags feed
these config fields."""

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.mcore.test_tree_exact import _cfg, _weighted_loss, _weights, all_samples


def _mla_cfg(extra):
    from forge_megatron.bridge import gpt_config_from_hf
    from forge_megatron.models.tiny import tiny_config

    hf = {**tiny_config("deepseek_v3", vocab_size=96).to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}
    return gpt_config_from_hf(hf, extra=extra)


def _qwen3_5_cfg(extra):
    from forge_megatron.bridge import gpt_config_from_hf
    from forge_megatron.models.tiny import tiny_config

    hf = {**tiny_config("qwen3_5", vocab_size=96).to_dict(), "architectures": ["Qwen3_5ForCausalLM"]}
    return gpt_config_from_hf(hf, extra=extra)


def _body(rank, world_size, mla, arch="gpt"):
    from forge_megatron.mcore.forward import tree_logprobs
    from forge_megatron.mcore.tree_attention import build_tree_gpt
    from forge_megatron.tree import build_tree

    samples = all_samples(3)
    layout = build_tree(samples)
    out = {}
    state = None
    for name, extra in (("plain", {}),
                        ("full", {"recompute_granularity": "full", "recompute_method": "uniform",
                                  "recompute_num_layers": 1}),
                        ("selective", {"recompute_granularity": "selective"}),
                        ("up_proj", {"recompute_granularity": "selective",
                                     "recompute_modules": ["core_attn", "mla_up_proj"]})):
        if name == "up_proj" and not mla:
            continue
        torch.manual_seed(3)
        cfg = _mla_cfg(extra) if mla else _qwen3_5_cfg(extra) if arch == "qwen3_5" else _cfg(extra=extra)
        model = build_tree_gpt(cfg)
        if state is None:
            state = model.state_dict()
        model.load_state_dict(state)
        calls = []
        model.decoder.layers[0].register_forward_hook(lambda *_: calls.append(1))
        attn_calls = []
        mixer = model.decoder.layers[0].self_attention  # a Gated DeltaNet layer in Qwen3.5 (no core_attention)
        getattr(mixer, "core_attention", mixer).register_forward_hook(lambda *_: attn_calls.append(1))
        logp, _ = tree_logprobs(model, layout)
        _weighted_loss(logp, layout, _weights(samples)).backward()
        out[name] = (len(calls), len(attn_calls), {k: p.grad.clone() for k, p in model.named_parameters()})
    return out


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
def test_recompute_keeps_gradients_and_reruns_layers(mla):
    (out,) = run_distributed(_body, world_size=1, mla=mla)
    plain_layer, plain_attn, plain_grads = out["plain"]
    assert (plain_layer, plain_attn) == (1, 1)
    assert out["full"][0] == 2  # the whole layer ran again in the backward
    assert out["selective"][:2] == (1, 2)  # only core attention ran again
    for name in ("full", "selective") + (("up_proj",) if mla else ()):
        grads = out[name][2]
        assert max((grads[k] - g).abs().max().item() for k, g in plain_grads.items()) <= 1e-6, name


def test_recompute_with_gated_delta_net_layers():
    """Qwen3.5's hybrid layers under Megatron's recomputation: full reruns the Gated DeltaNet layer (whose recurrence
    then skips its own checkpoint), selective leaves it to that checkpoint (kernels/gated_delta.py); the gradients
    stay those of the plain run."""
    (out,) = run_distributed(_body, world_size=1, mla=False, arch="qwen3_5")
    assert out["plain"][:2] == (1, 1)
    assert out["full"][:2] == (2, 2)  # the linear-attention layer ran again in the backward
    for name in ("full", "selective"):
        grads = out[name][2]
        assert max((grads[k] - g).abs().max().item() for k, g in out["plain"][2].items()) <= 1e-6, name
