"""--lora-rank: the trainer as a real process against a real forge-pool process, training LoRA adapters over the
frozen checkpoint. One rank, TP = 2 with sequence parallelism, PP = 2, CP = 2 and full recomputation train the same
steps (so do multi-latent attention's adapters and a MoE model's under TP = 2 with SP); the first step's loss
is the full model's (B starts at zero); only the adapters move and have optimizer state; a run stopped and resumed
trains what an uninterrupted one does; the HF export holds the merged weights (the checkpoint's elsewhere); a resume
in another layout is refused. CPU, 0 GPUs (gloo). The sync of merged weights: tests/weight_sync."""

import os
import shutil

import numpy as np
import pytest
import torch

from forge_megatron.models.tiny import build_tiny_model
from forge_megatron.training import arguments

from .pool_feed import feed_groups
from .test_arguments import MINIMAL
from .trainer_run import assert_same_as_one_rank, run_on_fresh_pool

LORA = ["--lora-rank", "4", "--lora-alpha", "16"]


def test_lora_trains_the_same_under_tensor_sequence_and_pipeline_parallelism_and_exports_merged(tmp_path):
    from safetensors.torch import load_file

    from forge_megatron.convert.trainer_checkpoint import export_trainer_checkpoint

    model_dir = build_tiny_model(str(tmp_path / "hf"), arch="qwen3", seed=3)
    feed = lambda c: feed_groups(c, 3, np.random.default_rng(7), completion_len=(4, 6))  # noqa: E731
    layouts = [("one", LORA, 1, (None,)), ("full", [], 1, (None,)),
               ("tp2sp", LORA + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, (None,)),
               ("pp2", LORA + ["--pipeline-model-parallel-size", "2"], 2, (None,)),
               ("cp2", LORA + ["--context-parallel-size", "2"], 2, (None,)),
               # every weight frozen: the recomputed layers' input must still require a gradient for the adapters
               ("recompute", LORA + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                     "--recompute-num-layers", "1"], 1, (None,)),
               ("resumed", LORA, 1, (2, None))]
    steps = {}
    for name, extra, nproc, exits in layouts:
        steps[name], outs, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=3, groups=1, nproc=nproc,
                                                 extra=extra + ["--tree-token-budget", "32"], model=[], exits=exits)
    assert [len(s) for s in steps.values()] == [3] * len(layouts)
    assert_same_as_one_rank(steps, ["tp2sp", "pp2", "cp2", "recompute", "resumed"])
    one, full = steps["one"], steps["full"]
    assert one[0]["loss"] == pytest.approx(full[0]["loss"], rel=1e-6)  # B = 0: the checkpoint's model at step 1
    assert one[0]["grad_norm"] != pytest.approx(full[0]["grad_norm"], rel=1e-2)  # the adapters' gradients alone
    assert one[2]["loss"] != pytest.approx(full[2]["loss"], rel=1e-4)  # and their updates

    # the checkpoints hold what trains: the adapters (and the buffers), not the frozen weights (the resumed run read
    # them from --hf-checkpoint again and trained the same steps)
    ckpt_file = tmp_path / "one" / "ckpt" / "iter_0000002" / "rank_00000.pt"
    state = torch.load(ckpt_file, weights_only=False)
    adapters = [k for k in state["model"] if k.endswith(("lora_A", "lora_B"))]
    assert len(adapters) == 2 * 4 * 2  # two layers' four linears, A and B each
    assert state["frozen_from_hf"] and all(k.endswith(("lora_A", "lora_B", "lora_scaling", "_extra_state"))
                                           for k in state["model"]), sorted(state["model"])
    moved = [k for k in adapters if k.endswith("lora_B") and state["model"][k].abs().max() > 0]
    assert len(moved) == len(adapters) // 2
    full_file = tmp_path / "full" / "ckpt" / "iter_0000003" / "rank_00000.pt"
    assert ckpt_file.stat().st_size < full_file.stat().st_size / 5

    out = str(tmp_path / "export")
    export_trainer_checkpoint(str(tmp_path / "one" / "ckpt"), out)
    got = {k: v for f in os.listdir(out) if f.endswith(".safetensors") for k, v in load_file(f"{out}/{f}").items()}
    before = {k: v for f in os.listdir(model_dir) if f.endswith(".safetensors")
              for k, v in load_file(f"{model_dir}/{f}").items()}
    assert set(got) == set(before)
    adapted = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for name in before:
        if any(f".{m}." in name for m in adapted) and name.endswith("weight"):
            assert not torch.equal(got[name], before[name]), name  # W + scaling * B A
        else:  # embeddings, norms, the head, q/k norms, biases: frozen, the checkpoint's own
            assert torch.equal(got[name], before[name]), name

    config = _check_peft_adapter(tmp_path / "one", model_dir, tmp_path / "peft_one")
    assert (config["r"], config["lora_alpha"]) == (4, 16)
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]

    # a resume under another layout is refused with the way out; so is one over another base checkpoint
    with pytest.raises(AssertionError, match="a --lora-rank run resumes in its own"):
        run_on_fresh_pool(tmp_path, "one", model_dir, feed, iters=4, groups=1, nproc=2, model=[],
                          extra=LORA + ["--tensor-model-parallel-size", "2", "--tree-token-budget", "32"])
    other = build_tiny_model(str(tmp_path / "other"), arch="qwen3", seed=4)
    with pytest.raises(AssertionError, match="holds other weights"):
        run_on_fresh_pool(tmp_path, "one", other, feed, iters=4, groups=1, model=[],
                          extra=LORA + ["--tree-token-budget", "32"])
    # the export reads the frozen weights from the run's --hf-checkpoint, or one given (checked the same)
    from forge_megatron.convert.cli import main as convert

    moved_base = str(tmp_path / "moved_hf")
    shutil.copytree(model_dir, moved_base)
    shutil.rmtree(model_dir)
    with pytest.raises(FileNotFoundError, match="give it with --hf-checkpoint"):
        export_trainer_checkpoint(str(tmp_path / "one" / "ckpt"), str(tmp_path / "export2"))
    assert convert(["trainer-to-hf", "--save-dir", str(tmp_path / "one" / "ckpt"), "--out", str(tmp_path / "export3"),
                    "--hf-checkpoint", moved_base]) == 0
    again = {k: v for f in os.listdir(tmp_path / "export3") if f.endswith(".safetensors")
             for k, v in load_file(f"{tmp_path}/export3/{f}").items()}
    assert set(again) == set(got) and all(torch.equal(again[k], got[k]) for k in got)
    assert convert(["trainer-to-hf", "--save-dir", str(tmp_path / "one" / "ckpt"), "--out", str(tmp_path / "export4"),
                    "--hf-checkpoint", other]) == 2  # (its error: "holds other weights")


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_lora_on_latent_attention_and_moe_models_trains_the_same_under_tensor_and_sequence_parallelism(tmp_path, arch):
    """DeepSeek-V3's layout (multi-latent attention's up projections and output adapted, a dense layer's MLP, a MoE
    layer's experts and shared expert frozen) and Qwen3-MoE's (attention adapted, the experts frozen): TP = 2 with
    sequence parallelism trains the same steps as one rank."""
    model_dir = build_tiny_model(str(tmp_path / "hf"), arch=arch, seed=5)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(9), completion_len=(4, 6))  # noqa: E731
    steps = {}
    for name, extra, nproc in [("one", [], 1),
                               ("tp2sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2)]:
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1, nproc=nproc,
                                              extra=LORA + extra + ["--tree-token-budget", "32"], model=[])
    assert steps["one"][0]["grad_norm"] > 0
    assert_same_as_one_rank(steps, ["tp2sp"])
    # (PEFT 0.21 maps a MoE family's gate/up/down targets onto its experts, which leaves DeepSeek's dense MLP
    # adapters unloaded: docs/training.md)
    modules = _check_peft_adapter(tmp_path / "tp2sp", model_dir, tmp_path / "peft",
                                  load_with_peft=arch != "deepseek_v3")["target_modules"]  # TP shards joined
    assert modules == (["down_proj", "gate_proj", "kv_b_proj", "o_proj", "q_b_proj", "up_proj"]
                       if arch == "deepseek_v3" else ["k_proj", "o_proj", "q_proj", "v_proj"])


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_lora_on_experts_trains_the_same_under_expert_parallelism(tmp_path, arch):
    """``--lora-target-modules all,experts,shared_experts``: an adapter per routed expert (reduced over its
    expert-data-parallel group, as the experts' weights) and on the shared expert. Qwen3-MoE under EP = 2, GLM-4.5's
    layout (a dense layer, a shared expert) under TP = 2 with SP and EP = 2 with the experts whole: the same steps
    as one rank; so does Qwen3-MoE under TP = 2 with SP, its experts split over TP (the token dispatcher's
    communication: the adapters' whole factors summed over TP by a gradient hook)."""
    model_dir = build_tiny_model(str(tmp_path / "hf"), arch=arch, seed=6)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(10), completion_len=(4, 6))  # noqa: E731
    lora = ["--lora-rank", "4", "--lora-target-modules", "all,experts,shared_experts", "--tree-token-budget", "32"]
    other = (["--expert-model-parallel-size", "2"] if arch == "qwen3_moe" else
             ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
              "--expert-tensor-parallel-size", "1"])
    steps = {}
    for name, extra, nproc in [("one", [], 1), ("other", other, 2)]:
        steps[name], outs, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1, nproc=nproc,
                                                 extra=lora + extra, model=[])
    assert steps["one"][0]["grad_norm"] > 0
    assert_same_as_one_rank(steps, ["other"], data_parallel=("other",) if arch == "qwen3_moe" else ())
    if arch == "qwen3_moe":  # the experts split over TP (expert TP = TP): the dispatcher's communication
        steps["split"], _, _ = run_on_fresh_pool(tmp_path, "split", model_dir, feed, iters=2, groups=1, nproc=2,
                                                 model=[], extra=lora + ["--tensor-model-parallel-size", "2",
                                                                         "--sequence-parallel"])
        assert_same_as_one_rank(steps, ["split"])


