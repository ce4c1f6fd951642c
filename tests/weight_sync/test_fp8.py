"""Block-wise FP8 weights for engines serving an FP8 checkpoint (forge_megatron/weight_sync/fp8.py).

References: a block-by-block loop for the quantizer; transformers' own FP8 checkpoint loader (which dequantizes on
CPU) for the checkpoint format; a forge-engine serving the FP8 checkpoint for the update protocol; the trainer's
gathered weights, quantized offline by ``forge-convert hf-to-fp8`` and loaded by transformers, for the sync.
"""

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from forge_megatron.bridge import ParallelLayout
from forge_megatron.convert import checkpoint as ckpt
from forge_megatron.convert.cli import main as convert_main
from forge_megatron.weight_sync import buckets as bk
from forge_megatron.weight_sync.fp8 import (
    FP8_DTYPE, FP8_MAX, Fp8Config, dequantize, dequantize_named, quantize, quantize_named,
)
from tests.dist_utils import run_distributed
from tests.convert.mcore_forward import load_converted
from tests.weight_sync.test_weight_sync import PROMPT, _post, sync_ep2_trainer_to

BLOCK = (16, 16)  # the tiny models' weights are 32-128 wide: several blocks per weight


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from forge_megatron.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("fp8")
    v0 = build_tiny_model(str(root / "v0"), arch="qwen3_moe", seed=5)
    v1 = build_tiny_model(str(root / "v1"), arch="qwen3_moe", seed=6)
    return {"v0": v0, "v1": v1, "v0_fp8": _to_fp8(v0, str(root / "v0_fp8")), "v1_fp8": _to_fp8(v1, str(root / "v1_fp8")),
            "root": root}


def _to_fp8(src, out, block=BLOCK, skip=""):
    assert convert_main(["hf-to-fp8", "--hf-dir", src, "--out", out, "--block", *map(str, block),
                         "--skip", skip]) == 0
    return out


def _tensors(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def _hf(d):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def _logprobs(model, ids):
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([PROMPT + ids])).logits[0].double(), -1)
    return [logp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(ids)]


# --- the quantizer ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,block", [((70, 45), (16, 32)), ((128, 64), (128, 128)), ((5, 300), (4, 128))])
def test_quantize_matches_a_block_by_block_reference(shape, block):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[1])  # columns of very different magnitudes
    w[: block[0], : block[1]] = 0.0  # an all-zero block
    q, s = quantize(w.to(torch.bfloat16), block)
    gm, gn = math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and s.dtype == torch.float32 and s.shape == (gm, gn)
    wb = w.to(torch.bfloat16).float()
    for i in range(gm):
        for j in range(gn):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            blk = wb[rows, cols]
            amax = blk.abs().max().item()
            want_s = amax / FP8_MAX if amax > 0 else 1.0
            assert s[i, j].item() == pytest.approx(want_s, rel=1e-6)
            want_q = (blk / s[i, j]).to(FP8_DTYPE)
            assert torch.equal(q[rows, cols].view(torch.uint8), want_q.view(torch.uint8))
            if amax > 0:  # the block's largest entry lands on e4m3's largest value: the full range is used
                assert q[rows, cols].float().abs().max().item() == FP8_MAX
    back = dequantize(q, s, block)
    # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of the value (normal range), or 2^-10 x scale (subnormals)
    bound = torch.maximum(wb.abs() * 2.0 ** -4, s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
                          [: shape[0], : shape[1]] * 2.0 ** -10)
    assert ((back - wb).abs() <= bound * (1 + 1e-6)).all()
    assert (back[: block[0], : block[1]] == 0).all()


