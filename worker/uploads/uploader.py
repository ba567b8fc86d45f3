"""Upload a spooled render with retries and back-off; release the spool copy only once confirmed.

`Uploader.upload(entry)` is synchronous: the job function calls it after the render when
`LTX_UPLOAD_PIPELINE=false`. It owns everything that must stay true whoever calls it, so the background
uploader (`worker/stages/upload.py`) is a thread that feeds `upload()` from a queue (and from `Spool.pending()` at
start) without changing this module:

- every attempt is recorded in the entry's manifest (`attempts`, `last_error`) before sleeping, so a
  crash mid-retry leaves an accurate spool behind;
- the spool copy is released only after `Storage.put` confirmed the object (size + sha256 read back);
- on final failure the entry stays in the spool and `UploadFailed` carries the last error;
- `stop` (a threading.Event) cuts a back-off sleep short, e.g. on a cold shutdown.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any

from ltx_contract.states import EventType
from worker.errors import WorkerError
from worker.uploads.spool import Spool, SpoolEntry
from worker.uploads.storage import Storage, StorageError, StoredObject

__all__ = ["UploadFailed", "Uploader"]

log = logging.getLogger("worker.uploads.uploader")

EventFn = Callable[[dict[str, Any]], None]


class UploadFailed(WorkerError, RuntimeError):
    """Every attempt failed; the render is still in the spool (`entry`)."""

    def __init__(self, message: str, *, entry: SpoolEntry, attempts: int, retryable: bool) -> None:
        super().__init__(message)
        self.entry = entry
        self.attempts = attempts
        self.retryable = retryable


@dataclass(eq=False)
class Uploader:
    """Retrying, confirming uploads from a `Spool` to a `Storage` (see the module docstring)."""

    storage: Storage
    spool: Spool
    _: KW_ONLY
    attempts: int = 5
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    progress_interval_s: float = 0.5

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt `attempt` (1-based): exponential, capped, with jitter."""
        base = min(self.backoff_max_s, self.backoff_s * (2 ** (attempt - 1)))
        return base * random.uniform(0.8, 1.0)

    def upload(
        self,
        entry: SpoolEntry,
        *,
        on_event: EventFn | None = None,
        stop: threading.Event | None = None,
        release: bool = True,
    ) -> StoredObject:
        """Upload `entry` (retrying), release the spool copy, return the confirmed object.

        `release=False`: keep the spool copy; the caller releases it once the job's outcome is recorded
        (the background uploader does, so a crash between confirmation and that record loses nothing:
        the restarted worker finds the entry, the idempotent put reuses the object, and the job is updated)."""
        emit = on_event or (lambda _event: None)
        last_error = "no attempt made"
        retryable = True
        for attempt in range(1, self.attempts + 1):
            if stop is not None and stop.is_set():
                last_error = "upload interrupted by shutdown"
                break
            entry = self.spool.update(entry, attempts=entry.attempts + 1)
            progress = _Progress(entry.size, emit, self.progress_interval_s)
            try:
                stored = self.storage.put(entry, progress=progress)
            except StorageError as exc:
                last_error = str(exc)
                retryable = exc.retryable
                entry = self.spool.update(entry, last_error=last_error)
                if not retryable or attempt == self.attempts:
                    emit({"type": EventType.UPLOAD, "attempt": attempt, "error": last_error, "final": True})
                    log.error("upload of %s failed (attempt %d/%d): %s", entry.key, attempt, self.attempts, exc)
                    break
                wait = self.backoff(attempt)
                emit({"type": EventType.UPLOAD, "attempt": attempt, "error": last_error, "retry_in_s": round(wait, 3)})
                log.warning(
                    "upload of %s failed (attempt %d/%d), retrying in %.1fs: %s",
                    entry.key,
                    attempt,
                    self.attempts,
                    wait,
                    exc,
                )
                if stop is not None:
                    if stop.wait(wait):
                        last_error = f"{last_error} (then interrupted by shutdown)"
                        break
                else:
                    time.sleep(wait)
                continue
            progress.finish()
            if release:
                self.spool.release(entry)
            return stored
        raise UploadFailed(
            f"upload of {entry.key} failed after {entry.attempts} attempt(s): {last_error}; "
            f"the video is kept in the spool at {entry.path}",
            entry=entry,
            attempts=entry.attempts,
            retryable=retryable,
        )


class _Progress:
    """boto3 transfer callback (byte increments, from transfer threads) → throttled upload events."""

    def __init__(self, total: int, emit: EventFn, interval_s: float) -> None:
        self.total = total
        self.sent = 0
        self.emit = emit
        self.interval_s = interval_s
        self.last = 0.0
        self.lock = threading.Lock()

    def __call__(self, increment: int) -> None:
        with self.lock:
            self.sent += increment
            now = time.monotonic()
            if self.sent >= self.total or now - self.last < self.interval_s:
                return  # (all sent: `finish()` reports it once, marked done)
            self.last = now
            sent = self.sent
        self.emit({"type": EventType.UPLOAD, "bytes": sent, "total": self.total})

    def finish(self) -> None:
        self.emit({"type": EventType.UPLOAD, "bytes": self.total, "total": self.total, "done": True})
