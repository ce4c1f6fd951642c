"""Run one episode of an agent on a task through the gateway, with a per-episode timeout.

Three kinds of agents, one contract (``agent.run(task, session, timeout_s) -> EpisodeResult``):

- :class:`PythonAgent` (white-box): a Python callable ``fn(task, session) -> EpisodeResult | str | None`` that talks
  to ``session.base_url`` with ``session.api_key`` (any OpenAI client) and may compute its own reward.
- :class:`CommandAgent` (black-box): any program. It gets the OpenAI endpoint the way the official clients read
  it (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``) and the task in ``FORGE_TASK_PROMPT`` / ``FORGE_TASK_JSON``; its final
  answer is the last non-empty line of its stdout. It runs in its own process group, killed on timeout.
- :class:`HttpAgent` (black-box service): ``POST <url> {"task", "base_url", "api_key"}`` answered by
  ``{"output": "..."}``.

The trajectory itself is recorded by the gateway from the agent's API calls; the runner only opens the session,
scores the final answer with a verifier (``verifier(task, output) -> reward``, default: exact match with
``task.answer``), sets the reward and ends the session with the episode's status (finished, failed, timed_out).
Whatever goes wrong on the agent's side ends the session: an agent that raises or cannot start (a missing
program), a verifier that raises, returns something other than a finite number, or takes longer than
``verifier_timeout_s``, all end it as ``failed`` with the reason logged, so its group never waits for it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable

from forge_megatron.agents.gateway_api import AgentSession, GatewayClient, GatewayError
from forge_megatron.agents.tasks import Task

log = logging.getLogger("forge.agents")

Verifier = Callable[[Task, "str | None"], float]


@dataclass
class EpisodeResult:
    """What an agent run produced. ``reward`` None: the verifier scores ``output``."""

    output: str | None = None
    status: str = "finished"  # finished | failed | timed_out
    reward: float | None = None
    terms: dict[str, float] = field(default_factory=dict)
    error: str = ""


@dataclass
class EpisodeReport:
    task_id: str
    domain: str
    session_id: str
    status: str
    reward: float | None
    output: str | None
    duration_s: float
    completion_tokens: int = 0  # tokens the policy sampled in the episode
    policy_versions: list[int] = field(default_factory=list)  # [oldest, newest] version that sampled them


def exact_match(task: Task, output: str | None) -> float:
    """1.0 when the final output equals ``task.answer`` (surrounding whitespace ignored), else 0.0."""
    if task.answer is None:
        raise ValueError(f"task {task.task_id} has no answer: give a verifier or let the agent set its reward")
    return float(output is not None and output.strip() == task.answer.strip())


def no_reward(task: Task, output: str | None) -> float:
    """``--verifier none``: 0.0 for every finished episode, whatever its task (a task needs no answer). For on-policy
    distillation from a teacher alone (the trainer's --distill-outcome-coef 0): the teacher's per-token advantage is
    the signal, the outcome advantages are all zero (process terms such as malformed tool calls still count)."""
    return 0.0


# ``--verifier`` names of the verifiers built from options rather than imported (judge.py, reward_model.py,
# code_verifier.py)
REMOTE_VERIFIERS = ("judge", "rm", "code")
LOCAL_VERIFIERS = {"none": no_reward}
VERIFIER_TIMEOUT_S = 60.0  # what run_episode gives a verifier (an LLM judge's attempts must fit: judge.py)


def load_callable(path: str) -> Callable:
    """``package.module:function`` -> the function (clear error when it does not exist)."""
    import importlib

    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected 'package.module:function', got {path!r}")
    fn = getattr(importlib.import_module(module_name), attr, None)
    if not callable(fn):
        raise ValueError(f"{path!r}: {attr!r} is not a callable of {module_name}")
    return fn


class DomainVerifier:
    """Mixed-domain training: each task is scored by its domain's verifier (``verifiers[task.domain]``), tasks of
    other domains by ``default``."""

    def __init__(self, verifiers: dict[str, Verifier], default: Verifier = exact_match):
        self.verifiers, self.default = dict(verifiers), default

    def __call__(self, task: Task, output) -> float:
        return self.verifiers.get(task.domain, self.default)(task, output)

    def check_domains(self, *task_lists: list[Task]) -> None:
        """Raise when a verifier names a domain no task has (a typo would score that domain by exact match)."""
        known = {t.domain for tasks in task_lists for t in tasks}
        unknown = sorted(set(self.verifiers) - known)
        if unknown:
            raise ValueError(f"--verifier names domain(s) {unknown} that no task has (task domains: {sorted(known)})")


def build_verifier(specs: list[str] | None, args=None) -> Verifier:
    """``--verifier`` values -> one verifier: ``module:function`` scores every domain, ``DOMAIN=module:function``
    scores that domain (repeat for several); domains without one use the unprefixed verifier, else exact match.
    ``judge`` in place of ``module:function`` is the LLM judge of ``args``' ``--judge-*`` options (judge.py), ``rm``
    the reward model of its ``--rm-*`` options (reward_model.py), ``code`` the task's unit tests run with its
    ``--code-*`` options (code_verifier.py), ``none`` no reward at all (:func:`no_reward`)."""
    default, per_domain, remote = None, {}, {}

    def load(path: str) -> Verifier:
        if path in LOCAL_VERIFIERS:
            return LOCAL_VERIFIERS[path]
        if path not in REMOTE_VERIFIERS:
            return load_callable(path)
        if path not in remote:  # one judge / reward model / test runner for every domain that names it
            from forge_megatron.agents.code_verifier import code_verifier_from_args
            from forge_megatron.agents.judge import judge_from_args
            from forge_megatron.agents.reward_model import reward_model_from_args

            make = {"judge": judge_from_args, "rm": reward_model_from_args, "code": code_verifier_from_args}[path]
            remote[path] = make(args)
        return remote[path]

    for spec in specs or []:
        domain, sep, path = spec.partition("=")
        if not sep:
            if default is not None:
                raise ValueError(f"--verifier: two verifiers for every domain ({spec!r}); prefix one with DOMAIN=")
            default = load(spec)
        elif not domain or domain in per_domain:
            raise ValueError(f"--verifier {spec!r}: " + ("empty domain" if not domain else
                                                           f"domain {domain!r} already has a verifier"))
        else:
            per_domain[domain] = load(path)
    if not per_domain:
        return default or exact_match
    return DomainVerifier(per_domain, default or exact_match)


def add_verifier_argument(p) -> None:
    from forge_megatron.agents.code_verifier import add_code_arguments
    from forge_megatron.agents.judge import add_judge_arguments
    from forge_megatron.agents.reward_model import add_reward_model_arguments

    p.add_argument("--verifier", action="append", default=None,
                   metavar="[DOMAIN=]MODULE:FUNCTION|judge|rm|code|none",
                   help="(task, output) -> reward. Unprefixed: every domain; DOMAIN=...: that domain's tasks "
                        "(repeat for mixed-domain training, e.g. --verifier math=my.rewards:math "
                        "--verifier code=my.rewards:unit_tests). 'judge': an LLM judge's score / max score "
                        "(--judge-* below); 'rm': a reward model's score (--rm-* below); 'code': the task's unit "
                        "tests (metadata.tests) run on the program in the answer (--code-* below); 'none': 0 for every "
                        "finished episode, tasks need no answer (on-policy distillation from a teacher alone). "
                        "Default: exact match with the task's answer")
    add_judge_arguments(p)
    add_reward_model_arguments(p)
    add_code_arguments(p)


class PythonAgent:
    """White-box agent: a callable run in a worker thread; past the timeout its episode is ended as timed_out."""

    def __init__(self, fn: Callable[[Task, AgentSession], "EpisodeResult | str | None"]):
        self.fn = fn

    def run(self, task: Task, session: AgentSession, timeout_s: float) -> EpisodeResult:
        box: list = []

        def target():
            try:
                box.append(self.fn(task, session))
            except Exception as exc:  # noqa: BLE001 - an agent bug fails its episode, not the driver
                box.append(EpisodeResult(status="failed", error=f"{type(exc).__name__}: {exc}"))

        worker = threading.Thread(target=target, daemon=True, name=f"agent-{task.task_id}")
        worker.start()
        worker.join(timeout_s)
        if not box:
            return EpisodeResult(status="timed_out", error=f"no result after {timeout_s:.0f}s")
        out = box[0]
        return out if isinstance(out, EpisodeResult) else EpisodeResult(output=out)


class CommandAgent:
    """Black-box agent program (argv list or a shell-free string split on whitespace)."""

    def __init__(self, command: list[str] | str, env: dict[str, str] | None = None):
        self.argv = command.split() if isinstance(command, str) else list(command)
        if not self.argv:
            raise ValueError("agent command is empty")
        self.env = env or {}

    def run(self, task: Task, session: AgentSession, timeout_s: float) -> EpisodeResult:
        env = {**os.environ, **self.env, "OPENAI_BASE_URL": session.base_url, "OPENAI_API_KEY": session.api_key,
               "FORGE_TASK_PROMPT": task.prompt, "FORGE_TASK_JSON": json.dumps(task.to_dict())}
        proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return EpisodeResult(status="timed_out", error=f"killed after {timeout_s:.0f}s")
        if proc.returncode != 0:
            return EpisodeResult(status="failed", error=f"exit {proc.returncode}: {stderr.strip()[-500:]}")
        lines = [line for line in stdout.splitlines() if line.strip()]
        return EpisodeResult(output=lines[-1].strip() if lines else "")


class HttpAgent:
    """Black-box agent service reached over HTTP."""

    def __init__(self, url: str):
        self.url = url

    def run(self, task: Task, session: AgentSession, timeout_s: float) -> EpisodeResult:
        body = json.dumps({"task": task.to_dict(), "base_url": session.base_url, "api_key": session.api_key})
        req = urllib.request.Request(self.url, data=body.encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                answer = json.loads(resp.read())
        except TimeoutError:
            return EpisodeResult(status="timed_out", error=f"no answer after {timeout_s:.0f}s")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            if "timed out" in str(exc):
                return EpisodeResult(status="timed_out", error=str(exc))
            return EpisodeResult(status="failed", error=f"agent service {self.url}: {exc}")
        if not isinstance(answer, dict) or not isinstance(answer.get("output", ""), str):
            return EpisodeResult(status="failed", error="agent service must answer {\"output\": \"...\"}")
        return EpisodeResult(output=answer.get("output"), reward=answer.get("reward"))


def _call_with_timeout(fn: Callable, args: tuple, timeout_s: float, what: str):
    """``fn(*args)`` on a worker thread; TimeoutError after ``timeout_s`` (the thread is abandoned, daemon)."""
    box: list = []

    def target():
        try:
            box.append((True, fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box.append((False, exc))

    worker = threading.Thread(target=target, daemon=True, name=what)
    worker.start()
    worker.join(timeout_s)
    if not box:
        raise TimeoutError(f"{what} gave no answer within {timeout_s:.0f}s")
    ok, value = box[0]
    if not ok:
        raise value
    return value


def score(verifier: Verifier, task: Task, output, timeout_s: float) -> float:
    """The verifier's reward for ``output``: a finite number, within ``timeout_s``; raises ValueError otherwise."""
    try:
        reward = _call_with_timeout(verifier, (task, output), timeout_s, f"verifier of {task.task_id}")
    except Exception as exc:  # noqa: BLE001 - any verifier fault fails the episode
        raise ValueError(f"verifier failed: {type(exc).__name__}: {exc}") from exc
    return _finite(reward, "the verifier")


def _finite(reward, source: str) -> float:
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"{source} returned the reward {reward!r}, not a finite number")
    return float(reward)


