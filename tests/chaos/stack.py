"""The real service under test: Redis (AOF, fsync always), SeaweedFS behind a `TcpProxy`, and one
`ltx-worker` supervisor with two CPU groups running the chaos runner (the smoke model plus faults).

Every process the stack starts inherits `LTX_CHAOS_RUN=<token>` in its environment, so the leak check can
find any survivor (supervisor, worker, rank, a grandchild nobody knew about) by reading /proc/*/environ,
besides the pids collected from the workers' health snapshots and from /proc children while it runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import uuid
from pathlib import Path
from typing import Any

from devstack.dev_servers import RedisServer, S3Server
from devstack.tcp_proxy import TcpProxy
from tests.chaos.runner import RUNNER_NAME, RUNNER_PATH
from tests.support.runners import RUNNERS
from tests.support.wait import wait_for
from tests.support.workers import WorkerProcess, pid_alive, worker_env, worker_health

__all__ = ["ChaosStack", "marked_processes"]

GROUPS = ("cpu:2", "cpu:1")
MARKER = "LTX_CHAOS_RUN"


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def descendants(pid: int) -> set[int]:
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in _children(todo.pop()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def marked_processes(token: str) -> list[int]:
    """Live (non-zombie) processes whose environment carries this run's marker."""
    needle = f"{MARKER}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0") and pid_alive(int(entry)):
            found.append(int(entry))
    return found


