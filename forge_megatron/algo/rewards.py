"""Composite episode rewards and the per-group scoring the data pool runs when a group finishes.

Reward of episode i (every term is reported in ``GroupScores.terms`` and they sum to the total):

    R_i = outcome_i                                         (from the verifier / environment)
        + sum_k process_weights[k] * process_terms_i[k]     (raw measurements, e.g. malformed tool calls)
        + completion_time_i                                 (bonus in [0, bound] for fast successful episodes)
        + overlong_i                                        (optional length penalty, DAPO's soft overlong
                                                             punishment, on the episode's sampled tokens)
        + user terms                                        (optional "module:function" reward function)
        + sum_k segment_rewards_i[k]                        (optional per-segment / per-turn rewards)
        + sum_c call_rewards_i[c]                           (optional rewards of single calls inside segments)

Completion time, among the successful episodes of a group with durations d (failures get 0):

    completion_time_i = bound * min_j d_j / d_i         (fastest gets ``bound``; equal durations equal bonus)

Overlong penalty (``overlong_max_tokens`` L, ``overlong_buffer_tokens`` B, ``overlong_penalty`` p), on the n tokens
the policy sampled in the episode (every segment, every call):

    overlong_i = 0                          n <= L - B
               = -p * (n - (L - B)) / B     L - B < n <= L     (a ramp from 0 to -p over the last B tokens)
               = -p                         n > L

(DAPO penalises overlong answers this way instead of scoring truncated ones as plain failures; for agents the length
is the whole episode's sampled tokens.)

Per-segment rewards: the episode-level part (everything except ``segment_rewards`` and ``call_rewards``) is
credited to the last segment; returns use reward-to-go with discount ``gamma`` and the group baseline of
``advantages.py``. Every segment of an episode with n segments gets loss weight 1/n, so splitting an episode into
more segments does not give it more weight in the loss.

Per-call rewards (``call_rewards``: an agent rewarding single calls, e.g. a tool call that worked, while one segment
holds many calls): the episode's reward-to-go steps are, segment by segment, its rewarded calls then the segment's
end, each step's reward its own (the call's; the segment's reward at its end, plus the episode-level part at the
last), the returns ``G_j = r_j + gamma G_{j+1}`` per step. A token takes the advantage of the first step at or after
it (a call's tokens the return from that call on), so a segment's tokens carry several advantages; the group
baseline is taken on the episodes' first returns, as without them. ``GroupScores.segment_steps`` lists the steps.

A user reward function is named ``"package.module:function"`` and has the signature

    def my_reward(outcome: EpisodeOutcome) -> float | dict[str, float]

A float becomes the term ``"user"``; a dict adds one term per key (already weighted). It runs in the data pool
process once per finished episode.
"""

from __future__ import annotations

import importlib
import logging
import math
import unicodedata
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from forge_megatron.algo.advantages import ESTIMATORS, group_baselines, reward_to_go

__all__ = [
    "EpisodeOutcome", "RewardConfig", "GroupScores", "score_group", "completion_time_bonus", "ProcessContext",
    "register_process_term", "measure_process_terms", "PROCESS_TERMS", "language_mixing", "load_reward_fn",
    "overlong_penalty",
]

log = logging.getLogger(__name__)

SINGLETON_MODES = ("zero", "raw", "error")
RESERVED_TERMS = ("outcome", "completion_time", "overlong", "segment_rewards", "call_rewards")
DEFAULT_PROCESS_WEIGHTS = {"malformed_tool_calls": -0.1, "failed_tool_calls": 0.0, "language_mixing": -0.5,
                           "truncated_calls": 0.0}


