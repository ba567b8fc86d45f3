"""Redis refusing the worker: a condition the worker waits out, never a reason to quit.

Why: a tenant can fill Redis past `maxmemory`, and then every write fails with `OOM`. An error that raises out of
RQ's work loop ("unhandled exception, quitting") ends the worker, its restarts die the same way at registration, and
the service would stay down after the memory comes back. Out of memory, a read-only replica (`READONLY`, a
failover), a server still loading its AOF (`LOADING`), a lost connection: each clears by itself or by an operator's
hand, without a new worker process. So the steps of the work loop that talk to Redis (registration, maintenance,
dequeue and admission, the bookkeeping around a job, heartbeats) catch these errors, and this object turns them into
a back-off (0.5 s doubling to 10 s), one log line per outage (not a traceback per attempt), the
`ltx_worker_redis_up` gauge and the `redis` entry of the health snapshot (`/healthz` stays 200 while the loop turns:
a restart would not help; `/readyz` says 503: no job is taken meanwhile). Any other error still propagates: a bug is
not an outage. Which refusals are outages (`outage_reason`) and the memory hooks are the contract's
(`ltx_contract.redis_retry`): the producer's writes wait out the same refusals.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ltx_contract.health import RedisHealth
from ltx_contract.redis_retry import memory_refused, outage_reason

__all__ = ["RedisOutage"]

log = logging.getLogger("worker.redis")


class RedisOutage:
    """The worker's view of whether Redis takes its commands; thread-safe. See the module docstring."""

    def __init__(
        self, on_change: Callable[[bool], None] | None = None, *, first_delay_s: float = 0.5, max_delay_s: float = 10.0
    ) -> None:
        self.on_change = on_change
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self.since: float | None = None  #: wall clock of the first refusal of this outage
        self.reason: str | None = None
        self.refusals = 0  #: in this outage
        self.outages = 0  #: since the process started
        self._lock = threading.Lock()

    @property
    def up(self) -> bool:
        return self.since is None

    def refused(self, exc: BaseException, where: str) -> float | None:
        """Record a refusal if `exc` is one (see `outage_reason`); returns the back-off to wait, None if `exc`
        is not a Redis outage (the caller re-raises it)."""
        reason = outage_reason(exc)
        if reason is None:
            return None
        memory_refused(exc)
        with self._lock:
            first = self.since is None
            if first:
                self.since, self.outages = time.time(), self.outages + 1
            self.refusals += 1
            self.reason = f"{where}: {reason}"
            delay = min(self.max_delay_s, self.first_delay_s * 2 ** min(self.refusals - 1, 16))
        if first:
            log.error(
                "Redis refuses the worker (%s during %s): waiting it out (no job is taken; retrying with "
                "back-off up to %.0fs)",
                reason,
                where,
                self.max_delay_s,
            )
            self._changed(False)
        elif self.refusals % 20 == 0:
            log.warning(
                "Redis still refuses the worker after %.0fs (%s during %s)",
                time.time() - (self.since or 0),
                reason,
                where,
            )
        return delay

    def cleared(self) -> None:
        """A command that needs Redis's memory went through: the outage (if any) is over."""
        if self.since is None:
            return
        with self._lock:
            since, self.since, self.reason, refusals, self.refusals = self.since, None, None, self.refusals, 0
        if since is not None:
            log.warning(
                "Redis takes the worker's commands again after %.1fs (%d refusals)", time.time() - since, refusals
            )
            self._changed(True)

    def snapshot(self) -> RedisHealth:
        return RedisHealth(up=self.up, since=self.since, reason=self.reason, outages=self.outages)

    def _changed(self, up: bool) -> None:
        if self.on_change is not None:
            try:
                self.on_change(up)
            except Exception:
                log.debug("outage listener failed", exc_info=True)
