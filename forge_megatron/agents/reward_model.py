"""Reward-model rewards: a verifier that scores an episode's answer with a trained reward model served by SGLang.

A reward model (a sequence classifier: Skywork-Reward, InternLM2-Reward, Qwen2.5-Math-RM, ...; ``*ForSequence
Classification`` with one label) reads a conversation and gives one number. SGLang serves it with
``--is-embedding`` on ``POST /classify`` (``EmbeddingReqInput``: ``text`` or ``input_ids``; the answer's
``embedding`` holds the classifier's logits at the last token), forge-engine alike on CPU (rollout/reward_model.py).

``RewardModelVerifier`` is a verifier like any other (``(task, output) -> reward``, runner.py): ``--verifier rm`` for
every domain or ``--verifier chat=rm`` for one, composed by the pool with the process and completion-time terms. The
conversation it scores is the task's prompt as the user's turn and the agent's answer (JSON for a non-string) as the
assistant's, rendered with the reward model's own chat template (its tokenizer, ``--rm-tokenizer``, read from local
files) into token ids, which are sent as they are (no second tokenization, so no doubled BOS). The reward is the
score (``transform="raw"``, the default: GRPO's group normalisation takes care of its scale) or its sigmoid
(``"sigmoid"``, in (0, 1): a Bradley-Terry model's probability of beating a zero-score answer).

Failures are handled as the judge's are: connection errors, timeouts and 5xx answers are tried again (``attempts``,
``timeout_s`` each, within the 60 s the runner gives a verifier), a 4xx answer (an input over the context length, a
wrong endpoint) fails at once with the server's message, and an answer without a finite score fails the episode
naming the endpoint, never a silent zero. Scores are deterministic, so they are kept per conversation
(``cache_size``): a group's identical answers are scored once.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass

from forge_megatron.agents.remote import Retryable, ScoreCache, check_base_url, options_checked, post_json

TRANSFORMS = ("raw", "sigmoid")


class RewardModelError(ValueError):
    """The reward model gave no usable score (its endpoint failed or its answers had none)."""


@dataclass
class RewardModelVerifier:
    """``(task, output) -> score`` of the reward model at ``base_url`` (SGLang's native API: ``http://host:port``)."""

    base_url: str
    tokenizer_path: str
    transform: str = "raw"
    label: int = 0  # which of the classifier's outputs is the reward (one-label reward models: 0)
    api_key: str | None = None
    attempts: int = 3
    timeout_s: float = 15.0
    cache_size: int = 4096

    def __post_init__(self):
        from transformers import AutoTokenizer

        self.base_url = check_base_url(self.base_url, "reward model URL")
        if self.transform not in TRANSFORMS:
            raise ValueError(f"reward model transform must be one of {TRANSFORMS}, got {self.transform!r}")
        if self.label < 0 or self.attempts < 1 or self.timeout_s <= 0:
            raise ValueError("reward model label must be >= 0, attempts >= 1 and timeout_s > 0")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"reward model tokenizer {self.tokenizer_path!r}: {exc}") from None
        if not self.tokenizer.chat_template:
            raise ValueError(f"reward model tokenizer {self.tokenizer_path!r} has no chat template: the reward model "
                             "scores conversations rendered with its own template")
        self._cache = ScoreCache(self.cache_size)
        # the runner scores a group's episodes on their own threads; a fast tokenizer's settings (truncation,
        # padding) are shared state, so rendering is serialised on it (tokenizers can raise "Already borrowed")
        self._tokenizer_lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"{self.base_url}/classify"

    def input_ids(self, task, output) -> list[int]:
        """The conversation (the task's prompt, the agent's answer) in the reward model's chat template."""
        text = output if isinstance(output, str) else json.dumps(output)
        conversation = [{"role": "user", "content": task.prompt}, {"role": "assistant", "content": text}]
        with self._tokenizer_lock:
            ids = self.tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)
        return [int(x) for x in (ids["input_ids"] if isinstance(ids, dict) else ids)]

    def reward_of(self, score: float) -> float:
        if self.transform == "raw":
            return score
        z = math.exp(-abs(score))  # (a sigmoid that cannot overflow)
        return 1.0 / (1.0 + z) if score >= 0 else z / (1.0 + z)

    def __call__(self, task, output) -> float:
        ids = self.input_ids(task, output)
        key = tuple(ids)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        reward = self.reward_of(classify_score(self.url, ids, self.label, self.attempts, self.timeout_s, self.api_key,
                                               RewardModelError, "reward model", "--rm-label",
                                               f" for task {task.task_id}"))
        self._cache.put(key, reward)
        return reward


