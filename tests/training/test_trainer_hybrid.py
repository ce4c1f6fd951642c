"""The trainer with hybrid linear-attention models (the Qwen3.5 layout: a Gated DeltaNet layer, then a gated
full-attention layer, zero-centred norms; OLMo Hybrid's; Kimi Linear's) as a real process against a real forge-pool
process: one rank, PP = 2, TP = 2 with sequence parallelism (the gated norm's shared weight all-reduced over TP in the
backward) and CP = 2 (key heads traded for tokens) train the same two steps. CPU, 0 GPUs (gloo)."""

import numpy as np
import pytest

from forge_megatron.models.tiny import build_tiny_model

from .pool_feed import feed_groups
from .trainer_run import REPLAY_KEYS, assert_same_as_one_rank, run_on_fresh_pool


def test_qwen3_5_trains_the_same_under_pipeline_and_tensor_parallelism(tmp_path):
    model_dir = build_tiny_model(str(tmp_path / "qwen3_5"), arch="qwen3_5", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 5))  # noqa: E731
    steps = {}
    for name, extra, nproc in (
            ("one", [], 1),
            ("pp2", ["--pipeline-model-parallel-size", "2"], 2),  # the linear and the full layer on two stages
            ("tp2sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
            # each CP rank runs the whole tree for one of the two key heads (an all-to-all each way)
            ("cp2", ["--context-parallel-size", "2"], 2)):
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1, nproc=nproc,
                                              extra=extra + ["--tree-token-budget", "18"], model=[])
    assert [len(v) for v in steps.values()] == [2, 2, 2, 2]
    assert steps["one"][0]["grad_norm"] > 0
    assert_same_as_one_rank(steps, ("pp2", "tp2sp", "cp2"))

    from forge_megatron.bridge import Bridge
    from forge_megatron.training import arguments
    from forge_megatron.training.trainer import model_config

    args = arguments.parse_args(["--hf-checkpoint", model_dir, "--lr", "1e-4", "--train-iters", "3",
                                 "--weight-sync-transport", "none", "--context-parallel-size", "4"])
    with pytest.raises(ValueError, match="--context-parallel-size 4 must divide the key heads per tensor-parallel "
                                         "rank \\(2 / 1\\)"):
        model_config(args, Bridge(model_dir))


def test_qwen3_5_moe_trains_the_same_under_tensor_expert_and_pipeline_parallelism(tmp_path):
    """The Qwen3.5-MoE layout (the same hybrid layers, each MLP routed experts plus a shared expert behind a sigmoid
    gate) with rollout routing replay: TP = 2 with sequence parallelism, EP = 2, PP = 2 and TP = 2 x EP = 2 with the
    experts whole (the shared expert still split over TP) train the same two steps as one rank; both layers replay
    their rows."""
    model_dir = build_tiny_model(str(tmp_path / "qwen3_5_moe"), arch="qwen3_5_moe", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 5), routing=(2, 4, 2))  # noqa
    steps = {}
    for name, extra, nproc in (
            ("one", [], 1),
            ("tp2sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
            ("ep2", ["--expert-model-parallel-size", "2"], 2),
            ("pp2", ["--pipeline-model-parallel-size", "2"], 2),
            ("tp2_ep2_etp1", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                              "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"], 2)):
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1, nproc=nproc,
                                              extra=extra + ["--routing-replay", "--tree-token-budget", "18"],
                                              model=[])
    assert [len(v) for v in steps.values()] == [2, 2, 2, 2, 2]
    assert_same_as_one_rank(steps, ("tp2sp", "ep2", "pp2", "tp2_ep2_etp1"), REPLAY_KEYS)
    assert sorted(s["routing_replayed_rows"] for s in steps["one"]) == [120, 128]  # both layers MoE
    assert steps["one"][0]["grad_norm"] > 0 and 0 < steps["one"][0]["routing_mismatch"] < 1


def test_olmo_hybrid_trains_the_same_under_tensor_and_context_parallelism(tmp_path):
    """The OLMo Hybrid layout (a pre-norm Gated DeltaNet layer with beta in (0, 2), then OLMo 3's post-norm attention
    without RoPE): TP = 2 with sequence parallelism (the post-attention norms on reduce-scattered outputs, the gated
    norm's weight shared over TP) and CP = 2 (key heads traded for tokens; the NoPE attention's zig-zag shards) train
    the same two steps as one rank."""
    model_dir = build_tiny_model(str(tmp_path / "olmo_hybrid"), arch="olmo_hybrid", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 5))  # noqa: E731
    steps = {}
    for name, extra, nproc in (
            ("one", [], 1),
            ("tp2sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
            ("cp2", ["--context-parallel-size", "2"], 2)):
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1, nproc=nproc,
                                              extra=extra + ["--tree-token-budget", "18"], model=[])
    assert [len(v) for v in steps.values()] == [2, 2, 2]
    assert steps["one"][0]["grad_norm"] > 0
    assert_same_as_one_rank(steps, ("tp2sp", "cp2"))


def test_kimi_linear_trains_the_same_under_tensor_context_expert_and_pipeline_parallelism(tmp_path):
    """The Kimi Linear layout (a Kimi Delta Attention layer with a dense MLP, then RoPE-less multi-latent attention
    with a MoE layer) with routing replay: TP = 2 with sequence parallelism (the heads, their gates' up projections
    and the convolution split; the gates' shared down projections split and gathered, their gradient summed over
    TP), CP = 2 (heads traded for tokens, MLA on zig-zag shards), EP = 2 and PP = 2 train the same two steps as one
    rank; the MoE layer replays its rows."""
    model_dir = build_tiny_model(str(tmp_path / "kimi_linear"), arch="kimi_linear", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 5), routing=(2, 4, 2))  # noqa
    steps = {}
    for name, extra, nproc in (
            ("one", [], 1),
            ("tp2sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
            ("cp2", ["--context-parallel-size", "2"], 2),
            ("ep2", ["--expert-model-parallel-size", "2"], 2),
            ("pp2", ["--pipeline-model-parallel-size", "2"], 2)):
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1, nproc=nproc,
                                              extra=extra + ["--routing-replay", "--tree-token-budget", "18"],
                                              model=[])
    assert [len(v) for v in steps.values()] == [2, 2, 2, 2, 2]
    assert_same_as_one_rank(steps, ("tp2sp", "cp2", "ep2", "pp2"), REPLAY_KEYS)
    assert sorted(s["routing_replayed_rows"] for s in steps["one"]) == [60, 64]  # one MoE layer of two
    assert steps["one"][0]["grad_norm"] > 0 and 0 < steps["one"][0]["routing_mismatch"] < 1
