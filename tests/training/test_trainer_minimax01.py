"""The trainer on MiniMax-M1's layout, as a real process against a real forge-pool process: two lightning-attention
layers (linear attention with a fixed decay per head, along each token's ancestors in the tree) before a softmax one,
every layer's experts under a softmax router, residuals taken from the norms' outputs and scaled. One rank, TP = 2
with sequence parallelism (each rank half the lightning heads, their output norm over all heads by an all-reduce; the
residuals the norms' [s / 2] slices) and CP = 2 (each rank every token of half the heads) train the same two steps,
routing replayed. (Under PP a lightning layer's decay comes from its global layer number, which Megatron hands every
stage's layers, as the TP2 x PP2 round trip and the logits equal to transformers' check.) CPU, 0 GPUs (gloo)."""

import numpy as np

from forge_megatron.models.tiny import build_tiny_model

from .pool_feed import feed_groups
from .trainer_run import REPLAY_KEYS, assert_same_as_one_rank, run_on_fresh_pool


def test_minimax01_lightning_layers_train_the_same_under_parallelism(tmp_path):
    model_dir = build_tiny_model(str(tmp_path / "minimax01"), arch="minimax01", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 6), routing=(3, 4, 2))  # noqa
    layouts = [("one", []), ("tp2sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
               ("cp2", ["--context-parallel-size", "2"])]
    steps = {}
    for name, extra in layouts:
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1,
                                              nproc=1 if name == "one" else 2,
                                              extra=extra + ["--routing-replay", "--tree-token-budget", "24"], model=[])
    assert [len(v) for v in steps.values()] == [2] * len(layouts)
    assert steps["one"][0]["grad_norm"] > 0
    assert_same_as_one_rank(steps, [name for name, _ in layouts[1:]], REPLAY_KEYS)
