"""Composite rewards, group advantages, reward-to-go, completion-time bonus, process terms, user reward functions.

GPUs: 0."""

import math
import re
import textwrap

import pytest

from forge_megatron.algo import (
    PROCESS_TERMS,
    EpisodeOutcome,
    ProcessContext,
    RewardConfig,
    completion_time_bonus,
    group_baselines,
    language_mixing,
    measure_process_terms,
    register_process_term,
    reward_to_go,
    score_group,
)


def _ep(reward, success=True, duration=10.0, **kw):
    return EpisodeOutcome(outcome_reward=reward, success=success, duration_s=duration, **kw)


def _exact(message):
    return f"^{re.escape(message)}$"


# ---------------------------------------------------------------- advantages


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
@pytest.mark.parametrize("std_normalize", [True, False])
def test_group_advantages_zero_mean(estimator, std_normalize):
    rewards = [1.0, 0.0, 0.5, 1.0, 0.2]
    cfg = RewardConfig(estimator=estimator, std_normalize=std_normalize)
    adv = [a[0] for a in score_group([_ep(r) for r in rewards], cfg).segment_advantages]
    assert sum(adv) == pytest.approx(0.0, abs=1e-12)
    mean = sum(rewards) / 5
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 5) + 1e-6 if std_normalize else 1.0
    factor = 5 / 4 if estimator == "rloo" else 1.0  # leave-one-out: r_i - mean_{j!=i} = G/(G-1) (r_i - mean)
    assert adv == pytest.approx([factor * (r - mean) / std for r in rewards], rel=1e-9)


def test_rloo_baseline_excludes_own_reward():
    baselines, scale = group_baselines([1.0, 2.0, 6.0], "rloo", std_normalize=False, eps=1e-6)
    assert baselines == [4.0, 3.5, 1.5]
    assert scale == 1.0


def test_equal_rewards_give_zero_advantages_not_nan():
    scores = score_group([_ep(1.0), _ep(1.0), _ep(1.0)], RewardConfig())
    assert scores.segment_advantages == [[0.0], [0.0], [0.0]]


def test_segment_count_invariance():
    """Splitting an episode into more segments changes neither its advantage nor its total loss weight, nor the
    advantages of the other episodes."""
    base = [_ep(1.0), _ep(0.0), _ep(0.5)]
    split = [_ep(1.0, num_segments=4), _ep(0.0), _ep(0.5, num_segments=2)]
    a, b = score_group(base, RewardConfig()), score_group(split, RewardConfig())
    assert b.segment_advantages[0] == [a.segment_advantages[0][0]] * 4
    assert b.segment_advantages[1] == a.segment_advantages[1]
    assert b.segment_advantages[2] == [a.segment_advantages[2][0]] * 2
    assert b.segment_weights == [[0.25] * 4, [1.0], [0.5, 0.5]]
    assert [sum(w) for w in b.segment_weights] == [1.0, 1.0, 1.0]


def test_reward_to_go_hand_computation():
    assert reward_to_go([1.0, 0.0, 2.0], 0.5) == [1.5, 1.0, 2.0]  # G2 = 2, G1 = 0 + .5*2, G0 = 1 + .5*1
    assert reward_to_go([1.0, 0.0, 2.0], 1.0) == [3.0, 2.0, 2.0]
    assert reward_to_go([1.0, 3.0], 0.0) == [1.0, 3.0]
    assert reward_to_go([], 0.9) == []
    with pytest.raises(ValueError, match=_exact("gamma must lie in [0, 1], got 1.5")):
        reward_to_go([1.0], 1.5)


