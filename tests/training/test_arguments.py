"""train_forge.py's command line: forge flags in --help, no collision with Megatron-LM's flags, validation. CPU, 0 GPUs."""

import argparse
import os
import re
import subprocess
import sys

import pytest

from forge_megatron.training import arguments

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MINIMAL = ["--hf-checkpoint", "/tmp/m", "--lr", "1e-4", "--train-iters", "3", "--weight-sync-transport", "none"]


def _forge_flags() -> list[str]:
    parser = arguments.add_forge_args(argparse.ArgumentParser())
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"]


def _megatron_lm_flags() -> set[str]:
    path = os.path.join(os.path.dirname(__file__), "megatron_lm_flags.txt")
    with open(path) as f:
        return {line.strip() for line in f if line.startswith("--")}


def test_every_forge_flag_is_in_help():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train_forge.py"), "--help"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    flags = _forge_flags()
    assert len(flags) >= 25
    missing = [f for f in flags if f not in out.stdout]
    assert not missing, f"forge flags missing from --help: {missing}"
    assert "forge (agent RL)" in out.stdout


def test_forge_flags_do_not_collide_with_megatron_lm():
    megatron = _megatron_lm_flags()
    assert {"--num-layers", "--tensor-model-parallel-size", "--lr", "--save"} <= megatron  # the list is real
    assert sorted(set(_forge_flags()) & megatron) == []


def test_mirror_uses_megatron_names_and_builds_without_conflict():
    parser = arguments.build_parser()  # argparse raises on a duplicate option string
    mirrored = [s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
    forge = set(_forge_flags())
    megatron_mirror = [f for f in mirrored if f not in forge]
    unknown = sorted(set(megatron_mirror) - _megatron_lm_flags())
    assert unknown == [], f"mirrored flags that Megatron-LM does not have: {unknown}"


def test_megatron_defaults_mirrored():
    args = arguments.build_parser().parse_args([])
    assert args.tensor_model_parallel_size == 1 and args.seed == 1234 and args.log_interval == 100
    assert args.lr_decay_style == "linear" and args.clip_grad == 1.0 and args.weight_decay == 0.01
    assert args.normalization == "LayerNorm" and args.position_embedding_type == "learned_absolute"
    assert args.add_bias_linear is True and args.rotary_base == 10000


def test_forge_values_parse():
    args = arguments.parse_args(MINIMAL + ["--reward-weights", "malformed_tool_calls=-0.2", "--domain-ratios",
                                           "math=0.7,qa=0.3", "--engine-urls", "http://a:1,http://b:2",
                                           "--no-tree-merging", "--rl-loss", "ppo"])
    assert args.reward_weights == {"malformed_tool_calls": -0.2}
    assert args.domain_ratios == {"math": 0.7, "qa": 0.3}
    assert args.engine_urls == ["http://a:1", "http://b:2"] and args.tree_merging is False
    cfg = arguments.loss_config(args)
    assert (cfg.loss_type, cfg.eps_low, cfg.eps_high) == ("ppo", 0.2, 0.2)
    assert arguments.reward_config(args).process_weights["malformed_tool_calls"] == -0.2


def test_weight_sync_flags_reach_the_syncer_config():
    from forge_megatron.training.trainer import weight_sync_config

    sync = ["--engine-urls", "http://a:1", "--weight-sync-transport", "distributed"]
    args = arguments.parse_args(MINIMAL + sync + ["--weight-sync-pause-mode", "retract",
                                           "--weight-sync-bucket-mb", "64", "--weight-sync-master-addr", "10.0.0.7"])
    cfg = weight_sync_config(args)
    assert (cfg.pause_mode, cfg.bucket_bytes, cfg.master_addr) == ("retract", 64 << 20, "10.0.0.7")
    assert weight_sync_config(arguments.parse_args(MINIMAL + sync)).pause_mode == "abort"


def test_weight_sync_fp8_reads_the_engines_checkpoint_config(tmp_path):
    import json

    from forge_megatron.training.trainer import weight_sync_config
    from forge_megatron.weight_sync.fp8 import Fp8Config

    sync = ["--engine-urls", "http://a:1", "--weight-sync-transport", "distributed"]
    fp8_dir, plain_dir = tmp_path / "fp8", tmp_path / "plain"
    fp8_dir.mkdir(), plain_dir.mkdir()
    qc = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 32], "modules_to_not_convert": ["mlp.gate"]}
    (fp8_dir / "config.json").write_text(json.dumps({"quantization_config": qc}))
    (plain_dir / "config.json").write_text(json.dumps({"hidden_size": 8}))
    for path in (str(fp8_dir), str(fp8_dir / "config.json")):
        cfg = weight_sync_config(arguments.parse_args(MINIMAL + sync + ["--weight-sync-fp8", path]))
        assert cfg.fp8 == Fp8Config(block=(64, 32), skip=("mlp.gate",))
    assert weight_sync_config(arguments.parse_args(MINIMAL + sync)).fp8 is None
    for extra, message in [([str(plain_dir)], "has no quantization_config"), ([str(tmp_path / "nope")], "cannot read"),
                           ([str(fp8_dir), "--weight-sync-transport", "none"], "needs a weight sync")]:
        with pytest.raises(ValueError, match=message):
            arguments.parse_args(MINIMAL + sync + ["--weight-sync-fp8", *extra])