def test_lora_kl_reference_is_the_policy_with_its_adapters_off(tmp_path):
    """With --rl-kl-coef the reference of a LoRA run is the policy with its adapters off (no copy of the weights):
    it trains the same steps as with a frozen copy of the checkpoint (--ref-hf-checkpoint to a copy of it), under
    PP = 2 too; KL 0 at step 1 (B = 0), > 0 after."""
    import shutil

    model_dir = build_tiny_model(str(tmp_path / "hf"), arch="qwen3", seed=4)
    copy = shutil.copytree(model_dir, str(tmp_path / "hf_copy"))
    feed = lambda c: feed_groups(c, 3, np.random.default_rng(8), completion_len=(4, 6))  # noqa: E731
    kl = LORA + ["--rl-kl-coef", "0.5", "--tree-token-budget", "32"]
    steps, outs = {}, {}
    for name, extra, nproc in [("one", kl, 1), ("copy", kl + ["--ref-hf-checkpoint", copy], 1),
                               ("pp2", kl + ["--pipeline-model-parallel-size", "2"], 2)]:
        steps[name], outs[name], _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=3, groups=1,
                                                       nproc=nproc, extra=extra, model=[])
    assert "the policy with its LoRA adapters off" in outs["one"][0]
    assert "the policy with its LoRA adapters off" not in outs["copy"][0]
    assert_same_as_one_rank(steps, ["copy", "pp2"], keys=("loss", "grad_norm", "kl"))
    assert steps["one"][0]["kl"] == pytest.approx(0.0, abs=1e-7) and steps["one"][2]["kl"] > 1e-6


