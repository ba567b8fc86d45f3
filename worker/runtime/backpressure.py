"""Back-pressure: the worker takes no job while its uploads or its spool's disk cannot take another render.

While the background uploader (`worker.stages.upload`) holds `max_pending_uploads` renders (or
`max_pending_bytes`), or the spool's disk is nearly full (fewer than `spool_min_free_bytes` bytes or
`spool_min_free_inodes` inodes: a full spool would fail every job), `Backpressure.wait` blocks before the
dequeue. The worker stays registered (`tick`: its heartbeat), idle (a warm stop interrupts the wait like an
idle dequeue) and says so in metrics, health (`/readyz` 503, `uploads.backpressure_reason`: `active` and
`why`) and the log. Free space is re-checked every second, the LoRA cache yielding its unpinned files to the
spool each time, for bytes and for inodes alike (tiny LoRA files once took every inode while the bytes
stayed free, and the worker waited for good, restarts included), so the worker recovers by itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from worker.render.service import RenderService

__all__ = ["Backpressure"]

log = logging.getLogger("worker.rq")


class Backpressure:
    """The wait before a dequeue (module docstring); `active` and `why` feed the health snapshot."""

    def __init__(self, service: RenderService, *, notify: Callable[[], None], tick: Callable[[], None]) -> None:
        self.service = service
        self.settings = service.settings
        self.notify = notify  #: something in the health snapshot changed
        self.tick = tick  #: one turn of the worker loop (its heartbeat) while waiting
        self.active = False
        self.why: str | None = None

    def wait(self) -> None:
        """Return at once when there is room; else wait until there is (module docstring)."""
        pipeline = self.service.pipeline
        why = self.reason()
        if why is None:
            return
        metrics, group = self.service.metrics, self.service.group
        self.active, self.why = True, why
        metrics.backpressure.labels(group).set(1)
        t0 = last = time.monotonic()
        log.warning("back-pressure: %s; waiting before taking another job", why)
        self.notify()
        try:
            beat = max(1.0, min(10.0, self.settings.worker_ttl / 4))
            while (still := self.reason()) is not None:
                if still != self.why:
                    self.why = still
                    self.notify()
                if pipeline.full():
                    pipeline.wait_for_room(beat)
                else:
                    time.sleep(min(beat, 1.0))  # (disk space comes back through uploads or the operator)
                now = time.monotonic()
                metrics.backpressure_seconds.labels(group).inc(now - last)
                last = now
                self.tick()  # keeps the registration fresh
        finally:
            metrics.backpressure_seconds.labels(group).inc(time.monotonic() - last)
            metrics.backpressure.labels(group).set(0)
            self.active = False
            self.notify()
        log.info("back-pressure released after %.2fs", time.monotonic() - t0)

    def _cache_yields(self, floor: int, floor_inodes: int) -> bool:
        """The LoRA cache yields to the spool where they share a disk: it evicts unpinned files until the disk
        has the spool's floors (True if it removed any; the spool's space is then checked again)."""
        try:
            return bool(self.service.loras.cache.make_room(floor, floor_inodes))
        except OSError as exc:  # (its folder unreadable: the wait goes on, its reason says why)
            log.warning("back-pressure: the LoRA cache could not make room: %s", exc)
            return False

    def reason(self) -> str | None:
        """Why no job may be taken now, or None."""
        pipeline = self.service.pipeline
        if pipeline.full():
            return f"uploads pending: {pipeline.snapshot()}"
        try:
            free_bytes, free_inodes = self.service.spool.free()
        except OSError as exc:
            return f"spool unusable: {exc}"
        floor, floor_inodes = self.settings.spool_min_free_bytes, self.settings.spool_min_free_inodes
        if (free_bytes < floor or free_inodes < floor_inodes) and self._cache_yields(floor, floor_inodes):
            free_bytes, free_inodes = self.service.spool.free()
        if free_bytes < floor or free_inodes < floor_inodes:
            return f"spool disk nearly full: {free_bytes} bytes, {free_inodes} inodes free"
        return None