@dataclass
class EpisodeOutcome:
    """What scoring needs to know about one finished episode."""

    outcome_reward: float
    success: bool
    duration_s: float
    num_segments: int = 1
    process_terms: dict[str, float] = field(default_factory=dict)
    """Raw measurements, e.g. ``{"malformed_tool_calls": 2.0, "language_mixing": 0.1}``; weights live in config."""
    segment_rewards: list[float] | None = None
    """Optional reward per segment (turn); enables reward-to-go within the episode."""
    call_rewards: list[list[tuple[int, float]]] | None = None
    """Optional rewards of single calls inside the segments (an agent's per-turn rewards through the gateway): per
    segment, ``(position, reward)`` pairs in increasing position, the position the call's last sampled token in the
    segment's tokens; each call becomes a reward-to-go step of its own (module docstring)."""
    domain: str = "default"
    metadata: dict = field(default_factory=dict)
    """Free-form task data for a user reward function (e.g. the reference answer)."""
    sampled_tokens: int = 0
    """Tokens the policy sampled in the episode (all segments): the overlong penalty's length."""

    def validate(self, where: str) -> None:
        """Raise ValueError naming ``where`` (e.g. "episode 3") for the first problem found."""
        if not math.isfinite(self.outcome_reward):
            raise ValueError(f"{where}: outcome_reward is {self.outcome_reward} (must be finite)")
        if not (math.isfinite(self.duration_s) and self.duration_s >= 0):
            raise ValueError(f"{where}: duration_s is {self.duration_s} (must be finite and >= 0)")
        if self.num_segments < 1:
            raise ValueError(f"{where}: num_segments is {self.num_segments} (must be >= 1)")
        for name, value in self.process_terms.items():
            if not math.isfinite(value):
                raise ValueError(f"{where}: process term {name!r} is {value} (must be finite)")
        if self.segment_rewards is not None:
            if len(self.segment_rewards) != self.num_segments:
                raise ValueError(
                    f"{where}: {len(self.segment_rewards)} segment_rewards for {self.num_segments} segments"
                )
            if not all(math.isfinite(r) for r in self.segment_rewards):
                raise ValueError(f"{where}: segment_rewards has non-finite values")
        if self.call_rewards is not None:
            if len(self.call_rewards) != self.num_segments:
                raise ValueError(f"{where}: call_rewards lists {len(self.call_rewards)} segments, the episode has "
                                 f"{self.num_segments}")
            for k, points in enumerate(self.call_rewards):
                positions = [p for p, _ in points]
                if any(not isinstance(p, int) or p < 0 for p in positions) or positions != sorted(set(positions)):
                    raise ValueError(f"{where}: call_rewards of segment {k}: positions must be increasing ints >= 0, "
                                     f"got {positions}")
                if not all(math.isfinite(r) for _, r in points):
                    raise ValueError(f"{where}: call_rewards of segment {k} has non-finite values")


def load_reward_fn(path: str) -> Callable:
    """Import ``"package.module:function"`` and return the callable; errors name what is missing."""
    module_name, sep, fn_name = path.partition(":")
    if not sep or not module_name or not fn_name:
        raise ValueError(f"reward_fn must look like 'package.module:function', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward_fn {path!r}: cannot import module {module_name!r} ({e})") from e
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise ValueError(f"reward_fn {path!r}: module {module_name!r} has no attribute {fn_name!r}")
    if not callable(fn):
        raise ValueError(f"reward_fn {path!r}: {fn_name!r} is not callable")
    return fn


