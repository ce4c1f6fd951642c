"""benchmarks/vision_merge.py: merged and per-sample runs score the same logprobs, and the merged one encodes each
distinct image once (the patch counts are the tower's own, counted by a hook)."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "vision_merge.py")


@pytest.mark.parametrize("flags", [["--workload", "grpo", "--group", "3"],
                                   ["--workload", "agentic", "--episodes", "1", "--calls", "3", "--frozen-tower"]],
                         ids=["grpo_trained", "agentic_frozen"])
def test_vision_merge_benchmark(flags):
    out = subprocess.run([sys.executable, SCRIPT, *flags, "--repeats", "1", "--side", "8", "--vision-depth", "1"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["max_abs_logprob_diff"] < 1e-5 and r["scored_tokens"] == r["total_tokens"] - r["samples"]
    per_image = 8 * 8
    assert r["patches_encoded_merged"] == r["distinct_images"] * per_image
    assert r["patches_encoded_per_sample"] == r["image_occurrences"] * per_image
    grpo = "grpo" in flags  # 3 completions of one picture; 3 calls re-sending 1, 2 and 3 screenshots
    assert (r["distinct_images"], r["image_occurrences"]) == ((1, 3) if grpo else (3, 6))
    assert r["unique_tokens"] < r["total_tokens"] and r["speedup"] > 0
