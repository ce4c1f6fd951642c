"""forge-gateway: the OpenAI-compatible front door that turns any agent's API calls into training data.

Black-box agents only need an OpenAI base URL and API key. The gateway gives each episode a session key, renders the
chat template itself, calls engines with token ids through :class:`EngineFleet`, parses tool calls, answers in the
OpenAI schema, and records every call (prompt ids, completion ids, logprobs, policy version) into segments (see
``gateway_sessions``). Ended sessions become :class:`~forge_megatron.middleware.schema.Episode` records sent to an
:class:`EpisodeSink` (the data pool, or a ListSink in tests).

Routes
  POST /v1/chat/completions, GET /v1/models                 (also under /s/<session key>/v1/...)
  POST /v1/messages   Anthropic's Messages API, same sessions and recording (``anthropic_api``)
  POST /v1/responses  OpenAI's Responses API (Codex CLI, the Agents SDK), same sessions and recording
                      (``responses_api``); GET / DELETE /v1/responses/{id}: the session's stored responses
  POST /v1/completions  a raw prompt (text or token ids; no template, no parsers) for agents that render their own
  POST /forge/groups {task_id, size, domain, metadata}        -> {group_id}
  POST /forge/sessions {group_id, metadata}                   -> {session_id, api_key, base_url, anthropic_base_url}
  POST /forge/sessions {eval: true, task_id, domain, metadata} -> an evaluation session: served and recorded the same
                                                                 way, never sent to the sink (not trained on)
  GET  /forge/sessions/{id}                                   -> the call records
  POST /forge/sessions/{id}/reward {reward, terms, call_rewards: [{call | response, token?, reward}]}
  POST /forge/sessions/{id}/end {status}                      -> the episode goes to the sink; answers with the
                                                                 policy versions that sampled it
  POST /forge/admin/pause {drain_timeout_s}, POST /forge/admin/resume {policy_version, lora_name},
  GET /forge/admin/state   (``lora_name``: the engines serve the policy as that LoRA adapter: every call from now on
                           names it, and its tokens are the adapter's version; the trainer's --weight-sync-lora adapter)
  POST /forge/evals {policy_version, pass@1, ...} -> {id, gateway};  GET /forge/evals?after=ID -> {evals, gateway}
                    (kept in memory, the last 1000; ``gateway`` changes when the gateway restarts, ids start again)
  GET  /metrics       Prometheus text format: the gateway's counters and gauges, the engines', and the data pool's
                      when it is the sink (forge-node); admin token like /forge/* when one is set
                      evaluation results (agents/evaluate.py publishes them, the trainer logs them), last 1000 kept

Images (Qwen3-VL, Qwen3.5 and GLM-4.xV checkpoints with an image processor): inline image parts of user messages and tool results (all three
APIs) are normalised once (multimodal/images.py: resized to the processor's grid, a PNG), rendered as the model's
image text, expanded to their token counts and sent to the engine as SGLang's ``image_data``; the segment records
them, and a call continues it only when its images start with the segment's (:meth:`Gateway.expand_images`).

``tool_choice`` "required" or {"type": "function", "function": {"name": X}} is enforced by forcing a prefix: the
parser's tool-call opening (``ToolParser.forced_prefix``) is appended to the prompt ids, so it is prompt (loss mask 0,
policy version -1; the policy did not sample it), the engine continues from it, and the parser reads prefix +
completion. While paused (weights being updated) new calls wait up to ``pause_wait_s`` instead of failing; a call
whose engine aborted it for an update goes on after resume from the tokens it had sampled (prompt + those tokens as
input, the parts joined into one completion with per-token policy versions; a stream continues unbroken), or with
``resume_aborted=False`` is re-issued from its prompt (a stream that had sent content then ends with an
OpenAI-style error event, code ``aborted``).

Sampling parameters of training calls. SGLang returns the logprob of each sampled token under softmax(z / T), the
distribution at the call's temperature T before any top_p / top_k cut, and the trainer scores tokens under
softmax(z / T_train) (``--rollout-temperature``, default 1). Recorded and trained logprobs agree, and the tokens come
from the distribution the recorded logprobs describe, only when a call samples at T_train with top_p 1 and no
top_k: the *policy temperature* (``GatewayConfig.policy_temperature``, ``--policy-temperature``). Agents often ask
otherwise (temperature 0.2 for "reliable" tool use); their importance ratios are then off. With
``policy_sampling`` the gateway samples every training call at the policy temperature, top_p 1, no top_k whatever
the agent sent (``stats["policy_sampling_overrides"]`` counts calls it changed); without it, it counts other calls
as ``stats["tempered_calls"]`` and warns once. Evaluation sessions are never trained on: they
honour the agent's values, or the session's own ``sampling`` given when it was opened (e.g. temperature 0 for
greedy evaluation). ``/forge/*`` needs
the admin token when one is configured, and one must be configured when binding beyond loopback. Errors use OpenAI's
body ``{"error": {message, type, param, code}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import ipaddress
import json
import logging
import os
import secrets
import threading
import time
import uuid
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np
from aiohttp import web

from forge_megatron.multimodal.images import IMAGE_MARK, ImageError, content_parts
from forge_megatron.middleware.gateway_sessions import (
    CallRecord, ChatRenderer, Session, TemplateRenderError, _Turn, model_end_ids, vocabulary_fingerprint,
)
from forge_megatron.middleware.schema import EPISODE_STATUSES, EpisodeSink, ListSink, SchemaError
from forge_megatron.middleware.reasoning_parsers import get_reasoning_parser, reasoning_parser_names
from forge_megatron.middleware.tool_parsers import CannotForceToolCall, get_parser, parser_names
from forge_megatron.rollout.lora_serving import policy_adapter_version
from forge_megatron.rollout.launch import print_ready, serve_app, until_terminated
from forge_megatron.rollout.sglang_client import (
    EngineFleet, EngineRequestError, FleetConfig, NoEngineAvailable, SharedLoad,
)

log = logging.getLogger("forge.gateway")

ROLES = ("system", "user", "assistant", "tool", "developer")
ABORT_RETRIES = 5
MAX_GROUPS = 100_000  # groups a gateway remembers for opening sessions (a run's in flight are a few hundred)


@dataclass
class GatewayConfig:
    """Gateway settings (CLI flags mirror the field names)."""

    model_path: str  # local HF directory: tokenizer + chat template + config (context length)
    engine_urls: list[str]  # SGLang-compatible engines
    host: str = "127.0.0.1"
    port: int = 8000
    public_url: str | None = None  # base of the URLs handed to agents (default: advertised_url(host, port))
    admin_token: str | None = None  # required for /forge/* when set; must be set when host is not loopback
    tool_parser: str = "hermes"  # tool_parsers.py: the served model family's tool-call format
    reasoning_parser: str | None = None  # reasoning_parsers.py: answer thinking blocks as reasoning_content
    chat_template_kwargs: dict = field(default_factory=dict)  # extra template variables; a request's own win
    served_model_name: str | None = None  # /v1/models id (default: the model directory name)
    context_length: int | None = None  # default: max_position_embeddings from config.json
    default_max_tokens: int = 1024  # when the request sets neither max_tokens nor max_completion_tokens
    max_body_bytes: int = 8 << 20
    image_threads: int = 4  # threads that decode and normalise the agents' new images (PIL works outside the GIL)
    # Image URLs (multimodal/fetch.py): none are fetched unless hosts (globs) or a directory (file:// URLs) are given
    image_url_hosts: tuple[str, ...] = ()
    image_url_private: bool = False  # hosts that resolve to private / loopback / link-local addresses too
    image_dir: str | None = None
    image_url_timeout_s: float = 10.0
    pause_wait_s: float = 120.0  # how long a call waits for resume before 503
    engine_attempts: int = 3  # engines tried per call
    health_interval_s: float = 2.0
    keep_ended_sessions: int = 1000  # ended sessions kept for GET /forge/sessions/{id}; older ones are forgotten
    keep_ended_mib: float = 1024.0  # ... and at most this much of their recorded tokens (MoE routing included)
    return_routed_experts: bool = False  # MoE: record each token's experts for rollout routing replay (R3)
    resume_aborted: bool = True  # a call aborted by a weight update goes on from the tokens it sampled (partial
    # rollout: per-token versions and logprobs stay exact); False: it is re-issued from its prompt
    # Training calls sample from the trained policy (policy_temperature, top_p 1, no top_k) whatever the agent asks:
    # only then are the engine's logprobs those of the distribution sampled and of the one trained (module doc).
    policy_sampling: bool = False
    policy_temperature: float = 1.0  # the trainer's --rollout-temperature (see the module docstring)
    # Open sessions with no call for this long (none in flight) are ended as timed_out and sent to the sink, so
    # sessions whose agent or driver died do not stay in memory for the rest of the run. None: never.
    session_idle_timeout_s: float | None = None
    # Run the Python code a checkpoint ships for its tokenizer or config (Kimi-K2's tiktoken tokenizer, configs of
    # model types transformers does not know), from model_path only: nothing is downloaded. SGLang's flag.
    trust_remote_code: bool = False
    # A new session opens on the engine its group's sessions use (one cached prefill of the task's shared prompt)
    # unless that engine has more than this many calls in flight over the least-loaded one; None: least-loaded only.
    group_affinity_slack: int | None = 32
    # Set by the front of a multi-process gateway (gateway_front.py) on each of its workers: session ids and API keys
    # start with it, so the front routes a session's requests to the worker that holds the session.
    worker_tag: str | None = None
    # Set by the front on each worker too: the workers' shared table of calls in flight per engine (SharedLoad) and
    # this worker's row of it, so each routes by the whole gateway's load.
    engine_load_file: str | None = None
    engine_load_row: int = 0
    # On-policy distillation from a served teacher (middleware/teacher.py): SGLang engines serving it; each episode's
    # sampled tokens are scored with it when the episode ends, before it goes to the sink.
    teacher_urls: tuple[str, ...] = ()
    teacher_timeout_s: float = 120.0
    teacher_prompt: str | None = None  # a privileged system message the teacher reads first (middleware/teacher.py)
    teacher_topk: int = 0  # > 0: also the teacher's top-k tokens at every sampled token (dense distillation)
    # a reward on each call per malformed tool call it made, at its last token (the pool's episode-level
    # malformed_tool_calls weight must then be 0: forge-node sets it); 0: off
    malformed_call_reward: float = 0.0

    def __post_init__(self):
        if not self.engine_urls:
            raise ValueError("engine_urls is empty: give at least one engine URL")
        if not os.path.isdir(self.model_path):
            raise ValueError(f"model_path {self.model_path!r} is not a directory")
        if not _is_loopback(self.host) and not self.admin_token:
            raise ValueError(f"admin_token is required when host {self.host!r} is not a loopback address")
        get_parser(self.tool_parser)
        get_reasoning_parser(self.reasoning_parser)
        if not isinstance(self.chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict, got {self.chat_template_kwargs!r}")
        for name in ("default_max_tokens", "max_body_bytes", "engine_attempts", "keep_ended_sessions", "image_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.pause_wait_s < 0:
            raise ValueError(f"pause_wait_s must be >= 0, got {self.pause_wait_s}")
        self.image_url_hosts = tuple(self.image_url_hosts)  # (a list when the front passes the config on as JSON)
        self.url_policy()  # ValueError for a missing directory or a bad timeout
        if not self.keep_ended_mib >= 0:
            raise ValueError(f"keep_ended_mib must be >= 0, got {self.keep_ended_mib}")
        if self.session_idle_timeout_s is not None and not self.session_idle_timeout_s > 0:
            raise ValueError(f"session_idle_timeout_s must be > 0 or None, got {self.session_idle_timeout_s}")
        if not (isinstance(self.policy_temperature, (int, float)) and 0 < self.policy_temperature <= 2):
            raise ValueError(f"policy_temperature must be in (0, 2], got {self.policy_temperature!r}")
        if self.group_affinity_slack is not None and self.group_affinity_slack < 0:
            raise ValueError(f"group_affinity_slack must be >= 0 or None, got {self.group_affinity_slack}")
        self.teacher_urls = tuple(self.teacher_urls)
        if self.teacher_prompt is not None and not self.teacher_urls:
            raise ValueError("teacher_prompt needs teacher_urls (the teacher that reads it)")
        if isinstance(self.teacher_topk, bool) or not isinstance(self.teacher_topk, int) or self.teacher_topk < 0:
            raise ValueError(f"teacher_topk must be an int >= 0, got {self.teacher_topk!r}")
        if self.teacher_topk and not self.teacher_urls:
            raise ValueError("teacher_topk needs teacher_urls (the teacher whose top-k tokens are recorded)")
        if not self.teacher_timeout_s > 0:
            raise ValueError(f"teacher_timeout_s must be > 0, got {self.teacher_timeout_s}")
        if self.worker_tag is not None and not (self.worker_tag.isascii() and self.worker_tag.isalnum()):
            raise ValueError(f"worker_tag must be letters and digits, got {self.worker_tag!r}")

    def url_policy(self):
        """The image URLs this gateway fetches (multimodal/fetch.py)."""
        from forge_megatron.multimodal.fetch import UrlPolicy

        return UrlPolicy(hosts=self.image_url_hosts, private=self.image_url_private, directory=self.image_dir,
                         timeout_s=self.image_url_timeout_s)


def advertised_url(host: str, port: int) -> str:
    """The base URL handed to agents for a server bound to ``host``: bound to every interface (0.0.0.0, ::), the
    machine's host name, which agents on this machine and on others resolve (``--public-url`` overrides)."""
    import socket

    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


def _too_many_aborts() -> ApiError:
    return ApiError(503, f"the call was aborted by weight updates {ABORT_RETRIES} times; retry it later",
                    "service_unavailable", code="aborted")


@dataclass
class ChatRequest:
    """The validated subset of an OpenAI chat-completions body."""

    messages: list[dict]
    tools: list | None
    tool_choice: object
    sampling: dict
    stream: bool
    include_usage: bool = False
    logprobs: bool = False  # return OpenAI choice.logprobs (of the sampled tokens; streamed with their chunks)
    top_logprobs: int = 0  # and, per token, this many most likely alternatives (chat top_logprobs, legacy logprobs=k)
    separate_reasoning: bool = True  # SGLang's field: thinking blocks as reasoning_content (with a reasoning parser)
    template_kwargs: dict = field(default_factory=dict)  # SGLang's chat_template_kwargs (e.g. enable_thinking)
    # /v1/completions: the prompt as text or token ids (messages empty, no template, no parsers)
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    image_urls: list | None = None  # set by Gateway.with_images: each image's URL (None: inline), in prompt order
    response_id: str | None = None  # the id the answer carries (set by the route), recorded with the call


