"""What the trainer receives from the data pool: one sample per segment of every episode of a group.

A group's episodes are scored by the algorithm layer when the group completes
(``forge_megatron.algo.rewards.score_group``); here each segment becomes a :class:`TrainSample` whose per-token
advantage is the segment's advantage on trained tokens and zero elsewhere:

    advantages_L[t] = A_segment * loss_mask_L[t]

Episode -> EpisodeOutcome mapping (the pool's contract with the algorithm layer):
  outcome_reward  = episode.reward (0.0 when the agent/env set none)
  success         = episode.metadata["success"] when present, else outcome_reward > 0
  duration_s      = episode.ended_at - episode.started_at
  num_segments    = len(episode.segments)
  process_terms   = episode.reward_terms plus {"malformed_tool_calls": num_malformed_tool_calls,
                                               "truncated_calls": num_truncated_calls}
  segment_rewards = [segment.reward or 0.0 per segment]
  domain          = episode.domain
  metadata        = the group's task metadata updated with episode.metadata (for a user reward function)
  sampled_tokens  = the policy-sampled tokens of all its segments (the overlong penalty's length)

Routed experts (rollout routing replay), when the episodes carry them, travel as one more int8/int16 array
[T, layers, topk] next to the per-token ones (``-1`` rows where nothing was recorded); teacher logprobs (the
gateway's ``--teacher-urls``) as one more float32 array [T].

Legend: L = tokens of one segment, T = tokens of all samples of a batch concatenated, S = samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from forge_megatron.middleware.schema import Episode, split_images

# (field name, dtype) of every per-token array of a sample, in wire order.
TOKEN_FIELDS = (
    ("tokens", np.int32),
    ("loss_mask", np.uint8),
    ("rollout_logprobs", np.float32),
    ("policy_versions", np.int32),
    ("advantages", np.float32),
)


@dataclass
class TrainSample:
    """One segment of one episode, with its advantage broadcast on the trained tokens.

    Arrays delivered by the pool or the transport are read-only views of one buffer per batch; copy to modify.
    """

    tokens: np.ndarray  # int32 [L]
    loss_mask: np.ndarray  # uint8 [L]
    rollout_logprobs: np.ndarray  # float32 [L]
    policy_versions: np.ndarray  # int32 [L]
    advantages: np.ndarray  # float32 [L]
    sample_weight: float
    group_index: int
    episode_id: str
    domain: str
    reward: float
    routed_experts: np.ndarray | None = None  # int8/int16 [L, layers, topk] (routing replay), -1: not recorded
    # vision-language models: one image per run of image tokens, in order: encoded bytes (what the pool delivers;
    # the trainer runs the checkpoint's image processor) or a multimodal.ImageInput (patches already made)
    images: list | None = None
    teacher_logprobs: np.ndarray | None = None  # float32 [L]: a served teacher's logprobs of the sampled tokens
    # a served teacher's top-k at each sampled token (loss_mask = 1), in order: int32 / float32 [sampled, K]
    teacher_topk_ids: np.ndarray | None = None
    teacher_topk_logprobs: np.ndarray | None = None
    # the segment's return (reward-to-go within its episode): a learned critic's value target (--critic); None: the
    # episode's reward (batches of pools from before 2026-12-05, offline files). With call rewards, the return from
    # the segment's end (after its last rewarded call)
    segment_return: float | None = None
    # rewards of single calls in the segment (the gateway's per-call rewards): [position, reward] pairs, the position
    # the call's last sampled token; a critic's GAE takes them as rewards at those tokens
    call_rewards: list | None = None


@dataclass
class TrainBatch:
    batch_id: int
    samples: list[TrainSample]
    group_indices: list[int]
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(getattr(s, name).nbytes for s in self.samples for name, _ in TOKEN_FIELDS) + \
            sum(s.routed_experts.nbytes for s in self.samples if s.routed_experts is not None) + \
            sum(s.teacher_logprobs.nbytes for s in self.samples if s.teacher_logprobs is not None) + \
            sum(s.teacher_topk_ids.nbytes + s.teacher_topk_logprobs.nbytes for s in self.samples
                if s.teacher_topk_ids is not None) + \
            sum(len(im) if isinstance(im, (bytes, memoryview)) else im.pixel_values.nbytes
                for s in self.samples for im in s.images or ())


def episode_outcome(episode: Episode, task_metadata: dict | None = None):
    """The algorithm layer's view of one episode (mapping documented in the module docstring)."""
    from forge_megatron.algo.rewards import EpisodeOutcome

    reward = 0.0 if episode.reward is None else float(episode.reward)
    success = bool(episode.metadata.get("success", reward > 0))
    terms = {k: float(v) for k, v in episode.reward_terms.items()}
    terms["malformed_tool_calls"] = float(episode.num_malformed_tool_calls)
    terms["truncated_calls"] = float(episode.num_truncated_calls)
    return EpisodeOutcome(
        outcome_reward=reward,
        success=success,
        duration_s=episode.duration_s,
        num_segments=len(episode.segments),
        process_terms=terms,
        segment_rewards=[0.0 if s.reward is None else float(s.reward) for s in episode.segments],
        call_rewards=[[(int(p), float(r)) for p, r in s.call_rewards or []] for s in episode.segments]
        if any(s.call_rewards for s in episode.segments) else None,
        domain=episode.domain,
        metadata={**(task_metadata or {}), **episode.metadata},
        sampled_tokens=sum(s.num_trained_tokens for s in episode.segments),
    )