def test_which_weights_are_quantized_and_pairs_stay_in_one_bucket():
    cfg = Fp8Config(block=(4, 4), skip=("layers.1.",))
    named = [("model.embed_tokens.weight", torch.randn(10, 8)), ("model.layers.0.self_attn.q_proj.weight",
             torch.randn(8, 8)), ("model.layers.0.self_attn.q_proj.bias", torch.randn(8)),
             ("model.layers.0.mlp.gate.weight", torch.randn(4, 8)),
             ("model.layers.0.mlp.experts.3.down_proj.weight", torch.randn(8, 6)),
             ("model.layers.0.input_layernorm.weight", torch.randn(8)), ("lm_head.weight", torch.randn(10, 8)),
             ("model.layers.1.self_attn.o_proj.weight", torch.randn(8, 8)),
             ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", torch.randn(6, 8)),
             # DeepSeek-V3.2's indexer: wq_b and wk in FP8, weights_proj and the key norm not
             ("model.layers.0.self_attn.indexer.wq_b.weight", torch.randn(8, 8)),
             ("model.layers.0.self_attn.indexer.wk.weight", torch.randn(4, 8)),
             ("model.layers.0.self_attn.indexer.weights_proj.weight", torch.randn(4, 8)),
             ("model.layers.0.self_attn.indexer.k_norm.weight", torch.randn(4))]
    out = list(quantize_named(named, cfg))
    pairs = [item[0][0] for item in out if isinstance(item, list)]
    assert pairs == ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.3.down_proj.weight",
                     "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                     "model.layers.0.self_attn.indexer.wq_b.weight", "model.layers.0.self_attn.indexer.wk.weight"]
    for item in out:
        if isinstance(item, list):
            (wn, q), (sn, s) = item
            assert sn == wn[: -len("weight")] + "weight_scale_inv" and q.dtype == FP8_DTYPE
    buckets = list(bk.make_buckets(out, bucket_bytes=70))  # smaller than most items: one item per bucket
    for b in buckets:
        names = [n for n, _ in b]
        for n in names:
            if n.endswith("weight_scale_inv"):
                assert n.replace("weight_scale_inv", "weight") in names  # never split from its weight
    assert sum(len(b) for b in buckets) == len(named) + len(pairs)
    back, n = dequantize_named(dict(t for b in buckets for t in b))
    assert n == len(pairs) and set(back) == {name for name, _ in named}
    with pytest.raises(ValueError, match="came without"):
        dequantize_named({"a.weight_scale_inv": torch.ones(1, 1)})
    with pytest.raises(ValueError, match="came without 'x.weight_scale_inv'"):
        dequantize_named({"x.weight": torch.zeros(4, 4, dtype=FP8_DTYPE)})
    with pytest.raises(ValueError, match="weight_block_size"):
        dequantize_named({"x.weight": torch.zeros(8, 8, dtype=FP8_DTYPE), "x.weight_scale_inv": torch.ones(1, 1)},
                         block=(4, 4))
    with pytest.raises(ValueError, match="block-wise fp8 only"):
        Fp8Config.from_hf({"quant_method": "awq"})
    with pytest.raises(ValueError, match="per-tensor fp8"):
        Fp8Config.from_hf({"quant_method": "fp8"})
    assert Fp8Config.from_hf(cfg.hf_dict()) == cfg


