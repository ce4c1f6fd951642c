"""The trainer on AFMoE's layout (Arcee Trinity), as a real process against a real forge-pool process: sandwich
norms, a sigmoid gate on every attention channel from its own projection (Megatron's gated attention: per query
group its queries, their gates, the key and the value in one projection), window layers that rotate beside a NoPE
full one, a dense first layer, then experts under a sigmoid router choosing with its bias, renormalised and scaled,
beside a shared expert. One rank, TP = 2 with sequence parallelism, CP = 2 and EP = 2 train the same two steps,
routing replayed. CPU, 0 GPUs (gloo)."""

import numpy as np

from forge_megatron.models.tiny import build_tiny_model

from .pool_feed import feed_groups
from .trainer_run import REPLAY_KEYS, assert_same_as_one_rank, run_layouts


def test_afmoe_trains_the_same_under_tensor_context_and_expert_parallelism(tmp_path):
    model_dir = build_tiny_model(str(tmp_path / "afmoe"), arch="afmoe", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 6), routing=(3, 4, 2))  # noqa
    runs = ["tp2sp", "cp2", "ep2"]
    steps = run_layouts(tmp_path, model_dir, feed, ["one"] + runs, ["--routing-replay", "--tree-token-budget", "24"])
    assert steps["one"][0]["grad_norm"] > 0 and all(s["routing_replayed_rows"] > 0 for s in steps["one"])
    assert_same_as_one_rank(steps, runs, REPLAY_KEYS)
