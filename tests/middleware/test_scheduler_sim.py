"""benchmarks/scheduler.py: the simulation honours the staleness bounds it claims and charges greedy for them.

Properties checked (each follows from the rules, not from tuned numbers):
- admission (undelivered + 1 <= (s + 1) * B) bounds the lag of in-order delivery by s + 1, and a window W by
  s + 1 + ceil((W - 1) / B); so with the default max_lag (that bound) strict and windowed never drop a group;
- greedy passes stragglers without limit: without dropping it breaks the bound, with dropping it throws rollout
  work away under heavy tails, and the dropped groups are the long ones.
"""

import json
import math
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "scheduler.py")
POLICIES = ("strict", "windowed", "greedy")
KEYS = {"throughput", "idle_fraction", "staleness_mean", "staleness_max", "length_bias", "length_bias_all",
        "work_throughput", "timed_out_fraction", "dropped_fraction", "wasted_fraction"}


def run_sim(*args: str, groups: int = 400) -> dict:
    out = subprocess.run([sys.executable, SCRIPT, "--groups", str(groups), *args], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return json.loads(out)


def sim_error(*args: str) -> str:
    err = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120)
    assert err.returncode != 0
    return err.stderr


def window_bound(cfg: dict) -> int:
    return cfg["max_staleness"] + 1 + math.ceil((cfg["window"] - 1) / cfg["train_batch_groups"])


def test_defaults_follow_the_issue_definitions():
    result = run_sim()
    cfg = result["config"]
    n = cfg["generation_batch_groups"]
    assert cfg["train_batch_groups"] == n == cfg["concurrency"]  # B = N as in the pool's default
    assert cfg["window"] == math.ceil(0.3 * n)
    assert cfg["max_lag"] == window_bound(cfg)
    for policy in POLICIES:
        assert set(result[policy]) == KEYS
        assert result[policy]["staleness_max"] <= cfg["max_lag"]
    for policy in ("strict", "windowed"):
        assert result[policy]["dropped_fraction"] == 0 and result[policy]["wasted_fraction"] == 0


def test_equal_staleness_charges_greedy_for_stragglers():
    """B = 8 < W = 20, lognormal sigma 1: greedy keeps the bound only by dropping long rollouts."""
    capped, free = run_sim("--train-batch-groups", "8"), run_sim("--train-batch-groups", "8", "--keep-stale")
    bound = capped["config"]["max_lag"]
    assert bound == window_bound(capped["config"]) == 12
    assert free["greedy"]["staleness_max"] > bound  # greedy alone breaks the guarantee
    assert all(capped[p]["staleness_max"] <= bound for p in POLICIES)
    for policy in ("strict", "windowed"):  # they never reach the bound, so dropping changes nothing
        assert capped[policy] == free[policy]
    greedy = capped["greedy"]
    assert greedy["dropped_fraction"] > 0 and greedy["wasted_fraction"] > 0
    assert greedy["length_bias_all"] < free["greedy"]["length_bias_all"]  # the dropped groups were long
    assert greedy["length_bias_all"] < capped["windowed"]["length_bias_all"]
    # Rollout time per trained group (work / groups) is shorter for greedy: it trains the short rollouts.
    per_group = {p: capped[p]["work_throughput"] / capped[p]["throughput"] for p in POLICIES}
    assert per_group["greedy"] < per_group["windowed"]


@pytest.mark.parametrize(
    "args",
    [("--dist", "pareto", "--train-batch-groups", "4", "--max-staleness", "2", "--window", "13"),
     ("--sigma", "1.5", "--train-batch-groups", "8", "--max-staleness", "0", "--window", "5"),
     ("--train-batch-groups", "16", "--max-staleness", "3", "--timeout", "4", "--seed", "3")],
)
def test_admission_and_window_bound_the_lag(args):
    result = run_sim("--keep-stale", *args)
    cfg = result["config"]
    assert cfg["max_lag"] is None
    assert result["strict"]["staleness_max"] <= cfg["max_staleness"] + 1
    assert result["windowed"]["staleness_max"] <= window_bound(cfg)


def test_simulation_reads_measured_durations(tmp_path):
    good, bad = tmp_path / "durations.txt", tmp_path / "bad.txt"
    good.write_text("\n".join(["1.0"] * 30 + ["12.0"] * 2))  # mostly fast, a few stragglers
    bad.write_text("1.0\n-2.0\n")
    result = run_sim("--durations", os.fspath(good), groups=200)
    assert result["config"]["dist"] == "file"
    greedy, strict = result["greedy"], result["strict"]
    assert greedy["throughput"] > strict["throughput"] and greedy["length_bias"] < strict["length_bias"]
    assert "need positive numbers, one per line" in sim_error("--durations", os.fspath(bad))
    assert "--max-lag must be >= 0, got -1" in sim_error("--max-lag", "-1")
