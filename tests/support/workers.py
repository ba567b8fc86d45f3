"""Handles on `ltx-worker` processes under test, their health snapshots and the jobs they run.

`worker_env` points a worker at the test's Redis and S3 with fast heartbeats and the runners of
`tests.support.runners`; `WorkerProcess` starts one (`python -m worker ARGS`, log in a file) and stops it
with SIGTERM; `wait_ready` / `wait_state` / `wait_rq_status` wait through `tests.support.wait.wait_for`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devstack.dev_servers import pid_alive
from ltx_contract.health import WorkerHealth
from tests.support.runners import RUNNERS
from tests.support.wait import wait_for

ROOT = Path(__file__).resolve().parents[2]


def worker_env(
    redis_url: str, s3: Any, *, queue: str, name: str, spool: Path, s3_url: str | None = None, **extra: Any
) -> dict[str, str]:
    """Environment for an `ltx-worker` under test: fast heartbeats, test runners, the given servers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LTX_")}
    env.update(
        LTX_REDIS_URL=redis_url,
        LTX_QUEUES=queue,
        LTX_WORKER_NAME=name,
        LTX_RUNNERS=json.dumps(RUNNERS),
        LTX_RUNNER="fault",
        LTX_SPOOL_DIR=str(spool),
        LTX_S3_ENDPOINT_URL=s3_url or s3.url,
        LTX_S3_BUCKET=s3.bucket,
        LTX_S3_ACCESS_KEY_ID=s3.access_key,
        LTX_S3_SECRET_ACCESS_KEY=s3.secret_key,
        LTX_METRICS_PORT="0",
        LTX_METRICS_HOST="127.0.0.1",
        LTX_LOG_FORMAT="json",
        LTX_HEARTBEAT_INTERVAL="1",
        LTX_JOB_HEARTBEAT_TTL="6",
        LTX_WORKER_TTL="20",
        LTX_MAINTENANCE_INTERVAL="2",
        LTX_FLEET_START_TIMEOUT="120",
        LTX_FLEET_SHUTDOWN_TIMEOUT="5",
        LTX_UPLOAD_BACKOFF_S="0.2",
        LTX_UPLOAD_BACKOFF_MAX_S="1",
        LTX_S3_CONNECT_TIMEOUT="2",
        PYTHONUNBUFFERED="1",
    )
    env.update({f"LTX_{k.upper()}": str(v) for k, v in extra.items()})
    return env


class WorkerProcess:
    """An `ltx-worker` (supervisor) or `ltx-worker one` process with its log in a file."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.args = args
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "worker", *self.args], env=self.env, cwd=ROOT,
                                     stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 60) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


SMALL_REQUEST = {"width": 64, "height": 64, "num_frames": 9}  #: the fault runner's usual request size


@dataclass
class LaunchedWorker:
    """An `ltx-worker` process under test with its queue, worker-name prefix and a Redis connection."""

    proc: WorkerProcess
    conn: Any
    queue: str
    name: str

    def submit(self, prompt: str, **request: Any) -> Any:
        """Enqueue a small render (`SMALL_REQUEST`, overridable) steered by `prompt`'s directives."""
        return enqueue(self.conn, self.queue, {"prompt": prompt, **SMALL_REQUEST, **request})


def launch_worker(
    tmp: Path,
    redis_server: Any,
    s3_server: Any,
    args: list[str],
    *,
    prefix: str = "w",
    queue: str | None = None,
    spool: Path | None = None,
    log_name: str | None = None,
    **settings: Any,
) -> LaunchedWorker:
    """Start `ltx-worker ARGS` on a fresh queue and name (unless given) with `worker_env(**settings)`; its
    log is `tmp/<log_name or name>.log`. Waiting for it to be ready is the caller's (how many fleets)."""
    queue = queue or f"q-{uuid.uuid4().hex[:8]}"
    name = f"{prefix}{uuid.uuid4().hex[:6]}"
    env = worker_env(redis_server.url, s3_server, queue=queue, name=name, spool=spool or tmp / "spool", **settings)
    proc = WorkerProcess(args, env, tmp / (log_name or f"{name}.log")).start()
    return LaunchedWorker(proc, redis_server.client(), queue, name)