# --- the checkpoint format --------------------------------------------------------------------------------------
def test_fp8_checkpoint_loads_in_transformers_as_our_dequantization(moe, tmp_path):
    """forge-convert hf-to-fp8: transformers' FP8 loader (dequantizing on CPU) gives exactly our dequantization,
    experts included (transformers fuses them); routers, norms, embeddings and the head are left as they were."""
    fp8 = _tensors(moe["v0_fp8"])
    orig = _tensors(moe["v0"])
    with open(os.path.join(moe["v0_fp8"], "config.json")) as f:
        assert json.load(f)["quantization_config"] == Fp8Config(block=BLOCK).hf_dict()
    quantized = {n for n, t in fp8.items() if t.dtype == FP8_DTYPE}
    assert quantized == {n for n in orig if n.endswith("proj.weight")} and len(quantized) > 8
    assert all(torch.equal(fp8[n], orig[n]) for n in orig if n not in quantized)
    assert os.path.isfile(os.path.join(moe["v0_fp8"], "tokenizer.json"))
    ours, _ = dequantize_named(fp8)
    model = _hf(moe["v0_fp8"])
    state = model.state_dict()
    for name, t in ours.items():
        if name in state:
            assert torch.equal(state[name], t), name
    layer0 = model.model.layers[0].mlp.experts  # fused [E, 2I, H] gate rows first, [E, H, I]
    for e in range(model.config.num_experts):
        assert torch.equal(layer0.down_proj[e], ours[f"model.layers.0.mlp.experts.{e}.down_proj.weight"])
        half = layer0.gate_up_proj.shape[1] // 2
        assert torch.equal(layer0.gate_up_proj[e, half:], ours[f"model.layers.0.mlp.experts.{e}.up_proj.weight"])
    # the FP8 model really differs from the original, by about e4m3's rounding
    worst = max((ours[n] - orig[n]).abs().max().item() / orig[n].abs().max().item() for n in quantized)
    assert 1e-3 < worst <= 2.0 ** -4
    skipped = _to_fp8(moe["v0"], str(tmp_path / "skip"), skip="self_attn")
    assert not any(".self_attn." in n and t.dtype == FP8_DTYPE for n, t in _tensors(skipped).items())
    assert convert_main(["hf-to-fp8", "--hf-dir", moe["v0_fp8"], "--out", str(tmp_path / "again")]) == 2


def _logits_body(rank, world_size, mcore_dir, tokens):
    from tests.convert.mcore_forward import forward_logits

    _, model = load_converted(mcore_dir)
    return forward_logits(model, tokens)


def test_training_starts_from_a_published_fp8_checkpoint(tmp_path):
    """DeepSeek-V3, Kimi-K2 and MiniMax-M2 are published as block-wise FP8 only: the bridge's reader dequantizes
    them (scales are part of their weights, not unused tensors), the converted Megatron model computes what
    transformers computes from the FP8 files, and what is written back is unquantized (no fp8
    quantization_config over bf16/fp32 tensors). MiniMax-M2's Mixtral-named experts (w1/w2/w3) are FP8 too."""
    from forge_megatron.models.tiny import build_tiny_model

    src = build_tiny_model(str(tmp_path / "mm"), arch="minimax_m2", seed=3, with_tokenizer=False)
    fp8_dir = _to_fp8(src, str(tmp_path / "mm_fp8"))
    fp8 = _tensors(fp8_dir)
    quantized = {n for n, t in fp8.items() if t.dtype == FP8_DTYPE}
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in quantized
    assert "model.layers.1.block_sparse_moe.gate.weight" not in quantized  # routers stay unquantized
    ckpt.hf_to_megatron(fp8_dir, str(tmp_path / "mcore"), ParallelLayout(ep=2))
    bridge, _ = ckpt.read_meta(str(tmp_path / "mcore"))
    assert "quantization_config" not in bridge.hf_config
    ckpt.megatron_to_hf(str(tmp_path / "mcore"), str(tmp_path / "back"))
    back, ours = _tensors(str(tmp_path / "back")), dequantize_named(fp8)[0]
    assert set(back) == set(ours) and all(torch.equal(back[n], ours[n]) for n in ours)
    with open(tmp_path / "back" / "config.json") as f:
        assert "quantization_config" not in json.load(f)
    ckpt.hf_to_megatron(fp8_dir, str(tmp_path / "one"))
    tokens = torch.randint(0, 400, (2, 12), generator=torch.Generator().manual_seed(0))
    (logits,) = run_distributed(_logits_body, world_size=1, mcore_dir=str(tmp_path / "one"), tokens=tokens)
    with torch.no_grad():
        want = _hf(fp8_dir)(input_ids=tokens).logits
        unquantized = _hf(src)(input_ids=tokens).logits
    assert (logits - want).abs().max().item() <= 1e-4
    assert (unquantized - want).abs().max().item() > 1e-3  # the FP8 weights are really what was read
    broken = str(tmp_path / "broken")
    os.makedirs(broken)
    save_file({n: t for n, t in fp8.items() if n != "model.layers.0.self_attn.q_proj.weight_scale_inv"},
              os.path.join(broken, "model.safetensors"))
    with open(os.path.join(fp8_dir, "config.json")) as f, open(os.path.join(broken, "config.json"), "w") as g:
        g.write(f.read())
    with pytest.raises(ckpt.MappingError, match="'model.layers.0.self_attn.q_proj.weight' of the FP8 checkpoint .* "
                                                "has no 'model.layers.0.self_attn.q_proj.weight_scale_inv'"):
        ckpt.hf_to_megatron(broken, str(tmp_path / "no"))


