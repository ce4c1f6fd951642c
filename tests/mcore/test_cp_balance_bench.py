"""benchmarks/cp_balance.py runs end to end (0 GPUs, one CPU process, small trees).

Timings are not asserted (they belong to the benchmark's report). Checked: one JSON line with the documented keys,
and the counted imbalance of a chain against its closed form: contiguous shards of a T-token chain give CP rank r
the depths [r T / C, (r + 1) T / C), so the slowest rank carries (2C - 1) / C of the mean, and the zig-zag chunks
(one round or the trainer's) carry exactly the mean.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cp_balance_benchmark_json_and_chain_closed_form():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cp_balance.py"), "--tokens", "256", "--cps", "2", "4",
           "--repeats", "1", "--heads", "4", "--head-dim", "16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["benchmark"] == "cp_balance" and set(out["results"]) == {"chain", "grpo", "batch"}
    for name, per_cp in out["results"].items():
        assert per_cp["tokens"] > 0
        for cp in ("2", "4"):
            row = per_cp[cp]
            for split in ("contiguous", "zigzag_1round", "zigzag"):
                assert row[split]["imbalance_pairs"] >= 1.0 and row[split]["imbalance_measured"] >= 1.0
                assert row[split]["step_s"] > 0
            assert row["a2a"]["step_s"] > 0 and row["speedup"] > 0
    chain = out["results"]["chain"]
    for cp in (2, 4):
        T = chain["tokens"]  # 256: a multiple of the chunk count, so no padding
        local = T // cp
        pairs = [sum(range(r * local + 1, (r + 1) * local + 1)) for r in range(cp)]  # depth + 1 per query
        want = max(pairs) / (sum(pairs) / cp)
        assert abs(chain[str(cp)]["contiguous"]["imbalance_pairs"] - want) < 1e-3
        assert abs(want - (2 * cp - 1) / cp) < 0.01
        assert chain[str(cp)]["zigzag"]["imbalance_pairs"] == chain[str(cp)]["zigzag_1round"]["imbalance_pairs"] == 1.0
