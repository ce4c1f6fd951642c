"""RoPE attention factors on part of each head, and longrope (Phi-3.5 / Phi-4-mini) with one factor list per run
(mcore/rope.py). transformers switches a longrope model's factor lists with each forward's length, so a prompt cached
with the short list and its continuation past the original context rotate differently; forge trains with one list
and pins the reference engine to it. Tests: the trainer's model with each list equals transformers' wherever
transformers uses that list, and transformers pinned to it at every length; the two lists differ; a pinned model's
cached continuation equals its fresh forward (an unpinned one's does not); the reference engine loads pinned; TP2
with sequence parallelism scales each rank's rotated channels alike; the trainer's ``--longrope-factors`` is
checked; bad configs are refused by name. CPU, 0 GPUs (gloo)."""

import dataclasses
import json
import os

import pytest
import torch

from forge_megatron.convert import checkpoint as ckpt
from forge_megatron.convert.checkpoint import ParallelLayout
from forge_megatron.mcore import rope
from forge_megatron.mcore.parallel import ParallelConfig
from tests.dist_utils import run_distributed

SHORT = torch.tensor([[5, 17, 42, 99, 7, 31], [9, 4, 33, 60, 2, 15]])  # within the tiny model's 8 original positions
LONG = torch.tensor([[5, 17, 42, 99, 7, 31, 64, 12, 3, 8, 77, 21], [9, 4, 33, 60, 2, 15, 28, 90, 11, 6, 45, 70]])


@pytest.fixture(scope="module")
def phi4_mini(tmp_path_factory):
    from forge_megatron.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("longrope")
    hf_dir = build_tiny_model(str(root / "hf"), arch="phi4_mini", seed=4)
    for layout, name in ((ParallelLayout(), "tp1"), (ParallelLayout(tp=2), "tp2")):
        ckpt.hf_to_megatron(hf_dir, str(root / name), layout)
    return hf_dir, root


def _logits_body(rank, world_size, mcore_dir, factors, sequence_parallel=False):
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from forge_megatron.mcore.model import build_gpt, causal_mask

    bridge, _ = ckpt.read_meta(mcore_dir)
    out = {}
    for name in factors:
        cfg = dataclasses.replace(bridge.cfg, rope_scaling={**bridge.cfg.rope_scaling, "longrope_factors": name})
        model = build_gpt(cfg, sequence_parallel=sequence_parallel).eval()
        ckpt.load_into(model, mcore_dir)
        with torch.no_grad():
            for key, tokens in (("short", SHORT), ("long", LONG)):
                s = tokens.shape[1]
                logits = model(tokens, torch.arange(s)[None].expand_as(tokens), causal_mask(s))
                out[name, key] = gather_from_tensor_model_parallel_region(logits)  # [b, s, V]
    return out


def _hf(hf_dir, pinned: str | None = None):
    from transformers import AutoConfig

    from forge_megatron.models import load_causal_lm

    if pinned is None:
        return load_causal_lm(hf_dir, dtype=torch.float32).eval()
    config = AutoConfig.from_pretrained(hf_dir)
    config.rope_parameters = rope.pinned_longrope(config.rope_parameters, pinned)
    return load_causal_lm(hf_dir, dtype=torch.float32, config=config).eval()


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens).logits


def test_each_factor_list_equals_transformers_where_it_uses_it_and_pinned(phi4_mini):
    hf_dir, root = phi4_mini
    (got,) = run_distributed(_logits_body, world_size=1, mcore_dir=str(root / "tp1"), factors=("short", "long"))
    plain, pinned = _hf(hf_dir), {name: _hf(hf_dir, name) for name in ("short", "long")}
    # transformers itself: the short list up to 8 positions, the long one past them
    assert (got["short", "short"] - _hf_logits(plain, SHORT)).abs().max() <= 1e-4
    assert (got["long", "long"] - _hf_logits(plain, LONG)).abs().max() <= 1e-4
    # pinned, at every length
    for name in ("short", "long"):
        for key, tokens in (("short", SHORT), ("long", LONG)):
            assert (got[name, key] - _hf_logits(pinned[name], tokens)).abs().max() <= 1e-4, (name, key)
    # the lists differ (so a test that mixed them up would fail)
    assert (got["short", "short"] - got["long", "short"]).abs().max() > 1e-2
    assert (got["short", "long"] - got["long", "long"]).abs().max() > 1e-2


