"""`UploadPipeline`: the background uploader of one worker process, so the fleet never waits on storage.

Why: a fleet that uploads its video before taking the next job idles for the whole upload (seconds to
minutes for a 50 MB file on a remote bucket), and GPU seconds are what a backfill pays for. With the
pipeline the job function commits the render to the spool (manifest written atomically), hands it over
here and returns at once; the worker's next dequeue follows immediately.

Who writes what, in order, for one job (the RQ job id is the key everywhere):

1. main thread: `rendered` (the manifest exists: the video survives any crash from here on), `submit()`,
   the job function returns a small hand-off value, RQ marks the job `finished`, the worker calls
   `released(job_id)`;
2. an uploader thread: sha256 of the file (off the critical path; recorded in the manifest), `uploading`,
   `Uploader.upload(release=False)` with its retries, back-off and read-back confirmation;
3. after `released`: the outcome. Success: `uploaded` (meta `result`, a terminal state event with the
   result TTL on the stream) and the full result replaces the hand-off as the RQ `Result`, then the spool
   copy is deleted. Final failure: `retrying` (the job is re-queued in RQ; the re-run finds the manifest and
   uploads without rendering) or `failed` with `upload_failed` (RQ status and failed registry set; the
   video stays in the spool and is picked up again at the next start).

Waiting for `released` before writing the outcome keeps RQ's own success bookkeeping (status, result,
registries) from landing after ours.

Recovery: `recover()` (at start, before the first job) queues every complete render the spool still
holds, each recorded into the job `worker.stages.recovery` finds for it (a Redis restarting meanwhile is waited
for). Its job is updated as above; a job already recorded as `uploaded` (by this render, or by another render of
it that finished elsewhere) only has the copy released. Uploads are idempotent: the key is fixed in the manifest
(job id + render id, see `worker.uploads.storage`) and `Storage.put` skips an object that already holds the same
sha256, so a crash between confirmation and the record costs one HEAD request.

Bounds: `full()` is true while `max_pending_uploads` renders or `max_pending_bytes` bytes are pending
(queued or in flight); the worker does not take another job meanwhile (back-pressure, see
`worker.rq.loop.worker`). A render in progress can overshoot the byte bound by its own size.

Stopping: `drain(timeout)` (warm stop) waits for pending uploads; what is left (all, on a cold stop) stays
in the spool. `stop` cuts back-off sleeps short; an upload interrupted that way is not recorded as failed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from ltx_contract.health import UploadsHealth
from ltx_contract.states import FailureReason, JobState
from worker.jobs.attempt import JobAttempt
from worker.jobs.ends import Failure
from worker.jobs.outcomes import JobOutcomes
from worker.ops.metrics import WorkerMetrics
from worker.stages.recovery import RECOVERY_REDIS_WAIT_S, job_of
from worker.uploads.spool import Spool, SpoolEntry
from worker.uploads.storage import StoredObject
from worker.uploads.uploader import Uploader, UploadFailed

__all__ = ["PendingUpload", "UploadPipeline"]

log = logging.getLogger("worker.stages.upload")
_RELEASE_WAIT_S = 120.0  # RQ's success bookkeeping takes milliseconds; this only guards against a bug


@dataclass
class PendingUpload:
    """One render waiting for (or in) upload, with what is needed to record the job's outcome."""

    entry: SpoolEntry
    #: the execution that rendered it (its relay, outcome, number and timings); None when a recovered
    #: entry's job no longer exists in Redis
    attempt: JobAttempt | None
    render_s: float = 0.0
    released: threading.Event = field(default_factory=threading.Event)
    recovered: bool = False
    submitted: float = field(default_factory=time.monotonic)

    @property
    def job_id(self) -> str:
        return self.entry.job_id


ResultFn = Callable[[PendingUpload, StoredObject, float, float], dict[str, Any]]


