"""The port for a server behind the proxy (and every test's server) is chosen below the ephemeral
range: a port the system hands out for bind(0) can be taken as an outgoing connection's source
port before the server binds it, and the start then fails with 'address already in use'."""
from __future__ import annotations

import random
import socket

from app.server import targets


def test_the_port_is_below_the_ephemeral_range_and_free():
    low, high = targets.ephemeral_ports()
    assert 1024 < low < high
    for _ in range(20):
        port = targets.free_loopback_port()
        assert targets.LISTEN_PORTS_FROM <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # nothing holds it


def test_a_port_something_listens_on_is_passed_over(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(targets, "LISTEN_PORTS_FROM", 1025)
        monkeypatch.setattr(targets, "ephemeral_ports", lambda: (65000, 65535))
        monkeypatch.setattr(random, "sample", lambda population, k: [busy, busy + 1 if busy < 64999 else busy - 1])
        assert targets.free_loopback_port() != busy


def test_without_room_below_the_ephemeral_range_the_system_picks(monkeypatch):
    monkeypatch.setattr(targets, "ephemeral_ports", lambda: (targets.LISTEN_PORTS_FROM + 10, 60999))
    port = targets.free_loopback_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
