"""Redis refusing a write for a while: which refusals clear by themselves, and a retry that waits them out.

Out of memory (a tenant filled Redis past `maxmemory`), a read-only replica (`READONLY`, a failover), a server
still loading its AOF (`LOADING`), a lost connection: each clears by itself or by an operator's hand.
`outage_reason` tells those apart from every other error (a bug is not an outage); `with_redis_retry` retries
one write through them with a short back-off. Both sides write a job's events (`ltx_contract.event_stream`: the
producer the `cancelled` state of a job that never ran, the worker everything else), so both share this; the
worker's own loop keeps its outage state, logs and health entry in `worker.protocol.redis_outage.RedisOutage`.

A process may register memory hooks (`add_memory_hook`): run whenever one of its writes is refused for memory
(the worker releases its reserve and trims tenants over budget: `worker.jobs.tenant_memory`); a client
registers none.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis
from rq.exceptions import StopRequested

__all__ = [
    "REDIS_OUTAGE_S",
    "TRANSIENT_REPLIES",
    "add_memory_hook",
    "memory_refused",
    "outage_reason",
    "remove_memory_hook",
    "with_redis_retry",
]

REDIS_OUTAGE_S = 30.0  #: how long event writes keep retrying while Redis is unreachable

#: Error replies that mean "not now" rather than "never": out of memory, a replica or failover, a server
#: still loading, a script running too long, a failed background save refusing writes, a cluster moving.
TRANSIENT_REPLIES = (
    "OOM",
    "READONLY",
    "LOADING",
    "MASTERDOWN",
    "BUSY",
    "NOREPLICAS",
    "TRYAGAIN",
    "MISCONF",
    "CLUSTERDOWN",
)

#: Called (no arguments, must not raise) whenever a write of this process is refused for memory, from the
#: refusing thread: the worker releases its reserve and trims tenants over budget (worker.jobs.tenant_memory).
_memory_hooks: list[Callable[[], None]] = []


def add_memory_hook(fn: Callable[[], None]) -> None:
    _memory_hooks.append(fn)


def remove_memory_hook(fn: Callable[[], None]) -> None:
    if fn in _memory_hooks:
        _memory_hooks.remove(fn)


def memory_refused(exc: BaseException | None) -> bool:
    """If `exc` (or what it was raised from) is Redis refusing for memory, run the memory hooks; True if so."""
    seen = 0
    while exc is not None and seen < 5:
        if isinstance(exc, redis.exceptions.OutOfMemoryError) or (
            isinstance(exc, redis.ResponseError) and str(exc).upper().startswith("OOM")
        ):
            for fn in list(_memory_hooks):
                fn()
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


_TRANSIENT_CLASSES = (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError, redis.BusyLoadingError)


def outage_reason(exc: BaseException | None) -> str | None:
    """One line saying why Redis refused us if `exc` (or what it was raised from) is a transient refusal;
    None for anything else."""
    if isinstance(exc, StopRequested):  # (a stop signal raised while RQ waited on a lost connection: a stop)
        return None
    seen = 0
    while exc is not None and seen < 5:
        if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
            return f"{type(exc).__name__}: {str(exc)[:200]}"
        if isinstance(exc, _TRANSIENT_CLASSES):  # (redis-py strips the reply's prefix from these)
            return f"{type(exc).__name__}: {str(exc)[:200]}"
        if isinstance(exc, redis.ResponseError):
            text = str(exc)
            if text.split(" ", 1)[0].upper() in TRANSIENT_REPLIES:
                return text[:200]
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def with_redis_retry(fn: Callable[[], Any], *, outage_s: float = REDIS_OUTAGE_S) -> Any:
    """Call `fn` (one Redis write), retrying with back-off for up to `outage_s` seconds while Redis refuses
    for a reason that clears by itself: unreachable, out of memory, read-only, loading (`outage_reason`):
    a render's events must not fail its job on a full Redis."""
    deadline = time.monotonic() + outage_s
    delay = 0.05
    while True:
        try:
            return fn()
        except Exception as exc:
            if outage_reason(exc) is None or time.monotonic() + delay > deadline:
                raise
            memory_refused(exc)  # (out of memory: the worker's reserve and the tenant sweep make room)
            time.sleep(delay)
            delay = min(1.0, delay * 2)
