"""The trainer on Nemotron 3 Nano's layout, as a real process against a real forge-pool process: layers of one
sublayer each behind their own norm (a Mamba-2 mixer, squared-ReLU experts beside a shared one, NoPE attention,
experts again; Megatron's identities for each layer's other half). One rank, TP = 2 with sequence parallelism (each
rank one Mamba-2 group), CP = 2 (the recurrence on whole paths, one group per rank), PP = 2 (two one-sublayer layers
per stage) and EP = 2 train the same two steps, routing replayed. CPU, 0 GPUs (gloo)."""

import numpy as np

from forge_megatron.models.tiny import build_tiny_model

from .pool_feed import feed_groups
from .trainer_run import REPLAY_KEYS, assert_same_as_one_rank, run_layouts


def test_nemotron_h_moe_trains_the_same_under_tensor_context_pipeline_and_expert_parallelism(tmp_path):
    model_dir = build_tiny_model(str(tmp_path / "nemotron_h_moe"), arch="nemotron_h_moe", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 6), routing=(4, 4, 2))  # noqa
    runs = ["tp2sp", "cp2", "pp2", "ep2"]
    steps = run_layouts(tmp_path, model_dir, feed, ["one"] + runs, ["--routing-replay", "--tree-token-budget", "24"])
    assert steps["one"][0]["grad_norm"] > 0 and all(s["routing_replayed_rows"] > 0 for s in steps["one"])
    assert_same_as_one_rank(steps, runs, REPLAY_KEYS)


def test_nemotron_3_super_latent_moe_trains_the_same_under_tensor_and_expert_parallelism(tmp_path):
    """Nemotron 3 Super / Ultra's LatentMoE: the routed experts between a down and an up projection that every TP
    rank holds whole. Under TP = 2 with sequence parallelism each rank projects its own tokens, so the projections'
    gradients are summed over TP (without the sum the steps differ from one rank's); EP = 2 splits the latent
    experts; both train the same two steps as one rank, routing replayed."""
    model_dir = build_tiny_model(str(tmp_path / "nemotron_h_latent"), arch="nemotron_h_latent", seed=3)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(6), completion_len=(4, 6), routing=(4, 4, 2))  # noqa
    runs = ["tp2sp", "ep2"]
    steps = run_layouts(tmp_path, model_dir, feed, ["one"] + runs, ["--routing-replay", "--tree-token-budget", "24"])
    assert steps["one"][0]["grad_norm"] > 0 and all(s["routing_replayed_rows"] > 0 for s in steps["one"])
    assert_same_as_one_rank(steps, runs, REPLAY_KEYS)
