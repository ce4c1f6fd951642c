"""The trainer as a real process against a real forge-pool process (ZeroMQ, SQLite): kill -9 mid-run and resume from
the checkpoint with the pool re-serving exactly the uncommitted groups; DP=2 keeps replicas equal; SIGTERM to
torchrun stops both ranks with a checkpoint. CPU, 0 GPUs (gloo). The runs that are not killed or signalled start
their ranks through tests.dist_utils.run_script (forked from a server that imported torch and Megatron once)."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from forge_megatron.models.tiny import build_tiny_model
from tests.dist_utils import run_script

from .pool_feed import PoolProcess, feed_groups, free_port
from .trainer_run import TRAIN, run_on_fresh_pool
from .trainer_run import read_steps as _steps
from .trainer_run import train_cmd as _train_cmd
from .trainer_run import train_env as _env

@pytest.fixture()
def setup(tmp_path):
    model_dir = build_tiny_model(str(tmp_path / "model"))
    pool = PoolProcess(str(tmp_path / "pool.sqlite"))
    yield model_dir, pool, str(tmp_path)
    pool.stop()


def _wait_for_steps(proc, metrics: str, n: int, timeout_s: float = 240) -> None:
    """Until the trainer ``proc`` has written ``n`` steps to ``metrics`` (its output if it exits first)."""
    deadline = time.time() + timeout_s
    while len(_steps(metrics)) < n:
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "trainer made no progress"
        time.sleep(0.3)


def test_kill_and_resume_continues_from_checkpoint(setup):
    model_dir, pool, run_dir = setup
    rng = np.random.default_rng(0)
    feed_groups(pool.client, 3, rng)  # enough for 3 steps: the 4th blocks waiting for data
    cmd = [sys.executable, TRAIN, *_train_cmd(model_dir, pool, run_dir, iters=5, groups=1)]
    first = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        _wait_for_steps(first, f"{run_dir}/metrics.jsonl", 3)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # crash between checkpoints (saved at 2, trained 3)
        first.wait()
    run1 = _steps(f"{run_dir}/metrics.jsonl")
    assert [s["step"] for s in run1] == [1, 2, 3]
    groups = pool.client.metrics()["groups"]
    assert (groups["committed"], groups["delivered"]) == (2, 1)  # batch 3 was delivered, never committed

    feed_groups(pool.client, 2, rng)
    second = run_script(TRAIN, cmd[2:], env=_env())
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed from" in second.stdout and "at iteration 2" in second.stdout
    # batch 3's group, plus any batch the pool handed to the dead trainer's parked request after the new feed
    assert "delivered-but-uncommitted groups" in second.stdout, second.stdout
    run2 = _steps(f"{run_dir}/metrics.jsonl")[3:]
    assert [s["step"] for s in run2] == [3, 4, 5]
    assert run2[0]["group_indices"] == run1[2]["group_indices"]  # the lost step is redone on the same group
    trained = [g for s in run1[:2] + run2 for g in s["group_indices"]]
    assert sorted(trained) == sorted(set(trained)) and len(trained) == 5  # every group exactly once
    assert pool.client.metrics()["groups"]["committed"] == 5
    for s in run1 + run2:
        assert np.isfinite(s["loss"]) and s["total_tokens"] > s["unique_tokens"] > 0  # prompts merged
        assert s["wait_s"] >= 0 and s["forward_backward_s"] > 0 and "default/success_rate" in s
    ckpt2 = torch.load(f"{run_dir}/ckpt/iter_0000002/rank_00000.pt", weights_only=False)["model"]
    ckpt4 = torch.load(f"{run_dir}/ckpt/iter_0000004/rank_00000.pt", weights_only=False)["model"]
    (name,) = [k for k in ckpt2 if k.endswith("layers.0.self_attention.linear_qkv.weight")]
    assert not torch.equal(ckpt2[name], ckpt4[name])  # training moved the weights after the resume


def test_exit_duration_and_exit_signal_stop_with_a_checkpoint(setup):
    """--exit-duration-in-mins (Megatron's): the trainer saves and stops after the iteration that ends past it, exit
    status 0. --exit-signal-handler, two ranks under torchrun: SIGTERM to torchrun (which passes it on) while rank 0
    waits for a batch stops both at once (rank 0 broadcasts "no batch"), with a checkpoint of the last iteration (not
    a save-interval one) and the pool committed up to it."""
    model_dir, pool, run_dir = setup
    rng = np.random.default_rng(1)
    feed_groups(pool.client, 1, rng)
    base = _train_cmd(model_dir, pool, run_dir, iters=8, groups=1)
    first = run_script(TRAIN, [*base, "--exit-duration-in-mins", "0.0001"], env=_env())
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "--exit-duration-in-mins 0.0001: stopping after iteration 1 (checkpoint saved)" in first.stdout
    assert open(f"{run_dir}/ckpt/latest").read() == "1"  # not a save-interval (2) iteration

    feed_groups(pool.client, 4, rng)  # iterations 2 (saved: interval) and 3 (2 groups each), then it waits
    base[base.index("--train-batch-groups") + 1] = "2"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(free_port()), TRAIN]
    second = subprocess.Popen([*torchrun, *base, "--exit-signal-handler"], env={**os.environ, "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_for_steps(second, f"{run_dir}/metrics.jsonl", 3)
        time.sleep(1.0)  # waiting for the batch of iteration 4 now
        second.send_signal(signal.SIGTERM)
        out, _ = second.communicate(timeout=60)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
    assert "exit signal SIGTERM: stopping after iteration 3 (checkpoint saved)" in out, out[-3000:]
    assert open(f"{run_dir}/ckpt/latest").read() == "3"
    assert sorted(os.listdir(f"{run_dir}/ckpt/iter_0000003")) == [
        "rank_00000.json", "rank_00000.pt", "rank_00001.json", "rank_00001.pt"]
    groups = pool.client.metrics()["groups"]
    assert (groups["committed"], groups["delivered"]) == (5, 0)  # nothing left to be trained again

    # --exit-file (what forge.sbatch creates on slurm's signal before the time limit): a file left from before is
    # removed at the start; one made while the trainer waits for its next batch stops it with a checkpoint
    stop = os.path.join(run_dir, "stop_training")
    open(stop, "w").close()
    feed_groups(pool.client, 1, rng)  # iteration 4, then it waits
    base[base.index("--train-batch-groups") + 1] = "1"
    third = subprocess.Popen([sys.executable, TRAIN, *base, "--exit-file", stop], env=_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_for_steps(third, f"{run_dir}/metrics.jsonl", 4)
        assert not os.path.exists(stop)
        time.sleep(1.0)
        open(stop, "w").close()
        out, _ = third.communicate(timeout=60)
    finally:
        if third.poll() is None:
            os.killpg(third.pid, signal.SIGKILL)
    assert third.returncode == 0, out[-3000:]
    assert "was there before the start (left from an earlier run?): removed" in out
    assert f"--exit-file {stop}: stopping after iteration 4 (checkpoint saved)" in out, out[-3000:]
    assert open(f"{run_dir}/ckpt/latest").read() == "4"
    assert pool.client.metrics()["groups"]["committed"] == 6


def test_dp2_replicas_stay_equal(setup):
    model_dir, pool, run_dir = setup
    feed_groups(pool.client, 4, np.random.default_rng(1))
    out = run_script(TRAIN, _train_cmd(model_dir, pool, run_dir, iters=2, groups=2), nproc=2,
                     env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    steps = _steps(f"{run_dir}/metrics.jsonl")
    assert [s["step"] for s in steps] == [1, 2] and all(len(s["group_indices"]) == 2 for s in steps)
    assert steps[0]["episodes"] == 4  # rank 0 trains on its half of the groups (1 group of 4 episodes)
    r0 = torch.load(f"{run_dir}/ckpt/iter_0000002/rank_00000.pt", weights_only=False)["model"]
    r1 = torch.load(f"{run_dir}/ckpt/iter_0000002/rank_00001.pt", weights_only=False)["model"]
    for name, t in r0.items():
        if isinstance(t, torch.Tensor):
            assert torch.equal(t, r1[name]), name  # DP grads were all-reduced: replicas identical
    assert pool.client.metrics()["groups"]["committed"] == 4


def test_pp2_and_tp2_sp_pp2_train_like_one_rank(tmp_path):
    """Same batches, same HF initialisation: PP = 2, and TP = 2 with sequence parallelism x PP = 2 (4 ranks: the
    stages exchange [T / TP, 1, hidden] slices of variable length) (gloo, Megatron's schedules) match a single rank's
    losses and gradient norms; step 2 also checks the optimizer update (under SP the norms' partial gradients must
    have been summed over TP). TP without SP: test_trainer_moe.py's resume under another layout, the MoE tests."""
    model_dir = build_tiny_model(str(tmp_path / "model"))
    runs = {}
    tp_sp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    for name, nproc, extra in (("single", 1, []), ("pp2", 2, ["--pipeline-model-parallel-size", "2"]),
                               ("tp2_sp_pp2", 4, tp_sp + ["--pipeline-model-parallel-size", "2"])):
        steps, _, _ = run_on_fresh_pool(tmp_path, name, model_dir, lambda c: feed_groups(c, 2, np.random.default_rng(3)),
                                        iters=2, groups=1, extra=extra, nproc=nproc)
        runs[name] = steps
    losses = {name: [s["loss"] for s in steps] for name, steps in runs.items()}
    assert len(losses["single"]) == 2
    for name in ("pp2", "tp2_sp_pp2"):
        assert all(np.isfinite(losses[name]))
        assert losses[name] == pytest.approx(losses["single"], abs=1e-5), name
        assert [s["grad_norm"] for s in runs[name]] == pytest.approx([s["grad_norm"] for s in runs["single"]],
                                                                     rel=1e-5), name


def test_interleaved_pipeline_trains_like_one_rank_and_resumes(tmp_path):
    """PP = 2 with two virtual stages per rank (4 layers: rank 0 holds layers 1 and 3, rank 1 layers 2 and 4),
    Megatron's interleaved schedule, micro-batches split to a multiple of PP and padded to one length: the same
    losses and gradient norms as one rank when the run stops after step 1 (checkpoint of both chunks) and resumes,
    and in one go with TP = 2 and sequence parallelism on top (4 ranks); the HF weights reach both chunks of each
    rank. Tied input/output embeddings: the last stage keeps its own copy of the embedding as head, made equal to
    the first stage's at construction (an all-reduce that used to crash on CPU: Megatron calls .cuda() there) and
    kept equal by the embedding-gradient all-reduce (plain PP = 2 with tied embeddings: test_weight_sync.py)."""
    model_dir = build_tiny_model(str(tmp_path / "model"), num_hidden_layers=4, tie_word_embeddings=True)
    four = ["--num-layers", "4", "--old-logprobs", "recompute"]  # after tiny.sh's 2; also a forward-only schedule
    vpp = four + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    vpp_tp_sp = vpp + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    runs = (("single", 1, four, (None,)), ("vpp_resumed", 2, vpp, (1, None)), ("vpp_tp2_sp", 4, vpp_tp_sp, (None,)))
    steps = {}
    for name, nproc, extra, exits in runs:
        steps[name], stdouts, _ = run_on_fresh_pool(
            tmp_path, name, model_dir, lambda c: feed_groups(c, 3, np.random.default_rng(9), completion_len=(4, 12)),
            iters=2, groups=1, extra=extra, nproc=nproc, exits=exits)
        if name == "vpp_resumed":
            assert "resumed from" in stdouts[1]
    for name in ("vpp_resumed", "vpp_tp2_sp"):  # the last: TP 2 x PP 2 x VPP 2 with sequence parallelism
        assert len(steps[name]) == 2
        for a, b in zip(steps["single"], steps[name]):
            assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
            assert b["micro_batches"] % 2 == 0
    # pi_old recomputed through the chunks
    assert steps["vpp_resumed"][0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)


def test_interleaved_pipeline_over_four_stages_keeps_variable_lengths(tmp_path):
    """PP = 4 x VPP = 2 (8 layers, one per chunk): the neighbours of a stage are different ranks, so micro-batches
    keep their own lengths (not padded: see test_balance.py) and the variable shapes travel safely; losses and
    gradient norms equal one rank's."""
    model_dir = build_tiny_model(str(tmp_path / "model"), num_hidden_layers=8)
    eight = ["--num-layers", "8"]
    runs = (("single", 1, eight),
            ("pp4vpp2", 4, eight + ["--pipeline-model-parallel-size", "4", "--num-virtual-stages-per-pipeline-rank",
                                    "2", "--tree-token-budget", "40"]))
    steps = {}
    for name, nproc, extra in runs:
        steps[name], _, _ = run_on_fresh_pool(
            tmp_path, name, model_dir, lambda c: feed_groups(c, 3, np.random.default_rng(9), completion_len=(4, 12)),
            iters=2, groups=1, extra=extra, nproc=nproc)
    for a, b in zip(steps["single"], steps["pp4vpp2"]):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["micro_batches"] % 4 == 0 and b["micro_batches"] > 1
    assert steps["pp4vpp2"][0]["total_tokens"] == steps["single"][0]["total_tokens"]


def test_dp2_and_cp2_gradients_equal_one_rank_on_the_same_batches(tmp_path):
    """CISPO's token mean is over the whole batch: two DP ranks holding groups with different token counts must
    produce the gradient one rank computes on the full batch (grad norm of the DP-reduced gradient, two steps).
    Two context-parallel ranks, each holding half of every tree, must produce it too, here under PP = 2 with keys and
    values all-gathered (--cp-comm-type all_gather; CP's all-to-all through the trainer: the MoE tests' CP runs)."""
    model_dir = build_tiny_model(str(tmp_path / "model"))
    norms, tokens = {}, {}
    runs = (("single", 1, []), ("dp2", 2, []),
            ("pp2cp2", 4, ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                           "--cp-comm-type", "all_gather"]))
    for name, nproc, extra in runs:
        steps, _, _ = run_on_fresh_pool(
            tmp_path, name, model_dir, lambda c: feed_groups(c, 4, np.random.default_rng(5), completion_len=(6, 11)),
            iters=2, groups=2, extra=extra, nproc=nproc)
        norms[name] = [s["grad_norm"] for s in steps]
        tokens[name] = [s["loss_tokens"] for s in steps]
    # rank 0 of the DP=2 run holds one of the two groups, and the groups' token counts differ
    assert all(0 < d < s for d, s in zip(tokens["dp2"], tokens["single"]))
    assert any(2 * d != s for d, s in zip(tokens["dp2"], tokens["single"]))
    assert norms["dp2"] == pytest.approx(norms["single"], rel=1e-5)
    assert tokens["pp2cp2"] == tokens["single"]  # CP ranks score every target of the batch
    assert norms["pp2cp2"] == pytest.approx(norms["single"], rel=1e-5)


def test_dp2_with_a_split_group_equals_one_rank(tmp_path):
    """A group costing more than a DP rank's share is dealt out by episodes (--dp-balance cost): the two ranks then
    each train part of it, and the DP-reduced gradient must still be the one rank's on the same batches."""
    model_dir = build_tiny_model(str(tmp_path / "model"))
    runs = {}
    for name, nproc in (("single", 1), ("dp2", 2)):
        steps, _, _ = run_on_fresh_pool(
            tmp_path, name, model_dir,
            lambda c: feed_groups(c, 4, np.random.default_rng(7), completion_len=(4, 40)),
            iters=2, groups=2, nproc=nproc)
        runs[name] = steps
    assert [s["dp_split_groups"] for s in runs["dp2"]] == [1, 1]  # the 40-token group went to both ranks
    assert all(s["dp_load_imbalance"] < 1.3 for s in runs["dp2"])
    for a, b in zip(runs["single"], runs["dp2"]):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)  # (loss is each rank's share)


