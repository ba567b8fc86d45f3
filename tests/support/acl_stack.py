"""A worker logged in as the generated `worker` ACL user, on a Redis the test started: what the ACL, the
tenant-queue and the restart tests share. The worker serves one fresh queue with the fault runner on one
CPU rank, with tenant ids on; it must stop with exit 0, and the Redis is cleaned up after it."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.support.workers import WorkerProcess, worker_env


@contextlib.contextmanager
def acl_worker(
    server: Any, s3_server: Any, tmp: Path, secrets: Path, ready: Callable[[Any, str, WorkerProcess], None], **env: Any
) -> Iterator[tuple[WorkerProcess, str, str]]:
    """Yields (worker process, queue, worker name) once `ready(admin client, name, process)` returns."""
    queue, name = f"q-{uuid.uuid4().hex[:8]}", f"w{uuid.uuid4().hex[:6]}"
    spool = tmp / "spool"
    spool.mkdir()
    env = worker_env(server.url, s3_server, queue=queue, name=name, spool=spool, runner="fault",
                     redis_username="worker", redis_password_file=secrets / "worker", tenant_ids="true",
                     **env)  # fmt: skip
    proc = WorkerProcess(["one", "--group", "cpu:1"], env, tmp / "worker.log").start()
    admin = server.client(socket_timeout=5)
    try:
        ready(admin, name, proc)
        yield proc, queue, name
    finally:
        rc = proc.stop()
        admin.close()
        server.cleanup()
        assert rc == 0, proc.log_tail()
