"""Short runs of the vision demo (the colour task): pictures through the gateway, the engine, the pool and the
trainer, every process separate; every process gone afterwards. CPU, 0 GPUs. (Split from test_demo_short.py so that
parallel test workers run them apart.)"""

import json
import os
import subprocess
import sys

import pytest

from .demo_utils import processes_mentioning


# (Qwen2.5-VL's, Mistral 3's and Kimi-K2.5's pictures through the gateway, the engine and the trainer, and trained
# towers reaching the engine, are tested without the whole loop: tests/multimodal/test_trainer_images.py,
# test_mistral3_images.py)
@pytest.mark.parametrize("arch,tower", [("qwen3_vl", "trained"), ("gemma4_vl", "frozen")])
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
    assert not processes_mentioning(str(out)), "a demo process outlived the demo"
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
