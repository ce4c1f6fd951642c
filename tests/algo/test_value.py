"""GAE along the trained tokens of tree-packed samples and the value loss (algo/value.py), against a plain loop."""

import pytest
import torch

from forge_megatron.algo.value import discounted_suffix_sums, gae_advantages, value_loss


def _loop_gae(values, mask, bounds, returns, gamma, lam, rewards=None):
    """The textbook backward recursion, one sample at a time, over its trained tokens only (``rewards``: more reward
    at any trained position)."""
    adv, ret = [0.0] * len(values), [0.0] * len(values)
    for s, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        idx = [t for t in range(lo, hi) if mask[t]]
        acc, next_v = 0.0, 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            r = (returns[s] if k == len(idx) - 1 else 0.0) + (rewards[t] if rewards is not None else 0.0)
            delta = r + gamma * next_v - values[t]
            acc = delta + gamma * lam * acc
            adv[t], ret[t], next_v = acc, acc + values[t], values[t]
    return torch.tensor(adv), torch.tensor(ret)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (1.0, 0.5)])
def test_gae_equals_the_backward_recursion(gamma, lam):
    """Five samples of 1..40 targets with prompt / tool-result gaps (mask 0) between trained runs, one sample with
    no trained token: advantages and targets equal the loop's; untrained tokens get zeros."""
    g = torch.Generator().manual_seed(0)
    lengths = [40, 1, 7, 25, 3]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    M = bounds[-1]
    values = torch.randn(M, generator=g)
    mask = (torch.rand(M, generator=g) > 0.3).float()
    mask[bounds[1]:bounds[2]] = 0  # a sample without trained tokens
    mask[:5] = 0  # a prompt
    returns = torch.randn(len(lengths), generator=g)
    adv, ret = gae_advantages(values, mask, torch.tensor(bounds), returns, gamma, lam)
    want_adv, want_ret = _loop_gae(values.tolist(), mask.tolist(), bounds, returns.tolist(), gamma, lam)
    assert torch.allclose(adv, want_adv.float(), atol=1e-5) and torch.allclose(ret, want_ret.float(), atol=1e-5)
    assert adv[mask == 0].abs().max() == 0 and ret[mask == 0].abs().max() == 0
    if gamma == lam == 1.0:  # A_t = G - V_t: the return against a per-token baseline
        sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        assert torch.allclose(adv[mask > 0], (returns[sample] - values)[mask > 0], atol=1e-6)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95)])
def test_gae_with_the_rewards_of_single_calls(gamma, lam):
    """Per-call rewards (``rewards_M``, the gateway's call_rewards) at some trained positions, one of them a sample's
    last: the recursion with those rewards added to r_t. With gamma = lambda = 1 each token's advantage is the
    rewards from it on (the calls' after it and the return at the end) minus its value."""
    g = torch.Generator().manual_seed(3)
    bounds = [0, 30, 42, 60]
    M = bounds[-1]
    values, returns = torch.randn(M, generator=g), torch.randn(3, generator=g)
    mask = (torch.rand(M, generator=g) > 0.2).float()
    mask[[0, 30, 42]] = 0
    mask[[5, 9, 29, 59]] = 1
    rewards = torch.zeros(M)
    rewards[[9, 29, 50]] = torch.tensor([0.5, -0.3, 0.25])
    mask[50] = 1
    adv, ret = gae_advantages(values, mask, torch.tensor(bounds), returns, gamma, lam, rewards)
    want_adv, want_ret = _loop_gae(values.tolist(), mask.tolist(), bounds, returns.tolist(), gamma, lam,
                                   rewards.tolist())
    assert torch.allclose(adv, want_adv.float(), atol=1e-5) and torch.allclose(ret, want_ret.float(), atol=1e-5)
    if gamma == lam == 1.0:
        t = 5  # before the first sample's calls at 9 and 29: 0.5 - 0.3 + its return
        assert adv[t].item() == pytest.approx(0.2 + returns[0].item() - values[t].item(), abs=1e-5)
    with pytest.raises(ValueError, match="rewards_M has 3 entries for 60 positions"):
        gae_advantages(values, mask, torch.tensor(bounds), returns, gamma, lam, torch.zeros(3))