def test_weight_sync_int4_reads_the_engines_checkpoint_config(tmp_path):
    """--weight-sync-int4: the quantization_config of the int4 release the engines serve (top level, or a
    vision-language release's text_config: Kimi-K2.5), refused when it is not one, without a sync, or with FP8."""
    import json

    from forge_megatron.training.trainer import weight_sync_config
    from forge_megatron.weight_sync.int4 import Int4Config

    sync = ["--engine-urls", "http://a:1", "--weight-sync-transport", "distributed"]
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head", "re:.*self_attn.*"],
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
              "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}
    top, vl, fp8 = tmp_path / "k2", tmp_path / "k25", tmp_path / "fp8"
    for d, config in ((top, {"quantization_config": qc}), (vl, {"text_config": {"quantization_config": qc}}),
                      (fp8, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
    for path in (str(top), str(vl / "config.json")):
        cfg = weight_sync_config(arguments.parse_args(MINIMAL + sync + ["--weight-sync-int4", path]))
        assert cfg.int4 == Int4Config(group=32, ignore=("lm_head", "re:.*self_attn.*")) and cfg.fp8 is None
        assert cfg.int4.hf_dict() == qc
    for extra, message in [([str(fp8)], "not a compressed-tensors"), ([str(tmp_path / "nope")], "cannot read"),
                           ([str(top), "--weight-sync-transport", "none"], "needs a weight sync"),
                           ([str(top), "--weight-sync-fp8", str(fp8)], "the engines serve one checkpoint")]:
        with pytest.raises(ValueError, match=message):
            arguments.parse_args(MINIMAL + sync + ["--weight-sync-int4", *extra])
    # --int4-qat: the release's rounding, its own CHECKPOINT's or --weight-sync-int4's (no sync needed with a path)
    want = Int4Config(group=32, ignore=("lm_head", "re:.*self_attn.*"))
    assert arguments.int4_qat_config(arguments.parse_args(MINIMAL + ["--int4-qat", str(vl)])) == want
    assert arguments.int4_qat_config(arguments.parse_args(MINIMAL + sync + ["--weight-sync-int4", str(top),
                                                                            "--int4-qat"])) == want
    assert arguments.int4_qat_config(arguments.parse_args(MINIMAL)) is None
    with pytest.raises(ValueError, match="--int4-qat without a CHECKPOINT"):
        arguments.parse_args(MINIMAL + ["--int4-qat"])
    with pytest.raises(ValueError, match="--int4-qat .*not a compressed-tensors"):
        arguments.parse_args(MINIMAL + ["--int4-qat", str(fp8)])


@pytest.mark.parametrize("extra, message", [
    (["--tree-token-budget", "0"], "--tree-token-budget must be >= 1"),
    (["--weight-sync-transport", "disk", "--engine-urls", "http://a:1"], "needs --weight-sync-dir"),
    (["--weight-sync-transport", "distributed"], "needs --engine-urls"),
    (["--save-interval", "2"], "--save-interval needs --save"),
    (["--async-save"], "--async-save needs --save"),
    (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer"),
    (["--keep-checkpoints", "2"], "--keep-checkpoints needs --save"),
    (["--save", "/tmp/x", "--keep-checkpoints", "0"], "--keep-checkpoints must be >= 1"),
    (["--train-iters", "0"], "--train-iters must be >= 1"),
    (["--rl-loss-norm-constant", "100"], "--rl-loss-norm-constant is used only with --rl-loss-norm constant"),
    (["--fp32-lm-head", "--no-fused-logprobs"], "--fp32-lm-head needs the fused logprobs"),
    (["--micro-batch-size", "4"], "size them with --tree-token-budget"),
    (["--routing-replay-split"], "--routing-replay-split needs --routing-replay"),
    (["--recompute-vision-tower"], "--recompute-vision-tower needs --train-vision-tower"),
    (["--vision-lr", "1e-5"], "--vision-lr needs --train-vision-tower"),
    (["--vision-trainable", "merger.*"], "--vision-trainable needs --train-vision-tower"),
    (["--train-vision-tower", "--vision-lr", "-1"], "--vision-lr needs --train-vision-tower and a value >= 0"),
    (["--rl-mismatch-band", "2", "3"], "--rl-mismatch-band LOW HIGH needs 0 < LOW < 1 < HIGH"),
    (["--rl-tis-cap", "0"], "the --rl-\\* loss flags: tis_cap must be > 0"),
    (["--ref-hf-checkpoint", "/x"], "--ref-hf-checkpoint is used only with --rl-kl-coef > 0"),
    (["--ref-offload"], "--ref-offload offloads the reference model, which exists only with --rl-kl-coef > 0, "
                        "--preference-data or --kto-data"),
    (["--teacher-offload"], "--teacher-offload needs --teacher-hf-checkpoint"),
    (["--distill-outcome-coef", "0"], "--distill-outcome-coef needs --teacher-hf-checkpoint"),
    (["--teacher-hf-checkpoint", "/t", "--distill-coef", "0"], "--distill-coef must be > 0 and "
                                                                "--distill-outcome-coef >= 0, got 0.0 and 1.0"),
    (["--teacher-hf-checkpoint", "/t", "--distill-coef", "-1"], "distill_coef and outcome_coef must be >= 0"),
    (["--teacher-hf-checkpoint", "/t", "--teacher-from-gateway"], "one teacher \\(in the trainer, or served"),
    (["--teacher-from-gateway", "--teacher-offload"], "the teacher is served elsewhere"),
    (["--distill-kl", "reverse"], "--distill-kl needs --teacher-hf-checkpoint"),
    (["--teacher-hf-checkpoint", "/t", "--distill-topk", "8"], "--distill-topk sets the dense KL's top-k: it needs "
                                                               "--distill-kl forward, reverse or jsd"),
    (["--teacher-hf-checkpoint", "/t", "--distill-kl", "reverse", "--distill-jsd-beta", "0.3"],
     "--distill-jsd-beta weighs the JSD's mixture: it needs --distill-kl jsd"),
    (["--teacher-hf-checkpoint", "/t", "--distill-kl", "jsd", "--distill-jsd-beta", "1"],
     "distill_jsd_beta must lie in \\(0, 1\\), got 1.0"),
    (["--teacher-hf-checkpoint", "/t", "--distill-kl", "forward", "--distill-topk", "0"],
     "--distill-topk must be >= 1, got 0"),
    (["--gae-lambda", "0.95"], "--gae-lambda is a flag of the learned critic: add --critic"),
    (["--critic-warmup-iters", "2"], "--critic-warmup-iters is a flag of the learned critic"),
    (["--critic", "--gae-gamma", "1.5"], "--gae-gamma must lie in \\[0, 1\\], got 1.5"),
    (["--critic", "--critic-warmup-iters", "-1"], "--critic-warmup-iters must be >= 0"),
    (["--critic", "--preference-data", __file__], "for RL on the pool's episodes: not with --preference-data"),
    (["--ppo-mini-batches", "0"], "--ppo-mini-batches and --ppo-epochs must be >= 1, got 0 and 1"),
    (["--ppo-epochs", "0"], "--ppo-mini-batches and --ppo-epochs must be >= 1, got 1 and 0"),
    (["--train-batch-groups", "2", "--ppo-mini-batches", "3"], "--ppo-mini-batches 3: more mini-batches than the "
                                                               "batch's 2 groups"),
    (["--sft-data", __file__, "--ppo-epochs", "2"], "offline modes \(--sft-data, --preference-data, --kto-data\) take a "
                                                    "smaller --train-batch-groups instead"),
    (["--value-clip", "0.2"], "--value-clip clips the learned critic's value loss: add --critic"),
    (["--ppo-target-kl", "0.01"], "--ppo-target-kl 0.01: stops the later updates of a batch, so it needs"),
    (["--ppo-epochs", "2", "--ppo-target-kl", "0"], "needs a value > 0"),
    (["--whiten-advantages", "--sft-data", __file__], "--whiten-advantages whitens RL advantages: not with --sft-data"),
    (["--critic", "--value-clip", "0"], "--value-clip must be > 0, got 0.0"),
])
def test_bad_values_are_named(extra, message):
    with pytest.raises(ValueError, match=message):
        arguments.parse_args(MINIMAL + extra)


def test_critic_checkpoint_implies_critic():
    args = arguments.parse_args(MINIMAL + ["--critic-hf-checkpoint", "/c", "--gae-lambda", "0.9"])
    assert args.critic and args.gae_lambda == 0.9 and args.whiten_advantages and args.critic_lr is None
    assert not arguments.parse_args(MINIMAL + ["--critic", "--no-whiten-advantages"]).whiten_advantages
    # without a critic the pool's advantages are trained as they come, unless asked (REINFORCE++'s normalisation)
    assert not arguments.parse_args(MINIMAL).whiten_advantages
    assert arguments.parse_args(MINIMAL + ["--whiten-advantages"]).whiten_advantages


def test_missing_checkpoint_and_bad_pairs():
    with pytest.raises(ValueError, match="--hf-checkpoint is required"):
        arguments.parse_args(["--lr", "1", "--train-iters", "1", "--weight-sync-transport", "none"])
    with pytest.raises(argparse.ArgumentTypeError, match="value of 'math' is not a number"):
        arguments.name_float_pairs("math=x")
    with pytest.raises(argparse.ArgumentTypeError, match="name=value pairs"):
        arguments.name_float_pairs("math")


def test_model_arrays_build_gpt_configs():
    import shlex

    for name, vocab in (("tiny", 300), ("qwen3-8B", 0), ("qwen3-30B-A3B", 0), ("llama3.1-8B", 0), ("glm4.5-air", 0),
                        ("devstral-small", 0), ("deepseek-v3", 0), ("moonlight-16B-A3B", 0), ("gpt-oss-20b", 0),
                        ("minimax-m2", 0), ("qwen3.5-27B", 0), ("qwen2.5-7B", 0)):
        script = os.path.join(ROOT, "scripts", "models", f"{name}.sh")
        out = subprocess.run(["bash", "-c", f'source {shlex.quote(script)}; printf "%s\\n" "${{MODEL_ARGS[@]}}"'],
                             capture_output=True, text=True, check=True)
        args = arguments.parse_args(MINIMAL + out.stdout.split())
        cfg = arguments.gpt_config(args, vocab_size=vocab)
        assert cfg.num_layers == args.num_layers and cfg.vocab_size == (args.vocab_size or vocab)
        if name == "llama3.1-8B":  # Llama 3.1's own rope_scaling entry
            assert cfg.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
            assert cfg.rotary_base == 500000.0
        else:
            assert cfg.rope_scaling is None
        if name == "glm4.5-air":  # the GLM-4.5 MoE layout from Megatron's flags
            assert (cfg.moe_dense_layers, cfg.moe_shared_ffn_hidden_size, cfg.rotary_percent) == (1, 1408, 0.5)
            assert cfg.extra["moe_router_score_function"] == "sigmoid" and cfg.extra["moe_router_enable_expert_bias"]
        if name == "deepseek-v3":  # multi-latent attention and group-limited routing from Megatron's flags
            assert cfg.multi_latent_attention and (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.head_dim) == (1536, 512, 128)
            assert (cfg.extra["moe_router_num_groups"], cfg.extra["moe_router_group_topk"]) == (8, 4)
            assert cfg.moe_dense_layers == 3 and cfg.num_query_groups == 128
        if name == "moonlight-16B-A3B":
            assert cfg.multi_latent_attention and cfg.q_lora_rank is None
        if name == "minimax-m2":  # every layer MoE, q/k norms over all heads, RoPE on half of each head
            assert cfg.qk_layernorm_all_heads and cfg.moe_dense_layers == 0 and cfg.rotary_percent == 0.5
            assert cfg.moe_shared_ffn_hidden_size is None and cfg.num_moe_experts == 256
        if name == "qwen3.5-27B":  # 48 Gated DeltaNet layers, every 4th gated full attention, zero-centred norms
            assert cfg.hybrid and sum(cfg.linear_attention) == 48 and not cfg.linear_attention[3]
            assert cfg.zero_centered_norm and cfg.attention_output_gate and cfg.rotary_percent == 0.25
            assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (16, 48)
        if name == "gpt-oss-20b":  # biases everywhere, GQA 64 / 8 of 64 channels
            assert cfg.add_bias_linear and cfg.add_qkv_bias and (cfg.num_query_groups, cfg.head_dim) == (8, 64)
    assert cfg.add_qkv_bias is True and cfg.num_query_groups == 4  # qwen2.5-7B is last


def test_deepseek_v2_lite_script_agrees_with_its_release_config():
    """scripts/models/deepseek-v2-lite.sh's Megatron flags pass the trainer's check against DeepSeek-V2-Lite's
    config.json; the router's pre-softmax top-k and fp32 logits (no flag says them) come from the checkpoint; a flag
    that disagrees is named."""
    import shlex

    from forge_megatron.bridge import Bridge
    from forge_megatron.training.trainer import model_config
    from tests.bridge.test_bridge import _deepseek_v2_lite

    script = os.path.join(ROOT, "scripts", "models", "deepseek-v2-lite.sh")
    flags = subprocess.run(["bash", "-c", f'source {shlex.quote(script)}; printf "%s\\n" "${{MODEL_ARGS[@]}}"'],
                           capture_output=True, text=True, check=True).stdout.split()
    cfg = model_config(arguments.parse_args(MINIMAL + flags), Bridge(_deepseek_v2_lite()))
    assert cfg.moe_router_pre_softmax and cfg.extra["moe_router_dtype"] == "fp32" and cfg.q_lora_rank is None
    wrong = [f if f != "softmax" else "sigmoid" for f in flags]
    with pytest.raises(ValueError, match="router: the model flags say"):
        model_config(arguments.parse_args(MINIMAL + wrong), Bridge(_deepseek_v2_lite()))


def test_pool_side_flags_are_checked_against_the_pool(tmp_path):
    from forge_megatron.middleware.pool import DataPool, PoolConfig

    pool = DataPool(PoolConfig(db_path=str(tmp_path / "p.sqlite"), window_fraction=0.5, generation_batch_groups=8,
                               reward=arguments.reward_config(arguments.parse_args(
                                   MINIMAL + ["--advantage-estimator", "rloo", "--reward-weights",
                                              "language_mixing=-1.0"]))))
    try:
        cfg = pool.metrics()["config"]
    finally:
        pool.close()
    assert cfg["window"] == 4 and cfg["advantage_estimator"] == "rloo"
    arguments.check_pool_config(arguments.parse_args(MINIMAL), cfg)  # nothing given: the pool's settings rule
    arguments.check_pool_config(arguments.parse_args(MINIMAL + ["--window-fraction", "0.5", "--advantage-estimator",
                                                                "rloo", "--reward-weights", "language_mixing=-1"]), cfg)
    bad = arguments.parse_args(MINIMAL + ["--window-fraction", "0.3", "--reward-weights", "language_mixing=-0.5",
                                          "--completion-time-bound", "0.2"])
    with pytest.raises(ValueError, match=r"--completion-time-bound 0.2 \(pool: 0.0\); --window-fraction 0.3 "
                                         r"\(pool: 0.5\); --reward-weights language_mixing=-0.5 \(pool: -1.0\)"):
        arguments.check_pool_config(bad, cfg)
    # the overlong penalty: given to the trainer, it must be the pool's
    overlong = arguments.parse_args(MINIMAL + ["--overlong-max-tokens", "4096", "--overlong-buffer-tokens", "512"])
    assert (arguments.reward_config(overlong).overlong_max_tokens,
            arguments.reward_config(overlong).overlong_buffer_tokens) == (4096, 512)
    with pytest.raises(ValueError, match=r"--overlong-max-tokens 4096 \(pool: None\); --overlong-buffer-tokens 512 "
                                         r"\(pool: 0\)"):
        arguments.check_pool_config(overlong, cfg)
    arguments.check_pool_config(overlong, {**cfg, "overlong_max_tokens": 4096, "overlong_buffer_tokens": 512})
    with pytest.raises(ValueError, match="--overlong-buffer-tokens / --overlong-penalty need --overlong-max-tokens"):
        arguments.reward_config(arguments.parse_args(MINIMAL + ["--overlong-penalty", "0.5"]))
    # distillation needs every group, solved or not: a pool that drops the ones without outcome advantage is refused
    distil = arguments.parse_args(MINIMAL + ["--teacher-from-gateway"])
    arguments.check_pool_config(distil, cfg)
    with pytest.raises(ValueError, match="those groups still carry the teacher's per-token signal"):
        arguments.check_pool_config(distil, {**cfg, "drop_zero_advantage_groups": True})
    # so does a learned critic (those groups' returns still differ from its values)
    critic = arguments.parse_args(MINIMAL + ["--critic"])
    arguments.check_pool_config(critic, cfg)
    with pytest.raises(ValueError, match="with a learned critic those groups still have advantages"):
        arguments.check_pool_config(critic, {**cfg, "drop_zero_advantage_groups": True})


def test_constant_loss_norm_takes_its_divisor_and_is_split_over_dp():
    from forge_megatron.training.trainer import RankBatch, batch_loss_config

    with pytest.raises(ValueError, match="norm_constant"):
        arguments.loss_config(arguments.parse_args(MINIMAL + ["--rl-loss-norm", "constant"]))
    cfg = arguments.loss_config(arguments.parse_args(MINIMAL + ["--rl-loss-norm", "constant",
                                                                "--rl-loss-norm-constant", "1000"]))
    rb = RankBatch(micro_batches=[], num_loss_tokens=300.0, samples=[], batch_id=0, global_loss_tokens=800.0,
                   dp_size=2)
    assert batch_loss_config(cfg, rb).norm_constant == 500.0  # C / DP: DDP averages the DP ranks' gradients
    token_mean = arguments.loss_config(arguments.parse_args(MINIMAL))
    out = batch_loss_config(token_mean, rb)
    assert out.norm == "constant" and out.norm_constant == 400.0  # G / DP, G = loss tokens of the whole batch
    seq_mean = arguments.loss_config(arguments.parse_args(MINIMAL + ["--rl-loss-norm", "seq_mean"]))
    rb.global_sample_weight = 12.0
    out = batch_loss_config(seq_mean, rb)
    assert out.norm == "seq_mean" and out.norm_constant == 6.0  # W / DP, W = sample weights of the whole batch
    rb.global_sample_weight = 0.0
    with pytest.raises(ValueError, match="sample weights sum to 0.0: the seq_mean normaliser is 0"):
        batch_loss_config(seq_mean, rb)


@pytest.mark.parametrize("extra,layers,expected", [
    ([], 8, None),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"], 8, 2),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "4"], 8, 4),
    (["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "2"], 8, None),  # 1 chunk
])
def test_virtual_pipeline_size(extra, layers, expected):
    args = arguments.parse_args(MINIMAL + extra)
    assert arguments.virtual_pipeline_size(args, layers) == expected
    assert arguments.parallel_config(args, layers).vpp == expected


@pytest.mark.parametrize("extra,message", [
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--num-virtual-stages-per-pipeline-rank", "2"], "not both"),
    (["--num-virtual-stages-per-pipeline-rank", "2"], r"need --pipeline-model-parallel-size >= 2"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
     "8 layers do not split into 2 pipeline ranks x chunks of 3 layers"),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "3"],
     r"do not split into 2 x 3 equal chunks"),
])
def test_virtual_pipeline_errors_are_named(extra, message):
    args = arguments.parse_args(MINIMAL + extra)
    with pytest.raises(ValueError, match=message):
        arguments.virtual_pipeline_size(args, 8)


def test_moe_under_tensor_parallelism_needs_sequence_parallel(tmp_path):
    """Megatron-Core's MoE layer refuses to train with TP > 1 and no SP (each TP rank would dispatch its copy of
    every token): the trainer says so before building anything, and sets sequence_parallel when asked."""
    from forge_megatron.bridge import Bridge
    from forge_megatron.models.tiny import build_tiny_model
    from forge_megatron.training.trainer import model_config

    moe = build_tiny_model(str(tmp_path / "moe"), arch="qwen3_moe")
    dense = build_tiny_model(str(tmp_path / "dense"))
    tp2 = ["--tensor-model-parallel-size", "2"]
    with pytest.raises(ValueError, match="is a MoE model: with --tensor-model-parallel-size 2 it needs --sequence-parallel"):
        model_config(arguments.parse_args(MINIMAL + tp2), Bridge(moe))
    cfg = model_config(arguments.parse_args(MINIMAL + tp2 + ["--sequence-parallel"]), Bridge(moe))
    assert cfg.extra["sequence_parallel"] is True
    assert model_config(arguments.parse_args(MINIMAL + tp2), Bridge(dense)).extra["sequence_parallel"] is False
    assert "sequence_parallel" not in model_config(arguments.parse_args(MINIMAL + ["--sequence-parallel"]),
                                                   Bridge(dense)).extra  # TP = 1: nothing to split


def test_model_flags_must_agree_with_the_checkpoints_rope():
    """The trainer takes the architecture from the HF checkpoint; Megatron flags that say otherwise (base, Llama 3.1
    RoPE scaling) stop it. YaRN / linear scaling, which no Megatron flag expresses, come from the checkpoint."""
    from forge_megatron.bridge import Bridge
    from forge_megatron.models.tiny import tiny_config
    from forge_megatron.training.trainer import model_config

    def hf(**params):
        cfg = tiny_config("llama", rope_parameters={"rope_theta": 500000.0, **params}).to_dict()
        return {**cfg, "architectures": ["LlamaForCausalLM"]}

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
             "--num-query-groups", "2", "--ffn-hidden-size", "128", "--position-embedding-type", "rope",
             "--rotary-base", "500000"]
    args = arguments.parse_args(MINIMAL + flags + ["--use-rope-scaling"])
    assert model_config(args, Bridge(hf(**llama3))).rope_scaling == llama3
    with pytest.raises(ValueError, match="rope_scaling: the model flags say None"):
        model_config(arguments.parse_args(MINIMAL + flags), Bridge(hf(**llama3)))
    with pytest.raises(ValueError, match="rope_scaling: the model flags say"):
        model_config(arguments.parse_args(MINIMAL + flags + ["--use-rope-scaling", "--rope-scaling-factor", "32"]),
                     Bridge(hf(**llama3)))
    with pytest.raises(ValueError, match="rotary_base: the model flags say 10000.0"):
        model_config(arguments.parse_args(MINIMAL + [f for f in flags if f not in ("--rotary-base", "500000")]),
                     Bridge(hf(**llama3)))
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert model_config(arguments.parse_args(MINIMAL + flags), Bridge(hf(**yarn))).rope_scaling["rope_type"] == "yarn"


def test_moe_layer_freq_names_a_dense_prefix_or_is_refused():
    assert arguments.dense_prefix("1", 4) == 0 and arguments.dense_prefix("([0]*3+[1]*89)", 92) == 3
    for bad, message in (("2", "only 1 or"), ("([0]*1+[1]*3)", "describes 4 layers"), ("[1,0]", "only 1 or")):
        with pytest.raises(ValueError, match=re.escape(message)):
            arguments.dense_prefix(bad, 5 if bad == "([0]*1+[1]*3)" else 2)


def test_glm_flags_must_agree_with_the_checkpoint():
    from forge_megatron.bridge import Bridge
    from forge_megatron.models.tiny import tiny_config
    from forge_megatron.training.trainer import model_config

    hf = {**tiny_config("glm4_moe").to_dict(), "architectures": ["Glm4MoeForCausalLM"]}
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
             "--num-query-groups", "2", "--ffn-hidden-size", "128", "--kv-channels", "16", "--qk-layernorm",
             "--add-qkv-bias", "--position-embedding-type", "rope", "--num-experts", "4", "--moe-ffn-hidden-size",
             "32", "--moe-shared-expert-intermediate-size", "32", "--moe-layer-freq", "([0]*1+[1]*1)",
             "--rotary-percent", "0.5", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
             "--moe-router-topk-scaling-factor", "2.5"]
    assert model_config(arguments.parse_args(MINIMAL + flags), Bridge(hf)).moe_dense_layers == 1
    for drop, field in ((["--rotary-percent", "0.5"], "rotary_percent"),
                        (["--moe-layer-freq", "([0]*1+[1]*1)"], "moe_dense_layers"),
                        (["--moe-router-enable-expert-bias"], "router")):
        wrong = [f for f in flags if f not in drop]
        with pytest.raises(ValueError, match=f"{field}: the model flags say"):
            model_config(arguments.parse_args(MINIMAL + wrong), Bridge(hf))


def test_deepseek_v3_flags_must_agree_with_the_checkpoint():
    """Multi-latent attention's sizes and group-limited routing are compared with the checkpoint like the rest."""
    from forge_megatron.bridge import Bridge
    from forge_megatron.models.tiny import tiny_config
    from forge_megatron.training.trainer import model_config

    hf = {**tiny_config("deepseek_v3").to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
             "--qk-layernorm", "--position-embedding-type", "rope", "--multi-latent-attention", "--q-lora-rank", "32",
             "--kv-lora-rank", "24", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12",
             "--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "32",
             "--moe-layer-freq", "([0]*1+[1]*1)", "--moe-router-score-function", "sigmoid",
             "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor", "2.5",
             "--moe-router-num-groups", "2", "--moe-router-group-topk", "1"]
    cfg = model_config(arguments.parse_args(MINIMAL + flags), Bridge(hf))
    assert cfg.multi_latent_attention and cfg.v_head_dim == 12
    for change, field in ((["--multi-latent-attention"], "multi_latent_attention"),
                          (["--v-head-dim", "12"], "v_head_dim"),
                          (["--q-lora-rank", "32"], "q_lora_rank"),
                          (["--moe-router-num-groups", "2"], "router")):
        at = flags.index(change[0])
        wrong = flags[:at] + flags[at + len(change):]
        with pytest.raises(ValueError, match=f"{field}: the model flags say"):
            model_config(arguments.parse_args(MINIMAL + wrong), Bridge(hf))


def test_minimax_m2_flags_must_agree_with_the_checkpoint():
    """minimax-m2.sh's kind of flags against a MiniMax-M2 checkpoint: the all-heads q/k norm is a forge flag,
    compared like Megatron's."""
    from forge_megatron.bridge import Bridge
    from forge_megatron.models.tiny import tiny_config
    from forge_megatron.training.trainer import model_config

    hf = {**tiny_config("minimax_m2").to_dict(), "architectures": ["MiniMaxM2ForCausalLM"]}
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
             "--num-query-groups", "2", "--ffn-hidden-size", "32", "--kv-channels", "16", "--qk-layernorm",
             "--qk-layernorm-all-heads", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
             "--rotary-base", "5000000",
             "--rotary-percent", "0.5", "--num-experts", "4", "--moe-ffn-hidden-size", "32",
             "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
    cfg = model_config(arguments.parse_args(MINIMAL + flags), Bridge(hf))
    assert cfg.qk_layernorm_all_heads and cfg.rotary_dim == 8
    for drop, field in ((["--qk-layernorm-all-heads"], "qk_layernorm_all_heads"),
                        (["--rotary-percent", "0.5"], "rotary_percent"),
                        (["--moe-router-enable-expert-bias"], "router")):
        wrong = [f for f in flags if f not in drop]
        with pytest.raises(ValueError, match=f"{field}: the model flags say"):
            model_config(arguments.parse_args(MINIMAL + wrong), Bridge(hf))
    with pytest.raises(ValueError, match="qk_layernorm_all_heads is an RMSNorm over all query / key heads: it needs "
                                         "qk_layernorm"):
        arguments.gpt_config(arguments.parse_args(MINIMAL + [f for f in flags if f != "--qk-layernorm"]), 400)


def test_qwen3_5_flags_must_agree_with_the_checkpoint():
    """qwen3.5-27B.sh's kind of flags (Megatron-LM's gated_delta_net variant) against a Qwen3.5-MoE checkpoint as
    released (vision-language): which layers are Gated DeltaNet, their sizes, the zero-centred norms, the attention
    output gate and the shared expert's gate are compared field by field."""
    from forge_megatron.bridge import Bridge
    from forge_megatron.models.tiny import tiny_config
    from forge_megatron.training.trainer import model_config

    hf = {**tiny_config("qwen3_5_moe_vl").to_dict(), "architectures": ["Qwen3_5MoeForConditionalGeneration"]}
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
             "--num-query-groups", "2", "--ffn-hidden-size", "128", "--kv-channels", "16", "--qk-layernorm",
             "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--rotary-percent", "0.25",
             "--apply-layernorm-1p", "--attention-output-gate", "--experimental-attention-variant", "gated_delta_net",
             "--linear-attention-freq", "2", "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
             "--linear-key-head-dim", "8", "--linear-value-head-dim", "8", "--num-experts", "4",
             "--moe-ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "48", "--moe-shared-expert-gate"]
    cfg = model_config(arguments.parse_args(MINIMAL + flags), Bridge(hf))
    assert cfg.linear_attention == (True, False) and cfg.extra["moe_shared_expert_gate"]
    for drop, field in ((["--apply-layernorm-1p"], "zero_centered_norm"),
                        (["--attention-output-gate"], "attention_output_gate"),
                        (["--moe-shared-expert-gate"], "shared_expert_gate")):
        wrong = [f for f in flags if f not in drop]
        with pytest.raises(ValueError, match=f"{field}: the model flags say"):
            model_config(arguments.parse_args(MINIMAL + wrong), Bridge(hf))
    for change, field in ((("--linear-attention-freq", "2"), "linear_attention"),
                          (("--linear-num-value-heads", "4"), "linear_num_value_heads")):
        i = flags.index(change[0])
        wrong = flags[:i + 1] + ["1" if field == "linear_attention" else "8"] + flags[i + 2:]
        with pytest.raises(ValueError, match=f"{field}: the model flags say"):
            model_config(arguments.parse_args(MINIMAL + wrong), Bridge(hf))
    without = flags[:flags.index("--linear-attention-freq")] + flags[flags.index("--linear-num-key-heads"):]
    with pytest.raises(ValueError, match="gated_delta_net needs --linear-attention-freq"):
        arguments.gpt_config(arguments.parse_args(MINIMAL + without), 400)


def test_gpt_oss_flags_must_agree_with_the_checkpoint():
    """gpt-oss-20b.sh's kind of flags (biases on, GQA, the experts' width) against a gpt-oss checkpoint; what no
    Megatron-LM flag here expresses (sinks, windows, the clamped GLU, YaRN) comes from the checkpoint."""
    from forge_megatron.bridge import Bridge
    from forge_megatron.models.tiny import tiny_config
    from forge_megatron.training.trainer import model_config

    hf = {**tiny_config("gpt_oss").to_dict(), "architectures": ["GptOssForCausalLM"]}
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
             "--num-query-groups", "2", "--ffn-hidden-size", "32", "--kv-channels", "16", "--add-qkv-bias",
             "--position-embedding-type", "rope", "--rotary-base", "150000", "--num-experts", "4",
             "--moe-ffn-hidden-size", "32"]
    cfg = model_config(arguments.parse_args(MINIMAL + flags), Bridge(hf))
    assert cfg.extra["softmax_type"] == "learnable" and cfg.extra["window_size"] == (3, 0)
    with pytest.raises(ValueError, match="add_qkv_bias: the model flags say False"):
        model_config(arguments.parse_args(MINIMAL + [f for f in flags if f != "--add-qkv-bias"]), Bridge(hf))