@pytest.mark.parametrize("norm", ["seq_mean", "token_mean"])
def test_batch_normaliser_does_not_depend_on_micro_batching(tmp_path, norm):
    """One optimizer step over the same batch, packed into one micro-batch or into several holding different numbers
    of sequences (--tree-token-budget): the gradient must be the same, i.e. the normaliser is the batch's."""
    model_dir = build_tiny_model(str(tmp_path / "model"))
    norms = {}
    for budget in (4096, 40):
        (step,), _, _ = run_on_fresh_pool(
            tmp_path, f"b{budget}", model_dir,
            lambda c: feed_groups(c, 3, np.random.default_rng(7), completion_len=(3, 14, 8)), iters=1, groups=3,
            extra=["--rl-loss-norm", norm, "--tree-token-budget", str(budget)])
        norms[budget] = (step["grad_norm"], step["micro_batches"], step["loss"], step["ratio_mean"],
                         step["num_tokens"])
    assert norms[4096][1] == 1 and norms[40][1] > 2
    assert norms[40][0] == pytest.approx(norms[4096][0], rel=1e-5)
    # the logged loss terms do not depend on the micro-batching either (shares summed, token means weighted)
    for i in (2, 3, 4):
        assert norms[40][i] == pytest.approx(norms[4096][i], rel=1e-5, abs=1e-7)


