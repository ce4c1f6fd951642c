"""The trainer on MiniMax-M1's and Laguna's layouts, as real processes against a real forge-pool process, routing
replayed; each layout trains the same two steps as one rank. CPU, 0 GPUs (gloo).

MiniMax-M1: two lightning-attention layers (linear attention with a fixed decay per head, along each token's ancestors
in the tree) before a softmax one, experts under a softmax router, residuals taken from the norms' outputs and scaled.
TP = 2 with sequence parallelism (each rank half the lightning heads, their output norm over all heads by an
all-reduce; the residuals the norms' [s / 2] slices) and CP = 2 (each rank every token of half the heads). (Under PP a
lightning layer's decay comes from its global layer number, which Megatron hands every stage's layers, as the TP2 x
PP2 round trip and the logits equal to transformers' check.)

Laguna: a sliding-window layer (4 query heads, a dense MLP), a full-attention layer (8 query heads, RoPE over half of
each head), a window again (4 heads), a softplus gate per head, experts under a sigmoid router beside a shared expert.
TP = 2 with sequence parallelism (each rank half of each layer's own heads and gates), CP = 2 and PP = 2 (the first
stage one layer)."""

import numpy as np
import pytest

from forge_megatron.models.tiny import build_tiny_model

from .pool_feed import feed_groups
from .trainer_run import REPLAY_KEYS, assert_same_as_one_rank, run_on_fresh_pool

TP2SP = ("tp2sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"])
CP2 = ("cp2", ["--context-parallel-size", "2"])
LAYOUTS = {
    "minimax01": [TP2SP, CP2],
    "laguna": [TP2SP, CP2, ("pp2first1", ["--pipeline-model-parallel-size", "2",
                                          "--decoder-first-pipeline-num-layers", "1"])],
}


@pytest.mark.parametrize("arch", sorted(LAYOUTS))
def test_minimax01_and_laguna_train_the_same_under_parallelism(tmp_path, arch):
    model_dir = build_tiny_model(str(tmp_path / arch), arch=arch, seed=2)
    # (three layers, 4 experts, top 2: each token's routed experts per layer, replayed)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 6), routing=(3, 4, 2))  # noqa
    layouts = [("one", [])] + LAYOUTS[arch]
    steps = {}
    for name, extra in layouts:
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1,
                                              nproc=1 if name == "one" else 2,
                                              extra=extra + ["--routing-replay", "--tree-token-budget", "24"], model=[])
    assert [len(v) for v in steps.values()] == [2] * len(layouts)
    assert steps["one"][0]["grad_norm"] > 0
    assert_same_as_one_rank(steps, [name for name, _ in layouts[1:]], REPLAY_KEYS)
