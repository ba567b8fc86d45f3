"""The supervisor: one worker process per device group, restarted when it exits, stopped on SIGTERM.

It never imports torch or touches a GPU: it only starts `python -m worker one --group G --index I`
children (each in its own session, so a terminal's Ctrl+C reaches only the supervisor, which forwards
it once), watches them, and restarts one that exits unexpectedly with exponential back-off (`backoff_s`
doubling per exit within `quick_exit_s` of its start, capped at `backoff_max_s`). It never gives up on a
worker that keeps dying young: the cause may clear by itself (Redis out of memory or read-only, a GPU held
by another process, storage down), and a supervisor that exited after five quick exits left the service
down once Redis had memory again. It says so loudly instead (a critical log line at `max_quick_exits`
exits in a row, and again at every multiple). A worker whose exit code is permanent
(`worker.runtime.exitcodes.PERMANENT_EXITS`: 2, a configuration error: settings, storage credentials, a missing
GPU) is never restarted: restarting cannot fix it, so the supervisor stops the others and exits 2 at once.
A worker that exits 0 unasked is restarted the same way (Redis pubsub must not be a way to stop the
service).

Signals: the first SIGTERM/SIGINT is forwarded to every child as SIGTERM (warm stop: running jobs
finish, then fleets stop); a second one is forwarded again (cold stop: jobs are aborted and re-queued,
fleets killed). After both, `kill_after_s` (if set) bounds the wait before SIGKILL.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType

from worker.runtime.exitcodes import EXIT_BAD_CONFIG, PERMANENT_EXITS

__all__ = ["EXIT_BAD_CONFIG", "Supervisor"]

log = logging.getLogger("worker.runtime.supervisor")


@dataclass
class _Child:
    group: str
    index: int
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    quick_exits: int = 0
    clean_exits: int = 0  #: unasked exits with code 0 in a row, each soon after its start (back-off)
    restarts: int = 0
    next_start: float = 0.0
    exit_codes: list[int] = field(default_factory=list)


class Supervisor:
    """Runs and watches one worker process per group; see the module docstring."""

    def __init__(
        self,
        groups: Sequence[str],
        command_for: Callable[[str, int], list[str]],
        *,
        env: dict[str, str] | None = None,
        backoff_s: float = 1.0,
        backoff_max_s: float = 60.0,
        quick_exit_s: float = 60.0,
        max_quick_exits: int = 5,
        kill_after_s: float | None = None,
        poll_s: float = 0.1,
    ) -> None:
        self.children = [_Child(group, i) for i, group in enumerate(groups)]
        self.command_for = command_for
        self.env = env
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.quick_exit_s = quick_exit_s
        self.max_quick_exits = max_quick_exits
        self.kill_after_s = kill_after_s
        self.poll_s = poll_s
        self.signals_received = 0
        self._cold_at: float | None = None

    # ---- signals -------------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals_received += 1
        mode = "warm" if self.signals_received == 1 else "cold"
        log.warning("supervisor got %s: %s stop of %d worker(s)", signal.Signals(signum).name, mode,
                    len(self.children))  # fmt: skip
        if self.signals_received >= 2 and self._cold_at is None:
            self._cold_at = time.monotonic()
        self._forward(signal.SIGTERM)

    def _forward(self, sig: signal.Signals) -> None:
        for child in self.children:
            proc = child.proc
            if proc is not None and proc.poll() is None:
                try:
                    proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    # ---- lifecycle -----------------------------------------------------------------------------------
    def _start(self, child: _Child) -> None:
        cmd = self.command_for(child.group, child.index)
        child.proc = subprocess.Popen(cmd, env=self.env, start_new_session=True)
        child.started_at = time.monotonic()
        log.info("started worker for group %s (pid %d)", child.group, child.proc.pid)

    @property
    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children if c.proc is not None and c.proc.poll() is None]

    def run(self) -> int:
        """Supervise until stopped (exit code 0 if every worker stopped cleanly) or a worker exits with a
        permanent code (the supervisor exits with it)."""
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        code = 0
        try:
            for child in self.children:
                self._start(child)
            while True:
                if self.signals_received:
                    if all(c.proc is None or c.proc.poll() is not None for c in self.children):
                        break
                    if (self._cold_at is not None and self.kill_after_s is not None
                            and time.monotonic() - self._cold_at > self.kill_after_s):  # fmt: skip
                        log.error("workers still running %.0fs after a cold stop: SIGKILL", self.kill_after_s)
                        self._forward(signal.SIGKILL)
                        self._cold_at = None
                    time.sleep(self.poll_s)
                    continue
                fatal = self._check_children()
                if fatal:
                    code = fatal
                    self.signals_received = 2  # treat as a cold stop of the others
                    self._cold_at = time.monotonic()
                    self._forward(signal.SIGTERM)
                    time.sleep(0.2)
                    self._forward(signal.SIGTERM)
                    continue
                time.sleep(self.poll_s)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
        for child in self.children:
            if child.proc is not None:
                rc = child.proc.wait()
                if rc not in (0, None) and code == 0 and self.signals_received:
                    log.warning("worker for group %s exited with %d on stop", child.group, rc)
        return code

    def _check_children(self) -> int:
        """Restart exited workers (with back-off). Returns the supervisor's exit code when one must not be
        restarted (a permanent exit code: `EXIT_BAD_CONFIG`), else 0."""
        now = time.monotonic()
        for child in self.children:
            proc = child.proc
            if proc is None:
                if now >= child.next_start:
                    self._start(child)
                continue
            rc = proc.poll()
            if rc is None:
                continue
            lived = now - child.started_at
            child.exit_codes.append(rc)
            child.proc = None
            if rc in PERMANENT_EXITS:
                log.critical("worker for group %s exited %d: a configuration error (its log says which); "
                             "restarting cannot fix it: stopping", child.group, rc)  # fmt: skip
                return rc
            if rc == 0:
                # A clean exit nobody asked for (the workers refuse RQ's pubsub shutdown command, so an older
                # worker or something else told it to): restarted with back-off, never a crash loop, or anyone
                # who can PUBLISH on Redis could end the service.
                child.clean_exits = child.clean_exits + 1 if lived < self.quick_exit_s else 0
                delay = self._backoff(child.clean_exits)
                child.restarts += 1
                child.next_start = now + delay
                log.warning("worker for group %s exited 0 unasked after %.1fs; restarting in %.1fs",
                            child.group, lived, delay)  # fmt: skip
                continue
            child.quick_exits = child.quick_exits + 1 if lived < self.quick_exit_s else 0
            delay = self._backoff(child.quick_exits)
            child.restarts += 1
            child.next_start = now + delay
            if child.quick_exits and child.quick_exits % self.max_quick_exits == 0:
                log.critical("worker for group %s exited %d times in a row within %.0fs of starting (last code "
                             "%d): still restarting, every %.0fs at most; its log says why", child.group,
                             child.quick_exits, self.quick_exit_s, rc, self.backoff_max_s)  # fmt: skip
                continue
            log.error("worker for group %s exited with code %d after %.1fs; restarting in %.1fs",
                      child.group, rc, lived, delay)  # fmt: skip
        return 0

    def _backoff(self, exits_in_a_row: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2 ** min(30, max(0, exits_in_a_row - 1)))


def child_command(group: str, index: int, extra: Sequence[str] = ()) -> list[str]:
    """The command line of one worker process (this interpreter, `-m worker one`)."""
    return [sys.executable, "-m", "worker", "one", "--group", group, "--index", str(index),
            "--parent-pid", str(os.getpid()), *extra]  # fmt: skip


def child_env(overrides: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(overrides)
    return env