def test_score_group_reward_to_go_across_segments():
    # episode 0: per-turn rewards [0.1, 0.0, 0.3] and outcome 1.0 credited to the last turn
    ep0 = _ep(1.0, num_segments=3, segment_rewards=[0.1, 0.0, 0.3])
    ep1 = _ep(0.0)
    scores = score_group([ep0, ep1], RewardConfig(gamma=0.5, std_normalize=False))
    g0 = [0.1 + 0.5 * (0.0 + 0.5 * 1.3), 0.0 + 0.5 * 1.3, 1.3]  # reward-to-go by hand
    assert scores.rewards[0] == pytest.approx(1.4)  # undiscounted total
    assert scores.terms[0]["segment_rewards"] == pytest.approx(0.4)
    baseline = (g0[0] + 0.0) / 2  # GRPO baseline from the episodes' returns at their first segment
    assert scores.segment_advantages[0] == pytest.approx([g - baseline for g in g0])
    assert scores.segment_advantages[1] == pytest.approx([0.0 - baseline])
    assert scores.segment_returns == [pytest.approx(g0), [0.0]]  # a learned critic's value targets (--critic)


def test_call_rewards_are_reward_to_go_steps_inside_their_segments():
    """Episode 0: two segments; segment 0 holds rewarded calls ending at tokens 5 (0.2) and 9 (-0.1), segment 1 one at
    token 3 (0.4), the segment rewards 0.05 and 0, the outcome 1. Steps in order: 0.2, -0.1, 0.05 (segment 0's end),
    0.4, 1.0 (segment 1's end, with the outcome), their returns discounted by gamma = 0.5 per step; the group
    baseline on the first returns (episode 1 has none of these: one step, its outcome 0). A segment's advantage and
    return are its first step's; the steps list every step's position, reward, return and advantage; the total
    reward counts the call rewards once (a term of their own)."""
    ep0 = _ep(1.0, num_segments=2, segment_rewards=[0.05, 0.0], call_rewards=[[(5, 0.2), (9, -0.1)], [(3, 0.4)]])
    scores = score_group([ep0, _ep(0.0)], RewardConfig(gamma=0.5, std_normalize=False))
    rewards = [0.2, -0.1, 0.05, 0.4, 1.0]
    g = [0.0] * 5
    for j in range(4, -1, -1):
        g[j] = rewards[j] + (0.5 * g[j + 1] if j < 4 else 0.0)
    b = (g[0] + 0.0) / 2
    assert scores.rewards[0] == pytest.approx(1.0 + 0.05 + 0.2 - 0.1 + 0.4)
    assert scores.terms[0]["call_rewards"] == pytest.approx(0.5)
    assert scores.segment_returns == [pytest.approx([g[0], g[3]]), [0.0]]
    assert scores.segment_advantages[0] == pytest.approx([g[0] - b, g[3] - b])
    (s0, s1), (none,) = scores.segment_steps
    assert none is None
    assert [st[0] for st in s0] == [5, 9, -1] and [st[0] for st in s1] == [3, -1]
    assert [st[1] for st in s0 + s1] == pytest.approx(rewards)
    assert [st[2] for st in s0 + s1] == pytest.approx(g)
    assert [st[3] for st in s0 + s1] == pytest.approx([x - b for x in g])
    # without call rewards the steps are the segments: the same as segment rewards alone
    plain = score_group([_ep(1.0, num_segments=2, segment_rewards=[0.05, 0.0]), _ep(0.0)], RewardConfig(gamma=0.5))
    assert plain.segment_steps == [[None, None], [None]]


# ---------------------------------------------------------------- composite reward


def test_composite_terms_sum_to_reward_and_use_weights():
    cfg = RewardConfig(process_weights={"malformed_tool_calls": -0.1, "language_mixing": -0.5})
    ep = _ep(1.0, process_terms={"malformed_tool_calls": 2.0, "language_mixing": 0.2, "unweighted_probe": 9.0})
    scores = score_group([ep, _ep(0.0)], cfg)
    assert scores.terms[0] == pytest.approx({"outcome": 1.0, "malformed_tool_calls": -0.2, "language_mixing": -0.1})
    assert scores.rewards == pytest.approx([0.7, 0.0])
    for terms, reward in zip(scores.terms, scores.rewards):
        assert sum(terms.values()) == pytest.approx(reward)