def test_a_pinned_model_continues_its_cache_as_it_computes_afresh(phi4_mini):
    """What pinning is for: a prompt cached within the original context and its continuation past it. transformers
    unpinned rotates the cached prompt with the short list and the continuation with the long one, which no single
    forward (the trainer's) reproduces; pinned, the cached continuation equals the fresh forward."""
    hf_dir, _ = phi4_mini

    def cached_minus_fresh(model):
        with torch.no_grad():
            fresh = model(input_ids=LONG).logits[:, 6:]
            prompt = model(input_ids=LONG[:, :6], use_cache=True)
            cont = model(input_ids=LONG[:, 6:], past_key_values=prompt.past_key_values, use_cache=True).logits
        return (cont - fresh).abs().max().item()

    assert cached_minus_fresh(_hf(hf_dir)) > 1e-2
    assert cached_minus_fresh(_hf(hf_dir, "long")) <= 1e-4


def test_reference_engine_loads_pinned_to_the_trainers_default(phi4_mini):
    from forge_megatron.rollout.engine_server import ReferenceEngine

    hf_dir, _ = phi4_mini
    engine = ReferenceEngine(hf_dir)  # the default: long (2048 positions past the original 8), as the trainer's
    try:
        params = engine.model.config.rope_parameters
        assert params["short_factor"] == params["long_factor"] == [2.0, 4.0, 6.0, 8.0, 12.0, 24.0]
        assert (_hf_logits(engine.model, SHORT) - _hf_logits(_hf(hf_dir, "long"), SHORT)).abs().max() == 0
    finally:
        engine.worker.shutdown()
    short = ReferenceEngine(hf_dir, longrope_factors="short")
    try:
        assert short.model.config.rope_parameters["long_factor"] == [1.0, 1.1, 1.3, 1.6, 2.0, 2.5]
    finally:
        short.worker.shutdown()
    from forge_megatron.models.tiny import build_tiny_model

    plain = build_tiny_model(os.path.join(os.path.dirname(hf_dir), "phi3"), arch="phi3", seed=1)
    with pytest.raises(ValueError, match="has no longrope RoPE"):
        ReferenceEngine(plain, longrope_factors="long")


def test_tensor_and_sequence_parallel_ranks_scale_their_rotated_channels(phi4_mini):
    hf_dir, root = phi4_mini
    results = run_distributed(_logits_body, world_size=2, parallel=ParallelConfig(tp=2),
                              mcore_dir=str(root / "tp2"), factors=("long",), sequence_parallel=True)
    want = _hf_logits(_hf(hf_dir), LONG)
    for got in results:
        assert (got["long", "long"] - want).abs().max() <= 1e-4


def test_trainer_flag_and_bad_configs(phi4_mini, tmp_path):
    from forge_megatron.bridge import Bridge, UnsupportedModelError
    from forge_megatron.models.tiny import tiny_config
    from forge_megatron.training import arguments
    from forge_megatron.training.trainer import model_config

    hf_dir, _ = phi4_mini
    base = ["--hf-checkpoint", hf_dir, "--lr", "1e-6", "--train-iters", "1", "--weight-sync-transport", "none"]
    cfg = model_config(arguments.parse_args(base), Bridge(hf_dir))
    assert cfg.rope_scaling["longrope_factors"] == "long" and cfg.rotated_channels_scale == pytest.approx(
        (1 + torch.log(torch.tensor(256.0)).item() / torch.log(torch.tensor(8.0)).item()) ** 0.5)
    short = model_config(arguments.parse_args(base + ["--longrope-factors", "short"]), Bridge(hf_dir))
    assert short.rope_scaling["longrope_factors"] == "short"
    phi3 = {**tiny_config("phi3").to_dict(), "architectures": ["Phi3ForCausalLM"]}
    with pytest.raises(ValueError, match="has no longrope RoPE"):
        model_config(arguments.parse_args(base + ["--longrope-factors", "short"]), Bridge(phi3))
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    params = hf["rope_parameters"]
    for change, message in (({"short_factor": None}, "needs 'short_factor'"),
                            ({"long_factor": [1.0, 2.0]}, "2 factors for 6 rotated frequencies"),
                            ({"short_mscale": 1.2}, "short_mscale"),
                            ({"long_factor": [1.0, -1.0, 1.0, 1.0, 1.0, 1.0]}, "list of positive numbers")):
        with pytest.raises((ValueError, UnsupportedModelError), match=message):
            cfg = Bridge({**hf, "rope_parameters": {**params, **change}}).cfg
            rope.inv_freq(cfg.rope_scaling, cfg.rotary_base, cfg.rotary_dim)  # (as the model is built)
    # the pinned entry an SGLang engine is given: both lists the chosen one, the rest as the checkpoint has it
    pinned = rope.pinned_longrope(params, "short")
    assert pinned["long_factor"] == pinned["short_factor"] == params["short_factor"]
    assert pinned["partial_rotary_factor"] == 0.75 and pinned["original_max_position_embeddings"] == 8


