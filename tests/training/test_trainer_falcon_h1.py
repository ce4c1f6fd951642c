"""The trainer on Falcon-H1's layout, as a real process against a real forge-pool process: attention and a Mamba-2
mixer side by side in every layer (mcore/falcon_h1.py), every muP multiplier apart from 1. One rank, TP = 2 with
sequence parallelism (each rank half the attention heads and one Mamba-2 group, both on its slice of the tokens),
CP = 2 (the attention on zig-zag shards, the mixer on the whole tree for one group) and PP = 2 train the same two
steps. CPU, 0 GPUs (gloo)."""

import numpy as np

from forge_megatron.models.tiny import build_tiny_model

from .pool_feed import feed_groups
from .trainer_run import assert_same_as_one_rank, run_layouts


def test_falcon_h1_trains_the_same_under_tensor_context_and_pipeline_parallelism(tmp_path):
    model_dir = build_tiny_model(str(tmp_path / "falcon_h1"), arch="falcon_h1", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 6))  # noqa
    runs = ["tp2sp", "cp2", "pp2"]
    steps = run_layouts(tmp_path, model_dir, feed, ["one"] + runs, ["--tree-token-budget", "24"])
    assert steps["one"][0]["grad_norm"] > 0
    assert_same_as_one_rank(steps, runs)
