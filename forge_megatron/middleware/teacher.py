"""A served distillation teacher: the gateway scores each finished episode's sampled tokens with it.

On-policy distillation (docs/training.md) needs, for every token the student sampled, the teacher's logprob of it.
A teacher too large to hold beside the policy on the trainer's GPUs is served by SGLang instead (``--teacher-urls``
of forge-gateway / forge-node), and the gateway asks it when an episode ends, while the other rollouts run: one
prefill-only call per segment (``/generate`` with ``input_ids``, ``max_new_tokens: 0``, ``return_logprob``,
``logprob_start_len`` one before the first sampled token; SGLang's ``meta_info["input_token_logprobs"]``), at the
policy temperature (SGLang tempers input logprobs as output ones, and the trainer scores at that temperature). The
logprobs travel with the episode (``Segment.teacher_logprobs``: the teacher's logprob at every sampled token, 0
elsewhere) through the pool to the trainer (``--teacher-from-gateway``), which trains on ``teacher - old logprob``
exactly as with a teacher of its own. With ``--teacher-topk K`` the same call also asks for each position's K most
likely tokens (``top_logprobs_num``; ``meta_info["input_top_logprobs"]``), recorded at every sampled token
(``Segment.teacher_topk_ids`` / ``teacher_topk_logprobs``) for the trainer's dense KL (``--distill-kl
forward|reverse``).

A privileged teacher (``--teacher-prompt TEMPLATE``): the teacher reads each segment after a system message of its
own, the template filled in with the task's fields (``{task_id}``, ``{domain}`` and the group's metadata, e.g.
``"A correct final answer is {answer}."``), while the student never saw it: on-policy distillation from the same
model given privileged information (hints, the reference solution; "on-policy self-distillation") gives every sampled
token a target without a larger teacher. The prefix's tokens come first (the segment's own BOS dropped when the prefix
starts with it) and the logprobs are read at the sampled tokens' shifted positions.

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

    def __init__(self, urls: list[str], temperature: float = 1.0, timeout_s: float = 120.0, attempts: int = 3,
                 topk: int = 0):
        from forge_megatron.rollout.sglang_client import SGLangClient

        if not urls:
            raise ValueError("teacher_urls is empty")
        self.clients = [SGLangClient(u, timeout_s=timeout_s) for u in urls]
        self.temperature, self.timeout_s, self.attempts = temperature, timeout_s, max(1, attempts)
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 0:
            raise ValueError(f"teacher_topk must be an int >= 0, got {topk!r}")
        self.topk = topk  # > 0: also the teacher's top-k at every sampled token
        self._next = itertools.cycle(range(len(self.clients)))
        self.scored_tokens = 0  # sampled tokens the teacher scored (the gateway's stats)

    async def close(self) -> None:
        for c in self.clients:
            await c.close()

    async def segment_logprobs(self, tokens: list[int], loss_mask: list[int], prefix: list[int] = (),
                               bos: int | None = None):
        """The teacher's logprob at every sampled position of one segment (0.0 elsewhere); ``prefix``: token ids the
        teacher reads first (a privileged system message; the segment's first token dropped when both start with
        ``bos``). With ``topk``: (those logprobs, ids int32 [sampled, k], logprobs float32 [sampled, k]) of the
        teacher's k most likely tokens at each sampled position."""
        import numpy as np

        from forge_megatron.rollout.sglang_client import EngineError, EngineRequestError

        sampled = [t for t, m in enumerate(loss_mask) if m]
        out = [0.0] * len(tokens)
        if not sampled:
            empty = np.zeros((0, self.topk), np.int32), np.zeros((0, self.topk), np.float32)
            return (out, *empty) if self.topk else out
        if sampled[0] == 0:
            raise TeacherRefused("a segment's first token is marked sampled: nothing precedes it to score it from")
        skip = 1 if prefix and bos is not None and prefix[0] == bos and tokens[0] == bos else 0
        ids = list(prefix) + list(tokens[skip:])
        shift = len(prefix) - skip  # the segment's token t is the teacher input's t + shift
        start = sampled[0] - 1 + shift  # SGLang leaves the window's first position unscored
        errors = []
        for _ in range(self.attempts):
            client = self.clients[next(self._next)]
            try:
                answer = await client.input_logprobs(ids, start, self.temperature, timeout_s=self.timeout_s,
                                                     top_logprobs_num=self.topk)
            except EngineRequestError as exc:
                raise TeacherRefused(str(exc)) from exc
            except EngineError as exc:
                errors.append(str(exc))
                continue
            values, rows = (answer[0], [t + shift - start - 1 for t in sampled]) if self.topk else (answer, None)
            for t in sampled:
                out[t] = values[t + shift - start - 1]
            self.scored_tokens += len(sampled)
            return (out, answer[1][rows], answer[2][rows]) if self.topk else out
        raise TeacherUnavailable(f"no teacher engine answered after {self.attempts} attempt(s): " + "; ".join(errors))

    async def score(self, episode: Episode, prefix: list[int] = (), bos: int | None = None) -> Episode:
        """``episode`` with ``teacher_logprobs`` on every segment (its segments scored concurrently), each read after
        ``prefix``. Raises TeacherUnavailable / TeacherRefused."""
        todo = [s for s in episode.segments if s.teacher_logprobs is None]
        results = await asyncio.gather(*(self.segment_logprobs(s.tokens, s.loss_mask, prefix, bos) for s in todo),
                                       return_exceptions=True)
        for seg, res in zip(todo, results):
            if isinstance(res, BaseException):
                raise res
            if self.topk:
                seg.teacher_logprobs, seg.teacher_topk_ids, seg.teacher_topk_logprobs = res
            else:
                seg.teacher_logprobs = res
        return episode


def teacher_prompt(template: str, task_id: str, domain: str, metadata: dict) -> str:
    """``--teacher-prompt``'s text for one group: ``template`` with ``{task_id}``, ``{domain}`` and the group's
    metadata fields filled in. ValueError naming a field the template needs that the group does not have."""
    fields = {**{k: v for k, v in (metadata or {}).items() if isinstance(k, str)}, "task_id": task_id,
              "domain": domain}
    try:
        return template.format_map(fields)
    except KeyError as exc:
        raise ValueError(f"--teacher-prompt needs {{{exc.args[0]}}}, which this group's task has not (its fields: "
                         f"{sorted(fields)}): give it in the task's metadata") from None
    except (IndexError, ValueError) as exc:
        raise ValueError(f"--teacher-prompt {template!r} is not a format string: {exc}") from None
