"""ZeroMQ request/reply between the data pool and its clients (trainer, remote gateways).

Pattern: the server binds a ROUTER socket; each client uses a DEALER and tags every request with a request id
(``rid``). A client that gets no reply within its timeout closes its socket, opens a fresh one and resends the
same request with the same rid ("lazy pirate"), so either side may restart at any time. Replies with another rid
are stale and dropped. Resends are harmless: the pool deduplicates ``get_batch`` and ``register_group`` by rid and
episodes by episode id, so a batch whose reply was lost comes back identical on the resend (even across a pool
restart: the rid is stored in the database).

``get_batch`` with a timeout does not block the server: waiting requests are parked and retried every
``poll_interval_s`` until a batch is ready or their deadline passes (then the reply is ``None``).

Messages follow :mod:`forge_megatron.middleware.wire` (msgpack header + raw array frames, never pickle). Every
request is checked (size, version, schema); a bad one gets ``{"ok": False, "error": ...}`` and the server keeps
serving. Optional CURVE encryption + client authentication: pass the server keypair and the allowed client public
keys (``zmq.curve_keypair()`` makes them).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from forge_megatron.middleware.batch import TrainBatch
from forge_megatron.middleware.pool import DataPool
from forge_megatron.middleware.schema import Episode, EpisodeSink, SchemaError
from forge_megatron.middleware.wire import (
    WireError, batch_from_wire, batch_to_wire, episode_from_wire, episode_to_wire, field, pack, unpack,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 30


class PoolError(RuntimeError):
    """The pool answered a request with an error (the message is the pool's)."""


@dataclass(frozen=True)
class CurveKeys:
    """CURVE keys (z85 bytes from ``zmq.curve_keypair()``).

    Server: ``public``/``secret`` its own pair, ``allowed_clients`` the client public keys it accepts.
    Client: ``public``/``secret`` its own pair, ``server_public`` the server's public key.
    """

    public: bytes
    secret: bytes
    server_public: bytes | None = None
    allowed_clients: tuple[bytes, ...] = ()


def _reply(rid: Any, result: Any = None, arrays: list = ()) -> list:
    return pack({"rid": rid, "ok": True, "result": result}, arrays)


def _error(rid: Any, message: str) -> list:
    return pack({"rid": rid, "ok": False, "error": message})


class _AllowedKeys:
    """ZAP credentials provider: accepts the configured client public keys only."""

    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self.keys = set(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return zmq.utils.z85.encode(key) in self.keys or key in self.keys


class PoolServer:
    """Serves one :class:`DataPool` on a ROUTER socket; ``start()`` runs it in a thread, ``serve()`` in this one."""

    def __init__(self, pool: DataPool, bind: str = "tcp://127.0.0.1:5555", curve_keys: CurveKeys | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, poll_interval_s: float = 0.01) -> None:
        if max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {max_message_bytes}")
        if curve_keys is not None and not curve_keys.allowed_clients:
            raise ValueError("server CurveKeys need allowed_clients (the client public keys to accept)")
        self.pool = pool
        self.bind = bind
        self.curve_keys = curve_keys
        self.max_message_bytes = max_message_bytes
        self.poll_interval_s = poll_interval_s
        self.address: str | None = None  # the bound endpoint (resolves tcp://127.0.0.1:0 to the real port)
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._bind_error: zmq.ZMQError | None = None
        self._thread: threading.Thread | None = None
        # rid -> (client identity, num_groups, arrival, deadline) of parked get_batch requests
        self._waiters: dict[str, tuple[bytes, int, float, float]] = {}
        self._ops: dict[str, Callable] = {
            "ping": lambda h, a: {"pool": "forge"},
            "metrics": lambda h, a: self.pool.metrics(),
            "can_admit": lambda h, a: self.pool.can_admit(),
            "set_policy_version": lambda h, a: self.pool.set_policy_version(field(h, "version", int)),
            "requeue_uncommitted": lambda h, a: self.pool.requeue_uncommitted(),
            "commit": self._commit,
            "register_group": self._register_group,
            "episode_started": lambda h, a: self.pool.episode_started(field(h, "group_id", str),
                                                                      field(h, "episode_id", str)),
            "submit_episode": lambda h, a: self.pool.submit_episode(episode_from_wire(field(h, "episode", dict), a)),
            "group_status": lambda h, a: self.pool.group_status(field(h, "group_id", str)),
        }

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "PoolServer":
        self._thread = threading.Thread(target=self.serve, name="forge-pool-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout=30):
            raise RuntimeError(f"pool server did not bind {self.bind} within 30 s")
        if self._bind_error is not None:
            self._ctx.term()
            raise RuntimeError(f"pool server cannot bind {self.bind}: {self._bind_error}")
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._ctx.term()

    def _socket(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.max_message_bytes)  # hard memory guard; the app check replies
        if self.curve_keys is not None:
            sock.curve_server = True
            sock.curve_publickey = self.curve_keys.public
            sock.curve_secretkey = self.curve_keys.secret
        try:
            sock.bind(self.bind)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return sock

    def serve(self) -> None:
        auth = self._start_auth()
        try:
            sock = self._socket()
        except zmq.ZMQError as exc:
            self._bind_error = exc
            if auth is not None:
                auth.stop()
            return
        finally:
            self._ready.set()
        try:
            while not self._stop.is_set():
                if sock.poll(int(self.poll_interval_s * 1000)):
                    frames = sock.recv_multipart(copy=False)
                    self._send(sock, frames[0].bytes, self._handle(frames[0].bytes, frames[1:]))
                self._serve_waiters(sock)
        finally:
            sock.close(linger=0)
            if auth is not None:
                auth.stop()

    def _start_auth(self):
        if self.curve_keys is None:
            return None
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(self._ctx)
        auth.start()
        auth.configure_curve_callback("*", credentials_provider=_AllowedKeys(self.curve_keys.allowed_clients))
        return auth

    @staticmethod
    def _send(sock: zmq.Socket, identity: bytes, reply: list | None) -> None:
        if reply is not None:
            sock.send_multipart([identity] + reply, copy=False)

    # ------------------------------------------------------------------ requests
    def _handle(self, identity: bytes, frames: list) -> list | None:
        rid = None
        try:
            header, arrays = unpack([f.buffer for f in frames], self.max_message_bytes)
            rid = header.get("rid")
            if not isinstance(rid, str) or not rid:
                raise WireError("request field 'rid' must be a non-empty string")
            op = field(header, "op", str)
            if op == "get_batch":
                return self._get_batch(identity, rid, header)
            if op not in self._ops:
                raise WireError(f"unknown op {op!r} (known: {sorted(self._ops) + ['get_batch']})")
            return _reply(rid, self._ops[op](header, arrays))
        except (WireError, SchemaError, ValueError) as exc:
            return _error(rid, str(exc))
        except Exception as exc:  # keep serving; the client sees the failure
            log.exception("pool request failed")
            return _error(rid, f"internal error: {type(exc).__name__}: {exc}")

    def _commit(self, header: dict, arrays: list) -> int:
        if "up_to_batch_id" in header:
            return self.pool.commit(up_to_batch_id=field(header, "up_to_batch_id", int))
        ids = field(header, "batch_ids", list)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise WireError("request field 'batch_ids' must be a list of ints")
        return self.pool.commit(ids)

    def _register_group(self, header: dict, arrays: list) -> str:
        metadata = header.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise WireError("request field 'metadata' must be a map")
        return self.pool.register_group(field(header, "task_id", str), field(header, "size", int),
                                        field(header, "domain", str), metadata, request_id=header["rid"])

    def _get_batch(self, identity: bytes, rid: str, header: dict) -> list | None:
        num_groups = field(header, "num_groups", int)
        timeout_s = field(header, "timeout_s", (int, float))
        batch = self.pool.next_batch(num_groups, timeout_s=0, request_id=rid)
        if batch is not None or timeout_s <= 0:
            return self._batch_reply(rid, batch)
        now = time.monotonic()
        self._waiters[rid] = (identity, num_groups, now, now + timeout_s)
        return None

    def _serve_waiters(self, sock: zmq.Socket) -> None:
        for rid, (identity, num_groups, arrival, deadline) in list(self._waiters.items()):
            batch = self.pool.next_batch(num_groups, timeout_s=0, request_id=rid, waited_s=time.monotonic() - arrival)
            if batch is not None or time.monotonic() >= deadline:
                del self._waiters[rid]
                self._send(sock, identity, self._batch_reply(rid, batch))

    @staticmethod
    def _batch_reply(rid: str, batch: TrainBatch | None) -> list:
        if batch is None:
            return _reply(rid, None)
        meta, arrays = batch_to_wire(batch)
        return _reply(rid, meta, arrays)


class PoolClient(EpisodeSink):
    """Client of a :class:`PoolServer`; resends on timeout with a fresh socket so pool restarts are survived.

    Each request waits ``timeout_s`` (plus the requested wait for ``get_batch``) per attempt, ``retries`` resends,
    then raises TimeoutError. Also an :class:`EpisodeSink`, so a gateway in another process can feed the pool.
    Like its ZeroMQ socket, a client belongs to one thread at a time.
    """

    def __init__(self, addr: str, timeout_s: float = 10.0, retries: int = 3, curve_keys: CurveKeys | None = None,
                 max_message_bytes: int = 4 * DEFAULT_MAX_MESSAGE_BYTES) -> None:
        if curve_keys is not None and curve_keys.server_public is None:
            raise ValueError("client CurveKeys need server_public (the pool server's public key)")
        self.addr = addr
        self.timeout_s = timeout_s
        self.retries = retries
        self.curve_keys = curve_keys
        self.max_message_bytes = max_message_bytes
        # the process's one context (ZeroMQ's advice), never terminated here: a client's own context, dropped
        # with the client, could be garbage-collected in a reference cycle after the weak reference to its socket
        # was cleared, and its termination then waits forever for that socket (seen: a forge-engine thread stuck
        # in zmq_ctx_term inside a forward, where the collector happened to run)
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if self.curve_keys is not None:
                sock.curve_publickey = self.curve_keys.public
                sock.curve_secretkey = self.curve_keys.secret
                sock.curve_serverkey = self.curve_keys.server_public
            sock.connect(self.addr)
            self._sock = sock
        return self._sock

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def call(self, op: str, args: dict | None = None, arrays: list = (), wait_s: float = 0.0) -> tuple[Any, list]:
        """Send one request (resending on timeout) and return (result, arrays) of its reply."""
        rid = uuid.uuid4().hex
        frames = pack(dict(args or {}, op=op, rid=rid), arrays)
        for _attempt in range(self.retries + 1):
            sock = self._socket()
            sock.send_multipart(frames, copy=False)
            reply = self._await(sock, rid, time.monotonic() + self.timeout_s + wait_s)
            if reply is not None:
                return reply
            self._reset()
        raise TimeoutError(f"pool at {self.addr} did not answer {op!r} after {self.retries + 1} attempts "
                           f"of {self.timeout_s + wait_s:.1f} s")

    def _await(self, sock: zmq.Socket, rid: str, deadline: float) -> tuple[Any, list] | None:
        while (remaining := deadline - time.monotonic()) > 0:
            if not sock.poll(max(1, int(remaining * 1000))):
                return None
            header, arrays = unpack([f.buffer for f in sock.recv_multipart(copy=False)], self.max_message_bytes)
            if header.get("rid") not in (rid, None):
                continue  # a stale reply to an earlier attempt
            if not header.get("ok"):
                raise PoolError(f"pool rejected {rid}: {header.get('error')}")
            return header.get("result"), arrays
        return None

    # ------------------------------------------------------------------ trainer side
    def get_batch(self, num_groups: int, timeout_s: float = 60.0) -> TrainBatch | None:
        meta, arrays = self.call("get_batch", {"num_groups": num_groups, "timeout_s": timeout_s}, wait_s=timeout_s)
        return None if meta is None else batch_from_wire(meta, arrays)

    def commit(self, batch_ids: int | list[int] | None = None, *, up_to_batch_id: int | None = None) -> int:
        if up_to_batch_id is not None:
            return self.call("commit", {"up_to_batch_id": up_to_batch_id})[0]
        ids = [batch_ids] if isinstance(batch_ids, int) else list(batch_ids or [])
        return self.call("commit", {"batch_ids": ids})[0]

    def requeue_uncommitted(self) -> list[int]:
        return self.call("requeue_uncommitted")[0]

    def metrics(self) -> dict:
        return self.call("metrics")[0]

    def set_policy_version(self, version: int) -> None:
        self.call("set_policy_version", {"version": version})

    def can_admit(self) -> bool:
        return self.call("can_admit")[0]

    def ping(self) -> dict:
        return self.call("ping")[0]

    # ------------------------------------------------------------------ EpisodeSink (remote gateway)
    def register_group(self, task_id: str, size: int, domain: str = "default", metadata: dict | None = None) -> str:
        return self.call("register_group", {"task_id": task_id, "size": size, "domain": domain,
                                            "metadata": metadata or {}})[0]

    def episode_started(self, group_id: str, episode_id: str) -> None:
        self.call("episode_started", {"group_id": group_id, "episode_id": episode_id})

    def submit_episode(self, episode: Episode) -> str:
        meta, arrays = episode_to_wire(episode)
        return self.call("submit_episode", {"episode": meta}, arrays)[0]

    def group_status(self, group_id: str) -> dict:
        return self.call("group_status", {"group_id": group_id})[0]

    def close(self) -> None:
        self._reset()