# --- the engine ---------------------------------------------------------------------------------------------------
def test_fp8_engine_takes_fp8_updates_and_refuses_mismatched_ones(moe, tmp_path):
    from forge_megatron.rollout.launch import start_engine

    def bad_dir(name, tensors, config_from=moe["v1_fp8"]):
        d = tmp_path / name
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        (d / "config.json").write_text((open(os.path.join(config_from, "config.json")).read()))
        return str(d)

    v1 = _tensors(moe["v1_fp8"])
    qname = next(n for n, t in v1.items() if t.dtype == FP8_DTYPE)
    engine = start_engine(moe["v0_fp8"], in_process=True)
    plain = start_engine(moe["v0"], in_process=True)
    try:
        assert engine.engine.fp8 == Fp8Config(block=BLOCK) and plain.engine.fp8 is None
        ok = _post(engine.url, "/update_weights_from_disk", {"model_path": moe["v1_fp8"], "weight_version": "1"})
        assert ok["success"], ok
        tail = [3, 1, 4, 1, 5]
        want = _logprobs(_hf(moe["v1_fp8"]), tail)
        got = _logprobs(engine.engine.model, tail)
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-6
        assert max(abs(a - b) for a, b in zip(_logprobs(_hf(moe["v1"]), tail), want)) > 1e-4  # FP8 is not bf16
        cases = [
            (bad_dir("plain", _tensors(moe["v1"])), "must come as float8_e4m3fn"),
            (bad_dir("noscale", {qname: v1[qname]}), "came without"),
            (bad_dir("grid", {qname: v1[qname], qname + "_scale_inv": torch.ones(1, 1)}), "weight_block_size"),
        ]
        for path, message in cases:
            try:
                reply = _post(engine.url, "/update_weights_from_disk", {"model_path": path})
            except Exception as exc:  # noqa: BLE001 - urllib raises on the 400
                reply = json.loads(exc.read())
            assert reply["success"] is False and message in reply["message"], (path, reply)
        try:
            reply = _post(plain.url, "/update_weights_from_disk", {"model_path": moe["v1_fp8"]})
        except Exception as exc:  # noqa: BLE001
            reply = json.loads(exc.read())
        assert reply["success"] is False and "without an fp8 quantization_config" in reply["message"]
        # nothing of the refused updates was written
        got = _logprobs(engine.engine.model, tail)
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-6
    finally:
        engine.stop()
        plain.stop()


