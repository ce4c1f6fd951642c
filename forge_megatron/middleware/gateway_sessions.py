"""Gateway sessions: chat rendering to token ids, per-call records, and the segment rule (token-in/token-out).

The gateway renders the chat template itself and sends token ids to the engine, so the trained tokens are exactly the
sampled tokens. Each session is one episode. For call k with prompt ids p_k and sampled completion ids c_k:

  if p_k starts with p_{k-1} + c_{k-1}:  the current segment grows by the new prompt tokens (loss_mask 0,
                                          logprob 0, policy_version -1) and then c_k (loss_mask 1, its logprobs/version)
  else:                                   a new segment of the same episode starts with p_k + c_k

*Token fidelity.* The agent sends the whole history back as text, and re-tokenising the assistant turn it got
from us can give other ids than the ones sampled (BPE merges across token boundaries, tool calls re-serialised
from parsed JSON, stop strings trimmed). So the previous turn is never re-tokenised: if the new rendering starts with
the rendering of (previous messages + the assistant message we returned), the new prompt ids are

  p_{k-1} + c_{k-1} + ids(rendered text after that assistant turn)

where the text after the turn starts right after the end-of-turn marker (the tokenizer's ``eos_token``, e.g.
``<|im_end|>``, or another end-of-turn id the model declares, e.g. gpt-oss's ``<|call|>``: :func:`model_end_ids`)
when the sampled ids already end with one, and at the marker otherwise (then the template's marker is a prompt
token). The
boundary is always at a special token, so tokenising the remainder alone equals tokenising it in context. Only a
history that renders differently (the agent rewrote or compressed it, or changed the tools) is tokenised afresh,
and that is exactly the "new segment" case.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import secrets
import time
import uuid
from array import array
from dataclasses import dataclass, field

import numpy as np

from forge_megatron.middleware.schema import Episode, Segment


def vocabulary_fingerprint(vocab: dict[str, int]) -> str:
    """A digest of a tokenizer's token -> id map, equal for tokenizers that map every token alike (the gateway's
    ``/forge/admin/state`` reports the policy's: agents/call_rewards.py checks a reward model's against it)."""
    import hashlib

    return hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()).hexdigest()[:16]


@dataclass
class CallRecord:
    """One /v1/chat/completions call as the trainer needs it. Once recorded (:meth:`Session.record`) its prompt and
    completion ids, logprobs and per-token versions are positions of its segment (``prompt_len``, ``completion_len``)
    rather than lists of their own: each call of a long conversation would otherwise hold the whole history again
    (memory quadratic in the turns: ~110 MiB for a 200-turn, 140k-token session), and Python lists of floats take 4x
    the segment's typed arrays; :meth:`Session.call_dict` gives them back."""

    prompt_ids: list[int] | None
    completion_ids: list[int] | None
    logprobs: list[float] | None
    policy_version: int  # the newest version that sampled any of its tokens
    finish_reason: str
    engine_url: str
    segment_index: int
    started_at: float
    ended_at: float
    num_tool_calls: int = 0
    num_malformed_tool_calls: int = 0
    policy_versions: list[int] | None = None  # per completion token (None: all policy_version)
    resumed: int = 0  # times the call went on after an engine aborted it (weight updates)
    sampling: dict | None = None  # temperature / top_p / top_k the engine sampled with
    prompt_len: int = 0  # set when recorded: the call's prompt is its segment's first prompt_len tokens,
    completion_len: int = 0  # its completion the completion_len after them
    response_id: str | None = None  # the id its answer carried (chatcmpl-..., cmpl-..., resp_..., msg_...)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Turn:
    """What is needed to recognise the next call as a continuation of this one. A call in flight holds its prompt
    and completion ids as lists; the turn a session keeps for its next call (:meth:`Session.record`) points at the
    segment instead, whose tokens end with exactly those ids (a long conversation's history is not held twice)."""

    messages: list[dict]
    tools: list | None
    prompt_text: str
    prompt_ids: list[int] | None
    completion_ids: list[int] | None
    assistant_message: dict
    template_kwargs: dict = field(default_factory=dict)  # extra chat-template variables it was rendered with
    segment: SegmentBuilder | None = None  # once recorded: prompt + completion ids are this segment's tokens
    completion_len: int = 0  # once recorded: how many of them are the completion
    images: list = field(default_factory=list)  # the prompt's images (normalised PNGs), in the order of their tokens
    image_urls: list = field(default_factory=list)  # the URL each came from (None: sent inline), when any came by URL

    def ids(self) -> list[int]:
        """Prompt + completion ids."""
        if self.segment is not None:
            return self.segment.tokens.tolist()
        return self.prompt_ids + self.completion_ids

    def completion(self) -> list[int]:
        if self.segment is not None:
            tokens = self.segment.tokens
            return tokens[len(tokens) - self.completion_len:].tolist()
        return self.completion_ids


