"""Trajectory records shared by the gateway, the data pool, the transport and the trainer.

An *episode* is one agent run on one task. It is made of one or more *segments*: a segment is a single
token sequence whose every call extended the previous prompt + completion. When the agent rewrites its own
context (compression, summarisation, dropping tool output) the next call no longer extends the sequence and
a new segment starts: context management is an action, and every segment earns the episode's reward.

Per-token fields of a segment are aligned with ``tokens`` (length L):
  loss_mask[t]        1 if token t was sampled by the policy (trained on), 0 for prompt/tool/template tokens
  rollout_logprobs[t] log pi_rollout(tokens[t] | tokens[:t]) for sampled tokens, 0.0 elsewhere
  policy_versions[t]  version of the weights that sampled token t, -1 elsewhere

Optionally, for MoE models served with routed-expert capture (rollout routing replay, R3):
  routed_experts[t]   int8/int16 [layers, topk]: the experts the engine routed token t to in each layer, -1 where
                      none was recorded (dense layers, the last token, calls without capture); the trainer replays
                      them (int8 when the model has at most 128 experts)

Optionally, for on-policy distillation from a served teacher (the gateway's ``--teacher-urls``):
  teacher_logprobs[t] log pi_teacher(tokens[t] | tokens[:t]) for sampled tokens, 0.0 elsewhere
and with the gateway's ``--teacher-topk K`` (dense distillation, the trainer's ``--distill-kl forward|reverse|jsd``),
one row per *sampled* token (loss_mask = 1), in order:
  teacher_topk_ids    int32 [sampled, K]: the teacher's K most likely tokens at that position, most likely first
  teacher_topk_logprobs float32 [sampled, K]: their logprobs

Optionally, for vision-language models:
  images              the segment's images in the order of its image-token runs: each the PNG the gateway
                      normalized (multimodal/images.py), which the engine was sent and the trainer encodes

A *group* is the G episodes of one task (GRPO group); groups are the data pool's scheduling unit.
Everything here converts to and from plain msgpack-able dicts (never pickle), with validation.
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

SCHEMA_VERSION = 1

EPISODE_STATUSES = ("finished", "failed", "timed_out", "aborted")
ROUTING_DTYPES = (np.dtype(np.int8), np.dtype(np.int16))  # routed expert ids: int8 up to 128 experts


def split_images(table: list, frame) -> list:
    """Per owner (a segment or a sample), its encoded images as read-only memoryviews of ``frame`` (uint8: every
    owner's images back to back), or None: ``table`` lists each owner's image byte lengths (the wire headers'
    ``segment_images`` / ``images``)."""
    data, out, start = memoryview(frame).cast("B"), [], 0
    for lengths in table:
        images = []
        for n in lengths:
            images.append(data[start:start + n])
            start += n
        out.append(images or None)
    return out


class SchemaError(ValueError):
    """A record that does not match the schema; the message names the field."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise SchemaError(msg)


@dataclass
class Segment:
    tokens: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    policy_versions: list[int]
    # Optional per-segment reward term (e.g. a process reward for this turn range); summed into reward-to-go.
    reward: float | None = None
    # Optional int8/int16 [L, layers, topk] experts the engine routed each token to (-1: not recorded); see above.
    routed_experts: np.ndarray | None = None
    # Optional encoded images, one per run of image tokens, in order (see above); base64 strings in the JSON form.
    images: list[bytes] | None = None
    # Optional teacher logprobs of the sampled tokens (on-policy distillation; see above), 0.0 elsewhere.
    teacher_logprobs: list[float] | None = None
    # Optional teacher top-k at every sampled token (see above): int32 / float32 [sampled, K]; nested lists in JSON.
    teacher_topk_ids: np.ndarray | None = None
    teacher_topk_logprobs: np.ndarray | None = None
    # Optional rewards of single calls in this segment: [position, reward] pairs, the position the call's last sampled
    # token (loss mask 1), increasing; each is a reward-to-go step of its own (algo/rewards.py, "Per-call rewards").
    call_rewards: list[list] | None = None

    def __post_init__(self) -> None:
        if self.images is not None:
            if not isinstance(self.images, list):
                raise SchemaError("images must be a list of encoded images")
            try:  # from JSON: base64 strings
                self.images = [base64.b64decode(x, validate=True) if isinstance(x, str) else x for x in self.images]
            except (binascii.Error, ValueError) as exc:
                raise SchemaError(f"images: not base64: {exc}") from exc
        if self.routed_experts is not None and not isinstance(self.routed_experts, np.ndarray):
            try:  # from JSON: nested lists
                self.routed_experts = np.asarray(self.routed_experts, dtype=np.int16)
            except (TypeError, ValueError, OverflowError) as exc:
                raise SchemaError(f"routed_experts is not an int array: {exc}") from exc
        for name, dtype in (("teacher_topk_ids", np.int32), ("teacher_topk_logprobs", np.float32)):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, np.ndarray) and value.dtype == dtype):
                try:  # from JSON: nested lists
                    setattr(self, name, np.asarray(value, dtype=dtype))
                except (TypeError, ValueError, OverflowError) as exc:
                    raise SchemaError(f"{name} is not a {np.dtype(dtype).name} array: {exc}") from exc

    def validate(self, where: str = "segment") -> None:
        n = len(self.tokens)
        _check(n > 0, f"{where}.tokens is empty")
        r = self.routed_experts
        if r is not None:
            _check(r.dtype in ROUTING_DTYPES and r.ndim == 3 and r.shape[0] == n and r.shape[2] > 0,
                   f"{where}.routed_experts must be int8/int16 [tokens={n}, layers, topk], got {r.dtype}{list(r.shape)}")
            _check(bool((r >= -1).all()), f"{where}.routed_experts has ids below -1")
        if self.images is not None:
            _check(all(isinstance(x, (bytes, bytearray, memoryview)) and len(x) for x in self.images),
                   f"{where}.images must be non-empty encoded images (bytes)")
        for name in ("loss_mask", "rollout_logprobs", "policy_versions"):
            _check(len(getattr(self, name)) == n, f"{where}.{name} has length {len(getattr(self, name))}, tokens has {n}")
        _check(all(isinstance(t, int) and t >= 0 for t in self.tokens), f"{where}.tokens must be non-negative ints")
        _check(all(m in (0, 1) for m in self.loss_mask), f"{where}.loss_mask must be 0/1")
        _check(all(math.isfinite(x) for x in self.rollout_logprobs), f"{where}.rollout_logprobs has non-finite values")
        if self.reward is not None:
            _check(math.isfinite(self.reward), f"{where}.reward is not finite")
        if self.call_rewards is not None:
            pairs = self.call_rewards
            _check(isinstance(pairs, list) and all(
                isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], int) and not isinstance(x[0], bool)
                and isinstance(x[1], (int, float)) and not isinstance(x[1], bool) and math.isfinite(x[1])
                for x in pairs), f"{where}.call_rewards must be [position, finite reward] pairs")
            positions = [int(p) for p, _ in pairs]
            _check(positions == sorted(set(positions)) and all(1 <= p < n for p in positions),
                   f"{where}.call_rewards positions must increase and lie in [1, {n}) (a trained token: the first "
                   f"never is), got {positions}")
            _check(all(self.loss_mask[p] == 1 for p in positions),
                   f"{where}.call_rewards positions must be sampled tokens (loss_mask 1)")
        if self.teacher_logprobs is not None:
            _check(len(self.teacher_logprobs) == n,
                   f"{where}.teacher_logprobs has length {len(self.teacher_logprobs)}, tokens has {n}")
            _check(all(isinstance(x, (int, float)) and math.isfinite(x) and x <= 0 for x in self.teacher_logprobs),
                   f"{where}.teacher_logprobs must be finite logprobs (<= 0)")
        ids, logp = self.teacher_topk_ids, self.teacher_topk_logprobs
        if ids is not None or logp is not None:
            _check(ids is not None and logp is not None and self.teacher_logprobs is not None,
                   f"{where}: teacher_topk_ids and teacher_topk_logprobs come together, with teacher_logprobs")
            rows = self.num_trained_tokens
            _check(ids.ndim == 2 and ids.shape[0] == rows and ids.shape[1] > 0 and logp.shape == ids.shape,
                   f"{where}.teacher_topk_ids / _logprobs must be [sampled tokens={rows}, K], got "
                   f"{list(ids.shape)} and {list(logp.shape)}")
            _check(bool((ids >= 0).all()), f"{where}.teacher_topk_ids must be token ids (>= 0)")
            _check(bool(np.isfinite(logp).all() and (logp <= 1e-6).all()),
                   f"{where}.teacher_topk_logprobs must be finite logprobs (<= 0)")

    @property
    def num_trained_tokens(self) -> int:
        return int(sum(self.loss_mask))


