"""A short run of the end-to-end demo with on-policy distillation (a served teacher, the student's engine serving FP8
weights): every process separate, weights synced each step; every process gone afterwards. CPU, 0 GPUs. (Split from
test_demo_short.py so that parallel test workers run them apart.)"""

import json

from .demo_utils import run_demo


# (the served teacher's engine scores the sampled tokens in both modes; with reverse it also records its top-k: that
# case covers the served path through every process. The trainer-side teacher and the sampled KL are tested without
# the whole loop, on one rank and under PP / TP + SP / CP: tests/training/test_distill.py; each run here takes a
# minute on two cores, so this one also serves the student from forge-convert's FP8 copy: --fp8's own run, once in
# test_demo_short.py, was folded in here)
def test_short_distill_demo_learns_from_a_teacher_with_an_fp8_student_engine(tmp_path):
    """``--distill served --distill-kl reverse``: a second, twice-as-wide SFT model is the teacher; a second
    forge-engine serves it and the gateway scores each ended episode with it, recording the teacher's top 32 tokens
    at every sampled token (``--teacher-topk 32``), and every step's sampled tokens are trained on the dense KL over
    them alone (no reward term). Every step reports the reverse KL on the student's own samples; the weights move
    (gradient > 0) and reach the engine every step. (That this teaches the student: the 40-step demo,
    docs/training.md; the teacher in the trainer and the sampled KL: tests/training/test_distill.py.)

    ``--fp8``: the student's engine serves forge-convert's FP8 copy of the SFT model and the trainer syncs FP8 weights
    every step (disk transport). On tokens the trained weights sampled, the engine's logprobs differ from the
    trainer's by the FP8 rounding (far above fp32 noise, far below a different model); the partial-rollout counters
    are reported."""
    out = tmp_path / "distill_run"
    proc = run_demo(out, "--distill", "served", "--distill-kl", "reverse", "--fp8", "--steps", "3", "--sft-steps",
                    "10", "--groups-per-step", "2", "--group-size", "4", "--eval-tasks", "0", "--timeout-s", "400")
    assert "[demo]     the teacher for on-policy distillation: hidden 128" in proc.stdout
    assert "[forge-train] teacher for on-policy distillation loaded from" not in proc.stdout  # served, not loaded
    assert "reverse KL to the teacher over its top-k tokens (--distill-kl reverse)" in proc.stdout
    assert "[demo] teacher engine ready at" in proc.stdout
    assert "FP8 copy for the engine" in proc.stdout and "[demo] partial rollout:" in proc.stdout
    summary = json.loads((out / "metrics.json").read_text())
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # every sampled token of the trained episodes was scored by the teacher's engine
    assert summary["teacher_scored_tokens"] >= sum(s["num_tokens"] for s in steps) > 0
    # FP8 updates accepted by the FP8 engine, and the weights moved every step
    assert [s["policy_version"] for s in steps] == [1, 2, 3] and all(s["grad_norm"] > 0 for s in steps)
    # the teacher is another model: its logprobs differ from the student's on every step (after 10 SFT steps both
    # are still near uniform over the 400 tokens, logprobs ~ -ln 400, so their mean difference is ~1e-3, not more)
    for s in steps:
        assert s["distill_teacher_logp"] < 0 and abs(s["distill_reverse_kl"]) > 1e-5
    assert proc.stdout.count("| teacher rkl ") == 3  # on the progress lines
    assert summary["distill_reverse_kl"] == [s["distill_reverse_kl"] for s in steps]
    # the dense KL trains: both top-k KLs, the teacher's top-32 mass and the loss term
    seen = [(s["distill_loss"], s["distill_forward_kl"], s["distill_topk_mass"]) for s in steps]
    assert all(loss > 0 and forward > 0 and 0 < mass <= 1.0001 for loss, forward, mass in seen), seen
    first = summary["onpolicy_logp_abs_diff"][0]  # step 1 trains the weights whose FP8 copy sampled everything
    assert first is not None and 1e-4 < first < 0.05, first
    assert {"aborts", "resumed_tokens"} <= set(summary) and summary["discarded_tokens"] == 0  # resumed, not redone
