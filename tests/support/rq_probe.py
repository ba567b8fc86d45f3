"""A job function RQ runs in tests (`tests/test_worker_rqcompat.py`: what RQ 2.12 stores of an execution, read from
inside the execution): the fields and expiry of every execution record RQ holds for the job running it."""

from __future__ import annotations

from typing import Any


def stored_executions() -> dict[str, dict[str, str]]:
    """{key of RQ's stored execution of the current job: its fields and `ttl`}, read while the job runs."""
    from rq import get_current_job

    job: Any = get_current_job()
    keys = sorted(k.decode() for k in job.connection.scan_iter(match=f"rq:execution:{job.id}:*"))
    conn = job.connection
    return {
        key: {**{f.decode(): v.decode() for f, v in conn.hgetall(key).items()}, "ttl": str(conn.ttl(key))}
        for key in keys
    }