@dataclass
class Episode:
    episode_id: str
    group_id: str
    task_id: str
    segments: list[Segment]
    status: str = "finished"
    domain: str = "default"
    reward: float | None = None  # outcome reward, set by the agent/env via the gateway or by a reward function
    reward_terms: dict[str, float] = field(default_factory=dict)  # process terms, completion-time term, ...
    started_at: float = 0.0  # wall clock (time.time()) of session start
    ended_at: float = 0.0  # wall clock of session end
    num_tool_calls: int = 0
    num_malformed_tool_calls: int = 0
    num_truncated_calls: int = 0  # calls that ended at max_tokens (finish_reason "length")
    metadata: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        _check(bool(self.episode_id), "episode_id is empty")
        _check(bool(self.group_id), "group_id is empty")
        _check(self.status in EPISODE_STATUSES, f"status must be one of {EPISODE_STATUSES}, got {self.status!r}")
        if self.status == "finished":
            _check(len(self.segments) > 0, "a finished episode needs at least one segment")
        for i, seg in enumerate(self.segments):
            seg.validate(f"segments[{i}]")
        if self.reward is not None:
            _check(math.isfinite(self.reward), "reward is not finite")
        for k, v in self.reward_terms.items():
            _check(math.isfinite(v), f"reward_terms[{k!r}] is not finite")

    @property
    def duration_s(self) -> float:
        return max(0.0, self.ended_at - self.started_at)

    def to_dict(self) -> dict[str, Any]:
        """Plain (JSON-able) form; routed experts become nested lists, images base64 strings."""
        d = asdict(self)
        for seg in d["segments"]:
            for name in ("routed_experts", "teacher_topk_ids", "teacher_topk_logprobs"):
                if seg[name] is not None:
                    seg[name] = seg[name].tolist()
            if seg["images"] is not None:
                seg["images"] = [base64.b64encode(bytes(x)).decode() for x in seg["images"]]
        d["schema_version"] = SCHEMA_VERSION
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Episode":
        _check(isinstance(d, dict), "episode must be a mapping")
        ver = d.get("schema_version", SCHEMA_VERSION)
        _check(ver == SCHEMA_VERSION, f"episode schema_version {ver} is not supported (expected {SCHEMA_VERSION})")
        try:
            segs = [Segment(**s) for s in d["segments"]]
            kwargs = {k: v for k, v in d.items() if k not in ("segments", "schema_version")}
            ep = cls(segments=segs, **kwargs)
        except (KeyError, TypeError) as exc:
            raise SchemaError(f"malformed episode: {exc}") from exc
        ep.validate()
        return ep