class ChaosStack:
    """Servers + supervisor for one chaos run; `start()`, use, `stop()` (which never raises on leaks:
    the checker reads `pids_seen` and `marked_processes()`)."""

    def __init__(self, workdir: Path, *, s3: S3Server | None = None, render_timeout: float = 12.0,
                 overrides: dict[str, Any] | None = None, nice: int = 0) -> None:  # fmt: skip
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.token = uuid.uuid4().hex[:12]
        self.queue = f"chaos-{self.token}"
        self.name = f"chaos{self.token[:6]}"
        self.exec_log_dir = self.workdir / "exec"
        self.spool = self.workdir / "spool"
        self.redis = RedisServer(appendonly=True)
        self._own_s3 = s3 is None
        self.s3 = s3 or S3Server()
        self.proxy: TcpProxy | None = None
        self.supervisor: WorkerProcess | None = None
        self.render_timeout = render_timeout
        self.overrides = dict(overrides or {})  # worker settings (e.g. a planted defect for the negative control)
        self.pids_seen: dict[int, str] = {}  # pid -> role (supervisor/worker/rank/child)
        self.nice = nice  # niceness of every process the stack starts (the soak's heavy-load mode)
        self._niced: set[int] = set()
        self._watch_stop = threading.Event()
        self._watch_thread: threading.Thread | None = None
        self._conn: Any = None

    # ---- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> ChaosStack:
        self.redis.start()
        self.renice(self.redis.proc.pid if self.redis.proc is not None else None)
        if self._own_s3:
            self.s3.start()
        self.proxy = TcpProxy(self.s3.s3_port).start()
        self._conn = self.redis.client(socket_timeout=10)
        settings: dict[str, Any] = dict(
            runner=RUNNER_NAME,
            runners=json.dumps({**RUNNERS, RUNNER_NAME: RUNNER_PATH}),
            runner_setup=json.dumps({"exec_log_dir": str(self.exec_log_dir), "default_steps": 1}),
            render_timeout=self.render_timeout,
            retry_fleet_failure=2, retry_worker_lost=2, retry_upload_failed=2, retry_worker_shutdown=2,
            upload_attempts=40, upload_backoff_s=0.2, upload_backoff_max_s=0.5,
            rebuild_backoff_s=0.5, max_rebuild_failures=5, log_format="json",
            # two tenants: the run submits as bob, the hostile inputs come from alice (tests/chaos/hostile.py);
            # a depth cap no run of bob's reaches, which alice's thousands of bogus ids would if counted for him
            tenant_ids="true", tenants="alice,bob", max_queue_depth=200,
        )  # fmt: skip
        settings.update(self.overrides)
        env = worker_env(self.redis.url, self.s3, queue=self.queue, name=self.name, spool=self.spool,
                         s3_url=self.proxy.url, **settings)  # fmt: skip
        env[MARKER] = self.token
        self.supervisor = WorkerProcess(
            [f"--group={g}" for g in GROUPS] + ["--kill-after", "20"], env, self.workdir / "supervisor.log"
        )
        self.supervisor.start()
        self.pids_seen[self.supervisor.pid] = "supervisor"
        self.renice(self.supervisor.pid)
        self._watch_thread = threading.Thread(target=self._watch, name="chaos-pid-watch", daemon=True)
        self._watch_thread.start()
        self.wait_ready(240)
        return self

    @property
    def conn(self) -> Any:
        return self._conn

    def wait_ready(self, timeout: float) -> list[dict[str, Any]]:
        """Both groups' workers up with a live fleet."""

        def ready() -> list[dict[str, Any]] | None:
            assert self.supervisor is not None and self.supervisor.proc is not None
            if self.supervisor.proc.poll() is not None:
                raise AssertionError(f"supervisor exited {self.supervisor.proc.returncode}:\n{self.log_tail()}")
            try:
                infos = self.health()
            except Exception:
                return None
            live = [h for h in infos if h["fleet"]["alive"] and pid_alive(h["pid"])]
            return live if len({h["group"] for h in live}) >= len(GROUPS) else None

        return wait_for(ready, timeout, "both chaos workers ready", poll=0.1, on_fail=self.log_tail)

    def health(self) -> list[dict[str, Any]]:
        infos = worker_health(self._conn, self.name)
        for h in infos:
            self.pids_seen.setdefault(int(h["pid"]), "worker")
            for p in h["fleet"]["pids"] or []:
                self.pids_seen.setdefault(int(p), "rank")
        return infos

    def live_workers(self) -> list[dict[str, Any]]:
        return [h for h in self.health() if pid_alive(h["pid"])]

    def _watch(self) -> None:
        """Collect every descendant of the supervisor while the run lasts (ranks included)."""
        assert self.supervisor is not None
        root = self.supervisor.pid
        while not self._watch_stop.wait(0.25):
            for pid in descendants(root):
                self.pids_seen.setdefault(pid, "child")
                self.renice(pid)
            with contextlib.suppress(Exception):
                self.health()

    def renice(self, pid: int | None) -> None:
        """Lower `pid`'s priority to `nice` (children inherit it; the watcher catches those started before).
        By pid, once each; a process that already exited is skipped."""
        if not self.nice or pid is None or pid in self._niced:
            return
        self._niced.add(pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.setpriority(os.PRIO_PROCESS, pid, self.nice)

    def stop(self) -> int | None:
        """Warm-stop the supervisor (SIGTERM; it forwards to the workers) and wait for it."""
        rc = None
        if self.supervisor is not None:
            with contextlib.suppress(Exception):
                for pid in descendants(self.supervisor.pid):
                    self.pids_seen.setdefault(pid, "child")
            rc = self.supervisor.stop(timeout=90)
        self._watch_stop.set()
        if self._watch_thread is not None:
            self._watch_thread.join(timeout=5)
        return rc

    def leaked(self, grace: float = 20.0) -> list[int]:
        """Processes of this run still alive after `grace` seconds: collected pids and marked ones."""

        def survivors() -> list[int]:
            return sorted({p for p in self.pids_seen if pid_alive(p)} | set(marked_processes(self.token)))

        with contextlib.suppress(AssertionError):
            wait_for(lambda: not survivors(), grace, "no process left", poll=0.2)
        return survivors()

    def kill_leftovers(self, pids: list[int]) -> None:
        """After the verdict: SIGKILL this run's survivors (by pid) so a failing run cleans up."""
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def cleanup(self) -> None:
        if self.supervisor is not None and self.supervisor.proc is not None and self.supervisor.proc.poll() is None:
            self.supervisor.proc.kill()
        self.kill_leftovers(self.leaked(grace=0))
        if self.proxy is not None:
            self.proxy.block()
        with contextlib.suppress(Exception):
            self._conn.close()
        self.redis.cleanup()
        if self._own_s3:
            self.s3.cleanup()

    def log_tail(self, chars: int = 8000) -> str:
        return self.supervisor.log_tail(chars) if self.supervisor is not None else ""
