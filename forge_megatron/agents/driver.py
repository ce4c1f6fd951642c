"""The rollout driver: keeps the data pool fed with groups of agent episodes.

Loop: draw the next task (domains mixed by ``--domain-ratios`` through ``algo.DomainMixer``; default: each domain
in proportion to its number of tasks), register a group of G episodes at the gateway, run the G episodes
concurrently on worker threads. Backpressure: at most ``max_inflight_groups`` groups run at once, and no new group
starts while the pool says it cannot admit one (``PoolClient.can_admit``: too many in flight or too stale), so the
policy lag of what the trainer receives stays bounded.

    python -m forge_megatron.agents.driver --gateway-url http://127.0.0.1:8000 --tasks tasks.jsonl \\
        --group-size 8 --agent-command "python -m forge_megatron.agents.calculator"

Curriculum (``--retire-solved-after N``): a task whose last N groups were solved by every episode (finished, reward
> 0) is retired: no more groups of it, since they would give no policy-gradient signal (the pool's dynamic sampling
would drop them after paying for the rollouts). With ``--retired-tasks FILE`` retired task ids are appended there
and read back at start, so a restarted driver keeps its curriculum. A domain whose tasks are all retired leaves the
mix (the others keep their relative ratios); once every task is retired the driver stops starting groups.

With ``--eval-tasks heldout.jsonl`` it also evaluates the served policy on held-out tasks at version 0 and every
``--eval-every-versions`` versions, in gateway eval sessions that are never trained on (``agents/evaluate.py``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from forge_megatron.agents.call_rewards import add_call_reward_arguments, call_rewards_from_args
from forge_megatron.agents.gateway_api import GatewayClient, GatewayError
from forge_megatron.agents.runner import (
    DomainVerifier, EpisodeReport, Verifier, add_agent_arguments, add_verifier_argument, build_agent, build_verifier,
    exact_match, run_episode,
)
from forge_megatron.agents.tasks import Task, by_domain, load_tasks
from forge_megatron.algo.domains import DomainMixer

log = logging.getLogger("forge.driver")


def group_metadata(task) -> dict:
    """What a task's group is registered with: its metadata, and its answer (when it has one and the metadata does not
    name another): the pool hands it to a user reward function, a privileged distillation teacher's prompt reads it
    (the gateway's --teacher-prompt, e.g. "{answer}")."""
    metadata = dict(task.metadata or {})
    if task.answer is not None:
        metadata.setdefault("answer", task.answer)
    return metadata


class RolloutDriver:
    """Submits groups of episodes while the pool admits them; thread-safe counters for progress reports."""

    def __init__(self, gateway: GatewayClient, agent, tasks: list[Task], group_size: int,
                 verifier: Verifier = exact_match, max_inflight_groups: int = 4, episode_timeout_s: float = 300.0,
                 domain_ratios: dict[str, float] | None = None, can_admit: Callable[[], bool] | None = None,
                 seed: int = 0, retire_solved_after: int = 0, retired_tasks_path: str | None = None,
                 call_scorer=None):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if retire_solved_after < 0:
            raise ValueError(f"retire_solved_after must be >= 0, got {retire_solved_after}")
        if max_inflight_groups < 1:
            raise ValueError(f"max_inflight_groups must be >= 1, got {max_inflight_groups}")
        self.gateway, self.agent, self.verifier = gateway, agent, verifier
        self.call_scorer = call_scorer  # --call-rm-url: rewards of single calls (agents/call_rewards.py)
        self.group_size, self.max_inflight_groups, self.episode_timeout_s = group_size, max_inflight_groups, episode_timeout_s
        self.pools = by_domain(tasks)
        ratios = domain_ratios or {d: float(len(p)) for d, p in self.pools.items()}
        missing = sorted(set(ratios) - set(self.pools))
        if missing:
            raise ValueError(f"domain_ratios name domains without tasks: {missing}")
        self.ratios, self.seed = dict(ratios), seed
        self.mixer = DomainMixer(ratios, seed=seed)
        self.retire_solved_after, self.retired_tasks_path = retire_solved_after, retired_tasks_path
        self.retired: set[str] = set()
        self._solved_streak: dict[str, int] = {}
        self.can_admit = can_admit or (lambda: True)
        self.reports: deque[EpisodeReport] = deque(maxlen=10000)
        self.groups_started = 0
        self._inflight: list[Future] = []
        self._queue: deque[tuple[str, Task]] = deque()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_inflight_groups * group_size, thread_name_prefix="episode")
        if retired_tasks_path and os.path.exists(retired_tasks_path):
            with open(retired_tasks_path) as f:
                known = {t.task_id for t in tasks}
                self._retire({line.strip() for line in f if line.strip() in known}, persist=False)

    @property
    def exhausted(self) -> bool:
        """Every task is retired: nothing left to start."""
        return not any(self.pools.values())

    def _retire(self, task_ids: set[str], persist: bool = True) -> None:
        """Take ``task_ids`` out of the pools; domains left without tasks leave the mix. Caller holds no lock."""
        with self._lock:
            new = task_ids - self.retired
            if not new:
                return
            self.retired |= new
            for domain in list(self.pools):
                self.pools[domain] = [t for t in self.pools[domain] if t.task_id not in new]
            live = {d: r for d, r in self.ratios.items() if self.pools.get(d)}
            if sum(live.values()) > 0:  # a fresh mixer over the remaining pools (seeded by progress)
                self.mixer = DomainMixer(live, seed=self.seed + len(self.retired))
            else:  # only domains the ratios exclude have tasks left: nothing to draw
                self.pools = {d: [] for d in self.pools}
            self._queue = deque(item for item in self._queue if item[1].task_id not in new)
            if persist and self.retired_tasks_path:
                with open(self.retired_tasks_path, "a") as f:
                    f.writelines(f"{task_id}\n" for task_id in sorted(new))
        why = f"solved by every episode of their last {self.retire_solved_after} groups" if persist else \
            f"listed in {self.retired_tasks_path}"
        log.info("retired %d task(s) %s: %s (%d retired, %d left)", len(new), why,
                 ", ".join(sorted(new)[:5]) + (" ..." if len(new) > 5 else ""), len(self.retired),
                 sum(len(p) for p in self.pools.values()))

    def _run_group(self, task: Task, group_id: str) -> None:
        episodes = [self._pool.submit(self._episode, task, group_id) for _ in range(self.group_size)]
        reports = [fut.result() for fut in episodes]
        if self.retire_solved_after:
            solved = len(reports) == self.group_size and all(
                r is not None and r.status == "finished" and r.reward is not None and r.reward > 0 for r in reports)
            with self._lock:
                streak = self._solved_streak[task.task_id] = (self._solved_streak.get(task.task_id, 0) + 1) * solved
            if streak >= self.retire_solved_after:
                self._retire({task.task_id})

    def _episode(self, task: Task, group_id: str) -> EpisodeReport | None:
        try:
            report = run_episode(self.gateway, self.agent, task, group_id, self.verifier, self.episode_timeout_s,
                                 call_scorer=self.call_scorer)
        except GatewayError as exc:
            log.warning("episode of task %s lost: %s", task.task_id, exc)
            return None
        except Exception:  # noqa: BLE001 - a bug must not silently end the group's thread; the pool times it out
            log.exception("episode of task %s crashed", task.task_id)
            return None
        with self._lock:
            self.reports.append(report)
        return report

    def _next_task(self) -> tuple[str, Task] | None:
        """Tasks come in mixed batches of ``2 * max_inflight_groups`` so each batch holds the domain ratios; None
        once every task is retired."""
        with self._lock:
            if not any(self.pools.values()):
                return None
            if not self._queue:
                self._queue.extend(self.mixer.draw(self.pools, 2 * self.max_inflight_groups))
            return self._queue.popleft()

    def _wait_for_slot(self, stop: threading.Event) -> bool:
        while not stop.is_set():
            self._inflight = [f for f in self._inflight if not f.done()]
            if len(self._inflight) < self.max_inflight_groups and self._admits():
                return True
            stop.wait(0.05)
        return False

    def _admits(self) -> bool:
        try:
            return bool(self.can_admit())
        except Exception as exc:  # noqa: BLE001 - an unreachable pool pauses admission, it does not stop the run
            log.warning("pool admission check failed (%s); retrying", exc)
            return False

    def run(self, stop: threading.Event, max_groups: int | None = None) -> None:
        """Submit groups until ``stop`` is set (or ``max_groups`` were started), then wait for running episodes."""
        groups = ThreadPoolExecutor(max_workers=self.max_inflight_groups, thread_name_prefix="group")
        try:
            while (max_groups is None or self.groups_started < max_groups) and self._wait_for_slot(stop):
                picked = self._next_task()
                if picked is None:
                    log.warning("every task is retired (solved by every episode of its last %d groups): no more "
                                "groups to start", self.retire_solved_after)
                    break
                domain, task = picked
                try:
                    group_id = self.gateway.create_group(task.task_id, self.group_size, domain, group_metadata(task))
                except GatewayError as exc:
                    log.warning("could not register a group for %s: %s", task.task_id, exc)
                    stop.wait(1.0)
                    continue
                self._inflight.append(groups.submit(self._run_group, task, group_id))
                self.groups_started += 1
        finally:
            groups.shutdown(wait=True)
            self._pool.shutdown(wait=True)

    def success_rate(self, last: int | None = None) -> float | None:
        """Fraction of finished episodes with reward > 0 (over the ``last`` ones when given)."""
        with self._lock:
            done = [r for r in self.reports if r.status == "finished"]
        done = done[-last:] if last else done
        return sum(r.reward > 0 for r in done) / len(done) if done else None