@dataclass
class _Call:
    """One chat call in flight. ``turn.prompt_ids`` end with the ids of ``forced_text`` while ``turn.prompt_text``
    is the template's rendering without it: the forced text is the start of the assistant turn that the next call
    renders after ``prompt_text``."""

    turn: _Turn
    continues: bool  # extends the session's current segment
    sampling: dict  # engine sampling_params (max_new_tokens clamped to the context, the session's rules applied)
    forced_text: str  # tool-call opening appended to the prompt ('' unless tool_choice forces a call)
    started: float
    reasoning_open: bool = False  # the completion starts inside a reasoning block (the prompt opened it)
    top_logprobs: int = 0  # alternatives per token the engine is asked for (top_logprobs_num)
    done: list = field(default_factory=list)  # [(GenerateResult, version)] of aborted parts kept (resume_aborted)
    versions: list[int] = field(default_factory=list)  # per completion token, set when the generation is complete
    asked_version: int = 0  # the gateway's policy version when the engine request in flight was sent


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def image_data(call: _Call) -> list[str] | None:
    """SGLang's ``image_data`` of a call: every image of its prompt, in order, as data URLs."""
    from forge_megatron.multimodal.images import data_url

    return [data_url(x) for x in call.turn.images] if call.turn.images else None


IMAGE_CACHE = 256  # normalised images a gateway keeps (by the content of what the agent sent)
FETCH_THREADS = 8  # image URLs of one request fetched at once (multimodal/fetch.py)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat top_logprobs (the legacy completions' logprobs: 5)
# Sampling controls the gateway does not serve, with the values that leave sampling alone (those pass). Penalties,
# logit biases and min_p would have the engine sample from another distribution than the policy's (the trainer
# scores every token under the policy, at the policy temperature); a JSON response format would constrain decoding
# to a grammar, so the model would be trained on tokens it was not free to choose. Anything else is a 400 naming the
# field rather than a silently different completion.
NEUTRAL_SAMPLING = {"presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "min_p": (0,),
                    "logit_bias": ({},), "response_format": ({"type": "text"},)}
MAX_LEGACY_LOGPROBS = 5


def _top_logprobs(body: dict, name: str, bound: int) -> int:
    value = body.get(name)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= bound:
        raise _bad(name, f"{name} must be an integer in [0, {bound}]")
    return value


def parse_chat_request(body: dict, default_max_tokens: int) -> ChatRequest:
    """Validate ``body`` (OpenAI fields); raise ApiError(400) naming the offending field."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "messages must be a non-empty array")
    messages = [_normalise_message(m, i) for i, m in enumerate(msgs)]
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("name") for t in tools)):
        raise _bad("tools", "tools must be an array of {type: 'function', function: {name, ...}}")
    tool_choice = _tool_choice(body.get("tool_choice", "auto"), tools)
    if body.get("n", 1) != 1:
        raise _bad("n", "only n=1 is supported")
    top = _top_logprobs(body, "top_logprobs", MAX_TOP_LOGPROBS)
    if top and not _flag(body, "logprobs"):
        raise _bad("top_logprobs", "top_logprobs needs logprobs: true")
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, dict) or not all(isinstance(k, str) for k in template_kwargs):
        raise _bad("chat_template_kwargs", "chat_template_kwargs must be an object of template variables")
    effort = body.get("reasoning_effort")
    if effort is not None:  # as SGLang and vLLM do: a template variable (gpt-oss's template writes "Reasoning: high")
        if effort not in REASONING_EFFORTS:
            raise _bad("reasoning_effort", f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}")
        template_kwargs = {"reasoning_effort": effort, **template_kwargs}  # chat_template_kwargs win
    return ChatRequest(messages=messages, tools=tools or None, tool_choice=tool_choice,
                       sampling=_sampling_params(body, default_max_tokens), stream=_flag(body, "stream"),
                       include_usage=bool((body.get("stream_options") or {}).get("include_usage")),
                       logprobs=_flag(body, "logprobs"), top_logprobs=top,
                       separate_reasoning=_flag(body, "separate_reasoning", default=True),
                       template_kwargs=template_kwargs)


def parse_completion_request(body: dict, default_max_tokens: int, vocab_size: int) -> ChatRequest:
    """Validate an OpenAI (legacy) completions body: ``prompt`` is a string, an array of one string, or an array of
    token ids (sent to the engine as they are); raise ApiError(400) naming the offending field."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    text, ids = None, None
    if isinstance(prompt, str) and prompt:
        text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise _bad("prompt", f"prompt token ids must lie in [0, {vocab_size})")
        ids = list(prompt)
    else:
        raise _bad("prompt", "prompt must be a non-empty string or array of token ids (one prompt per call)")
    for name in ("echo", "suffix"):
        if body.get(name):
            raise _bad(name, f"{name} is not supported")
    for name in ("n", "best_of"):
        if body.get(name, 1) != 1:
            raise _bad(name, f"only {name}=1 is supported")
    top = _top_logprobs(body, "logprobs", MAX_LEGACY_LOGPROBS)  # k: the sampled tokens' and k alternatives
    return ChatRequest(messages=[], tools=None, tool_choice="none", sampling=_sampling_params(body, default_max_tokens),
                       stream=_flag(body, "stream"),
                       include_usage=bool((body.get("stream_options") or {}).get("include_usage")),
                       logprobs=body.get("logprobs") is not None, top_logprobs=top, separate_reasoning=False,
                       prompt=text, prompt_ids=ids)


def _tool_choice(choice, tools: list | None):
    """'none' | 'auto' | 'required' | {type: 'function', function: {name}} naming one of ``tools``."""
    if choice in ("none", "auto"):
        return choice
    if choice != "required" and not (isinstance(choice, dict) and isinstance(choice.get("function"), dict)):
        raise _bad("tool_choice", "tool_choice must be 'none', 'auto', 'required' or {type, function: {name}}")
    if not tools:
        raise _bad("tool_choice", "tool_choice 'required' or a named function needs a non-empty tools array")
    if isinstance(choice, dict):
        names = [t["function"]["name"] for t in tools]
        if choice["function"].get("name") not in names:
            raise _bad("tool_choice", f"tool_choice names function {choice['function'].get('name')!r}, which is "
                                      f"not in tools {names}")
    return choice