class EpisodeSink:
    """Where the gateway sends episodes. The data pool implements it; tests may use :class:`ListSink`.

    Flow: ``register_group`` once per task (G episodes), ``episode_started`` when a session opens,
    ``submit_episode`` when it ends (any status). A group is complete when all its episodes were submitted.
    """

    def register_group(self, task_id: str, size: int, domain: str = "default", metadata: dict | None = None) -> str:
        raise NotImplementedError  # pragma: no cover - interface

    def episode_started(self, group_id: str, episode_id: str) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def submit_episode(self, episode: Episode) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class ListSink(EpisodeSink):
    """In-process sink that keeps episodes in a list (tests, single-process tools)."""

    def __init__(self, id_prefix: str = "") -> None:
        self.episodes: list[Episode] = []
        self.groups: dict[str, dict] = {}
        self.started: list[tuple[str, str]] = []
        self.id_prefix = id_prefix  # group ids unique across the workers of a multi-process gateway

    def register_group(self, task_id: str, size: int, domain: str = "default", metadata: dict | None = None) -> str:
        if size < 1:
            raise SchemaError(f"group size must be >= 1, got {size}")
        group_id = f"{self.id_prefix}g{len(self.groups):08d}"
        self.groups[group_id] = {"task_id": task_id, "size": size, "domain": domain, "metadata": metadata or {}}
        return group_id

    def episode_started(self, group_id: str, episode_id: str) -> None:
        self.started.append((group_id, episode_id))

    def submit_episode(self, episode: Episode) -> None:
        episode.validate()
        self.episodes.append(episode)
