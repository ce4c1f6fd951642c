"""Process rewards per call: a reward model scores the conversation after each call the agent made.

An outcome verifier gives an episode one number; in a long agent episode that credits every call alike. With
``--call-rm-url`` the rollout driver also asks a reward model (a process reward model, or any one-label sequence
classifier served on SGLang's ``POST /classify``, forge-engine alike on CPU) for a score ``s_c`` of the conversation as
it stood after each call ``c``: that call's prompt and completion ids exactly as the gateway recorded them
(``GET /forge/sessions/{id}``), so no text is re-rendered or re-tokenised. The reward model must therefore read the
policy's token ids: its tokenizer (``--call-rm-tokenizer``) is checked against the gateway's at start-up (the
gateway's ``/forge/admin/state`` carries its vocabulary's fingerprint).

Each scored call gets a reward of its own (``POST /forge/sessions/{id}/reward {call_rewards}``), which the pool makes
a reward-to-go step (docs/algorithms.md, "Per-call rewards"):

- ``delta`` (default): ``w * (s_c - s_{c-1})``, ``s_{-1}`` the score of the first call's prompt: potential-based
  shaping (Ng et al. 1999), the calls' rewards add up to ``w * (s_last - s_start)`` whatever path led there, so the
  shaping cannot make a policy that farms intermediate scores better than one that reaches a good end;
- ``score``: ``w * s_c``, each call judged on its own (a PRM trained to score steps).

``--call-rm-weight`` w (default 1) weighs them against the outcome. With ``--call-rm-step-separator SEP`` (e.g.
``"\\n\\n"``) a call's completion is cut into steps at each SEP (a step ends with the token holding the end of
the separator; the completion's last token ends the last step) and every step is scored and rewarded at its last
token (``{"call", "token", "reward"}``): process supervision of the reasoning steps inside one answer, Math-Shepherd /
PRM800K style, for episodes of a single call as well as agents. Training episodes only (evaluation episodes are
not trained on). Failures are the verifier's: connection errors, timeouts and 5xx answers are tried again
(``--call-rm-attempts``), a 4xx or an answer without a finite score fails the episode with the reason logged, never
a silent zero. An episode's sequences go to the reward model in one request (SGLang's batch form, ``BATCH`` at most
per request), and a group's identical prefixes (a shared prompt) are scored once (``cache_size``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from forge_megatron.agents.remote import ScoreCache, check_base_url
from forge_megatron.agents.reward_model import classify_scores
from forge_megatron.middleware.gateway_sessions import vocabulary_fingerprint

MODES = ("delta", "score")
BATCH = 64  # sequences scored per /classify request


class CallRewardError(ValueError):
    """The reward model gave no usable score for a call."""


@dataclass
class CallRewardModel:
    """The per-call rewards of an episode's calls from the reward model at ``base_url`` (``http://host:port``)."""

    base_url: str
    weight: float = 1.0
    mode: str = "delta"
    label: int = 0
    api_key: str | None = None
    attempts: int = 3
    timeout_s: float = 15.0
    cache_size: int = 4096
    step_separator: str | None = None  # cut completions into steps at it (needs ``tokenizer``)
    tokenizer: object = None  # the policy's (the reward model's) tokenizer: decodes completions to find the steps

    def __post_init__(self):
        self.base_url = check_base_url(self.base_url, "call reward model URL")
        if self.step_separator is not None and (not self.step_separator or self.tokenizer is None):
            raise ValueError("call reward steps need a non-empty separator and the tokenizer that decodes them")
        if self.mode not in MODES:
            raise ValueError(f"call reward mode must be one of {MODES}, got {self.mode!r}")
        if not math.isfinite(self.weight) or self.label < 0 or self.attempts < 1 or self.timeout_s <= 0:
            raise ValueError("call reward model: weight must be finite, label >= 0, attempts >= 1, timeout_s > 0")
        self._cache = ScoreCache(self.cache_size)

    @property
    def url(self) -> str:
        return f"{self.base_url}/classify"

    def scores(self, sequences: list[list[int]]) -> list[float]:
        """The reward model's scores of ``sequences``: cached ones from the cache, the others in requests of
        ``BATCH`` sequences (one per episode in the common case, however many calls or steps it has)."""
        keys = [tuple(ids) for ids in sequences]
        out = {k: self._cache.get(k) for k in keys}
        todo = list(dict.fromkeys(k for k in keys if out[k] is None))
        for lo in range(0, len(todo), BATCH):
            chunk = todo[lo:lo + BATCH]
            for k, value in zip(chunk, classify_scores(self.url, [list(k) for k in chunk], self.label, self.attempts,
                                                       self.timeout_s, self.api_key, CallRewardError,
                                                       "call reward model", "--call-rm-label")):
                out[k] = value
                self._cache.put(k, value)
        return [out[k] for k in keys]

    def step_ends(self, completion_ids: list[int]) -> list[int]:
        """The completion's step ends with ``step_separator``: the token holding the end of each separator, and the
        last token (increasing, each once). Without a separator: the last token alone."""
        n = len(completion_ids)
        if self.step_separator is None:
            return [n - 1]

        def decode(k: int) -> str:  # the text of the first k tokens
            return self.tokenizer.decode(completion_ids[:k], skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False)

        # Tokens are not characters: a byte-level token may hold part of a character (decoded alone, a replacement
        # character) and a sentencepiece token's leading space shows only in context. So the text is the whole
        # completion's, and each separator's end is placed at the first token whose prefix decodes to the text up
        # to it (a binary search: the prefixes' texts only grow).
        text, ends, start = decode(n), [], 0
        while (hit := text.find(self.step_separator, start)) >= 0:
            start = hit + len(self.step_separator)
            head, lo, hi = text[:start], ends[-1] + 1 if ends else 1, n  # (each end at or after the one before)
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if decode(mid).startswith(head) else (mid + 1, hi)
            ends.append(lo - 1)
        return sorted(set(ends) | {n - 1})

    def __call__(self, calls: list[dict]) -> list[dict]:
        """``calls``: the session's calls as ``GET /forge/sessions/{id}`` lists them (``prompt_ids``,
        ``completion_ids``). Returns the ``call_rewards`` items of every call that sampled tokens (one per step with
        a separator)."""
        points, sequences = [], []  # (call, step end) and the sequence scored there
        for index, call in enumerate(calls):
            completion = list(call.get("completion_ids") or [])
            if not completion:
                continue  # (nothing sampled: no token to credit)
            prompt = list(call["prompt_ids"])
            if not sequences and self.mode == "delta":  # the first prompt's score: where the shaping starts
                sequences.append(prompt)
            for end in self.step_ends(completion):
                points.append((index, end))
                sequences.append(prompt + completion[:end + 1])
        if not points:
            return []
        scores = self.scores(sequences)
        if self.mode == "delta":
            scores = [b - a for a, b in zip(scores, scores[1:])]
        return [{"call": index, "token": end, "reward": self.weight * s} for (index, end), s in zip(points, scores)]