@dataclass
class RewardConfig:
    """Composite reward and advantage estimation for one group of episodes."""

    process_weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_PROCESS_WEIGHTS))
    """Signed multiplier per process term; measurements without a weight are ignored."""
    completion_time_bound: float = 0.0
    """Largest completion-time bonus (the fastest successful episode gets it); 0 turns the term off."""
    gamma: float = 1.0
    """Reward-to-go discount across the segments/turns of an episode."""
    estimator: str = "grpo"
    """"grpo" (group mean baseline) or "rloo" (leave-one-out baseline)."""
    std_normalize: bool = True
    """Divide advantages by the group's reward std (+ eps)."""
    eps: float = 1e-6
    singleton_group: str = "zero"
    """Group of one episode: "zero" (advantage 0, a warning), "raw" (advantage = return), "error"."""
    reward_fn: str | None = None
    """Optional user reward function, ``"package.module:function"`` (see the module docstring)."""
    overlong_max_tokens: int | None = None
    """L of the overlong penalty (module docstring): sampled tokens past it cost the whole penalty; None: off."""
    overlong_buffer_tokens: int = 0
    """B: the last B tokens before L ramp the penalty up from 0 (0: a step at L)."""
    overlong_penalty: float = 1.0
    """p: the largest penalty (its weight against the outcome reward)."""
    reward_fn_callable: Callable | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, w in self.process_weights.items():
            if name in RESERVED_TERMS:
                raise ValueError(f"process_weights[{name!r}]: {name!r} is a built-in term, not a process term")
            if not math.isfinite(w):
                raise ValueError(f"process_weights[{name!r}] is {w} (must be finite)")
        if not (math.isfinite(self.completion_time_bound) and self.completion_time_bound >= 0):
            raise ValueError(f"completion_time_bound must be finite and >= 0, got {self.completion_time_bound}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must lie in [0, 1], got {self.gamma}")
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {self.estimator!r}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.singleton_group not in SINGLETON_MODES:
            raise ValueError(f"singleton_group must be one of {SINGLETON_MODES}, got {self.singleton_group!r}")
        if self.reward_fn is not None:
            self.reward_fn_callable = load_reward_fn(self.reward_fn)
        if self.overlong_max_tokens is not None:
            if not (isinstance(self.overlong_max_tokens, int) and self.overlong_max_tokens > 0):
                raise ValueError(f"overlong_max_tokens must be a positive int, got {self.overlong_max_tokens!r}")
            if not (isinstance(self.overlong_buffer_tokens, int)
                    and 0 <= self.overlong_buffer_tokens <= self.overlong_max_tokens):
                raise ValueError(f"overlong_buffer_tokens must be an int in [0, overlong_max_tokens="
                                 f"{self.overlong_max_tokens}], got {self.overlong_buffer_tokens!r}")
            if not (math.isfinite(self.overlong_penalty) and self.overlong_penalty >= 0):
                raise ValueError(f"overlong_penalty must be finite and >= 0, got {self.overlong_penalty}")


@dataclass
class GroupScores:
    """Scores of one group, episode order preserved."""

    rewards: list[float]
    """Total (composite) reward per episode."""
    terms: list[dict[str, float]]
    """Per-episode breakdown; the values of each dict sum to the episode's reward."""
    segment_advantages: list[list[float]]
    """Per episode, per segment: the scalar advantage broadcast over the segment's trained tokens."""
    segment_weights: list[list[float]]
    """Per episode, per segment: loss weight 1/num_segments (``sample_weight_S`` of ``policy_loss``)."""
    warnings: list[str] = field(default_factory=list)
    """Documented fallbacks that happened (e.g. a group of one)."""
    segment_returns: list[list[float]] = field(default_factory=list)
    """Per episode, per segment: the return G_k (reward-to-go from segment k, discount ``gamma``): a learned critic's
    value target at the segment's end (``--critic``, algo/value.py)."""
    segment_steps: list[list[list | None]] = field(default_factory=list)
    """Per episode, per segment: None, or with call rewards (``EpisodeOutcome.call_rewards``) the segment's steps
    ``[position, reward, return, advantage]``, its rewarded calls then its end (position -1); a token up to a step's
    position, after the step before, takes that step's advantage (``segment_advantages`` is the first's)."""


# ---------------------------------------------------------------- process terms


@dataclass
class ProcessContext:
    """What process-term measurements look at: the episode's generated texts and its tool-call counts."""

    texts: list[str] = field(default_factory=list)
    tool_calls: int = 0
    malformed_tool_calls: int = 0
    failed_tool_calls: int = 0
    truncated_calls: int = 0  # calls cut at max_tokens (overlong answers: DAPO penalises them)


PROCESS_TERMS: dict[str, Callable[[ProcessContext], float]] = {}


def register_process_term(name: str) -> Callable:
    """Decorator adding ``fn(ctx: ProcessContext) -> float`` to the registry under ``name``."""

    def add(fn: Callable[[ProcessContext], float]) -> Callable[[ProcessContext], float]:
        if name in PROCESS_TERMS:
            raise ValueError(f"process term {name!r} is already registered")
        PROCESS_TERMS[name] = fn
        return fn

    return add