def test_completion_time_ordering_and_bounds():
    durations = [30.0, 10.0, 20.0, 5.0, 40.0]
    successes = [True, True, True, False, True]
    bonus = completion_time_bonus(durations, successes, bound=0.2)
    assert bonus[3] == 0.0  # fastest overall but failed
    assert bonus[1] == pytest.approx(0.2)  # fastest success gets the bound
    ok = sorted((d, b) for d, b, s in zip(durations, bonus, successes) if s)
    assert all(b1 > b2 for (_, b1), (_, b2) in zip(ok, ok[1:]))  # strictly faster -> strictly more
    assert all(0.0 <= b <= 0.2 for b in bonus)
    assert completion_time_bonus([7.0, 7.0, 7.0], [True, True, True], 0.3) == [0.3, 0.3, 0.3]
    assert completion_time_bonus([1.0, 2.0], [False, False], 0.3) == [0.0, 0.0]
    assert completion_time_bonus([0.0, 2.0], [True, True], 0.3) == [0.3, 0.0]


def test_completion_time_in_score_group():
    eps = [_ep(1.0, duration=10.0), _ep(1.0, duration=20.0), _ep(0.0, success=False, duration=1.0)]
    scores = score_group(eps, RewardConfig(completion_time_bound=0.2))
    assert [t["completion_time"] for t in scores.terms] == pytest.approx([0.2, 0.1, 0.0])
    assert scores.segment_advantages[0][0] > scores.segment_advantages[1][0] > scores.segment_advantages[2][0]
    assert "completion_time" not in score_group(eps, RewardConfig()).terms[0]  # bound 0 turns it off


def test_overlong_penalty_ramps_over_the_buffer():
    """DAPO's soft overlong punishment on the episode's sampled tokens: 0 up to L - B, a linear ramp to -p over the
    buffer, -p past L; a step at L without a buffer. In a group it is a term of the reward (terms still sum to it)
    and the longer episode's advantage falls; without the setting there is no such term."""
    from forge_megatron.algo.rewards import overlong_penalty

    assert [overlong_penalty(n, 100, 20, 0.5) for n in (10, 80, 90, 100, 101, 500)] == pytest.approx(
        [0.0, 0.0, -0.25, -0.5, -0.5, -0.5])
    assert [overlong_penalty(n, 100, 0) for n in (100, 101)] == [0.0, -1.0]
    eps = [_ep(1.0, sampled_tokens=50), _ep(1.0, sampled_tokens=95), _ep(1.0, sampled_tokens=150)]
    scores = score_group(eps, RewardConfig(overlong_max_tokens=100, overlong_buffer_tokens=20))
    assert [t["overlong"] for t in scores.terms] == pytest.approx([0.0, -0.75, -1.0])
    assert scores.rewards == pytest.approx([1.0, 0.25, 0.0])
    assert scores.segment_advantages[0][0] > scores.segment_advantages[1][0] > scores.segment_advantages[2][0]
    for terms, reward in zip(scores.terms, scores.rewards):
        assert sum(terms.values()) == pytest.approx(reward)
    assert "overlong" not in score_group(eps, RewardConfig()).terms[0]


def test_singleton_group_modes():
    scores = score_group([_ep(1.0, num_segments=2)], RewardConfig())
    assert scores.segment_advantages == [[0.0, 0.0]]
    assert scores.warnings == ["group of size 1: advantages set to 0"]
    raw = score_group([_ep(0.7)], RewardConfig(singleton_group="raw"))
    assert raw.segment_advantages == [[0.7]] and raw.warnings == []
    with pytest.raises(ValueError, match="group has a single episode"):
        score_group([_ep(1.0)], RewardConfig(singleton_group="error"))


# ---------------------------------------------------------------- process terms


