"""Megatron's distributed optimizer (``--use-distributed-optimizer``: fp32 masters and Adam moments sharded over the
data-parallel ranks) and ``--bf16`` on CPU (gloo): checkpoints resume in the layout they were saved in, in another
layout, and with or without the distributed optimizer, exactly as the run would have continued. Trainer processes
against a forge-pool process; 2 ranks."""

import re

import numpy as np
import pytest
import torch

from forge_megatron.convert.trainer_checkpoint import model_chunks
from forge_megatron.models.tiny import build_tiny_model

from .pool_feed import feed_groups
from .trainer_run import run_on_fresh_pool

DIST = ["--use-distributed-optimizer"]
TP2 = ["--tensor-model-parallel-size", "2"]
OVERLAP = ["--overlap-grad-reduce", "--ddp-bucket-size", "20000"]  # several buckets of the 125k-parameter model


def _feed(iters):
    return lambda c: feed_groups(c, iters, np.random.default_rng(11), completion_len=(5, 9))


def test_distributed_optimizer_checkpoints_resume_in_any_layout_and_with_either_optimizer(tmp_path):
    """Five steps under DP = 2 with the plain optimizer, straight, against one run stopped and resumed after each of
    its first three steps: DP = 2 with the distributed optimizer (its state gathered by parameter name on each
    data-parallel group's rank 0), the same again (each rank takes its slice back), TP = 2 with the plain optimizer
    (resharded from the holders' files), DP = 2 with the distributed optimizer (resharded into slices). A resume's
    weights show in the next step, its Adam moments and step count in the one after (its update): the gradient norms
    of steps 2-5 must be the straight run's, to fp32 round-off (TP sums in another order). The second and last
    stages reduce the gradients bucket by bucket during the backward (--overlap-grad-reduce): the same sums."""
    model_dir = build_tiny_model(str(tmp_path / "model"))
    straight, _, _ = run_on_fresh_pool(tmp_path, "straight", model_dir, _feed(5), iters=5, groups=1, nproc=2)
    moved, stdouts, counts = run_on_fresh_pool(
        tmp_path, "moved", model_dir, _feed(5), iters=5, groups=1,
        exits=[(1, DIST, 2), (2, DIST + OVERLAP, 2), (3, TP2, 2), (None, DIST + OVERLAP, 2)])
    assert counts == [1, 2, 3, 5]
    buckets = re.search(r"--overlap-grad-reduce: (\d+) gradient bucket\(s\) on rank 0", stdouts[1])
    assert buckets and int(buckets.group(1)) > 1
    assert "resharding" not in stdouts[1]  # the same layout and optimizer: each rank reads its slices
    assert "was saved under another parallel layout (tp 1 -> 2, dp 2 -> 1, etp 1 -> 2)" in stdouts[2]
    assert "was saved under another parallel layout (tp 2 -> 1, dp 1 -> 2, etp 2 -> 1)" in stdouts[3]
    assert [s["batch_id"] for s in moved] == [s["batch_id"] for s in straight]
    for a, b in zip(straight, moved):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-6), (a["step"], a["grad_norm"], b["grad_norm"])
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-9)
        if a["step"] != 3:  # under DP = 2 (step 3 ran under TP = 2): rank 0's share of the loss, the same episodes
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7), a["step"]
    # the checkpoint after step 1 holds the distributed optimizer's state once, on data-parallel rank 0
    saved = [torch.load(tmp_path / "moved" / "ckpt" / "iter_0000002" / f"rank_{r:05d}.pt", weights_only=False)
             for r in (0, 1)]
    assert saved[0]["sharded_optimizer"] and len(saved[0]["param_states"]) > 0 and saved[1]["param_states"] == {}
    for name, weight in model_chunks(saved[0])[0].items():
        if name.endswith("linear_qkv.weight"):
            entry = saved[0]["param_states"][f"0:{name}"]
            assert entry["exp_avg"].shape == weight.shape and entry["exp_avg_sq"].min() > 0
            assert float(entry["step"]) == 2