def add_call_reward_arguments(p) -> None:
    g = p.add_argument_group("per-call rewards from a reward model (agents/call_rewards.py)")
    g.add_argument("--call-rm-url", default=None,
                   help="base URL of a reward model's server (SGLang --is-embedding or forge-engine on a sequence "
                        "classifier) that scores the conversation after each call of every training episode; the "
                        "scores become rewards of single calls (default: off)")
    g.add_argument("--call-rm-tokenizer", default=None, metavar="DIR",
                   help="the reward model's tokenizer directory: it reads the policy's token ids, so its vocabulary "
                        "is checked against the gateway's at start-up (required with --call-rm-url)")
    g.add_argument("--call-rm-mode", choices=MODES, default="delta",
                   help="delta (default): w (s_c - s_{c-1}), potential-based shaping that sums to the score's change "
                        "over the episode; score: w s_c")
    g.add_argument("--call-rm-weight", type=float, default=1.0, help="w, the rewards' weight against the outcome")
    g.add_argument("--call-rm-step-separator", default=None, metavar="SEP",
                   help="score and reward every step of a completion, the steps cut at SEP (any script; backslash "
                        "escapes read: '\\n\\n' is a blank line), not only each call's end")
    g.add_argument("--call-rm-label", type=int, default=0,
                   help="which of the classifier's outputs is the score (default 0)")
    g.add_argument("--call-rm-api-key-env", default=None, metavar="VAR",
                   help="environment variable holding the server's API key (sent as a bearer token)")
    g.add_argument("--call-rm-attempts", type=int, default=3, help="tries per score (connection errors, 5xx)")
    g.add_argument("--call-rm-timeout-s", type=float, default=15.0, help="seconds per request")


def call_rewards_from_args(args, gateway=None) -> CallRewardModel | None:
    """The ``CallRewardModel`` of :func:`add_call_reward_arguments`' options (None without ``--call-rm-url``); with
    ``gateway`` (a GatewayClient) the reward model's tokenizer is checked against the policy's there."""
    import os

    if not getattr(args, "call_rm_url", None):
        given = [f for f in ("call_rm_tokenizer", "call_rm_api_key_env", "call_rm_step_separator")
                 if getattr(args, f, None)]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} is an option of --call-rm-url")
        return None
    if not args.call_rm_tokenizer:
        raise ValueError("--call-rm-url needs --call-rm-tokenizer (the reward model's tokenizer directory, checked "
                         "against the policy's: the reward model reads the policy's token ids)")
    api_key = None
    if args.call_rm_api_key_env:
        api_key = os.environ.get(args.call_rm_api_key_env)
        if not api_key:
            raise ValueError(f"--call-rm-api-key-env {args.call_rm_api_key_env}: the variable is not set")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.call_rm_tokenizer, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--call-rm-tokenizer {args.call_rm_tokenizer!r}: {exc}") from None
    if gateway is not None:
        check_tokenizer(tokenizer, args.call_rm_tokenizer, gateway.state())
    separator = getattr(args, "call_rm_step_separator", None)
    if separator is not None:  # backslash escapes (\n, \t, \u2192) read; other characters, any script, as given
        import codecs

        separator = codecs.decode(separator.encode("latin-1", "backslashreplace"), "unicode_escape")
    return CallRewardModel(args.call_rm_url, weight=args.call_rm_weight, mode=args.call_rm_mode,
                           label=args.call_rm_label, api_key=api_key, attempts=args.call_rm_attempts,
                           timeout_s=args.call_rm_timeout_s, step_separator=separator,
                           tokenizer=tokenizer if separator is not None else None)


def check_tokenizer(tokenizer, tokenizer_dir: str, gateway_state: dict) -> None:
    """ValueError unless ``tokenizer`` (loaded from ``tokenizer_dir``) maps every token to the id the gateway's (the
    policy's) does (``gateway_state``: ``/forge/admin/state``)."""
    want = (gateway_state.get("config") or {}).get("tokenizer_fingerprint")
    if not want:
        raise ValueError("the gateway does not report its tokenizer's fingerprint (a forge-gateway from before "
                         "2026-12-05): cannot check --call-rm-tokenizer against the policy's")
    got = vocabulary_fingerprint(tokenizer.get_vocab())
    if got != want:
        raise ValueError(f"--call-rm-tokenizer {tokenizer_dir}: its vocabulary is not the policy's (fingerprint {got} "
                         f"vs the gateway's {want}): the reward model scores the policy's token ids, so both must use "
                         "one tokenizer")
