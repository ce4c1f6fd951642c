"""The trainer on Cohere's layouts, as a real process against a real forge-pool process: parallel attention + MLP
layers on one bias-free LayerNorm (the MLP reads the input norm's output, which under sequence parallelism is each
TP rank's slice of the tokens), interleaved RoPE on the window layers beside NoPE full-attention ones, the logits
scaled. Command A's layout (Cohere2, dense) trains the same two steps on one rank, under TP = 2 with sequence
parallelism, CP = 2 (windows on each rank's zig-zag shard) and PP = 2 (the tied head on the last stage); Command A+'s
(Cohere2-MoE: a dense first layer, experts averaged with a shared expert) under TP = 2 + SP and EP = 2, routing
replayed. CPU, 0 GPUs (gloo)."""

import numpy as np

from forge_megatron.models.tiny import build_tiny_model

from .pool_feed import feed_groups
from .trainer_run import REPLAY_KEYS, assert_same_as_one_rank, run_layouts


def test_command_a_trains_the_same_under_tensor_context_and_pipeline_parallelism(tmp_path):
    model_dir = build_tiny_model(str(tmp_path / "cohere2"), arch="cohere2", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 6))  # noqa
    runs = ["tp2sp", "cp2", "pp2"]
    steps = run_layouts(tmp_path, model_dir, feed, ["one"] + runs, ["--tree-token-budget", "24"])
    assert steps["one"][0]["grad_norm"] > 0
    assert_same_as_one_rank(steps, runs)


def test_command_a_plus_trains_the_same_under_tensor_and_expert_parallelism(tmp_path):
    model_dir = build_tiny_model(str(tmp_path / "cohere2_moe"), arch="cohere2_moe", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 6), routing=(3, 4, 2))  # noqa
    runs = ["tp2sp", "ep2"]
    steps = run_layouts(tmp_path, model_dir, feed, ["one"] + runs, ["--routing-replay", "--tree-token-budget", "24"])
    assert steps["one"][0]["grad_norm"] > 0 and all(s["routing_replayed_rows"] > 0 for s in steps["one"])
    assert_same_as_one_rank(steps, runs, REPLAY_KEYS)
