"""Short runs of the end-to-end demo with on-policy distillation (a teacher in the trainer or served) and with LoRA
(the merged policy or the adapter served): every process separate, weights synced each step; every process gone
afterwards. CPU, 0 GPUs. (Split from test_demo_short.py so that parallel test workers run them apart.)"""

import json
import os
import subprocess
import sys

import pytest

from .demo_utils import processes_mentioning


# (the served teacher's engine scores the sampled tokens in both modes; with reverse it also records its top-k: that
# case covers the served path through every process. The trainer-side teacher and the sampled KL are tested without
# the whole loop, on one rank and under PP / TP + SP / CP: tests/training/test_distill.py; each run here takes a
# minute on two cores)
@pytest.mark.parametrize("where,kl", [("served", "reverse")])
def test_short_distill_demo_learns_from_a_teacher(tmp_path, where, kl):
    """``--distill``: a second, twice-as-wide SFT model is the teacher; the trainer loads it beside the student
    (``trainer``), or a second forge-engine serves it and the gateway scores each ended episode with it
    (``served``), and every step's sampled tokens are trained on the teacher's per-token advantage alone (no reward
    term), or with ``--distill-kl reverse`` on the dense KL over the teacher's top 32 tokens (served: recorded by the
    gateway, ``--teacher-topk 32``). Every step reports the reverse KL on the student's own samples; the weights move
    (gradient > 0) and reach the engine every step. (That this teaches the student: the 40-step demo,
    docs/training.md.)"""
    out = tmp_path / "distill_run"
    cmd = [sys.executable, "-m", "forge_megatron.training.demo", "--distill", where, "--out", str(out), "--steps", "3",
           "--sft-steps", "10", "--groups-per-step", "2", "--group-size", "4", "--eval-tasks", "0",
           "--timeout-s", "400", "--distill-kl", kl]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=480, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "[demo]     the teacher for on-policy distillation: hidden 128" in proc.stdout
    assert ("[forge-train] teacher for on-policy distillation loaded from" in proc.stdout) == (where == "trainer")
    assert ("reverse KL to the teacher per sampled token" if kl == "sampled" else
            "reverse KL to the teacher over its top-k tokens (--distill-kl reverse)") in proc.stdout
    summary = json.loads((out / "metrics.json").read_text())
    if where == "served":  # every sampled token of the trained episodes was scored by the teacher's engine
        assert "[demo] teacher engine ready at" in proc.stdout
        steps_tokens = [json.loads(line)["num_tokens"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert summary["teacher_scored_tokens"] >= sum(steps_tokens) > 0
    assert not processes_mentioning(str(out)), "a demo process outlived the demo"
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["policy_version"] for s in steps] == [1, 2, 3] and all(s["grad_norm"] > 0 for s in steps)
    # the teacher is another model: its logprobs differ from the student's on every step (after 10 SFT steps both
    # are still near uniform over the 400 tokens, logprobs ~ -ln 400, so their mean difference is ~1e-3, not more)
    for s in steps:
        assert s["distill_teacher_logp"] < 0 and abs(s["distill_reverse_kl"]) > 1e-5
    assert proc.stdout.count("| teacher rkl ") == 3  # on the progress lines
    assert summary["distill_reverse_kl"] == [s["distill_reverse_kl"] for s in steps]
    if kl != "sampled":  # the dense KL trains: both top-k KLs, the teacher's top-32 mass and the loss term
        seen = [(s["distill_loss"], s["distill_forward_kl"], s["distill_topk_mass"]) for s in steps]
        assert all(loss > 0 and forward > 0 and 0 < mass <= 1.0001 for loss, forward, mass in seen), seen


# (the default, merged; the adapters alone served by the engine: tests/weight_sync/test_adapter_sync.py and
# tests/middleware/test_gateway_lora.py, without the whole loop)
@pytest.mark.parametrize("sync", ["merged"])
def test_short_lora_demo_serves_the_trained_policy(tmp_path, sync):
    """``--lora-rank 8``: the trainer trains adapters over the frozen SFT model (an entropy bonus gives them a
    gradient whatever the rewards, through ``--train-args``) and syncs every step, W + scaling * B A (``merged``) or
    the adapters alone to an engine serving LoRA (``adapter``: nothing paused, no call cut): on the tokens each
    synced version sampled, the engine's logprobs equal the trainer's to fp32 round-off, though the adapters moved
    the model (the tokens sampled before an update differ by far more)."""
    out = tmp_path / "lora_run"
    n = 4 if sync == "merged" else 6  # (without aborts a step's batch is more often all one version: more steps)
    cmd = [sys.executable, "-m", "forge_megatron.training.demo", "--lora-rank", "8", "--lora-sync", sync,
           "--train-args", "--rl-entropy-coef 0.05", "--out", str(out), "--steps", str(n), "--sft-steps", "10",
           "--groups-per-step", "2", "--group-size", "4", "--eval-tasks", "0", "--timeout-s", "400"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=480, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    served = "the merged weights" if sync == "merged" else "the SFT weights + each version's adapter"
    assert f"[demo] LoRA rank 8: the engine serves {served}" in proc.stdout
    assert not processes_mentioning(str(out)), "a demo process outlived the demo"
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["policy_version"] for s in steps] == list(range(1, n + 1)) and all(s["grad_norm"] > 0 for s in steps)
    # tokens sampled by a synced version and trained at it (a step may have none: timing)
    onpolicy = [d for s in steps[1:] if (d := s.get("onpolicy/rollout_logp_abs_diff")) is not None]
    assert onpolicy and max(onpolicy) < 1e-5, onpolicy
    if sync == "merged":
        # the adapters moved the policy between versions: tokens an older version sampled are scored differently
        # (a step's batch may hold none: timing)
        stale = [s["rollout_kl"] for s in steps[1:] if s["staleness_max"] > 0]
        assert not stale or max(stale) > 1e-5, [(s["staleness_max"], s["rollout_kl"]) for s in steps]
        return
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["aborts"] == 0 and summary["resumed_tokens"] == 0  # no pause: no call was cut
    adapters = sorted(d for d in os.listdir(out / "weight_sync") if d.startswith("forge-"))
    assert [d.rsplit("-v", 1)[1] for d in adapters] == [str(n - 1), str(n)], adapters  # the last two
    from safetensors.torch import load_file

    last = load_file(str(out / "weight_sync" / adapters[-1] / "adapter_model.safetensors"))
    assert max(t.abs().max().item() for k, t in last.items() if "lora_B" in k) > 1e-4  # the adapters moved