def _check_peft_adapter(run_dir, base_dir, out_dir, load_with_peft: bool = True) -> dict:
    """The run's PEFT adapter (forge-convert trainer-to-peft) and its merged HF export agree: each adapted HF weight
    of the export is the base's + (alpha / r) B_hf A_hf, every other tensor the base's own; ``load_with_peft``: PEFT
    loads the adapter on the base model, which then scores as the merged export does. Returns the config."""
    import json

    from safetensors.torch import load_file

    from forge_megatron.convert.cli import main as convert

    assert convert(["trainer-to-peft", "--save-dir", f"{run_dir}/ckpt", "--out", f"{out_dir}/peft"]) == 0
    assert convert(["trainer-to-hf", "--save-dir", f"{run_dir}/ckpt", "--out", f"{out_dir}/merged"]) == 0
    config = json.loads(open(f"{out_dir}/peft/adapter_config.json").read())
    adapter = load_file(f"{out_dir}/peft/adapter_model.safetensors")
    merged = {k: v for f in os.listdir(f"{out_dir}/merged") if f.endswith(".safetensors")
              for k, v in load_file(f"{out_dir}/merged/{f}").items()}
    base = {k: v for f in os.listdir(base_dir) if f.endswith(".safetensors")
            for k, v in load_file(f"{base_dir}/{f}").items()}
    scaling = config["lora_alpha"] / config["r"]
    adapted = set()
    for key in adapter:
        if key.endswith(".lora_A.weight"):
            module = key[len("base_model.model."): -len(".lora_A.weight")]
            A, B = adapter[key], adapter[key.replace("lora_A", "lora_B")]
            assert A.shape[0] == B.shape[1] == config["r"]
            want = base[module + ".weight"].float() + scaling * B.float() @ A.float()
            torch.testing.assert_close(merged[module + ".weight"].float(), want, rtol=1e-5, atol=1e-6)
            adapted.add(module + ".weight")
    assert adapted and {k for k in base if not torch.equal(merged[k], base[k])} <= adapted
    assert config["base_model_name_or_path"] == base_dir and config["peft_type"] == "LORA"
    if not load_with_peft:
        return config
    # PEFT itself: the base model with the adapter scores as the merged export does (and not as the base)
    import transformers
    from peft import PeftModel

    ids = torch.tensor([[5, 17, 42, 99, 7, 123, 31, 64, 2, 11]])
    logits = {}
    for name, make in (("merged", lambda: transformers.AutoModelForCausalLM.from_pretrained(f"{out_dir}/merged")),
                       ("peft", lambda: PeftModel.from_pretrained(
                           transformers.AutoModelForCausalLM.from_pretrained(base_dir), f"{out_dir}/peft")),
                       ("base", lambda: transformers.AutoModelForCausalLM.from_pretrained(base_dir))):
        with torch.no_grad():
            logits[name] = make().float().eval()(ids).logits
    torch.testing.assert_close(logits["peft"], logits["merged"], rtol=1e-4, atol=1e-5)
    assert (logits["peft"] - logits["base"]).abs().max() > 1e-4
    return config


