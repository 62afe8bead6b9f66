"""A rendezvous port (MASTER_PORT) for process groups started on one machine."""

from __future__ import annotations

import random
import socket


def ephemeral_port_floor() -> int:
    """The lowest port the kernel hands to client sockets (Linux's default when unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A currently free TCP port on localhost, *below* the kernel's ephemeral range.

    A port from ``bind(0)`` is ephemeral: between closing it here and the rendezvous binding it,
    a client socket of another job (gloo opens many) can take it, and the start fails with
    EADDRINUSE (seen in CI with two test workers). Ports below the range are never handed to client
    sockets; the draw is random (urandom-seeded) so concurrent callers rarely pick the same one."""
    floor = ephemeral_port_floor()
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.randrange(max(1024, floor - 12_000), floor)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # nothing free below the range
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
