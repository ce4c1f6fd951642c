"""LLM-graded rewards: a verifier that asks a judge model, served behind an OpenAI-compatible endpoint, to grade an
episode's answer against a rubric.

Open-ended tasks (writing, research reports, agent trajectories without a checkable answer) have no exact-match
answer; a judge model reads the task, the reference answer when there is one, and the agent's answer, and ends its
reply with ``Score: N``. ``JudgeVerifier`` is a verifier like any other (``(task, output) -> reward``, runner.py), so
it plugs into ``--verifier`` for every domain or one (``--verifier chat=judge``) and the pool composes its reward
with the process and completion-time terms as usual.

The endpoint is any OpenAI-compatible ``/v1/chat/completions``: an SGLang server of the judge model (started like
the policy's engines, not trained, its weights never synced), forge-engine on CPU, or a hosted API. The judge runs
at temperature 0 by default; an answer without a readable score in ``[0, max_score]`` is asked again at
``retry_temperature`` (a greedy judge would only repeat itself), up to ``attempts`` times, as are connection errors,
timeouts (``timeout_s`` per request) and 5xx answers (after a short back-off), all within the 60 s the runner gives
a verifier; a 4xx answer (a wrong model name, a bad key) fails at once with the
server's message. When no attempt yields a score the verifier raises ``ValueError`` naming the endpoint and the last
answer, and the runner fails that episode (runner.score), so a misbehaving judge never turns into a silent zero.

The reward is ``score / max_score``, in [0, 1]. A greedy judge's scores are kept per prompt (``cache_size``, 4096):
a group's identical answers to one task are judged once. The rubric is a ``str.format`` template with ``{prompt}``,
``{answer}`` (the task's reference answer, empty if none), ``{output}`` (the agent's answer; JSON for a non-string)
and ``{max_score}`` (literal braces, e.g. a JSON example, written ``{{`` and ``}}``); unknown placeholders are
refused when the verifier is built.
"""

from __future__ import annotations

import json
import math
import re
import string
import time
from dataclasses import dataclass

from forge_megatron.agents.remote import Retryable, ScoreCache, check_base_url, options_checked, post_json

DEFAULT_RUBRIC = """You grade an AI assistant's answer to a task.

Task:
{prompt}

Reference answer (may be empty):
{answer}

Assistant's answer:
{output}

Judge how well the assistant's answer solves the task. End your reply with a line "Score: N", N an integer from 0 to \
{max_score}."""

RUBRIC_FIELDS = ("prompt", "answer", "output", "max_score")


class JudgeError(ValueError):
    """The judge gave no usable score (its endpoint failed or its answers had none)."""


