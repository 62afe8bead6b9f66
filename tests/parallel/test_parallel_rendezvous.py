"""The rendezvous port every single-machine process group starts on (trainer, tests, benchmarks)."""

from __future__ import annotations

import socket

from megaflex.parallel.rendezvous import ephemeral_port_floor, free_port


def test_free_port_is_bindable_and_below_the_ephemeral_range() -> None:
    floor = ephemeral_port_floor()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < floor for p in ports), (sorted(ports), floor)  # never a client socket's port
    assert len(ports) > 1  # drawn at random: concurrent callers rarely collide
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))
