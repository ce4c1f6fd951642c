"""The trainer on the DeepSeek-V3.2 layout (DeepSeek sparse attention: each token deeper than 4 attends to the 4 keys
its indexer picks among its ancestors; mcore/dsa.py), as a real process against a real forge-pool process. Under
TP = 2 with sequence parallelism every rank gathers the sequence for its replicated indexer and attends over its own
heads; under PP = 2 each stage holds one layer; with EP = 2 the experts split; with whole layers recomputed the
indexer selects again in the backward pass. All train the same two steps as one rank. CPU, gloo."""

import numpy as np

from forge_megatron.models.tiny import build_tiny_model

from .pool_feed import feed_groups
from .trainer_run import assert_same_as_one_rank, run_on_fresh_pool


def test_sparse_attention_trains_the_same_under_tensor_pipeline_and_expert_parallelism(tmp_path):
    model_dir = build_tiny_model(str(tmp_path / "dsv32"), arch="deepseek_v32", seed=3)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(6), completion_len=(4, 6))  # noqa: E731
    layouts = [("one", [], 1), ("tp2sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
               ("pp2", ["--pipeline-model-parallel-size", "2"], 2), ("ep2", ["--expert-model-parallel-size", "2"], 2),
               # whole layers recomputed in the backward pass: the indexer runs again on the same micro-batch
               ("recompute", ["--recompute-granularity", "full", "--recompute-method", "uniform",
                              "--recompute-num-layers", "1"], 1)]
    steps = {}
    for name, extra, nproc in layouts:
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1, nproc=nproc,
                                              extra=extra + ["--tree-token-budget", "40"], model=[])
    assert [len(v) for v in steps.values()] == [2] * len(layouts)
    assert steps["one"][0]["grad_norm"] > 0
    assert_same_as_one_rank(steps, ["tp2sp", "pp2", "ep2", "recompute"])
