"""Group-wise int4 weights for engines serving a compressed-tensors int4 checkpoint (forge_megatron/weight_sync/int4.py;
Kimi-K2-Thinking / Kimi-K2.5 as released).

References: the compressed-tensors library (its ``calculate_qparams``, ``quantize`` and ``pack_to_int32``) for the
quantizer and the packing; ``forge-convert int4-to-bf16`` + transformers for what an engine serving the checkpoint
computes; a forge-engine serving the int4 checkpoint for the update protocol; the trainer's gathered weights,
quantized by the library, for the sync.
"""

import json
import os

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import save_file

from forge_megatron.convert.cli import main as convert_main
from forge_megatron.weight_sync import buckets as bk
from forge_megatron.weight_sync.int4 import Int4Config, dequantize, dequantize_named, quantize, quantize_named
from tests.weight_sync.test_fp8 import _tensors
from tests.weight_sync.test_weight_sync import PROMPT, sync_ep2_trainer_to

GROUP = 16  # the tiny models' weights are 32-64 wide: several groups per row
# Kimi-K2-Thinking's quantization_config: the routed experts only
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]


def _quantization(group=GROUP):
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "ignore": KIMI_IGNORE, "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}}}}


def _library_int4(w: torch.Tensor, group: int):
    """(packed, scale) of ``w`` as the compressed-tensors library computes them."""
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    x = w.view(w.shape[0], -1, group)
    scale, zero = calculate_qparams(x.amin(-1), x.amax(-1), args)
    q = ct_quantize(w, scale, zero, args)
    return pack_to_int32(q.to(torch.int8), 4), scale


def _library_checkpoint(src: str, out: str, group=GROUP) -> str:
    """The int4 checkpoint of the HF checkpoint ``src`` as the library packs it (Kimi's ignore list), tokenizer
    files copied."""
    import shutil

    cfg = Int4Config(group=group, ignore=tuple(KIMI_IGNORE))
    packed = {}
    for name, t in _tensors(src).items():
        if cfg.quantizes(name, t):
            base = name[: -len(".weight")]
            packed[base + ".weight_packed"], packed[base + ".weight_scale"] = _library_int4(t, group)
            packed[base + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int32)
        else:
            packed[name] = t
    os.makedirs(out)
    save_file(packed, os.path.join(out, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": _quantization(group)}, f)
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(src, name), out)
    return out


def _library_dequantized(packed_dir: str, out: str) -> str:
    """The checkpoint ``packed_dir`` with every int4 triple replaced by the library's dequantization, in fp32 (the
    tiny models' dtype), its config without the quantization_config: what an engine serving it computes with."""
    import shutil

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP)
    tensors, plain = _tensors(packed_dir), {}
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            shape = torch.Size(tensors[base + ".weight_shape"].tolist())
            q = unpack_from_int32(t, 4, shape)
            plain[base + ".weight"] = ct_dequantize(q, tensors[base + ".weight_scale"], args=args,
                                                    dtype=torch.float32)
        elif not name.endswith((".weight_scale", ".weight_shape")):
            plain[name] = t
    os.makedirs(out)
    save_file(plain, os.path.join(out, "model.safetensors"))
    with open(os.path.join(packed_dir, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    for name in os.listdir(packed_dir):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(packed_dir, name), out)
    return out


def _logprobs(model, ids):
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([PROMPT + ids])).logits[0].double(), -1)
    return [logp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(ids)]


def _hf(d):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


# --- the quantizer ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,group", [((48, 96), 32), ((7, 64), 16), ((3, 40), 8)])
def test_quantize_is_the_compressed_tensors_librarys(shape, group, dtype):
    torch.manual_seed(0)
    w = (torch.randn(shape) * torch.logspace(-3, 1, shape[1])).to(dtype)  # columns of very different magnitudes
    w[:2, :group] = 0.0  # an all-zero group: the library's eps scale
    packed, scale, size = quantize(w, group)
    want_packed, want_scale = _library_int4(w, group)
    assert scale.dtype == dtype and torch.equal(scale, want_scale)
    assert packed.dtype == torch.int32 and torch.equal(packed, want_packed)
    assert size.tolist() == list(shape)
    back = dequantize(packed, scale, size.tolist(), group, torch.float32)
    step = scale.float().repeat_interleave(group, 1)
    # within half a step (a group's largest positive value, 7.5 steps, clamps to 7), plus the scale's and the
    # division's rounding in bf16 (2^-8 of at most 8 steps)
    assert ((back - w.float()).abs() <= 0.55 * step + 1e-6).all()


