"""`EncodeStage`: the mp4 encode of a rendered video, in the worker process beside the next job.

Why: H100/H200 have no NVENC, and an encode on the fleet's driver rank held every GPU of the group for it
(1.3 s of a 4.1 s distilled render at 768x512, 3.1 s at 1536x1024). The fleet now ends a job at its last
device operation: it yields yuv420p frames and the waveform (`ltx_mgpu.media.mp4.media_event`,
tensors in shared memory, no pickling) and the job function hands them here and returns; the worker's
next dequeue follows at once while this stage encodes (parallel x264 runs on every core, `encode_*`
settings), commits the mp4 to the spool and passes it to the upload pipeline.

Order for one job (RQ job id as the key):

1. job function: `<spool>/<job_id>/encoding.json` (the marker, written atomically) and the spool entry's
   ownership lock (`Spool.claim`), `submit()`, return; the job's state stays `rendering` (no video exists
   yet that could survive a crash);
2. the encoder thread (after RQ's bookkeeping of the return, `released`): a `stage` event `mux` (by the
   worker), the mp4 under the spool (the frames and audio hashed beside it, `runners.common.digest`), the
   manifest (`Spool.commit`), `rendered` with the hashes (`digests`, also in the job's summary), then the
   upload pipeline (`uploading` -> `uploaded` with the sha256, as for any render).

Streamed hand-off (`encode_stream`, `media="stream"`): the fleet yields the video's buffer as its decode
starts and announces frames as they are final; the job function feeds them to `open_stream()`'s
`Mp4Stream` (`ltx_mgpu.media.mp4_stream`), whose x264 runs start in the shared pool while the VAE
still decodes (behind the runs of videos queued before). The item reaches this stage as above; the encoder
thread then only waits for the last runs and muxes them with the audio (the same file as the one-shot
encode). The order and the crash rule are unchanged: nothing is spooled before the mp4, and a render that
fails after the first frames aborts the runs in the job function (`FleetRender.abort_stream`). `rendered`
adds `encode_overlap_s` / `encode_tail_s` (the encode's seconds before and after the decode ended).

Crash rule: a worker that dies mid-encode loses only the frames (they lived in its memory). The marker
without a manifest tells the next start (`recover()`, or any worker sharing the spool, once the dead
process's lock is gone) to record the loss (`worker_lost`, within its retry budget) and re-queue the job:
it renders again. Raw frames are never spooled, so the spool's disk use does not grow with the backlog.

Bounds: `full()` while `max_pending` videos wait for (or are in) the encoder; the worker takes no job
meanwhile (`UploadPipeline.full()` asks this stage too). Frames in memory are at most `max_pending` videos
(285 MB each at 1536x1024x121 in yuv420p), in /dev/shm.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from ltx_contract.states import FailureReason, JobState
from worker.jobs.attempt import JobAttempt
from worker.jobs.ends import Failure
from worker.rq.record import fetch_record
from worker.stages.recovery import when_redis_answers
from worker.stages.upload import PendingUpload, UploadPipeline
from worker.uploads.spool import MANIFEST_NAME, Spool, SpoolEntry

__all__ = ["MARKER_NAME", "EncodeStage", "PendingEncode"]

log = logging.getLogger("worker.stages.encode")
MARKER_NAME = "encoding.json"
_RELEASE_WAIT_S = 120.0  # RQ's success bookkeeping takes milliseconds; this only guards against a bug


@dataclass
class PendingEncode:
    """One rendered video waiting for (or in) the encoder, with what its upload needs afterwards."""

    attempt: JobAttempt  #: the execution that rendered it (its relay, its outcome, number and timings)
    output_path: Path  #: where the mp4 goes (inside the job's spool directory)
    media: dict[str, Any]  #: the runner's `media` event (yuv420p frames, waveform)
    output: dict[str, Any]  #: the runner's `output` event (frames, fps, size, timings)
    key: str  #: storage key of this render
    render_s: float = 0.0
    released: threading.Event = field(default_factory=threading.Event)
    claim: int | None = None  #: the spool entry's ownership lock while the frames exist only here
    #: the fleet's deterministic mode when it rendered them, recorded beside the frames and audio hashes
    deterministic: str | None = None

    @property
    def job_id(self) -> str:
        return self.attempt.id

    @property
    def nbytes(self) -> int:
        video = self.media.get("video")
        return int(video.numel()) if video is not None else 0


class EncodeStage:
    """One encoder thread with a bounded queue; see the module docstring."""

    def __init__(self, *, spool: Spool, pipeline: UploadPipeline, settings: Any, metrics: Any, group: str) -> None:
        self.spool, self.pipeline, self.settings, self.metrics, self.group = spool, pipeline, settings, metrics, group
        self.max_pending = int(settings.max_pending_encodes)
        self._cond = threading.Condition()
        self._queue: deque[PendingEncode] = deque()
        self._pending: dict[str, PendingEncode] = {}
        self._thread: threading.Thread | None = None
        self.encoded = 0
        self.failed = 0
        pipeline.encoder = self  # back-pressure, `is_pending` and the warm stop's drain see the encodes too

    # ---- feeding (the job function's thread) ---------------------------------------------------------
    def prepare(self, item: PendingEncode) -> None:
        """Write the crash marker and take the entry's lock, before the job function returns."""
        directory = self.spool.job_dir(item.job_id)
        record = item.attempt.record
        marker = {
            "job_id": item.job_id,
            "queue": record.queue,
            "submission": record.submission,
            "created_at": time.time(),
        }
        tmp = directory / f".{MARKER_NAME}.tmp"
        tmp.write_text(json.dumps(marker))
        os.replace(tmp, directory / MARKER_NAME)
        item.claim = self.spool.claim(item.job_id)

    def options(self) -> Any:
        from ltx_mgpu.media.mp4 import EncodeOptions

        s = self.settings
        return EncodeOptions(
            crf=s.encode_crf,
            preset=s.encode_preset,
            tune=s.encode_tune,
            bframes=s.encode_bframes,
            threads=s.encode_threads,
            segments=s.encode_segments,
        )

    def open_stream(self, event: dict[str, Any]) -> Any:
        """A streamed hand-off begins (`media_open`): its `Mp4Stream`, fed by the job function."""
        from ltx_mgpu.media.mp4_stream import Mp4Stream

        return Mp4Stream(event, self.options())

    def submit(self, item: PendingEncode) -> None:
        with self._cond:
            self._ensure_thread()
            self._pending[item.job_id] = item
            self._queue.append(item)
            self._cond.notify_all()
        self._publish()

    def released(self, job_id: str) -> None:
        with self._cond:
            item = self._pending.get(job_id)
        if item is not None:
            item.released.set()

    # ---- state ----------------------------------------------------------------------------------------
    def full(self) -> bool:
        with self._cond:
            return len(self._pending) >= self.max_pending

    def is_pending(self, job_id: str) -> bool:
        with self._cond:
            return job_id in self._pending

    def pending_count(self) -> int:
        with self._cond:
            return len(self._pending)

    def wait_empty(self, deadline: float) -> bool:
        with self._cond:
            while self._pending and time.monotonic() < deadline:
                self._cond.wait(min(0.2, max(0.0, deadline - time.monotonic())))
            return not self._pending

    # ---- the synchronous path (upload_pipeline off) -----------------------------------------------------
    def encode_now(self, item: PendingEncode) -> SpoolEntry:
        """Encode and commit in the caller's thread; returns the committed entry (raises on failure)."""
        item.released.set()
        try:
            return self._encode_and_commit(item, hash_now=True)
        finally:  # the caller uploads it (or fails the job) itself; nothing here owns the entry any more
            _abort_stream(item.media)
            if item.claim is not None:
                self.spool.unclaim(item.claim)
                item.claim = None

    # ---- the encoder thread ---------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="ltx-encode", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                item = self._queue.popleft()
            try:
                item.released.wait(_RELEASE_WAIT_S)
                entry = self._encode_and_commit(item, hash_now=False)
            except Exception as exc:
                self._failed(item, exc)
            else:
                self._hand_to_uploads(item, entry)
            finally:
                with self._cond:
                    self._pending.pop(item.job_id, None)
                    self._cond.notify_all()
                _abort_stream(item.media)  # (after a failed encode: no run of it is left queued)
                item.media = {}  # the frames' shared memory goes now, not when the next job replaces the item
                self._publish()

    def _encode_and_commit(self, item: PendingEncode, *, hash_now: bool) -> SpoolEntry:
        from ltx_mgpu.media.mp4 import AudioTrack, write_mp4_yuv
        from ltx_mgpu.runners.common.digest import MediaDigest

        media, stream = item.media, item.media.get("stream")
        _safe(item.attempt.relay.emit, {"type": "stage", "stage": "mux", "by": "worker"})
        t0 = time.monotonic()
        digest = MediaDigest(media["video"], media.get("audio"))  # (hashes in its thread beside the x264 runs)
        audio = None
        if media.get("audio") is not None:
            audio = AudioTrack(media["audio"], int(media["audio_sample_rate"]))
        write_mp4_yuv(
            media["video"],
            item.output_path,
            float(media["fps"]),
            width=int(media["width"]),
            audio=audio,
            options=self.options(),
            stream=None if stream is None else stream.runs,
        )
        digests = {**digest.result(), "deterministic": item.deterministic}
        ended = time.monotonic()
        # a streamed encode began with its first run, while the fleet still decoded
        started = min(t0, (stream.started_at() if stream is not None else None) or t0)
        encode_s = ended - started
        overlap = stream.timings(started, ended) if stream is not None else {}
        self.metrics.encode_seconds.labels(self.group).observe(encode_s)
        info = {k: item.output.get(k) for k in ("frames", "fps", "width", "height")}
        info.update(render_s=round(item.render_s, 4), encode_s=round(encode_s, 4), **overlap, digests=digests)
        info["deterministic"] = item.deterministic  # (the result reads it here, also after a restart)
        entry = self.spool.commit(
            item.job_id,
            file_name=item.output_path.name,
            key=item.key,
            content_type=str(item.output.get("content_type") or "video/mp4"),
            queue=item.attempt.record.queue,
            info=info,
            hash_now=hash_now,
            submission=item.attempt.record.submission,
        )
        (self.spool.job_dir(item.job_id) / MARKER_NAME).unlink(missing_ok=True)
        self.encoded += 1
        sha = {"sha256": entry.sha256} if entry.sha256 else {}
        _safe(
            item.attempt.relay.state,
            JobState.RENDERED,
            bytes=entry.size,
            render_s=round(item.render_s, 4),
            encode_s=round(encode_s, 4),
            **overlap,
            **sha,
            digests=digests,
        )
        return entry

    def _hand_to_uploads(self, item: PendingEncode, entry: SpoolEntry) -> None:
        if item.claim is not None:  # the pipeline takes its own lock on the entry (same process: release first)
            self.spool.unclaim(item.claim)
            item.claim = None
        upload = PendingUpload(entry=entry, attempt=item.attempt, render_s=item.render_s)
        upload.released.set()
        self.pipeline.submit(upload)

    def _failed(self, item: PendingEncode, exc: Exception) -> None:
        """The encode or its commit failed (disk full, a broken frame buffer): the video is lost, the job
        is recorded like any failed attempt and re-queued within its budget (it renders again)."""
        self.failed += 1
        log.exception("job %s: encode failed; the job is recorded and re-queued per its budget", item.job_id)
        reason = FailureReason.SPOOL_ERROR if isinstance(exc, OSError) else FailureReason.INTERNAL
        self.spool.discard_incomplete(item.job_id)
        if item.claim is not None:
            self.spool.unclaim(item.claim)
            item.claim = None
        item.attempt.ended_after_return(Failure(reason, f"encode: {type(exc).__name__}: {exc}", retryable=True))

    # ---- recovery (at start) ---------------------------------------------------------------------------
    def recover(self, connection: Any) -> int:
        """Re-queue the jobs whose worker died mid-encode (marker, no manifest, lock free). Returns how many."""
        found = 0
        for marker in sorted(self.spool.root.glob(f"*/{MARKER_NAME}")):
            directory = marker.parent
            if (directory / MANIFEST_NAME).exists() or self.is_pending(directory.name):
                continue
            fd = self.spool.claim(directory.name)
            if fd is None:  # a live process is still encoding it
                continue
            try:
                info = json.loads(marker.read_text())
                record = when_redis_answers(  # (Redis restarting: wait, never drop the job)
                    lambda d=directory.name: fetch_record(connection, d), self.pipeline.stop
                )
                state = record.meta.get("state")
                # only a job whose return RQ recorded (`finished`): one killed before that is still in RQ's
                # started registry, and the abandoned-job cleanup re-queues it (twice would run it twice)
                returned = record.returned()
                if returned and record.submission == info.get("submission") and state == JobState.RENDERING:
                    lost = "the worker stopped while encoding the video; it renders again"
                    failure = Failure(FailureReason.WORKER_LOST, lost, retryable=True)
                    JobAttempt(record, self.pipeline.outcomes).ended_after_return(failure)
                    found += 1
            except (redis.ConnectionError, redis.TimeoutError):
                log.error("encode marker %s: Redis unreachable; kept for the next start", directory.name)
                continue  # (the lock is released by `finally`)
            except Exception:
                log.warning("encode marker %s: job not recoverable; dropping the marker", directory.name, exc_info=True)
            finally:
                self.spool.unclaim(fd)
            self.spool.discard_incomplete(directory.name)
        if found:
            log.info("recovery: %d job(s) lost mid-encode re-queued to render again", found)
        return found

    def _publish(self) -> None:
        self.metrics.encode_pending.labels(self.group).set(self.pending_count())
        self.pipeline.notify()


def _abort_stream(media: dict[str, Any]) -> None:
    """Cancel a streamed encode's runs not started (a no-op once it is written)."""
    stream = media.get("stream") if media else None
    if stream is not None:
        stream.abort()


def _safe(fn: Any, *args: Any, **kwargs: Any) -> None:
    try:
        fn(*args, **kwargs)
    except Exception:
        log.warning("could not write a job event", exc_info=True)
