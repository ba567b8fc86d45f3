"""The full result of a render job once its video is uploaded (`uploaded`), the same whichever path uploaded it
(the job function itself, or the upload stage later: `for_upload`). While the stages still work the job function
gives back a hand-off instead (`worker.jobs.attempt.JobAttempt.handed_off`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ltx_contract.states import JobState
from worker.jobs.attempt import JobAttempt
from worker.render.fleet import WarmFleet
from worker.stages.upload import PendingUpload
from worker.uploads.spool import SpoolEntry
from worker.uploads.storage import Storage, StoredObject

__all__ = ["JobResults"]


@dataclass(frozen=True)
class JobResults:
    """The results of one worker process's jobs (its storage, fleet, group and name go into each)."""

    storage: Storage
    fleet: WarmFleet
    group: str
    worker_name: str

    def for_upload(self, item: PendingUpload, stored: StoredObject, upload_s: float, wait_s: float) -> dict[str, Any]:
        """The result of a render the upload stage uploaded (`UploadPipeline.make_result`)."""
        assert item.attempt is not None  # (the stage records no result for a recovered render without a job)
        result = self.uploaded(item.attempt, item.entry, stored, item.render_s, upload_s)
        result["timings"]["upload_wait_s"] = round(wait_s, 4)
        if item.recovered:
            result["recovered"] = True
        return result

    def uploaded(
        self, attempt: JobAttempt, entry: SpoolEntry, stored: StoredObject, render_s: float, upload_s: float
    ) -> dict[str, Any]:
        """The full result: where the video is, its hashes, size, timings and the fleet that rendered it."""
        url, url_expires_at = stored.url, stored.url_expires_at
        kept = attempt.kept_result_ttl()
        if url_expires_at is not None and kept > 0 and url_expires_at > time.time() + kept:
            # a URL must not outlive the result it is recorded in: once the job expired its id can be reused,
            # and the old URL would serve the new owner's video
            url, url_expires_at = self.storage.url_for(stored.key, expiry_s=kept)
        return {
            "job_id": attempt.id,
            "state": JobState.UPLOADED.value,
            "storage": stored.backend,
            "bucket": stored.bucket,
            "key": stored.key,
            "size": stored.size,
            "sha256": stored.sha256,
            "digests": entry.info.get("digests"),  #: the frames' and audio's sha256 (`runners.common.digest`)
            #: the fleet's deterministic mode when it rendered the video (kept in the spool's manifest)
            "deterministic": entry.info.get("deterministic"),
            "content_type": stored.content_type,
            "url": url,
            "url_expires_at": url_expires_at,
            "reused_object": stored.reused,
            "output": {k: v for k, v in entry.info.items() if k in ("frames", "fps", "width", "height")},
            "timings": {
                "queue_wait_s": None if attempt.queue_wait_s is None else round(attempt.queue_wait_s, 4),
                "render_s": round(render_s, 4),
                "upload_s": round(upload_s, 4),
                "total_s": round(time.time() - attempt.t0, 4),
            },
            "fleet": {
                "group": self.group,
                "devices": [str(d) for d in self.fleet.devices],
                "world_size": self.fleet.world_size,
                "worker": self.worker_name,
            },
            "attempt": attempt.number,
        }