def test_bf16_with_the_distributed_optimizer_resumes_like_an_uninterrupted_run(tmp_path):
    """--bf16 --use-distributed-optimizer (the slurm scripts' settings) under DP = 2: the fp32 masters of the bf16
    weights are sharded with the moments (the fp32 norm weights in the same parameter groups as bf16 weights); four steps straight vs a stop after step 2 and a resume: steps 3 and 4 match (lost masters or moments
    show in step 4). The same episodes reach the same ranks in both runs, so they agree to the last bit."""
    model_dir = build_tiny_model(str(tmp_path / "model"))
    extra = ["--bf16", *DIST]
    straight, _, _ = run_on_fresh_pool(tmp_path, "straight", model_dir, _feed(4), iters=4, groups=1, nproc=2,
                                       extra=extra)
    resumed, _, counts = run_on_fresh_pool(tmp_path, "resumed", model_dir, _feed(4), iters=4, groups=1, nproc=2,
                                           extra=extra, exits=(2, None))
    assert counts == [2, 4]
    for a, b in zip(straight, resumed):
        assert (b["loss"], b["grad_norm"]) == pytest.approx((a["loss"], a["grad_norm"]), rel=1e-6, abs=1e-7), a["step"]
    saved = torch.load(tmp_path / "resumed" / "ckpt" / "iter_0000002" / "rank_00000.pt", weights_only=False)
    masters = [k for k, e in saved["param_states"].items() if "main" in e]
    assert masters and all(saved["param_states"][k]["main"].dtype == torch.float32 for k in masters)
    assert any("main" not in e for e in saved["param_states"].values())  # fp32 parameters are their own masters


def test_a_run_resumes_in_another_precision(tmp_path):
    """fp32 -> --bf16 -> fp32, one step each: the bf16 optimizer's fp32 masters come from the fp32 run's weights, the
    fp32 run's weights from the bf16 run's masters (not its rounded bf16 weights), the moments travel as they are.
    Against the straight fp32 run the steps differ by bf16 rounding only (a lost state would show far more)."""
    model_dir = build_tiny_model(str(tmp_path / "model"))
    straight, _, _ = run_on_fresh_pool(tmp_path, "straight", model_dir, _feed(4), iters=4, groups=1)
    switched, stdouts, counts = run_on_fresh_pool(tmp_path, "switched", model_dir, _feed(4), iters=4, groups=1,
                                                  exits=[(1, (), 1), (2, ["--bf16"], 1), (None, (), 1)])
    assert counts == [1, 2, 4]
    assert "saved with another optimizer or precision (weights fp32 -> half)" in stdouts[1]
    assert "saved with another optimizer or precision (weights half -> fp32)" in stdouts[2]
    for a, b in zip(straight, switched):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-3), a["step"]
        assert b["loss"] == pytest.approx(a["loss"], abs=2e-3), a["step"]


def test_bf16_first_step_keeps_the_hf_weights(tmp_path):
    """--bf16: Megatron's optimizer keeps fp32 master weights made when it is built; after loading the HF checkpoint
    they must be refreshed, or the first step writes Megatron's random init back. Same group twice at lr 1e-9: the
    second step (after one update) must score it as the first did (it would not, on re-initialised weights)."""
    model_dir = build_tiny_model(str(tmp_path / "model"))

    def feed(client):
        for _ in range(2):
            feed_groups(client, 1, np.random.default_rng(5))

    first, second = run_on_fresh_pool(tmp_path, "bf16_same", model_dir, feed, iters=2, groups=1, extra=["--bf16"],
                                      lr="1e-9")[0]
    assert second["loss"] == pytest.approx(first["loss"], abs=2e-3)
    assert second["grad_norm"] == pytest.approx(first["grad_norm"], rel=2e-2)


