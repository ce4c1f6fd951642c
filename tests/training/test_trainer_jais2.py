"""The trainer on Jais 2's layout, as a real process against a real forge-pool process: LayerNorms with biases, biases
on q, k, v and the attention's output projection, a plain squared-ReLU MLP with biases. One rank and TP = 2 with
sequence parallelism (the norms' weights and biases see each rank's slice of the tokens: their gradients summed over
TP; the row-parallel projections' biases added once, after the reduction) train the same two steps. CPU, 0 GPUs
(gloo)."""

import numpy as np

from forge_megatron.models.tiny import build_tiny_model

from .pool_feed import feed_groups
from .trainer_run import assert_same_as_one_rank, run_layouts


def test_jais2_biases_and_layernorms_train_the_same_under_tensor_parallelism(tmp_path):
    model_dir = build_tiny_model(str(tmp_path / "jais2"), arch="jais2", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 6))  # noqa: E731
    steps = run_layouts(tmp_path, model_dir, feed, ["one", "tp2sp"], ["--tree-token-budget", "24"])
    assert steps["one"][0]["grad_norm"] > 0
    assert_same_as_one_rank(steps, ["tp2sp"])