def measure_process_terms(ctx: ProcessContext, names: list[str] | None = None) -> dict[str, float]:
    """Raw measurements for ``EpisodeOutcome.process_terms`` (all registered terms when ``names`` is None)."""
    names = list(PROCESS_TERMS) if names is None else names
    unknown = [n for n in names if n not in PROCESS_TERMS]
    if unknown:
        raise ValueError(f"unknown process terms {unknown}; registered: {sorted(PROCESS_TERMS)}")
    return {n: float(PROCESS_TERMS[n](ctx)) for n in names}


# Scripts that one language writes together count as one (Japanese mixes kanji and kana).
_SCRIPT_ALIASES = {"HIRAGANA": "CJK", "KATAKANA": "CJK", "HALFWIDTH": "CJK", "FULLWIDTH": "LATIN"}


def _script(ch: str) -> str:
    first = unicodedata.name(ch, "UNKNOWN").split(" ", 1)[0]
    return _SCRIPT_ALIASES.get(first, first)


def language_mixing(text: str) -> float:
    """Fraction of letters outside the text's dominant script (0 = one script, no letters also 0)."""
    counts = Counter(_script(ch) for ch in text if ch.isalpha())
    total = sum(counts.values())
    if total == 0:
        return 0.0
    return 1.0 - max(counts.values()) / total


@register_process_term("malformed_tool_calls")
def _malformed_tool_calls(ctx: ProcessContext) -> float:
    return float(ctx.malformed_tool_calls)


@register_process_term("failed_tool_calls")
def _failed_tool_calls(ctx: ProcessContext) -> float:
    return float(ctx.failed_tool_calls)


@register_process_term("truncated_calls")
def _truncated_calls(ctx: ProcessContext) -> float:
    return float(ctx.truncated_calls)


@register_process_term("language_mixing")
def _language_mixing(ctx: ProcessContext) -> float:
    """Language mixing of all generated text together."""
    return language_mixing("\n".join(ctx.texts))


# ---------------------------------------------------------------- scoring


def completion_time_bonus(durations_s: list[float], successes: list[bool], bound: float) -> list[float]:
    """``bound * min(d of successes) / d_i`` for successful episodes, 0 for failures (in [0, bound])."""
    if len(durations_s) != len(successes):
        raise ValueError(f"{len(durations_s)} durations for {len(successes)} success flags")
    ok = [d for d, s in zip(durations_s, successes) if s]
    if not ok or bound == 0:
        return [0.0] * len(durations_s)
    fastest = min(ok)
    return [bound * (1.0 if d <= fastest else fastest / d) if s else 0.0 for d, s in zip(durations_s, successes)]


def overlong_penalty(sampled_tokens: int, max_tokens: int, buffer_tokens: int, penalty: float = 1.0) -> float:
    """The overlong term of an episode that sampled ``sampled_tokens`` (module docstring): 0, a ramp to ``-penalty``
    over the ``buffer_tokens`` before ``max_tokens``, ``-penalty`` past it."""
    start = max_tokens - buffer_tokens
    if sampled_tokens <= start:
        return 0.0
    if sampled_tokens > max_tokens:
        return -float(penalty)
    return -float(penalty) * (sampled_tokens - start) / buffer_tokens


def _user_terms(fn: Callable, outcome: EpisodeOutcome, where: str) -> dict[str, float]:
    value = fn(outcome)
    terms = value if isinstance(value, dict) else {"user": value}
    for name, v in terms.items():
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{where}: reward_fn returned {name!r} = {v!r} (must be a finite number)")
    return {name: float(v) for name, v in terms.items()}


