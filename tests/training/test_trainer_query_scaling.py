"""The trainer on the Ministral 3 layout (YaRN, and queries scaled by 1 + beta * log(1 + floor(p / 4)) past position
4: rope.scale_queries), as a real process against a real forge-pool process. Under TP = 2 with sequence parallelism
each rank scales its own query groups of the gathered sequence; under CP = 2 each rank's zig-zag shard of the tree
reads its tokens' depths off its slice of the rotary table. Both train the same two steps as one rank. CPU, gloo."""

import numpy as np

from forge_megatron.models.tiny import build_tiny_model

from .pool_feed import feed_groups
from .trainer_run import assert_same_as_one_rank, run_on_fresh_pool


TP2SP = ("tp2sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2)
CP2 = ("cp2", ["--context-parallel-size", "2"], 2)


def _same_as_one_rank(tmp_path, arch: str, seed: int, layouts) -> None:
    """Train two steps of the tiny ``arch`` model on one rank and under each of ``layouts`` (name, flags, processes):
    every layout's steps equal one rank's."""
    model_dir = build_tiny_model(str(tmp_path / arch), arch=arch, seed=seed)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(seed + 3), completion_len=(4, 6))  # noqa: E731
    steps = {}
    for name, extra, nproc in [("one", [], 1), *layouts]:
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1, nproc=nproc,
                                              extra=extra + ["--tree-token-budget", "24"], model=[])
    assert [len(v) for v in steps.values()] == [2] * (len(layouts) + 1)
    assert steps["one"][0]["grad_norm"] > 0
    assert_same_as_one_rank(steps, [name for name, _, _ in layouts])


def test_query_scaling_trains_the_same_under_tensor_and_context_parallelism(tmp_path):
    _same_as_one_rank(tmp_path, "ministral3", 2, [TP2SP, CP2])


def test_mistral4_trains_the_same_under_tensor_expert_and_context_parallelism(tmp_path):
    """Mistral Small 4's layout (multi-latent attention whose queries are scaled by depth on the query projection's
    output, a softmax router, stacked experts) as released, inside Mistral3ForConditionalGeneration: TP = 2 with
    sequence parallelism (each rank scales its heads of the gathered sequence), EP = 2 and CP = 2 (each rank's
    tokens scaled by their own depths) train the same two steps as one rank."""
    _same_as_one_rank(tmp_path, "mistral4_vl", 3, [TP2SP, ("ep2", ["--expert-model-parallel-size", "2"], 2), CP2])
