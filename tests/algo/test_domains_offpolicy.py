"""Domain mixing (largest-remainder counts, seeded draws, per-domain means) and off-policy helpers. GPUs: 0."""

import math
import re
import subprocess
import sys
from collections import Counter

import pytest
import torch

from forge_megatron.algo import DomainMixer, domain_means, drop_stale, staleness, truncated_is_weights


def _exact(message):
    return f"^{re.escape(message)}$"


# ---------------------------------------------------------------- domain mixer


def test_counts_largest_remainder():
    mixer = DomainMixer({"math": 0.5, "qa": 0.3, "agent": 0.2})
    assert mixer.counts(10) == {"math": 5, "qa": 3, "agent": 2}
    assert mixer.counts(7) == {"math": 4, "qa": 2, "agent": 1}  # quotas 3.5, 2.1, 1.4: the extra slot to math
    assert mixer.counts(0) == {"math": 0, "qa": 0, "agent": 0}
    assert DomainMixer({"a": 3, "b": 1}).counts(8) == {"a": 6, "b": 2}  # ratios are normalised


def test_counts_sum_to_batch_and_stay_within_one_of_quota():
    rng = torch.Generator().manual_seed(0)
    for trial in range(50):
        ratios = {f"d{i}": float(x) for i, x in enumerate(torch.rand(5, generator=rng))}
        mixer = DomainMixer(ratios, seed=trial)
        total = sum(ratios.values())
        for batch in (1, 7, 32):
            counts = mixer.counts(batch)
            assert sum(counts.values()) == batch
            assert all(abs(counts[d] - batch * r / total) < 1 for d, r in ratios.items())


def test_equal_ratio_ties_rotate_over_batches():
    mixer = DomainMixer({"a": 1, "b": 1, "c": 1}, seed=3)
    seen = Counter()
    for _ in range(300):
        seen.update({d: n for d, n in mixer.counts(1).items()})
    assert all(80 < seen[d] < 120 for d in "abc"), seen


def test_draw_is_seeded_mixed_and_covers_each_pool():
    pools = {"math": list(range(6)), "qa": ["q0", "q1", "q2"]}
    draws = [DomainMixer({"math": 2, "qa": 1}, seed=7).draw(pools, 9) for _ in range(2)]
    assert draws[0] == draws[1]
    assert draws[0] != DomainMixer({"math": 2, "qa": 1}, seed=8).draw(pools, 9)
    batch = draws[0]
    assert Counter(d for d, _ in batch) == {"math": 6, "qa": 3}
    assert sorted(t for d, t in batch if d == "math") == list(range(6))  # one full pass, no repeats
    assert sorted(t for d, t in batch if d == "qa") == ["q0", "q1", "q2"]


def test_draw_reshuffles_after_a_pass():
    mixer = DomainMixer({"qa": 1.0}, seed=0)
    pool = list(range(4))
    tasks = [t for _ in range(3) for _, t in mixer.draw({"qa": pool}, 4)]
    for k in range(3):
        assert sorted(tasks[4 * k: 4 * k + 4]) == pool


@pytest.mark.parametrize(
    "ratios, message",
    [
        ({}, "ratios must name at least one domain"),
        ({"a": -1.0}, "ratio of domain 'a' is -1.0 (must be finite and >= 0)"),
        ({"a": math.nan}, "ratio of domain 'a' is nan (must be finite and >= 0)"),
        ({"a": 0.0, "b": 0.0}, "ratios must not all be 0"),
    ],
)
def test_mixer_config_errors(ratios, message):
    with pytest.raises(ValueError, match=_exact(message)):
        DomainMixer(ratios)


def test_draw_errors():
    mixer = DomainMixer({"a": 1, "b": 1})
    with pytest.raises(ValueError, match=_exact("domain 'b' needs 1 tasks but its pool is missing or empty")):
        mixer.draw({"a": [1], "b": []}, 2)
    with pytest.raises(ValueError, match=_exact("batch_size must be >= 0, got -1")):
        mixer.counts(-1)


def test_domain_means():
    values = [{"reward": 1.0, "len": 10.0}, {"reward": 0.0, "len": 20.0}, {"reward": 0.5, "len": 4.0}]
    out = domain_means(values, ["math", "math", "agent"])
    assert out == {"math/reward": 0.5, "math/len": 15.0, "agent/reward": 0.5, "agent/len": 4.0,
                   "math/count": 2.0, "agent/count": 1.0}
    with pytest.raises(ValueError, match=_exact("3 metric dicts for 2 domain labels")):
        domain_means(values, ["a", "b"])


# ---------------------------------------------------------------- off-policy


def test_truncated_is_weights():
    old_M = torch.tensor([-1.0, -1.0, -2.0], requires_grad=True)
    rollout_M = torch.tensor([-3.0, -0.5, -2.0])
    w_M = truncated_is_weights(old_M, rollout_M, cap=2.0)
    assert w_M.tolist() == pytest.approx([2.0, math.exp(-0.5), 1.0])
    assert not w_M.requires_grad
    with pytest.raises(ValueError, match=_exact("tis cap must be > 0, got 0.0")):
        truncated_is_weights(old_M, rollout_M, 0.0)


def test_staleness_and_drop_stale():
    assert staleness([-1, -1, 5, 6, 6], current_version=8) == 3  # prompt tokens (-1) do not count
    assert staleness([-1, -1], current_version=8) == 0
    assert staleness(torch.tensor([4, 7]), current_version=7) == 3
    samples = [[-1, 7, 8], [-1, 3, 8], [8, 8], [-1]]
    assert drop_stale(samples, current_version=8, max_staleness=1) == [0, 2, 3]
    assert drop_stale(samples, current_version=8, max_staleness=5) == [0, 1, 2, 3]
    assert drop_stale(samples, current_version=8, max_staleness=0) == [2, 3]
    with pytest.raises(ValueError, match=_exact("max_staleness must be >= 0, got -1")):
        drop_stale(samples, 8, -1)
    with pytest.raises(ValueError, match=_exact("policy version 9 is newer than the current version 8")):
        staleness([9], 8)


def test_algo_imports_neither_megatron_nor_middleware():
    """Every public name of forge_megatron.algo (each resolved from its submodule on first use) imports neither
    Megatron nor the middleware; the data pool's server and the rewards import no torch (they score groups in plain
    Python, so forge-pool starts in a fraction of a second)."""
    every_name = ("import sys, forge_megatron.algo as algo; values = [getattr(algo, n) for n in algo.__all__]; "
                  "assert sorted(dir(algo)) == sorted(set(dir(algo))) and set(algo.__all__) <= set(dir(algo)); "
                  "bad = [m for m in sys.modules if m.startswith(('megatron', 'forge_megatron.middleware', "
                  "'forge_megatron.mcore'))]; print(bad); sys.exit(1 if bad else 0)")
    no_torch = ("import sys, forge_megatron.middleware.pool_server, forge_megatron.middleware.batch; "
                "from forge_megatron.algo import RewardConfig, score_group, reward_to_go, DomainMixer; "
                "from forge_megatron.algo.rewards import score_group; "
                "print([m for m in sys.modules if m.split('.')[0] == 'torch'][:3]); sys.exit('torch' in sys.modules)")
    for code in (every_name, no_torch):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        import forge_megatron.algo

        forge_megatron.algo.nope
