"""Int4 quantization-aware training (forge_megatron/mcore/int4_qat.py): the trainer computes with the int4 rounding
an engine serving the int4 release loads, and trains the full-precision weights through it.

References: weight_sync/int4.py's quantize + dequantize (themselves compared with the compressed-tensors library in
tests/weight_sync/test_int4.py) for the rounding; transformers on the library's dequantization of the exported
weights for the logits; the same Megatron model without hooks, its weights replaced by their rounding, for the
gradients (the straight-through estimator hands them over unchanged). A Kimi-K2-layout model (DeepSeek-V3: MLA,
shared experts, a dense first layer; Kimi's ignore list, so only the routed experts are rounded) under EP = 2 and
under TP = 2 (the experts' fc2 split by columns, a whole number of groups per rank). CPU, gloo.
"""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from forge_megatron.bridge import ParallelLayout
from forge_megatron.convert import checkpoint as ckpt
from forge_megatron.mcore.int4_qat import fake_quantize, install
from forge_megatron.mcore.parallel import ParallelConfig
from forge_megatron.weight_sync.int4 import Int4Config, dequantize, quantize
from tests.dist_utils import run_distributed

GROUP = 16
KIMI = Int4Config(group=GROUP, ignore=("lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                       r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"))
TOKENS = torch.tensor([[5, 17, 33, 2, 9, 41, 7, 12, 30, 3]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8, 64), (5, 37), (3, 16)])
def test_fake_quantize_is_quantize_then_dequantize(shape, dtype):
    torch.manual_seed(0)
    w = (torch.randn(shape) * torch.logspace(-2, 1, shape[1])).to(dtype)
    w[0] = 0.0
    packed, scale, size = quantize(w, GROUP)
    assert torch.equal(fake_quantize(w, GROUP), dequantize(packed, scale, size.tolist(), GROUP, dtype))


def _local_out(model):
    from forge_megatron.mcore.model import causal_mask

    s = TOKENS.shape[1]
    return model(TOKENS, torch.arange(s)[None], causal_mask(s))  # this rank's vocab-parallel logits


def _body(rank, world_size, mcore_dir, export_dir):
    from forge_megatron.weight_sync.gather import is_stage_lead, iter_stage_buckets
    from tests.convert.mcore_forward import forward_logits, load_converted

    bridge, qat = load_converted(mcore_dir)
    _, plain = load_converted(mcore_dir)
    gate_only = Int4Config(group=GROUP, ignore=KIMI.ignore + ("re:.*up_proj.*",))
    try:  # Megatron's fc1 joins gate and up: a release rounding one of them only cannot be followed
        install(bridge, [plain], gate_only)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    names = install(bridge, [qat], KIMI)
    before = {n: p.detach().clone() for n, p in qat.named_parameters()}
    with torch.no_grad():
        vocab = forward_logits(qat, TOKENS)  # all-gathered over TP: what transformers is compared with
    exported = {}
    for bucket in iter_stage_buckets(bridge, [qat], bucket_bytes=1 << 20):
        if is_stage_lead():
            exported.update((n, t.clone()) for n, t in bucket)
    if rank == 0:
        save_file(exported, os.path.join(export_dir, "model.safetensors"))
        with open(os.path.join(export_dir, "config.json"), "w") as f:
            json.dump(bridge.hf_config, f)
    # gradients: through the hooks vs the plain model holding the rounded weights
    quantized = []
    with torch.no_grad():
        for local, p in plain.named_parameters():
            if local.endswith(".weight") and qat.get_submodule(local[: -len(".weight")])._forward_pre_hooks:
                p.copy_(fake_quantize(p, GROUP))
                quantized.append(local)
    out = _local_out(qat)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(rank))
    (out.float() * weights).sum().backward()
    (_local_out(plain).float() * weights).sum().backward()
    grads = {}
    for (local, a), (_, b) in zip(qat.named_parameters(), plain.named_parameters()):
        if a.grad is None or b.grad is None:
            grads[local] = (a.grad is None, b.grad is None)
        else:
            grads[local] = ((a.grad - b.grad).abs().max() / b.grad.abs().max().clamp_min(1e-30)).item()
    unchanged = all(torch.equal(p.detach(), before[n]) for n, p in qat.named_parameters())
    restored = all(isinstance(m._parameters["weight"], torch.nn.Parameter) for m in qat.modules()
                   if m._parameters.get("weight") is not None)
    return {"names": names, "quantized": quantized, "logits": vocab, "grads": grads, "unchanged": unchanged,
            "restored": restored, "refused": refused}


@pytest.fixture(scope="module")
def kimi_layout(tmp_path_factory):
    from forge_megatron.models.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("qat") / "k2"), arch="deepseek_v3", seed=23)


@pytest.mark.parametrize("parallel", [ParallelConfig(ep=2), ParallelConfig(tp=2)], ids=["ep2", "tp2"])
def test_qat_model_computes_with_the_int4_release_and_trains_through_it(kimi_layout, tmp_path, parallel):
    from tests.weight_sync.test_int4 import _hf, _library_checkpoint, _library_dequantized

    mcore = str(tmp_path / "mcore")
    ckpt.hf_to_megatron(kimi_layout, mcore, ParallelLayout(tp=parallel.tp, ep=parallel.ep))
    os.makedirs(tmp_path / "export")
    results = run_distributed(_body, world_size=2, parallel=parallel, mcore_dir=mcore,
                              export_dir=str(tmp_path / "export"))
    for r in results:
        # the routed experts of layer 1 (layer 0 is dense): fc1 and fc2 of each local expert, nothing else
        assert r["names"] and all(".mlp.experts.local_experts." in n for n in r["names"])
        assert len(r["names"]) == 2 * (4 // parallel.ep) and len(r["quantized"]) == len(r["names"])
        assert r["unchanged"] and r["restored"]  # the parameters themselves are never rounded
        assert r["refused"] and "joins HF tensors" in r["refused"] and "gate_proj" in r["refused"]
        for name, diff in r["grads"].items():
            assert isinstance(diff, float) and diff <= 1e-5, (name, diff)  # straight through, at the rounding
    # the exported weights are the full-precision ones; the library's int4 rounding of them is what QAT computes with
    reference = _library_dequantized(
        _library_checkpoint(str(tmp_path / "export"), str(tmp_path / "int4")), str(tmp_path / "ref"))
    with torch.no_grad():
        want = _hf(reference)(TOKENS).logits
        plain = _hf(str(tmp_path / "export"))(TOKENS).logits
    got = results[0]["logits"]
    assert (got - want).abs().max() <= 1e-4
    assert (got - plain).abs().max() > 1e-3  # the rounding is visible
