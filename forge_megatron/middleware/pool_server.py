"""``forge-pool``: run the data pool as its own process, serving trainers and remote gateways over ZeroMQ.

Example (the trainer pulls 8 groups per step, rollouts generate 32 groups per policy version, window 30 %):

    forge-pool --db /data/pool.sqlite --bind tcp://127.0.0.1:5555 --generation-batch-groups 32 \
               --train-batch-groups 8 --max-staleness 2

Multi-node (CURVE): make a keypair per side with
``python -c "import zmq; print(*(k.decode() for k in zmq.curve_keypair()), sep=chr(10))"`` (public, then secret),
put the server's pair in --curve-secret-file and the clients' public keys in --curve-clients-file, and bind a
routable address. Trainers pass ``CurveKeys(public, secret, server_public=...)`` to ``PoolClient``.

The state lives in the SQLite file: restarting with the same ``--db`` resumes where the pool stopped. It prints
``forge-pool serving on <endpoint>`` once bound and stops cleanly on SIGTERM / SIGINT.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from forge_megatron.middleware.pool import DataPool, PoolConfig
from forge_megatron.middleware.transport import CurveKeys, PoolServer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="forge-pool", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("storage and network")
    g.add_argument("--db", default="pool.sqlite", help="SQLite database file (created if absent; reused on restart)")
    g.add_argument("--bind", default="tcp://127.0.0.1:5555",
                   help="ZeroMQ endpoint; keep 127.0.0.1 unless you enable CURVE (--curve-secret-file)")
    g.add_argument("--max-message-mb", type=float, default=1024.0, help="largest request accepted, in MiB")
    g.add_argument("--keep-trajectories", action="store_true",
                   help="keep every episode's tokens after its group is committed (trained and checkpointed) or "
                        "dropped; by default they are deleted then, so the database does not grow with the run")
    g.add_argument("--curve-secret-file", help="file with two lines: server public key, server secret key (z85); "
                   "enables CURVE encryption")
    g.add_argument("--curve-clients-file", help="file with one allowed client public key (z85) per line")
    w = p.add_argument_group("windowed FIFO")
    w.add_argument("--generation-batch-groups", type=int, default=16, help="N: groups generated per policy version")
    w.add_argument("--window-fraction", type=float, default=0.3, help="W = ceil(fraction * N) (default 0.3)")
    w.add_argument("--window", default=None,
                   help="explicit W: 1 = strict FIFO, 'inf' = greedy first-finished-first-out, 0 = use the fraction")
    b = p.add_argument_group("backpressure and failures")
    b.add_argument("--max-inflight-groups", type=int, default=None, help="stop admitting at this many running groups")
    b.add_argument("--max-staleness", type=int, default=None, help="stop admitting when new groups would lag this "
                   "many policy versions")
    b.add_argument("--train-batch-groups", type=int, default=None, help="groups per trainer step (staleness estimate)")
    b.add_argument("--max-lag", type=int, default=None, help="staleness guarantee: drop (state 'stale') every "
                   "undelivered group registered more than this many policy versions ago; default: never drop")
    b.add_argument("--max-retries", type=int, default=0, help="failed episodes per group that reopen their slot")
    b.add_argument("--episode-timeout-s", type=float, default=None, help="running episodes older than this time out")
    b.add_argument("--min-finished-episodes", type=int, default=1, help="a completed group with fewer fails")
    b.add_argument("--drop-zero-advantage-groups", action="store_true",
                   help="dynamic sampling: do not deliver groups whose advantages are all zero (every episode solved the task, or none did, with equal rewards; no policy-gradient signal): they leave the window and admission starts another task; counted as filtered_* in the pool metrics")
    r = p.add_argument_group("rewards (forge_megatron.algo.rewards.RewardConfig; see docs/algorithms.md)")
    r.add_argument("--reward-fn", default=None, help="user reward function 'package.module:function'")
    r.add_argument("--completion-time-bound", type=float, default=0.0,
                   help="largest bonus for the fastest successful episode of a group (0 = off)")
    r.add_argument("--process-weight", action="append", default=[], metavar="NAME=W", type=_process_weight,
                   help="weight of a process term, e.g. malformed_tool_calls=-0.2 (repeatable; adds to the defaults)")
    r.add_argument("--overlong-max-tokens", type=int, default=None, metavar="L",
                   help="overlong penalty on each episode's sampled tokens: -penalty past L, a ramp over the "
                        "--overlong-buffer-tokens before it (DAPO's soft overlong punishment; default off)")
    r.add_argument("--overlong-buffer-tokens", type=int, default=0, metavar="B")
    r.add_argument("--overlong-penalty", type=float, default=1.0, help="the largest overlong penalty")
    r.add_argument("--gamma", type=float, default=1.0, help="reward-to-go discount across segments")
    r.add_argument("--estimator", default="grpo", help="advantage baseline: grpo (group mean) or rloo")
    r.add_argument("--no-std-normalize", action="store_true", help="do not divide advantages by the group std")
    r.add_argument("--singleton-group", default="zero", help="group of one episode: zero, raw or error")
    p.add_argument("--log-level", default="INFO")
    return p


def _process_weight(item: str) -> tuple[str, float]:
    name, _, value = item.partition("=")
    try:
        weight = float(value)
    except ValueError:
        weight = None
    if not name or weight is None:
        raise argparse.ArgumentTypeError(f"must look like NAME=NUMBER, got {item!r}")
    return name, weight


def _reward_config(args: argparse.Namespace):
    from forge_megatron.algo.rewards import DEFAULT_PROCESS_WEIGHTS, RewardConfig

    return RewardConfig(process_weights={**DEFAULT_PROCESS_WEIGHTS, **dict(args.process_weight)},
                        completion_time_bound=args.completion_time_bound, gamma=args.gamma, estimator=args.estimator,
                        std_normalize=not args.no_std_normalize, singleton_group=args.singleton_group,
                        reward_fn=args.reward_fn, overlong_max_tokens=args.overlong_max_tokens,
                        overlong_buffer_tokens=args.overlong_buffer_tokens, overlong_penalty=args.overlong_penalty)


def _read_keys(path: str) -> list[bytes]:
    with open(path, "rb") as f:
        return [line.strip() for line in f if line.strip()]


def _curve_keys(args: argparse.Namespace) -> CurveKeys | None:
    if not args.curve_secret_file:
        return None
    keys = _read_keys(args.curve_secret_file)
    if len(keys) != 2:
        raise SystemExit(f"--curve-secret-file {args.curve_secret_file}: expected 2 lines (public, secret), "
                         f"got {len(keys)}")
    clients = tuple(_read_keys(args.curve_clients_file)) if args.curve_clients_file else ()
    if not clients:
        raise SystemExit("--curve-secret-file needs --curve-clients-file listing the allowed client public keys")
    return CurveKeys(public=keys[0], secret=keys[1], allowed_clients=clients)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s forge-pool %(levelname)s %(message)s")
    try:
        config = PoolConfig(db_path=args.db, window_fraction=args.window_fraction, window=args.window,
                            generation_batch_groups=args.generation_batch_groups,
                            max_inflight_groups=args.max_inflight_groups, max_staleness=args.max_staleness,
                            train_batch_groups=args.train_batch_groups, max_lag=args.max_lag,
                            max_retries=args.max_retries,
                            episode_timeout_s=args.episode_timeout_s, min_finished_episodes=args.min_finished_episodes,
                            keep_trajectories=args.keep_trajectories,
                            drop_zero_advantage_groups=args.drop_zero_advantage_groups,
                            reward=_reward_config(args))
    except ValueError as exc:
        raise SystemExit(f"forge-pool: {exc}") from exc
    pool = DataPool(config)
    server = PoolServer(pool, bind=args.bind, curve_keys=_curve_keys(args),
                        max_message_bytes=int(args.max_message_mb * (1 << 20))).start()
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(f"forge-pool serving on {server.address}", flush=True)
    done.wait()
    server.stop()
    pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
