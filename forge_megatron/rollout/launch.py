"""Start forge-engine / forge-gateway servers from Python: as subprocesses (tests that kill them, the demo) or
in-process on a background event-loop thread (fast tests, benchmarks).

Each returns a handle with ``.url`` and ``.stop()``; subprocess handles also have ``.kill()`` (SIGKILL, for
failure tests). A server signals readiness by printing ``FORGE_READY port=<p>`` after it is listening, so port 0
(pick a free port) works without races.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading


async def serve_app(app, host: str, port: int, ready=None, started=None, stopping=None) -> None:
    """Serve an aiohttp ``app`` until cancelled. Once listening: ``started(port)`` (may be a coroutine function)
    then ``ready(port)``; on the way out ``stopping()`` (coroutine function) before the runner is cleaned up."""
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]
    if started is not None:
        started(bound)
    if ready is not None:
        ready(bound)
    try:
        await asyncio.Event().wait()
    finally:
        if stopping is not None:
            await stopping()
        await runner.cleanup()


async def until_terminated(server) -> None:
    """Await ``server`` (a coroutine serving until cancelled, whose cleanup runs on cancellation) until it returns or
    SIGTERM comes; then it is cancelled, its cleanup runs, and this returns normally, so a process stopped with
    SIGTERM (scancel, a supervisor) closes what it holds and exits 0. The handler is installed only in the main
    thread (servers on a test's event-loop thread are stopped by cancelling)."""
    task = asyncio.ensure_future(server)
    terminated = []

    def terminate() -> None:
        terminated.append(True)
        task.cancel()

    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGTERM, terminate)
    except (NotImplementedError, RuntimeError, ValueError):
        pass
    try:
        await task
    except asyncio.CancelledError:
        if not terminated:
            raise


def print_ready(port: int) -> None:
    """The readiness line :class:`ProcessServer` waits for."""
    print(f"FORGE_READY port={port}", flush=True)


class ProcessServer:
    """A server running as a subprocess in its own process group."""

    def __init__(self, module: str, args: list[str], host: str = "127.0.0.1", timeout_s: float = 120.0,
                 env: dict | None = None, wait: bool = True):
        cmd = [sys.executable, "-m", module, "--host", host, "--port", "0", *args]
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, env=full_env)
        self.host, self.timeout_s = host, timeout_s
        self.url = None
        self.port = None
        self._ready = threading.Event()
        self._tail: list[str] = []
        threading.Thread(target=self._read_output, daemon=True).start()
        if wait:
            self.wait_ready()

    def _read_output(self) -> None:
        """Keep the pipe drained; remember the port line and the last lines (for start-up errors)."""
        for line in self.proc.stdout:
            self._tail = (self._tail + [line])[-30:]
            if self.port is None and line.startswith("FORGE_READY port="):
                self.port = int(line.strip().split("=", 1)[1])
                self._ready.set()
        self._ready.set()  # exited

    def wait_ready(self) -> "ProcessServer":
        """Block until the server printed its port (or raise with its last output lines)."""
        if not self._ready.wait(self.timeout_s) or self.port is None:
            self.kill()
            raise RuntimeError(f"server {self.proc.args} did not start:\n{''.join(self._tail)}")
        self.url = f"http://{self.host}:{self.port}"
        return self

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group (simulates a crashed engine)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


class ThreadServer:
    """A server coroutine ``serve(ready)`` running on its own event loop in a daemon thread."""

    def __init__(self, serve, host: str = "127.0.0.1", timeout_s: float = 60.0):
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.port = None
        self._task = None

        def on_ready(port: int) -> None:
            self.port = port
            self._ready.set()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self._task = self.loop.create_task(serve(on_ready))
            try:
                self.loop.run_until_complete(self._task)
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the failure is reported below
                self._ready.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        if not self._ready.wait(timeout_s) or self.port is None:
            raise RuntimeError("in-process server did not start")
        self.url = f"http://{host}:{self.port}"

    def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self.loop.call_soon_threadsafe(self._task.cancel)
        self.thread.join(timeout=10)


def start_engine(model_dir: str, in_process: bool = False, host: str = "127.0.0.1", extra_args: list[str] | None = None):
    """Start a forge-engine serving ``model_dir``; returns a handle with ``.url`` and ``.stop()``."""
    if in_process:
        from forge_megatron.rollout.engine_server import build_parser, engine_from_args, serve

        engine = engine_from_args(build_parser().parse_args(["--model-path", model_dir, *(extra_args or [])]))
        server = ThreadServer(lambda ready: serve(engine, host, 0, ready), host=host)
        server.engine = engine
        return server
    return ProcessServer("forge_megatron.rollout.engine_server", ["--model-path", model_dir, *(extra_args or [])], host)


def start_engines(model_dir: str, n: int, host: str = "127.0.0.1", extra_args: list[str] | None = None):
    """Start ``n`` engine subprocesses in parallel (their start-up overlaps); return the ready handles."""
    servers = [ProcessServer("forge_megatron.rollout.engine_server", ["--model-path", model_dir, *(extra_args or [])],
                             host, wait=False) for _ in range(n)]
    return [s.wait_ready() for s in servers]


def start_gateway(model_dir: str, engine_urls: list[str], in_process: bool = False, host: str = "127.0.0.1",
                  sink=None, extra_args: list[str] | None = None, config: dict | None = None):
    """Start a forge-gateway in front of ``engine_urls``. In-process gateways send episodes to ``sink``
    (default: a ListSink, reachable as ``handle.gateway.sink``) and take GatewayConfig fields in ``config``;
    subprocess gateways use their CLI options."""
    urls = ",".join(engine_urls)
    if in_process:
        from forge_megatron.middleware.gateway import Gateway, GatewayConfig, serve

        gw = Gateway(GatewayConfig(model_path=model_dir, engine_urls=list(engine_urls), host=host, port=0,
                                   return_routed_experts="--return-routed-experts" in (extra_args or []),
                                   resume_aborted="--no-resume-aborted" not in (extra_args or []),
                                   **(config or {})), sink=sink)
        server = ThreadServer(lambda ready: serve(gw, ready), host=host)
        server.gateway = gw
        return server
    return ProcessServer("forge_megatron.middleware.gateway",
                         ["--model-path", model_dir, "--engines", urls, *(extra_args or [])], host)