# --- the trainer's sync -----------------------------------------------------------------------------------------
def test_trainer_sync_sends_what_the_fp8_checkpoint_of_its_weights_holds(moe, tmp_path):
    """EP=2 trainer -> forge-engine serving the FP8 checkpoint, over the broadcast (FP8 bytes over gloo) and the
    disk transport: the engine then scores its greedy tokens exactly like transformers loading forge-convert's FP8
    export of the trainer's weights, about e4m3's rounding away from the trainer's own full-precision logprobs,
    with a quarter of the fp32 bytes for the quantized weights."""
    results = sync_ep2_trainer_to(moe["v0"], moe["v0_fp8"], tmp_path, fp8=Fp8Config(block=BLOCK))
    full = _tensors(moe["v0"])
    full_bytes = sum(t.numel() * t.element_size() for t in full.values())
    proj_bytes = sum(t.numel() * t.element_size() for n, t in full.items() if n.endswith("proj.weight"))
    for version, transport in ((1, "distributed"), (2, "disk")):
        report, ids, ((engine_lps, engine_version), trainer_lps) = results[0][transport]
        assert report.policy_version == version and engine_version == str(version) and report.excluded == []
        reference = _to_fp8(str(tmp_path / "export" / transport), str(tmp_path / f"ref_{transport}"))
        hf_lps = _logprobs(_hf(reference), ids)
        assert max(abs(a - b) for a, b in zip(engine_lps, hf_lps)) <= 1e-5, transport
        assert max(abs(a - b) for a, b in zip(engine_lps, trainer_lps)) > 1e-5  # FP8 rounding is visible
        assert max(abs(a - b) for a, b in zip(engine_lps, trainer_lps)) < 0.1
        ref = _tensors(reference)
        scale_bytes = sum(t.numel() * 4 for n, t in ref.items() if n.endswith("weight_scale_inv"))
        assert report.bytes == sum(t.numel() * t.element_size() for t in ref.values())
        assert report.bytes == full_bytes - proj_bytes * 3 // 4 + scale_bytes  # 1 byte per fp32 projection weight



@pytest.mark.gpu
def test_quantize_on_the_gpu_equals_the_cpu():
    """Stage leads quantize gathered tensors on their GPU: the same bytes and scales as on the CPU (IEEE division and
    round-to-nearest-even casts on both), partial edge blocks included."""
    torch.manual_seed(1)
    w = (torch.randn(300, 700) * torch.logspace(-2, 1, 700)).to(torch.bfloat16)
    q, s = quantize(w, (128, 128))
    q_gpu, s_gpu = quantize(w.cuda(), (128, 128))
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q.view(torch.uint8)) and torch.equal(s_gpu.cpu(), s)
    assert torch.equal(dequantize(q_gpu, s_gpu, (128, 128)).cpu(), dequantize(q, s, (128, 128)))


def test_sparse_attention_indexer_syncs_in_fp8(tmp_path):
    """DeepSeek-V3.2 (tiny, its indexer picking 4 keys): the FP8 serving copy holds the indexer's wq_b and wk in FP8
    and weights_proj in bf16 as the release does, and an EP=2 trainer's sync leaves the engine scoring exactly like
    transformers loading the FP8 export of the trainer's weights."""
    from forge_megatron.models.tiny import build_tiny_model

    src = build_tiny_model(str(tmp_path / "v0"), arch="deepseek_v32", seed=5)
    # blocks dividing every weight: transformers dequantizes a partial block (the 24-wide key/value latent under 16 x 16
    # blocks) otherwise than DeepSeek's reference and forge (the releases' 512 / 1536 / 7168 are whole blocks)
    block = (8, 8)
    served = _to_fp8(src, str(tmp_path / "v0_fp8"), block=block)
    dtypes = {n: t.dtype for n, t in _tensors(served).items() if ".indexer." in n}
    assert dtypes["model.layers.0.self_attn.indexer.wq_b.weight"] == FP8_DTYPE
    assert dtypes["model.layers.0.self_attn.indexer.wk.weight"] == FP8_DTYPE
    assert "model.layers.0.self_attn.indexer.wk.weight_scale_inv" in dtypes
    assert dtypes["model.layers.0.self_attn.indexer.weights_proj.weight"] != FP8_DTYPE
    results = sync_ep2_trainer_to(src, served, tmp_path, fp8=Fp8Config(block=block))
    for transport in ("distributed", "disk"):
        report, ids, ((engine_lps, _), trainer_lps) = results[0][transport]
        assert report.excluded == []
        reference = _to_fp8(str(tmp_path / "export" / transport), str(tmp_path / f"ref_{transport}"), block=block)
        assert max(abs(a - b) for a, b in zip(engine_lps, _logprobs(_hf(reference), ids))) <= 1e-5, transport
        assert max(abs(a - b) for a, b in zip(engine_lps, trainer_lps)) > 1e-5  # FP8 rounding is visible
