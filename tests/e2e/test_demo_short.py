"""A short run of the end-to-end demo: engine, gateway + pool, calculator agent service, rollout driver and Megatron
trainer as separate processes, weights synced to the engine every step. Checks the outputs and that every process
is gone afterwards. CPU, 0 GPUs; about a minute on 2 idle cores."""

import json

from .demo_utils import run_demo


def test_short_demo_runs_the_whole_loop(tmp_path):
    out = tmp_path / "demo_run"
    proc = run_demo(out, "--steps", "3", "--sft-steps", "20", "--groups-per-step", "2", "--group-size", "4",
                    "--timeout-s", "400", "--eval-tasks", "8", "--eval-every", "2",
                    "--gateway-workers", "2")  # the sessions over two gateway processes; driver, trainer, sync: one URL
    for stage in ("1/5", "2/5", "3/5", "4/5", "5/5"):
        assert f"[demo] {stage}" in proc.stdout

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
    proc = run_demo(out, "--moe", "glm4_moe", "--steps", "2", "--sft-steps", "10", "--groups-per-step", "2",
                    "--group-size", "4", "--timeout-s", "400", "--eval-tasks", "0")  # (the held-out eval: the first test)
    assert "[demo] routing replay:" in proc.stdout
    summary = json.loads((out / "metrics.json").read_text())
    assert len(summary["routing_mismatch"]) == 2 and summary["routing_mismatch"][0] == 0.0
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert first["routing_replayed_rows"] > 0 and first["rollout_logp_abs_diff"] < 1e-4


# --fp8 (the engine serving forge-convert's FP8 copy, FP8 weight syncs): in test_demo_short_distill.py's distillation
# run, which serves the student so (one demo run of a minute on two cores fewer)


# the frozen tower's trainer path: tests/multimodal (kept short here); Gemma 4: pictures of their own sizes, image
# blocks in the sliding layers; Mistral 3: pictures written row by row (the warm-start's chats too); Kimi-K2.5: its
# trained tower synced under the release's names (a fused wqkv) through the disk transport; Qwen2.5-VL: its trained
# windowed tower synced under the release's visual.* (the engine's model holds it under model.visual.*)
