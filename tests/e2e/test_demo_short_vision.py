"""Short runs of the vision demo (the colour task): pictures through the gateway, the engine, the pool and the
trainer, every process separate; every process gone afterwards; one of them trains LoRA adapters. CPU, 0 GPUs.
(Split from test_demo_short.py so that parallel test workers run them apart.)"""

import json
import sqlite3

from forge_megatron.middleware.wire import episode_from_blob

from .demo_utils import run_demo


def _vision_demo(out, arch: str, steps: int, *flags: str) -> tuple[str, list[dict]]:
    """Run the colour-task demo on ``arch`` for ``steps`` steps and check what every vision run shows: the weights
    synced every step reach the engine's vision-language model; step 1 trains the weights that sampled its tokens,
    so the trainer scores them as the engine did, pictures included; the pool stored each episode's picture.
    Returns (stdout, per-step metrics)."""
    proc = run_demo(out, "--arch", arch, "--steps", str(steps), "--sft-steps", "10", "--groups-per-step", "2",
                    "--group-size", "4", "--timeout-s", "400", "--eval-tasks", "4", *flags)
    assert "colour agent ready" in proc.stdout
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["policy_version"] for s in metrics] == list(range(1, steps + 1))
    assert metrics[0]["rollout_logp_abs_diff"] < 1e-4
    assert metrics[0]["vision/success_rate"] == metrics[0]["success_rate"]
    with sqlite3.connect(out / "pool.sqlite") as db:
        blobs = [row[0] for row in db.execute("SELECT blob FROM episodes")]
    episodes = [episode_from_blob(b) for b in blobs]
    assert episodes and all(len(s.images or ()) == 1 for e in episodes for s in e.segments)
    return proc.stdout, metrics


# (Qwen2.5-VL's, Mistral 3's and Kimi-K2.5's pictures through the gateway, the engine and the trainer, and trained
# towers reaching the engine, are tested without the whole loop: tests/multimodal/test_trainer_images.py,
# test_mistral3_images.py)
def test_short_vision_demo_trains_the_tower_and_syncs_it(tmp_path):
    """``--arch qwen3_vl --train-vision-tower``: the colour task on a tiny Qwen3-VL model: the agent sends pictures,
    the gateway normalises and expands them and sends them to the engine, the pool stores them with the episodes, the
    trainer encodes them with the vision tower it trains, synced with the language model through the demo's disk
    transport: tokens sampled after a sync with the weights trained on score as the engine did."""
    stdout, steps = _vision_demo(tmp_path / "vision_run", "qwen3_vl", 4, "--train-vision-tower")
    assert "vision tower trained with the language model" in stdout
    onpolicy = [s["onpolicy/rollout_kl"] for s in steps[1:] if s.get("onpolicy/rollout_kl") is not None]
    assert onpolicy and max(onpolicy) < 1e-6, [s.get("onpolicy/rollout_kl") for s in steps]


# (LoRA's adapters alone served by the engine, --lora-sync adapter: tests/weight_sync/test_adapter_sync.py and
# tests/middleware/test_gateway_lora.py, without the whole loop)
def test_short_lora_demo_on_a_frozen_tower_serves_the_trained_policy(tmp_path):
    """``--arch gemma4_vl --lora-rank 8``: the colour task on a tiny Gemma 4 (pictures of their own sizes, image
    blocks attending both ways in the sliding layers) whose vision tower stays the checkpoint's, frozen; the trainer
    trains adapters over the frozen SFT model (an entropy bonus gives them a gradient whatever the rewards, through
    ``--train-args``) and syncs W + scaling * B A every step: on the tokens each synced version sampled, the engine's
    logprobs equal the trainer's to fp32 round-off, though the adapters moved the model (the tokens sampled before an
    update differ by far more). (Until Dec 8 2026 two runs: LoRA on the text task, and this model without LoRA.)"""
    n = 4
    stdout, steps = _vision_demo(tmp_path / "lora_run", "gemma4_vl", n, "--lora-rank", "8", "--lora-sync", "merged",
                                 "--train-args", "--rl-entropy-coef 0.05")
    assert "vision tower of" in stdout
    assert "[demo] LoRA rank 8: the engine serves the merged weights" in stdout
    assert all(s["grad_norm"] > 0 for s in steps)
    # tokens sampled by a synced version and trained at it (a step may have none: timing)
    onpolicy = [d for s in steps[1:] if (d := s.get("onpolicy/rollout_logp_abs_diff")) is not None]
    assert onpolicy and max(onpolicy) < 1e-5, onpolicy
    # the adapters moved the policy between versions: tokens an older version sampled are scored differently (a
    # step's batch may hold none: timing)
    stale = [s["rollout_kl"] for s in steps[1:] if s["staleness_max"] > 0]
    assert not stale or max(stale) > 1e-5, [(s["staleness_max"], s["rollout_kl"]) for s in steps]
