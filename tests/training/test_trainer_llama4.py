"""The trainer on Llama 4's layouts, as a real process against a real forge-pool process. Maverick's (a dense layer,
then a MoE one: top-1 sigmoid-routed experts fed their inputs scaled by the router's score, a shared expert beside
them; layer 0 rotates, attends in chunks of 4 depths and norms its q/k heads, layer 1 has no RoPE and an attention
temperature by depth): one rank, TP = 2 with sequence parallelism, CP = 2 (each rank's heads see whole chunks in the
all-to-all mode), PP = 2 (the dense layer on one stage, the MoE one on the other) and EP = 2 train the same two steps,
routing replayed. CPU, 0 GPUs (gloo)."""

import numpy as np

from forge_megatron.models.tiny import build_tiny_model

from .pool_feed import feed_groups
from .trainer_run import REPLAY_KEYS, assert_same_as_one_rank, run_layouts


def test_llama4_maverick_trains_the_same_under_tensor_context_pipeline_and_expert_parallelism(tmp_path):
    model_dir = build_tiny_model(str(tmp_path / "llama4"), arch="llama4", seed=2, interleave_moe_layer_step=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 6), routing=(2, 4, 1))  # noqa
    runs = ["tp2sp", "cp2", "pp2", "ep2"]
    steps = run_layouts(tmp_path, model_dir, feed, ["one"] + runs, ["--routing-replay", "--tree-token-budget", "24"])
    assert steps["one"][0]["grad_norm"] > 0 and all(s["routing_replayed_rows"] > 0 for s in steps["one"])
    assert_same_as_one_rank(steps, runs, REPLAY_KEYS)
