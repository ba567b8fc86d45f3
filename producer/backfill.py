"""Backfill: render every request of a (large) JSON Lines file, at most N at a time, resumably.

Three things make it safe to run, interrupt and run again:

- Job ids come from the request content and seed (`content_job_id`), so the same prompt is the same job.
  Before enqueuing, the job id is checked atomically (admission's WATCH/MULTI also watches the job key):
  a job that is queued or running is adopted (followed, not enqueued again); one that finished is only
  recorded; one that failed is re-run (`retry_failed`) under the same id.
- Every terminal outcome is appended to a JSON Lines manifest (job id, state, object key, sha256,
  seconds, source line) and fsynced, so a later run skips what the manifest says is done even after
  the jobs expired from Redis.
- Ctrl+C stops enqueuing and returns; jobs already in the queue keep running on the workers and are
  adopted by the next run. Nothing runs twice and nothing is lost.

Admission control applies: when the queue is full (or the client's quota is used up) the backfill waits,
backing off politely, instead of failing.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from ltx_contract.keys import events_key
from ltx_contract.states import TERMINAL_STATES, JobState
from producer.admission import AdmissionRefused, JobExists, SubmitRefusal
from producer.client import JobInfo, JobNotFound, ProducerClient, ServiceUnavailable, content_job_id
from producer.request_file import LoadedRequest

__all__ = ["Backfill", "BackfillSummary", "ManifestRecord", "default_manifest_path", "read_manifest"]

_TERMINAL = {s.value for s in TERMINAL_STATES}


def default_manifest_path(requests_path: str | Path) -> Path:
    path = Path(requests_path)
    return path.with_name(path.name.removesuffix(".jsonl").removesuffix(".ndjson") + ".manifest.jsonl")


@dataclass(frozen=True)
class ManifestRecord:
    """One line of the results manifest: the terminal outcome of one job."""

    job_id: str
    state: str  #: uploaded | failed | cancelled
    key: str | None  #: object key in the bucket (uploaded only)
    bucket: str | None
    sha256: str | None
    size: int | None
    seconds: float | None  #: seconds the worker spent on the job (render + upload; queue wait excluded)
    source: str  #: file:line of the request
    error: dict[str, Any] | None = None
    recorded_at: float = field(default_factory=time.time)

    @classmethod
    def from_info(cls, info: JobInfo, source: str) -> ManifestRecord:
        result = info.result or {}
        timings = result.get("timings") or {}
        seconds = timings.get("total_s")
        if seconds is None and info.started_at and info.ended_at:
            seconds = round((info.ended_at - info.started_at).total_seconds(), 3)
        return cls(
            job_id=info.job_id,
            state=info.state,
            key=result.get("key"),
            bucket=result.get("bucket"),
            sha256=result.get("sha256"),
            size=result.get("size"),
            seconds=seconds,
            source=source,
            error=info.error if info.state != JobState.UPLOADED.value else None,
        )

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=False, default=str)


def read_manifest(path: Path) -> dict[str, ManifestRecord]:
    """The last record per job id; a torn last line (killed mid-write) is ignored."""
    records: dict[str, ManifestRecord] = {}
    if not path.exists():
        return records
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            record = ManifestRecord(**data)
        except (ValueError, TypeError):
            continue
        records[record.job_id] = record
    return records


@dataclass
class BackfillSummary:
    total: int = 0  #: distinct jobs in the file
    duplicates: int = 0  #: requests identical to an earlier one in the file (same job id)
    already_done: int = 0  #: skipped: the manifest says uploaded
    enqueued: int = 0  #: newly put into the queue by this run
    adopted: int = 0  #: found queued/running/finished in Redis and followed instead of enqueued
    uploaded: int = 0  #: ended uploaded during this run
    failed: int = 0
    cancelled: int = 0
    waits: int = 0  #: times admission control made us wait
    interrupted: bool = False
    in_flight: int = 0  #: still queued/running when the run ended (only when interrupted)
    remaining: int = 0  #: never enqueued (only when interrupted)

    @property
    def done(self) -> int:
        return self.already_done + self.uploaded + self.failed + self.cancelled


@dataclass
class _Item:
    job_id: str
    loaded: LoadedRequest


class Backfill:
    """One backfill run; see the module docstring. `run()` once per instance."""

    def __init__(
        self,
        client: ProducerClient,
        requests: list[LoadedRequest],
        *,
        manifest: Path,
        concurrency: int,
        queue: str | None = None,
        priority: str = "normal",
        retry_failed: bool = True,
        poll_s: float = 0.25,
        max_wait_s: float = 5.0,
        unavailable_window_s: float = 300.0,
        on_change: Callable[[BackfillSummary, str], None] | None = None,
        on_record: Callable[[ManifestRecord], None] | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.client = client
        self.manifest = Path(manifest)
        self.concurrency = concurrency
        self.queue = queue
        self.priority = priority
        self.retry_failed = retry_failed
        self.poll_s = poll_s
        self.max_wait_s = max_wait_s
        self.unavailable_window_s = unavailable_window_s
        self.on_change = on_change or (lambda _summary, _note: None)
        self.on_record = on_record or (lambda _record: None)
        self.summary = BackfillSummary()
        self.items: list[_Item] = []
        seen: set[str] = set()
        for loaded in requests:
            job_id = content_job_id(loaded.request)
            if job_id in seen:
                self.summary.duplicates += 1
                continue
            seen.add(job_id)
            self.items.append(_Item(job_id, loaded))
        self.summary.total = len(self.items)
        self.refusal: SubmitRefusal | None = None  #: why we are waiting right now (None: not waiting)

    # ---- the loop --------------------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None) -> BackfillSummary:
        """Render every item; returns the summary. Redis must be usable at the start (ServiceUnavailable at
        once: a wrong URL or password is no outage to wait out); an outage later is waited out for
        `unavailable_window_s`."""
        stop = stop or threading.Event()
        self.client.check_connection()
        done = read_manifest(self.manifest)
        pending: deque[_Item] = deque()
        for item in self.items:
            record = done.get(item.job_id)
            if record is not None and (record.state == JobState.UPLOADED.value or not self.retry_failed):
                self.summary.already_done += 1
            else:
                pending.append(item)
        inflight: dict[str, _Item] = {}
        self._backoff = 0.5
        self._next_try = 0.0
        down_since: float | None = None
        self.on_change(self.summary, "start")
        self.manifest.parent.mkdir(parents=True, exist_ok=True)
        with self.manifest.open("a", encoding="utf-8") as out:
            while (pending or inflight) and not stop.is_set():
                try:
                    self._step(out, pending, inflight)
                    if down_since is not None:
                        down_since = None
                        self.on_change(self.summary, "reconnected")
                except (ServiceUnavailable, redis.ConnectionError, redis.TimeoutError) as exc:
                    # A Redis outage is waited out like a full queue: content-derived ids make a retried
                    # submit safe (an enqueue that did land is adopted, not duplicated). A refusal (ACL,
                    # credentials) is no outage: it ends the run at once.
                    if isinstance(exc, ServiceUnavailable) and exc.misconfigured:
                        raise
                    now = time.monotonic()
                    down_since = down_since or now
                    if now - down_since > self.unavailable_window_s:
                        raise
                    self.on_change(self.summary, "unavailable")
                    stop.wait(min(self.max_wait_s, 1.0 + (now - down_since) / 4))
                    continue
                stop.wait(self.poll_s)
        if stop.is_set() and (pending or inflight):
            self.summary.interrupted = True
            self.summary.in_flight = len(inflight)
            self.summary.remaining = len(pending)
        self.on_change(self.summary, "end")
        return self.summary

    def _step(self, out: Any, pending: deque[_Item], inflight: dict[str, _Item]) -> None:
        """One round: fill up to `concurrency` in flight (unless admission told us to wait), then record
        the jobs that ended."""
        while pending and len(inflight) < self.concurrency and time.monotonic() >= self._next_try:
            item = pending[0]
            try:
                outcome = self._start(item)
            except AdmissionRefused as exc:
                if self.refusal is None:
                    self.summary.waits += 1
                self.refusal = exc.refusal
                self._next_try = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 1.6, self.max_wait_s)
                self.on_change(self.summary, "waiting")
                break
            pending.popleft()
            if self.refusal is not None:
                self.refusal = None
                self._backoff = 0.5
            if outcome == "recorded":
                continue
            inflight[item.job_id] = item
            self.on_change(self.summary, outcome)
        if inflight:
            states = self.client.peek_states(list(inflight))
            for job_id, state in states.items():
                if state is None or state in _TERMINAL:
                    self._record(out, inflight[job_id], expired=state is None)
                    del inflight[job_id]  # only once recorded: an outage mid-record retries it

    def _start(self, item: _Item) -> str:
        """Enqueue `item`, or adopt the job that already has its id. Returns "enqueued", "adopted" or
        "recorded" (it had ended and was written to the manifest)."""
        for _ in range(3):
            try:
                self.client.submit(
                    item.loaded.request,
                    job_id=item.job_id,
                    queue=self.queue,
                    priority=self.priority,
                    extra_meta={"backfill": self.manifest.name, "source": item.loaded.source},
                )
                self.summary.enqueued += 1
                return "enqueued"
            except JobExists:
                try:
                    info = self.client.status(item.job_id)
                except JobNotFound:
                    continue  # expired between the check and now: try to enqueue again
                if info.state in (JobState.FAILED.value, JobState.CANCELLED.value) and self.retry_failed:
                    self._forget(item.job_id)
                    continue
                self.summary.adopted += 1
                if info.terminal:
                    with self.manifest.open("a", encoding="utf-8") as out:
                        self._write(out, ManifestRecord.from_info(info, item.loaded.source))
                    self._count(info.state)
                    self.on_change(self.summary, "recorded")
                    return "recorded"
                return "adopted"
        raise RuntimeError(f"could not enqueue or adopt job {item.job_id} (it keeps changing)")

    def _forget(self, job_id: str) -> None:
        """Remove an ended job (and its event stream) so the same id can be enqueued again: a new watcher
        must not see the old attempt's terminal event.

        RQ's `job.delete()` also takes the id out of the queue and registries, which a tenant's Redis user
        may not write: a tenant deletes only its own keys (never trying the rest: its commands write nothing
        shared), and the stale registry entry expires with the registry's TTL (meanwhile it names the new
        job, which `ls` shows as it is)."""
        settings = self.client.settings
        with contextlib.suppress(JobNotFound):
            job = self.client.job(job_id)
            if settings.tenant_ids and not settings.operator:
                self.client.connection.delete(job.key, job.dependents_key)
            else:
                try:
                    job.delete()
                except redis.exceptions.NoPermissionError:  # (a tenant user with LTX_TENANT_IDS=false)
                    self.client.connection.delete(job.key, job.dependents_key)
        self.client.connection.delete(events_key(self.client.own_job_id(job_id)))

    def _record(self, out: Any, item: _Item, *, expired: bool) -> None:
        if expired:
            record = ManifestRecord(
                job_id=item.job_id,
                state=JobState.FAILED.value,
                key=None,
                bucket=None,
                sha256=None,
                size=None,
                seconds=None,
                source=item.loaded.source,
                error={"reason": "expired", "message": "the job disappeared from Redis before it ended"},
            )
        else:
            try:
                info = self.client.status(item.job_id)
            except JobNotFound:
                self._record(out, item, expired=True)
                return
            record = ManifestRecord.from_info(info, item.loaded.source)
        self._write(out, record)
        self._count(record.state)
        self.on_change(self.summary, "finished")

    def _write(self, out: Any, record: ManifestRecord) -> None:
        out.write(record.to_json() + "\n")
        out.flush()
        os.fsync(out.fileno())
        self.on_record(record)

    def _count(self, state: str) -> None:
        if state == JobState.UPLOADED.value:
            self.summary.uploaded += 1
        elif state == JobState.CANCELLED.value:
            self.summary.cancelled += 1
        else:
            self.summary.failed += 1