def run_episode(gateway: GatewayClient, agent, task: Task, group_id: str | None, verifier: Verifier = exact_match,
                timeout_s: float = 300.0, eval_sampling: dict | None = None,
                verifier_timeout_s: float = VERIFIER_TIMEOUT_S, call_scorer=None) -> EpisodeReport:
    """Open a session, run the agent, score it, set the reward, end the session. Never raises for agent faults.

    ``group_id`` None: an evaluation episode (``GatewayClient.open_eval_session``, with ``eval_sampling``
    overriding the agent's temperature / top_p / top_k), never trained on. ``call_scorer`` (training episodes):
    ``calls -> call_rewards`` (agents/call_rewards.py) on the session's recorded calls, set with the reward; a
    failure fails the episode as a verifier's does."""
    if group_id is None:
        session = gateway.open_eval_session(task.task_id, task.domain, {"task_id": task.task_id}, eval_sampling)
    else:
        session = gateway.open_session(group_id, {"task_id": task.task_id})
    started = time.time()
    try:
        result = agent.run(task, session, timeout_s)
    except Exception as exc:  # noqa: BLE001 - e.g. the agent program does not exist: the episode fails, not the run
        result = EpisodeResult(status="failed", error=f"the agent could not run: {type(exc).__name__}: {exc}")
    reward = None
    if result.status == "finished":
        try:
            reward = _finite(result.reward, "the agent") if result.reward is not None else \
                score(verifier, task, result.output, verifier_timeout_s)
        except ValueError as exc:
            result = EpisodeResult(output=result.output, status="failed", error=str(exc))
    call_rewards = None
    if result.status == "finished" and call_scorer is not None and group_id is not None:
        try:
            call_rewards = call_scorer(gateway.session(session.session_id)["calls"])
        except ValueError as exc:
            result = EpisodeResult(output=result.output, status="failed", error=f"per-call rewards: {exc}")
    if result.status == "finished":
        gateway.set_reward(session.session_id, reward, result.terms, call_rewards)
    elif result.error:
        log.warning("episode %s of task %s %s: %s", session.session_id, task.task_id, result.status, result.error)
    status = result.status
    try:
        ended = end_session(gateway, session.session_id, status)
    except GatewayError as exc:
        if exc.status != 400 or status != "finished":
            raise
        status = "failed"  # the agent finished without a single model call: nothing to train on
        ended = end_session(gateway, session.session_id, status)
    return EpisodeReport(task.task_id, task.domain, session.session_id, status, reward, result.output,
                         time.time() - started, int(ended.get("completion_tokens", 0)),
                         list(ended.get("policy_versions", [])))