class SegmentBuilder:
    """Accumulates the per-token fields of one segment, as typed arrays (21 bytes a token; lists of Python ints and
    floats take 50 or more: a gateway holds hundreds of long conversations, and the last ended ones).

    Routed experts (rollout routing replay): each call reports the routing of its whole sequence (the segment so
    far plus its new prompt and completion, minus the last token); a position keeps the routing of the first call
    that processed it, the forward whose output the sampled tokens there were drawn from (later calls get that
    prefix from the engine's prefix cache in the common case)."""

    def __init__(self) -> None:
        self.tokens = array("i")  # int32 token ids
        self.loss_mask = array("b")
        self.logprobs = array("d")  # as the engine reported them (float64)
        self.versions = array("q")  # policy versions (-1: not sampled)
        self.routed: list[np.ndarray] = []  # int8/int16 [n, layers, topk] chunks, positions [0, routed_rows)
        self.routed_rows = 0
        self.images: list[bytes] = []  # the segment's images (a call's prompt holds all of them so far), in order

    def add_routing(self, rows: np.ndarray | None) -> None:
        """Routing of positions [0, len(rows)) of the segment as one call saw them; new positions are kept."""
        if rows is None:
            return
        if rows.shape[0] > self.routed_rows:
            self.routed.append(rows[self.routed_rows:])
            self.routed_rows = rows.shape[0]

    def add_prompt(self, ids: list[int]) -> None:
        n = len(ids)
        self.tokens.extend(ids)
        self.loss_mask.frombytes(bytes(n))
        self.logprobs.frombytes(bytes(8 * n))  # 0.0
        self.versions.extend(array("q", [-1]) * n)

    def add_completion(self, ids: list[int], logprobs: list[float], version: int | list[int]) -> None:
        """``version``: of every token, or per token (a call resumed across a weight update)."""
        n = len(ids)
        versions = array("q", [version]) * n if isinstance(version, int) else array("q", version)
        if len(logprobs) != n or len(versions) != n:
            raise ValueError(f"{n} tokens but {len(logprobs)} logprobs and {len(versions)} versions")
        self.tokens.extend(ids)
        self.loss_mask.frombytes(b"\x01" * n)
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)

    def nbytes(self) -> int:
        """Memory of the recorded per-token fields and routing."""
        return sum(a.itemsize * len(a) for a in (self.tokens, self.loss_mask, self.logprobs, self.versions)) + \
            sum(r.nbytes for r in self.routed) + sum(len(x) for x in self.images)

    def to_segment(self) -> Segment:
        routed = None
        if self.routed:  # the last token (and any position no call reported) has no routing: -1
            shape = self.routed[0].shape[1:]
            missing = np.full((len(self.tokens) - self.routed_rows, *shape), -1, dtype=self.routed[0].dtype)
            routed = np.concatenate(self.routed + [missing])
        return Segment(tokens=self.tokens.tolist(), loss_mask=self.loss_mask.tolist(),
                       rollout_logprobs=self.logprobs.tolist(), policy_versions=self.versions.tolist(),
                       routed_experts=routed, images=list(self.images) or None)


