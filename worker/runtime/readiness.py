"""One readiness answer: what a worker process's `/readyz` says, its supervisor says too.

A worker is ready while its fleet is warm, Redis takes its commands and it is not in back-pressure
(`FleetWorker.readiness`, its `/readyz`). The supervisor used to learn one thing only: a byte the worker wrote
once, when its fleet first got warm; it then answered 200 for that group while the worker's `/readyz` said 503
(back-pressure, Redis refusing it, a fleet being rebuilt). Now the worker keeps the pipe it got from the
supervisor (its number in `READY_FD_ENV`) and `ReadinessReporter` writes one line on every change, checked
every `interval_s`: `1` (ready) or `0 <reason>` (not, and why). The supervisor reads the last line
(`ReadinessPipe`) for its `/readyz` and `ltx_supervisor_worker_ready{group}`, so the two answers differ by at
most one check and one supervisor poll. The first `1` of a process is what resets the supervisor's
never-ready count, as the byte did (a bare `1` without a newline, then EOF, still reads as ready).

A line is at most `_MAX_LINE` bytes, under `PIPE_BUF`, so a write is atomic or refused whole; the worker's end
is non-blocking: a supervisor that stopped reading never blocks a worker (a refused line is written again at
the next check). A worker started without a supervisor has no pipe and reports nothing.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

__all__ = ["READY_FD_ENV", "Readiness", "ReadinessPipe", "ReadinessReporter", "report_to_supervisor"]

log = logging.getLogger("worker.runtime.readiness")

#: the child's environment variable naming the pipe it reports its readiness on (not a setting)
READY_FD_ENV = "LTX_SUPERVISOR_READY_FD"
Readiness = tuple[bool, str | None]  #: (ready, why not)
_MAX_LINE = 512  # bytes, newline included: under PIPE_BUF (at least 512 by POSIX), so one write is atomic


def encode(state: Readiness) -> bytes:
    """One line: `1`, or `0 <reason>` (the reason on one line, cut to fit `_MAX_LINE`)."""
    ready, reason = state
    if ready:
        return b"1\n"
    text = " ".join((reason or "not ready").split())
    return b"0 " + text.encode("utf-8", "replace")[: _MAX_LINE - 3] + b"\n"


def decode(line: bytes) -> Readiness:
    """The state a line says (anything but a leading `1` is not ready)."""
    if line.strip() == b"1":
        return True, None
    return False, line[2:].decode("utf-8", "replace").strip() or "not ready"


class ReadinessReporter:
    """The worker's side: a daemon thread writing `probe()` to the supervisor's pipe whenever it changes."""

    def __init__(self, fd: int, probe: Callable[[], Readiness], *, interval_s: float = 0.25) -> None:
        self.fd, self.probe, self.interval_s = fd, probe, interval_s
        self.sent: Readiness | None = None  #: the last state the supervisor took
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ltx-readiness", daemon=True)
        os.set_blocking(fd, False)

    def start(self) -> ReadinessReporter:
        self.check()  # (at once: the first `1` resets the supervisor's back-off)
        self._thread.start()
        return self

    def check(self) -> bool:
        """Write the current state if it changed; False once the supervisor is gone (the pipe is closed)."""
        try:
            state = self.probe()
        except Exception:
            log.debug("readiness probe failed", exc_info=True)
            return True
        if state == self.sent:
            return True
        try:
            os.write(self.fd, encode(state))
        except BlockingIOError:
            return True  # the supervisor is not reading: written again at the next check
        except OSError:
            return False  # EPIPE: the supervisor is gone (the worker's parent watch stops it)
        self.sent = state
        return True

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self.check():
                return


def report_to_supervisor(probe: Callable[[], Readiness]) -> ReadinessReporter | None:
    """In a worker process whose supervisor gave it a pipe: start reporting (once; None without a pipe)."""
    fd = os.environ.pop(READY_FD_ENV, None)
    if fd is None or not fd.isdigit():
        return None
    try:
        return ReadinessReporter(int(fd), probe).start()
    except OSError:
        log.warning("cannot report readiness to the supervisor (pipe %s)", fd, exc_info=True)
        return None


class ReadinessPipe:
    """The supervisor's side of one child's pipe (the read end, non-blocking)."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd
        self._partial = b""
        os.set_blocking(fd, False)

    def poll(self) -> list[Readiness]:
        """Every state the child wrote since the last poll, oldest first; closes the pipe at EOF (the child
        exited or closed it), when a partial last line counts as written."""
        if self.fd is None:
            return []
        data = b""
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                data += b"\n"  # (ends a partial last line; an empty one is skipped)
                self.close()
                break
            data += chunk
        *lines, self._partial = (self._partial + data).split(b"\n")
        return [decode(line) for line in lines if line.strip()]

    @property
    def closed(self) -> bool:
        return self.fd is None

    def close(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None
