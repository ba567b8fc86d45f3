"""The metrics and health port under a flood of slow clients, against a real `ltx-worker one` (real Redis
and S3): thousands of loopback connections that send nothing or a request head one byte at a time, kept
open (re-opened when the worker drops them) for a bounded time. The worker's thread count stays flat,
a fresh `/healthz` answers within a bound, a job renders, and SIGTERM stops the worker promptly. (With a
thread per connection, 12-16k such connections froze a worker for minutes.)
"""

from __future__ import annotations

import contextlib
import http.client
import selectors
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ltx_mgpu.os_limits import raise_open_files_limit
from tests.support.fleet import running_worker
from tests.support.workers import enqueue, wait_state

pytestmark = pytest.mark.timeout(240)

FLOOD = 2000
HEAD = b"GET /metrics HTTP/1.1\r\nHost: x\r\nUser-Agent: slow\r\n\r\n"


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


class Flood:
    """`FLOOD` loopback connections to `port`: most send nothing, every tenth trickles `HEAD` a byte per
    turn; a connection the server closes is re-opened, until `stop()`."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sel = selectors.DefaultSelector()
        self.sent: dict[socket.socket, int] = {}
        self.opened = 0
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _open(self, slow: bool) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", self.port))
        self.sent[sock] = 0 if slow else -1
        self.sel.register(sock, selectors.EVENT_READ)
        self.opened += 1

    def _run(self) -> None:
        # The flood's sockets are this process's files: an ordinary user's soft limit is often 1,024. Raised as
        # the worker raises its own (`ltx_mgpu.os_limits`); where the hard limit is lower, a smaller flood.
        soft = raise_open_files_limit()
        for i in range(FLOOD if soft is None else min(FLOOD, soft - 256)):
            self._open(slow=i % 10 == 0)
        while not self._stop.is_set():
            for key, _ in self.sel.select(timeout=0.1):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    gone = sock.recv(65536) == b""
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone:
                    slow = self.sent.pop(sock) >= 0
                    self.sel.unregister(sock)
                    sock.close()
                    self.dropped += 1
                    self._open(slow)
            for sock, n in list(self.sent.items()):
                if 0 <= n < len(HEAD) - 1:  # never the last byte: the head stays incomplete
                    with contextlib.suppress(OSError):
                        sock.send(HEAD[n : n + 1])
                        self.sent[sock] = n + 1

    def start(self) -> Flood:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for sock in list(self.sent):
            sock.close()
        self.sel.close()


def _probe(port: int, within_s: float) -> float:
    """Seconds until `/healthz` answers 200, asking again (as a health checker does) when the connection is closed
    before the answer: the server evicts its oldest connection for each new one past its cap, so a probe accepted
    in a burst of 256 flood connections whose request had not arrived yet may be the one pushed out. Starvation is
    no answer for seconds, not one reset."""
    t0 = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=within_s) as resp:
                assert resp.status == 200
                return time.monotonic() - t0
        except (ConnectionError, http.client.RemoteDisconnected, urllib.error.URLError):
            if time.monotonic() - t0 > within_s:
                raise


def test_slow_clients_on_the_metrics_port_never_starve_the_worker(tmp_path, redis_server, s3_server):
    with running_worker(tmp_path, redis_server, s3_server) as w:
        pid, port = w.proc.pid, w.health()["metrics_port"]
        baseline = _threads(pid)
        flood = Flood(port).start()
        try:
            peak, probes = baseline, []
            deadline = time.monotonic() + 12  # longer than the server's 5 s per-connection deadline
            job = enqueue(w.conn, w.queue, {"prompt": "under a flood", "width": 64, "height": 64, "num_frames": 9})
            while time.monotonic() < deadline:
                peak = max(peak, _threads(pid))
                probes.append(_probe(port, within_s=5.0))
                time.sleep(0.5)
            assert wait_state(job, {"uploaded", "failed"}, 60, w.proc) == "uploaded", job.get_meta()
            peak = max(peak, _threads(pid))
            assert peak <= baseline + 8, (baseline, peak)  # a render's threads come and go; no thread per client
            assert flood.opened >= FLOOD and flood.dropped > 0, (flood.opened, flood.dropped)  # deadlines, cap
            assert max(probes) < 3, probes
            t0 = time.monotonic()
            w.proc.signal(signal.SIGTERM)
            assert w.proc.wait(30) == 0
            assert time.monotonic() - t0 < 20
        finally:
            flood.stop()


def test_the_probe_server_caps_connections_and_expires_slow_ones() -> None:
    from worker.ops.probe_server import ProbeServer

    server = ProbeServer(lambda path: (200, path.encode(), "text/plain"), max_connections=50, timeout_s=1.0).start()
    socks: list[Any] = []
    try:
        for _ in range(200):
            socks.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        reply = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=3).read()
        assert reply == b"/healthz"
        time.sleep(0.3)
        assert server.open_connections <= 50 and server.evicted >= 150
        time.sleep(1.5)
        assert server.open_connections == 0 and server.expired > 0  # past the deadline: closed
        assert threading.active_count() < 20
    finally:
        for sock in socks:
            sock.close()
        server.stop()
