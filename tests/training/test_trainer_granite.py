"""The trainer with Granite's muP-style scales, as a real process against a real forge-pool process: the embedding
times 2, attention scaled by 0.1, each attention's and MLP's output halved before the residual adds it (hooks on every
layer's attention and MLP, under TP with sequence parallelism each rank's slice of the tokens), the logits divided by 4
(the output layer's input, which the fused logprobs take), tied embeddings split over the first and last pipeline
stage. One rank, PP = 2 and TP = 2 with sequence parallelism train the same two steps. CPU, 0 GPUs (gloo)."""

import numpy as np

from forge_megatron.models.tiny import build_tiny_model

from .pool_feed import feed_groups
from .trainer_run import REPLAY_KEYS, assert_same_as_one_rank, run_layouts


def test_granite_scales_train_the_same_under_pipeline_and_tensor_parallelism(tmp_path):
    model_dir = build_tiny_model(str(tmp_path / "granite"), arch="granite", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 6))  # noqa: E731
    steps = run_layouts(tmp_path, model_dir, feed, ["one", "pp2", "tp2sp"], ["--tree-token-budget", "24"])
    assert steps["one"][0]["grad_norm"] > 0
    assert_same_as_one_rank(steps, ["pp2", "tp2sp"])


def test_granite_swa_sinks_and_windows_train_the_same_under_tensor_and_context_parallelism(tmp_path):
    """Granite SWA (a learned sink logit per head in every layer, split over TP with the heads; a sliding window and
    RoPE on layer 1, NoPE on layer 0): TP = 2 with sequence parallelism and CP = 2 (each rank's heads' sinks in the
    all-to-all mode) train the same two steps as one rank."""
    model_dir = build_tiny_model(str(tmp_path / "granite_swa"), arch="granite_swa", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 6))  # noqa: E731
    steps = run_layouts(tmp_path, model_dir, feed, ["one", "tp2sp", "cp2"], ["--tree-token-budget", "24"])
    assert steps["one"][0]["grad_norm"] > 0
    assert_same_as_one_rank(steps, ["tp2sp", "cp2"])


def test_granite_4_h_mamba_layers_train_the_same_under_tensor_context_and_pipeline_parallelism(tmp_path):
    """Granite 4.0-H's layout (a Mamba-2 layer of 2 groups before a NoPE attention layer, experts and the shared MLP
    in both): TP = 2 with sequence parallelism (each rank one group's heads, projection rows and convolution
    channels), CP = 2 (each rank the whole tree for one group: the recurrence needs whole paths) and PP = 2 (the
    Mamba-2 layer on the first stage) train the same two steps as one rank, routing replayed."""
    model_dir = build_tiny_model(str(tmp_path / "granite_4_h"), arch="granitemoehybrid_mamba", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 6), routing=(2, 4, 2))  # noqa
    runs = ["tp2sp", "cp2", "pp2"]
    steps = run_layouts(tmp_path, model_dir, feed, ["one"] + runs, ["--routing-replay", "--tree-token-budget", "24"])
    assert steps["one"][0]["grad_norm"] > 0
    assert_same_as_one_rank(steps, runs, REPLAY_KEYS)