def test_overlap_param_gather_trains_syncs_and_saves_what_the_plain_gather_does(tmp_path):
    """--overlap-param-gather (with --overlap-grad-reduce, several buckets) under DP = 2 with the distributed
    optimizer: after a step each rank holds only its own slice of the new weights until the next forward gathers
    the rest bucket by bucket. Four steps, weights synced to an engine every second step, one checkpoint at the end,
    against the same run (same buckets) gathering right after each step: the same gradient norms (steps 2 and 4 run on weights
    gathered in their forward: stale slices would change them), bit-equal weights synced after step 4 (gathered
    before the sync) and the same checkpoint (gathered before the save)."""
    from safetensors.torch import load_file

    from forge_megatron.rollout.launch import start_engine

    model_dir = build_tiny_model(str(tmp_path / "model"))
    engine = start_engine(model_dir, in_process=True)
    runs = {}
    try:
        for name, extra in (("plain", DIST + OVERLAP), ("overlap", DIST + OVERLAP + ["--overlap-param-gather"])):
            sync = ["--weight-sync-transport", "disk", "--weight-sync-dir", str(tmp_path / f"sync_{name}"),
                    "--engine-urls", engine.url, "--weight-sync-interval", "2", "--save-interval", "4"]
            runs[name] = run_on_fresh_pool(tmp_path, name, model_dir, _feed(4), iters=4, groups=1, nproc=2,
                                           extra=extra + sync)
    finally:
        engine.stop()
    (plain, _, _), (overlap, stdouts, _) = runs["plain"], runs["overlap"]
    groups = re.search(r"--overlap-param-gather: (\d+) parameter bucket group\(s\) on rank 0", stdouts[0])
    assert groups and int(groups.group(1)) > 1
    assert [s["policy_version"] for s in overlap] == [0, 1, 1, 2]
    for a, b in zip(plain, overlap):
        assert b["grad_norm"] == a["grad_norm"] and b["loss"] == a["loss"], a["step"]
    mine, theirs = ({k: v for f in sorted((tmp_path / f"sync_{n}" / "policy_2").glob("*.safetensors"))
                     for k, v in load_file(f).items()} for n in ("overlap", "plain"))  # the newest sync is kept
    assert sorted(mine) == sorted(theirs) and len(theirs) > 20
    for key in theirs:
        assert torch.equal(mine[key], theirs[key]), key
    saved = [torch.load(tmp_path / n / "ckpt" / "iter_0000004" / "rank_00001.pt", weights_only=False)
             for n in ("plain", "overlap")]
    weights = [{k: v for k, v in model_chunks(state)[0].items() if isinstance(v, torch.Tensor)} for state in saved]
    assert sorted(weights[0]) == sorted(weights[1]) and len(weights[0]) > 10
    for key, a in weights[0].items():
        assert torch.equal(a, weights[1][key]), key


@pytest.mark.parametrize("capturable", [False, True])
def test_restored_adam_state_lies_where_the_parameter_does(capturable):
    """Checkpoint files load on the CPU; the restored moments must move to the parameter's device (the first H200 run
    resumed them on the CPU beside CUDA parameters: Adam's foreach kernels refused "cuda:0 and cpu"), and the step
    count stays where torch's Adam keeps it: the CPU, or the device for its capturable and fused forms. A "meta"
    parameter stands in for a GPU one here."""
    from forge_megatron.training.reshard import KINDS, _Row, restore

    q = torch.nn.Parameter(torch.empty(6, device="meta"))
    inner = torch.optim.Adam([q], lr=1e-3, capturable=capturable)
    saved = {k: torch.arange(10, dtype=torch.float64) for k in KINDS}  # a parameter of 10, this rank's slice 2:8
    restore(_Row(0, "w", None, inner, q, q, slice(2, 8)), saved.__getitem__, torch.tensor(3.0))
    state = inner.state[q]
    for k in KINDS:
        assert state[k].device == q.device and state[k].dtype == q.dtype and state[k].shape == q.shape
    assert state["step"].device == (q.device if capturable else torch.device("cpu"))
    if not capturable:  # a meta tensor holds no value to read
        assert float(state["step"]) == 3.0