def score_episodes(episodes: list[Episode], reward_config, task_metadata: dict | None = None) -> dict[str, Any]:
    """Score a completed group; returns plain lists (stored in the pool's database as msgpack)."""
    from forge_megatron.algo.rewards import score_group

    outcomes = [episode_outcome(ep, task_metadata) for ep in episodes]
    scores = score_group(outcomes, reward_config)
    return {
        "rewards": [float(r) for r in scores.rewards],
        "successes": [bool(o.success) for o in outcomes],
        "segment_advantages": [[float(a) for a in row] for row in scores.segment_advantages],
        "segment_weights": [[float(w) for w in row] for row in scores.segment_weights],
        "segment_returns": [[float(g) for g in row] for row in scores.segment_returns],
        **({"segment_steps": [[None if st is None else [[int(p), float(r), float(g), float(a)] for p, r, g, a in st]
                               for st in row] for row in scores.segment_steps]}
           if any(st is not None for row in scores.segment_steps for st in row) else {}),
    }


def group_samples(episodes: list[tuple[dict[str, Any], list[np.ndarray]]], scores: dict[str, Any],
                  group_index: int) -> list[TrainSample]:
    """One :class:`TrainSample` per segment of every scored episode.

    ``episodes`` are in wire form (``wire.episode_to_wire``): a header with ``episode_id``, ``domain`` and
    ``segment_lengths``, and the four per-token arrays of all segments concatenated (plus the routed experts when
    the header has ``routing_shape``, and the segments' encoded images last when it has ``segment_images``; the
    teacher logprobs right after the four when it has ``teacher_logprobs``, and the teacher's top-k ids and logprobs
    after them when it has ``teacher_topk``); samples are views of them.
    """
    samples = []
    for e, (meta, arrays_T) in enumerate(episodes):
        lengths = list(meta["segment_lengths"])
        bounds = np.cumsum([0] + lengths)
        teacher_T = arrays_T[4] if meta.get("teacher_logprobs") else None
        k = meta.get("teacher_topk")
        routing = meta.get("routing_shape")
        routed_T = arrays_T[4 + (teacher_T is not None) + 2 * bool(k)].reshape(-1, *routing) if routing else None
        images = _segment_images(meta, arrays_T)
        sampled = [int(np.count_nonzero(arrays_T[1][lo:hi])) for lo, hi in zip(bounds[:-1], bounds[1:])]
        teachers = teacher_parts(meta, teacher_T, (arrays_T[5], arrays_T[6], k) if k else None, lengths, sampled,
                                 f"episode {meta['episode_id']}")
        for s, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            tokens_L, loss_mask_L, logprobs_L, versions_L = (a[lo:hi] for a in arrays_T[:4])
            teacher, top = teachers[s]
            advantage = np.float32(scores["segment_advantages"][e][s])
            returns = scores.get("segment_returns")  # (groups scored before 2026-12-05 have none)
            segment_return = float(returns[e][s]) if returns else None
            steps = scores["segment_steps"][e][s] if scores.get("segment_steps") else None
            advantages = np.where(loss_mask_L == 1, advantage, np.float32(0.0))
            calls = None
            if steps is not None:  # per-call rewards: each call's tokens take the advantage from that call on
                advantages, segment_return = _step_advantages(steps, loss_mask_L), float(steps[-1][2])
                calls = [[int(p), float(r)] for p, r, _, _ in steps[:-1]]
            samples.append(
                TrainSample(
                    tokens=tokens_L,
                    loss_mask=loss_mask_L,
                    rollout_logprobs=logprobs_L,
                    policy_versions=versions_L,
                    advantages=advantages,
                    sample_weight=scores["segment_weights"][e][s],
                    group_index=group_index,
                    episode_id=meta["episode_id"],
                    domain=meta["domain"],
                    reward=scores["rewards"][e],
                    segment_return=segment_return,
                    call_rewards=calls,
                    routed_experts=None if routed_T is None else routed_T[lo:hi],
                    images=images[s],
                    teacher_logprobs=teacher,
                    teacher_topk_ids=None if top is None else top[0],
                    teacher_topk_logprobs=None if top is None else top[1],
                )
            )
    return samples


