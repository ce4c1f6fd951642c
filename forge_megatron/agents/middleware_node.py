"""The middleware node of a run: forge-gateway with the data pool embedded as its episode sink, in one process.

Agents talk to the gateway (OpenAI API + session endpoints); every ended session goes straight into the
:class:`DataPool` (thread-safe, SQLite), which scores groups and serves batches to the trainer over ZeroMQ
(:class:`PoolServer`). One process means no extra hop for episodes and one database writer.

    python -m forge_megatron.agents.middleware_node --model-path /models/tiny --engines http://127.0.0.1:30000 \\
        --port 8000 --pool-bind tcp://127.0.0.1:5555 --pool-db runs/pool.sqlite

Prints ``FORGE_READY port=<gateway port>`` once both servers listen (the launch helpers wait for it).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from forge_megatron.middleware.gateway import Gateway, GatewayConfig, add_session_options, serve, session_options
from forge_megatron.middleware.pool import DataPool, PoolConfig
from forge_megatron.middleware.transport import PoolServer
from forge_megatron.rollout.launch import until_terminated


def build_parser() -> argparse.ArgumentParser:
    from forge_megatron.utils.cli import name_float_pairs

    p = argparse.ArgumentParser(prog="forge-node", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("gateway")
    g.add_argument("--model-path", required=True, help="local HF directory with the tokenizer and chat template")
    g.add_argument("--engines", required=True, help="comma-separated SGLang/forge-engine URLs")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    g.add_argument("--admin-token", default=os.environ.get("FORGE_ADMIN_TOKEN"))
    g.add_argument("--public-url", default=None,
                   help="base of the URLs handed to agents (default http://<host>:<port>; bound to 0.0.0.0: this "
                        "machine's host name). With --gateway-workers, agents then call through this one URL")
    g.add_argument("--gateway-workers", type=int, default=1, metavar="N",
                   help="serve sessions from N gateway processes behind this one (each session in one of them, "
                        "episodes to the pool over ZeroMQ); one process prepares ~50 long-context calls/s "
                        "(docs/middleware.md, multi-process gateway). Default 1: the gateway in this process")
    add_session_options(g)
    d = p.add_argument_group("data pool")
    d.add_argument("--pool-bind", default="tcp://127.0.0.1:5555")
    d.add_argument("--pool-db", default="pool.sqlite")
    d.add_argument("--keep-trajectories", action="store_true",
                   help="keep episodes' tokens after their group is committed or dropped (default: delete them then)")
    d.add_argument("--window-fraction", type=float, default=0.3)
    d.add_argument("--rollout-batch-groups", type=int, default=16, help="N of the window W = ceil(fraction * N)")
    d.add_argument("--max-inflight-groups", type=int, default=None)
    d.add_argument("--max-staleness", type=int, default=None)
    d.add_argument("--train-batch-groups", type=int, default=None)
    d.add_argument("--max-lag", type=int, default=None,
                   help="drop undelivered groups registered more than this many policy versions ago (see forge-pool)")
    d.add_argument("--episode-timeout-s", type=float, default=None)
    d.add_argument("--drop-zero-advantage-groups", action="store_true",
                   help="dynamic sampling: do not deliver groups whose advantages are all zero (every episode solved the task, or none did, with equal rewards; no policy-gradient signal): they leave the window and admission starts another task; counted as filtered_* in the pool metrics")
    d.add_argument("--advantage-estimator", default="grpo", choices=["grpo", "rloo"])
    d.add_argument("--reward-weights", type=name_float_pairs, default={})
    d.add_argument("--completion-time-bound", type=float, default=0.0)
    d.add_argument("--overlong-max-tokens", type=int, default=None, metavar="L",
                   help="overlong penalty on each episode's sampled tokens: -penalty past L, a ramp over the "
                        "--overlong-buffer-tokens before it (DAPO's soft overlong punishment; default off)")
    d.add_argument("--overlong-buffer-tokens", type=int, default=None, metavar="B")
    d.add_argument("--overlong-penalty", type=float, default=None, help="the largest overlong penalty (default 1)")
    return p


def pool_config(args: argparse.Namespace) -> PoolConfig:
    from forge_megatron.training.arguments import reward_config

    return PoolConfig(db_path=args.pool_db, window_fraction=args.window_fraction,
                      generation_batch_groups=args.rollout_batch_groups, max_inflight_groups=args.max_inflight_groups,
                      max_staleness=args.max_staleness, train_batch_groups=args.train_batch_groups,
                      max_lag=args.max_lag, episode_timeout_s=args.episode_timeout_s, reward=reward_config(args),
                      keep_trajectories=args.keep_trajectories,
                      drop_zero_advantage_groups=args.drop_zero_advantage_groups)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s forge-node %(message)s")
    try:  # bad gateway settings (an unknown parser, ...) stop it before the pool starts
        config = GatewayConfig(model_path=args.model_path, engine_urls=[u for u in args.engines.split(",") if u],
                               host=args.host, port=args.port, admin_token=args.admin_token,
                               public_url=args.public_url, **session_options(args))
    except ValueError as exc:
        raise SystemExit(f"forge-node: {exc}") from exc
    if args.gateway_workers < 1:
        raise SystemExit(f"forge-node: --gateway-workers must be >= 1, got {args.gateway_workers}")
    if args.malformed_call_reward:  # the penalty moves from the episode to the call: counted once
        if args.reward_weights.get("malformed_tool_calls", 0.0) != 0.0:
            raise SystemExit("forge-node: --malformed-call-reward and --reward-weights malformed_tool_calls="
                             f"{args.reward_weights['malformed_tool_calls']:g} would penalise malformed tool calls "
                             "twice (on the call and on the episode): drop one")
        args.reward_weights = {**args.reward_weights, "malformed_tool_calls": 0.0}
        logging.info("--malformed-call-reward %g: malformed tool calls are penalised on the call that made them; the "
                     "pool's episode-level malformed_tool_calls weight is 0", args.malformed_call_reward)
    pool = DataPool(pool_config(args))
    server = PoolServer(pool, bind=args.pool_bind).start()
    print(f"forge-pool serving on {server.address}", flush=True)
    ready = lambda port: print(f"FORGE_READY port={port}", flush=True)  # noqa: E731
    try:
        if args.gateway_workers > 1:  # the workers send episodes to this process's pool over ZeroMQ
            from forge_megatron.middleware.gateway_front import GatewayFront, serve_front

            addr = server.address.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")
            front = GatewayFront(config, args.gateway_workers, {"kind": "pool", "addr": addr}, pool=pool)
            try:
                asyncio.run(serve_front(front, ready=ready))
            except RuntimeError as exc:  # a worker did not start: its own output says why
                raise SystemExit(f"forge-node: {exc}") from exc
        else:
            asyncio.run(until_terminated(serve(Gateway(config, sink=pool), ready=ready)))  # SIGTERM: exit 0
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        pool.close()


if __name__ == "__main__":
    main()
