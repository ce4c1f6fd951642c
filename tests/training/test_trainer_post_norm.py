"""The trainer with norms after attention and MLP, as a real process against a real forge-pool process: the OLMo 3
layout (those norms instead of the input ones, q/k norms over all heads, a sliding window on layer 0 with plain RoPE
and YaRN on the full-attention layer 1) and the Gemma 3 layout (those norms as well as the input ones, all scaling by
1 + w, GeGLU, the scaled embedding, a window on layer 0 with its own RoPE base, tied embeddings). One rank, PP = 2
(each stage picks its layers' windows and RoPE by their global numbers; Gemma's tied embedding split over the first
and last stage) and TP = 2 with sequence parallelism (the added norms see each rank's slice of the tokens: their
weight gradients summed over TP), and for OLMo 3 CP = 2, train the same two steps. The Gemma 4 layout too (plain-weight
sandwich norms; a global layer with its own head size and key heads, values that are its keys, proportional RoPE from
its own table of the positions it is handed, also under CP = 2; normed values; layer scalars; soft-capped logits).
The Gemma 2 layout (soft-capped attention scores and logits) under TP = 2 and CP = 2 (each rank's heads capped in
the all-to-all mode). CPU, 0 GPUs (gloo)."""

import numpy as np
import pytest

from forge_megatron.models.tiny import build_tiny_model

from .pool_feed import feed_groups
from .trainer_run import REPLAY_KEYS, assert_same_as_one_rank, run_layouts


@pytest.mark.parametrize("arch", ["olmo3", "gemma3", "gemma4", "gemma2", "flex_olmo"])
def test_post_norm_layers_train_the_same_under_pipeline_and_tensor_parallelism(tmp_path, arch):
    model_dir = build_tiny_model(str(tmp_path / arch), arch=arch, seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 6))  # noqa: E731
    # (Gemma 2: Gemma 3's layer but for its soft caps, so PP as Gemma 3's; each TP rank caps its heads)
    runs = ["tp2sp"] if arch == "gemma2" else ["tp2sp", "ep2"] if arch == "flex_olmo" else ["pp2", "tp2sp"]
    # (FlexOlmo: the norm after each MoE layer normalises its experts' output, gathered back from the EP ranks)
    if arch in ("olmo3", "gemma4", "gemma2"):  # each CP rank's zig-zag shard of the tree: windows, and each layer's
        runs.append("cp2")  # RoPE from the whole table
    steps = run_layouts(tmp_path, model_dir, feed, ["one"] + runs, ["--tree-token-budget", "24"])
    assert steps["one"][0]["grad_norm"] > 0
    if arch != "gemma4":
        assert_same_as_one_rank(steps, runs)
        return
    assert_gemma4_steps_match(steps, runs)


def assert_gemma4_steps_match(steps: dict, runs, keys=("loss", "grad_norm"), data_parallel=("ep2",)) -> None:
    """The first step equal to fp32 reduction order (as every other layout's), the second within 1e-4 absolute on
    the loss (~1e-2, a sum of O(1) terms that nearly cancel) and 1e-3 relative on the gradient norm. Gemma 4's
    normed queries, keys and values leave directions whose gradient is zero but for rounding (and its per-layer table
    rows barely used): Adam's first update moves every element by about the learning rate whatever its gradient, so a
    few such elements step with different signs on one rank and on two (at most 7e-4 of 1e-3 apart after the second
    step, a few elements of thousands; the TP ranks' replicated weights stay identical), which the second step sees."""
    assert_same_as_one_rank({name: s[:1] for name, s in steps.items()}, runs, keys, data_parallel)
    for name in runs:
        a, b = steps["one"][1], steps[name][1]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3), name
        if name not in data_parallel:  # (EP = 2 runs as DP = 2: its loss is rank 0's share)
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-4), name


def test_gemma4_moe_block_trains_the_same_under_tensor_expert_and_pipeline_parallelism(tmp_path):
    """The Gemma 4 26B-A4B layout (routed experts beside the dense MLP in every layer, each branch with its own
    norms, the router on the un-normalised input with its own input scale and per-expert scales) with routing replay:
    TP = 2 with sequence parallelism (the branches' norms and the router's scales replicated, their gradients summed
    over TP), EP = 2 and PP = 2 train as one rank (assert_gemma4_steps_match); both MoE layers replay their rows."""
    model_dir = build_tiny_model(str(tmp_path / "gemma4_moe"), arch="gemma4_moe", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 5), routing=(2, 4, 2))  # noqa
    runs = ["tp2sp", "ep2", "pp2"]
    steps = run_layouts(tmp_path, model_dir, feed, ["one"] + runs, ["--routing-replay", "--tree-token-budget", "18"])
    assert_gemma4_steps_match(steps, runs, REPLAY_KEYS)
    assert steps["one"][0]["grad_norm"] > 0 and 0 < steps["one"][0]["routing_mismatch"] < 1
    assert all(s["routing_replayed_rows"] > 0 for s in steps["one"])


def test_gemma4_per_layer_inputs_and_shared_kv_train_the_same_under_tensor_and_context_parallelism(tmp_path):
    """The Gemma 4 E2B / E4B layout (per-layer inputs from their own table, replicated: under sequence parallelism
    each rank makes its own tokens' and the gradients are summed over TP; the last two layers reusing the first two's
    keys and values, with double-wide MLPs): TP = 2 with SP and CP = 2 (the consumers attend to the producers' keys
    of this rank's zig-zag shard) train as one rank (assert_gemma4_steps_match)."""
    model_dir = build_tiny_model(str(tmp_path / "gemma4_e"), arch="gemma4_e", seed=2)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(5), completion_len=(4, 6))  # noqa: E731
    steps = run_layouts(tmp_path, model_dir, feed, ["one", "tp2sp", "cp2"], ["--tree-token-budget", "24"])
    assert steps["one"][0]["grad_norm"] > 0
    assert_gemma4_steps_match(steps, ["tp2sp", "cp2"])
