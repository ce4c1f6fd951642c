"""A short run of the end-to-end demo: engine, gateway + pool, calculator agent service, rollout driver and Megatron
trainer as separate processes, weights synced to the engine every step. Checks the outputs and that every process
is gone afterwards. CPU, 0 GPUs; about a minute on 2 idle cores."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd and int(pid) != os.getpid():
            found.append(f"{pid}: {cmd}")
    return found


def test_short_demo_runs_the_whole_loop(tmp_path):
    out = tmp_path / "demo_run"
    cmd = [sys.executable, "-m", "forge_megatron.training.demo", "--out", str(out), "--steps", "3", "--sft-steps", "20",
           "--groups-per-step", "2", "--group-size", "4", "--timeout-s", "400", "--eval-tasks", "8", "--eval-every", "2",
           "--gateway-workers", "2"]  # the sessions over two gateway processes; driver, trainer, sync: one URL
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=480, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for stage in ("1/5", "2/5", "3/5", "4/5", "5/5"):
        assert f"[demo] {stage}" in proc.stdout
    assert not _processes_mentioning(str(out)), "a demo process outlived the demo"

    summary = json.loads((out / "metrics.json").read_text())
    assert summary["steps"] == 3 and summary["wall_s"] > 0
    assert 0.0 <= summary["first_success_rate"] <= 1.0 and 0.0 <= summary["last_success_rate"] <= 1.0
    assert (out / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert [s["policy_version"] for s in steps] == [1, 2, 3]  # the engine got new weights after every step
    for s in steps:
        assert s["episodes"] == 8 and len(s["group_indices"]) == 2
        assert s["merge_ratio"] > 2  # the episodes of a group share the long tools prompt
        assert s["staleness_max"] <= 2  # the pool's admission control bounds the policy lag
        assert s["math/success_rate"] == s["success_rate"]  # per-domain metrics (one domain here)
        for key in ("wait_s", "forward_backward_s", "sync_s", "tokens_per_s", "clip_frac_high", "loss"):
            assert key in s
    driver_log = (out / "logs" / "driver.log").read_text()
    assert "Traceback" not in driver_log
    # held-out evaluation before RL, after RL (final weights) and, by the driver once the version reached 2, during it
    # (that one is recorded only if it finished before the demo stopped the driver)
    versions = [e["policy_version"] for e in summary["evals"]]
    assert versions[0] == 0 and versions[-1] == 3 and all(v >= 2 for v in versions[1:-1]) and len(versions) <= 3
    assert all(e["tasks"] == 8 and 0.0 <= e["pass@1"] <= 1.0 for e in summary["evals"])
    assert "[demo] held-out tasks (never trained on): pass@1" in proc.stdout
    held_out = {json.loads(line)["task_id"] for line in (out / "heldout_tasks.jsonl").read_text().splitlines()}
    trained = {json.loads(line)["task_id"] for line in (out / "rl_tasks.jsonl").read_text().splitlines()}
    assert len(held_out) == 8 and not held_out & trained
    # the pre-RL evaluation was published to the gateway and the trainer logged it with its first step
    assert steps[0]["eval/policy_version"] == 0 and steps[0]["eval/pass@1"] == summary["evals"][0]["pass@1"]
    # the episodes the pool received came from both gateway workers (their session ids carry the worker's tag)
    import sqlite3

    from forge_megatron.middleware.gateway_front import worker_tag_of

    with sqlite3.connect(out / "pool.sqlite") as db:
        ids = [row[0] for row in db.execute("SELECT episode_id FROM episodes")]
    assert len(ids) >= 3 * 8 and {worker_tag_of(i) for i in ids} == {"w0r0", "w1r0"}, ids[:4]


def test_short_moe_demo_replays_the_engines_routing(tmp_path):
    """``--moe glm4_moe``: the same loop on a tiny GLM-4.5-layout model (a sigmoid router with score-correction
    biases, a dense layer, a shared expert) with rollout routing replay through every process (engine recording
    experts, gateway keeping them, pool, trainer replaying). Step 1 trains the weights that sampled its tokens, in
    fp32 on both sides: every replayed row is the trainer's own routing and the logprobs agree. (Qwen3-MoE's softmax
    router replays in tests/training and tests/middleware/test_gateway_resume.py.)"""
    out = tmp_path / "moe_run"
    cmd = [sys.executable, "-m", "forge_megatron.training.demo", "--moe", "glm4_moe", "--out", str(out), "--steps", "2",
           "--sft-steps", "10", "--groups-per-step", "2", "--group-size", "4", "--timeout-s", "400"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=480, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "[demo] routing replay:" in proc.stdout
    assert not _processes_mentioning(str(out)), "a demo process outlived the demo"
    summary = json.loads((out / "metrics.json").read_text())
    assert len(summary["routing_mismatch"]) == 2 and summary["routing_mismatch"][0] == 0.0
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert first["routing_replayed_rows"] > 0 and first["rollout_logp_abs_diff"] < 1e-4


@pytest.mark.parametrize("where,kl", [("trainer", "sampled"), ("served", "sampled"), ("served", "reverse")])
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
    assert not _processes_mentioning(str(out)), "a demo process outlived the demo"
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


@pytest.mark.parametrize("sync", ["merged", "adapter"])
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
    assert not _processes_mentioning(str(out)), "a demo process outlived the demo"
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


def test_short_fp8_demo_serves_and_syncs_fp8_weights(tmp_path):
    """``--fp8``: the engine serves forge-convert's FP8 copy of the SFT model and the trainer syncs FP8 weights every
    step (disk transport). On tokens the trained weights sampled, the engine's logprobs differ from the trainer's by
    the FP8 rounding (far above fp32 noise, far below a different model); the partial-rollout counters are reported."""
    out = tmp_path / "fp8_run"
    cmd = [sys.executable, "-m", "forge_megatron.training.demo", "--fp8", "--out", str(out), "--steps", "2",
           "--sft-steps", "10", "--groups-per-step", "2", "--group-size", "4", "--timeout-s", "400"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=480, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "FP8 copy for the engine" in proc.stdout and "[demo] partial rollout:" in proc.stdout
    assert not _processes_mentioning(str(out)), "a demo process outlived the demo"
    summary = json.loads((out / "metrics.json").read_text())
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["policy_version"] for s in steps] == [1, 2]  # FP8 updates accepted by the FP8 engine
    first = summary["onpolicy_logp_abs_diff"][0]  # step 1 trains the weights whose FP8 copy sampled everything
    assert first is not None and 1e-4 < first < 0.05, first
    assert {"aborts", "resumed_tokens"} <= set(summary) and summary["discarded_tokens"] == 0  # resumed, not redone


# the frozen tower's trainer path: tests/multimodal (kept short here); Gemma 4: pictures of their own sizes, image
# blocks in the sliding layers; Mistral 3: pictures written row by row (the warm-start's chats too); Kimi-K2.5: its
# trained tower synced under the release's names (a fused wqkv) through the disk transport; Qwen2.5-VL: its trained
# windowed tower synced under the release's visual.* (the engine's model holds it under model.visual.*)
@pytest.mark.parametrize("arch,tower", [("qwen3_vl", "trained"), ("gemma4_vl", "frozen"), ("ministral3_vl", "frozen"),
                                        ("kimi_k25", "trained"), ("qwen2_5_vl", "trained")])
def test_short_vision_demo_sends_pictures_through_every_process(tmp_path, arch, tower):
    """``--arch qwen3_vl`` (``gemma4_vl``): the colour task on a tiny Qwen3-VL (Gemma 4) model: the agent sends
    pictures, the gateway normalises and expands them and sends them to the engine, the pool stores them with the
    episodes, the trainer encodes them with the vision tower (frozen; or trained, ``--train-vision-tower``, and then synced with the language model through the
    demo's disk transport), and the weights synced every step reach the engine's vision-language model. Step 1 trains
    the weights that sampled its tokens: the trainer scores them as the engine did, pictures included."""
    out = tmp_path / "vision_run"
    cmd = [sys.executable, "-m", "forge_megatron.training.demo", "--arch", arch, "--out", str(out), "--steps",
           "4" if tower == "trained" else "2", "--sft-steps", "10", "--groups-per-step", "2", "--group-size", "4",
           "--timeout-s", "400", "--eval-tasks", "4", *(["--train-vision-tower"] if tower == "trained" else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=480, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "colour agent ready" in proc.stdout
    assert ("vision tower trained with the language model" if tower == "trained" else "vision tower of") in proc.stdout
    assert not _processes_mentioning(str(out)), "a demo process outlived the demo"
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["policy_version"] for s in steps] == ([1, 2, 3, 4] if tower == "trained" else [1, 2])
    assert steps[0]["rollout_logp_abs_diff"] < 1e-4 and steps[0]["vision/success_rate"] == steps[0]["success_rate"]
    if tower == "trained":  # tokens sampled after a sync with the weights trained on score as the engine did
        onpolicy = [s["onpolicy/rollout_kl"] for s in steps[1:] if s.get("onpolicy/rollout_kl") is not None]
        assert onpolicy and max(onpolicy) < 1e-6, [s.get("onpolicy/rollout_kl") for s in steps]
    import sqlite3

    from forge_megatron.middleware.wire import episode_from_blob

    with sqlite3.connect(out / "pool.sqlite") as db:
        blobs = [row[0] for row in db.execute("SELECT blob FROM episodes")]
    episodes = [episode_from_blob(b) for b in blobs]
    assert episodes and all(len(s.images or ()) == 1 for e in episodes for s in e.segments)
