"""benchmarks/tree_attention.py runs on CPU (tiny sizes, segment/reference vs per-sample SDPA) and prints one JSON line.

GPUs needed: 0.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tree_attention.py"


@pytest.mark.parametrize("workload", ["grpo", "agentic"])
def test_benchmark_prints_one_json_line(workload):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--workload", workload, "--repeat", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert set(out["backends"]) >= {"segment", "reference", "sdpa_per_sample"}
    assert out["backends"]["reference"]["max_abs_diff_vs_segment"] < 1e-5
    # Merging shares prefixes: the tree attends strictly fewer pairs than the unmerged samples.
    assert out["tree_pairs"] < out["per_sample_pairs"] and out["tree_tokens"] < out["per_sample_tokens"]
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_tflops"] > 0 for r in out["backends"].values())
    blocks = -(-out["tree_tokens"] // 64)
    assert sum(out["tiles_64"].values()) == blocks * (blocks + 1) // 2  # every causal tile classified once