def test_lora_flags_are_checked():
    args = arguments.parse_args(MINIMAL + ["--lora-rank", "8"])
    cfg = arguments.lora_config(args)
    assert (cfg.rank, cfg.alpha, cfg.scaling) == (8, 16.0, 2.0) and len(cfg.targets) == 7
    args = arguments.parse_args(MINIMAL + ["--lora-rank", "8", "--lora-alpha", "8", "--lora-target-modules",
                                           "linear_qkv, linear_proj"])
    assert arguments.lora_config(args).targets == ("linear_qkv", "linear_proj")
    assert arguments.lora_config(arguments.parse_args(MINIMAL)) is None
    for extra, message in [(["--lora-rank", "0"], "--lora-rank must be >= 1"),
                           (["--lora-rank", "4", "--lora-alpha", "0"], "--lora-alpha must be > 0"),
                           (["--lora-alpha", "4"], "--lora-alpha needs --lora-rank"),
                           (["--lora-rank", "4", "--lora-target-modules", "q_proj"], "takes some of linear_qkv"),
                           (["--lora-rank", "4", "--train-vision-tower"], "does not combine with --train-vision-tower"),
                           (["--lora-rank", "4", "--rl-kl-coef", "0.1", "--ref-offload"], "no copy of the weights")]:
        with pytest.raises(ValueError, match=message):
            arguments.parse_args(MINIMAL + extra)
    synced = [a for a in MINIMAL if a not in ("--weight-sync-transport", "none")] + ["--engine-urls", "http://e:1"]
    adapter = ["--weight-sync-lora", "adapter", "--weight-sync-dir", "/tmp/a"]
    args = arguments.parse_args(synced + ["--lora-rank", "4"] + adapter)
    assert args.weight_sync_lora == "adapter"
    for extra, message in [(adapter, "needs --lora-rank"),
                           (["--lora-rank", "4", "--weight-sync-lora", "adapter"], "needs --weight-sync-dir"),
                           (["--lora-rank", "4", "--lora-target-modules", "all,experts"] + adapter, "no PEFT form"),
                           (["--lora-rank", "4", "--weight-sync-fp8", "/tmp/fp8"] + adapter, "--weight-sync-fp8")]:
        with pytest.raises(ValueError, match=message):
            arguments.parse_args(synced + extra)
    with pytest.raises(ValueError, match="needs a weight sync"):
        arguments.parse_args(MINIMAL + ["--lora-rank", "4"] + adapter)
