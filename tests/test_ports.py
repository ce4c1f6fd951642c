"""free_port draws below the kernel's ephemeral range (where port-0 binds and outgoing connections never land)."""

import socket

from forge_megatron.utils import ports


def test_ports_come_from_below_the_ephemeral_range_and_bind():
    low = ports._ephemeral_low()
    picked = {ports.free_port() for _ in range(20)}
    if low is not None and low - ports._SPAN >= 1024:
        assert all(low - ports._SPAN <= p < low for p in picked)
        assert len(picked) > 1  # drawn at random, not one fixed port
    for p in picked:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_taken_port_is_not_handed_out(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: taken + 1)
        monkeypatch.setattr(ports, "_SPAN", 2)  # candidates: taken - 1 and taken
        got = {ports.free_port(attempts=16) for _ in range(8)}
        assert taken not in got


def test_without_room_below_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 2000)
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
