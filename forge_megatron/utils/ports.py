"""A TCP port to listen on later (torch.distributed stores, ZeroMQ binds, servers started by another process).

Asking the kernel for port 0 and closing the socket hands back a port from the ephemeral range, the same range
the kernel draws from for every other port-0 bind and for the local end of every outgoing connection: on a busy
machine (a test run with engines, gateways and pools talking over loopback) another socket can take it before
the process that was given it binds, and a torch.distributed store then fails with EADDRINUSE. Ports just below
the ephemeral range are never handed out by the kernel, so picking one at random there and checking that it binds
leaves only the (small) chance that another process picks the same number in the same instant.
"""

from __future__ import annotations

import random
import socket

_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_SPAN = 12000  # how many ports below the ephemeral range to draw from


def _ephemeral_low() -> int | None:
    try:
        with open(_EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _binds(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", attempts: int = 64) -> int:
    """A port on ``host`` that was free a moment ago, drawn below the kernel's ephemeral range (Linux); elsewhere,
    or when that range starts too low to leave room, one the kernel hands out."""
    low = _ephemeral_low()
    if low is not None and low - _SPAN >= 1024:
        rng = random.SystemRandom()
        for _ in range(attempts):
            port = rng.randrange(low - _SPAN, low)
            if _binds(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