def test_router_bias_update_rate_needs_a_bias():
    from forge_megatron.bridge import Bridge
    from forge_megatron.models.tiny import tiny_config
    from forge_megatron.training.trainer import model_config

    glm = Bridge({**tiny_config("glm4_moe").to_dict(), "architectures": ["Glm4MoeForCausalLM"]})
    assert model_config(arguments.parse_args(MINIMAL), glm).extra["moe_router_bias_update_rate"] == 0.0
    cfg = model_config(arguments.parse_args(MINIMAL + ["--moe-router-bias-update-rate", "0.001"]), glm)
    assert cfg.extra["moe_router_bias_update_rate"] == 0.001
    qwen = Bridge({**tiny_config("qwen3_moe").to_dict(), "architectures": ["Qwen3MoeForCausalLM"]})
    with pytest.raises(ValueError, match="has no router score-correction bias"):
        model_config(arguments.parse_args(MINIMAL + ["--moe-router-bias-update-rate", "0.001"]), qwen)


def test_expert_tensor_parallel_flag_and_resume_layout():
    """--expert-tensor-parallel-size takes 1 or the TP size (Megatron-LM's flag), reaches the parallel config, and a
    checkpoint saved under another expert-TP split (same world size) is told apart (and resharded on resume),
    naming the change; checkpoints written before the field existed read as expert TP = TP."""
    from forge_megatron.training.checkpoint import layout_changes

    base = ["--hf-checkpoint", "m", "--lr", "1e-4", "--train-iters", "3", "--weight-sync-transport", "none",
            "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    args = arguments.parse_args(base + ["--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2"])
    arguments.validate_args(args)
    parallel = arguments.parallel_config(args)
    assert (parallel.tp, parallel.ep, parallel.expert_tp) == (2, 2, 1) and parallel.data_parallel_size(2) == 1
    assert arguments.parallel_config(arguments.parse_args(base)).expert_tp == 2  # default: the TP size
    with pytest.raises(ValueError, match="--expert-tensor-parallel-size 4: forge supports 1 .* or the TP size \\(2\\)"):
        arguments.validate_args(arguments.parse_args(base + ["--expert-tensor-parallel-size", "4"]))
    layout = {"tp": 2, "pp": 1, "ep": 1, "cp": 1, "dp": 1, "vpp": 1}
    assert layout_changes(layout, {**layout, "etp": 2}) == ""  # an older checkpoint: expert TP = TP
    assert layout_changes(layout, {**layout, "etp": 1}) == "etp 2 -> 1"
    assert layout_changes(layout, {**layout, "tp": 1, "pp": 2, "etp": 1}) == "tp 2 -> 1, pp 1 -> 2, etp 2 -> 1"


def test_every_model_script_sources_and_names_known_parsers():
    """Each scripts/models/*.sh (what forge.sbatch and run_local.sh source by MODEL=...) sets MODEL_ARGS the trainer
    parses (empty: the architecture comes from the checkpoint) and gateway formats that exist."""
    import glob
    import shlex

    from forge_megatron.middleware.reasoning_parsers import get_reasoning_parser
    from forge_megatron.middleware.tool_parsers import get_parser

    scripts = sorted(glob.glob(os.path.join(ROOT, "scripts", "models", "*.sh")))
    assert len(scripts) >= 15
    for script in scripts:
        out = subprocess.run(["bash", "-c", f'set -u; source {shlex.quote(script)}; printf "%s\\n" "${{MODEL_ARGS[@]}}"; '
                              'echo "TOOL=$TOOL_PARSER"; echo "REASONING=$REASONING_PARSER"'],
                             capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
        assert out.returncode == 0, (script, out.stderr)
        lines = out.stdout.splitlines()
        flags = [x for line in lines if not line.startswith(("TOOL=", "REASONING=")) for x in line.split()]
        arguments.parse_args(MINIMAL + flags)
        get_parser(next(line for line in lines if line.startswith("TOOL="))[len("TOOL="):])
        get_reasoning_parser(next(line for line in lines if line.startswith("REASONING="))[len("REASONING="):])


def test_sparse_attention_flags_and_layouts():
    """DeepSeek-V3.2 / GLM-5: Megatron's DSA flags are checked against the checkpoint; core-attention-only
    recomputation and pipeline stages that begin with a GLM shared-indexer layer are refused by name
    before anything is built."""
    from forge_megatron.bridge import Bridge
    from forge_megatron.models.tiny import tiny_config
    from forge_megatron.training.trainer import model_config

    hf = {**tiny_config("deepseek_v32").to_dict(), "architectures": ["DeepseekV32ForCausalLM"]}
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
             "--qk-layernorm", "--position-embedding-type", "rope", "--multi-latent-attention", "--q-lora-rank", "32",
             "--kv-lora-rank", "24", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12",
             "--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "32",
             "--moe-layer-freq", "([0]*1+[1]*1)", "--moe-router-score-function", "sigmoid",
             "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor", "2.5", "--moe-router-num-groups",
             "2", "--moe-router-group-topk", "1", "--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads",
             "32", "--dsa-indexer-head-dim", "16", "--dsa-indexer-topk", "4"]
    assert model_config(arguments.parse_args(MINIMAL + flags), Bridge(hf)).dsa_index_topk == 4
    with pytest.raises(ValueError, match="dsa_index_topk: the model flags say 2048"):
        model_config(arguments.parse_args(MINIMAL + flags[:-2]), Bridge(hf))
    with pytest.raises(ValueError, match="sparse_attention: the model flags say False"):
        model_config(arguments.parse_args(MINIMAL + flags[:-8]), Bridge(hf))
    assert model_config(arguments.parse_args(MINIMAL + ["--context-parallel-size", "2"]), Bridge(hf))
    with pytest.raises(ValueError, match="use --recompute-granularity full"):
        model_config(arguments.parse_args(MINIMAL + ["--recompute-granularity", "selective"]), Bridge(hf))
    glm = {**tiny_config("glm_moe_dsa").to_dict(), "architectures": ["GlmMoeDsaForCausalLM"]}  # layer 1 shared
    with pytest.raises(ValueError, match="a pipeline stage would begin at layer 1"):
        model_config(arguments.parse_args(MINIMAL + ["--pipeline-model-parallel-size", "2"]), Bridge(glm))
    assert model_config(arguments.parse_args(MINIMAL + ["--pipeline-model-parallel-size", "2"]), Bridge(hf))
    # uneven stages move the boundary: layers [full, shared, full] over PP = 2 as 2 + 1, not 1 + 2
    glm3 = {**tiny_config("glm_moe_dsa", num_hidden_layers=3, indexer_types=["full", "shared", "full"]).to_dict(),
            "architectures": ["GlmMoeDsaForCausalLM"]}
    pp2 = MINIMAL + ["--pipeline-model-parallel-size", "2"]
    assert model_config(arguments.parse_args(pp2 + ["--decoder-first-pipeline-num-layers", "2"]), Bridge(glm3))
    with pytest.raises(ValueError, match="a pipeline stage would begin at layer 1.*--decoder-first-pipeline-num-layers"):
        model_config(arguments.parse_args(pp2 + ["--decoder-last-pipeline-num-layers", "2"]), Bridge(glm3))


def test_block_sparse_attention_refuses_core_attention_recomputation():
    """MiniMax-M3's block-sparse layers: core-attention-only recomputation (the indexer needs the layer's input) is
    refused by name; whole layers may be recomputed."""
    from forge_megatron.bridge import Bridge
    from forge_megatron.models.tiny import tiny_config
    from forge_megatron.training.trainer import model_config

    hf = {**tiny_config("minimax_m3").to_dict(), "architectures": ["MiniMaxM3SparseForConditionalGeneration"]}
    with pytest.raises(ValueError, match="block-sparse attention.*use --recompute-granularity full"):
        model_config(arguments.parse_args(MINIMAL + ["--recompute-granularity", "selective"]), Bridge(hf))
    cfg = model_config(arguments.parse_args(MINIMAL + ["--recompute-granularity", "full"]), Bridge(hf))
    assert cfg.block_sparse_layers == (False, True, True)


def test_longcat_pipeline_stages_hold_whole_layer_pairs():
    """LongCat-Flash: its two checkpoint layers are four Megatron layers, two per pair; PP = 2 (a pair per stage) is
    taken, a stage boundary inside a pair is refused by name before anything is built."""
    from forge_megatron.bridge import Bridge
    from forge_megatron.models.tiny import tiny_config
    from forge_megatron.training.trainer import model_config

    hf = {**tiny_config("longcat_flash").to_dict(), "architectures": ["LongcatFlashForCausalLM"]}
    pp2 = MINIMAL + ["--pipeline-model-parallel-size", "2"]
    assert model_config(arguments.parse_args(pp2), Bridge(hf)).num_layers == 4
    with pytest.raises(ValueError, match=r"LongCat-Flash.*pieces hold \[1, 3\] layers"):
        model_config(arguments.parse_args(pp2 + ["--decoder-first-pipeline-num-layers", "1"]), Bridge(hf))


def test_uneven_pipeline_stage_flags():
    """Megatron-LM's --decoder-first/last-pipeline-num-layers: checked at parse time where the model is not needed
    (PP >= 2, no virtual stages) and against the model's layers once it is known, naming the counts."""
    pp4 = MINIMAL + ["--pipeline-model-parallel-size", "4"]
    args = arguments.parse_args(pp4 + ["--decoder-first-pipeline-num-layers", "13",
                                       "--decoder-last-pipeline-num-layers", "12"])
    parallel = arguments.parallel_config(args, 61)  # DeepSeek-V3: 13 + 18 + 18 + 12
    assert [len(r) for r in parallel.layer_chunks(61)] == [13, 18, 18, 12]
    from forge_megatron.mcore.parallel import pipeline_chunks

    assert pipeline_chunks(3, 2, None, 1, 2) == [range(0, 1), range(1, 3)]  # both given: no middle stage
    assert pipeline_chunks(5, 3, None, None, 1) == [range(0, 2), range(2, 4), range(4, 5)]
    with pytest.raises(ValueError, match="61 layers do not split into 4 pipeline stages: give the first / last"):
        arguments.parallel_config(arguments.parse_args(pp4), 61)
    with pytest.raises(ValueError, match="61 layers do not split into 4 pipeline stages with first stage 13, last "
                                         "stage 11 layers: the other 2 stage"):
        arguments.parallel_config(arguments.parse_args(pp4 + ["--decoder-first-pipeline-num-layers", "13",
                                                              "--decoder-last-pipeline-num-layers", "11"]), 61)
    with pytest.raises(ValueError, match="need --pipeline-model-parallel-size >= 2"):
        arguments.validate_args(arguments.parse_args(MINIMAL + ["--decoder-first-pipeline-num-layers", "1"]))
    with pytest.raises(ValueError, match="give --num-virtual-stages-per-pipeline-rank"):
        arguments.validate_args(arguments.parse_args(pp4 + ["--decoder-first-pipeline-num-layers", "2",
                                                            "--num-layers-per-virtual-pipeline-stage", "1"]))
    # with virtual stages each stage's layers split into its chunks: 2 + 4 layers as chunks [0] [1, 2] | [3] [4, 5]
    vpp = arguments.parallel_config(arguments.parse_args(
        MINIMAL + ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2",
                   "--num-virtual-stages-per-pipeline-rank", "2"]), 6)
    assert vpp.vpp == 2 and vpp.layer_chunks(6) == [range(0, 1), range(1, 3), range(3, 4), range(4, 6)]
    with pytest.raises(ValueError, match=r"give the stages \[3, 3\] layers: each must split into its 2 virtual"):
        pipeline_chunks(6, 2, 2, 3)