def test_language_mixing():
    assert language_mixing("The answer is 42.") == 0.0
    assert language_mixing("hello мир") == pytest.approx(3 / 8)
    assert language_mixing("これは日本語の文です") == 0.0  # kanji + kana: one language
    assert language_mixing("") == 0.0
    assert language_mixing("123 !?") == 0.0
    assert language_mixing("答案是 yes") == pytest.approx(3 / 6)


def test_measure_builtin_process_terms():
    ctx = ProcessContext(texts=["ok", "ок"], tool_calls=5, malformed_tool_calls=2, failed_tool_calls=1)
    assert measure_process_terms(ctx, ["malformed_tool_calls", "failed_tool_calls", "language_mixing"]) == {
        "malformed_tool_calls": 2.0, "failed_tool_calls": 1.0, "language_mixing": 0.5}
    with pytest.raises(ValueError, match=r"unknown process terms \['nope'\]"):
        measure_process_terms(ctx, ["nope"])


def test_register_process_term():
    name = "test_rewards_tool_call_rate"

    @register_process_term(name)
    def rate(ctx):
        return ctx.malformed_tool_calls / max(ctx.tool_calls, 1)

    try:
        assert measure_process_terms(ProcessContext(tool_calls=4, malformed_tool_calls=1), [name]) == {name: 0.25}
        with pytest.raises(ValueError, match=_exact(f"process term {name!r} is already registered")):
            register_process_term(name)(rate)
    finally:
        PROCESS_TERMS.pop(name)


