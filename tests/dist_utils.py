"""Run a test body on N gloo ranks (spawned processes) with Megatron's parallel state initialised.

    results = run_distributed(body, world_size=2, parallel=ParallelConfig(tp=2), seed=0, arg=...)

``body(rank, world_size, **kwargs)`` must be a module-level function (it is pickled by name into the
children). Its return value (picklable) comes back per rank. If any rank raises, the others are killed and
the child's traceback is re-raised here; a rank that hangs past ``timeout_s`` fails the test and every
child process is killed, so no process outlives a failing test. A rendezvous port taken by another process before
the ranks bind it (two test workers choosing at once) starts the run again on another port (``attempts``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import traceback

from forge_megatron.mcore.parallel import ParallelConfig
from forge_megatron.utils.ports import free_port  # noqa: F401 (the tests' import point)


def _child(rank, world_size, port, parallel, seed, body, kwargs, queue):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
    )
    try:
        import torch

        torch.set_num_threads(1)
        from forge_megatron.mcore import parallel as par

        par.initialize(parallel, seed=seed, timeout_s=120)
        try:
            result = body(rank, world_size, **kwargs)
        finally:
            par.destroy()
        # Plain pickle to bytes: multiprocessing's reducers would pass tensors through shared memory that dies
        # with this process before the parent reads it.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))


class _PortTaken(RuntimeError):
    """The rendezvous port was taken by another process between choosing it and binding it."""


def run_distributed(body, world_size: int, parallel: ParallelConfig = ParallelConfig(), seed: int = 1234,
                    timeout_s: float = 240.0, attempts: int = 3, **kwargs):
    for attempt in range(attempts):
        try:
            return _run_once(body, world_size, parallel, seed, timeout_s, kwargs)
        except _PortTaken:  # another test worker bound the free port first: start again on another one
            if attempt == attempts - 1:
                raise


def _run_once(body, world_size, parallel, seed, timeout_s, kwargs):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, parallel, seed, body, kwargs, queue), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        import queue as queue_mod
        import time

        deadline = time.monotonic() + timeout_s
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"distributed test did not finish in {timeout_s:.0f}s "
                                   f"(ranks done: {sorted(results)})")
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} died with exit codes {[procs[i].exitcode for i in dead]}")
                continue
            if status == "error":
                if "init_process_group" in payload and "EADDRINUSE" in payload:
                    raise _PortTaken(f"rank {rank} could not rendezvous:\n{payload}")
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=10 if len(results) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [results[r] for r in range(world_size)]
