"""Discrete-event simulation of rollouts feeding a trainer: strict FIFO vs windowed FIFO vs greedy, at one
staleness guarantee.

Rollouts: up to ``concurrency`` groups generate at once; each takes a heavy-tailed duration (lognormal, Pareto or
samples from ``--durations FILE``, scaled to mean 1) and starts as soon as a slot is free and the pool's
backpressure rule admits it (``scheduler.admit`` with the pool's counts: running groups, and undelivered = running
+ finished; undelivered + 1 <= (max_staleness + 1) * B). Trainer: takes B groups per step through the real
``scheduler.select_groups``, trains for ``step_s``, then the policy version increments. A group started at version
v and trained at version v' has lag (staleness) v' - v. All three policies see the same duration sequence.

Equal staleness: admission alone bounds the lag only for in-order delivery (strict: s + 1; window W:
s + 1 + ceil((W - 1) / B), see ``staleness_bound``); greedy passes a straggler without limit. So every policy
also enforces ``max_lag`` the way greedy systems bound staleness: when the version advances, a pending group that
can no longer be trained within ``max_lag`` versions (``scheduler.exceeds_lag``, the rule the pool applies with
``PoolConfig.max_lag``) is dropped (aborted if still running), freeing its slot and wasting the rollout time spent
on it. The default ``max_lag`` is the windowed policy's own bound, so strict and
windowed never drop and greedy pays for the same guarantee. ``--keep-stale`` turns dropping off; ``--timeout T``
fails groups running longer than T (the pool's ``episode_timeout_s``), which also wastes their rollout time.

Reported per policy: throughput (trained groups per mean rollout duration), work_throughput (rollout time of the
trained groups per unit time: trained tokens if tokens scale with duration), idle_fraction (trainer time spent
waiting), staleness_mean / staleness_max (versions, over trained groups), length_bias = mean duration of the
groups trained in the first K batches / mean duration of all groups the policy started (1 = unbiased, < 1 =
favours short rollouts; the started groups are a prefix of the shared sequence, so with Pareto tails their mean
is not exactly 1),
length_bias_all (the same over the whole run: dropped stragglers never train), timed_out_fraction and
dropped_fraction (of started groups), wasted_fraction (rollout time of timed-out and dropped groups / rollout time
of all groups that ended).

    python benchmarks/scheduler.py --dist lognormal --sigma 1.0
"""

from __future__ import annotations

import argparse
import heapq
import json
import math

import numpy as np

from forge_megatron.middleware.scheduler import PendingGroup, admit, exceeds_lag, select_groups, window_size


def durations(args: argparse.Namespace, rng: np.random.Generator) -> np.ndarray:
    """Group durations with mean 1 (so step time and throughput are in units of the mean rollout)."""
    n = args.groups * 4
    if args.durations:
        pool = np.loadtxt(args.durations, dtype=np.float64).ravel()
        if pool.size == 0 or not np.all(pool > 0):
            raise SystemExit(f"--durations {args.durations}: need positive numbers, one per line")
        d = rng.choice(pool, size=n)
    elif args.dist == "lognormal":
        d = rng.lognormal(0.0, args.sigma, size=n)
    else:
        d = rng.pareto(args.alpha, size=n) + 1.0
    return d / d.mean()


def simulate(d: np.ndarray, window: float, args: argparse.Namespace) -> dict[str, float]:
    B, step_s, max_lag = args.train_batch_groups, args.step_s, args.max_lag
    events: list[tuple[float, int, int]] = []  # (time, kind 0=finish / 1=trainer free / 2=timeout, group index)
    start_version: dict[int, int] = {}
    start_time: dict[int, float] = {}
    finished: set[int] = set()
    pending: list[int] = []  # started, not consumed, not failed, by index
    version, now, next_idx, idle, trainer_free_at = 0, 0.0, 0, 0.0, 0.0
    timed_out = dropped = 0
    useful_s = wasted_s = 0.0  # rollout time of consumed groups / of timed-out and dropped groups
    consumed_lags: list[int] = []
    consumed_durations: list[float] = []
    trainer_busy = False

    def launch() -> None:
        nonlocal next_idx
        while next_idx < d.size and admit(len(pending) - len(finished), len(pending), args.concurrency,
                                          args.max_staleness, B):
            if args.timeout is not None and d[next_idx] > args.timeout:
                heapq.heappush(events, (now + args.timeout, 2, next_idx))
            else:
                heapq.heappush(events, (now + d[next_idx], 0, next_idx))
            start_version[next_idx], start_time[next_idx] = version, now
            pending.append(next_idx)
            next_idx += 1

    def drop_stale() -> None:
        """Abort running groups and discard finished ones that can no longer be trained within ``max_lag``."""
        nonlocal dropped, wasted_s
        for i in [i for i in pending if exceeds_lag(start_version[i], version, max_lag)]:
            pending.remove(i)
            wasted_s += d[i] if i in finished else now - start_time[i]
            finished.discard(i)
            dropped += 1

    def try_train() -> None:
        nonlocal trainer_busy, idle, useful_s
        chosen = select_groups([PendingGroup(i, i in finished) for i in pending], window, B)
        if len(chosen) < B:
            return
        idle += now - trainer_free_at
        for i in chosen:
            pending.remove(i)
            finished.discard(i)
            consumed_lags.append(version - start_version[i])
            consumed_durations.append(d[i])
            useful_s += d[i]
        trainer_busy = True
        heapq.heappush(events, (now + step_s, 1, -1))

    launch()
    while len(consumed_lags) < args.groups:
        if not events:
            raise SystemExit(f"all {d.size} rollouts ended with only {len(consumed_lags)} groups trained"
                             " (over 3/4 dropped or timed out): raise --max-lag or --timeout")
        now, kind, idx = heapq.heappop(events)
        if kind != 1 and idx not in pending:
            continue  # dropped while running: its finish / timeout no longer matters
        if kind == 0:
            finished.add(idx)
        elif kind == 2:  # timed out: the group fails and leaves the window, as in the pool
            pending.remove(idx)
            timed_out += 1
            wasted_s += args.timeout
        else:
            trainer_busy, trainer_free_at, version = False, now, version + 1
            drop_stale()
        if not trainer_busy:
            try_train()
        launch()
    k, started_mean = args.bias_batches * B, float(np.mean(d[:next_idx]))
    return {
        "throughput": len(consumed_lags) / now,
        "idle_fraction": idle / now,
        "staleness_mean": float(np.mean(consumed_lags)),
        "staleness_max": int(np.max(consumed_lags)),
        "length_bias": float(np.mean(consumed_durations[:k])) / started_mean,
        "length_bias_all": float(np.mean(consumed_durations)) / started_mean,
        "work_throughput": useful_s / now,
        "timed_out_fraction": timed_out / next_idx,
        "dropped_fraction": dropped / next_idx,
        "wasted_fraction": wasted_s / (useful_s + wasted_s),
    }