# ---------------------------------------------------------------- user reward function


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(textwrap.dedent("""
        def length_bonus(outcome):
            return 0.5 * outcome.metadata.get("n", 0)

        def breakdown(outcome):
            return {"format": 0.25, "style": -0.5 if outcome.domain == "qa" else 0.0}

        def broken(outcome):
            return float("nan")

        def clashes(outcome):
            return {"outcome": 1.0}

        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards_mod"


def test_user_reward_fn_float_and_dict(reward_module):
    cfg = RewardConfig(reward_fn=f"{reward_module}:length_bonus")
    scores = score_group([_ep(1.0, metadata={"n": 2}), _ep(0.0)], cfg)
    assert scores.terms[0]["user"] == 1.0
    assert scores.rewards == [2.0, 0.0]
    scores = score_group([_ep(1.0, domain="qa"), _ep(0.0)], RewardConfig(reward_fn=f"{reward_module}:breakdown"))
    assert scores.terms[0] == {"outcome": 1.0, "format": 0.25, "style": -0.5}
    assert scores.terms[1] == {"outcome": 0.0, "format": 0.25, "style": 0.0}


@pytest.mark.parametrize(
    "path, message",
    [
        ("no_colon", "reward_fn must look like 'package.module:function', got 'no_colon'"),
        ("mod:", "reward_fn must look like 'package.module:function', got 'mod:'"),
        ("my_rewards_mod:missing",
         "reward_fn 'my_rewards_mod:missing': module 'my_rewards_mod' has no attribute 'missing'"),
        ("my_rewards_mod:NOT_CALLABLE", "reward_fn 'my_rewards_mod:NOT_CALLABLE': 'NOT_CALLABLE' is not callable"),
    ],
)
def test_user_reward_fn_load_errors(reward_module, path, message):
    with pytest.raises(ValueError, match=_exact(message)):
        RewardConfig(reward_fn=path)


def test_user_reward_fn_missing_module():
    message = "reward_fn 'no_such_mod_xyz:f': cannot import module 'no_such_mod_xyz'"
    with pytest.raises(ValueError, match=re.escape(message)):
        RewardConfig(reward_fn="no_such_mod_xyz:f")


def test_user_reward_fn_bad_returns(reward_module):
    message = "episode 0: reward_fn returned 'user' = nan (must be a finite number)"
    with pytest.raises(ValueError, match=_exact(message)):
        score_group([_ep(1.0), _ep(0.0)], RewardConfig(reward_fn=f"{reward_module}:broken"))
    with pytest.raises(ValueError, match=_exact("episode 0: reward_fn term 'outcome' clashes with a built-in term")):
        score_group([_ep(1.0), _ep(0.0)], RewardConfig(reward_fn=f"{reward_module}:clashes"))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "bad, message",
    [
        (_ep(float("nan")), "episode 2: outcome_reward is nan (must be finite)"),
        (_ep(float("inf")), "episode 2: outcome_reward is inf (must be finite)"),
        (_ep(1.0, duration=-1.0), "episode 2: duration_s is -1.0 (must be finite and >= 0)"),
        (_ep(1.0, num_segments=0), "episode 2: num_segments is 0 (must be >= 1)"),
        (_ep(1.0, process_terms={"language_mixing": float("nan")}),
         "episode 2: process term 'language_mixing' is nan (must be finite)"),
        (_ep(1.0, num_segments=2, segment_rewards=[1.0]), "episode 2: 1 segment_rewards for 2 segments"),
        (_ep(1.0, segment_rewards=[float("inf")]), "episode 2: segment_rewards has non-finite values"),
        (_ep(1.0, call_rewards=[[(1, 0.0)], []]), "episode 2: call_rewards lists 2 segments, the episode has 1"),
        (_ep(1.0, call_rewards=[[(4, 0.1), (2, 0.1)]]),
         "episode 2: call_rewards of segment 0: positions must be increasing ints >= 0, got [4, 2]"),
        (_ep(1.0, call_rewards=[[(4, float("nan"))]]), "episode 2: call_rewards of segment 0 has non-finite values"),
    ],
)
def test_bad_episode_named_by_index(bad, message):
    with pytest.raises(ValueError, match=_exact(message)):
        score_group([_ep(1.0), _ep(0.0), bad], RewardConfig())


def test_empty_group():
    with pytest.raises(ValueError, match=_exact("score_group needs at least one episode, got an empty group")):
        score_group([], RewardConfig())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(process_weights={"x": float("nan")}), "process_weights['x'] is nan (must be finite)"),
        (dict(process_weights={"outcome": 2.0}),
         "process_weights['outcome']: 'outcome' is a built-in term, not a process term"),
        (dict(completion_time_bound=-0.1), "completion_time_bound must be finite and >= 0, got -0.1"),
        (dict(gamma=1.1), "gamma must lie in [0, 1], got 1.1"),
        (dict(estimator="ppo"), "estimator must be one of ('grpo', 'rloo'), got 'ppo'"),
        (dict(eps=0.0), "eps must be > 0, got 0.0"),
        (dict(singleton_group="drop"), "singleton_group must be one of ('zero', 'raw', 'error'), got 'drop'"),
        (dict(overlong_max_tokens=0), "overlong_max_tokens must be a positive int, got 0"),
        (dict(overlong_max_tokens=10, overlong_buffer_tokens=11),
         "overlong_buffer_tokens must be an int in [0, overlong_max_tokens=10], got 11"),
        (dict(overlong_max_tokens=10, overlong_penalty=-1.0), "overlong_penalty must be finite and >= 0, got -1.0"),
        (dict(process_weights={"overlong": -1.0}),
         "process_weights['overlong']: 'overlong' is a built-in term, not a process term"),
    ],
)
def test_reward_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=_exact(message)):
        RewardConfig(**kwargs)


def test_group_baselines_errors():
    with pytest.raises(ValueError, match=_exact("a group-relative baseline needs at least 2 episodes, got 1")):
        group_baselines([1.0], "grpo", True, 1e-6)
    with pytest.raises(ValueError, match=_exact("estimator must be one of ('grpo', 'rloo'), got 'x'")):
        group_baselines([1.0, 2.0], "x", True, 1e-6)
