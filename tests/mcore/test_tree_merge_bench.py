"""benchmarks/tree_merge.py runs end to end on a user JSONL workload (0 GPUs, one CPU process, tiny model).

Timings are not asserted (they belong to the benchmark's report); what is checked: one JSON line with the
documented keys, token counts against an independent prefix count, exact logprobs/gradients (--check), and the
JSONL reader's error messages.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "tree_merge.py"


def _bench_module():
    spec = importlib.util.spec_from_file_location("tree_merge_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _unique_prefixes(samples):
    return len({tuple(s[: i + 1]) for s in samples for i in range(len(s))})


@pytest.mark.parametrize("arch", ["gpt", "qwen3_5"])
def test_jsonl_workload_with_loss_mask(tmp_path, arch):
    samples = [[5, 6, 7, 8, 9], [5, 6, 7, 1, 2, 3], [5, 6, 7, 8, 9], [40, 41, 42]]
    path = tmp_path / "work.jsonl"
    path.write_text("\n".join(json.dumps({"tokens": s, "loss_mask": [0] * 3 + [1] * (len(s) - 3)}) for s in samples))
    cmd = [sys.executable, str(SCRIPT), "--workload", str(path), "--check", "--repeats", "1", "--layers",
           "2" if arch == "qwen3_5" else "1", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--vocab", "64",
           "--arch", arch]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["total_tokens"] == sum(map(len, samples))
    assert out["unique_tokens"] == _unique_prefixes(samples)
    assert out["bound"] == pytest.approx(out["total_tokens"] / out["unique_tokens"], abs=1e-3)
    assert out["speedup"] == pytest.approx(out["naive_s"] / out["tree_s"], rel=1e-2)
    assert out["max_abs_logprob_diff"] <= 1e-5 and out["max_rel_grad_diff"] <= 1e-5
    assert out["arch"] == arch and (out.get("max_rel_grad_diff_decay", 0.0) <= 1e-3)
    assert ("max_rel_grad_diff_decay" in out) == (arch == "qwen3_5")


@pytest.mark.parametrize("line, message", [
    ('{"ids": [1, 2]}', "every line needs a 'tokens' list of at least 2"),
    ('{"tokens": [1, 2, 3], "loss_mask": [1, 1]}', "loss_mask has 2 entries for 3 tokens"),
])
def test_jsonl_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"tokens": [1, 2]}\n' + line + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:2: " + message.replace("[", r"\[")):
        _bench_module().jsonl_workload(str(path))


def test_workload_shapes_have_the_documented_bounds():
    bench = _bench_module()
    args = bench.parse_args([])
    import random

    agentic = bench.agentic_workload(args, random.Random(0))
    grpo = bench.grpo_workload(args, random.Random(0))
    assert sum(map(len, agentic)) / _unique_prefixes(agentic) >= 10  # default agentic bound >= 10
    P, G, R = args.prompt_len, args.group, args.response_len
    assert sum(map(len, grpo)) / _unique_prefixes(grpo) == pytest.approx(G * (P + R) / (P + G * R))
    args.system_len = 0  # KTO: an example and its mismatched sample share the prompt, 2 (P + R) / (P + 2 R)
    kto, masks = bench.kto_workload(args, random.Random(0))
    assert len(kto) == 2 * args.examples and all(sum(m) == R for m in masks)
    assert sum(map(len, kto)) / _unique_prefixes(kto) == pytest.approx(2 * (P + R) / (P + 2 * R))
    assert kto[1][P:] == kto[2][P:] and kto[1][:P] == kto[0][:P]  # example 0's prompt, example 1's answer
