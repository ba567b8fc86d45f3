"""Free loopback TCP ports: the one port picker of the repository (stdlib only; imports no torch).

The development servers (`devstack.dev_servers`: Redis, SeaweedFS, `TcpProxy`), the benchmarks and the tests
need several at once; no production module picks ports this way (tests/test_import_contracts.py). The engine's own
rendezvous does not use it: its stores are bound by the parent before any rank starts (port 0), so no
other process can take the port in between.
A picked port was free a moment ago: the kernel chose it, and it is handed out unbound, so another
process can take it before the caller binds (racy, fine for development servers on one machine).
"""

from __future__ import annotations

import socket

__all__ = ["LOOPBACK", "free_port", "free_ports", "port_is_free"]

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """One loopback TCP port that was free a moment ago."""
    return free_ports(1)[0]


def port_is_free(port: int) -> bool:
    """True if `port` can be bound on the loopback interface right now."""
    with socket.socket() as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def free_ports(count: int, *, with_offset: int | None = None) -> list[int]:
    """`count` distinct free ports; with `with_offset`, port+offset must be free as well (weed's admin
    plugin dials admin.port + 10000)."""
    chosen: list[int] = []
    socks: list[socket.socket] = []
    try:
        while len(chosen) < count:
            sock = socket.socket()
            sock.bind((LOOPBACK, 0))
            port = int(sock.getsockname()[1])
            if with_offset is not None and (port + with_offset > 65535 or not port_is_free(port + with_offset)):
                sock.close()
                continue
            socks.append(sock)  # keep it bound so the next pick cannot return the same port
            chosen.append(port)
    finally:
        for sock in socks:
            sock.close()
    return chosen