def _flag(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise _bad(name, f"{name} must be a boolean")
    return value


def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not lo <= value <= hi:
        raise _bad(name, f"{name} must be {'an integer' if integer else 'a number'} in [{lo}, {hi}], got {value!r}")
    return value


SAMPLING_KEYS = ("temperature", "top_p", "top_k")


def continuation_seed(seed: int, part: int) -> int:
    """Seed of part ``part`` (>= 1) of a seeded call resumed after aborts: deterministic, distinct per part, within
    the request seed's range [0, 2**63)."""
    import hashlib

    digest = hashlib.blake2b(f"{seed}:{part}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def from_policy(sampling: dict, temperature: float = 1.0) -> bool:
    """True when engine sampling params draw from the trained policy: the policy ``temperature``, top_p 1, no
    top_k."""
    return sampling.get("temperature", 1.0) == temperature and sampling.get("top_p", 1.0) == 1.0 and \
        sampling.get("top_k", -1) in (-1, 0)


def session_sampling(body) -> dict:
    """Validated sampling overrides of an eval session (``{temperature, top_p, top_k}``, each optional)."""
    if body is None:
        return {}
    if not isinstance(body, dict) or set(body) - set(SAMPLING_KEYS):
        raise _bad("sampling", f"sampling must be an object with some of {list(SAMPLING_KEYS)}")
    out = {}
    if "temperature" in body:
        out["temperature"] = float(_number(body, "temperature", 1.0, 0.0, 2.0))
    if "top_p" in body:
        out["top_p"] = float(_number(body, "top_p", 1.0, 1e-9, 1.0))
    if "top_k" in body:  # 0 and -1 both mean off (SGLang's spelling: -1)
        out["top_k"] = _number(body, "top_k", -1, -1, 1 << 30, integer=True) or -1
    return out


def _refuse_unserved_sampling(body: dict) -> None:
    """400 naming the first of ``NEUTRAL_SAMPLING``'s fields ``body`` sets to a value that changes sampling."""
    for name, neutral in NEUTRAL_SAMPLING.items():
        value = body.get(name)
        if value is None or (not isinstance(value, bool) and value in neutral):
            continue
        if name == "response_format":
            raise _bad(name, f"response_format {value!r} is not supported (plain text only): decoding constrained to a "
                             "JSON grammar would train the model on tokens it was not free to choose")
        raise _bad(name, f"{name} {value!r} is not supported (leave it out, or send {neutral[0]!r}): the engine would "
                         "sample from another distribution than the policy's, which the trainer scores")


def _sampling_params(body: dict, default_max_tokens: int) -> dict:
    _refuse_unserved_sampling(body)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    which = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    params = {
        "temperature": float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        "top_p": float(_number(body, "top_p", 1.0, 1e-9, 1.0)),
        "max_new_tokens": _number({which: max_tokens}, which, default_max_tokens, 1, 1 << 30, integer=True),
    }
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise _bad("stop", "stop must be a non-empty string or an array of up to 4 of them")
        params["stop"] = stop
    seed = _number(body, "seed", None, 0, (1 << 63) - 1, integer=True)
    if seed is not None:
        params["sampling_seed"] = seed
    top_k = _number(body, "top_k", None, -1, 1 << 30, integer=True)  # SGLang/vLLM extension
    if top_k not in (None, 0):
        params["top_k"] = top_k
    if _flag(body, "ignore_eos"):  # SGLang/vLLM extension
        params["ignore_eos"] = True
    return params


IMAGE_KEY = "forge_images"  # a normalised message's images (encoded bytes), in the order of its IMAGE_MARKs


def _normalise_message(m, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad(where, f"{where} must be an object")
    role = m.get("role")
    if role not in ROLES:
        raise _bad(f"{where}.role", f"{where}.role must be one of {ROLES}, got {role!r}")
    content = m.get("content")
    images = []
    if isinstance(content, list):  # content parts: text, and images in user and tool messages
        try:
            content, images = content_parts(content, where, images_allowed=role in ("user", "tool"), urls=True)
        except ImageError as exc:
            raise _bad(exc.param or f"{where}.content", str(exc)) from None
    if content is not None and not isinstance(content, str):
        raise _bad(f"{where}.content", f"{where}.content must be a string, an array of content parts, or null")
    if content and content.count(IMAGE_MARK) != len(images):
        raise _bad(f"{where}.content", f"{where}.content holds a NUL-delimited marker the gateway reserves")
    reasoning = m.get("reasoning_content", m.get("reasoning")) if role == "assistant" else None
    if reasoning is not None and not isinstance(reasoning, str):
        raise _bad(f"{where}.reasoning_content", f"{where}.reasoning_content must be a string or null")
    if content is None and not (role == "assistant" and (m.get("tool_calls") or reasoning is not None)):
        raise _bad(f"{where}.content", f"{where}.content is required")
    out = {"role": "system" if role == "developer" else role, "content": content or ""}
    if reasoning is not None:  # the template renders it back (reasoning_parsers.py: multi-turn fidelity)
        out["reasoning_content"] = reasoning
    if role == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = [_normalise_tool_call(tc, f"{where}.tool_calls[{j}]")
                             for j, tc in enumerate(m["tool_calls"])]
    if role == "tool":
        out["tool_call_id"] = m.get("tool_call_id")
    if images:
        out[IMAGE_KEY] = images
    return out


def _normalise_tool_call(tc, where: str) -> dict:
    fn = tc.get("function") if isinstance(tc, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
        raise _bad(where, f"{where} must be {{id, type: 'function', function: {{name, arguments: str}}}}")
    return {"id": tc.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": fn["arguments"]}}


class Gateway:
    """State and request handling; :func:`make_app` wires it to HTTP."""

    def __init__(self, config: GatewayConfig, sink: EpisodeSink | None = None):
        from transformers import AutoConfig, AutoTokenizer

        self.config = config
        self.sink = sink if sink is not None else ListSink()
        remote = dict(trust_remote_code=config.trust_remote_code)
        try:
            tokenizer = AutoTokenizer.from_pretrained(config.model_path, **remote)
            model_config = AutoConfig.from_pretrained(config.model_path, **remote)
        except ValueError as exc:
            if not config.trust_remote_code and "trust_remote_code" in str(exc):
                raise ValueError(f"{config.model_path} ships its own tokenizer or config code (e.g. Kimi-K2): start "
                                 "with --trust-remote-code to run it (from that directory; nothing is downloaded)"
                                 ) from exc
            raise
        if hasattr(model_config, "get_text_config"):  # a vision-language checkpoint (Qwen3.5): its language model's
            model_config = model_config.get_text_config()
        self.renderer = ChatRenderer(tokenizer, end_ids=model_end_ids(config.model_path))
        self._tokenizer_fingerprint: str | None = None
        self.images, self.image_placeholder = self._image_processor(config.model_path)
        self.teacher = None  # --teacher-urls: middleware/teacher.py
        if config.teacher_urls:
            if self.images is not None:
                raise ValueError("teacher_urls: on-policy distillation takes text models; "
                                 f"{config.model_path} takes images")
            from forge_megatron.middleware.teacher import TeacherScorer

            self.teacher = TeacherScorer(list(config.teacher_urls), config.policy_temperature,
                                         config.teacher_timeout_s, topk=config.teacher_topk)
        self.context_length = config.context_length or int(getattr(model_config, "max_position_embeddings", 4096))
        self.vocab_size = int(getattr(model_config, "vocab_size", 0) or len(self.renderer.tok))
        self.routing_shape = None  # (layers, topk) when recording routed experts
        if config.return_routed_experts:
            top_k = getattr(model_config, "num_experts_per_tok", None) or getattr(model_config, "top_k_experts", None)
            if not top_k:  # (Gemma 4 names it top_k_experts)
                raise ValueError(f"return_routed_experts: {config.model_path} is not a MoE model "
                                 "(config.json has no num_experts_per_tok / top_k_experts)")
            self.routing_shape = (int(model_config.num_hidden_layers), int(top_k))
            experts = getattr(model_config, "num_experts", None) or getattr(model_config, "n_routed_experts", None) \
                or getattr(model_config, "num_local_experts", None)  # Qwen3 / DeepSeek, GLM / gpt-oss, Mixtral
            # ids and -1 fit in int8 up to 128 experts: half the bytes through the pool and to the trainer
            self.routing_dtype = np.int8 if experts and int(experts) <= 128 else np.int16
        self.parser = get_parser(config.tool_parser)
        self.parser.learn_template(lambda messages, tools: self.renderer.render(messages, tools,
                                                                                add_generation_prompt=False))
        self.reasoning = get_reasoning_parser(config.reasoning_parser)
        self.no_parser = self.parser.without_calls()  # tool_choice "none"
        shared = SharedLoad(config.engine_load_file, config.engine_load_row) if config.engine_load_file else None
        self.fleet = EngineFleet(config.engine_urls, FleetConfig(max_attempts=config.engine_attempts,
                                                                 health_interval_s=config.health_interval_s,
                                                                 group_affinity_slack=config.group_affinity_slack),
                                 shared=shared)
        self.model_name = config.served_model_name or os.path.basename(os.path.normpath(config.model_path))
        self.groups: OrderedDict[str, dict] = OrderedDict()  # the newest MAX_GROUPS (older ones are long done)
        self.image_cache: OrderedDict[str, bytes] = OrderedDict()  # normalised images by the sent bytes' digest
        self.image_lock = threading.Lock()
        self.url_policy = config.url_policy()  # which image URLs it fetches (none by default)
        # a request's new image URLs fetched at once (not on image_worker: its threads wait for these)
        self.fetch_pool = ThreadPoolExecutor(max_workers=FETCH_THREADS, thread_name_prefix="forge-fetch") \
            if self.images is not None and self.url_policy.enabled else None
        self.image_worker = ThreadPoolExecutor(max_workers=config.image_threads, thread_name_prefix="forge-images") \
            if self.images is not None else None
        self.sessions: dict[str, Session] = {}
        self.by_key: dict[str, Session] = {}
        self.ended_ids: deque[str] = deque()  # oldest first; bounded by keep_ended_sessions and keep_ended_mib
        self.ended_bytes = 0  # recorded bytes of the sessions in ended_ids
        self.policy_version = 0
        self.policy_adapter: str | None = None  # the LoRA adapter the engines serve the policy as (calls name it)
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.inflight = 0
        # engine aborts seen (weight updates); sampled tokens kept across them / thrown away (not resuming)
        self.stats = {"aborts": 0, "resumed_tokens": 0, "discarded_tokens": 0, "policy_sampling_overrides": 0,
                      "tempered_calls": 0, "reaped_sessions": 0, "calls": 0, "prompt_tokens": 0,
                      "completion_tokens": 0, "forgotten_sessions": 0, "images_fetched": 0, "image_fetch_failures": 0,
                      "image_prompt_mismatches": 0, "teacher_scored_tokens": 0, "teacher_failed_episodes": 0}
        self._reaper: asyncio.Task | None = None
        self._token_texts: dict[int, str] = {}  # token_text's cache (at most the vocabulary)
        self.evals: deque[dict] = deque(maxlen=1000)  # published evaluation results, each with an increasing id
        self._eval_ids = 0
        self.instance = uuid.uuid4().hex[:16]  # tells readers of the eval ids that this gateway restarted
        self.base_url = config.public_url or advertised_url(config.host, config.port)

    # --- pause / resume ---------------------------------------------------------------------------------------
    async def wait_resumed(self) -> None:
        if self.resumed.is_set():  # the common case: no task, no timer
            return
        try:
            await asyncio.wait_for(self.resumed.wait(), timeout=self.config.pause_wait_s)
        except asyncio.TimeoutError as exc:
            raise ApiError(503, f"weights are being updated; still paused after {self.config.pause_wait_s}s",
                           "service_unavailable", code="paused") from exc

    async def pause(self, drain_timeout_s: float) -> int:
        """Hold new calls; wait up to ``drain_timeout_s`` for in-flight ones; return how many are still running."""
        self.resumed.clear()
        deadline = time.monotonic() + drain_timeout_s
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self.inflight

    def resume(self, policy_version: int | None, lora_name: str | None = None) -> None:
        if policy_version is not None:
            self.policy_version = policy_version
        if lora_name is not None:
            self.policy_adapter = lora_name
        self.resumed.set()

    # --- sessions ---------------------------------------------------------------------------------------------
    def add_group(self, group_id: str, info: dict) -> None:
        self.groups[group_id] = info
        while len(self.groups) > MAX_GROUPS:
            self.groups.popitem(last=False)

    def teacher_prefix(self, task_id: str, domain: str, metadata: dict) -> list[int] | None:
        """The token ids of a group's privileged teacher system message (``teacher_prompt`` filled in with its task's
        fields, rendered with the chat template); None without one. ValueError naming a missing field."""
        if self.config.teacher_prompt is None:
            return None
        from forge_megatron.middleware.teacher import teacher_prompt

        text = teacher_prompt(self.config.teacher_prompt, task_id, domain, metadata)
        return self.renderer.encode(self.renderer.render([{"role": "system", "content": text}], None,
                                                         add_generation_prompt=False))

    def session_ids(self) -> dict:
        """A new session's id and API key; a worker's (``worker_tag``) start with its tag: ``<tag>-<hex>`` and
        ``forge-<tag>-<token>`` (see ``gateway_front.worker_tag_of``)."""
        tag = self.config.worker_tag
        if tag is None:
            return {}
        return {"session_id": f"{tag}-{uuid.uuid4().hex}", "api_key": f"forge-{tag}-{secrets.token_urlsafe(24)}"}

    def session_for_key(self, key: str | None) -> Session:
        sess = self.by_key.get(key or "")
        if sess is None:
            raise ApiError(401, "unknown API key: start a session with POST /forge/sessions", "authentication_error",
                           code="invalid_api_key")
        if sess.ended:
            raise ApiError(404, f"session {sess.session_id} has ended ({sess.status})", "invalid_request_error",
                           code="session_ended")
        return sess

    def session_by_id(self, session_id: str, open_only: bool = False) -> Session:
        sess = self.sessions.get(session_id)
        if sess is None:
            raise ApiError(404, f"unknown session {session_id!r}", code="session_not_found")
        if open_only and sess.ended:
            raise ApiError(404, f"session {sess.session_id} has ended ({sess.status})", code="session_ended")
        return sess

    def tokenizer_fingerprint(self) -> str:
        """A digest of the policy tokenizer's token -> id map (computed once): agents/call_rewards.py checks a
        reward model's tokenizer against it."""
        if self._tokenizer_fingerprint is None:
            self._tokenizer_fingerprint = vocabulary_fingerprint(self.renderer.tok.get_vocab())
        return self._tokenizer_fingerprint

    async def close_session(self, sess: Session, status: str) -> str:
        """End ``sess`` with ``status`` (after a call in flight) and send its episode to the sink (not an eval
        session's); returns the sink's answer. SchemaError when the sink refuses it (the session stays ended)."""
        async with sess.lock:
            sess.status, sess.ended_at = status, time.time()
            sess.last_active = sess.ended_at
            stored, sess.responses = sess.responses, {}  # an ended session serves no calls: unreachable now
        outcome = "eval"
        if not sess.evaluation:
            try:
                outcome = await self.to_sink("submit_episode", await self._with_teacher(
                    sess.to_episode(self.config.malformed_call_reward)))
            except ApiError:  # the sink did not answer: the session stays open, so the end can be sent again
                sess.status, sess.ended_at, sess.responses = None, 0.0, stored
                raise
            except SchemaError:  # refused: ended for good, kept (and forgotten) like any ended session
                self.retire(sess)
                raise
        self.retire(sess)
        return outcome or "accepted"

    async def _with_teacher(self, episode):
        """``episode`` with its served teacher's logprobs (--teacher-urls; as it is without). No teacher engine
        answering is a 503 ``teacher_unavailable`` (the session stays open: send the end again); a refusal that a
        retry would not change sends the episode as ``failed`` with the reason (middleware/teacher.py)."""
        if self.teacher is None or not episode.segments:
            return episode
        from forge_megatron.middleware.teacher import TeacherRefused, TeacherUnavailable

        prefix = None
        if self.config.teacher_prompt is not None:
            prefix = (self.groups.get(episode.group_id) or {}).get("teacher_prefix")
            if prefix is None:  # (forgotten beyond MAX_GROUPS: the group is long done)
                raise ApiError(409, f"group {episode.group_id} is not known here any more: its teacher prompt is "
                                    "lost", code="group_forgotten")
        try:
            await self.teacher.score(episode, prefix or (), self.renderer.tok.bos_token_id)
        except TeacherUnavailable as exc:
            raise ApiError(503, f"the distillation teacher did not answer ({exc}); nothing was lost: send the "
                                "request again", "service_unavailable", code="teacher_unavailable") from exc
        except TeacherRefused as exc:
            log.warning("episode %s: the teacher refused to score it, sent as failed: %s", episode.episode_id, exc)
            self.stats["teacher_failed_episodes"] += 1
            episode.status = "failed"
            episode.metadata = {**episode.metadata, "teacher_error": str(exc)}
            for seg in episode.segments:
                seg.teacher_logprobs = seg.teacher_topk_ids = seg.teacher_topk_logprobs = None
            return episode
        self.stats["teacher_scored_tokens"] = self.teacher.scored_tokens
        return episode

    async def to_sink(self, method: str, *args):
        """``sink.<method>(*args)`` in a worker thread. SchemaError is the sink's refusal; any other failure (a data
        pool over ZeroMQ that does not answer: gateway workers) is a 503 ``sink_unavailable`` to retry."""
        try:
            return await asyncio.to_thread(getattr(self.sink, method), *args)
        except SchemaError:
            raise
        except Exception as exc:  # noqa: BLE001 - TimeoutError, ZMQError, OSError: all "not now"
            raise ApiError(503, f"the episode sink did not answer {method} ({exc.__class__.__name__}: {exc}); "
                                "nothing was lost: send the request again", "service_unavailable",
                           code="sink_unavailable") from exc

    async def reap_idle_sessions(self, now: float | None = None) -> int:
        """End open sessions idle for ``session_idle_timeout_s`` (no call in flight) as timed_out."""
        timeout = self.config.session_idle_timeout_s
        if timeout is None:
            return 0
        now = time.time() if now is None else now
        idle = [s for s in self.sessions.values()
                if not s.ended and not s.lock.locked() and now - s.last_active > timeout]
        reaped = 0
        for sess in idle:
            if sess.ended or sess.lock.locked() or now - sess.last_active <= timeout:  # a call or an end meanwhile
                continue
            try:
                outcome = await self.close_session(sess, "timed_out")
            except SchemaError as exc:
                outcome = f"refused ({exc})"
            except ApiError as exc:  # the sink did not answer: still open, ended on a later round
                log.warning("session %s idle: %s", sess.session_id, exc.message)
                continue
            reaped += 1
            self.stats["reaped_sessions"] += 1
            log.warning("session %s (task %s) had no call for %.0fs: ended as timed_out; sink: %s", sess.session_id,
                        sess.task_id, now - sess.last_active, outcome)
        return reaped

    async def _reap_forever(self) -> None:
        while True:
            timeout = self.config.session_idle_timeout_s
            await asyncio.sleep(5.0 if timeout is None else min(60.0, max(0.05, timeout / 4)))
            try:
                await self.reap_idle_sessions()
            except Exception:  # noqa: BLE001 - the reaper must outlive a sink hiccup
                log.exception("reaping idle sessions failed")

    def start_background(self) -> None:
        """Engine health checks and the idle-session reaper, on the running event loop."""
        self.fleet.start_health_loop()
        self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def stop_background(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        if self.image_worker is not None:
            self.image_worker.shutdown(wait=False)
        if self.fetch_pool is not None:
            self.fetch_pool.shutdown(wait=False)
        await self.fleet.close()
        if self.teacher is not None:
            await self.teacher.close()

    def retire(self, sess: Session) -> None:
        """Remember ``sess`` as ended; forget the oldest ended sessions beyond ``keep_ended_sessions`` or beyond
        ``keep_ended_mib`` of recorded tokens (the newest is always kept: it has just been answered for)."""
        sess.last_turn = None  # only a next call needs it (the history's text and ids: ~20% of a session's memory)
        self.fleet.forget(sess.session_id)
        self.ended_ids.append(sess.session_id)
        self.ended_bytes += sess.recorded_bytes()
        budget = self.config.keep_ended_mib * 2**20
        while len(self.ended_ids) > self.config.keep_ended_sessions or \
                (self.ended_bytes > budget and len(self.ended_ids) > 1):
            old = self.sessions.pop(self.ended_ids.popleft())
            self.by_key.pop(old.api_key, None)
            self.ended_bytes -= old.recorded_bytes()
            self.stats["forgotten_sessions"] += 1

    # --- images ------------------------------------------------------------------------------------------------
    def _image_processor(self, model_path: str):
        """(the checkpoint's multimodal ImageProcessor, the text of one image in a prompt) for a vision-language
        checkpoint whose images forge takes (multimodal.families.SUPPORTED) with an image processor; (None, None) for
        other models (an image in a request is then a 400)."""
        from forge_megatron.multimodal.images import ImageProcessor

        try:
            processor = ImageProcessor(model_path)
        except (ValueError, OSError):
            return None, None
        text = processor.placeholder(self.renderer.tok)
        if text is None:
            log.warning("%s: its image tokens do not tokenize back to themselves; requests with images are refused",
                        model_path)
            return None, None
        return processor, text

    def with_images(self, req: ChatRequest, sess: Session | None = None) -> tuple[ChatRequest, list[bytes]]:
        """``req`` with the model's image placeholder where each image part was, and the images normalised
        (multimodal/images.py), in prompt order; a 400 when the model takes no images or an image is unusable.

        An image URL is fetched for each call that brings it new: one at the same place in the prompt as in the
        session's previous call (``sess``: the history an agent sends again) is the image fetched then, the one the
        model saw, while a URL in a new message is fetched again (a screenshot URL may serve new content each
        turn). ``req.image_urls`` records where each image came from."""
        if not any(IMAGE_KEY in m for m in req.messages):
            return req, []
        if self.images is None:
            from forge_megatron.multimodal.families import SUPPORTED

            raise _bad("messages", f"{self.model_name} takes no images (images are served for {SUPPORTED} "
                                   "checkpoints with an image processor)")
        from forge_megatron.multimodal.fetch import ImageURL

        prev = sess.last_turn if sess is not None else None
        seen = list(zip(prev.image_urls, prev.images)) if prev is not None and prev.image_urls else []
        parts = [x for m in req.messages for x in m.get(IMAGE_KEY, ())]
        again = [isinstance(x, ImageURL) and n < len(seen) and seen[n][0] == x.url for n, x in enumerate(parts)]
        fetched = self._fetch_urls({x.url: x for x, old in zip(parts, again) if isinstance(x, ImageURL) and not old})
        images, urls, messages = [], [], []
        for i, m in enumerate(req.messages):
            if IMAGE_KEY in m:
                for k, x in enumerate(m[IMAGE_KEY]):
                    n, url = len(images), x.url if isinstance(x, ImageURL) else None
                    got = seen[n][1] if again[n] else fetched.get(url)
                    if isinstance(got, ImageError):
                        raise _bad(f"messages[{i}].content", str(got)) from None
                    try:
                        images.append(got if url is not None else self._normalized(x, f"messages[{i}] image {k}"))
                    except ImageError as exc:
                        raise _bad(f"messages[{i}].content", str(exc)) from None
                    urls.append(url)
                m = {k: v for k, v in m.items() if k != IMAGE_KEY}
                m["content"] = m["content"].replace(IMAGE_MARK, self.image_placeholder)
            messages.append(m)
        return replace(req, messages=messages, image_urls=urls if any(urls) else None), images

    def _fetch_urls(self, new: dict) -> dict:
        """{url: normalised image or ImageError} of the URLs in ``new`` ({url: ImageURL}), fetched side by side when
        there are several (an agent's first call may name many screenshots) on the fetch threads."""
        def fetch(x):
            try:
                return self._fetched(x)
            except ImageError as exc:
                return exc

        if len(new) < 2 or self.fetch_pool is None:
            return {url: fetch(x) for url, x in new.items()}
        return dict(zip(new, self.fetch_pool.map(fetch, new.values())))

    def _fetched(self, x) -> bytes:
        """The normalised image at URL ``x`` (an ImageURL), fetched under the gateway's policy (counted)."""
        from forge_megatron.multimodal.fetch import fetch_image

        data = None
        try:
            data = fetch_image(x, self.url_policy)
        finally:
            with self.image_lock:  # (the fetch threads)
                self.stats["images_fetched" if data is not None else "image_fetch_failures"] += 1
        return self.images.normalize(data, x.where)

    def _normalized(self, data, where: str) -> bytes:
        """The normalised PNG of an image's encoded bytes, cached by content (an agent sends its history's images
        with every call)."""
        from forge_megatron.multimodal.images import digest

        key = digest(data)
        with self.image_lock:  # the image threads and a count_tokens call on the event loop
            out = self.image_cache.get(key)
            if out is not None:
                self.image_cache.move_to_end(key)
                return out
        out = self.images.normalize(data, where)
        with self.image_lock:
            self.image_cache[key] = out
            while len(self.image_cache) > IMAGE_CACHE:
                self.image_cache.popitem(last=False)
        return out

    def expand_images(self, prev, ids: list[int], continues: bool, text: str, images: list[bytes]):
        """(prompt ids, continues) with each image's one placeholder token made its token count: a continuation keeps
        the previous call's ids (images already expanded) when its images start the new call's, else the prompt is
        tokenized anew and starts a segment."""
        from forge_megatron.multimodal.images import digest

        before = (prev.images or []) if prev is not None else []
        pad = self.images.spec.image_token_id
        if continues and ([digest(x) for x in before] != [digest(x) for x in images[:len(before)]]
                          or pad in prev.completion()):  # an image token the model sampled is no image
            ids, continues = self.renderer.encode(text), False
        start, first = (len(prev.ids()), len(before)) if continues else (0, 0)
        try:
            out = self.images.expand(ids, images, start, first)
        except ValueError as exc:
            raise _bad("messages", str(exc)) from None
        return out, continues

    # --- one chat call ----------------------------------------------------------------------------------------
    def template_kwargs(self, req: ChatRequest) -> dict:
        return {**self.config.chat_template_kwargs, **req.template_kwargs}

    def prompt_of(self, sess: Session, req: ChatRequest,
                  images: list[bytes] | None = None) -> tuple[str, list[int], bool, list[bytes]]:
        """(prompt text, prompt ids, continues the session's segment, the prompt's normalised images) of a request
        (``images``: those of a request :meth:`with_images` has already been through); a 400 naming the chat
        template's own message when the template refuses the messages."""
        if req.prompt is not None or req.prompt_ids is not None:
            return (*self.renderer.raw_prompt_ids(sess.last_turn, req.prompt, req.prompt_ids), [])
        if images is None:
            req, images = self.with_images(req, sess)
        try:
            text, ids, continues = self.renderer.prompt_ids(sess.last_turn, req.messages, req.tools,
                                                            self.template_kwargs(req))
        except TemplateRenderError as exc:
            raise ApiError(400, str(exc), param="messages", code="chat_template_error") from exc
        if self.images is not None:  # (a text naming the image token without an image is a 400 there)
            ids, continues = self.expand_images(sess.last_turn, ids, continues, text, images)
        return text, ids, continues, images

    def prepare(self, sess: Session, req: ChatRequest, images: list[bytes] | None = None) -> _Call:
        """The engine call of ``req`` (``images``: its normalised images when :meth:`with_images` has run already)."""
        kwargs = self.template_kwargs(req)
        if images is None:
            req, images = self.with_images(req, sess)
        text, prompt_ids, continues, _ = self.prompt_of(sess, req, images)
        forced = self.forced_text(req)
        reasoning_open = self.reasoning is not None and self.reasoning.opens(text)
        if forced and reasoning_open:
            raise _bad("tool_choice", f"tool_choice {req.tool_choice!r} cannot be enforced: the chat template opens "
                                      f"a reasoning block ({self.reasoning.start}) at the end of the prompt, and a "
                                      "tool call cannot start inside it; use tool_choice 'auto' or turn thinking off "
                                      "(e.g. chat_template_kwargs {\"enable_thinking\": false})")
        prompt_ids = prompt_ids + self.renderer.encode(forced)
        room = self.context_length - len(prompt_ids)
        if room < 1:
            raise ApiError(400, f"the prompt is {len(prompt_ids)} tokens; the context length is {self.context_length}",
                           param="messages", code="context_length_exceeded")
        sampling = self.sampling_for(sess, {**req.sampling, "max_new_tokens": min(req.sampling["max_new_tokens"], room)})
        if self.images is not None:  # a sampled image token ends the completion (its text would read as an image)
            sampling["stop_token_ids"] = [*sampling.get("stop_token_ids", ()), self.images.spec.image_token_id]
        turn = _Turn(messages=req.messages, tools=req.tools, prompt_text=text, prompt_ids=prompt_ids,
                     completion_ids=[], assistant_message={}, template_kwargs=kwargs, images=images,
                     image_urls=req.image_urls or [])
        return _Call(turn=turn, continues=continues, sampling=sampling, forced_text=forced, started=time.time(),
                     reasoning_open=reasoning_open, top_logprobs=req.top_logprobs)

    def sampling_for(self, sess: Session, sampling: dict) -> dict:
        """The module's rule on sampling parameters: an eval session's own values; a training call from the policy
        itself under ``policy_sampling``, otherwise as asked and counted when it is not from the policy."""
        if sess.evaluation:
            return {**sampling, **sess.sampling}
        policy_t = self.config.policy_temperature
        if self.config.policy_sampling:
            policy = {k: v for k, v in sampling.items() if k != "top_k"}
            policy.update(temperature=policy_t, top_p=1.0)
            if policy != sampling:
                self.stats["policy_sampling_overrides"] += 1
            return policy
        if not from_policy(sampling, policy_t):
            self.stats["tempered_calls"] += 1
            if self.stats["tempered_calls"] == 1:
                log.warning("a training call asked for temperature %s, top_p %s, top_k %s: its tokens are not sampled "
                            "from the trained policy (temperature %s, top_p 1, no top_k), so the importance ratios "
                            "are off; start the gateway with --policy-sampling to sample training calls from it "
                            "(counted as tempered_calls)",
                            sampling["temperature"], sampling["top_p"], sampling.get("top_k"), policy_t)
        return sampling

    def forced_text(self, req: ChatRequest) -> str:
        """The parser's tool-call opening when tool_choice forces a call, else ''."""
        if req.tool_choice in ("none", "auto"):
            return ""
        name = req.tool_choice["function"]["name"] if isinstance(req.tool_choice, dict) else None
        prior = sum(len(m.get("tool_calls") or []) for m in req.messages)
        try:
            return self.parser.forced_prefix(name, prior_calls=prior)
        except CannotForceToolCall as exc:
            raise _bad("tool_choice", f"tool_choice {req.tool_choice!r} cannot be enforced: {exc}") from exc

    async def generate(self, sess: Session, call: _Call):
        """Call an engine (failover inside the fleet) until the completion is whole. A part aborted by a weight
        update is kept and continued after resume (``resume_aborted``), or dropped and re-issued; the call fails
        after ``ABORT_RETRIES`` aborts in a row that kept no new token."""
        idle = 0
        while True:
            await self.wait_resumed()
            ids, sampling = self.next_request(call)
            if self.kept_is_whole(call, sampling):
                return self.complete(call, None)
            call.asked_version = self.policy_version
            try:
                result = await self.fleet.generate(self.engine_ids(call, ids), sampling, session_key=sess.session_id,
                                                   return_routed_experts=self.routing_shape is not None,
                                                   group_key=sess.group_id or None,
                                                   top_logprobs_num=call.top_logprobs, image_data=image_data(call),
                                                   lora_path=self.policy_adapter)
            except (NoEngineAvailable, EngineRequestError) as exc:
                raise _engine_error(exc) from exc
            if result.finish_type != "abort":
                return self.complete(call, result)
            idle = 0 if self.keep_aborted(call, len(ids), result) else idle + 1
            if idle >= ABORT_RETRIES:
                raise _too_many_aborts()
            await asyncio.sleep(0.01)

    async def generate_streamed(self, sess: Session, call: _Call, on_partial):
        """:meth:`generate` for streaming: ``await on_partial(result)`` sees the completion so far after each engine
        chunk (kept parts included) and returns how many content characters the client has. Without
        ``resume_aborted`` an aborted call is re-issued only while that is 0."""
        sent, idle = 0, 0
        while True:
            await self.wait_resumed()
            ids, sampling = self.next_request(call)
            if self.kept_is_whole(call, sampling):
                return self.complete(call, None)
            result = None
            call.asked_version = self.policy_version
            try:
                async for result in self.fleet.generate_stream(
                        self.engine_ids(call, ids), sampling, session_key=sess.session_id,
                        return_routed_experts=self.routing_shape is not None, group_key=sess.group_id or None,
                        top_logprobs_num=call.top_logprobs, image_data=image_data(call),
                        lora_path=self.policy_adapter):
                    sent = await on_partial(self.joined(call, result))
            except (NoEngineAvailable, EngineRequestError) as exc:
                raise _engine_error(exc) from exc
            if result is not None and result.finish_type != "abort":
                return self.complete(call, result)
            kept = result is not None and self.keep_aborted(call, len(ids), result)
            if sent and not self.config.resume_aborted:
                raise ApiError(503, f"the engine aborted the call (weights update) after {sent} characters were "
                                    "streamed; send the call again", "service_unavailable", code="aborted")
            idle = 0 if kept else idle + 1
            if idle >= ABORT_RETRIES:
                raise _too_many_aborts()
            await asyncio.sleep(0.01)

    # --- aborted calls: keep the sampled part, go on from it --------------------------------------------------
    def engine_ids(self, call: _Call, ids: list[int]) -> list[int]:
        """The input ids an engine is sent for ``ids`` (the prompt and any kept tokens, images written out): each
        image one placeholder, which the engine writes out again (SGLang's processors: ``ImageProcessor.engine_ids``);
        the trajectory keeps them written out."""
        if not call.turn.images or self.images is None:
            return ids
        try:
            return self.images.engine_ids(ids, [self.images.grid(x) for x in call.turn.images])
        except ValueError as exc:  # (the gateway wrote the prompt: a bug, not the agent's)
            raise ApiError(500, f"the prompt's images cannot be sent to the engine: {exc}") from exc

    def next_request(self, call: _Call) -> tuple[list[int], dict]:
        """Input ids and sampling params of the next engine request: the prompt and the kept parts' tokens, with
        what is left of ``max_new_tokens``. A seeded call's continuation gets a seed of its own (derived from the
        request's seed and the number of parts), so it does not replay the random stream the first part consumed."""
        if not call.done:
            return call.turn.prompt_ids, call.sampling
        kept = [t for part, _ in call.done for t in part.output_ids]
        sampling = {**call.sampling, "max_new_tokens": call.sampling["max_new_tokens"] - len(kept)}
        if "sampling_seed" in sampling:
            sampling["sampling_seed"] = continuation_seed(sampling["sampling_seed"], len(call.done))
        return call.turn.prompt_ids + kept, sampling

    def kept_is_whole(self, call: _Call, sampling: dict) -> bool:
        """The kept parts end the completion already: no budget left, or an end-of-turn token last."""
        return bool(call.done) and (sampling["max_new_tokens"] <= 0 or self.ends_turn(call, call.done[-1][0]))

    def ends_turn(self, call: _Call, part) -> bool:
        return part.output_ids[-1] in self.renderer.eot_ids and not call.sampling.get("ignore_eos")

    def keep_aborted(self, call: _Call, n_input: int, result) -> bool:
        """An engine aborted a part of ``call`` (a weight update paused it) after sampling ``result.output_ids``;
        keep them (True) when resuming and there are any, with the version that sampled them."""
        self.stats["aborts"] += 1
        keep = self.config.resume_aborted and bool(result.output_ids)
        if keep and self.routing_shape is not None:  # the rows are cut from it when the parts are joined
            try:
                self.routed_experts_of(n_input, result)
            except ApiError as exc:  # an engine that reports no routing for aborted requests: start over
                log.warning("aborted part dropped, its routing is unusable: %s", exc.message)
                keep = False
        if not keep:
            self.stats["discarded_tokens"] += len(result.output_ids)
            return False
        self.check_part(call, result)
        call.done.append((result, self.version_of(result, call)))
        self.stats["resumed_tokens"] += len(result.output_ids)
        return True

    def check_part(self, call: _Call, result) -> None:
        if call.turn.images and result.prompt_tokens:
            self.check_image_prompt(call, result)
        if len(result.logprobs) != len(result.output_ids):
            raise ApiError(502, f"the engine returned {len(result.logprobs)} logprobs for {len(result.output_ids)} "
                                "tokens", "engine_error", code="bad_engine_response")
        if call.top_logprobs and len(result.top_logprobs or ()) != len(result.output_ids):
            raise ApiError(502, f"the engine returned top logprobs for {len(result.top_logprobs or ())} of "
                                f"{len(result.output_ids)} tokens (asked top_logprobs_num {call.top_logprobs})",
                           "engine_error", code="bad_engine_response")

    def check_image_prompt(self, call: _Call, result) -> None:
        """An engine that wrote a prompt's images out to another token count than the gateway (an SGLang whose
        processor takes another placeholder form: docs/rollout.md) sampled from another prompt than the one the
        trainer scores: counted and logged (the count says nothing when the engine reports the ids as sent)."""
        written = len(call.turn.prompt_ids) + sum(len(p.output_ids) for p, _ in call.done)
        sent = len(self.engine_ids(call, call.turn.prompt_ids)) + written - len(call.turn.prompt_ids)
        if result.prompt_tokens in (written, sent):
            return
        self.stats["image_prompt_mismatches"] += 1
        if self.stats["image_prompt_mismatches"] == 1:
            log.error("engine %s counted %d prompt tokens for a call with images the gateway wrote as %d (sent as "
                      "%d): it writes images out otherwise, so the trainer scores another prompt than it sampled "
                      "from (docs/rollout.md: SGLANG_MM_AVOID_RETOKENIZE, the SGLang version); counted in "
                      "gateway_image_prompt_mismatches_total", result.engine_url, result.prompt_tokens, written, sent)

    def joined(self, call: _Call, result):
        """``result`` after the kept parts: ids and logprobs concatenated (no routing; for streaming views)."""
        if not call.done:
            return result
        parts = [p for p, _ in call.done] + ([result] if result is not None else [])
        tops = None if any(p.top_logprobs is None for p in parts) else [x for p in parts for x in p.top_logprobs]
        return replace(parts[-1], output_ids=[t for p in parts for t in p.output_ids],
                       logprobs=[x for p in parts for x in p.logprobs], routed_experts=None, top_logprobs=tops,
                       prompt_tokens=call.done[0][0].prompt_tokens,
                       completion_tokens=sum(len(p.output_ids) for p in parts))

    def complete(self, call: _Call, result):
        """The whole completion of ``call`` from its kept parts and the last engine answer (None when the kept
        parts used the whole budget): tokens, logprobs, routing rows, per-token versions in ``call.versions``, and
        a stop string that only the joined text contains cut as the engine would have."""
        if result is not None:
            self.check_part(call, result)
        if not call.done:
            call.versions = [self.version_of(result, call)] * len(result.output_ids)
            return result
        parts = call.done + ([(result, self.version_of(result, call))] if result is not None else [])
        joined = self.joined(call, result)
        call.versions = [v for p, v in parts for _ in p.output_ids]
        if result is None:  # see kept_is_whole
            last = call.done[-1][0]
            joined = replace(joined, finish_reason={"type": "stop", "matched": last.output_ids[-1]}
                             if self.ends_turn(call, last) else {"type": "length", "length": len(joined.output_ids)})
        if self.routing_shape is not None:
            joined.routed_experts = self.joined_routing(call, parts)
        stop = self.stop_across_parts(joined.output_ids, [len(p.output_ids) for p, _ in parts],
                                      call.sampling.get("stop") or [])
        if stop is not None:
            n, matched = stop
            joined = replace(joined, output_ids=joined.output_ids[:n], logprobs=joined.logprobs[:n],
                             top_logprobs=None if joined.top_logprobs is None else joined.top_logprobs[:n],
                             completion_tokens=n, finish_reason={"type": "stop", "matched": matched})
            call.versions = call.versions[:n]
            if joined.routed_experts is not None:
                rows = len(call.turn.prompt_ids) + n - 1
                joined.routed_experts = joined.routed_experts[:rows * self.routing_shape[0] * self.routing_shape[1]]
        return joined

    def joined_routing(self, call: _Call, parts) -> np.ndarray:
        """Rows [0, prompt + output - 1) of the joined completion: each position from the part that sampled the
        token after it (part i answers for its input length n_i and k_i tokens: rows [n_i - 1, n_i + k_i - 1),
        the first part from row 0, the last to its end)."""
        rows, n = [], len(call.turn.prompt_ids)
        for i, (part, _) in enumerate(parts):
            full = self.routed_experts_of(n, part)
            start = 0 if i == 0 else n - 1
            end = full.shape[0] if i == len(parts) - 1 else n + len(part.output_ids) - 1
            rows.append(full[start:end])
            n += len(part.output_ids)
        return np.concatenate(rows).astype(np.int32).reshape(-1)

    def stop_across_parts(self, ids: list[int], sizes: list[int], stops: list[str]) -> tuple[int, str] | None:
        """(tokens to keep, matched string) for the earliest stop string that ends in a later part than it starts:
        the engine checks stop strings within each request's own output only."""
        if not stops or len(sizes) < 2:
            return None
        span = 4 * max(len(s) for s in stops) + 1  # tokens a stop string can cover (byte-level pieces included)
        best = None
        boundary = 0
        for size in sizes[:-1]:
            boundary += size
            lo = max(0, boundary - span)
            for n in range(boundary + 1, min(len(ids), boundary + span) + 1):
                if best is not None and n >= best[0]:
                    break
                text = self.renderer.tok.decode(ids[lo:n], skip_special_tokens=False)
                hit = [s for s in stops if s in text]
                if hit:
                    best = (n, min(hit, key=text.index))
                    break
        return best

    def text_of(self, call: _Call, result) -> str:
        """What the parsers read: the forced text + the visible completion text."""
        return call.forced_text + self.renderer.completion_text(result.output_ids, result.finish_reason)

    def split_reasoning(self, call: _Call, req: ChatRequest, text: str, final: bool = True):
        """(reasoning or None, the rest) of a completion's text under the reasoning parser (reasoning_parsers.py);
        (None, text) without one or when the request asks for the raw text (``separate_reasoning`` false)."""
        if self.reasoning is None or not req.separate_reasoning:
            return None, text
        return self.reasoning.split(text, call.reasoning_open, final=final)

    def parser_for(self, req: ChatRequest):
        return self.parser if req.tool_choice != "none" else self.no_parser

    def stream_views(self, call: _Call, req: ChatRequest, result, holds: list[str]) -> tuple[str | None, str]:
        """(reasoning, content) of a completion so far that a stream may give out: each extends the one given for
        a shorter completion (held back at partial markers, the tool-call marker and stop strings ``holds``)."""
        reasoning, text = self.split_reasoning(call, req, self.text_of(call, result), final=False)
        if reasoning is not None:
            reasoning = reasoning[:_emit_upto(reasoning, [])]
        shown = self.parser_for(req).streamable(text)
        return reasoning, shown[:_emit_upto(shown, holds)]

    def stream_calls(self, call: _Call, req: ChatRequest, result, closed: int) -> tuple[int, list[dict] | None]:
        """(blocks closed, the tool calls in them) of a completion so far, for parsers with ``streams_calls`` (a
        call whose block has closed is final); calls None when no block closed since ``closed`` were."""
        parser = self.parser_for(req)
        if not parser.streams_calls:
            return closed, None
        _, text = self.split_reasoning(call, req, self.text_of(call, result), final=False)
        now = text.count(parser.end_marker)
        if now <= closed:  # nothing new: skip the parse
            return closed, None
        return now, parser.parse(text, req.tools).tool_calls

    def finish(self, sess: Session, call: _Call, result, req: ChatRequest) -> tuple[dict, str]:
        """Parse the completion (``result`` from :meth:`generate`), record the call, return (assistant message,
        OpenAI finish_reason)."""
        reasoning, text = self.split_reasoning(call, req, self.text_of(call, result))
        parsed = self.parser_for(req).parse(text, req.tools)
        message = {"role": "assistant", "content": parsed.content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        finish = "tool_calls" if parsed.tool_calls else ("length" if result.finish_type == "length" else "stop")
        turn = call.turn
        self.stats["calls"] += 1
        self.stats["prompt_tokens"] += len(turn.prompt_ids)
        self.stats["completion_tokens"] += len(result.output_ids)
        routed = self.routed_experts_of(len(turn.prompt_ids), result)
        turn.completion_ids = list(result.output_ids)
        turn.assistant_message = message
        sess.record(turn, call.continues, routed=routed, call=CallRecord(
            prompt_ids=turn.prompt_ids, completion_ids=turn.completion_ids, logprobs=list(result.logprobs),
            policy_version=max(call.versions, default=self.version_of(result, call)),
            policy_versions=list(call.versions),
            resumed=len(call.done), finish_reason=finish, engine_url=result.engine_url, segment_index=-1,
            started_at=call.started, ended_at=time.time(), num_tool_calls=len(parsed.tool_calls),
            num_malformed_tool_calls=parsed.num_malformed, response_id=req.response_id,
            sampling={k: call.sampling[k] for k in SAMPLING_KEYS if k in call.sampling}))
        return message, finish

    def routed_experts_of(self, n_input: int, result):
        """int8/int16 [input + output - 1, layers, topk] of an engine answer to ``n_input`` ids (None when not
        recording); a clear 502 when the engine did not return them (SGLang needs --enable-return-routed-experts) or
        returned another shape."""
        if self.routing_shape is None:
            return None
        flat = result.routed_experts
        rows = n_input + len(result.output_ids) - 1
        if flat is None:
            raise ApiError(502, f"engine {result.engine_url} returned no routed_experts: start SGLang with "
                                "--enable-return-routed-experts (or run the gateway without --return-routed-experts)",
                           "engine_error", code="bad_engine_response")
        if flat.size != rows * self.routing_shape[0] * self.routing_shape[1]:
            raise ApiError(502, f"engine {result.engine_url} returned {flat.size} routed expert ids, expected {rows} "
                                f"tokens x {list(self.routing_shape)}", "engine_error", code="bad_engine_response")
        return flat.reshape(rows, *self.routing_shape).astype(self.routing_dtype)

    def version_of(self, result, call: _Call) -> int:
        """The version of the policy adapter the request named (``forge-<run>-v<version>``), else the engine's
        weight_version when it is an integer (set by weight sync), else the gateway's version when the request was
        sent (a call sent to the checkpoint's weights before the first sync is version 0, also when it ends after
        the sync: an adapter sync does not stop it)."""
        adapter = policy_adapter_version(result.lora_path)
        if adapter is not None:
            return adapter
        try:
            return int(result.weight_version)
        except (TypeError, ValueError):
            return call.asked_version

    def token_text(self, token_id: int) -> str:
        """One token decoded alone (special tokens as their text), cached: a stream with top_logprobs asks for
        (k + 1) tokens per position."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.renderer.tok.decode([token_id], skip_special_tokens=False)
        return text

    def openai_logprobs(self, ids: list[int], logprobs: list[float], top: list | None = None) -> dict:
        """OpenAI ``choice.logprobs`` of the sampled tokens ``ids`` (each token decoded alone) and, with ``top`` (the
        engine's per-position [(logprob, id), ...]), their most likely alternatives."""
        def entry(token_id: int, lp: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for alp, a in top[i]] if top else []}
                            for i, (t, lp) in enumerate(zip(ids, logprobs))]}

    def text_token_span(self, call: _Call, req: ChatRequest, result, content: str, final: bool = True,
                        start: int = 0, cache: dict | None = None) -> tuple[int, int]:
        """[lo, hi): the completion tokens whose text holds ``content`` (the answer's content, or what a stream has
        sent of it), from the token its first character is in to the one its last is in, not before token
        ``start``: reasoning and tool-call tokens are outside. Every prefix of the completion decodes to a prefix of
        its text, so both ends are found by bisection over the prefixes' lengths (O(log n) decodes; ``cache`` keeps
        them across the calls of one stream, whose earlier ids never change, so each delta decodes a few prefixes).
        Content the text does not contain as it is (a parser rewrote it) gets every token from ``start``."""
        ids = result.output_ids
        if not content:
            return start, start
        full = self.text_of(call, result)
        _, rest = self.split_reasoning(call, req, full, final=final)
        at = full.find(content, len(full) - len(rest) if full.endswith(rest) else 0)
        if at < 0:
            return start, max(start, len(ids))
        first = max(0, at - len(call.forced_text))  # in the completion's own text
        last = first + len(content)
        cache = {} if cache is None else cache

        def decoded(k: int) -> int:  # characters in the first k tokens' text
            if k not in cache:
                cache[k] = len(self.renderer.tok.decode(ids[:k], skip_special_tokens=False))
            return cache[k]

        lo = bisect.bisect_right(range(len(ids)), first, lo=min(start, len(ids)), key=lambda k: decoded(k + 1))
        hi = min(len(ids), bisect.bisect_left(range(len(ids) + 1), last, lo=lo, key=decoded))
        return lo, max(lo, hi)

    def legacy_logprobs(self, ids: list[int], logprobs: list[float], top: list | None, offset: int) -> dict:
        """Completions ``choice.logprobs`` of the sampled tokens ``ids`` (each decoded alone), the first at character
        ``offset`` of prompt + completion; ``top_logprobs`` a {token text: logprob} per position (None without
        ``top``; alternatives that decode to the same text keep the likelier)."""
        tokens = [self.token_text(t) for t in ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        tops = None
        if top is not None:
            tops = []
            for alternatives in top:
                named = {}
                for alp, a in alternatives:
                    named.setdefault(self.token_text(a), alp)
                tops.append(named)
        return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": tops, "text_offset": offsets}

    def usage(self, turn: _Turn) -> dict:
        n_prompt, n_out = len(turn.prompt_ids), len(turn.completion_ids)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


# --- HTTP -----------------------------------------------------------------------------------------------------
GATEWAY = web.AppKey("gateway", Gateway)


async def _body(request: web.Request) -> dict:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise ApiError(413, f"request body is larger than {request.app[GATEWAY].config.max_body_bytes} bytes",
                       param="body", code="body_too_large") from exc
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", param="body", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", param="body", code="invalid_json")
    return body


def _api(handler):
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request, request.app[GATEWAY])
        except ApiError as exc:
            return exc.response()
    return wrapped


def _admin(handler):
    async def wrapped(request: web.Request, gw: Gateway) -> web.StreamResponse:
        token = gw.config.admin_token
        if token:
            got = request.headers.get("X-Forge-Admin-Token") or _bearer(request)
            if got != token:
                raise ApiError(401, "admin token missing or wrong (X-Forge-Admin-Token or Authorization: Bearer)",
                               "authentication_error", code="invalid_admin_token")
        return await handler(request, gw)
    return _api(wrapped)


def _bearer(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    return auth[7:].strip() if auth.startswith("Bearer ") else None


def _completion_id(kind: str = "chatcmpl") -> str:
    return f"{kind}-{os.urandom(12).hex()}"


async def serve_call(gw: Gateway, sess: Session, req: ChatRequest, stream):
    """One call of ``sess`` under its lock (counted in flight, waiting out a pause): ``await stream(sess, req,
    call)``'s response when ``req.stream``, else ``(call, result, message, finish)`` once it is recorded. Shared by
    the OpenAI and Anthropic routes."""
    sess.last_active = time.time()  # also while it waits out a pause: not idle
    await gw.wait_resumed()
    gw.inflight += 1
    try:
        async with sess.lock:
            if sess.ended:
                raise ApiError(404, f"session {sess.session_id} has ended ({sess.status})", code="session_ended")
            images = None
            if gw.images is not None and any(IMAGE_KEY in m for m in req.messages):
                # decoding and resizing big screenshots: on the gateway's image threads, off the event loop
                req, images = await asyncio.get_running_loop().run_in_executor(gw.image_worker, gw.with_images, req,
                                                                               sess)
            call = gw.prepare(sess, req, images)
            if req.stream:
                return await stream(sess, req, call)
            result = await gw.generate(sess, call)
            return (call, result, *gw.finish(sess, call, result, req))
    finally:
        gw.inflight -= 1
        sess.last_active = time.time()


def stream_holds(gw: Gateway, req: ChatRequest, call: _Call) -> list[str]:
    """Strings a stream must not emit past (nor a partial one at the end): the tool-call marker, the stops."""
    return [s for s in [gw.parser.start_marker if req.tool_choice != "none" else None,
                        *call.sampling.get("stop", [])] if s]


@_api
async def chat_completions(request: web.Request, gw: Gateway) -> web.StreamResponse:
    sess = gw.session_for_key(request.match_info.get("key") or _bearer(request))
    req = parse_chat_request(await _body(request), gw.config.default_max_tokens)
    req.response_id = _completion_id()
    served = await serve_call(gw, sess, req, lambda sess, req, call: _stream(request, gw, sess, req, call))
    if not isinstance(served, tuple):
        return served
    call, result, message, finish = served
    return web.json_response({
        "id": req.response_id, "object": "chat.completion", "created": int(time.time()), "model": gw.model_name,
        "choices": [{"index": 0, "message": message, "finish_reason": finish,
                     "logprobs": gw.openai_logprobs(result.output_ids, result.logprobs, result.top_logprobs)
                     if req.logprobs else None}],
        "usage": gw.usage(call.turn),
    })


@_api
async def completions(request: web.Request, gw: Gateway) -> web.StreamResponse:
    """``POST /v1/completions``: a raw prompt (text or token ids) for agents that render their own prompts."""
    sess = gw.session_for_key(request.match_info.get("key") or _bearer(request))
    req = parse_completion_request(await _body(request), gw.config.default_max_tokens, gw.vocab_size)
    req.response_id = _completion_id("cmpl")
    served = await serve_call(gw, sess, req, lambda sess, req, call: _stream_text(request, gw, sess, req, call))
    if not isinstance(served, tuple):
        return served
    call, result, message, finish = served
    return web.json_response({
        "id": req.response_id, "object": "text_completion", "created": int(time.time()),
        "model": gw.model_name,
        "choices": [{"index": 0, "text": message["content"] or "", "finish_reason": _text_finish(finish),
                     "logprobs": gw.legacy_logprobs(result.output_ids, result.logprobs, result.top_logprobs,
                                                    len(call.turn.prompt_text)) if req.logprobs else None}],
        "usage": gw.usage(call.turn),
    })


def _text_finish(finish: str) -> str:
    return "length" if finish == "length" else "stop"


async def _stream_text(request, gw: Gateway, sess: Session, req: ChatRequest, call: _Call) -> web.StreamResponse:
    """A completions stream: text deltas held back at stop strings, then the finish reason (and usage)."""
    chunk = _chunk_maker(gw, req.response_id, "text_completion", "text")
    holds = stream_holds(gw, req, call)
    logprobs = StreamedLogprobs(gw, req, call, legacy=True)
    resp = None
    sent = 0

    async def on_partial(result) -> int:
        nonlocal resp, sent
        if resp is None:
            resp = await _sse_response(request)
        _, text = gw.stream_views(call, req, result, holds)
        if len(text) > sent:
            await resp.write(chunk(text[sent:], logprobs=logprobs.take(result)))
            sent = len(text)
        return sent

    done = await _generate_or_error_event(gw, sess, req, call, on_partial, lambda: resp)
    if done is None:
        return resp
    _, message, finish = done
    if resp is None:
        resp = await _sse_response(request)
    text = message["content"] or ""
    await resp.write(chunk(text[sent:], _text_finish(finish), logprobs=logprobs.take(done[0])))
    if req.include_usage:
        await resp.write(chunk("", usage=gw.usage(call.turn)))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _emit_upto(text: str, holds: list[str]) -> int:
    """How much of ``text`` is safe to stream: stop before a marker/stop string (or a partial one at the end)
    and before a trailing incomplete UTF-8 character."""
    end = len(text)
    for h in holds:
        at = text.find(h)
        if at >= 0:
            end = min(end, at)
        for k in range(min(len(h) - 1, len(text)), 0, -1):
            if text.endswith(h[:k]):
                end = min(end, len(text) - k)
                break
    while end > 0 and text[end - 1] == "\ufffd":
        end -= 1
    return end


def _sse(body: dict) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


def _chunk_maker(gw: Gateway, cid: str, obj: str, field: str):
    """The SSE chunk writer of one streamed call (its id ``cid``): ``chunk(value, finish=None, usage=None,
    logprobs=None)`` puts ``value`` in the choice's ``field`` (chat: ``delta``, completions: ``text``); a usage chunk
    has no choices."""
    created = int(time.time())

    def chunk(value, finish: str | None = None, usage: dict | None = None, logprobs: dict | None = None) -> bytes:
        body = {"id": cid, "object": obj, "created": created, "model": gw.model_name,
                "choices": [{"index": 0, field: value, "finish_reason": finish, "logprobs": logprobs}]}
        if usage is not None:
            body["choices"], body["usage"] = [], usage
        return _sse(body)

    return chunk


class StreamedLogprobs:
    """The logprobs a stream owes (requests with ``logprobs``): each chunk written carries those of the tokens sampled
    since the previous one that carried any (text held back at a stop string or a tool-call marker does not hold back
    its tokens' logprobs), the finish chunk the rest, so the chunks' lists joined are the completion's."""

    def __init__(self, gw: Gateway, req: ChatRequest, call: _Call, legacy: bool = False):
        self.gw, self.on, self.legacy = gw, req.logprobs, legacy
        self.sent = 0  # tokens whose logprobs were sent
        self.offset = len(call.turn.prompt_text)  # legacy text_offset of the next token

    def take(self, result) -> dict | None:
        """``choice.logprobs`` of ``result``'s tokens not sent yet (None when off or there are none)."""
        n = min(len(result.output_ids), len(result.logprobs))  # a chunk's logprobs may trail its ids
        if not self.on or n <= self.sent:
            return None
        ids, lps = result.output_ids[self.sent:n], result.logprobs[self.sent:n]
        top = result.top_logprobs[self.sent:n] if result.top_logprobs is not None else None
        if top is not None and len(top) < len(ids):  # a chunk without them (the whole answer is checked at the end)
            top = top + [[]] * (len(ids) - len(top))
        self.sent = n
        if not self.legacy:
            return self.gw.openai_logprobs(ids, lps, top)
        out = self.gw.legacy_logprobs(ids, lps, top, self.offset)
        self.offset += sum(len(t) for t in out["tokens"])
        return out


async def _sse_response(request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def _generate_or_error_event(gw: Gateway, sess: Session, req: ChatRequest, call: _Call, on_partial, started):
    """(result, message, finish) of a streamed call; None once a started SSE response (``started()``) has been ended
    with an OpenAI-style error event (an error before anything was sent is raised: a plain error response)."""
    try:
        result = await gw.generate_streamed(sess, call, on_partial)
        return (result, *gw.finish(sess, call, result, req))
    except ApiError as err:
        resp = started()
        if resp is None:
            raise
        await resp.write(_sse(err.body()))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return None


async def _stream(request, gw: Gateway, sess: Session, req: ChatRequest, call: _Call) -> web.StreamResponse:
    """Stream one call as SSE chunks. Content is held back at the tool-call marker and stop strings; each tool call
    is sent as one tool_calls delta when its block closes (formats without closing markers: at the end). Errors
    after the response has started (e.g. an abort once content was sent) end it with an OpenAI-style error event."""
    chunk = _chunk_maker(gw, req.response_id, "chat.completion.chunk", "delta")
    holds = stream_holds(gw, req, call)
    logprobs = StreamedLogprobs(gw, req, call)
    resp = None
    sent = sent_reasoning = 0
    sent_calls: list[dict] = []  # tool calls sent as their blocks closed, before the completion ended
    closed = 0  # call blocks closed so far

    async def on_partial(result) -> int:
        nonlocal resp, sent, sent_reasoning, closed
        if resp is None:
            resp = await _sse_response(request)
            await resp.write(chunk({"role": "assistant", "content": ""}))
        deltas = []
        reasoning, text = gw.stream_views(call, req, result, holds)
        if reasoning is not None and len(reasoning) > sent_reasoning:
            deltas.append({"reasoning_content": reasoning[sent_reasoning:]})
            sent_reasoning = len(reasoning)
        if len(text) > sent:
            deltas.append({"content": text[sent:]})
            sent = len(text)
        closed, calls = gw.stream_calls(call, req, result, closed)
        for tc in (calls or [])[len(sent_calls):]:
            deltas.append({"tool_calls": [{"index": len(sent_calls), **tc}]})
            sent_calls.append(tc)
        for i, delta in enumerate(deltas):  # the new tokens' logprobs ride on the first
            await resp.write(chunk(delta, logprobs=logprobs.take(result) if i == 0 else None))
        return sent + sent_reasoning + len(sent_calls)

    done = await _generate_or_error_event(gw, sess, req, call, on_partial, lambda: resp)
    if done is None:
        return resp
    _, message, finish = done
    reasoning = message.get("reasoning_content") or ""
    if len(reasoning) > sent_reasoning:
        await resp.write(chunk({"reasoning_content": reasoning[sent_reasoning:]}))
    content = message["content"] or ""
    if len(content) > sent:
        await resp.write(chunk({"content": content[sent:]}))
    calls = adopt_streamed_calls(message, sent_calls)
    if len(calls) > len(sent_calls):
        await resp.write(chunk({"tool_calls": [{"index": i, **tc} for i, tc in enumerate(calls)
                                               if i >= len(sent_calls)]}))
    await resp.write(chunk({}, finish, logprobs=logprobs.take(done[0])))
    if req.include_usage:
        await resp.write(chunk({}, usage=gw.usage(call.turn)))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


class StreamProgress:
    """What an API adapter's stream (Anthropic's, the Responses API's) has sent of one answer: reasoning and content
    characters, and whole tool calls, each as soon as its call's block closes. :meth:`step` returns what is new."""

    def __init__(self, gw: Gateway, req: ChatRequest, call: _Call):
        self.gw, self.req, self.call = gw, req, call
        self.holds = stream_holds(gw, req, call)
        self.reasoning = self.content = 0  # characters sent
        self.calls: list[dict] = []  # tool calls sent
        self._closed = 0

    def step(self, result) -> tuple[str | None, str, list[dict]]:
        """(new reasoning: None while the answer has no reasoning block or content has started, new content, newly
        closed tool calls) of a partial engine result. Content is held back at the tool-call marker and the stop
        strings, and whitespace alone (before a tool call) is not content."""
        reasoning, text = self.gw.stream_views(self.call, self.req, result, self.holds)
        new_reasoning = None
        if reasoning is not None and self.content == 0:
            new_reasoning = reasoning[self.reasoning:]
            self.reasoning = max(self.reasoning, len(reasoning))
        new_text = ""
        if len(text) > self.content and text.strip():
            new_text, self.content = text[self.content:], len(text)
        self._closed, calls = self.gw.stream_calls(self.call, self.req, result, self._closed)
        new_calls = (calls or [])[len(self.calls):]
        self.calls += new_calls
        return new_reasoning, new_text, new_calls

    @property
    def sent(self) -> int:
        return self.content + self.reasoning + len(self.calls)


def adopt_streamed_calls(message: dict, sent: list[dict]) -> list[dict]:
    """The message's tool calls, the ones a stream already sent keeping the ids it sent them with (each parse
    names calls afresh); the message is the turn's record, so the next call renders those ids."""
    calls = message.get("tool_calls") or []
    for tc, early in zip(calls, sent):
        if tc["function"] != early["function"]:
            log.warning("a streamed tool call changed when the completion ended: %s -> %s", early, tc)
            break
        tc["id"] = early["id"]
    return calls


def _engine_error(exc: Exception) -> ApiError:
    if isinstance(exc, EngineRequestError):
        return ApiError(400, f"the engine rejected the call: {exc}")
    return ApiError(503, f"no engine could serve the call: {exc}", "service_unavailable", code="engine_unavailable")


@_api
async def list_models(request: web.Request, gw: Gateway) -> web.Response:
    return web.json_response({"object": "list", "data": [
        {"id": gw.model_name, "object": "model", "created": 0, "owned_by": "forge"}]})


def _group_info(gw: Gateway, task_id: str, size: int, domain: str, metadata) -> dict:
    """What the gateway keeps of a group; with ``--teacher-prompt`` the teacher's system message rendered for its
    task (a 400 naming a field the template needs that the task lacks)."""
    try:
        prefix = gw.teacher_prefix(task_id, domain, metadata if isinstance(metadata, dict) else {})
    except ValueError as exc:
        raise _bad("metadata", str(exc)) from exc
    return {"task_id": task_id, "size": size, "domain": domain, "sessions": 0,
            **({"teacher_prefix": prefix} if prefix is not None else {})}


@_admin
async def create_group(request: web.Request, gw: Gateway) -> web.Response:
    body = await _body(request)
    task_id, size, domain = body.get("task_id"), body.get("size"), body.get("domain", "default")
    if not isinstance(task_id, str) or not task_id:
        raise _bad("task_id", "task_id must be a non-empty string")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise _bad("size", f"size must be an integer >= 1, got {size!r}")
    if not isinstance(domain, str):
        raise _bad("domain", "domain must be a string")
    metadata = body.get("metadata") or {}
    info = _group_info(gw, task_id, size, domain, metadata)  # (before the sink: a task the teacher cannot read)
    try:
        group_id = await gw.to_sink("register_group", task_id, size, domain, metadata)
    except SchemaError as exc:
        raise ApiError(400, str(exc), param="group") from exc
    gw.add_group(group_id, info)
    return web.json_response({"group_id": group_id})


@_admin
async def adopt_group(request: web.Request, gw: Gateway) -> web.Response:
    """A worker of a multi-process gateway takes over a group the sink already has (its first worker died and was
    restarted): the front sends what POST /forge/groups was given. Nothing reaches the sink."""
    if gw.config.worker_tag is None:
        raise ApiError(404, "only the workers of a multi-process gateway adopt groups", code="not_a_worker")
    body = await _body(request)
    group_id, task_id, size = body.get("group_id"), body.get("task_id"), body.get("size")
    if not isinstance(group_id, str) or not group_id or not isinstance(task_id, str) or \
            isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise _bad("group", "adopting a group needs group_id, task_id and size")
    if group_id not in gw.groups:
        gw.add_group(group_id, _group_info(gw, task_id, size, str(body.get("domain", "default")),
                                           body.get("metadata") or {}))
    return web.json_response({"group_id": group_id})


@_admin
async def create_session(request: web.Request, gw: Gateway) -> web.Response:
    body = await _body(request)
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise _bad("metadata", "metadata must be an object")
    evaluation = body.get("eval", False)
    if not isinstance(evaluation, bool):
        raise _bad("eval", "eval must be true or false")
    if evaluation:
        sess = _eval_session(body, metadata, gw.session_ids())
    elif body.get("sampling") is not None:
        raise _bad("sampling", "only eval sessions take sampling overrides (training calls follow the gateway's "
                               "--policy-sampling rule)")
    else:
        group = gw.groups.get(body.get("group_id"))
        if group is None:
            raise ApiError(404, f"unknown group_id {body.get('group_id')!r}: create it with POST /forge/groups",
                           param="group_id", code="group_not_found")
        sess = Session(group_id=body["group_id"], task_id=group["task_id"], domain=group["domain"], metadata=metadata,
                       **gw.session_ids())
        try:
            await gw.to_sink("episode_started", sess.group_id, sess.session_id)
        except SchemaError as exc:  # e.g. the pool closed the group (timed out, completed)
            raise ApiError(409, f"the episode sink refused the session: {exc}", param="group_id",
                           code="group_closed") from exc
        group["sessions"] += 1
    gw.sessions[sess.session_id] = sess
    gw.by_key[sess.api_key] = sess
    return web.json_response({"session_id": sess.session_id, "api_key": sess.api_key,
                              "base_url": f"{gw.base_url}/s/{sess.api_key}/v1",
                              "anthropic_base_url": f"{gw.base_url}/s/{sess.api_key}"})


def _eval_session(body: dict, metadata: dict, ids: dict) -> Session:
    """An evaluation episode: no group, nothing for the sink; the task is named in the request itself."""
    if body.get("group_id") is not None:
        raise _bad("group_id", "an eval session belongs to no group: give task_id and domain instead of group_id")
    task_id, domain = body.get("task_id"), body.get("domain", "default")
    if not isinstance(task_id, str) or not task_id:
        raise _bad("task_id", "an eval session needs task_id, a non-empty string")
    if not isinstance(domain, str) or not domain:
        raise _bad("domain", "domain must be a non-empty string")
    return Session(group_id="", task_id=task_id, domain=domain, metadata=metadata, evaluation=True,
                   sampling=session_sampling(body.get("sampling")), **ids)


@_admin
async def get_session(request: web.Request, gw: Gateway) -> web.Response:
    return web.json_response(gw.session_by_id(request.match_info["sid"]).summary())


@_admin
async def set_reward(request: web.Request, gw: Gateway) -> web.Response:
    sess = gw.session_by_id(request.match_info["sid"], open_only=True)
    body = await _body(request)
    reward, terms = body.get("reward"), body.get("terms") or {}
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
        raise _bad("reward", "reward must be a number")
    if not isinstance(terms, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                              for v in terms.values()):
        raise _bad("terms", "terms must be an object of numbers")
    calls = None
    if body.get("call_rewards") is not None:  # rewards of single calls (checked before anything is set)
        try:
            calls = sess.set_call_rewards(body["call_rewards"])
        except ValueError as exc:
            raise _bad("call_rewards", str(exc)) from exc
    if reward is not None:
        sess.reward = float(reward)
    sess.reward_terms.update({k: float(v) for k, v in terms.items()})
    return web.json_response({"session_id": sess.session_id, "reward": sess.reward, "terms": sess.reward_terms,
                              **({} if calls is None else {"call_rewards": calls})})


@_admin
async def end_session(request: web.Request, gw: Gateway) -> web.Response:
    sess = gw.session_by_id(request.match_info["sid"], open_only=True)
    body = await _body(request)
    status = body.get("status", "finished")
    if status not in EPISODE_STATUSES:
        raise _bad("status", f"status must be one of {EPISODE_STATUSES}, got {status!r}")
    if status == "finished" and not sess.segments:
        raise _bad("status", "the session made no calls; end it as failed or aborted")
    try:
        outcome = await gw.close_session(sess, status)
    except SchemaError as exc:
        raise ApiError(409, f"the episode sink rejected the episode: {exc}", param="episode",
                       code="episode_rejected") from exc
    return web.json_response({"session_id": sess.session_id, "status": status, "sink": outcome,
                              "num_segments": len(sess.segments), "num_calls": len(sess.calls),
                              **sess.sampled_stats()})


@_admin
async def admin_pause(request: web.Request, gw: Gateway) -> web.Response:
    body = await _body(request)
    drain = _number(body, "drain_timeout_s", 0.0, 0.0, 3600.0)
    still = await gw.pause(float(drain))
    return web.json_response({"paused": True, "inflight": still})


@_admin
async def admin_resume(request: web.Request, gw: Gateway) -> web.Response:
    body = await _body(request)
    version = _number(body, "policy_version", None, 0, 1 << 62, integer=True)
    lora_name = body.get("lora_name")
    if lora_name is not None and (not isinstance(lora_name, str) or not 0 < len(lora_name) <= 256):
        raise _bad("lora_name", "lora_name must be the name of the LoRA adapter the engines serve the policy as "
                                "(a non-empty string of at most 256 characters)")
    gw.resume(version, lora_name)
    return web.json_response({"paused": False, "policy_version": gw.policy_version,
                              "policy_adapter": gw.policy_adapter})


@_admin
async def publish_eval(request: web.Request, gw: Gateway) -> web.Response:
    body = await _body(request)
    version = body.get("policy_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise _bad("policy_version", "an evaluation result needs policy_version, an integer >= 0")
    if len(json.dumps(body)) > 1 << 20:
        raise _bad("body", "an evaluation result is at most 1 MiB of JSON")
    gw._eval_ids += 1
    gw.evals.append({**body, "id": gw._eval_ids})
    return web.json_response({"id": gw._eval_ids, "gateway": gw.instance})


@_admin
async def list_evals(request: web.Request, gw: Gateway) -> web.Response:
    try:
        after = int(request.query.get("after", "0"))
    except ValueError:
        raise _bad("after", "after must be an integer (the last id already seen)") from None
    return web.json_response({"evals": [e for e in gw.evals if e["id"] > after], "gateway": gw.instance})


@_admin
async def admin_state(request: web.Request, gw: Gateway) -> web.Response:
    return web.json_response({
        "paused": not gw.resumed.is_set(), "policy_version": gw.policy_version, "inflight": gw.inflight,
        "policy_adapter": gw.policy_adapter,
        "sessions_open": sum(not s.ended for s in gw.sessions.values()),
        "sessions_ended": sum(s.ended for s in gw.sessions.values()), **gw.stats,
        "ended_sessions_mib": round(gw.ended_bytes / 2**20, 3),  # what the ended sessions kept hold
        # inflight: this process's calls on the engine; load: what routing weighs (every worker's, in a multi-process
        # gateway)
        "engines": [{"url": e.url, "up": e.up, "inflight": e.inflight, "load": gw.fleet.load(e), "served": e.served,
                     "failures": e.failures} for e in gw.fleet.engines],
        "group_affinity": dict(gw.fleet.affinity),  # new sessions placed on their group's engine / away from it
        # what the trainer checks against its own flags at start (--rollout-temperature)
        "config": {"policy_sampling": gw.config.policy_sampling, "policy_temperature": gw.config.policy_temperature,
                   "teacher": bool(gw.config.teacher_urls), "teacher_topk": gw.config.teacher_topk,
                   # what a per-call reward model checks its tokenizer against (agents/call_rewards.py)
                   "tokenizer_fingerprint": gw.tokenizer_fingerprint()},
    })


_METRIC_HELP = {
    "calls": ("counter", "chat calls served and recorded"),
    "prompt_tokens": ("counter", "prompt tokens of the calls served"),
    "completion_tokens": ("counter", "tokens the engines sampled for the calls served"),
    "aborts": ("counter", "engine aborts seen (weight updates)"),
    "resumed_tokens": ("counter", "sampled tokens kept across aborts (partial rollout)"),
    "discarded_tokens": ("counter", "sampled tokens thrown away by aborts (--no-resume-aborted)"),
    "policy_sampling_overrides": ("counter", "training calls whose sampling --policy-sampling changed"),
    "tempered_calls": ("counter", "training calls not sampled from the trained policy (--policy-temperature, top_p 1, "
                                  "no top_k): their importance ratios are off"),
    "reaped_sessions": ("counter", "sessions ended as timed_out for being idle"),
    "forgotten_sessions": ("counter", "ended sessions forgotten (GET /forge/sessions/{id}: 404) beyond "
                                      "--keep-ended-sessions / --keep-ended-mib"),
    "images_fetched": ("counter", "image URLs fetched (--image-url-hosts, --image-dir; once per new message)"),
    "image_fetch_failures": ("counter", "image URLs refused or that could not be fetched (each a 400)"),
    "image_prompt_mismatches": ("counter", "calls with images whose prompt the engine counted otherwise than the "
                                           "gateway wrote it (its processor writes images out in another form)"),
    "teacher_scored_tokens": ("counter", "sampled tokens the served distillation teacher scored (--teacher-urls)"),
    "teacher_failed_episodes": ("counter", "episodes sent as failed because the teacher refused to score them"),
}
_POOL_GAUGES = ("queue_depth", "window", "window_ready", "window_pending", "window_occupancy", "policy_version",
                "stale_groups", "stale_episodes", "stale_tokens", "filtered_groups", "filtered_solved",
                "filtered_unsolved", "filtered_episodes", "filtered_tokens", "staleness_mean", "staleness_max",
                "trainer_wait_total_s", "trainer_wait_last_s")


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(gw: Gateway, pool_metrics: dict | None = None) -> str:
    """The gateway's (and the pool's) state in Prometheus' text exposition format."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP forge_{name} {help_text}", f"# TYPE forge_{name} {kind}"])
        lines.extend(f"forge_{name}{labels} {float(value):g}" for labels, value in samples)

    for key, (kind, help_text) in _METRIC_HELP.items():
        metric(f"gateway_{key}_total" if kind == "counter" else f"gateway_{key}", kind, help_text,
               [("", gw.stats[key])])
    metric("gateway_policy_version", "gauge", "policy version the gateway was last resumed with",
           [("", gw.policy_version)])
    metric("gateway_paused", "gauge", "1 while a weight update holds new calls", [("", not gw.resumed.is_set())])
    metric("gateway_inflight_calls", "gauge", "calls being served", [("", gw.inflight)])
    metric("gateway_open_sessions", "gauge", "sessions not ended", [("", sum(not s.ended for s in gw.sessions.values()))])
    engines = [(f'{{engine="{_label(e.url)}"}}', e) for e in gw.fleet.engines]
    metric("engine_up", "gauge", "1 when the engine answers its health check", [(lb, e.up) for lb, e in engines])
    metric("engine_inflight_calls", "gauge", "requests in flight on the engine", [(lb, e.inflight) for lb, e in engines])
    metric("engine_served_total", "counter", "requests the engine answered", [(lb, e.served) for lb, e in engines])
    metric("engine_failures_total", "counter", "requests to the engine that failed", [(lb, e.failures) for lb, e in engines])
    metric("engine_group_placements_total", "counter", "new sessions placed on their group's engine (followed) or "
           "away from it for load (spilled)", [(f'{{placement="{k}"}}', v) for k, v in gw.fleet.affinity.items()])
    if pool_metrics is not None:
        lines += pool_metric_lines(pool_metrics)
    return "\n".join(lines) + "\n"


def pool_metric_lines(pool_metrics: dict) -> list[str]:
    """The data pool's metrics (``DataPool.metrics()``) as Prometheus text lines."""
    lines = []

    def metric(name: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP forge_{name} {help_text}", f"# TYPE forge_{name} gauge"])
        lines.extend(f"forge_{name}{labels} {float(value):g}" for labels, value in samples)

    metric("pool_groups", "data pool groups per state",
           [(f'{{state="{_label(state)}"}}', n) for state, n in sorted(pool_metrics.get("groups", {}).items())])
    for key in _POOL_GAUGES:
        value = pool_metrics.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            metric(f"pool_{key}", f"data pool {key.replace('_', ' ')}", [("", value)])
    return lines


@_admin
async def prometheus_metrics(request: web.Request, gw: Gateway) -> web.Response:
    pool = None
    if gw.config.worker_tag is None and callable(getattr(gw.sink, "metrics", None)):  # the data pool embedded in
        # this process (forge-node); a worker's sink is the front's pool, which the front reports
        pool = await asyncio.to_thread(gw.sink.metrics)
    return web.Response(text=prometheus_text(gw, pool), content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


def make_app(gw: Gateway) -> web.Application:
    app = web.Application(client_max_size=gw.config.max_body_bytes)
    app[GATEWAY] = gw
    from forge_megatron.middleware import anthropic_api, responses_api

    for prefix in ("", "/s/{key}"):
        app.router.add_post(prefix + "/v1/chat/completions", chat_completions)
        app.router.add_post(prefix + "/v1/responses", responses_api.responses)  # OpenAI Responses API
        app.router.add_get(prefix + "/v1/responses/{rid}", responses_api.get_response)  # stored responses
        app.router.add_delete(prefix + "/v1/responses/{rid}", responses_api.delete_response)
        app.router.add_post(prefix + "/v1/completions", completions)  # raw prompts (text or token ids)
        app.router.add_post(prefix + "/v1/messages", anthropic_api.messages)  # Anthropic Messages API
        app.router.add_post(prefix + "/v1/messages/count_tokens", anthropic_api.count_tokens)
        app.router.add_get(prefix + "/v1/models", list_models)
    app.router.add_post("/forge/groups", create_group)
    app.router.add_post("/forge/groups/adopt", adopt_group)
    app.router.add_post("/forge/sessions", create_session)
    app.router.add_get("/forge/sessions/{sid}", get_session)
    app.router.add_post("/forge/sessions/{sid}/reward", set_reward)
    app.router.add_post("/forge/sessions/{sid}/end", end_session)
    app.router.add_post("/forge/evals", publish_eval)
    app.router.add_get("/forge/evals", list_evals)
    app.router.add_get("/metrics", prometheus_metrics)
    app.router.add_post("/forge/admin/pause", admin_pause)
    app.router.add_post("/forge/admin/resume", admin_resume)
    app.router.add_get("/forge/admin/state", admin_state)
    return app


async def serve(gw: Gateway, ready=None) -> None:
    """Serve until cancelled; ``ready(port)`` is called once listening (port 0 picks a free one)."""
    def started(port: int) -> None:
        if gw.config.public_url is None:
            gw.base_url = advertised_url(gw.config.host, port)
        gw.start_background()

    await serve_app(make_app(gw), gw.config.host, gw.config.port, ready, started=started, stopping=gw.stop_background)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_session_options(p) -> None:
    """How calls are parsed, sampled and recorded: the flags forge-gateway and forge-node share."""
    p.add_argument("--tool-parser", default="hermes", metavar="NAME",
                   help="the served model's tool-call format (SGLang's --tool-call-parser names): "
                        + ", ".join(parser_names()) + " (default hermes)")
    p.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="answer the model's thinking block as reasoning_content (Anthropic: thinking blocks) and parse "
                        "tool calls after it (SGLang's --reasoning-parser names): "
                        + ", ".join(reasoning_parser_names()) + " (default: none, the text as generated)")
    p.add_argument("--chat-template-kwargs", type=_json_object, default={}, metavar="JSON",
                   help='extra chat-template variables for every call, e.g. \'{"enable_thinking": false}\' '
                        "(a request's own chat_template_kwargs win)")
    p.add_argument("--default-max-tokens", type=int, default=1024,
                   help="max_tokens of a call that sets neither max_tokens nor max_completion_tokens")
    p.add_argument("--return-routed-experts", action="store_true",
                   help="MoE models: ask the engines for each token's routed experts and keep them in the episodes "
                        "for rollout routing replay (trainer --routing-replay; SGLang --enable-return-routed-experts)")
    p.add_argument("--policy-sampling", action="store_true",
                   help="sample every training call from the trained policy (--policy-temperature, top_p 1, no "
                        "top_k), whatever the agent asks, so recorded logprobs are the sampler's and the trainer's "
                        "(eval sessions exempt)")
    p.add_argument("--policy-temperature", type=float, default=1.0,
                   help="the temperature the trainer scores tokens at (its --rollout-temperature, default 1): "
                        "--policy-sampling samples training calls at it, and calls at another one count as "
                        "tempered_calls")
    p.add_argument("--session-idle-timeout-s", type=float, default=None,
                   help="end open sessions with no call for this long as timed_out (their agent or driver died); "
                        "default: never")
    p.add_argument("--keep-ended-sessions", type=int, default=1000, metavar="N",
                   help="ended sessions kept for GET /forge/sessions/{id} (default 1000; older ones are forgotten)")
    p.add_argument("--keep-ended-mib", type=float, default=1024.0, metavar="MIB",
                   help="... and at most this much memory of their recorded tokens, logprobs, versions and MoE "
                        "routing (default 1024; a 140k-token session takes ~3 MiB, ~50 more with routing replay "
                        "on a 48-layer top-8 MoE)")
    p.add_argument("--group-affinity-slack", type=int, default=32, metavar="N",
                   help="open a session on the engine its group's sessions use (their shared prompt prefilled and "
                        "cached once) unless it has more than N calls in flight over the least-loaded engine "
                        "(default 32; -1: every new session to the least-loaded engine)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the tokenizer / config code the checkpoint ships (Kimi-K2's tokenizer), from "
                        "--model-path only (SGLang's flag; the engines need it too)")
    p.add_argument("--malformed-call-reward", type=float, default=0.0, metavar="R",
                   help="a reward (e.g. -0.1) on each call per malformed tool call it made, at its last token: the "
                        "malformed-call penalty credited to the call that made it rather than to the whole episode "
                        "(a reward of a single call: docs/middleware.md); the pool's malformed_tool_calls weight must "
                        "then be 0, which forge-node sets (default 0: off)")
    p.add_argument("--max-body-mib", type=float, default=8.0, metavar="MIB",
                   help="largest request body (default 8): agents that send images send their history's images with "
                        "every call (inline, base64), so raise it for them (a 1-megapixel PNG is ~2 MiB in base64)")
    p.add_argument("--image-threads", type=int, default=4, metavar="N",
                   help="threads that decode and normalise the agents' new images, off the event loop (default 4; "
                        "each image once, cached by content: benchmarks/image_normalize.py)")
    p.add_argument("--image-url-hosts", default="", metavar="GLOBS",
                   help="fetch image URLs (http/https) of hosts matching these comma-separated globs, e.g. "
                        "'images.example.com,*.s3.amazonaws.com' or '*' for any public host (default: none, only "
                        "inline data URLs; see docs/middleware.md 'Image URLs' for the guards)")
    p.add_argument("--image-url-private", action="store_true",
                   help="also fetch from hosts that resolve to private, loopback or link-local addresses (the "
                        "cluster's own image store); refused by default")
    p.add_argument("--image-dir", default=None, metavar="DIR",
                   help="take file:///path image URLs of files under DIR (an agent on the gateway's host, e.g. a GUI "
                        "agent's screenshots); default: none")
    p.add_argument("--image-url-timeout-s", type=float, default=10.0, metavar="S",
                   help="the whole fetch of one image URL, redirects included (default 10)")
    p.add_argument("--teacher-urls", default="", metavar="URLS",
                   help="on-policy distillation from a served teacher: comma-separated SGLang URLs serving a model "
                        "with the policy's tokenizer; each episode's sampled tokens are scored with it when the "
                        "episode ends (prefill only, at --policy-temperature) and the logprobs go with it to the "
                        "trainer (--teacher-from-gateway); text models (docs/middleware.md)")
    p.add_argument("--teacher-timeout-s", type=float, default=120.0, metavar="S",
                   help="one teacher call (a segment's prefill; default 120)")
    p.add_argument("--teacher-topk", type=int, default=0, metavar="K",
                   help="with --teacher-urls: also record the teacher's K most likely tokens and their logprobs at "
                        "every sampled token (SGLang's top_logprobs_num in the same prefill), for the trainer's dense "
                        "KL (--distill-kl forward|reverse|jsd --distill-topk <= K); default 0: the sampled tokens' "
                        "logprobs only")
    p.add_argument("--teacher-prompt", default=None, metavar="TEMPLATE",
                   help="with --teacher-urls: a privileged system message the teacher reads before each segment "
                        "(the student never sees it), filled in with the task's fields: {task_id}, {domain} and its "
                        "metadata, e.g. 'A correct final answer is {answer}.' (on-policy self-distillation from "
                        "privileged information; a group whose task lacks a field is refused)")
    p.add_argument("--no-resume-aborted", dest="resume_aborted", action="store_false",
                   help="re-issue a call that an engine aborted for a weight update from its prompt, dropping the "
                        "tokens it had sampled (default: go on from them, each token keeping the policy version and "
                        "logprob it was sampled with, a stream without a break)")


def session_options(args: argparse.Namespace) -> dict:
    """The GatewayConfig fields of :func:`add_session_options`' flags."""
    return dict(tool_parser=args.tool_parser, reasoning_parser=args.reasoning_parser,
                chat_template_kwargs=args.chat_template_kwargs, default_max_tokens=args.default_max_tokens,
                return_routed_experts=args.return_routed_experts, resume_aborted=args.resume_aborted,
                policy_sampling=args.policy_sampling, policy_temperature=args.policy_temperature,
                session_idle_timeout_s=args.session_idle_timeout_s, trust_remote_code=args.trust_remote_code,
                group_affinity_slack=None if args.group_affinity_slack < 0 else args.group_affinity_slack,
                keep_ended_sessions=args.keep_ended_sessions, keep_ended_mib=args.keep_ended_mib,
                max_body_bytes=int(args.max_body_mib * 2**20), image_threads=args.image_threads,
                image_url_hosts=tuple(h.strip() for h in args.image_url_hosts.split(",") if h.strip()),
                image_url_private=args.image_url_private, image_dir=args.image_dir,
                image_url_timeout_s=args.image_url_timeout_s,
                teacher_urls=tuple(u.strip() for u in args.teacher_urls.split(",") if u.strip()),
                teacher_timeout_s=args.teacher_timeout_s, teacher_prompt=args.teacher_prompt,
                teacher_topk=args.teacher_topk, malformed_call_reward=args.malformed_call_reward)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="forge-gateway",
        description="OpenAI-compatible gateway that records agent calls as training episodes. Example: "
                    "forge-gateway --model-path /tmp/tiny --engines http://127.0.0.1:30000 --port 8000",
    )
    p.add_argument("--model-path", required=True, help="local HF directory with the tokenizer and chat template")
    p.add_argument("--engines", required=True, help="comma-separated SGLang/forge-engine URLs")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback; others need --admin-token)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0 picks a free one; printed as FORGE_READY)")
    p.add_argument("--public-url", default=None,
                   help="base URL handed to agents (default http://host:port; bound to 0.0.0.0: this machine's host "
                        "name); with --workers, agents then call through this one URL")
    p.add_argument("--admin-token", default=os.environ.get("FORGE_ADMIN_TOKEN"),
                   help="token for /forge/* (env FORGE_ADMIN_TOKEN); required beyond loopback")
    p.add_argument("--context-length", type=int, default=None, help="max prompt tokens + new tokens")
    p.add_argument("--pause-wait-s", type=float, default=120.0, help="how long calls wait while paused")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="serve sessions from N gateway processes behind this one (each session lives in one; agents "
                        "get the worker's own base URL): one process prepares ~50 long-context calls/s. Default 1")
    add_session_options(p)
    p.add_argument("--episodes-jsonl", default=None,
                   help="append finished episodes to this JSONL file (default: keep them in memory)")
    return p


class JsonlSink(ListSink):
    """ListSink that also appends each episode as one JSON line (standalone runs without a data pool)."""

    def __init__(self, path: str, id_prefix: str = ""):
        super().__init__(id_prefix)
        self.path = path

    def submit_episode(self, episode) -> None:
        import fcntl

        super().submit_episode(episode)
        line = (json.dumps(episode.to_dict()) + "\n").encode()
        with open(self.path, "ab") as f:  # the workers of a multi-process gateway append to one file: whole lines
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                f.write(line)
                f.flush()
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s forge-gateway %(message)s")
    try:
        config = GatewayConfig(
            model_path=args.model_path, engine_urls=[u for u in args.engines.split(",") if u], host=args.host,
            port=args.port, public_url=args.public_url, admin_token=args.admin_token,
            context_length=args.context_length, pause_wait_s=args.pause_wait_s, **session_options(args))
    except ValueError as exc:
        raise SystemExit(f"forge-gateway: {exc}") from exc
    if args.workers < 1:
        raise SystemExit(f"forge-gateway: --workers must be >= 1, got {args.workers}")
    if config.malformed_call_reward:
        logging.warning("--malformed-call-reward %g: give the data pool --reward-weights malformed_tool_calls=0, or "
                        "malformed tool calls are penalised twice (forge-node does that itself)",
                        config.malformed_call_reward)
    if args.workers > 1:
        from forge_megatron.middleware.gateway_front import GatewayFront, serve_front

        spec = {"kind": "jsonl", "path": os.path.abspath(args.episodes_jsonl)} if args.episodes_jsonl else \
            {"kind": "list"}
        try:
            asyncio.run(serve_front(GatewayFront(config, args.workers, spec), ready=print_ready))
        except RuntimeError as exc:  # a worker did not start: its own output says why
            raise SystemExit(f"forge-gateway: {exc}") from exc
        return
    sink = JsonlSink(args.episodes_jsonl) if args.episodes_jsonl else ListSink()
    try:
        gw = Gateway(config, sink=sink)
    except ValueError as exc:  # e.g. --return-routed-experts on a dense model
        raise SystemExit(f"forge-gateway: {exc}") from exc
    asyncio.run(until_terminated(serve(gw, ready=print_ready)))  # SIGTERM: stops cleanly, exit 0


if __name__ == "__main__":
    # python -m runs this file as __main__, a second copy of the module: the Anthropic and Responses routes import
    # forge_megatron.middleware.gateway and look the gateway up under that module's app key, so serve from it
    from forge_megatron.middleware import gateway as _gateway

    _gateway.main()
