"""`TcpProxy`: a loopback TCP forwarder that can refuse connections on demand or behave like a remote link.

Used in front of the development servers (`devstack.dev_servers`): tests make S3 or Redis "unreachable" for a
while without restarting the (slow to start) server, and benchmarks make a local bucket remote-like
(capped bandwidth, added latency). Threads only; stopped with `block()`.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from devstack.dev_servers import LOOPBACK, free_port

__all__ = ["TcpProxy"]


class TcpProxy:
    """Forwards 127.0.0.1:`port` to a target; `block()` makes the port refuse connections (and cuts open
    ones) until `unblock()`. Used to make a server unreachable without stopping it. `drop_replies(n, after)`:
    the next `n` replies the target sends (to a request containing the bytes `after`, if given) are not
    passed on; their connections are cut instead (the target did the work, the client never hears of it:
    what a server stopped right after a write looks like).

    Remote-like storage (benchmarks): `rate_bytes_per_s` caps the client→target bandwidth, shared by all
    connections (a token schedule: each chunk waits for its slot), and `latency_s` delays every new
    connection and every chunk sent back to the client by that much (a round trip to a distant region)."""

    def __init__(
        self,
        target_port: int,
        *,
        target_host: str = LOOPBACK,
        port: int | None = None,
        rate_bytes_per_s: float | None = None,
        latency_s: float = 0.0,
    ) -> None:
        self.target = (target_host, target_port)
        self.rate = rate_bytes_per_s
        self.latency_s = latency_s
        self._next_slot = 0.0
        self.port = port or free_port()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._accept_thread: threading.Thread | None = None
        self.connections_refused = 0
        self._replies_to_drop = 0
        self._drop_after: bytes | None = None
        self._drop_containing: bytes | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def blocked(self) -> bool:
        return self._listener is None

    def start(self) -> TcpProxy:
        self.unblock()
        return self

    def unblock(self) -> None:
        with self._lock:
            if self._listener is not None:
                return
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((LOOPBACK, self.port))
            sock.listen(64)
            self._listener = sock
        self._accept_thread = threading.Thread(target=self._accept_loop, args=(sock,), daemon=True)
        self._accept_thread.start()

    def block(self) -> None:
        """Close the listening socket (new connections are refused) and every open connection."""
        with self._lock:
            sock, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5)

    stop = block

    def drop_replies(self, count: int = 1, *, after: bytes | None = None, containing: bytes | None = None) -> None:
        """Cut the connection of each of the next `count` replies from the target instead of passing it on
        (only replies to a request that contained `after`, when given: e.g. b"EXEC"; only replies that
        contain `containing`, when given: e.g. the id a BLPOP returns, not its empty time-outs)."""
        with self._lock:
            self._replies_to_drop += count
            self._drop_after = after
            self._drop_containing = containing

    @property
    def pending_drops(self) -> int:
        """Replies `drop_replies` asked for that have not been dropped yet."""
        with self._lock:
            return self._replies_to_drop

    def _take_drop(self, state: dict[str, bool], reply: bytes) -> bool:
        with self._lock:
            if self._replies_to_drop <= 0 or (self._drop_after is not None and not state.get("marked")):
                return False
            if self._drop_containing is not None and self._drop_containing not in reply:
                return False
            self._replies_to_drop -= 1
            return True

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                if self.latency_s:
                    time.sleep(self.latency_s)
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self._conns.update((client, upstream))
            state: dict[str, bool] = {}  # (shared by the two directions of this connection)
            for src, dst, up in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pipe, args=(src, dst, up, state), daemon=True).start()

    def _throttle(self, nbytes: int) -> None:
        assert self.rate
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_slot)
            self._next_slot = start + nbytes / self.rate
            until = self._next_slot
        delay = until - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def _pipe(self, src: socket.socket, dst: socket.socket, upstream: bool = True,
              state: dict[str, bool] | None = None) -> None:  # fmt: skip
        state = {} if state is None else state
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if upstream and self._replies_to_drop:
                    state["marked"] = self._drop_after is None or self._drop_after in data
                if upstream and self.rate:
                    self._throttle(len(data))
                elif not upstream and self.latency_s:
                    time.sleep(self.latency_s)
                if not upstream and self._replies_to_drop and self._take_drop(state, data):
                    break  # (the finally below cuts both sides)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)
            src.close()