def _template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: tool-call ``arguments`` given as a JSON object string (the OpenAI
    wire form) become the object, as SGLang and vLLM pass them (templates that write arguments as XML iterate over
    them; JSON templates write ``arguments | tojson``, the same text as the string the gateway returned), and
    ``reasoning_content`` is also given as ``thinking`` (the field gpt-oss's template renders; transformers >= 5 does
    the same) and, beside tool calls, as ``tool_plan`` (the plan Cohere's Command templates write before an
    action)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls and any(isinstance((c.get("function") or {}).get("arguments"), str) for c in calls):
            m = {**m, "tool_calls": [_with_object_arguments(c) for c in calls]}
        if "forge_images" in m:  # (gateway.IMAGE_KEY) the gateway's, not the template's
            m = {k: v for k, v in m.items() if k != "forge_images"}
        if m.get("reasoning_content") is not None and "thinking" not in m:
            m = {**m, "thinking": m["reasoning_content"]}  # gpt-oss's template reads the reasoning from "thinking"
        if calls and m.get("reasoning_content") is not None and "tool_plan" not in m:
            m = {**m, "tool_plan": m["reasoning_content"]}  # Command A's template: <|START_THINKING|>{{ tool_plan }}
        out.append(m)
    return out


def model_end_ids(model_path: str) -> list[int]:
    """End-of-turn ids a model declares besides its tokenizer's eos: ``eos_token_id`` (an id or a list) of its
    generation_config.json and config.json, as SGLang stops on them (gpt-oss: ``<|return|>`` and ``<|call|>``)."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        try:
            with open(os.path.join(model_path, name)) as f:
                eos = json.load(f).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        for i in eos if isinstance(eos, list) else [eos]:
            if isinstance(i, int) and not isinstance(i, bool) and i not in ids:
                ids.append(i)
    return ids


def _with_object_arguments(call: dict) -> dict:
    fn = call.get("function") or {}
    if not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call


class TemplateRenderError(ValueError):
    """The model's chat template refused the messages (its ``raise_exception``, or a value it cannot render)."""