END_ATTEMPTS = 6  # an end answered 503 (the pool or a distillation teacher not answering) is sent again
END_BACKOFF_S = (2.0, 5.0, 10.0, 20.0, 30.0)


def end_session(gateway, session_id: str, status: str, attempts: int = END_ATTEMPTS,
                backoff_s: tuple = END_BACKOFF_S) -> dict:
    """``gateway.end_session``, sent again after a 503 (``sink_unavailable``, ``teacher_unavailable``: the session
    stays open and nothing was lost) up to ``attempts`` times, waiting ``backoff_s`` between them; any other error,
    or the last 503, is raised."""
    for attempt in range(attempts):
        try:
            return gateway.end_session(session_id, status)
        except GatewayError as exc:
            if exc.status != 503 or attempt == attempts - 1:
                raise
            wait = backoff_s[min(attempt, len(backoff_s) - 1)]
            log.warning("ending session %s: %s; sending it again in %.0fs", session_id, exc, wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


def add_agent_arguments(p: argparse.ArgumentParser) -> None:
    """The three ways to name an agent on a command line (exactly one is given)."""
    p.add_argument("--agent-command", help="black-box agent program (gets OPENAI_BASE_URL / OPENAI_API_KEY)")
    p.add_argument("--agent-url", help="black-box agent HTTP service")
    p.add_argument("--agent-python", help="white-box agent 'module:function'")


def build_agent(args: argparse.Namespace):
    chosen = [x for x in (args.agent_command, args.agent_url, args.agent_python) if x]
    if len(chosen) != 1:
        raise SystemExit("give exactly one of --agent-command, --agent-url, --agent-python")
    if args.agent_command:
        return CommandAgent(args.agent_command)
    if args.agent_url:
        return HttpAgent(args.agent_url)
    return PythonAgent(load_callable(args.agent_python))