@dataclass(eq=False, kw_only=True)
class UploadPipeline:
    """Queue + uploader threads + outcome recording; see the module docstring."""

    uploader: Uploader
    spool: Spool
    metrics: WorkerMetrics
    group: str
    worker_name: str
    threads: int  #: uploads in flight at once
    max_pending: int
    max_pending_bytes: int
    outcomes: JobOutcomes
    make_result: ResultFn
    stop: threading.Event
    on_uploaded: Callable[[], None] | None = None
    #: told of every upload that failed all its attempts
    on_upload_failed: Callable[[UploadFailed], None] | None = None
    #: pending/in-flight counts changed (health); set by the owner after construction
    on_change: Callable[[], None] = field(default=lambda: None, init=False)
    uploaded: int = field(default=0, init=False)
    failed: int = field(default=0, init=False)
    connection: Any = field(default=None, init=False)
    #: the `worker.stages.encode.EncodeStage` feeding this pipeline (sets itself)
    encoder: Any = field(default=None, init=False)
    _cond: threading.Condition = field(default_factory=threading.Condition, init=False, repr=False)
    _queue: deque[PendingUpload] = field(default_factory=deque, init=False, repr=False)
    # queued or in flight, by job id; and the spool ownership locks of those entries (Spool.claim)
    _pending: dict[str, PendingUpload] = field(default_factory=dict, init=False, repr=False)
    _claims: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _bytes: int = field(default=0, init=False, repr=False)
    _active: int = field(default=0, init=False, repr=False)
    _closing: bool = field(default=False, init=False, repr=False)
    _threads: list[threading.Thread] = field(default_factory=list, init=False, repr=False)

    # ==== lifecycle ===================================================================================
    def start(self, connection: Any) -> UploadPipeline:
        """Start the uploader threads (idempotent). `connection`: Redis, for recovered jobs."""
        self.connection = connection
        with self._cond:
            if self._threads:
                return self
            for i in range(self.threads):
                t = threading.Thread(target=self._run, name=f"ltx-upload-{i}", daemon=True)
                self._threads.append(t)
                t.start()
        self._publish()
        return self

    def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` s for every pending upload to end; then stop the threads. True if drained.

        Whatever is still pending stays in the spool (its manifest intact) for the next start."""
        deadline = time.monotonic() + max(0.0, timeout)
        if self.encoder is not None and not self.encoder.wait_empty(deadline):
            log.warning("warm stop: %d video(s) still encoding; their jobs render again", self.encoder.pending_count())
        with self._cond:
            if self._pending:
                log.info("warm stop: waiting up to %.0fs for %d pending upload(s)", timeout, len(self._pending))
            while self._pending and not self.stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.2))
            drained = not self._pending
            left_over = len(self._pending)
            self._closing = True
            self._cond.notify_all()
        if not drained:
            log.warning("%d upload(s) left in the spool for the next start", left_over)
            self.stop.set()  # cut retries short; an interrupted upload is not recorded as failed
        for t in self._threads:
            t.join(timeout=5)
        return drained

    # ==== feeding =====================================================================================
    def submit(self, item: PendingUpload) -> bool:
        """Queue a committed render. False if this job is already pending (the first one wins)."""
        with self._cond:
            if item.job_id in self._pending:
                return False
            fd = self.spool.claim(item.job_id)
            if fd is None:  # another live process (its job function or its recovery) owns this entry
                log.info("job %s: its spool entry is owned by another process; not uploading it here", item.job_id)
                return False
            self._claims[item.job_id] = fd
            self._pending[item.job_id] = item
            self._bytes += item.entry.size
            self._queue.append(item)
            self._cond.notify_all()
        self._publish()
        return True

    def released(self, job_id: str) -> None:
        """RQ finished its bookkeeping of the job function's return: the outcome may be recorded now."""
        with self._cond:
            item = self._pending.get(job_id)
        if item is not None:
            item.released.set()

    def hold(self, job_id: str) -> bool:
        """A new execution of a pending job (recovery queued it, then RQ handed the re-queued job to us):
        delay recording its outcome until that execution's return is handled too (`released`)."""
        with self._cond:
            item = self._pending.get(job_id)
        if item is None:
            return False
        item.released.clear()
        return True

    def recover(self) -> int:
        """Queue every complete render left in the spool (a previous process died or stopped cold, or an
        upload finally failed). Returns how many were queued."""
        queued = 0
        for entry in self.spool.pending():
            if not self.is_pending(entry.job_id) and (item := self._recovered(entry)) is not None and self.submit(item):
                queued += 1
        if queued:
            log.info("recovery: %d render(s) from the spool queued for upload", queued)
        return queued

    def _recovered(self, entry: SpoolEntry) -> PendingUpload | None:
        """The upload of a render found in the spool; None when it waits for the next start (Redis does not
        answer) or its job is recorded as uploaded already (the copy is released)."""
        try:
            record = job_of(entry, self.connection, self.stop)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            # not "the job is gone": leave the render in the spool for the next start's recovery
            log.error(
                "spool entry %s: Redis unreachable for %.0fs (%s); left in the spool",
                entry.job_id,
                RECOVERY_REDIS_WAIT_S,
                type(exc).__name__,
            )
            return None
        meta = record.meta if record is not None else {}
        result = meta.get("result") if isinstance(meta.get("result"), dict) else {}
        if meta.get("state") == JobState.UPLOADED.value and result.get("key"):
            # (its key may differ: another render of the job, e.g. re-run elsewhere after this host
            # vanished, was recorded first; recording this one too would end the job twice)
            log.info(
                "spool entry %s: job already recorded as uploaded (%s); releasing the copy",
                entry.job_id,
                result.get("key"),
            )
            self.spool.release(entry)
            return None
        attempt = None
        if record is not None:
            attempt = JobAttempt(record, self.outcomes, number=int(meta.get("attempt") or 1), t0=entry.created_at)
        item = PendingUpload(
            entry=entry, attempt=attempt, render_s=float(entry.info.get("render_s") or 0.0), recovered=True
        )
        item.released.set()
        return item

    # ==== back-pressure ===============================================================================
    def is_pending(self, job_id: str) -> bool:
        with self._cond:
            return job_id in self._pending

    def notify(self) -> None:
        """Something this pipeline's bounds depend on changed (an encode ended): wake the waiters."""
        with self._cond:
            self._cond.notify_all()
        self.on_change()

    def full(self) -> bool:
        with self._cond:
            return self._full()

    def _full(self) -> bool:
        encoder_full = self.encoder is not None and self.encoder.full()
        return len(self._pending) >= self.max_pending or self._bytes >= self.max_pending_bytes or encoder_full

    def wait_for_room(self, timeout: float) -> bool:
        """Block up to `timeout` s until the pipeline is below its bounds. True if there is room."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._full():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
            return True

    def snapshot(self) -> UploadsHealth:
        """The pipeline's part of the health snapshot (the worker adds `backpressure` and `background`)."""
        with self._cond:
            return UploadsHealth(
                pending=len(self._pending),
                encoding=self.encoder.pending_count() if self.encoder is not None else 0,
                pending_bytes=self._bytes,
                in_flight=self._active,
                full=self._full(),
                max_pending=self.max_pending,
                max_pending_bytes=self.max_pending_bytes,
                uploaded=self.uploaded,
                failed=self.failed,
            )

    # ==== uploader threads ============================================================================
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if self._closing and (not self._queue or self.stop.is_set()):
                    return
                item = self._queue.popleft()
                self._active += 1
            try:
                self._process(item)
            except Exception:
                log.exception("upload of job %s: unexpected error; the video stays in the spool", item.job_id)
            finally:
                with self._cond:
                    self._active -= 1
                    if self._pending.pop(item.job_id, None) is not None:
                        self._bytes -= item.entry.size
                    fd = self._claims.pop(item.job_id, None)
                    if fd is not None:
                        self.spool.unclaim(fd)
                    self._cond.notify_all()
                self._publish()

    def _process(self, item: PendingUpload) -> None:
        if self.stop.is_set():
            return  # stopping: leave it in the spool
        try:
            entry = self.spool.ensure_sha256(item.entry)
        except OSError as exc:
            log.error("job %s: spool file unreadable (%s); cannot upload it", item.job_id, exc)
            return
        item.entry = entry
        attempt = item.attempt
        emit = self.event_fn(attempt)
        if attempt is not None:
            extra = {"recovered": True} if item.recovered else {}
            self._safe(
                attempt.relay.state,
                JobState.UPLOADING,
                key=entry.key,
                bytes=entry.size,
                sha256=entry.sha256,
                worker=self.worker_name,
                **extra,
            )
        t_up = time.monotonic()
        wait_s = t_up - item.submitted
        try:
            stored = self.uploader.upload(entry, on_event=emit, stop=self.stop, release=False)
        except UploadFailed as exc:
            self.metrics.upload_seconds.labels(self.group).observe(time.monotonic() - t_up)
            if self.stop.is_set():
                log.warning("job %s: upload interrupted by shutdown; left in the spool", item.job_id)
                return
            if self.on_upload_failed is not None:
                self.on_upload_failed(exc)
            item.released.wait(_RELEASE_WAIT_S)
            self._record_failure(item, exc)
            return
        upload_s = time.monotonic() - t_up
        self.metrics.upload_seconds.labels(self.group).observe(upload_s)
        self.metrics.upload_bytes.labels(self.group).inc(stored.size)
        item.released.wait(_RELEASE_WAIT_S)
        self._record_success(item, stored, upload_s, wait_s)
        self.spool.release(entry)  # only now: a crash before this line re-uploads (idempotently) at start

    # ---- outcomes -------------------------------------------------------------------------------------
    def _record_success(self, item: PendingUpload, stored: StoredObject, upload_s: float, wait_s: float) -> None:
        self.uploaded += 1
        attempt = item.attempt
        if attempt is None:
            log.info("recovered render %s uploaded to %s (no job to update)", item.job_id, stored.key)
            return
        # (RQ saw this job finish at `rendered`: the attempt records the result in RQ by hand, then `uploaded`)
        attempt.uploaded(self.make_result(item, stored, upload_s, wait_s), after_return=True, recovered=item.recovered)
        if self.on_uploaded is not None:
            self.on_uploaded()
        log.info("job %s uploaded (%.2fs after %.2fs in the queue)", item.job_id, upload_s, wait_s)

    def _record_failure(self, item: PendingUpload, exc: UploadFailed) -> None:
        self.failed += 1
        if item.attempt is None:
            log.error("recovered render %s: %s", item.job_id, exc)
            return
        # RQ saw this job finish (it returned at `rendered`): `ended_after_return` moves it back by hand
        details = {"spool_path": str(exc.entry.path), "upload_attempts": exc.attempts}
        failure = Failure(FailureReason.UPLOAD_FAILED, str(exc), retryable=exc.retryable, details=details)
        item.attempt.ended_after_return(failure)

    # ---- helpers --------------------------------------------------------------------------------------
    def event_fn(self, attempt: JobAttempt | None) -> Callable[[dict[str, Any]], None]:
        """An upload's `on_event` for `attempt`'s stream (retries counted in the metrics; a relay error only logged)."""

        def emit(event: dict[str, Any]) -> None:
            if "error" in event:
                self.metrics.upload_retries.labels(self.group).inc()
            if attempt is not None:
                self._safe(attempt.relay.emit, event)

        return emit

    @staticmethod
    def _safe(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception:
            log.warning("could not write a job event", exc_info=True)

    def _publish(self) -> None:
        self.on_change()
        snap = self.snapshot()
        self.metrics.upload_pending.labels(self.group).set(snap.pending)
        self.metrics.upload_pending_bytes.labels(self.group).set(snap.pending_bytes)
        self.update_spool_metrics()

    def update_spool_metrics(self) -> None:
        """Publish how many complete renders wait in the spool (and their bytes); a spool that cannot be
        read leaves the last values."""
        try:
            entries, size = self.spool.usage()
        except OSError:
            return
        self.metrics.spool_entries.labels(self.group).set(entries)
        self.metrics.spool_bytes.labels(self.group).set(size)