class ChatRenderer:
    """Chat template + tokenizer of the served model (a local HF directory)."""

    def __init__(self, tokenizer, end_ids: list[int] | tuple[int, ...] = ()):
        """``end_ids``: more end-of-turn token ids than the tokenizer's eos (the model's generation_config eos
        list, e.g. gpt-oss's ``<|call|>`` next to ``<|return|>``: :func:`model_end_ids`)."""
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template")
        if tokenizer.eos_token is None:
            raise ValueError("the tokenizer has no eos_token (needed as the end-of-turn marker)")
        self.tok = tokenizer
        self.eot_ids = {tokenizer.eos_token_id, *(i for i in end_ids if 0 <= i < len(tokenizer))}
        self.eot_texts = sorted({tokenizer.decode([i], skip_special_tokens=False) for i in self.eot_ids} - {""})

    def render(self, messages: list[dict], tools: list | None, add_generation_prompt: bool,
               template_kwargs: dict | None = None) -> str:
        """The chat template's text; ``template_kwargs`` are extra template variables (e.g. Qwen3's
        ``enable_thinking``: SGLang's ``chat_template_kwargs``)."""
        import jinja2

        try:
            return self.tok.apply_chat_template(_template_messages(messages), tools=tools or None,
                                                add_generation_prompt=add_generation_prompt, tokenize=False,
                                                **(template_kwargs or {}))
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            # e.g. Mistral's "Tool call IDs should be alphanumeric strings with length 9!", gpt-oss's "Cannot pass
            # both content and thinking ...", Llama 3.1's "This model only supports single tool-calls at once!"
            raise TemplateRenderError(f"the model's chat template refused the messages: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def prompt_ids(self, prev: _Turn | None, messages: list[dict], tools: list | None,
                   template_kwargs: dict | None = None) -> tuple[str, list[int], bool]:
        """Render ``messages``; return (text, prompt ids, continues_previous) following the module rule."""
        text = self.render(messages, tools, add_generation_prompt=True, template_kwargs=template_kwargs)
        spliced = self._continuation(prev, text, tools, template_kwargs or {}) if prev is not None else None
        if spliced is not None:
            return text, spliced, True
        return text, self.encode(text), False

    def raw_prompt_ids(self, prev: _Turn | None, text: str | None,
                       ids: list[int] | None) -> tuple[str, list[int], bool]:
        """(text, prompt ids, continues_previous) of a raw prompt (``/v1/completions``). Token ids are taken as they
        are and continue the previous call when they start with its prompt + completion ids; a text continues it
        when it starts with the previous prompt text + the decoded completion ids (the sampled tokens, stop tokens
        included): those ids are kept and only the rest is tokenised. Anything else starts a new segment."""
        if prev is not None and prev.messages:
            prev = None  # a chat turn: its prompt was rendered by the template, not comparable
        if ids is not None:
            done = prev.ids() if prev is not None else None
            text = self.tok.decode(ids, skip_special_tokens=False)
            return text, list(ids), done is not None and len(ids) > len(done) and ids[:len(done)] == done
        if prev is not None:
            done_text = prev.prompt_text + self.tok.decode(prev.completion(), skip_special_tokens=False)
            if len(text) > len(done_text) and text.startswith(done_text):
                return text, prev.ids() + self.encode(text[len(done_text):]), True
        return text, self.encode(text), False

    def _continuation(self, prev: _Turn, text: str, tools: list | None, template_kwargs: dict) -> list[int] | None:
        if (tools or None) != (prev.tools or None) or template_kwargs != prev.template_kwargs or \
                len(text) <= len(prev.prompt_text) or not text.startswith(prev.prompt_text):
            return None  # cheap rejections before rendering the previous turn
        try:
            with_answer = self.render(prev.messages + [prev.assistant_message], prev.tools,
                                      add_generation_prompt=False, template_kwargs=prev.template_kwargs)
        except TemplateRenderError:
            return None  # the previous turn does not render as a history: the new prompt starts a segment
        if not with_answer.startswith(prev.prompt_text) or not text.startswith(with_answer):
            return None
        answer = with_answer[len(prev.prompt_text):]
        cut, eot = max((answer.rfind(t), t) for t in self.eot_texts)
        if cut < 0:
            return None
        sampled = prev.completion()
        ends_turn = bool(sampled) and sampled[-1] in self.eot_ids
        tail = answer[cut + len(eot):] if ends_turn else answer[cut:]
        return prev.ids() + self.encode(tail + text[len(with_answer):])

    def completion_text(self, ids: list[int], finish: dict) -> str:
        """Visible text of a completion: without a matched stop token, cut before a matched stop string."""
        matched = (finish or {}).get("matched")
        if isinstance(matched, int) and ids and ids[-1] == matched:
            ids = ids[:-1]
        text = self.tok.decode(ids, skip_special_tokens=False)
        if isinstance(matched, str) and matched in text:
            text = text[: text.index(matched)]
        return text


