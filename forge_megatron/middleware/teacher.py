"""A served distillation teacher: the gateway scores each finished episode's sampled tokens with it.

On-policy distillation (docs/training.md) needs, for every token the student sampled, the teacher's logprob of it.
A teacher too large to hold beside the policy on the trainer's GPUs is served by SGLang instead (``--teacher-urls``
of forge-gateway / forge-node), and the gateway asks it when an episode ends, while the other rollouts run: one
prefill-only call per segment (``/generate`` with ``input_ids``, ``max_new_tokens: 0``, ``return_logprob``,
``logprob_start_len`` one before the first sampled token; SGLang's ``meta_info["input_token_logprobs"]``), at the
policy temperature (SGLang tempers input logprobs as output ones, and the trainer scores at that temperature). The
logprobs travel with the episode (``Segment.teacher_logprobs``: the teacher's logprob at every sampled token, 0
elsewhere) through the pool to the trainer (``--teacher-from-gateway``), which trains on ``teacher - old logprob``
exactly as with a teacher of its own.

Failures: the calls go round-robin over the teacher engines; a connection error, a timeout or a 5xx answer is
tried on the next engine (``attempts`` in all); if none answers, the episode's end is refused with 503 and the
session stays open, so the end can be sent again (nothing is lost; an idle session is ended again by the reaper).
A 4xx answer (an input over the teacher's context length) or an answer that does not score the tokens sent will not
change on a retry: the episode is sent to the pool as ``failed``, the reason in ``metadata["teacher_error"]``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

from forge_megatron.middleware.schema import Episode

log = logging.getLogger(__name__)


class TeacherUnavailable(RuntimeError):
    """No teacher engine answered (connection errors, timeouts, 5xx): try the episode's end again later."""


class TeacherRefused(ValueError):
    """A teacher engine refused to score a segment (4xx) or answered something else than its logprobs."""


class TeacherScorer:
    """Scores episodes' sampled tokens with the teacher engines at ``urls`` (SGLang's native API)."""

    def __init__(self, urls: list[str], temperature: float = 1.0, timeout_s: float = 120.0, attempts: int = 3):
        from forge_megatron.rollout.sglang_client import SGLangClient

        if not urls:
            raise ValueError("teacher_urls is empty")
        self.clients = [SGLangClient(u, timeout_s=timeout_s) for u in urls]
        self.temperature, self.timeout_s, self.attempts = temperature, timeout_s, max(1, attempts)
        self._next = itertools.cycle(range(len(self.clients)))
        self.scored_tokens = 0  # sampled tokens the teacher scored (the gateway's stats)

    async def close(self) -> None:
        for c in self.clients:
            await c.close()

    async def segment_logprobs(self, tokens: list[int], loss_mask: list[int]) -> list[float]:
        """The teacher's logprob at every sampled position of one segment (0.0 elsewhere)."""
        from forge_megatron.rollout.sglang_client import EngineError, EngineRequestError

        sampled = [t for t, m in enumerate(loss_mask) if m]
        out = [0.0] * len(tokens)
        if not sampled:
            return out
        if sampled[0] == 0:
            raise TeacherRefused("a segment's first token is marked sampled: nothing precedes it to score it from")
        start = sampled[0] - 1  # SGLang leaves the window's first position unscored
        errors = []
        for _ in range(self.attempts):
            client = self.clients[next(self._next)]
            try:
                values = await client.input_logprobs(tokens, start, self.temperature, timeout_s=self.timeout_s)
            except EngineRequestError as exc:
                raise TeacherRefused(str(exc)) from exc
            except EngineError as exc:
                errors.append(str(exc))
                continue
            for t in sampled:
                out[t] = values[t - start - 1]
            self.scored_tokens += len(sampled)
            return out
        raise TeacherUnavailable(f"no teacher engine answered after {self.attempts} attempt(s): " + "; ".join(errors))

    async def score(self, episode: Episode) -> Episode:
        """``episode`` with ``teacher_logprobs`` on every segment (its segments scored concurrently). Raises
        TeacherUnavailable / TeacherRefused."""
        todo = [s for s in episode.segments if s.teacher_logprobs is None]
        results = await asyncio.gather(*(self.segment_logprobs(s.tokens, s.loss_mask) for s in todo),
                                       return_exceptions=True)
        for seg, res in zip(todo, results):
            if isinstance(res, BaseException):
                raise res
            seg.teacher_logprobs = res
        return episode
