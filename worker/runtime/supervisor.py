"""The supervisor: one worker process per device group, restarted when it exits, stopped on SIGTERM.

It never imports torch or touches a GPU: it only starts `python -m worker one --group G --index I`
children (each in its own session, so a terminal's Ctrl+C reaches only the supervisor, which forwards
it once), watches them, and restarts one that exits unexpectedly.

Readiness: each child gets the write end of a pipe (its number in `READY_FD_ENV`) and writes a line on it each
time its readiness changes, the very answer of its own `/readyz` (`worker.runtime.readiness`). With several
groups the supervisor is ready while *every* group's worker is (its `/readyz` 200 means each worker's says 200;
`groups` in its JSON, and `ltx_supervisor_worker_ready{group}`, say which are, for alerts on a partial
loss): a machine whose groups are not all taking jobs is not what it was deployed as, even though the others
still render. A child that exits before its first "ready" line exited *never ready*, however long it ran
(a warm-up can take minutes before it fails): its restart backs off exponentially, `backoff_s` doubling per
never-ready exit in a row up to `backoff_max_s`. A child that
became ready resets the count (its restart after a later exit waits `backoff_s`). From `alarm_after` never-ready
exits in a row the supervisor says so loudly: a critical log line per exit naming the group and the last
exit code, `ltx_supervisor_crash_loop{group}` 1, and its `/readyz` (`worker.ops.supervisor_probe`, when a port
is given) 503 with the reason, until a child of that group is ready. It never gives up on such a worker:
the cause may clear by itself (Redis out of memory or read-only, a GPU held by another process, storage
down), and a supervisor that exited after five quick exits left the service down once Redis had memory
again. A worker whose exit code is permanent
(`worker.runtime.exit_codes.PERMANENT_EXITS`: 2, a configuration error: settings, storage credentials, a missing
GPU) is never restarted: restarting cannot fix it, so the supervisor stops the others and exits 2 at once.
A worker that exits 0 unasked is restarted the same way (Redis pubsub must not be a way to stop the
service).

Signals: the first SIGTERM/SIGINT is forwarded to every child as it came (warm stop: running jobs
finish, then fleets stop; a worker treats both alike, and its log names the signal the operator sent, not
one the supervisor chose); a second one is forwarded again (cold stop: jobs are aborted and re-queued,
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
from typing import Any

from worker.ops.supervisor_probe import SupervisorMetrics, SupervisorProbes
from worker.runtime.exit_codes import EXIT_BAD_CONFIG, PERMANENT_EXITS
from worker.runtime.readiness import READY_FD_ENV, ReadinessPipe

__all__ = ["EXIT_BAD_CONFIG", "READY_FD_ENV", "Supervisor"]

log = logging.getLogger("worker.runtime.supervisor")


@dataclass
class _Child:
    group: str
    index: int
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    ready: bool = False  #: the running process's last report says ready
    ever_ready: bool = False  #: the running process reported ready at least once
    not_ready: str | None = None  #: why not, from its last report
    pipe: ReadinessPipe | None = None  #: the read end of its readiness pipe (closed once it exited)
    never_ready_exits: int = 0  #: exits in a row before the process was ever ready (reset by a ready one)
    restarts: int = 0
    next_start: float = 0.0
    exit_codes: list[int] = field(default_factory=list)
    delays: list[float] = field(default_factory=list)  #: the back-off before each restart

    def status(self, alarm_after: int) -> dict[str, Any]:
        running = self.proc is not None and self.proc.poll() is None
        out: dict[str, Any] = {
            "group": self.group,
            "pid": self.proc.pid if running and self.proc else None,
            "ready": running and self.ready,
            "never_ready_exits": self.never_ready_exits,
            "last_exit_code": self.exit_codes[-1] if self.exit_codes else None,
            "crash_loop": self.never_ready_exits >= alarm_after,
        }
        if out["crash_loop"]:
            out["reason"] = (
                f"group {self.group}: the worker exited {self.never_ready_exits} times in a row before it "
                f"was ever ready (last exit code {out['last_exit_code']}); its log says why"
            )
        elif not out["ready"] and running and self.ever_ready:
            out["reason"] = f"group {self.group}: the worker is not ready: {self.not_ready}"
        elif not out["ready"]:
            out["reason"] = f"group {self.group}: the worker is {'starting' if running else 'restarting'}"
        return out


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
        alarm_after: int = 3,
        kill_after_s: float | None = None,
        poll_s: float = 0.1,
        port: int | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.children = [_Child(group, i) for i, group in enumerate(groups)]
        self.command_for = command_for
        self.env = env
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.alarm_after = max(1, alarm_after)
        self.kill_after_s = kill_after_s
        self.poll_s = poll_s
        self.port, self.host = port, host  #: the probes' port (None: off; 0: any free one, then the one bound)
        self.metrics = SupervisorMetrics()
        for child in self.children:
            self.metrics.worker_ready.labels(child.group).set(0)
            self.metrics.never_ready_exits.labels(child.group).set(0)
            self.metrics.crash_loop.labels(child.group).set(0)
        self.signals_received = 0
        self._cold_at: float | None = None

    # ---- signals -------------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals_received += 1
        mode = "warm" if self.signals_received == 1 else "cold"
        log.warning("supervisor got %s: %s stop of %d worker(s)", signal.Signals(signum).name, mode, len(self.children))
        if self.signals_received >= 2 and self._cold_at is None:
            self._cold_at = time.monotonic()
        self._forward(signal.Signals(signum))

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
        read_fd, write_fd = os.pipe()
        env = {**(os.environ if self.env is None else self.env), READY_FD_ENV: str(write_fd)}
        try:
            child.proc = subprocess.Popen(cmd, env=env, start_new_session=True, pass_fds=(write_fd,))
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)  # (the child holds its copy: EOF here once it exits)
        self._close_pipe(child)
        child.pipe, child.ready, child.ever_ready, child.not_ready = ReadinessPipe(read_fd), False, False, None
        child.started_at = time.monotonic()
        log.info("started worker for group %s (pid %d)", child.group, child.proc.pid)

    def _poll_ready(self, child: _Child) -> None:
        """Take the child's readiness reports; its first "ready" resets its never-ready count."""
        if child.pipe is None:
            return
        for ready, reason in child.pipe.poll():
            if ready and not child.ever_ready:
                self._first_ready(child)
            elif ready != child.ready:
                log.info("worker for group %s is %s", child.group, "ready again" if ready else f"not ready: {reason}")
            child.ready, child.not_ready = ready, reason
            self.metrics.worker_ready.labels(child.group).set(1 if ready else 0)
        if child.pipe.closed:  # (it exited, or is stopping: its pipe closes with it)
            child.pipe, child.ready = None, False
            self.metrics.worker_ready.labels(child.group).set(0)

    def _first_ready(self, child: _Child) -> None:
        child.ever_ready = True
        if child.never_ready_exits >= self.alarm_after:
            log.warning(
                "worker for group %s is ready after %d exits in a row before readiness",
                child.group,
                child.never_ready_exits,
            )
        child.never_ready_exits = 0
        self.metrics.never_ready_exits.labels(child.group).set(0)
        self.metrics.crash_loop.labels(child.group).set(0)
        log.info("worker for group %s (pid %d) is ready", child.group, child.proc.pid if child.proc else -1)

    @staticmethod
    def _close_pipe(child: _Child) -> None:
        if child.pipe is not None:
            child.pipe.close()
            child.pipe = None

    def status(self) -> tuple[bool, str | None, list[dict[str, Any]]]:
        """(every group's worker runs and is ready, why not, each group's status): the probes' answer."""
        groups = [child.status(self.alarm_after) for child in self.children]
        reasons = [g["reason"] for g in groups if "reason" in g]
        return not reasons, "; ".join(reasons) or None, groups

    @property
    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children if c.proc is not None and c.proc.poll() is None]

    def run(self) -> int:
        """Supervise until stopped (exit code 0 if every worker stopped cleanly) or a worker exits with a
        permanent code (the supervisor exits with it)."""
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        code = 0
        probes = None
        if self.port is not None:
            probes = SupervisorProbes(self.metrics, self.status, host=self.host, port=self.port).start()
            self.port = probes.port
            log.info("supervisor probes and metrics on port %d", probes.port)
        try:
            for child in self.children:
                self._start(child)
            while True:
                if self.signals_received:
                    if all(c.proc is None or c.proc.poll() is not None for c in self.children):
                        break
                    if (
                        self._cold_at is not None
                        and self.kill_after_s is not None
                        and time.monotonic() - self._cold_at > self.kill_after_s
                    ):
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
            self._close_pipe(child)
        if probes is not None:
            probes.stop()
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
            self._poll_ready(child)  # (before the exit: a child may say ready and exit in one poll)
            rc = proc.poll()
            if rc is None:
                continue
            self._poll_ready(child)
            lived = now - child.started_at
            child.exit_codes.append(rc)
            child.proc = None
            self._close_pipe(child)
            self.metrics.worker_ready.labels(child.group).set(0)
            if rc in PERMANENT_EXITS:
                log.critical(
                    "worker for group %s exited %d: a configuration error (its log says which); "
                    "restarting cannot fix it: stopping",
                    child.group,
                    rc,
                )
                return rc
            # (an unasked exit 0 too: the workers refuse RQ's pubsub shutdown command, so an older worker or
            # something else told it to; restarted with back-off, or anyone who can PUBLISH could end the service)
            child.never_ready_exits = 0 if child.ever_ready else child.never_ready_exits + 1
            delay = self._backoff(child.never_ready_exits)
            child.restarts += 1
            child.delays.append(delay)
            child.next_start = now + delay
            self.metrics.restarts.labels(child.group).inc()
            self.metrics.never_ready_exits.labels(child.group).set(child.never_ready_exits)
            what = "after it was ready" if child.ever_ready else "before it was ever ready"
            if child.never_ready_exits >= self.alarm_after:
                self.metrics.crash_loop.labels(child.group).set(1)
                log.critical(
                    "worker for group %s exited %d times in a row before it was ever ready (last exit code "
                    "%d, after %.1fs): crash loop; restarting in %.1fs (back-off up to %.0fs); its log "
                    "says why",
                    child.group,
                    child.never_ready_exits,
                    rc,
                    lived,
                    delay,
                    self.backoff_max_s,
                )
                continue
            log.error(
                "worker for group %s exited with code %d after %.1fs, %s; restarting in %.1fs",
                child.group,
                rc,
                lived,
                what,
                delay,
            )
        return 0

    def _backoff(self, exits_in_a_row: int) -> float:
        """The wait before a restart after `exits_in_a_row` never-ready exits (0: it had been ready)."""
        return min(self.backoff_max_s, self.backoff_s * 2 ** min(30, max(0, exits_in_a_row - 1)))


def child_command(group: str, index: int, extra: Sequence[str] = ()) -> list[str]:
    """The command line of one worker process (this interpreter, `-m worker one`)."""
    return [
        sys.executable,
        "-m",
        "worker",
        "one",
        "--group",
        group,
        "--index",
        str(index),
        "--parent-pid",
        str(os.getpid()),
        *extra,
    ]


def child_env(overrides: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(overrides)
    return env