def test_fused_logprobs_train_like_megatrons_output_layer(tmp_path):
    """The default (output layer fused into the logprobs) and --no-fused-logprobs (Megatron's output layer, then the
    logits) train the same two steps: loss, entropy (bonus on, so its gradient counts), pi_old recomputed through the
    forward-only schedule (unit ratios at step 1) and gradient norms, to fp32 round-off. --fp32-lm-head reaches the
    loss on both passes and, on an fp32 model, changes nothing. The training/inference mismatch is logged."""
    model_dir = build_tiny_model(str(tmp_path / "model"))
    steps = {}
    for name, extra in (("fused", []), ("unfused", ["--no-fused-logprobs"]), ("fp32_head", ["--fp32-lm-head"])):
        steps[name], _, _ = run_on_fresh_pool(
            tmp_path, name, model_dir, lambda c: feed_groups(c, 2, np.random.default_rng(13), completion_len=(4, 11)),
            iters=2, groups=1,
            extra=extra + ["--rl-entropy-coef", "0.01", "--old-logprobs", "recompute"])
    assert len(steps["fused"]) == len(steps["unfused"]) == len(steps["fp32_head"]) == 2
    for other in ("unfused", "fp32_head"):
        for a, b in zip(steps["fused"], steps[other]):
            for key in ("loss", "entropy", "ratio_mean", "grad_norm", "rollout_logp_abs_diff", "rollout_kl"):
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (other, key)
    assert steps["fused"][0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    first = steps["fused"][0]  # feed_groups' rollout logprobs are not the model's: a mismatch to see
    assert first["rollout_logp_abs_diff_max"] >= first["rollout_logp_abs_diff"] > 0 and first["rollout_kl"] > 0
    # every fed token says version 0, the version being trained (no weight sync here): all of them are on-policy
    assert first["onpolicy/num_tokens"] == first["num_tokens"] > 0
    assert first["onpolicy/rollout_kl"] == pytest.approx(first["rollout_kl"], rel=1e-6)


def _feed_engine_rollouts(client, model_dir: str, temperature: float, groups: int = 2, group_size: int = 3):
    """Finished episodes whose completions and logprobs the reference engine sampled at ``temperature`` from the
    model the trainer starts from (what a gateway with --policy-sampling --policy-temperature records)."""
    import time
    import uuid

    from forge_megatron.middleware.schema import Episode, Segment
    from forge_megatron.rollout.engine_server import ReferenceEngine

    engine = ReferenceEngine(model_dir)
    rng = np.random.default_rng(21)
    for g in range(groups):
        prompt = rng.integers(10, 200, size=8).tolist()
        gid = client.register_group(f"task-{g}", group_size, "default")
        for e in range(group_size):
            req = engine.new_request({"input_ids": prompt, "sampling_params": {
                "temperature": temperature, "max_new_tokens": 6, "sampling_seed": 10 * g + e, "ignore_eos": True}})
            while req.finish is None:
                engine._step(req)
            n = len(req.output_ids)
            seg = Segment(tokens=prompt + req.output_ids, loss_mask=[0] * len(prompt) + [1] * n,
                          rollout_logprobs=[0.0] * len(prompt) + list(req.logprobs),
                          policy_versions=[-1] * len(prompt) + [0] * n)
            eid = uuid.uuid4().hex
            client.episode_started(gid, eid)
            now = time.time()
            client.submit_episode(Episode(episode_id=eid, group_id=gid, task_id=f"task-{g}", segments=[seg],
                                          reward=float(e % 2), started_at=now - 1, ended_at=now))


def test_rollout_temperature_scores_what_the_engine_sampled(tmp_path):
    """Rollouts sampled at temperature 0.7 carry SGLang-style logprobs of softmax(z / 0.7). A trainer started from
    the sampling weights with --rollout-temperature 0.7 scores the same numbers (mismatch ~0 at step 1, unit
    ratios); at the default 1 it scores another distribution, and the mismatch shows."""
    model_dir = build_tiny_model(str(tmp_path / "model"))
    steps = {}
    for name, extra in (("t07", ["--rollout-temperature", "0.7"]), ("t1", [])):
        steps[name], _, _ = run_on_fresh_pool(
            tmp_path, name, model_dir, lambda c: _feed_engine_rollouts(c, model_dir, 0.7), iters=1, groups=2,
            extra=extra + ["--rl-entropy-coef", "0.01"])
    matched, default = steps["t07"][0], steps["t1"][0]
    assert matched["rollout_logp_abs_diff"] < 1e-4 and matched["rollout_logp_abs_diff_max"] < 1e-3
    assert matched["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert default["rollout_logp_abs_diff"] > 100 * matched["rollout_logp_abs_diff"] + 1e-2
    assert matched["entropy"] != pytest.approx(default["entropy"], rel=1e-3)  # the entropy term is tempered too


def test_kl_to_a_frozen_reference(tmp_path):
    """--rl-kl-coef: a frozen copy of the HF model scores every batch. Step 1 (policy == reference): KL exactly 0,
    the same loss and gradient as without the term; step 2: KL > 0 and a different loss. PP = 2 trains the same, and
    a run stopped after step 1 and resumed still compares with the initial model (not the resumed policy), here with
    the reference's weights offloaded to host memory between its passes (--ref-offload)."""
    model_dir = build_tiny_model(str(tmp_path / "model"))
    feed = lambda c: feed_groups(c, 2, np.random.default_rng(3), completion_len=(5, 7))  # noqa: E731
    kl = ["--rl-kl-coef", "0.5", "--old-logprobs", "recompute"]
    runs = {}
    for name, extra, nproc, exits in (("plain", ["--old-logprobs", "recompute"], 1, (None,)), ("kl", kl, 1, (None,)),
                                      ("kl_pp2", kl + ["--pipeline-model-parallel-size", "2"], 2, (None,)),
                                      ("kl_resumed", kl + ["--ref-offload"], 1, (1, None))):
        runs[name], stdouts, _ = run_on_fresh_pool(tmp_path, name, model_dir, feed, iters=2, groups=1, extra=extra,
                                                   nproc=nproc, exits=exits, lr="1e-2")
        assert all(("reference model offloaded to host memory" in out) == ("--ref-offload" in extra)
                   for out in stdouts), name
    plain, with_kl = runs["plain"], runs["kl"]
    assert with_kl[0]["kl"] == 0.0 and "kl" not in plain[0]
    for key in ("loss", "grad_norm"):
        assert with_kl[0][key] == pytest.approx(plain[0][key], rel=1e-6, abs=1e-9), key
    assert with_kl[1]["kl"] > 1e-6 and abs(with_kl[1]["loss"] - plain[1]["loss"]) > 1e-7
    for other in ("kl_pp2", "kl_resumed"):
        for a, b in zip(with_kl, runs[other]):
            for key in ("loss", "kl", "grad_norm"):
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-8), (other, key)


def test_exit_and_resume_continues_the_same_run_exactly(tmp_path):
    """--exit-interval 3 of a 5-iteration run saves and stops after iteration 3; resuming with the same flags trains
    iterations 4 and 5 exactly as an uninterrupted run does, to fp32 round-off: the model, LR schedule, pool position
    and policy version show in step 4, the Adam moments only in step 5 (step 4's update). (Changing --train-iters
    instead would change the LR decay.) The resumed run saves with --async-save (iteration 2 written in the
    background while step 3 trains, 3 at the exit) and --keep-checkpoints 1, the straight run synchronously."""
    model_dir = build_tiny_model(str(tmp_path / "model"))
    steps = {}
    for name, exits, extra in (("straight", [None], ()),
                               ("resumed", [3, None], ("--async-save", "--keep-checkpoints", "1"))):
        steps[name], stdouts, counts = run_on_fresh_pool(
            tmp_path, name, model_dir, lambda c: feed_groups(c, 5, np.random.default_rng(11), completion_len=(5, 9)),
            iters=5, groups=1, exits=exits, extra=extra)
        if name == "resumed":
            assert "--exit-interval 3: stopping after iteration 3" in stdouts[0]
            assert counts[0] == 3
            for it in (2, 3):
                assert f"checkpoint iteration {it}: state copied to host memory" in stdouts[0]
                assert f"checkpoint iteration {it} saved to" in stdouts[0]  # published: latest, pool commit
            assert "resumed from" in stdouts[1] and "at iteration 3" in stdouts[1]
            assert sorted(os.listdir(tmp_path / name / "ckpt")) == ["iter_0000005", "latest"]  # keep 1
    assert len(steps["resumed"]) == len(steps["straight"]) == 5
    for a, b in zip(steps["straight"], steps["resumed"]):
        assert (a["batch_id"], a["policy_version"]) == (b["batch_id"], b["policy_version"])
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-9)


def test_recomputed_old_logprobs_give_unit_ratios(setup):
    """--old-logprobs recompute: pi_old is the current policy before the update, so every ratio is 1 at step 1; with
    the recorded rollout logprobs (-5 per token here) the ratios are far from 1. (Recomputed under PP and VPP: the
    interleaved-pipeline and KL tests.)"""
    model_dir, pool, run_dir = setup
    feed_groups(pool.client, 2, np.random.default_rng(5))
    ratios = {}
    for mode in ("recompute", "rollout"):
        out = run_script(TRAIN, _train_cmd(model_dir, pool, f"{run_dir}/{mode}", iters=1, groups=1,
                                           extra=["--old-logprobs", mode]), env=_env())
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        (step,) = _steps(f"{run_dir}/{mode}/metrics.jsonl")
        ratios[mode] = (step["ratio_mean"], step["ratio_max"], step["clip_frac_high"])
    assert ratios["recompute"] == pytest.approx((1.0, 1.0, 0.0), abs=1e-5)
    assert abs(ratios["rollout"][0] - 1.0) > 0.3  # exp(logp + 5), logp of a random tiny model ~ -log(vocab) ~ -6
