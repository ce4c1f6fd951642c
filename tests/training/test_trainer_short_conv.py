"""The trainer on LFM2's layout, as a real process against a real forge-pool process: a gated short-convolution layer
(y = C * conv(B * x), three taps along each token's ancestors) before an attention layer with per-head q/k norms. One
rank, TP = 2 with sequence parallelism (each rank half the channels), CP = 2 (each rank every token of half the
channels) and PP = 2 train the same two steps. CPU, 0 GPUs (gloo)."""

import numpy as np

from forge_megatron.models.tiny import build_tiny_model

from .pool_feed import feed_groups
from .trainer_run import assert_same_as_one_rank, run_on_fresh_pool


def test_lfm2_short_convolutions_train_the_same_under_tensor_context_and_pipeline_parallelism(tmp_path):
    model_dir = build_tiny_model(str(tmp_path / "lfm2"), arch="lfm2", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 6))  # noqa: E731
    steps = {}
    layouts = [("one", [], 1), ("tp2sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
               ("cp2", ["--context-parallel-size", "2"], 2), ("pp2", ["--pipeline-model-parallel-size", "2"], 2)]
    for name, extra, nproc in layouts:
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1, nproc=nproc,
                                              extra=extra + ["--tree-token-budget", "24"], model=[])
    assert [len(v) for v in steps.values()] == [2] * len(layouts)
    assert steps["one"][0]["grad_norm"] > 0
    assert_same_as_one_rank(steps, [name for name, _, _ in layouts[1:]])