def _step_advantages(steps: list, loss_mask_L: np.ndarray) -> np.ndarray:
    """float32 [L]: each trained token the advantage of the first step at or after it (``steps``: a segment's
    ``[position, reward, return, advantage]``, its rewarded calls then its end at position -1)."""
    out = np.full(loss_mask_L.shape, np.float32(steps[-1][3]), dtype=np.float32)
    lo = 0
    for p, _, _, a in steps[:-1]:
        out[lo:p + 1] = a
        lo = p + 1
    return np.where(loss_mask_L == 1, out, np.float32(0.0))


def teacher_parts(meta: dict, teacher_T, topk, lengths: list[int], sampled: list[int], where: str) -> list:
    """Per item (segment or sample) of a wire form, ``(teacher logprobs [L] or None, (top-k ids [S, K], logprobs
    [S, K]) or None)`` from the flat frames: ``teacher_T`` float32 [T] (the header's ``teacher_missing`` items hold
    zeros there and get None), ``topk`` (flat ids, flat logprobs, K) or None (rows for the sampled tokens of every
    item not in ``teacher_topk_missing``). ``lengths`` / ``sampled``: each item's tokens and sampled tokens. A
    frame of another size raises ValueError naming ``where``."""
    n = len(lengths)
    missing = set(meta.get("teacher_missing") or ())
    topk_missing = set(meta.get("teacher_topk_missing") or ())
    if not all(isinstance(i, int) and 0 <= i < n for i in missing | topk_missing):
        raise ValueError(f"{where} teacher_missing / teacher_topk_missing must list item indices below {n}")
    out, bounds = [], np.cumsum([0] + list(lengths))
    rows = 0
    if topk is not None:
        ids_flat, logp_flat, k = topk
        want = sum(s for i, s in enumerate(sampled) if i not in topk_missing) * k
        if ids_flat.size != want or logp_flat.size != want:
            raise ValueError(f"{where} teacher top-k must hold {want} values (sampled tokens x {k}), got "
                             f"{ids_flat.size} and {logp_flat.size}")
    for i in range(n):
        lo, hi = bounds[i], bounds[i + 1]
        teacher = None if teacher_T is None or i in missing else teacher_T[lo:hi]
        top = None
        if topk is not None and i not in topk_missing:
            top = (ids_flat[rows * k:(rows + sampled[i]) * k].reshape(sampled[i], k),
                   logp_flat[rows * k:(rows + sampled[i]) * k].reshape(sampled[i], k))
            rows += sampled[i]
        out.append((teacher, top))
    return out


def _segment_images(meta: dict, arrays_T: list) -> list:
    """Per segment of a wire-form episode, its encoded images (memoryviews of the last array) or None."""
    table = meta.get("segment_images")
    return split_images(table, arrays_T[-1]) if table else [None] * len(meta["segment_lengths"])


def group_staleness(samples: list[TrainSample], policy_version: int) -> int:
    """Version lag of a group: current policy version minus the oldest version that sampled any of its tokens."""
    versions = [s.policy_versions[s.loss_mask.astype(bool)] for s in samples]
    versions = [v for v in versions if v.size]
    if not versions:
        return 0
    return max(0, int(policy_version) - int(min(v.min() for v in versions)))
