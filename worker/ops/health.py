"""`HealthPublisher`: keeps a worker's health snapshot in Redis current, written when something changes.

The snapshot (`ltx:worker:<name>:health`, read by `producer stats` and dashboards) used to be written only
with RQ's worker heartbeat, so it lagged by up to a dequeue timeout: "jobs 0" after a finished job, an
upload still `pending` after it was confirmed, a dead fleet still "ready". Now every change
(job start and end, upload queued and confirmed, fleet failed / starting / ready) calls `notify()`, from
any thread and without blocking: a writer thread of its own coalesces the requests and writes the latest
snapshot on a connection of its own with short timeouts (a Redis outage delays the next write; it never
blocks the uploader or the fleet monitor that asked). It also writes once per `refresh_s` regardless,
so the key (which expires) stays alive while the worker does.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["HealthPublisher"]

log = logging.getLogger("worker.ops.health")


class HealthPublisher:
    """One writer thread per worker process; see the module docstring."""

    def __init__(
        self,
        connection: Any,
        key: str,
        snapshot: Callable[[], dict[str, Any]],
        *,
        ttl_s: int,
        refresh_s: float = 5.0,
    ) -> None:
        self.connection = connection
        self.key = key
        self.snapshot = snapshot
        self.ttl_s = ttl_s
        self.refresh_s = refresh_s
        self.writes = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> HealthPublisher:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ltx-health-writer", daemon=True)
            self._thread.start()
        return self

    def notify(self) -> None:
        """Something in the snapshot changed: write it soon (never blocks; requests coalesce)."""
        self._wake.set()

    def write_now(self) -> bool:
        """Write the snapshot from the calling thread; False if Redis did not take it."""
        try:
            payload = json.dumps(self.snapshot(), default=str)
            self.connection.set(self.key, payload, ex=self.ttl_s)
        except Exception:
            log.debug("could not write the health snapshot", exc_info=True)
            return False
        self.writes += 1
        return True

    def stop(self, *, delete: bool = True) -> None:
        """Stop the writer; remove the key (a stopped worker has no health)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if delete:
            try:
                self.connection.delete(self.key)
            except Exception:
                log.debug("could not delete the health key", exc_info=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.refresh_s)
            if self._stop.is_set():
                return
            self._wake.clear()
            if not self.write_now():
                self._stop.wait(0.5)  # Redis unreachable: retry soon, not in a tight loop
                self._wake.set()
