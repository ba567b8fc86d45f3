"""A worker logged in as the generated `worker` ACL user, on a Redis the test started: what the ACL, the
tenant-queue, the restart and the dashboard tests share. `write_passwords` writes the users' password files;
`acl_worker` runs the worker (one fresh queue, the fault runner on one CPU rank, tenant ids on; it must stop
with exit 0, and the Redis is cleaned up after it); `Stack` is that stack as tenants see it (`producer`,
`raw` clients, the ACL log), with `tenant_enqueue`, `small_request` and `wait_client_state`."""

from __future__ import annotations

import contextlib
import secrets
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.support.wait import wait_for
from tests.support.workers import WorkerProcess, wait_ready, worker_env

USERS = ("worker", "alice", "bob")  #: the Redis users of these stacks (`worker` and two tenants)


def write_passwords(directory: Path, users: tuple[str, ...] = USERS) -> dict[str, str]:
    """A fresh password per user, each in `directory/<user>` as `ltx-worker redis-acl` and clients read it."""
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for user in users:
        out[user] = secrets.token_urlsafe(24)
        (directory / user).write_text(out[user] + "\n")
    return out


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


class Stack:
    """An ACL stack as its users see it: producer settings and clients per user, raw clients, the ACL log."""

    def __init__(self, server: Any, s3: Any, worker: WorkerProcess, queue: str, name: str, secrets_dir: Path) -> None:
        self.server, self.s3, self.worker, self.queue, self.name = server, s3, worker, queue, name
        self.secrets = secrets_dir
        self.admin = server.client()

    def settings(self, user: str, **extra: Any) -> Any:
        from producer.settings import ProducerSettings

        return ProducerSettings(
            redis_url=self.server.url,
            redis_username=user,
            redis_password_file=self.secrets / user,
            redis_ca_file=self.server.ca_file,
            queues=[self.queue],
            s3_endpoint_url=self.s3.url,
            **extra,
        )

    def producer(self, user: str) -> Any:
        from producer.client import ProducerClient

        return ProducerClient(self.settings(user))

    def raw(self, user: str) -> Any:
        """What a tenant can do with its credentials and no producer."""
        return self.server.user_client(user, (self.secrets / user).read_text().strip(), socket_timeout=5)

    def fleet_alive(self) -> bool:
        return bool(wait_ready(self.admin, self.name, 1, 30, self.worker))

    def denial_counts(self, user: str) -> dict[str, int]:
        """What `user` was denied so far, with how often (Redis aggregates repeats within 60 s into one entry)."""
        counts: dict[str, int] = {}
        for e in self.admin.acl_log(128):
            if _text(e["username"]) == user:
                what = f"{_text(e['reason'])}: {_text(e['object'])}"
                counts[what] = counts.get(what, 0) + int(e["count"])
        return counts

    def acl_denials(self, user: str) -> list[str]:
        log = self.admin.acl_log(128)
        return [f"{_text(e['reason'])}: {_text(e['object'])}" for e in log if _text(e["username"]) == user]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def small_request(prompt: str = "t", **kwargs: Any) -> Any:
    """A `RenderRequest` the fault runner renders in a moment (64x64, 9 frames)."""
    from ltx_contract.schema import RenderRequest

    return RenderRequest(prompt=prompt, width=64, height=64, num_frames=9, **kwargs)


def tenant_enqueue(conn: Any, queue: str, request: dict[str, Any], *, job_id: str, meta: dict[str, Any]) -> Any:
    """What a tenant can enqueue with raw Redis: RQ's job hash and push, on its own queue (no `rq:queues`)."""
    from rq import Queue
    from rq.serializers import JSONSerializer

    from ltx_contract.keys import RENDER_FUNC
    from ltx_contract.rq_client import enqueue_unregistered

    q = Queue(queue, connection=conn, serializer=JSONSerializer)
    job = q.create_job(
        RENDER_FUNC, args=(request,), job_id=job_id, meta=meta, timeout=600, result_ttl=3600, failure_ttl=3600
    )
    with conn.pipeline() as pipe:
        enqueue_unregistered(q, job, pipeline=pipe)
        pipe.execute()
    return job


def wait_client_state(client: Any, job_id: str, states: set[str], stack: Stack, timeout: float = 60) -> Any:
    """Wait until `client.status(job_id)` is in `states`; returns that `JobInfo`."""
    return wait_for(
        lambda: (i := client.status(job_id)).state in states and i,
        timeout,
        f"{job_id} in {states}",
        on_fail=stack.worker.log_tail,
    )