@dataclass
class Session:
    """One episode served through the gateway."""

    group_id: str
    task_id: str
    domain: str
    metadata: dict = field(default_factory=dict)
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    api_key: str = field(default_factory=lambda: "forge-" + secrets.token_urlsafe(24))
    started_at: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.time)  # start of the session or of its latest call, or its end
    calls: list[CallRecord] = field(default_factory=list)
    segments: list[SegmentBuilder] = field(default_factory=list)
    last_turn: _Turn | None = None
    reward: float | None = None
    reward_terms: dict = field(default_factory=dict)
    call_rewards: dict = field(default_factory=dict)  # (call index, completion token) -> reward (set_call_rewards)
    status: str | None = None  # set when ended
    ended_at: float = 0.0
    evaluation: bool = False  # an eval session: served and recorded like any other, never sent to the sink
    sampling: dict = field(default_factory=dict)  # an eval session's sampling overrides (temperature, top_p, top_k)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)  # one call at a time per session
    responses: dict = field(default_factory=dict, repr=False)  # Responses API: stored responses by id

    @property
    def ended(self) -> bool:
        return self.status is not None

    def record(self, turn: _Turn, continues: bool, call: CallRecord, routed: np.ndarray | None = None) -> None:
        """Append call ``call`` (whose prompt is ``turn.prompt_ids``) to the current or a new segment; ``routed``:
        the call's routed experts [prompt + completion - 1, layers, topk], if recorded."""
        if continues and self.segments:
            seg = self.segments[-1]
            if array("i", turn.prompt_ids[:len(seg.tokens)]) != seg.tokens:
                raise RuntimeError("continuation prompt does not extend the segment (gateway bug)")
            seg.add_prompt(turn.prompt_ids[len(seg.tokens):])
        else:
            seg = SegmentBuilder()
            self.segments.append(seg)
            seg.add_prompt(turn.prompt_ids)
        seg.add_completion(call.completion_ids, call.logprobs,
                           call.policy_versions if call.policy_versions is not None else call.policy_version)
        seg.add_routing(routed)
        if turn.images:  # the prompt's images start with the segment's (Gateway.expand_images)
            seg.images = list(turn.images)
        call.segment_index = len(self.segments) - 1
        call.prompt_len, call.completion_len = len(turn.prompt_ids), len(call.completion_ids)
        call.prompt_ids = call.completion_ids = call.logprobs = call.policy_versions = None  # in the segment now
        self.calls.append(call)
        self.last_turn = dataclasses.replace(turn, prompt_ids=None, completion_ids=None, segment=seg,
                                             completion_len=call.completion_len, images=seg.images)

    def recorded_bytes(self) -> int:
        """Memory of what the session recorded: its segments' arrays (the call records hold positions of them)."""
        return sum(seg.nbytes() for seg in self.segments)

    def call_dict(self, call: CallRecord) -> dict:
        """A recorded call as a dict, its prompt and completion ids, logprobs and per-token policy versions read back
        from its segment."""
        out = call.to_dict()
        if call.prompt_ids is None:
            seg = self.segments[call.segment_index]
            lo, hi = call.prompt_len, call.prompt_len + call.completion_len
            out["prompt_ids"] = seg.tokens[:lo].tolist()
            out["completion_ids"] = seg.tokens[lo:hi].tolist()
            out["logprobs"] = seg.logprobs[lo:hi].tolist()
            out["policy_versions"] = seg.versions[lo:hi].tolist()
        return out

    def set_call_rewards(self, items: list) -> list[dict]:
        """``items``: ``{"call": index, "reward": r}`` objects, optionally with ``"token": k``: the index a call of
        this session in the order :meth:`summary` lists them (negative from the end: -1 the latest; or ``"response":
        id`` in its place, the call whose answer carried that id, ``chatcmpl-...`` / ``cmpl-...`` / ``resp_...`` /
        ``msg_...``) and ``k`` one of its completion's tokens (negative from its end; default -1, the last: a reward
        of the whole call; another marks the end of a step inside it, e.g. a reasoning step a process reward model
        scored). Each sets (replaces) the
        reward at that token. Raises ValueError naming the bad item; nothing is set unless all are good. Returns
        every reward set, as ``{"call", "token", "reward"}`` items in order."""
        if not isinstance(items, list):
            raise ValueError("call_rewards must be a list of {call, reward} objects")
        new = {}
        by_response = {c.response_id: i for i, c in enumerate(self.calls) if c.response_id}
        for i, item in enumerate(items):
            where = f"call_rewards[{i}]"
            keys = set(item) if isinstance(item, dict) else set()
            if len(keys & {"call", "response"}) != 1 or not {"reward"} <= keys <= {"call", "response", "token",
                                                                                  "reward"}:
                raise ValueError(f"{where} must be an object with the keys call (or response: the id of the call's "
                                 "answer) and reward, and optionally token")
            if "response" in item:
                if item["response"] not in by_response:
                    raise ValueError(f"{where}.response {item['response']!r} is the id of none of the session's "
                                     f"{len(self.calls)} calls")
                item = {**item, "call": by_response[item["response"]]}
            index, reward, token = item["call"], item["reward"], item.get("token", -1)
            if isinstance(index, bool) or not isinstance(index, int) or not -len(self.calls) <= index < len(self.calls):
                raise ValueError(f"{where}.call must be the index of one of the session's {len(self.calls)} calls "
                                 f"(negative from the latest), got {index!r}")
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                raise ValueError(f"{where}.reward must be a finite number")
            index %= len(self.calls)
            n = self.calls[index].completion_len
            if n == 0:
                raise ValueError(f"{where}: call {index} sampled no tokens; there is no token to credit its reward to")
            if isinstance(token, bool) or not isinstance(token, int) or not -n <= token < n:
                raise ValueError(f"{where}.token must index one of call {index}'s {n} completion tokens (negative "
                                 f"from its end), got {token!r}")
            new[(index, token % n)] = float(reward)
        self.call_rewards.update(new)
        return [{"call": c, "token": t, "reward": r} for (c, t), r in sorted(self.call_rewards.items())]

    def _segment_call_rewards(self, malformed_reward: float = 0.0) -> list[list | None]:
        """Per segment: its calls' rewards as ``[position, reward]``, the position the rewarded completion token in
        the segment (the nearest sampled one at or before it within the call: tokens of a resumed call's
        continuation are all sampled, so this is the token itself but for an engine's odd record).
        ``malformed_reward`` (the gateway's --malformed-call-reward) adds that much per malformed tool call at the
        last token of the call that made it."""
        rewards = dict(self.call_rewards)
        if malformed_reward:
            for index, call in enumerate(self.calls):
                if call.num_malformed_tool_calls and call.completion_len:
                    key = (index, call.completion_len - 1)
                    rewards[key] = rewards.get(key, 0.0) + malformed_reward * call.num_malformed_tool_calls
        out: list[list | None] = [None] * len(self.segments)
        for (index, token), reward in sorted(rewards.items()):
            call = self.calls[index]
            mask = self.segments[call.segment_index].loss_mask
            pos = call.prompt_len + token
            while pos >= call.prompt_len and not mask[pos]:
                pos -= 1
            if pos < call.prompt_len:
                continue  # (no sampled token left in the call up to it: nothing to credit)
            points = out[call.segment_index] = out[call.segment_index] or []
            if points and points[-1][0] == pos:  # two rewards landing on one token add up
                points[-1][1] += reward
            else:
                points.append([pos, reward])
        return out

    def to_episode(self, malformed_call_reward: float = 0.0) -> Episode:
        """The episode the session recorded; ``malformed_call_reward``: see :meth:`_segment_call_rewards`."""
        segments = [s.to_segment() for s in self.segments]
        for seg, rewards in zip(segments, self._segment_call_rewards(malformed_call_reward)):
            seg.call_rewards = rewards
        return Episode(
            episode_id=self.session_id, group_id=self.group_id, task_id=self.task_id,
            segments=segments, status=self.status or "aborted", domain=self.domain,
            reward=self.reward, reward_terms=dict(self.reward_terms), started_at=self.started_at,
            ended_at=self.ended_at, num_tool_calls=sum(c.num_tool_calls for c in self.calls),
            num_malformed_tool_calls=sum(c.num_malformed_tool_calls for c in self.calls),
            num_truncated_calls=sum(c.finish_reason == "length" for c in self.calls),
            metadata={**self.metadata, "num_calls": len(self.calls)},
        )

    def sampled_stats(self) -> dict:
        """Policy-sampled tokens and the oldest/newest policy version that sampled them ([] when none did)."""
        versions = np.concatenate([np.zeros(0, np.int64)] + [
            np.frombuffer(seg.versions, np.int64)[np.frombuffer(seg.loss_mask, np.int8) > 0] for seg in self.segments])
        return {"completion_tokens": int(versions.size),
                "policy_versions": [int(versions.min()), int(versions.max())] if versions.size else []}

    def summary(self) -> dict:
        return {"session_id": self.session_id, "group_id": self.group_id, "eval": self.evaluation,
                "status": self.status, "reward": self.reward, "num_segments": len(self.segments),
                "call_rewards": [{"call": c, "token": t, "reward": r} for (c, t), r in sorted(self.call_rewards.items())],
                "calls": [self.call_dict(c) for c in self.calls]}
