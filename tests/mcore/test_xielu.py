"""Apertus's xIELU (mcore/xielu.py): under tensor parallelism, with and without sequence parallelism, every TP rank's
gradient of each layer's two trained scalars is the whole model's (transformers'), not its share of the fc1
channels; and the scalars are per layer. Also the embedding multiplier's rounding per family (muP-style scales).
CPU, 0 GPUs (gloo)."""

import pytest
import torch

from forge_megatron.convert import checkpoint as ckpt
from forge_megatron.convert.checkpoint import ParallelLayout
from forge_megatron.mcore.parallel import ParallelConfig
from tests.dist_utils import run_distributed

TOKENS = torch.tensor([[5, 17, 42, 99, 7, 31, 64, 12, 3, 8, 77, 21], [9, 4, 33, 60, 2, 15, 28, 90, 11, 6, 45, 70]])


def _sum_logprob(logits_bsV):
    logp = torch.log_softmax(logits_bsV.float(), dim=-1)[:, :-1]
    return logp.gather(-1, TOKENS[:, 1:, None]).sum()


def _grads_body(rank, world_size, mcore_dir, sequence_parallel):
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from forge_megatron.mcore.model import build_gpt, causal_mask

    bridge, _ = ckpt.read_meta(mcore_dir)
    model = build_gpt(bridge.cfg, sequence_parallel=sequence_parallel)
    ckpt.load_into(model, mcore_dir)
    s = TOKENS.shape[1]
    logits = model(TOKENS, torch.arange(s)[None].expand_as(TOKENS), causal_mask(s))
    _sum_logprob(gather_from_tensor_model_parallel_region(logits)).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if ".activation_func." in name}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2sp"])
def test_xielu_scalars_get_the_whole_models_gradient_on_every_tp_rank(tmp_path, sequence_parallel):
    from forge_megatron.models import load_causal_lm
    from forge_megatron.models.tiny import build_tiny_model

    hf_dir = build_tiny_model(str(tmp_path / "apertus"), arch="apertus", seed=4, with_tokenizer=False)
    hf = load_causal_lm(hf_dir, dtype=torch.float32)
    _sum_logprob(hf(input_ids=TOKENS).logits).backward()
    want = {f"decoder.layers.{i}.mlp.activation_func.{name}": getattr(layer.mlp.act_fn, name).grad
            for i, layer in enumerate(hf.model.layers) for name in ("alpha_p", "alpha_n")}
    assert len(want) == 4 and all(g.abs().max() > 0 for g in want.values())
    assert (hf.model.layers[0].mlp.act_fn.alpha_p != hf.model.layers[1].mlp.act_fn.alpha_p).all()  # per layer
    ckpt.hf_to_megatron(hf_dir, str(tmp_path / "tp2"), ParallelLayout(tp=2))
    results = run_distributed(_grads_body, world_size=2, parallel=ParallelConfig(tp=2),
                              mcore_dir=str(tmp_path / "tp2"), sequence_parallel=sequence_parallel)
    for got in results:
        assert set(got) == set(want)
        for name, g in got.items():
            err = ((g - want[name]).abs().max() / want[name].abs().max()).item()
            assert err <= 1e-4, (name, err)


def _embedding_scale_body(rank, world_size):
    from forge_megatron.mcore.model import GPTConfig, build_gpt

    out = {}
    x = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for rounded in (True, False):
        cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=2, num_query_groups=1, ffn_hidden_size=64,
                        vocab_size=16, embedding_multiplier=5.656854, embedding_multiplier_rounded=rounded)
        hooks = list(build_gpt(cfg).embedding._forward_hooks.values())
        out[rounded] = hooks[-1](None, (), x)
    return out


def test_embedding_multiplier_rounds_as_each_family_does():
    """Gemma rounds its embedding multiplier to the hidden states' dtype before multiplying; Granite, Falcon-H1 and
    AFMoE multiply by the Python float (in bf16 the two differ for a multiplier bf16 cannot hold)."""
    from forge_megatron.bridge import Bridge
    from forge_megatron.models.tiny import tiny_config

    (out,) = run_distributed(_embedding_scale_body, world_size=1)
    x = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(out[True], x * torch.tensor(5.656854, dtype=torch.bfloat16))
    assert torch.equal(out[False], x * 5.656854) and not torch.equal(out[True], out[False])
    for arch, cls, rounded in (("gemma3", "Gemma3ForCausalLM", True), ("granite", "GraniteForCausalLM", False),
                               ("falcon_h1", "FalconH1ForCausalLM", False), ("afmoe", "AfmoeForCausalLM", False)):
        cfg = Bridge({**tiny_config(arch).to_dict(), "architectures": [cls]}).cfg
        assert cfg.embedding_multiplier is not None and cfg.embedding_multiplier_rounded is rounded, arch
