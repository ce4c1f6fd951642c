"""LatentMoE (Nemotron 3 Super / Ultra; mcore/latent_moe.py) without Transformer Engine: under TP = 2 with sequence
parallelism each rank projects its own tokens into and out of the latent space, so the projections' gradients are
summed over TP (Megatron's finalize_model_grads sums the parameters marked ``sequence_parallel``), and then equal
transformers' on every rank. The trainer-layout test (tests/training/test_trainer_nemotron_h.py) would not notice a
missing sum: these gradients are ~1e-3 of the whole norm and Adam's first steps move a weight alike for a whole or
a partial gradient. CPU, 0 GPUs (gloo)."""

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


def _grads_body(rank, world_size, mcore_dir):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from forge_megatron.mcore.latent_moe import LatentMoELayer
    from forge_megatron.mcore.model import build_gpt, causal_mask

    bridge, _ = ckpt.read_meta(mcore_dir)
    model = build_gpt(bridge.cfg, sequence_parallel=True)
    ckpt.load_into(model, mcore_dir)
    assert sum(isinstance(m, LatentMoELayer) for m in model.modules()) == 2
    s = TOKENS.shape[1]
    logits = model(TOKENS, torch.arange(s)[None].expand_as(TOKENS), causal_mask(s))
    _sum_logprob(gather_from_tensor_model_parallel_region(logits)).backward()
    out = {}
    for name, p in model.named_parameters():
        if "latent_proj" in name:
            out[name, "partial"] = p.grad.clone()
            if getattr(p, "sequence_parallel", False):  # (what finalize_model_grads does under sequence parallelism)
                torch.distributed.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
            out[name, "summed"] = p.grad.clone()
    return out


def test_latent_projections_get_the_whole_models_gradient_on_every_tp_rank(tmp_path):
    from forge_megatron.models import load_causal_lm
    from forge_megatron.models.tiny import build_tiny_model

    hf_dir = build_tiny_model(str(tmp_path / "hf"), arch="nemotron_h_latent", seed=3, with_tokenizer=False)
    hf = load_causal_lm(hf_dir, dtype=torch.float32)
    _sum_logprob(hf(input_ids=TOKENS).logits).backward()
    want = {f"decoder.layers.{i}.mlp.{p}_latent_proj.weight": getattr(hf.model.layers[i].mixer,
                                                                      f"{p}_latent_proj").weight.grad
            for i in (1, 3) for p in ("fc1", "fc2")}
    ckpt.hf_to_megatron(hf_dir, str(tmp_path / "tp2"), ParallelLayout(tp=2))
    results = run_distributed(_grads_body, world_size=2, parallel=ParallelConfig(tp=2),
                              mcore_dir=str(tmp_path / "tp2"))
    for got in results:
        assert {name for name, _ in got} == set(want)
        for name, g in want.items():
            assert ((got[name, "summed"] - g).abs().max() / g.abs().max()).item() <= 1e-4, name
            # each rank's own share is not it (so the sum is what makes them equal)
            assert ((got[name, "partial"] - g).abs().max() / g.abs().max()).item() > 1e-2, name


def test_duplicated_linear_stands_in_for_te_only_while_building():
    from megatron.core.transformer.moe import moe_layer

    from forge_megatron.mcore.latent_moe import DuplicatedLinear, _duplicated_in_place_of_te

    before = moe_layer.HAVE_TE, getattr(moe_layer, "TELinear", None)
    with _duplicated_in_place_of_te():
        assert moe_layer.HAVE_TE and moe_layer.TELinear is DuplicatedLinear
    assert (moe_layer.HAVE_TE, getattr(moe_layer, "TELinear", None)) == before
    with pytest.raises(ValueError, match="duplicated"):
        DuplicatedLinear(4, 4, parallel_mode="column", config=None, init_method=None, bias=False,
                         skip_bias_add=False)
