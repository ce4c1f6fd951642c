"""Uneven pipeline stages (--decoder-first/last-pipeline-num-layers, Megatron-LM's flags: DeepSeek-V3's and Kimi-K2's
61 layers split no other way) through the trainer as real processes against a real forge-pool process. CPU, gloo."""

import numpy as np
import torch

from forge_megatron.models.tiny import build_tiny_model

from .pool_feed import feed_groups
from .trainer_run import REPLAY_KEYS, assert_same_as_one_rank, run_on_fresh_pool


def _exported(tmp_path, name):
    from safetensors.torch import load_file

    from forge_megatron.convert.trainer_checkpoint import export_trainer_checkpoint

    export_trainer_checkpoint(str(tmp_path / name / "ckpt"), str(tmp_path / f"{name}_hf"), iteration=2)
    return {k: v for f in sorted((tmp_path / f"{name}_hf").glob("*.safetensors")) for k, v in load_file(f).items()}


def test_uneven_pipeline_stages_train_save_resume_and_export_like_one_rank(tmp_path):
    """A 3-layer DeepSeek-V3-layout model (dense layer 0, MoE layers 1 and 2, multi-latent attention) with routing
    replay: PP = 2 with the last stage holding one layer (stage 0: layers 0-1), saved after iteration 2, resumed under
    PP = 2 with the *first* stage holding one layer (the checkpoint is resharded: its stages hold other layers) and
    trained to iteration 4: all four steps equal the one-rank run's. The uneven checkpoint exports the same HF
    weights as the one-rank run's checkpoint of the same iteration."""
    model_dir = build_tiny_model(str(tmp_path / "ds3"), arch="deepseek_v3", seed=4, num_hidden_layers=3)
    feed = lambda c: feed_groups(c, 4, np.random.default_rng(9), completion_len=(4, 5), routing=(3, 4, 2))  # noqa
    extra = ["--routing-replay", "--tree-token-budget", "18"]
    pp2 = ["--pipeline-model-parallel-size", "2"]
    steps = {}
    steps["one"], _, _ = run_on_fresh_pool(tmp_path, "one", model_dir, feed, iters=4, groups=1, extra=extra, model=[])
    steps["uneven"], stdouts, counts = run_on_fresh_pool(
        tmp_path, "uneven", model_dir, feed, iters=4, groups=1, extra=extra, model=[],
        exits=[(2, pp2 + ["--decoder-last-pipeline-num-layers", "1"], 2),
               (None, pp2 + ["--decoder-first-pipeline-num-layers", "1"], 2)])
    assert counts == [2, 4]
    assert "saved under another parallel layout (first None -> 1, last 1 -> None)" in stdouts[1]
    assert_same_as_one_rank(steps, ("uneven",), REPLAY_KEYS)
    assert steps["one"][0]["grad_norm"] > 0 and steps["one"][0]["routing_replayed_rows"] > 0
    # the first run's stage 0 held layers 0 and 1 (local numbers), its stage 1 layer 2 (local 0)
    for rank, local in ((0, {"0", "1"}), (1, {"0"})):
        state = torch.load(tmp_path / "uneven" / "ckpt" / "iter_0000002" / f"rank_{rank:05d}.pt",
                           weights_only=False)["model"]
        assert {k.split(".")[2] for k in state if k.startswith("decoder.layers.")} == local
    one, uneven = _exported(tmp_path, "one"), _exported(tmp_path, "uneven")
    assert set(one) == set(uneven)
    for k, v in one.items():  # the same two steps, trained in another reduction order
        torch.testing.assert_close(uneven[k], v, rtol=1e-4, atol=1e-5, msg=k)


def test_uneven_stages_with_the_interleaved_pipeline_train_like_one_rank(tmp_path):
    """PP = 2 x VPP = 2 with the first stage holding 2 of 6 layers: rank 0's chunks hold layers 0 and 3, rank 1's
    layers 1-2 and 4-5 (Megatron's interleaved uneven layout); the two steps equal one rank's."""
    model_dir = build_tiny_model(str(tmp_path / "six"), arch="qwen3", seed=5, num_hidden_layers=6)
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(3), completion_len=(4, 8))  # noqa: E731
    steps = {}
    for name, extra, nproc in (("one", [], 1),
                               ("vpp", ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank",
                                        "2", "--decoder-first-pipeline-num-layers", "2"], 2)):
        steps[name], _, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1, nproc=nproc,
                                              extra=extra + ["--tree-token-budget", "24"], model=[])
    assert_same_as_one_rank(steps, ("vpp",))
    assert all(s["micro_batches"] % 2 == 0 for s in steps["vpp"])
    state = torch.load(tmp_path / "vpp" / "ckpt" / "iter_0000002" / "rank_00001.pt", weights_only=False)
    assert [len({k.split(".")[2] for k in chunk if k.startswith("decoder.layers.")})
            for chunk in state["model_chunks"]] == [2, 2]
