"""The trainer on Apertus's layout, as a real process against a real forge-pool process: a plain MLP whose xIELU
activation has two trained scalars per layer: one rank, TP = 2 with sequence parallelism, TP = 2 without it, CP = 2
and PP = 2 train the same two steps. (Adam's first steps move a scalar alike whether its gradient is whole or a TP
rank's part of it: the scalars' gradients themselves are checked against transformers' in tests/mcore/test_xielu.py.)
CPU, 0 GPUs (gloo)."""

import numpy as np

from forge_megatron.models.tiny import build_tiny_model

from .pool_feed import feed_groups
from .trainer_run import LAYOUTS, assert_same_as_one_rank, run_layouts


def test_apertus_xielu_scalars_train_the_same_under_tensor_context_and_pipeline_parallelism(tmp_path, monkeypatch):
    monkeypatch.setitem(LAYOUTS, "tp2", (["--tensor-model-parallel-size", "2"], 2))
    model_dir = build_tiny_model(str(tmp_path / "apertus"), arch="apertus", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 6))  # noqa
    runs = ["tp2sp", "tp2", "cp2", "pp2"]
    steps = run_layouts(tmp_path, model_dir, feed, ["one"] + runs, ["--tree-token-budget", "24"])
    assert steps["one"][0]["grad_norm"] > 0
    assert_same_as_one_rank(steps, runs)
