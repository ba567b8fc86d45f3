"""Spool recovery's questions to Redis: which job a render (or an encode) that an earlier process left in the spool
belongs to, asked of a Redis that may be restarting at that moment (a host's worker and its Redis often restart
together: taking the connection error for a vanished job uploaded live jobs' renders as orphans and left the jobs
`rendered` for good). The upload pipeline (`UploadPipeline.recover`) and the encode stage (`EncodeStage.recover`)
both ask here at start, before the first job."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from worker.rq.record import JobRecord, fetch_record
from worker.uploads.spool import SpoolEntry

__all__ = ["RECOVERY_REDIS_WAIT_S", "job_of", "when_redis_answers"]

log = logging.getLogger("worker.stages.recovery")
RECOVERY_REDIS_WAIT_S = 300.0  # how long recovery waits for Redis before leaving a render in the spool


def when_redis_answers(fetch: Callable[[], Any], stop: threading.Event) -> Any:
    """`fetch()`, retried while Redis does not answer (with back-off, until `stop` is set). Raises the
    connection error after `RECOVERY_REDIS_WAIT_S`."""
    deadline = time.monotonic() + RECOVERY_REDIS_WAIT_S
    delay = 0.2
    while True:
        try:
            return fetch()
        except (redis.ConnectionError, redis.TimeoutError):
            if time.monotonic() + delay > deadline or stop.is_set():
                raise
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def job_of(entry: SpoolEntry, connection: Any, stop: threading.Event) -> JobRecord | None:
    """The job a recovered render is recorded into: None when it is gone, unreadable, or a later
    submission of its id (the render is then uploaded as an orphan). Raises Redis's connection errors."""
    try:
        record = when_redis_answers(lambda: fetch_record(connection, entry.job_id), stop)
    except (redis.ConnectionError, redis.TimeoutError):
        raise
    except Exception as exc:  # NoSuchJobError (expired, deleted) or an unreadable hash
        log.warning(
            "spool entry %s: job not readable in Redis (%s); uploading the video anyway",
            entry.job_id,
            type(exc).__name__,
        )
        return None
    if not entry.belongs_to(record.submission):
        # the id was submitted again after this render's job expired: upload it as an orphan
        # (its object key is its own), never into the new job
        log.warning(
            "spool entry %s: rendered for an earlier submission of this id; uploading it "
            "without recording it into the current job",
            entry.job_id,
        )
        return None
    return record
