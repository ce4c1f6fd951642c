"""Evaluation: held-out tasks run by the same agent through the same gateway, never trained on.

Training curves of an RL run measure the policy on the tasks it is trained on, sampled at whatever versions were
live, mixed with the window's lag. An evaluation asks a cleaner question: how well does the policy the engines
serve now solve tasks it never trains on? Each episode runs in a gateway *eval session* (``POST /forge/sessions
{"eval": true, ...}``): the agent talks to the same OpenAI/Anthropic endpoints, the gateway renders, samples and
records exactly as for training, but the episode is never sent to the data pool.

One evaluation runs every task ``samples`` times (at most ``concurrency`` episodes at once) and reports, over all
tasks and per domain:

  ``pass@k``         for k = 1, 2, 4, ... up to ``samples`` (and ``samples`` itself): the unbiased estimator
                     1 - C(n - c, k) / C(n, k) per task (n episodes, c successes), averaged over tasks;
                     pass@1 is the success rate. Success = a finished episode with reward above
                     ``--eval-success-threshold`` (default 0: reward > 0, the rollout driver's rule; a reward
                     model's raw scores want their own bar); failed, timed-out and lost episodes count as
                     unsuccessful.
  ``mean_reward``    over finished episodes (None if none finished)
  ``finished``       fraction of episodes that finished (the rest failed, timed out or were lost)
  ``completion_tokens_mean``, ``duration_s_mean``   over finished episodes
  ``policy_versions``  [oldest, newest] policy version that sampled any token of the evaluation (a weight sync during
                     the evaluation shows as a range)

Sampling: eval calls use the agent's own temperature / top_p / top_k unless ``--eval-temperature`` (``--eval-top-p``,
``--eval-top-k``) is given; the gateway then applies it to every call of the session (temperature 0: greedy
pass@1, the usual report; pass@k for k > 1 needs temperature > 0). Eval sessions are exempt from the gateway's
``--policy-sampling`` rule for training calls.

Standalone, against whatever the engines serve (e.g. a converted checkpoint before training):

    forge-eval --gateway-url http://127.0.0.1:8000 --tasks heldout.jsonl --samples 4 \\
        --agent-command "python -m forge_megatron.agents.calculator" --output evals.jsonl

Periodically during training, from the rollout driver: ``forge-rollout ... --eval-tasks heldout.jsonl
--eval-every-versions 10`` (:class:`PeriodicEval`: version 0 first, then each time the gateway's policy version
reaches the next multiple; evaluations that would overlap are skipped, not queued). Every result is also published
to the gateway (``POST /forge/evals``), where a trainer started with ``--gateway-url`` picks it up and logs it with
its next step as ``eval/pass@1``, ``eval/<domain>/pass@1``, ... (tensorboard, wandb, metrics JSONL; the
evaluation's own version as ``eval/policy_version``). Evaluation episodes share the
engines with rollouts, so they slow rollouts down while they run: size ``--eval-samples`` and the task set to that.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from forge_megatron.agents.gateway_api import GatewayClient, GatewayError
from forge_megatron.agents.runner import (
    DomainVerifier, EpisodeReport, Verifier, add_agent_arguments, add_verifier_argument, build_agent, build_verifier,
    exact_match, run_episode,
)
from forge_megatron.agents.tasks import Task, load_tasks

log = logging.getLogger("forge.eval")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k episodes drawn without replacement from n (c of them successful) succeeds."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(samples: int) -> list[int]:
    """k = 1, 2, 4, ... <= samples, and samples itself."""
    ks = [1 << i for i in range(samples.bit_length()) if 1 << i <= samples]
    return ks if ks[-1] == samples else ks + [samples]


def _success(report: EpisodeReport, threshold: float = 0.0) -> bool:
    return report.status == "finished" and report.reward is not None and report.reward > threshold


def summarise(reports: list[EpisodeReport], samples: int, success_threshold: float = 0.0) -> dict:
    """The metrics of the module docstring over ``reports`` (every task run ``samples`` times); an episode succeeds
    with a reward above ``success_threshold``."""
    by_task: dict[str, list[EpisodeReport]] = {}
    for r in reports:
        by_task.setdefault(r.task_id, []).append(r)
    out: dict = {"tasks": len(by_task), "episodes": len(reports)}
    for k in pass_ks(samples):
        scores = [pass_at_k(len(rs), sum(_success(r, success_threshold) for r in rs), k)
                  for rs in by_task.values() if len(rs) >= k]
        out[f"pass@{k}"] = sum(scores) / len(scores) if scores else None
    finished = [r for r in reports if r.status == "finished"]
    out["finished"] = len(finished) / len(reports) if reports else None
    out["mean_reward"] = sum(r.reward or 0.0 for r in finished) / len(finished) if finished else None
    out["completion_tokens_mean"] = sum(r.completion_tokens for r in finished) / len(finished) if finished else None
    out["duration_s_mean"] = sum(r.duration_s for r in finished) / len(finished) if finished else None
    versions = [v for r in reports for v in r.policy_versions]
    out["policy_versions"] = [min(versions), max(versions)] if versions else []
    return out


def evaluate(gateway: GatewayClient, agent, tasks: list[Task], samples: int = 1, verifier: Verifier = exact_match,
             timeout_s: float = 300.0, concurrency: int = 8, stop: threading.Event | None = None,
             sampling: dict | None = None, success_threshold: float = 0.0) -> dict | None:
    """Run every task ``samples`` times in eval sessions; the summary overall and per domain (``domains``).
    ``sampling`` ({temperature, top_p, top_k}) replaces the agent's values on every call (e.g. temperature 0); an
    episode succeeds with a reward above ``success_threshold``.

    Returns None when ``stop`` was set before every episode ran, or while one that did not finish was running
    (stopping may be what cut it): the partial result would be biased."""
    if samples < 1 or concurrency < 1:
        raise ValueError(f"samples and concurrency must be >= 1, got {samples} and {concurrency}")
    if not tasks:
        raise ValueError("no evaluation tasks")
    started = time.time()
    version = gateway.state().get("policy_version")

    def one(task: Task) -> EpisodeReport | None:
        if stop is not None and stop.is_set():
            return None
        try:
            return run_episode(gateway, agent, task, None, verifier, timeout_s, sampling)
        except GatewayError as exc:  # the gateway refused or lost the session: an unsuccessful episode
            log.warning("eval episode of task %s lost: %s", task.task_id, exc)
            return EpisodeReport(task.task_id, task.domain, "", "lost", None, None, 0.0)

    jobs = [task for task in tasks for _ in range(samples)]
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="eval") as pool:
        reports = list(pool.map(one, jobs))
    if any(r is None for r in reports) or (stop is not None and stop.is_set()
                                           and any(r.status != "finished" for r in reports)):
        return None
    domains = sorted({t.domain for t in tasks})
    result = {"policy_version": version, **summarise(reports, samples, success_threshold), "samples": samples,
              "sampling": dict(sampling or {}), "success_threshold": success_threshold,
              "wall_s": time.time() - started}
    if len(domains) > 1:
        result["domains"] = {d: summarise([r for r in reports if r.domain == d], samples, success_threshold)
                             for d in domains}
    return result


def format_result(result: dict) -> str:
    """One log line: version, pass@k, mean reward, finished fraction."""
    passes = " ".join(f"{k}={v:.3f}" for k, v in result.items() if k.startswith("pass@") and v is not None)
    reward = result["mean_reward"]
    return (f"eval at policy version {result['policy_version']}: {passes} mean_reward="
            f"{'-' if reward is None else f'{reward:.3f}'} finished={result['finished']:.2f} "
            f"({result['episodes']} episodes, {result['wall_s']:.1f}s)")


def publish(gateway: GatewayClient, result: dict) -> None:
    """Give the result to the gateway (``POST /forge/evals``): the trainer logs it as ``eval/*`` metrics."""
    try:
        gateway.publish_eval(result)
    except GatewayError as exc:  # the result is in the log and the JSONL anyway
        log.warning("could not publish the evaluation to the gateway: %s", exc)


def append_jsonl(path: str, record: dict) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class PeriodicEval:
    """Evaluates at policy version 0 (``at_start``) and whenever the gateway's version reaches the next multiple of
    ``every_versions``; results go to the log and, with ``output``, one JSON line each. Runs on its own thread."""

    def __init__(self, gateway: GatewayClient, agent, tasks: list[Task], every_versions: int, samples: int = 1,
                 verifier: Verifier = exact_match, timeout_s: float = 300.0, concurrency: int = 8,
                 output: str | None = None, at_start: bool = True, poll_s: float = 1.0,
                 on_result: Callable[[dict], None] | None = None, sampling: dict | None = None,
                 success_threshold: float = 0.0):
        if every_versions < 1:
            raise ValueError(f"every_versions must be >= 1, got {every_versions}")
        if not tasks:
            raise ValueError("no evaluation tasks")
        self.gateway, self.agent, self.tasks = gateway, agent, tasks
        self.every, self.samples, self.verifier = every_versions, samples, verifier
        self.timeout_s, self.concurrency, self.output, self.poll_s = timeout_s, concurrency, output, poll_s
        self.next_due = 0 if at_start else every_versions
        self.results: list[dict] = []
        self.on_result = on_result
        self.sampling = sampling
        self.success_threshold = success_threshold

    def due(self, version: int) -> bool:
        return version >= self.next_due

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                version = int(self.gateway.state()["policy_version"])
            except (GatewayError, KeyError, TypeError, ValueError) as exc:
                log.warning("eval: cannot read the gateway's policy version (%s); retrying", exc)
                stop.wait(max(self.poll_s, 1.0))
                continue
            if self.due(version):
                try:
                    self.run_once(stop)
                except Exception:  # noqa: BLE001 - a failed evaluation must not end periodic evaluation
                    log.exception("evaluation at policy version %d failed; the next one is still due", version)
                # skip versions passed while evaluating: the next evaluation is at the next multiple still ahead
                self.next_due = (version // self.every + 1) * self.every
            stop.wait(self.poll_s)

    def run_once(self, stop: threading.Event | None = None) -> dict | None:
        result = evaluate(self.gateway, self.agent, self.tasks, self.samples, self.verifier, self.timeout_s,
                          self.concurrency, stop, self.sampling, self.success_threshold)
        if result is None:
            log.info("eval interrupted (stopping); not recorded")
            return None
        self.results.append(result)
        log.info(format_result(result))
        if self.output:
            append_jsonl(self.output, result)
        publish(self.gateway, result)
        if self.on_result is not None:
            self.on_result(result)
        return result

    def start(self, stop: threading.Event) -> threading.Thread:
        thread = threading.Thread(target=self.run, args=(stop,), name="forge-eval", daemon=True)
        thread.start()
        return thread


def add_eval_arguments(p: argparse.ArgumentParser, periodic: bool) -> None:
    g = p.add_argument_group("evaluation (held-out tasks in gateway eval sessions, never trained on)")
    g.add_argument("--eval-samples", type=int, default=1, help="episodes per task (pass@k up to this k)")
    g.add_argument("--eval-concurrency", type=int, default=8, help="evaluation episodes at once")
    g.add_argument("--eval-timeout-s", type=float, default=None,
                   help="per-episode timeout (default: the rollout episode timeout, 300 s standalone)")
    g.add_argument("--eval-output", default=None, help="append one JSON line per evaluation to this file")
    g.add_argument("--eval-temperature", type=float, default=None,
                   help="sample evaluation calls at this temperature whatever the agent asks (0: greedy)")
    g.add_argument("--eval-top-p", type=float, default=None, help="the same for top_p")
    g.add_argument("--eval-top-k", type=int, default=None, help="the same for top_k (-1: off)")
    g.add_argument("--eval-success-threshold", type=float, default=0.0,
                   help="an episode succeeds (pass@k) with a reward above this (default 0; with a reward model's raw "
                        "scores, e.g. --verifier rm, the score that means right)")
    if periodic:
        g.add_argument("--eval-tasks", default=None, help="held-out tasks JSONL (same format as --tasks); "
                       "enables periodic evaluation")
        g.add_argument("--eval-every-versions", type=int, default=10,
                       help="evaluate at policy version 0 and whenever the version reaches the next multiple of this")
        g.add_argument("--no-eval-at-start", dest="eval_at_start", action="store_false",
                       help="skip the evaluation at version 0")


def eval_sampling(args: argparse.Namespace) -> dict:
    """The ``--eval-temperature/top-p/top-k`` overrides that were given."""
    pairs = (("temperature", args.eval_temperature), ("top_p", args.eval_top_p), ("top_k", args.eval_top_k))
    return {name: value for name, value in pairs if value is not None}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="forge-eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gateway-url", required=True)
    p.add_argument("--admin-token", default=os.environ.get("FORGE_ADMIN_TOKEN"))
    p.add_argument("--tasks", required=True, help="held-out tasks JSONL (task_id, prompt, domain, answer, metadata)")
    add_agent_arguments(p)
    add_verifier_argument(p)
    add_eval_arguments(p, periodic=False)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.eval_samples < 1 or args.eval_concurrency < 1:
        raise SystemExit("--eval-samples and --eval-concurrency must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s forge-eval %(message)s", stream=sys.stderr)
    tasks = load_tasks(args.tasks)
    try:
        verifier = build_verifier(args.verifier, args)
        if isinstance(verifier, DomainVerifier):
            verifier.check_domains(tasks)
    except (ValueError, ImportError) as exc:  # a bad spec, a misspelt domain, a module that does not import
        raise SystemExit(f"forge-eval: {exc}") from exc
    result = evaluate(GatewayClient(args.gateway_url, args.admin_token), build_agent(args), tasks,
                      args.eval_samples, verifier,
                      args.eval_timeout_s or 300.0, args.eval_concurrency, sampling=eval_sampling(args),
                      success_threshold=args.eval_success_threshold)
    log.info(format_result(result))
    if args.eval_output:
        append_jsonl(args.eval_output, result)
    publish(GatewayClient(args.gateway_url, args.admin_token), result)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