def classify_score(url: str, ids: list[int], label: int, attempts: int, timeout_s: float, api_key: str | None,
                   refused: type[Exception], who: str, label_flag: str, context: str = "") -> float:
    """The score of one token sequence: :func:`classify_scores` of a batch of one."""
    return classify_scores(url, [ids], label, attempts, timeout_s, api_key, refused, who, label_flag, context)[0]


def classify_scores(url: str, batch: list[list[int]], label: int, attempts: int, timeout_s: float,
                    api_key: str | None, refused: type[Exception], who: str, label_flag: str,
                    context: str = "") -> list[float]:
    """The scores (output ``label``) of the token sequences ``batch`` from the reward model's ``/classify`` at ``url``,
    in one request (SGLang's batch form, ``input_ids`` a list of lists: one answer per sequence): connection errors,
    timeouts, 5xx answers and answers without a finite score for every sequence are tried again (``attempts``), a
    4xx raises ``refused`` at once with the server's message, and so does a model with fewer outputs than ``label``
    asks for (``label_flag`` names the option); no scores after every attempt raise ``refused`` naming ``who``,
    ``url`` and ``context``."""
    last = None
    for attempt in range(attempts):
        try:
            answer = post_json(url, {"input_ids": [list(ids) for ids in batch]}, timeout_s, api_key, refused, who)
        except Retryable as exc:
            last = str(exc)
            time.sleep(min(2.0, 0.25 * 2 ** attempt))
            continue
        answers = answer if isinstance(answer, list) else [answer]  # (a server may answer a batch of one alone)
        scores = [math.nan] * len(batch)
        if len(answers) == len(batch):
            for k, one in enumerate(answers):
                embedding = one.get("embedding") if isinstance(one, dict) else None
                if isinstance(embedding, list) and len(embedding) <= label:
                    raise refused(f"{who} {url} gives {len(embedding)} output(s) per input; {label_flag} {label} "
                                  f"asks for output {label}")
                try:
                    scores[k] = float(embedding[label]) if isinstance(embedding, list) else math.nan
                except (TypeError, ValueError):
                    pass
        if all(math.isfinite(x) for x in scores):
            return scores
        last = f"no finite embedding[{label}] for every input in its answer {str(answer)[:300]!r}"
    raise refused(f"{who} {url} gave no score{context} in {attempts} attempt(s): {last}")


def add_reward_model_arguments(p) -> None:
    g = p.add_argument_group("reward model (--verifier [DOMAIN=]rm)")
    g.add_argument("--rm-url", default=None,
                   help="base URL of the reward model's server (http://host:port: SGLang launched with "
                        "--is-embedding, or forge-engine on a sequence-classification checkpoint); scored on /classify")
    g.add_argument("--rm-tokenizer", default=None, metavar="DIR",
                   help="the reward model's tokenizer (a local directory with its chat template): the conversation "
                        "is rendered with it and sent as token ids")
    g.add_argument("--rm-transform", choices=TRANSFORMS, default="raw",
                   help="reward = the score (raw, default) or its sigmoid (in (0, 1))")
    g.add_argument("--rm-label", type=int, default=0,
                   help="which of the classifier's outputs is the reward (default 0: one-label reward models)")
    g.add_argument("--rm-api-key-env", default=None, metavar="VAR",
                   help="environment variable holding the reward model server's API key (sent as a bearer token)")
    g.add_argument("--rm-attempts", type=int, default=3,
                   help="tries per episode before it fails (connection errors, timeouts, 5xx, answers without a "
                        "score)")
    g.add_argument("--rm-timeout-s", type=float, default=15.0,
                   help="seconds per request; attempts x this must fit the 60 s the runner gives a verifier")


def reward_model_from_args(args) -> RewardModelVerifier:
    """The ``RewardModelVerifier`` of ``add_reward_model_arguments``' options; clear errors for missing or bad ones."""
    if not getattr(args, "rm_url", None) or not getattr(args, "rm_tokenizer", None):
        raise ValueError("--verifier ...=rm needs --rm-url (the reward model server) and --rm-tokenizer (its "
                         "tokenizer directory, for the chat template)")
    api_key = options_checked(args, "rm")
    return RewardModelVerifier(args.rm_url, args.rm_tokenizer, transform=args.rm_transform, label=args.rm_label,
                               api_key=api_key, attempts=args.rm_attempts, timeout_s=args.rm_timeout_s)
