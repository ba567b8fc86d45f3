"""`HealthPublisher`: keeps a worker's health snapshot in Redis current, written when something changes.

The snapshot (`ltx:worker:<name>:health`, read by `producer stats` and dashboards) follows each change
rather than RQ's worker heartbeat (which would lag it by up to a dequeue timeout: "jobs 0" after a finished
job, a dead fleet still "ready"): every change (job start and end, upload queued and confirmed, fleet
failed / starting / ready) calls `notify()`, from any thread and without blocking; a writer thread of its
own coalesces the requests and writes the latest snapshot on a connection of its own with short timeouts
(a Redis outage delays the next write; it never blocks the uploader or the fleet monitor that asked). It
also writes once per `refresh_s` regardless, so the key (which expires) stays alive while the worker does.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from ltx_contract.health import WorkerHealth

__all__ = ["HealthPublisher"]

log = logging.getLogger("worker.ops.health")


@dataclass(eq=False)
class HealthPublisher:
    """One writer thread per worker process; see the module docstring."""

    connection: Any
    key: str
    snapshot: Callable[[], WorkerHealth]
    _: KW_ONLY
    ttl_s: int
    refresh_s: float = 5.0
    writes: int = field(default=0, init=False)  #: snapshots Redis took
    _wake: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)

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
            payload = json.dumps(self.snapshot().to_json(), default=str)
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