@dataclass
class JudgeVerifier:
    """``(task, output) -> score / max_score`` from a judge model at ``base_url`` (OpenAI style: ``.../v1``)."""

    base_url: str
    model: str = "default"
    rubric: str = DEFAULT_RUBRIC
    max_score: float = 10.0
    api_key: str | None = None
    temperature: float = 0.0
    retry_temperature: float = 0.7
    max_tokens: int = 512
    attempts: int = 3
    timeout_s: float = 15.0  # per request: three of them and the back-offs fit the runner's 60 s per verifier
    score_pattern: str = r"score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)"
    cache_size: int = 4096  # a greedy judge's scores of identical prompts (a group's equal answers): asked once

    def __post_init__(self):
        self.base_url = check_base_url(self.base_url, "judge base URL")
        fields = {name for _, name, _, _ in string.Formatter().parse(self.rubric) if name is not None}
        unknown = sorted(fields - set(RUBRIC_FIELDS))
        if unknown or "output" not in fields:
            raise ValueError(f"judge rubric: placeholders {unknown} are not among {list(RUBRIC_FIELDS)}" if unknown
                             else "judge rubric has no {output} placeholder: the judge would not see the answer")
        if not (self.max_score > 0 and math.isfinite(self.max_score)):
            raise ValueError(f"judge max_score must be a positive number, got {self.max_score!r}")
        if self.attempts < 1 or self.max_tokens < 1 or self.timeout_s <= 0:
            raise ValueError("judge attempts and max_tokens must be >= 1 and timeout_s > 0")
        self._pattern = re.compile(self.score_pattern, re.IGNORECASE)
        self._cache = ScoreCache(self.cache_size)

    @property
    def url(self) -> str:
        return f"{self.base_url}/chat/completions"

    def prompt_for(self, task, output) -> str:
        text = output if isinstance(output, str) else json.dumps(output)
        answer = task.answer if isinstance(task.answer, str) else \
            ("" if task.answer is None else json.dumps(task.answer))
        max_score = int(self.max_score) if float(self.max_score).is_integer() else self.max_score
        return self.rubric.format(prompt=task.prompt, answer=answer, output=text, max_score=max_score)

    def parse(self, reply: str) -> float | None:
        """The last ``Score: N`` of ``reply`` if it lies in [0, max_score], else None."""
        found = self._pattern.findall(reply or "")
        if not found:
            return None
        score = float(found[-1])
        return score if 0.0 <= score <= self.max_score else None

    def __call__(self, task, output) -> float:
        prompt, last = self.prompt_for(task, output), None
        cacheable = self.temperature == 0  # a greedy first answer is the same every time
        cached = self._cache.get(prompt) if cacheable else None
        if cached is not None:
            return cached
        for attempt in range(self.attempts):
            temperature = self.temperature if attempt == 0 or self.temperature > 0 else self.retry_temperature
            try:
                reply = self._ask(prompt, temperature, seed=attempt)
            except Retryable as exc:
                last = str(exc)
                time.sleep(min(2.0, 0.25 * 2 ** attempt))
                continue
            score = self.parse(reply)
            if score is not None:
                if cacheable and attempt == 0:  # (a retry's sampled answer is not the greedy one)
                    self._cache.put(prompt, score / self.max_score)
                return score / self.max_score
            last = f"no score in [0, {self.max_score:g}] in its answer {reply[-300:]!r}"
        raise JudgeError(f"judge {self.url} gave no score for task {task.task_id} in {self.attempts} attempt(s): "
                         f"{last}")

    def _ask(self, prompt: str, temperature: float, seed: int) -> str:
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "temperature": temperature,
                "max_tokens": self.max_tokens, "seed": seed}
        answer = post_json(self.url, body, self.timeout_s, self.api_key, JudgeError, "judge")
        try:
            content = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise Retryable(f"its answer has no choices[0].message.content: {str(answer)[:300]}") from None
        return content if isinstance(content, str) else ""


def add_judge_arguments(p) -> None:
    g = p.add_argument_group("LLM judge (--verifier [DOMAIN=]judge)")
    g.add_argument("--judge-url", default=None,
                   help="OpenAI-compatible base URL of the judge model (http://host:port/v1: an SGLang server, "
                        "forge-engine or a hosted API)")
    g.add_argument("--judge-model", default="default", help="model name sent to the judge endpoint")
    g.add_argument("--judge-rubric", default=None, metavar="FILE",
                   help="rubric template (str.format with {prompt}, {answer}, {output}, {max_score}; literal braces "
                        "written {{ and }}); default: a generic grading prompt ending in 'Score: N'")
    g.add_argument("--judge-max-score", type=float, default=10.0, help="top of the judge's scale (reward = score / it)")
    g.add_argument("--judge-api-key-env", default=None, metavar="VAR",
                   help="environment variable holding the judge endpoint's API key (sent as a bearer token)")
    g.add_argument("--judge-attempts", type=int, default=3,
                   help="asks per episode before it fails (unreadable scores, connection errors, 5xx)")
    g.add_argument("--judge-timeout-s", type=float, default=15.0,
                   help="seconds per request; attempts x this must fit the 60 s the runner gives a verifier")


def judge_from_args(args) -> JudgeVerifier:
    """The ``JudgeVerifier`` of ``add_judge_arguments``' options; clear errors for missing or bad ones."""
    if not getattr(args, "judge_url", None):
        raise ValueError("--verifier ...=judge needs --judge-url (the judge model's OpenAI-compatible base URL)")
    rubric = DEFAULT_RUBRIC
    if args.judge_rubric:
        try:
            with open(args.judge_rubric) as f:
                rubric = f.read()
        except OSError as exc:
            raise ValueError(f"--judge-rubric {args.judge_rubric!r}: {exc.strerror}") from None
    api_key = options_checked(args, "judge")
    return JudgeVerifier(args.judge_url, model=args.judge_model, rubric=rubric, max_score=args.judge_max_score,
                         api_key=api_key, attempts=args.judge_attempts, timeout_s=args.judge_timeout_s)
