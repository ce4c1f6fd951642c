"""The trainer on the DeepSeek-V3.2 layout (DeepSeek sparse attention: each token deeper than 4 attends to the 4 keys
its indexer picks among its ancestors; mcore/dsa.py), as a real process against a real forge-pool process. Under
TP = 2 with sequence parallelism every rank gathers the sequence for its replicated indexer and attends over its own
heads; under PP = 2 each stage holds one layer; with EP = 2 the experts split; under CP = 2 each rank's queries
(zig-zag chunks of the tree) select among the all-gathered keys; with whole layers recomputed the indexer selects
again in the backward pass. All train the same two steps as one rank. CPU, gloo."""

import numpy as np

from forge_megatron.models.tiny import build_tiny_model

from .pool_feed import feed_groups
from .trainer_run import assert_same_as_one_rank, run_on_fresh_pool


def test_sparse_attention_trains_the_same_under_tensor_pipeline_and_expert_parallelism(tmp_path):
    model_dir = build_tiny_model(str(tmp_path / "dsv32"), arch="deepseek_v32", seed=3)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(6), completion_len=(4, 6))  # noqa: E731
    layouts = [("one", [], 1), ("tp2sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
               ("pp2", ["--pipeline-model-parallel-size", "2"], 2), ("ep2", ["--expert-model-parallel-size", "2"], 2),
               ("cp2", ["--context-parallel-size", "2"], 2),
               # whole layers recomputed in the backward pass: the indexer runs again on the same micro-batch
               ("recompute", ["--recompute-granularity", "full", "--recompute-method", "uniform",
                              "--recompute-num-layers", "1"], 1)]
    steps = {}
    for name, extra, nproc in layouts:
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1, nproc=nproc,
                                              extra=extra + ["--tree-token-budget", "40"], model=[])
    assert [len(v) for v in steps.values()] == [2] * len(layouts)
    assert steps["one"][0]["grad_norm"] > 0
    assert_same_as_one_rank(steps, ["tp2sp", "pp2", "ep2", "cp2", "recompute"])


def test_indexer_loss_trains_the_indexer_the_same_under_tensor_parallelism(tmp_path):
    """--dsa-indexer-loss-coeff: the indexer trains on its KL to the main attention (summed over every TP rank's
    heads), reported as dsa_indexer_kl; under TP = 2 with sequence parallelism the loss and the gradient norm (the
    indexer's gradients included) equal one rank's, and the indexer's gradients really count (the gradient norm
    exceeds the frozen indexer's run on the same data). Under CP = 2 the deep rows are split between the ranks: each
    attaches its share of the mean over all of them, and the step equals one rank's too."""
    model_dir = build_tiny_model(str(tmp_path / "dsv32"), arch="deepseek_v32", seed=3)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(6), completion_len=(4, 6))  # noqa: E731
    coeff = ["--dsa-indexer-loss-coeff", "100"]  # the tiny indexer's KL gradients are ~1e-3: make them count
    layouts = [("frozen", [], 1), ("one", coeff, 1),
               ("tp2sp", coeff + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
               ("cp2", coeff + ["--context-parallel-size", "2"], 2)]
    steps = {}
    for name, extra, nproc in layouts:
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1, nproc=nproc,
                                              extra=extra + ["--tree-token-budget", "40"], model=[])
    assert "dsa_indexer_kl" not in steps["frozen"][0]
    assert_same_as_one_rank(steps, ["tp2sp", "cp2"], keys=("loss", "grad_norm", "dsa_indexer_kl"))
    first = steps["one"][0]
    assert first["dsa_indexer_kl"] > 0 and first["loss"] == steps["frozen"][0]["loss"]  # the policy loss alone
    assert first["grad_norm"] > steps["frozen"][0]["grad_norm"] * 1.001  # without the indexer's share: ~1e-6


def test_glm5_shared_indexer_layers_train_the_same_under_context_parallelism(tmp_path):
    """GLM-5's layout (layer 1 reuses layer 0's selection): under CP = 2 each rank's layer 1 takes the selection its
    layer 0 made for the same local queries; the steps equal one rank's."""
    model_dir = build_tiny_model(str(tmp_path / "glm5"), arch="glm_moe_dsa", seed=4)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(7), completion_len=(4, 6))  # noqa: E731
    steps = {}
    for name, extra, nproc in (("one", [], 1), ("cp2", ["--context-parallel-size", "2"], 2)):
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1, nproc=nproc,
                                              extra=extra + ["--tree-token-budget", "40"], model=[])
    assert steps["one"][0]["grad_norm"] > 0
    assert_same_as_one_rank(steps, ["cp2"])
