"""Redis memory under a hostile tenant: a per-tenant budget the workers hold, and a reserve that lets a
worker record outcomes when Redis is full.

Redis has no per-user memory limit, and a tenant's Redis user may write its own keys (job hashes, event
streams, its admission set, its queues: `ltx_contract.redis_acl`) as often as it likes: each stays under the
value cap (`--proto-max-bulk-len`) and the job-hash bound (`worker.rq.loop.job_class`), yet a few hundred of them
fill `maxmemory`. Then every write fails, the workers cannot record the outcome of the job they are
running and wait, degraded, until an operator deletes the keys. So the workers measure and trim:

- **Budget.** Each tenant may hold `LTX_TENANT_REDIS_BYTES` of Redis memory (0, the default: half of
  Redis's `maxmemory` shared among the tenants, `LTX_TENANTS` or those seen with keys; no `maxmemory`, no
  budget; -1: off). A tenant's keys are those its ACL lets it write or that hold its jobs' results:
  `rq:job:<t>-*`, `ltx:job:<t>-*`, `rq:results:<t>-*`, `ltx:producer:client:<t>:jobs`, `rq:queue:*:t:<t>`.
- **Sweep.** One pass of `SCAN` over the keyspace (at most `MAX_KEYS` keys, `COUNT 1000` each), `MEMORY
  USAGE` of each tenant key (pipelined), then for every tenant over its budget: its keys deleted, largest
  first, ended or unreadable jobs before queued ones, until it is under; a key of a job some worker is
  running (`status` `started`) is never deleted. A deleted queued job's id left in a queue is dropped
  uncounted when taken (`worker.jobs.tenant_queues`). `SCAN`, `MEMORY USAGE`, `HGET` and `DEL` need no memory, so
  the sweep works while Redis refuses writes. It runs when Redis refuses a worker for memory (at most every
  `SWEEP_EVERY_S`) and at each maintenance pass once Redis uses more than `SWEEP_ABOVE` of `maxmemory`.
- **Reserve.** Each worker holds a string of `RESERVE_BYTES` under `ltx:worker:reserve:<slot>` (tenants
  cannot read or write `ltx:worker:*` beyond health snapshots). The slot is the worker's name without its
  pid (`<prefix>.<group>`), so a worker restarted after a crash takes over its predecessor's reserve
  instead of adding one (a SIGKILLed worker cannot delete its own); it expires `reserve_ttl` after the
  last maintenance pass refreshed it. The first refusal for memory deletes it,
  so that the refused write (an outcome, an event, the job's bookkeeping) has room when retried even if no
  tenant is over budget; it is taken again when Redis has room for it twice over.

What this does not stop: a tenant refilling memory between sweeps (her writes land first, the next refusal
trims her again), or many tenants each under budget filling Redis together (then the budgets are too big
for `maxmemory`: lower `LTX_TENANT_REDIS_BYTES`). Every other tenant keeps its keys either way.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from ltx_contract.keys import KEY_PREFIX, TENANT_QUEUE_INFIX

__all__ = ["MAX_KEYS", "RESERVE_BYTES", "SWEEP_ABOVE", "SWEEP_EVERY_S", "TenantMemory", "key_tenant"]

log = logging.getLogger("worker.jobs.tenant_memory")

RESERVE_BYTES = 2 << 20  #: the headroom each worker keeps for recording outcomes (a few hundred events)
SWEEP_EVERY_S = 5.0  #: while Redis refuses for memory, how often the tenants are measured
SWEEP_ABOVE = 0.75  #: at maintenance, sweep once Redis uses more than this share of `maxmemory`
MAX_KEYS = 500_000  #: keys one sweep looks at (a bound on its time: ~1-3 s per 100k on a busy Redis)
_BATCH = 1000

_NAME = r"([A-Za-z0-9_]{1,32})"
_TENANT_KEYS = re.compile(
    rf"(?:rq:job:|{KEY_PREFIX}:job:|rq:results:){_NAME}-(.+)"
    rf"|{KEY_PREFIX}:producer:client:{_NAME}:jobs"
    rf"|rq:queue:.+{re.escape(TENANT_QUEUE_INFIX)}{_NAME}"
)


def key_tenant(key: str) -> tuple[str, str | None] | None:
    """(tenant, job id or None) of a key a tenant owns, None for any other key."""
    m = _TENANT_KEYS.fullmatch(key)
    if m is None:
        return None
    if m.group(1):
        job_id = f"{m.group(1)}-{m.group(2)}".removesuffix(":events")
        return m.group(1), job_id
    return (m.group(3) or m.group(4)), None


class TenantMemory:
    """See the module docstring. `budget_bytes`: the setting (0 auto, -1 off); thread-safe."""

    def __init__(
        self,
        connection: Any,
        *,
        worker_name: str,
        tenants: list[str] | tuple[str, ...] = (),
        budget_bytes: int = 0,
        reserve_bytes: int = RESERVE_BYTES,
        reserve_ttl: int = 3600,
        max_keys: int = MAX_KEYS,
        on_trim: Callable[[str, int, int], None] | None = None,
    ) -> None:
        self.connection = connection
        self.on_trim = on_trim  #: told (tenant, keys deleted, bytes freed) of every trim: the worker's metrics
        self.tenants = tuple(tenants)
        self.budget_bytes = int(budget_bytes)
        self.reserve_bytes = int(reserve_bytes)
        self.max_keys = max_keys
        slot = worker_name.rsplit(".", 1)[0] if worker_name.rsplit(".", 1)[-1].isdigit() else worker_name
        self.reserve_key = f"{KEY_PREFIX}:worker:reserve:{slot}"
        self.reserve_ttl = max(1, int(reserve_ttl))
        self.deleted = 0  #: tenant keys deleted since start
        self._lock = threading.Lock()
        self._next_sweep = 0.0

    # ---- the reserve --------------------------------------------------------------------------------
    def take_reserve(self) -> bool:
        """Hold the reserve again if Redis has room for it twice over (or has no limit); True if held."""
        if self.reserve_bytes <= 0:
            return False
        try:
            if self.connection.expire(self.reserve_key, self.reserve_ttl):
                return True
            used, limit = self._memory()
            if limit and used + 2 * self.reserve_bytes > limit:
                return False
            self.connection.set(self.reserve_key, b"\0" * self.reserve_bytes, ex=self.reserve_ttl, nx=True)
            return True
        except Exception as exc:  # (Redis refusing: the next maintenance tries again)
            log.debug("reserve not taken: %s", exc)
            return False

    def relieve(self) -> None:
        """Redis refused a write for memory: release the reserve, and measure the tenants (not more often than
        `SWEEP_EVERY_S`). Never raises: called from the retry paths of every Redis write."""
        try:
            if self.connection.delete(self.reserve_key):
                log.warning(
                    "Redis is out of memory: released this worker's reserve (%d bytes) to record outcomes",
                    self.reserve_bytes,
                )
            with self._lock:
                if time.monotonic() < self._next_sweep:
                    return
                self._next_sweep = time.monotonic() + SWEEP_EVERY_S
            self.sweep()
        except Exception:
            log.warning("relieving Redis's memory failed", exc_info=True)

    def maintain(self) -> None:
        """At each maintenance pass: hold the reserve; sweep when Redis is nearly full."""
        try:
            used, limit = self._memory()
            if limit and used > SWEEP_ABOVE * limit:
                self.sweep()
            self.take_reserve()
        except Exception:
            log.warning("tenant memory maintenance failed", exc_info=True)

    # ---- the sweep ----------------------------------------------------------------------------------
    def budget(self, limit: int, seen: int) -> int | None:
        """Bytes each tenant may hold; None: no budget."""
        if self.budget_bytes < 0:
            return None
        if self.budget_bytes > 0:
            return self.budget_bytes
        if not limit:
            return None
        return limit // 2 // max(1, len(self.tenants) or seen)

    def sweep(self) -> dict[str, int]:
        """Measure every tenant's keys and trim those over budget; returns {tenant: bytes deleted}."""
        trimmed: dict[str, int] = {}
        _, limit = self._memory()
        if self.budget(limit, 1) is None:
            return trimmed  # (no budget: nothing to measure)
        keys = self._tenant_keys()
        budget = self.budget(limit, len(keys))
        if budget is None:
            return trimmed
        for tenant, sized in keys.items():
            total = sum(size for _, size, _ in sized)
            if total <= budget:
                continue
            freed, n = self._trim(sized, total - budget)
            trimmed[tenant] = freed
            self.deleted += n
            if self.on_trim is not None:
                self.on_trim(tenant, n, freed)
            log.warning(
                "tenant %s held %d bytes of Redis memory, over its budget of %d: deleted %d of its keys "
                "(%d bytes), largest and ended first",
                tenant,
                total,
                budget,
                n,
                freed,
            )
        return trimmed

    def _memory(self) -> tuple[int, int]:
        info = self.connection.info("memory")
        return int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))

    def _tenant_keys(self) -> dict[str, list[tuple[str, int, str | None]]]:
        """{tenant: [(key, bytes, job id)]} over at most `max_keys` keys of the keyspace."""
        found: dict[str, list[tuple[str, int, str | None]]] = {}
        batch: list[tuple[str, str, str | None]] = []
        looked = 0
        for raw in self.connection.scan_iter(count=_BATCH):
            looked += 1
            key = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
            owner = key_tenant(key)
            if owner is not None:
                batch.append((key, *owner))
            if len(batch) >= _BATCH or looked >= self.max_keys:
                self._measure(batch, found)
                batch = []
            if looked >= self.max_keys:
                log.warning("tenant memory sweep stopped after %d keys", looked)
                break
        self._measure(batch, found)
        return found

    def _measure(self, batch: list[tuple[str, str, str | None]], found: dict[str, list[Any]]) -> None:
        if not batch:
            return
        with self.connection.pipeline(transaction=False) as pipe:
            for key, _, _ in batch:
                pipe.memory_usage(key, samples=0)
            sizes = pipe.execute(raise_on_error=False)
        for (key, tenant, job_id), size in zip(batch, sizes, strict=True):
            if isinstance(size, int):
                found.setdefault(tenant, []).append((key, size, job_id))

    def _trim(self, sized: list[tuple[str, int, str | None]], excess: int) -> tuple[int, int]:
        """Delete keys of `sized` until `excess` bytes are gone: ended or unreadable jobs (and other keys)
        first, then queued jobs, largest first within each; never a started job's. Returns (bytes, keys)."""
        job_ids = sorted({job_id for _, _, job_id in sized if job_id})
        status: dict[str, str] = {}
        for i in range(0, len(job_ids), _BATCH):
            chunk = job_ids[i : i + _BATCH]
            with self.connection.pipeline(transaction=False) as pipe:
                for job_id in chunk:
                    pipe.hget(f"rq:job:{job_id}", "status")
                for job_id, value in zip(chunk, pipe.execute(raise_on_error=False), strict=True):
                    if isinstance(value, bytes):
                        status[job_id] = value.decode(errors="replace")

        def order(item: tuple[str, int, str | None]) -> tuple[int, int]:
            state = status.get(item[2] or "")
            return (1 if state in ("queued", "deferred", "scheduled") else 0, -item[1])

        freed = n = 0
        for key, size, job_id in sorted(sized, key=order):
            if freed >= excess:
                break
            if job_id and status.get(job_id) == "started":
                continue
            if self.connection.delete(key):
                freed, n = freed + size, n + 1
        return freed, n