def staleness_bound(max_staleness: int, window: float, per_step: int) -> float:
    """Max lag the admission rule plus a window W guarantee: s + 1 + ceil((W - 1) / B).

    A group admitted with at most (s + 1) * B - 1 older groups undelivered can be passed by at most W - 1 younger
    ones (a taken group lies below head + W <= i + W), so at most (s + 1) * B + W - 2 groups are taken before it:
    it is in the (s + 1 + ceil((W - 1) / B))-th batch selected after it starts, counting the one selected when a
    running trainer step ends (the step running at its start was selected before it). W = 1 gives s + 1."""
    return math.inf if math.isinf(window) else max_staleness + 1 + math.ceil((window - 1) / per_step)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dist", choices=("lognormal", "pareto"), default="lognormal")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma (heavier tail when larger)")
    p.add_argument("--alpha", type=float, default=1.5, help="Pareto shape (heavier tail when smaller)")
    p.add_argument("--durations", help="file of measured rollout durations (one per line) to sample from")
    p.add_argument("--generation-batch-groups", type=int, default=64,
                   help="N: groups generated per policy version; W = ceil(window_fraction * N)")
    p.add_argument("--window-fraction", type=float, default=0.3)
    p.add_argument("--concurrency", type=int, default=None, help="groups generating at once (default N)")
    p.add_argument("--window", default=None, help="explicit W of the windowed policy (overrides the fraction)")
    p.add_argument("--train-batch-groups", type=int, default=None,
                   help="B: groups per trainer step, one policy version each (default N, as in the pool)")
    p.add_argument("--max-staleness", type=int, default=8,
                   help="s: backpressure as in the pool: admit while undelivered + 1 <= (s + 1) * B")
    p.add_argument("--max-lag", type=int, default=None,
                   help="staleness guarantee enforced for every policy: a group that can no longer be trained "
                        "within this many versions is dropped (aborted if running); default: the windowed "
                        "policy's own bound s + 1 + ceil((W - 1) / B), so strict and windowed never drop")
    p.add_argument("--keep-stale", action="store_true",
                   help="never drop: greedy then trains stragglers however stale (no common staleness guarantee)")
    p.add_argument("--trainer-speed", type=float, default=0.8,
                   help="trainer capacity / rollout capacity; sets step_s = B * mean / concurrency / speed")
    p.add_argument("--timeout", type=float, default=None,
                   help="rollout timeout in mean durations: longer groups fail at it and leave the window")
    p.add_argument("--groups", type=int, default=4000, help="groups trained per simulation")
    p.add_argument("--bias-batches", type=int, default=10, help="K: batches used for length_bias")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.concurrency = args.concurrency or args.generation_batch_groups
    args.train_batch_groups = args.train_batch_groups or args.generation_batch_groups
    args.step_s = args.train_batch_groups / args.concurrency / args.trainer_speed
    args.window_groups = window_size(args.window, args.window_fraction, args.generation_batch_groups)
    if args.max_lag is not None and args.max_lag < 0:
        raise SystemExit(f"--max-lag must be >= 0, got {args.max_lag}")
    if args.keep_stale:
        args.max_lag = None
    elif args.max_lag is None:
        bound = staleness_bound(args.max_staleness, args.window_groups, args.train_batch_groups)
        args.max_lag = None if math.isinf(bound) else bound
    return args


def main() -> None:
    args = parse_args()
    d = durations(args, np.random.default_rng(args.seed))
    windows = {"strict": 1.0, "windowed": args.window_groups, "greedy": math.inf}
    result = {name: simulate(d, w, args) for name, w in windows.items()}
    result["config"] = {"window": args.window_groups, "dist": "file" if args.durations else args.dist,
                        "generation_batch_groups": args.generation_batch_groups, "concurrency": args.concurrency,
                        "train_batch_groups": args.train_batch_groups, "max_staleness": args.max_staleness,
                        "max_lag": args.max_lag, "timeout": args.timeout, "step_s": args.step_s,
                        "groups": args.groups}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
