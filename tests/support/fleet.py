"""A handle on one `ltx-worker one` under test (`Fleet`, `JobFleet`): started on its own queue and name, ready
with a warm fleet, stopped (exit 0 required) at the end; plus a reader for its /metrics page."""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.support.wait import wait_for
from tests.support.workers import WorkerProcess, enqueue, wait_ready, worker_env, worker_health


class Fleet:
    """Handle on the module's worker: its process, queue, Redis connection, proxy and spool."""

    def __init__(self, proc: WorkerProcess, conn: Any, queue: str, name: str, proxy: Any, spool: Path) -> None:
        self.proc, self.conn, self.queue, self.name, self.proxy, self.spool = proc, conn, queue, name, proxy, spool

    def health(self) -> dict[str, Any]:
        infos = worker_health(self.conn, self.name)
        assert len(infos) == 1, infos
        return infos[0]

    def idle(self, timeout: float = 90) -> dict[str, Any]:
        """Wait for a live fleet and no running job; return the health snapshot."""

        def ok() -> dict[str, Any] | None:
            infos = wait_ready(self.conn, self.name, 1, timeout, self.proc)
            info = infos[0]
            return info if info["current_job"] is None else None

        return wait_for(ok, timeout, "idle worker", on_fail=self.proc.log_tail)

    def submit(self, prompt: str, **request: Any) -> Any:
        return enqueue(self.conn, self.queue, {"prompt": prompt, "width": 64, "height": 64, "num_frames": 9,
                                               **request})  # fmt: skip


class JobFleet(Fleet):
    """A `Fleet` that tests send RQ jobs to directly: `enqueue` takes RQ's keyword arguments (job id, meta,
    TTLs, retries) for a small render, and `metric` sums a /metrics family's samples."""

    def enqueue(self, prompt: str = "t", **kwargs: Any) -> Any:
        return enqueue(self.conn, self.queue, {"prompt": prompt, "width": 64, "height": 64, "num_frames": 9}, **kwargs)

    def metric(self, line_start: str) -> float:
        """The sum of the samples on this worker's /metrics whose line starts with `line_start`."""
        port = self.health()["metrics_port"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


def start_worker(
    tmp: Path, redis_server: Any, s3_server: Any, proxy: Any, runner: str, group: str, *,
    handle: type[Fleet] = Fleet, **extra: Any
) -> Fleet:  # fmt: skip
    """An `ltx-worker one` on its own queue, ready (its fleet warm); S3 through `proxy` unless None."""
    queue = f"q-{uuid.uuid4().hex[:8]}"
    name = f"t{uuid.uuid4().hex[:6]}"
    spool = tmp / "spool"
    spool.mkdir(exist_ok=True)
    env = worker_env(redis_server.url, s3_server, queue=queue, name=name, spool=spool,
                     s3_url=proxy.url if proxy is not None else None, runner=runner, **extra)  # fmt: skip
    proc = WorkerProcess(["one", "--group", group], env, tmp / "worker.log").start()
    conn = redis_server.client()
    wait_ready(conn, name, 1, 120, proc)
    return handle(proc, conn, queue, name, proxy, spool)


@contextmanager
def running_worker(
    tmp: Path, redis_server: Any, s3_server: Any, *, handle: type[Fleet] = Fleet, runner: str = "fault",
    group: str = "cpu:1", **extra: Any
) -> Iterator[Fleet]:  # fmt: skip
    """`start_worker` (straight to S3) for a module's tests; stopped at the end, which must exit 0."""
    f = start_worker(tmp, redis_server, s3_server, None, runner, group, handle=handle, **extra)
    try:
        yield f
    finally:
        rc = f.proc.stop()
        f.conn.close()
        assert rc == 0, f.proc.log_tail()


def metric(port: int, line_start: str) -> str | None:
    """The first line of the worker's /metrics page on `port` that starts with `line_start`, or None."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return next((line for line in text.splitlines() if line.startswith(line_start)), None)
