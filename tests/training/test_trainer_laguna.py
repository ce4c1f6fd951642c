"""The trainer on Laguna's layout, as a real process against a real forge-pool process: a sliding-window layer (4 query
heads, a dense MLP), a full-attention layer (8 query heads, RoPE over half of each head), a window again (4 heads), a
softplus gate per head, experts under a sigmoid router beside a shared expert. One rank, TP = 2 with sequence
parallelism (each rank half of each layer's own heads and gates), CP = 2 and PP = 2 (the first stage one layer)
train the same two steps, routing replayed. CPU, 0 GPUs (gloo)."""

import numpy as np

from forge_megatron.models.tiny import build_tiny_model

from .pool_feed import feed_groups
from .trainer_run import REPLAY_KEYS, assert_same_as_one_rank, run_on_fresh_pool


def test_laguna_per_layer_heads_train_the_same_under_parallelism(tmp_path):
    model_dir = build_tiny_model(str(tmp_path / "laguna"), arch="laguna", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 6), routing=(3, 4, 2))  # noqa
    layouts = [("one", []), ("tp2sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
               ("cp2", ["--context-parallel-size", "2"]),
               ("pp2first1", ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"])]
    steps = {}
    for name, extra in layouts:
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1,
                                              nproc=1 if name == "one" else 2,
                                              extra=extra + ["--routing-replay", "--tree-token-budget", "24"], model=[])
    assert [len(v) for v in steps.values()] == [2] * len(layouts)
    assert steps["one"][0]["grad_norm"] > 0
    assert_same_as_one_rank(steps, [name for name, _ in layouts[1:]], REPLAY_KEYS)