def worker_health(conn: Any, name_prefix: str) -> list[dict[str, Any]]:
    """Health snapshots of workers whose name starts with `name_prefix` (a SIGKILLed worker's snapshot
    lingers until its key expires: filter with `pid_alive`). Each is checked against the protocol's
    `WorkerHealth`: it parses, and reads back to the very JSON the worker wrote (no key it does not type)."""
    out = []
    for key in conn.scan_iter(match=f"ltx:worker:{name_prefix}.*:health"):
        raw = conn.get(key)
        if raw:
            data = json.loads(raw)
            assert WorkerHealth.from_json(data).to_json() == data, data
            out.append(data)
    return out


def wait_ready(
    conn: Any, name_prefix: str, count: int, timeout: float, worker: WorkerProcess | None = None
) -> list[dict[str, Any]]:
    """Wait until `count` workers with this name prefix report a live fleet and an idle loop."""

    def ready() -> list[dict[str, Any]] | None:
        if worker is not None and worker.proc is not None and worker.proc.poll() is not None:
            raise AssertionError(f"worker exited with {worker.proc.returncode}:\n{worker.log_tail()}")
        infos = [h for h in worker_health(conn, name_prefix) if h["fleet"]["alive"] and pid_alive(h["pid"])]
        return infos if len(infos) >= count else None

    return wait_for(ready, timeout, f"{count} ready worker(s) {name_prefix}",
                    on_fail=worker.log_tail if worker else None)  # fmt: skip


def http_json(port: int, path: str, timeout: float = 10) -> tuple[int, dict[str, Any]]:
    """GET a probe (`/readyz`, `/healthz`) on 127.0.0.1: (status, its JSON); (0, {}) while nothing answers."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return 0, {}


# ==== jobs ==============================================================================================


def enqueue(conn: Any, queue: str, request: dict[str, Any], **kwargs: Any) -> Any:
    """Enqueue a render exactly as a producer would: by dotted path, JSON serializer, explicit timeouts."""
    from rq import Queue
    from rq.serializers import JSONSerializer

    from ltx_contract.keys import RENDER_FUNC

    q = Queue(queue, connection=conn, serializer=JSONSerializer)
    kwargs.setdefault("job_timeout", 600)
    kwargs.setdefault("result_ttl", 3600)
    kwargs.setdefault("failure_ttl", 3600)
    return q.enqueue(RENDER_FUNC, request, **kwargs)


def meta_state(job: Any) -> str | None:
    return job.get_meta(refresh=True).get("state")


def wait_state(job: Any, states: set[str] | str, timeout: float, worker: WorkerProcess | None = None) -> str:
    wanted = {states} if isinstance(states, str) else set(states)

    def reached() -> str | None:
        state = meta_state(job)
        return state if state in wanted else None

    state = wait_for(reached, timeout, f"job {job.id} in {wanted} (now {meta_state(job)})",
                     on_fail=worker.log_tail if worker else None)  # fmt: skip
    if state == "uploaded":
        # the worker announces "uploaded" just before returning; RQ then records the result and `finished`
        from rq.job import JobStatus

        wait_rq_status(job, {JobStatus.FINISHED}, 30, worker)
    return state


def wait_rq_status(job: Any, statuses: set[str], timeout: float, worker: WorkerProcess | None = None) -> str:
    def reached() -> str | None:
        status = job.get_status(refresh=True)
        return str(status.value if hasattr(status, "value") else status) if status in statuses else None

    return wait_for(reached, timeout, f"job {job.id} RQ status in {statuses}",
                    on_fail=worker.log_tail if worker else None)  # fmt: skip


def events(conn: Any, job_id: str) -> list[dict[str, Any]]:
    from ltx_contract.keys import EVENT_FIELD_DATA, events_key

    return [json.loads(fields[EVENT_FIELD_DATA.encode()]) for _, fields in conn.xrange(events_key(job_id))]