def test_cli_prints_the_override_that_pins_sglang(phi4_mini, capsys):
    """``forge-convert longrope-override``: the JSON for SGLang's --json-model-override-args under the key the
    checkpoint's config.json uses, both lists the chosen one (default: the trainer's); transformers' config updated with
    it, as SGLang updates the checkpoint's, computes the trainer's logits; a checkpoint without longrope is an error
    naming it."""
    from transformers import AutoConfig

    from forge_megatron.convert.cli import main as cli_main
    from forge_megatron.models import load_causal_lm

    hf_dir, root = phi4_mini
    assert cli_main(["longrope-override", "--hf-dir", hf_dir]) == 0
    override = json.loads(capsys.readouterr().out)
    (key,) = override
    assert key == "rope_parameters" and override[key]["short_factor"] == override[key]["long_factor"] == \
        [2.0, 4.0, 6.0, 8.0, 12.0, 24.0]
    config = AutoConfig.from_pretrained(hf_dir)
    config.update(override)  # (as SGLang applies --json-model-override-args to the checkpoint's config)
    served = load_causal_lm(hf_dir, dtype=torch.float32, config=config).eval()
    (got,) = run_distributed(_logits_body, world_size=1, mcore_dir=str(root / "tp1"), factors=("long",))
    assert (_hf_logits(served, SHORT) - got["long", "short"]).abs().max() <= 1e-4
    # a release's config.json names it rope_scaling (Phi-4-mini): under that key the update reaches the same entry,
    # on transformers 5 (its rope_scaling setter) as on 4 (the attribute the models read)
    legacy = AutoConfig.from_pretrained(hf_dir)
    legacy.update({"rope_scaling": override[key]})
    pinned = legacy.rope_parameters
    assert pinned["short_factor"] == pinned["long_factor"] == override[key]["long_factor"]
    assert cli_main(["longrope-override", "--hf-dir", hf_dir, "--factors", "short"]) == 0
    assert json.loads(capsys.readouterr().out)[key]["long_factor"] == [1.0, 1.1, 1.3, 1.6, 2.0, 2.5]
    from forge_megatron.models.tiny import build_tiny_model

    plain = build_tiny_model(str(root / "qwen3"), arch="qwen3", seed=1, with_tokenizer=False)
    assert cli_main(["longrope-override", "--hf-dir", plain]) == 2
    assert "has no longrope RoPE" in capsys.readouterr().err


def test_attention_factors_megatron_cannot_place_are_refused():
    """Where the attention factor could not be one scale on the rotated channels: q/k norms after RoPE (a norm
    would undo it on a whole head and not on part of one), a second RoPE for the sliding layers, per-layer heads."""
    from forge_megatron.mcore.model import GPTConfig

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    assert GPTConfig(rotary_percent=0.5, rope_scaling=yarn).rotated_channels_scale == pytest.approx(
        rope.attention_factor(rope.check(yarn, 4096)))
    assert GPTConfig(rope_scaling=yarn).rotated_channels_scale == 1.0  # whole head: a softmax scale
    with pytest.raises(ValueError, match="q/k norms after RoPE"):
        GPTConfig(rope_scaling=yarn, qk_layernorm=True, qk_norm_after_rope=True)
    with pytest.raises(ValueError, match="one RoPE for every layer"):
        GPTConfig(rotary_percent=0.5, rope_scaling=yarn, sliding_rope_scaling={"rope_type": "default"},
                  extra={"window_size": (3, 0), "window_attn_skip_freq": [1, 0]})
