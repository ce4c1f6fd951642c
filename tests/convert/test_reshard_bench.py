"""benchmarks/reshard.py: the streaming reshard and the whole-model reference write identical checkpoints, and the
line carries every field docs/benchmarks.md reports."""

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "reshard.py")


def test_reshard_benchmark():
    out = subprocess.run([sys.executable, SCRIPT, "--mib", "8", "--from-pp", "2", "--to-tp", "2", "--to-pp", "2"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["identical"] is True and r["layers"] == 4 and r["model_mib"] > 4
    assert {"stream_peak_mib", "whole_peak_mib", "ratio", "stream_s", "whole_s"} <= set(r)
    assert r["stream_peak_mib"] >= 0 and r["whole_peak_mib"] > 0