def test_suffix_sums_stay_in_their_segment_and_handle_long_runs():
    """A 5000-token segment (13 scan steps) beside one-token segments, c = 0.999: equal to the loop in fp64."""
    x = torch.randn(5003, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    seg = torch.tensor([0] + [1] * 5000 + [2, 3], dtype=torch.long)
    y = discounted_suffix_sums(x, seg, 0.999)
    want, acc = torch.zeros_like(x), 0.0
    for i in reversed(range(x.numel())):
        acc = x[i].item() + (0.999 * acc if i + 1 < x.numel() and seg[i + 1] == seg[i] else 0.0)
        want[i] = acc
    assert torch.allclose(y, want, rtol=1e-10, atol=1e-9)
    with pytest.raises(ValueError, match="discount"):
        discounted_suffix_sums(x, seg, 1.5)


def test_value_loss_and_bad_inputs():
    v, r = torch.tensor([1.0, 2.0, 3.0], requires_grad=True), torch.tensor([0.0, 2.0, 5.0])
    loss = value_loss(v, r, torch.tensor([1.0, 0.0, 1.0]))
    assert loss.item() == pytest.approx(0.5 * (1 + 4))
    loss.backward()
    assert v.grad.tolist() == [1.0, 0.0, -2.0]
    with pytest.raises(ValueError, match="disagree"):
        gae_advantages(torch.zeros(4), torch.ones(3), torch.tensor([0, 4]), torch.zeros(1))
    with pytest.raises(ValueError, match="gamma and lambda"):
        gae_advantages(torch.zeros(4), torch.ones(4), torch.tensor([0, 4]), torch.zeros(1), lam=1.2)


def test_clipped_value_loss_takes_the_larger_term():
    """PPO's value clip around V_old = 1 with eps 0.5 toward return 2: V = 1.2 inside the band (both terms equal);
    V = 0.2 and 2.6 outside it but with more error than the clipped value has (the unclipped term is the larger:
    its gradient V - R stays); a masked token adds nothing; nothing clipped. Then V = 1.9 moved past the band toward
    R: the clipped value 1.5 has the larger error, the loss is its, the gradient 0, and the count says one token."""
    from forge_megatron.algo.value import value_clip_count

    v = torch.tensor([1.2, 0.2, 2.6, 0.2], requires_grad=True)
    old, r, mask = torch.ones(4), torch.full((4,), 2.0), torch.tensor([1.0, 1.0, 1.0, 0.0])
    loss = value_loss(v, r, mask, old, clip=0.5)
    # 0.5 * [(1.2 - 2)^2, max((0.2 - 2)^2, (0.5 - 2)^2), max((2.6 - 2)^2, (1.5 - 2)^2)]
    want = 0.5 * (0.8 ** 2 + 1.8 ** 2 + 0.6 ** 2)
    assert loss.item() == pytest.approx(want)
    loss.backward()
    assert v.grad.tolist() == pytest.approx([-0.8, -1.8, 0.6, 0.0])
    v2 = torch.tensor([1.9, 0.6], requires_grad=True)
    old2, r2 = torch.tensor([1.0, 1.0]), torch.tensor([2.0, 0.0])
    loss2 = value_loss(v2, r2, torch.ones(2), old2, clip=0.5)
    assert loss2.item() == pytest.approx(0.5 * ((1.5 - 2.0) ** 2 + (0.6 - 0.0) ** 2))
    loss2.backward()
    assert v2.grad.tolist() == pytest.approx([0.0, 0.6])
    assert value_clip_count(v2, r2, torch.ones(2), old2, 0.5).item() == 1.0
    assert value_clip_count(v, r, mask, old, 0.5).item() == 0.0
    with pytest.raises(ValueError, match="clip needs old_values_M"):
        value_loss(v, r, mask, clip=0.5)


def test_gae_benchmark_runs_small():
    """benchmarks/gae.py at a small size: one JSON line with the keys docs/benchmarks.md reports, the vectorised
    advantages equal to the loop's."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "gae.py"), "--tokens", "4096", "--samples",
                          "16", "--repeats", "1"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr
    (line,) = out.stdout.strip().splitlines()
    result = json.loads(line)
    assert result["tokens"] == 4096 and result["max_abs_diff"] < 1e-9
    assert {"scan_ms", "loop_ms", "policy_loss_ms", "speedup_vs_loop", "scan_over_policy_loss"} <= result.keys()