def test_partial_groups_and_odd_widths_round_trip():
    torch.manual_seed(1)
    w = torch.randn(5, 37)  # neither a multiple of the group nor of the eight values per word
    packed, scale, size = quantize(w, 16)
    assert packed.shape == (5, 5) and scale.shape == (5, 3)
    back = dequantize(packed, scale, size.tolist(), 16, torch.float32)
    assert (back - w).abs().max() <= scale.max() / 2 + 1e-6
    assert (back[:, 32:].abs().amax(dim=1) > 0).all()  # the last, partial group has its own scale


def test_which_weights_are_quantized_and_triples_stay_in_one_bucket():
    cfg = Int4Config.from_hf(_quantization(4))
    named = [("model.embed_tokens.weight", torch.randn(10, 8)),
             ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 8)),
             ("model.layers.0.mlp.gate_proj.weight", torch.randn(8, 8)),  # a dense MLP: ignored by Kimi's list
             ("model.layers.1.mlp.gate.weight", torch.randn(4, 8)),
             ("model.layers.1.mlp.shared_experts.up_proj.weight", torch.randn(6, 8)),
             ("model.layers.1.mlp.experts.3.down_proj.weight", torch.randn(8, 6)),
             ("model.layers.1.mlp.experts.0.gate_proj.weight", torch.randn(6, 8)),
             ("model.layers.1.input_layernorm.weight", torch.randn(8)), ("lm_head.weight", torch.randn(10, 8))]
    out = list(quantize_named(named, cfg))
    triples = [item[0][0] for item in out if isinstance(item, list)]
    assert triples == ["model.layers.1.mlp.experts.3.down_proj.weight_packed",
                       "model.layers.1.mlp.experts.0.gate_proj.weight_packed"]
    buckets = list(bk.make_buckets(out, bucket_bytes=40))  # smaller than any item: one item per bucket
    for b in buckets:
        names = [n for n, _ in b]
        for n in names:
            if n.endswith(".weight_packed"):
                base = n[: -len(".weight_packed")]
                assert {base + ".weight_scale", base + ".weight_shape"} <= set(names)  # never split
    assert {"int32", "float32"} <= {d for b in buckets for d in bk.describe(b)["dtypes"]}
    back, n = dequantize_named(dict(t for b in buckets for t in b), cfg.group)
    assert n == 2 and set(back) == {name for name, _ in named}
    with pytest.raises(ValueError, match="came without 'x.weight_scale'"):
        dequantize_named({"x.weight_packed": torch.zeros(2, 1, dtype=torch.int32),
                          "x.weight_shape": torch.tensor([2, 8], dtype=torch.int32)}, 4)
    with pytest.raises(ValueError, match="serves no int4 checkpoint"):
        dequantize_named(dict(out[-3]), None)
    with pytest.raises(ValueError, match="not a compressed-tensors pack-quantized"):
        Int4Config.from_hf({"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match="only 4-bit symmetric"):
        Int4Config.from_hf({**_quantization(), "config_groups": {"g": {"weights": {"num_bits": 8}}}})
    assert Int4Config.from_hf(cfg.hf_dict()) == cfg


# --- an engine serving the checkpoint ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from forge_megatron.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("int4")
    v0 = build_tiny_model(str(root / "v0"), arch="deepseek_v3", seed=21)
    return {"v0": v0, "v0_int4": _library_checkpoint(v0, str(root / "v0_int4"))}


def test_int4_engine_serves_the_checkpoint_and_takes_only_packed_updates(moe, tmp_path):
    """forge-engine on the int4 checkpoint scores like transformers on the library's dequantization of it (and
    forge-convert int4-to-bf16's copy, to its bf16 rounding); a packed update (the library's packing of another
    weight) lands as the library dequantizes it; a plain weight for a quantized module is refused, naming the flag;
    a triple missing a part is refused."""
    from forge_megatron.rollout.engine_server import ReferenceEngine, RequestError

    assert convert_main(["int4-to-bf16", "--hf-dir", moe["v0_int4"], "--out", str(tmp_path / "bf16")]) == 0
    engine = ReferenceEngine(moe["v0_int4"])
    try:
        assert engine.int4 is not None and engine.int4.group == GROUP
        ids = [5, 17, 33, 2, 9, 41]
        mine = _logprobs(engine.model, ids)
        reference = _hf(_library_dequantized(moe["v0_int4"], str(tmp_path / "fp32")))
        assert mine == pytest.approx(_logprobs(reference, ids), abs=1e-6)
        assert mine == pytest.approx(_logprobs(_hf(str(tmp_path / "bf16")), ids), abs=1e-3)
        assert mine != pytest.approx(_logprobs(_hf(moe["v0"]), ids), abs=1e-3)  # the int4 rounding is visible
        name = "model.layers.1.mlp.experts.2.up_proj.weight"
        w = _tensors(moe["v0"])[name] * 1.5
        packed, scale = _library_int4(w, GROUP)
        base = name[: -len(".weight")]
        update = {base + ".weight_packed": packed, base + ".weight_scale": scale,
                  base + ".weight_shape": torch.tensor(list(w.shape), dtype=torch.int32)}
        engine.load_state(update)
        fused = engine.model.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
        half = fused.shape[1] // 2
        assert torch.equal(fused[2, half:], dequantize(packed, scale, list(w.shape), GROUP, torch.float32))
        with pytest.raises(RequestError, match=r"must come packed.*--weight-sync-int4"):
            engine.load_state({name: w})
        with pytest.raises(RequestError, match="came without"):
            engine.load_state({base + ".weight_packed": packed})
    finally:
        engine.worker.shutdown()


def test_trainer_sync_sends_what_the_int4_checkpoint_of_its_weights_holds(moe, tmp_path):
    """EP=2 trainer -> forge-engine serving the int4 checkpoint, over the broadcast (int32 words over gloo) and the
    disk transport: the engine then scores its greedy tokens exactly like transformers on the library's int4 packing
    of the trainer's weights (dequantized by the library), visibly away from the trainer's own logprobs; the quantized
    experts travel as 4 bits per weight plus a scale per group."""
    cfg = Int4Config.from_hf(_quantization())
    results = sync_ep2_trainer_to(moe["v0"], moe["v0_int4"], tmp_path, int4=cfg)
    full = _tensors(moe["v0"])
    full_bytes = sum(t.numel() * t.element_size() for t in full.values())
    quantized = [t for n, t in full.items() if cfg.quantizes(n, t)]
    assert quantized and all(t.dtype == torch.float32 for t in quantized)
    for version, transport in ((1, "distributed"), (2, "disk")):
        report, ids, ((engine_lps, engine_version), trainer_lps) = results[0][transport]
        assert report.policy_version == version and engine_version == str(version) and report.excluded == []
        packed = _library_checkpoint(str(tmp_path / "export" / transport), str(tmp_path / f"int4_{transport}"))
        hf_lps = _logprobs(_hf(_library_dequantized(packed, str(tmp_path / f"ref_{transport}"))), ids)
        assert max(abs(a - b) for a, b in zip(engine_lps, hf_lps)) <= 1e-5, transport
        assert max(abs(a - b) for a, b in zip(engine_lps, trainer_lps)) > 5e-3  # the int4 rounding is visible
        # each quantized fp32 weight: 4 bits instead of 32, plus an fp32 scale per GROUP and an int32 [2] shape
        saved = sum(t.numel() * 4 - t.numel() // 2 - t.numel() // GROUP * 4 - 8 for t in quantized)
        assert report.bytes == full_bytes - saved