def build_parser() -> argparse.ArgumentParser:
    from forge_megatron.utils.cli import name_float_pairs

    p = argparse.ArgumentParser(prog="forge-rollout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gateway-url", required=True)
    p.add_argument("--admin-token", default=os.environ.get("FORGE_ADMIN_TOKEN"))
    p.add_argument("--tasks", required=True, help="tasks JSONL (task_id, prompt, domain, answer, metadata)")
    p.add_argument("--group-size", type=int, default=8, help="episodes per task (GRPO group)")
    p.add_argument("--max-inflight-groups", type=int, default=4)
    p.add_argument("--episode-timeout-s", type=float, default=300.0)
    p.add_argument("--domain-ratios", type=name_float_pairs, default=None, help="e.g. math=0.7,qa=0.3")
    p.add_argument("--pool-addr", default=None, help="data pool ZeroMQ address: respect its admission control")
    add_agent_arguments(p)
    add_verifier_argument(p)
    add_call_reward_arguments(p)
    p.add_argument("--max-groups", type=int, default=None, help="stop after this many groups (default: run until killed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--retire-solved-after", type=int, default=0, metavar="N",
                   help="curriculum: stop drawing a task once its last N groups were solved by every episode "
                        "(0: never)")
    p.add_argument("--retired-tasks", default=None, metavar="FILE",
                   help="append retired task ids here and skip the ones listed at start (survives restarts)")
    from forge_megatron.agents.evaluate import add_eval_arguments

    add_eval_arguments(p, periodic=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s forge-rollout %(message)s")
    can_admit = None
    if args.pool_addr:
        from forge_megatron.middleware.transport import PoolClient

        client = PoolClient(args.pool_addr)
        can_admit = client.can_admit
    gateway, agent = GatewayClient(args.gateway_url, args.admin_token), build_agent(args)
    tasks = load_tasks(args.tasks)
    eval_tasks = load_tasks(args.eval_tasks) if args.eval_tasks else []
    try:
        verifier = build_verifier(args.verifier, args)
        if isinstance(verifier, DomainVerifier):
            verifier.check_domains(tasks, eval_tasks)
        call_scorer = call_rewards_from_args(args, gateway)
    except (ValueError, ImportError) as exc:  # a bad spec, a misspelt domain, a module that does not import
        raise SystemExit(f"forge-rollout: {exc}") from exc
    driver = RolloutDriver(
        gateway, agent, tasks, args.group_size, verifier=verifier,
        max_inflight_groups=args.max_inflight_groups, episode_timeout_s=args.episode_timeout_s,
        domain_ratios=args.domain_ratios, can_admit=can_admit, seed=args.seed,
        retire_solved_after=args.retire_solved_after, retired_tasks_path=args.retired_tasks, call_scorer=call_scorer,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.eval_tasks:
        from forge_megatron.agents.evaluate import PeriodicEval, eval_sampling

        if args.eval_samples < 1 or args.eval_concurrency < 1 or args.eval_every_versions < 1:
            raise SystemExit("--eval-samples, --eval-concurrency and --eval-every-versions must be >= 1")
        PeriodicEval(gateway, agent, eval_tasks, args.eval_every_versions, args.eval_samples,
                     verifier, args.eval_timeout_s or args.episode_timeout_s, args.eval_concurrency,
                     args.eval_output, args.eval_at_start, sampling=eval_sampling(args),
                     success_threshold=args.eval_success_threshold).start(stop)
    reporter = threading.Thread(target=_report, args=(driver, stop), daemon=True)
    reporter.start()
    driver.run(stop, args.max_groups)
    return 0


def _report(driver: RolloutDriver, stop: threading.Event, every_s: float = 10.0) -> None:
    while not stop.wait(every_s):
        rate = driver.success_rate(last=200)
        log.info("groups started %d, episodes done %d, success (last 200) %s%s", driver.groups_started,
                 len(driver.reports), "-" if rate is None else f"{rate:.2f}",
                 f", tasks retired {len(driver.retired)}" if driver.retire_solved_after else "")


if __name__ == "__main__":
    raise SystemExit(main())
