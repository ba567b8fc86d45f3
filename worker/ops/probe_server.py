"""A small HTTP/1.0 GET server on one thread, bounded in connections and time (the metrics and health port).

Why: anyone who reaches the port can open connections, and the port shares the worker process with its RQ
loop and its stop. A server with a thread per connection (`http.server.ThreadingHTTPServer`), no cap and no
timeout lets half-open connections from one client pile up runnable threads until `/healthz` times out, the
worker's RQ registration expires, queued jobs wait and a SIGTERM is slow to act. This server costs one thread
whatever the clients do:

- one selector loop reads every connection without blocking; a request is answered once its head (up to
  `_MAX_HEAD` bytes) has arrived, so a client that sends nothing or a byte at a time costs a socket and a
  buffer, never a thread, and a fresh probe is answered as soon as its request is in;
- each connection has a deadline (`timeout_s` from accept to the end of the reply; slow readers included),
  after which it is closed;
- at most `max_connections` are open: a new one pushes out the oldest (the slowest), so whoever floods the
  port cannot keep a fresh probe out;
- replies are computed on the loop thread (a health snapshot and the Prometheus exposition take
  milliseconds and touch no network) and written without blocking; every reply closes its connection.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["ProbeServer", "Reply"]

log = logging.getLogger("worker.probes")

Reply = tuple[int, bytes, str]  #: status, body, content type
_MAX_HEAD = 8192
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Head Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    deadline: float
    head: bytearray = field(default_factory=bytearray)
    out: bytes | None = None


class ProbeServer:
    """`route(path) -> Reply` for GET requests; see the module docstring."""

    def __init__(
        self,
        route: Callable[[str], Reply],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_connections: int = 256,
        timeout_s: float = 5.0,
    ) -> None:
        self.route = route
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.listener = socket.create_server((host, port), backlog=1024, reuse_port=False)
        self.listener.setblocking(False)
        _host, port_bound = self.listener.getsockname()[:2]  # (port 0: the kernel chose; we keep listening)
        self.port = int(port_bound)
        self.served = 0
        self.evicted = 0
        self.expired = 0
        self._conns: dict[socket.socket, _Conn] = {}  # (insertion order: oldest first)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.listener, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ltx-probes", daemon=True)

    def start(self) -> ProbeServer:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        for conn in list(self._conns.values()):
            self._close(conn)
        with contextlib.suppress(Exception):
            self._sel.unregister(self.listener)
        self.listener.close()
        self._sel.close()

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    # ---- the loop --------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                events = self._sel.select(timeout=0.2)
            except OSError:
                continue
            # connections first: a request that arrived is answered before a flood of new ones evicts it
            events.sort(key=lambda event: event[0].fileobj is self.listener)
            for key, mask in events:
                if key.fileobj is self.listener:
                    self._accept()
                    continue
                conn = self._conns.get(key.fileobj)  # type: ignore[call-overload]
                if conn is None:
                    continue
                try:
                    if mask & selectors.EVENT_READ:
                        self._read(conn)
                    elif mask & selectors.EVENT_WRITE:
                        self._write(conn)
                except OSError:
                    self._close(conn)
            now = time.monotonic()
            for conn in [c for c in self._conns.values() if c.deadline < now]:
                self.expired += 1
                self._close(conn)

    def _accept(self) -> None:
        for _ in range(256):  # a bounded batch per turn, so expiry and replies keep running in a flood
            try:
                sock, _addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # (out of descriptors: the oldest connections make room)
                self._evict_oldest()
                return
            while len(self._conns) >= self.max_connections:
                self._evict_oldest()
            sock.setblocking(False)
            conn = _Conn(sock, time.monotonic() + self.timeout_s)
            self._conns[sock] = conn
            self._sel.register(sock, selectors.EVENT_READ)
            try:
                self._read(conn)  # a probe's request is usually in already: answered before any eviction
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._close(conn)

    def _evict_oldest(self) -> None:
        oldest = next(iter(self._conns.values()), None)
        if oldest is not None:
            self.evicted += 1
            self._close(oldest)

    def _read(self, conn: _Conn) -> None:
        data = conn.sock.recv(4096)
        if not data:
            self._close(conn)
            return
        conn.head += data
        end = conn.head.find(b"\r\n\r\n")
        if end < 0:
            end = conn.head.find(b"\n\n")
        if end < 0:
            if len(conn.head) > _MAX_HEAD:
                self._respond(conn, (431, b"request head too large\n", "text/plain"))
            return
        self._respond(conn, self._dispatch(bytes(conn.head[:end])))

    def _dispatch(self, head: bytes) -> Reply:
        parts = head.split(b"\n", 1)[0].split()
        if len(parts) < 2:
            return 400, b"bad request\n", "text/plain"
        if parts[0] != b"GET":
            return 405, b"GET only\n", "text/plain"
        path = parts[1].decode("latin-1").split("?", 1)[0]
        try:
            return self.route(path)
        except Exception:
            log.warning("probe handler for %s failed", path[:100], exc_info=True)
            return 500, b"internal error\n", "text/plain"

    def _respond(self, conn: _Conn, reply: Reply) -> None:
        status, body, ctype = reply
        head = (
            f"HTTP/1.0 {status} {_REASONS.get(status, 'Status')}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        conn.out = head.encode("latin-1") + body
        self.served += 1
        self._sel.modify(conn.sock, selectors.EVENT_WRITE)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        assert conn.out is not None
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        conn.out = conn.out[sent:]
        if not conn.out:
            self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        with contextlib.suppress(Exception):
            self._sel.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()
