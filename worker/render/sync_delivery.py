"""`SyncDelivery`: a render delivered by the job function itself, with the upload pipeline off (`upload_pipeline`
false): encoded (frames) and committed, uploaded, confirmed and recorded before the job function returns, so RQ's
`finished` means `uploaded` and there is no hand-off. It runs the stages' own parts inline (the encode stage's
`encode_now`, the pipeline's uploader, stop event, metrics and upload events), so both paths upload alike; with
the pipeline on (the default) the render service hands the render to the stages instead and none of this runs."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ltx_contract.states import FailureReason, JobState
from worker.jobs.attempt import JobAttempt
from worker.jobs.ends import End, Failure
from worker.render.results import JobResults
from worker.stages.encode import EncodeStage, PendingEncode
from worker.stages.upload import UploadPipeline
from worker.uploads.spool import SpoolEntry
from worker.uploads.uploader import UploadFailed

__all__ = ["SyncDelivery"]


@dataclass(frozen=True)
class SyncDelivery:
    """The synchronous path of one worker process; see the module docstring."""

    pipeline: UploadPipeline  #: its uploader, spool, metrics, stop event and upload events (`event_fn`)
    encoder: EncodeStage
    results: JobResults
    on_uploaded: Callable[[], None]  #: an upload was confirmed (the render service counts it)
    on_upload_failed: Callable[[UploadFailed], None]  #: every attempt of an upload failed (storage degraded)

    def deliver(self, attempt: JobAttempt, entry: SpoolEntry | PendingEncode, render_s: float) -> dict[str, Any] | End:
        """Encode (frames) and commit, upload, confirm, record: the job's result, or how it ended."""
        if isinstance(entry, PendingEncode):
            encoded = self._encode(attempt, entry)
            if isinstance(encoded, Failure):
                return encoded
            entry = encoded
        p = self.pipeline
        entry = p.spool.ensure_sha256(entry)
        attempt.relay.state(JobState.UPLOADING, key=entry.key, bytes=entry.size)
        t_up = time.monotonic()
        try:
            stored = p.uploader.upload(entry, on_event=p.event_fn(attempt), stop=p.stop)
        except UploadFailed as exc:
            p.metrics.upload_seconds.labels(p.group).observe(time.monotonic() - t_up)
            self.on_upload_failed(exc)
            details = {"spool_path": str(exc.entry.path), "upload_attempts": exc.attempts}
            return Failure(FailureReason.UPLOAD_FAILED, str(exc), retryable=exc.retryable, details=details)
        upload_s = time.monotonic() - t_up
        p.metrics.upload_seconds.labels(p.group).observe(upload_s)
        p.metrics.upload_bytes.labels(p.group).inc(stored.size)
        result = self.results.uploaded(attempt, entry, stored, render_s, upload_s)
        attempt.uploaded(result)
        self.on_uploaded()
        return result

    def _encode(self, attempt: JobAttempt, item: PendingEncode) -> SpoolEntry | Failure:
        """Encode and commit before the upload; a failed encode leaves no partial file in the spool."""
        try:
            return self.encoder.encode_now(item)
        except Exception as exc:
            self.pipeline.spool.discard_incomplete(attempt.id)
            if isinstance(exc, OSError):
                return Failure.spool(exc)
            return Failure(FailureReason.INTERNAL, f"encode: {type(exc).__name__}: {exc}")
