"""benchmarks/gateway.py --multi-turn: the conversation it times is one the gateway continues as one segment."""

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gateway.py")


def test_multi_turn_mode_times_one_growing_segment():
    out = subprocess.run([sys.executable, SCRIPT, "--multi-turn", "12", "--result-words", "20", "--repeats", "1"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["turns"] == [1, 10, 12]
    assert result["continues"] == [False, True, True]  # every later call extends the first call's segment
    assert result["prompt_tokens"] == sorted(set(result["prompt_tokens"]))  # grows turn by turn
    assert all(ms > 0 for ms in result["prepare_ms"] + result["render_ms"])
    # what a session keeps grows with the conversation once (its segment), not once per call
    assert 0 < result["session_mib"] < result["per_call_lists_mib"]
    # the segment's per-token fields as typed arrays: well under the same fields as lists of Python numbers
    assert 0 < result["segments_mib"] < result["segments_as_lists_mib"] / 2


def test_workers_mode_measures_the_three_paths_on_one_conversation():
    out = subprocess.run([sys.executable, SCRIPT, "--workers", "2", "--history-turns", "3", "--result-words", "10",
                          "--calls", "8", "--concurrency", "2", "--rounds", "1"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["workers"] == 2 and result["prompt_tokens"] > 50  # the whole conversation counted
    assert all(result[k] > 0 for k in ("one_calls_per_s", "workers_calls_per_s", "via_front_calls_per_s"))
    assert abs(result["speedup"] - result["workers_calls_per_s"] / result["one_calls_per_s"]) < 0.02