def _episode_terms(outcome: EpisodeOutcome, bonus: float, cfg: RewardConfig, where: str) -> dict[str, float]:
    terms = {"outcome": float(outcome.outcome_reward)}
    for name, raw in outcome.process_terms.items():
        if name in cfg.process_weights:
            terms[name] = cfg.process_weights[name] * raw
    if cfg.completion_time_bound > 0:
        terms["completion_time"] = bonus
    if cfg.overlong_max_tokens is not None:
        terms["overlong"] = overlong_penalty(outcome.sampled_tokens, cfg.overlong_max_tokens,
                                             cfg.overlong_buffer_tokens, cfg.overlong_penalty)
    if cfg.reward_fn_callable is not None:
        for name, v in _user_terms(cfg.reward_fn_callable, outcome, where).items():
            if name in terms or name in RESERVED_TERMS:
                raise ValueError(f"{where}: reward_fn term {name!r} clashes with a built-in term")
            terms[name] = v
    if outcome.segment_rewards is not None:
        terms["segment_rewards"] = math.fsum(outcome.segment_rewards)
    if outcome.call_rewards:
        terms["call_rewards"] = math.fsum(r for points in outcome.call_rewards for _, r in points)
    return terms


def _segment_steps(outcome: EpisodeOutcome, reward: float, gamma: float) -> list[list[list]]:
    """Per segment, its reward-to-go steps ``[position, reward, return]``: its rewarded calls (with
    ``call_rewards``), then its end (position -1, the segment's reward; the last segment's also the episode-level
    rest of ``reward``), the returns discounted by ``gamma`` per step."""
    per_segment = list(outcome.segment_rewards or [0.0] * outcome.num_segments)
    per_segment[-1] += reward - math.fsum(outcome.segment_rewards or []) - math.fsum(
        r for points in outcome.call_rewards or [] for _, r in points)
    steps = [[*[[p, float(r)] for p, r in (outcome.call_rewards[k] if outcome.call_rewards else [])], [-1, r_k]]
             for k, r_k in enumerate(per_segment)]
    returns = iter(reward_to_go([r for seg in steps for _, r in seg], gamma))
    return [[[p, r, next(returns)] for p, r in seg] for seg in steps]


def _singleton_advantages(returns: list[list[float]], cfg: RewardConfig, warnings: list[str]) -> list[list[float]]:
    if cfg.singleton_group == "error":
        raise ValueError("group has a single episode: no group baseline (set singleton_group='zero' or 'raw')")
    if cfg.singleton_group == "raw":
        return [list(r) for r in returns]
    msg = "group of size 1: advantages set to 0"
    log.warning(msg)
    warnings.append(msg)
    return [[0.0] * len(r) for r in returns]


def score_group(outcomes: list[EpisodeOutcome], cfg: RewardConfig) -> GroupScores:
    """Composite rewards, per-segment advantages and loss weights for one finished group."""
    if not outcomes:
        raise ValueError("score_group needs at least one episode, got an empty group")
    for i, o in enumerate(outcomes):
        o.validate(f"episode {i}")
    bonus = completion_time_bonus([o.duration_s for o in outcomes], [o.success for o in outcomes],
                                  cfg.completion_time_bound)
    terms = [_episode_terms(o, b, cfg, f"episode {i}") for i, (o, b) in enumerate(zip(outcomes, bonus))]
    rewards = [math.fsum(t.values()) for t in terms]
    steps = [_segment_steps(o, r, cfg.gamma) for o, r in zip(outcomes, rewards)]
    # every step's return, in order; a segment's return is its first step's (its start's)
    flat = [[g for seg in ep for _, _, g in seg] for ep in steps]
    warnings: list[str] = []
    if len(outcomes) == 1:
        flat_adv = _singleton_advantages(flat, cfg, warnings)
    else:
        baselines, scale = group_baselines([g[0] for g in flat], cfg.estimator, cfg.std_normalize, cfg.eps)
        flat_adv = [[(g - b) / scale for g in gs] for gs, b in zip(flat, baselines)]
    returns, advantages, seg_steps = [], [], []
    for ep, adv in zip(steps, flat_adv):
        adv = iter(adv)
        ep_steps = [[[p, r, g, next(adv)] for p, r, g in seg] for seg in ep]
        returns.append([seg[0][2] for seg in ep_steps])
        advantages.append([seg[0][3] for seg in ep_steps])
        seg_steps.append([seg if len(seg) > 1 else None for seg in ep_steps])
    weights = [[1.0 / o.num_segments] * o.num_segments for o in outcomes]
    return GroupScores(rewards, terms, advantages, weights, warnings, returns, seg_steps)
