"""Discrete-event simulation of rollouts feeding a trainer: strict FIFO vs windowed FIFO vs greedy.

Rollouts: up to ``concurrency`` groups generate at once; each takes a heavy-tailed duration (lognormal, Pareto or
samples from ``--durations FILE``) and starts as soon as a slot is free and the backpressure rule admits it
(``scheduler.admit``: undelivered + 1 <= (max_staleness + 1) * B). A group started at policy version v and consumed
at version v' has staleness v' - v. Trainer: takes B groups per step through the real ``scheduler.select_groups``
(the data pool's rule), trains for ``step_s``, then the policy version increments. With ``--timeout`` a group
running longer fails at the timeout and leaves the window (the pool's ``episode_timeout_s``). All three policies
see the same duration sequence.

Reported per policy: throughput (groups consumed per simulated second), idle_fraction (trainer time spent waiting),
staleness_mean / staleness_max (versions), length_bias = mean duration of the groups consumed in the first K batches
/ population mean duration (1 = unbiased, < 1 = favours short rollouts).

    python benchmarks/scheduler.py --dist lognormal --sigma 1.0
"""

from __future__ import annotations

import argparse
import heapq
import json
import math

import numpy as np

from forge_megatron.middleware.scheduler import PendingGroup, admit, select_groups, window_size


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
    B, step_s = args.train_batch_groups, args.step_s
    events: list[tuple[float, int, int]] = []  # (time, kind 0=finish / 1=trainer free / 2=timeout, group index)
    start_version: dict[int, int] = {}
    finished: set[int] = set()
    pending: list[int] = []  # started, not consumed, by index
    version, now, next_idx, idle, trainer_free_at, timed_out = 0, 0.0, 0, 0.0, 0.0, 0
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
            start_version[next_idx] = version
            pending.append(next_idx)
            next_idx += 1

    def try_train() -> None:
        nonlocal trainer_busy, idle
        chosen = select_groups([PendingGroup(i, i in finished) for i in pending], window, B)
        if len(chosen) < B:
            return
        idle += now - trainer_free_at
        for i in chosen:
            pending.remove(i)
            finished.discard(i)
            consumed_lags.append(version - start_version[i])
            consumed_durations.append(d[i])
        trainer_busy = True
        heapq.heappush(events, (now + step_s, 1, -1))

    launch()
    while len(consumed_lags) < args.groups:
        now, kind, idx = heapq.heappop(events)
        if kind == 0:
            finished.add(idx)
        elif kind == 2:  # timed out: the group fails and leaves the window, as in the pool
            pending.remove(idx)
            timed_out += 1
        else:
            trainer_busy, trainer_free_at, version = False, now, version + 1
        if not trainer_busy:
            try_train()
        launch()
    k = args.bias_batches * B
    return {
        "throughput": len(consumed_lags) / now,
        "idle_fraction": idle / now,
        "staleness_mean": float(np.mean(consumed_lags)),
        "staleness_max": int(np.max(consumed_lags)),
        "length_bias": float(np.mean(consumed_durations[:k]) / d.mean()),
        "timed_out_fraction": timed_out / next_idx,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dist", choices=("lognormal", "pareto"), default="lognormal")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma (heavier tail when larger)")
    p.add_argument("--alpha", type=float, default=1.5, help="Pareto shape (heavier tail when smaller)")
    p.add_argument("--durations", help="file of measured rollout durations (one per line) to sample from")
    p.add_argument("--generation-batch-groups", type=int, default=64, help="N; W = ceil(window_fraction * N)")
    p.add_argument("--window-fraction", type=float, default=0.3)
    p.add_argument("--concurrency", type=int, default=None, help="groups generating at once (default N)")
    p.add_argument("--window", default=None, help="explicit W of the windowed policy (overrides the fraction)")
    p.add_argument("--train-batch-groups", type=int, default=8, help="B: groups per trainer step")
    p.add_argument("--max-staleness", type=int, default=8,
                   help="backpressure as in the pool: admit while undelivered + 1 <= (s + 1) * B")
    p.add_argument("--trainer-speed", type=float, default=0.8,
                   help="trainer capacity / rollout capacity; sets step_s = B * mean / concurrency / speed")
    p.add_argument("--timeout", type=float, default=None,
                   help="rollout timeout in mean durations: longer groups fail at it and leave the window")
    p.add_argument("--groups", type=int, default=4000, help="groups consumed per simulation")
    p.add_argument("--bias-batches", type=int, default=10, help="K: batches used for length_bias")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.concurrency = args.concurrency or args.generation_batch_groups
    args.step_s = args.train_batch_groups / args.concurrency / args.trainer_speed
    d = durations(args, np.random.default_rng(args.seed))
    windows = {"strict": 1.0, "windowed": window_size(args.window, args.window_fraction, args.generation_batch_groups),
               "greedy": math.inf}
    result = {name: simulate(d, w, args) for name, w in windows.items()}
    result["config"] = {"window": windows["windowed"], "dist": "file" if args.durations else args.dist,
                        "concurrency": args.concurrency, "train_batch_groups": args.train_batch_groups,
                        "max_staleness": args.max_staleness, "timeout": args.timeout, "step_s": args.step_s,
                        "groups": args.groups}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
