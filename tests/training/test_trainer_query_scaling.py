"""The trainer on the Ministral 3 layout (YaRN, and queries scaled by 1 + beta * log(1 + floor(p / 4)) past position
4: rope.scale_queries), as a real process against a real forge-pool process. Under TP = 2 with sequence parallelism
each rank scales its own query groups of the gathered sequence; under CP = 2 each rank's zig-zag shard of the tree
reads its tokens' depths off its slice of the rotary table. Both train the same two steps as one rank. CPU, gloo."""

import numpy as np

from forge_megatron.models.tiny import build_tiny_model

from .pool_feed import feed_groups
from .trainer_run import assert_same_as_one_rank, run_on_fresh_pool


def test_query_scaling_trains_the_same_under_tensor_and_context_parallelism(tmp_path):
    model_dir = build_tiny_model(str(tmp_path / "ministral3"), arch="ministral3", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 6))  # noqa: E731
    layouts = [("one", [], 1), ("tp2sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
               ("cp2", ["--context-parallel-size", "2"], 2)]
    steps = {}
    for name, extra, nproc in layouts:
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1, nproc=nproc,
                                              extra=extra + ["--tree-token-budget", "24"], model=[])
    assert [len(v) for v in steps.values()] == [2] * len(layouts)
    assert steps["one"][0]["grad_norm"] > 0
    assert_same_as_one_rank(steps, ["tp2sp", "cp2"])


def test_mistral4_trains_the_same_under_tensor_expert_and_context_parallelism(tmp_path):
    """Mistral Small 4's layout (multi-latent attention whose queries are scaled by depth on the query projection's
    output, a softmax router, stacked experts) as released, inside Mistral3ForConditionalGeneration: TP = 2 with
    sequence parallelism (each rank scales its heads of the gathered sequence), EP = 2 and CP = 2 (each rank's
    tokens scaled by their own depths) train the same two steps as one rank."""
    model_dir = build_tiny_model(str(tmp_path / "mistral4_vl"), arch="mistral4_vl", seed=3)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(6), completion_len=(4, 6))  # noqa: E731
    layouts = [("one", [], 1), ("tp2sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
               ("ep2", ["--expert-model-parallel-size", "2"], 2), ("cp2", ["--context-parallel-size", "2"], 2)]
    steps = {}
    for name, extra, nproc in layouts:
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1, nproc=nproc,
                                              extra=extra + ["--tree-token-budget", "24"], model=[])
    assert [len(v) for v in steps.values()] == [2] * len(layouts)
    assert steps["one"][0]["grad_norm"] > 0
    assert_same_as_one_rank(steps, ["tp2sp", "ep2", "cp2"])
