"""Run a test body on N gloo ranks (processes forked from a server that imported the heavy modules once) with
Megatron's parallel state initialised.

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

# What the ranks' server imports once (a module missing here is imported by each rank as it needs it). torch._dynamo:
# torch imports it at a rank's first optimizer and first meta-tensor op (the memory plan), ~1.5 s of CPU a rank.
# tests.dist_freeze, last: freezes the server's heap, so the ranks' collections skip it (trainer tests ~7 % faster).
PRELOAD = ["tests.dist_utils", "torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt",
           "megatron.core.optimizer", "transformers", "transformers.modeling_utils", "torch._dynamo",
           "forge_megatron.mcore.parallel", "forge_megatron.mcore.model", "forge_megatron.training.arguments",
           "forge_megatron.training.trainer", "forge_megatron.bridge", "forge_megatron.kernels.tree_attention",
           "forge_megatron.mcore.gated_delta_net", "forge_megatron.middleware.transport",
           "forge_megatron.weight_sync.syncer", "forge_megatron.mcore.tree_attention", "forge_megatron.mcore.forward",
           "forge_megatron.multimodal.tree", "megatron.core.models.gpt.gpt_layer_specs", "numpy.ma", "tests.dist_freeze"]
# FORGE_TEST_LAUNCH=exec: run_script starts each rank as its own interpreter (torchrun for several), as a user does
LAUNCH_ENV = "FORGE_TEST_LAUNCH"


def _child(rank, world_size, port, parallel, seed, body, kwargs, queue, environ):
    os.environ.clear()  # the test's environment (the server's is the one it had when it started)
    os.environ.update(environ)
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


def _fork_unsafe() -> bool:
    """On a machine with a GPU ranks start their own interpreters: a rank forked from a server in which anything
    initialised CUDA cannot use it ("Cannot re-initialize CUDA in forked subprocess", the first H200 run of the GPU
    trainer tests), and a rank that hides the GPU (CUDA_VISIBLE_DEVICES="") must probe afresh."""
    from forge_megatron.utils import env

    return env.has_cuda()


def _context():
    """A forkserver whose server process imported torch, Megatron-Core and transformers once: each rank forks from
    it (milliseconds) instead of starting Python and importing them again (seconds). With a GPU: spawn."""
    if _fork_unsafe():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _run_once(body, world_size, parallel, seed, timeout_s, kwargs):
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, parallel, seed, body, kwargs, queue, dict(os.environ)),
                    daemon=True)
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


def _script_child(script, argv, environ, out_path, err_path, module):
    """One rank of ``python script argv`` (``python -m script argv`` if ``module``) in a process forked from the
    server: its own stdout and stderr files, the caller's environment, the script run as __main__, the interpreter's
    exit steps (threads joined, atexit)."""
    import atexit
    import runpy
    import sys
    import threading

    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(environ)
    import torch

    torch.set_num_threads(int(environ.get("OMP_NUM_THREADS") or 1))
    sys.argv = [script, *argv]
    code = 0
    try:
        if module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter: the traceback to stderr, exit status 1
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_script(script: str, argv, nproc: int = 1, env: dict | None = None, timeout_s: float = 300.0,
               attempts: int = 3, module: bool = False):
    """``python script *argv`` (``module``: ``python -m script *argv``; ``nproc`` > 1: as under torchrun, RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR /
    MASTER_PORT set per rank) with ``env`` (default os.environ), each rank forked from the server that imported the
    heavy modules once. Returns a subprocess.CompletedProcess: the ranks' stdout and stderr (rank 0's first), the
    first failing rank's exit status (1 if it died of a signal, as torchrun) or 0. As torchrun, a failing rank
    stops the others (after 5 s); past ``timeout_s`` every rank is killed and subprocess.TimeoutExpired raised. A
    rendezvous port taken by another test worker starts the run again (``attempts``). FORGE_TEST_LAUNCH=exec, or a
    GPU on this machine, runs a new interpreter per rank instead (torchrun for several)."""
    import subprocess
    import sys

    env = dict(os.environ if env is None else env)
    if os.environ.get(LAUNCH_ENV) == "exec" or _fork_unsafe():
        target = ["-m", script] if module else [script]
        if nproc == 1:
            return subprocess.run([sys.executable, *target, *argv], env=env, capture_output=True, text=True,
                                  timeout=timeout_s)
        return _torchrun(target, argv, nproc, env, timeout_s)
    for attempt in range(attempts):
        done = _run_script_once(script, list(argv), nproc, env, timeout_s, module)
        if done.returncode == 0 or "EADDRINUSE" not in done.stderr or attempt == attempts - 1:
            return done
    raise AssertionError("unreachable")


def _torchrun(target, argv, nproc, env, timeout_s):
    """torchrun with each rank's output in its own files (``--redirects 3``), put together as run_script's forked
    ranks' are: rank 0's first. (Ranks sharing torchrun's pipes interleave their writes within a line.)"""
    import glob
    import shutil
    import subprocess
    import sys
    import tempfile

    logs = tempfile.mkdtemp(prefix="forge-torchrun-")
    try:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
               str(free_port()), "--log-dir", logs, "--redirects", "3", *target, *argv]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)

        def read(rank, name):
            found = sorted(glob.glob(os.path.join(logs, "**", "attempt_*", str(rank), f"{name}.log"),
                                     recursive=True))
            return "".join(open(path, errors="replace").read() for path in found)
        out = "".join(read(r, "stdout") for r in range(nproc))
        err = "".join(read(r, "stderr") for r in range(nproc))
        return subprocess.CompletedProcess(cmd, done.returncode, done.stdout + out, err + done.stderr)
    finally:
        shutil.rmtree(logs, ignore_errors=True)


def _run_script_once(script, argv, nproc, env, timeout_s, module):
    import multiprocessing.connection
    import shutil
    import subprocess
    import tempfile
    import time

    ctx = _context()
    logs = tempfile.mkdtemp(prefix="forge-ranks-")
    if nproc > 1:
        port = str(free_port())
        envs = [{**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(r), "LOCAL_RANK": str(r),
                 "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)} for r in range(nproc)]
    else:
        envs = [env]
    files = [(os.path.join(logs, f"{r}.out"), os.path.join(logs, f"{r}.err")) for r in range(nproc)]
    procs = [ctx.Process(target=_script_child, args=(script, argv, envs[r], *files[r], module)) for r in range(nproc)]
    try:
        for p in procs:
            p.start()
        deadline, failed_at = time.monotonic() + timeout_s, None
        while any(p.exitcode is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                raise subprocess.TimeoutExpired([script, *argv], timeout_s)
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            if failed_at is not None and now - failed_at > 5:
                break
            multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.2)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join(timeout=10)
    codes = [p.exitcode for p in procs]
    returncode = next((c for c in codes if c is not None and c > 0), 1 if any(c != 0 for c in codes) else 0)
    out, err = [], []
    for o, e in files:
        for path, into in ((o, out), (e, err)):
            if os.path.exists(path):  # (a rank that died before it opened them wrote nothing)
                with open(path, errors="replace") as f:
                    into.append(f.read())
    shutil.rmtree(logs, ignore_errors=True)
    return subprocess.CompletedProcess([script, *argv], returncode, "".join(out), "".join(err))
