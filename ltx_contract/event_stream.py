"""Write a job's events into its Redis Stream and keep a small summary in the RQ job meta: one event at a time,
each exactly once. Both sides write events: the worker everything a running job says (its relay,
`worker.protocol.relay.EventRelay`, adds progress, percent and ETA on top of this), the producer the
`cancelled` state of a job that never ran (`ltx_contract.control`).

One `emit()` is one Redis round trip: XADD (approximate MAXLEN) plus, when the summary changed, an HSET of
the job's `meta` field, in one pipeline. The stream's expiry is set on the first entry (long enough to
outlive the running job) and reset on the terminal state to the job's result/failure TTL, so the events
disappear together with the job (an EXPIRE survives later XADDs).

The meta summary (see `ltx_contract.states.SUMMARY_FIELDS`) is written into the *same* dict RQ holds for the
job, so RQ's own later `job.save()` (e.g. on a re-queue) writes our latest summary rather than a stale copy.
Thread-safe: upload progress arrives from transfer threads while the main thread may emit too.

Redis may restart under a running job, and one failed XADD must not turn a healthy render into a terminal
`internal` failure. Writes are therefore retried on connection errors for up to `REDIS_OUTAGE_S` with a short
back-off (`ltx_contract.redis_retry`); with AOF nothing acknowledged is lost. A write can also be applied with
its reply lost (Redis stopped by SIGTERM persists what it executed but may close the socket before the reply
leaves): a plain retry (or redis-py's own silent ones, 10 by default in redis-py 8) would add the event twice,
and a consumer would see a job end twice. So the writer sends each command once (`redis_conn.single_try`), and
its own retry first looks for the event among the stream's newest entries (each event's payload is unique: it
carries its emit time) and only completes the rest of the write when it is there: every event appears exactly
once.
"""

from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING, Any

from ltx_contract.keys import EVENT_FIELD_DATA, EVENT_FIELD_TYPE, events_key
from ltx_contract.redis_conn import single_try
from ltx_contract.redis_retry import with_redis_retry
from ltx_contract.states import TERMINAL_STATES, EventType, JobState

if TYPE_CHECKING:
    from rq.job import Job

__all__ = ["DONE_STAGE", "EventWriter"]

DONE_STAGE = "done"  #: the summary's `stage` once a job is uploaded (no runner stage runs any more)
_RETRY_LOOKBACK = 16  #: newest stream entries a retried write searches for its own event
_KNOWN_TYPES = {t.value for t in EventType}


class EventWriter:
    """Writes events of one job execution; see the module docstring."""

    def __init__(
        self,
        connection: Any,
        job: Job,
        *,
        maxlen: int,
        running_ttl: int,
        summary: dict[str, Any] | None = None,
    ) -> None:
        self.connection = connection
        self.writer = single_try(connection)  # (retried here, where a retry knows what it may repeat)
        self.job = job
        self.key = events_key(job.id)
        self.maxlen = maxlen
        self.running_ttl = max(1, int(running_ttl))
        self._lock = threading.Lock()
        self._expiry_set = False
        if job.meta is None:
            job.meta = {}
        self.meta: dict[str, Any] = job.meta
        self.meta.update(summary or {})
        self.entries = 0

    # ---- public --------------------------------------------------------------------------------------
    def emit(self, event: dict[str, Any], *, summary: dict[str, Any] | None = None, ttl: int | None = None) -> str:
        """Append `event` (a JSON-safe dict with a `type`) to the stream; update the summary. Returns the id.

        `ttl`: set the stream's expiry to this many seconds now (terminal events).
        """
        data = dict(event)
        data.setdefault("type", EventType.OTHER.value)
        data["ts"] = time.time()
        etype = str(data["type"])
        if etype not in _KNOWN_TYPES:
            etype = EventType.OTHER.value
        with self._lock:
            changes = dict(summary or {})
            changes.update(self.event_summary(etype, data))
            if changes:
                changes["updated_at"] = data["ts"]
            payload = json.dumps(data, default=str)
            tries = 0

            def write() -> Any:
                nonlocal tries
                tries += 1
                return self._write(payload, etype, changes, ttl, maybe_written=tries > 1)

            entry_id = with_redis_retry(write)
            self.entries += 1
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    def event_summary(self, etype: str, data: dict[str, Any]) -> dict[str, Any]:
        """Summary fields an event of type `etype` changes by itself (called under the lock; may add fields to
        the event's `data`). None here: a running job's relay derives its stage and progress from them."""
        return {}

    def _write(self, payload: str, etype: str, changes: dict[str, Any], ttl: int | None, *, maybe_written: bool) -> Any:
        """One pipeline: XADD, the stream's expiry, the summary. Safe to repeat after a connection error:
        with `maybe_written` (an earlier try failed) the XADD is skipped when the event is already there."""
        written = self._find_entry(payload) if maybe_written else None
        pipe = self.writer.pipeline(transaction=False)
        if written is None:
            pipe.xadd(
                self.key,
                {EVENT_FIELD_TYPE: etype, EVENT_FIELD_DATA: payload},
                maxlen=self.maxlen,
                approximate=True,
            )
        if ttl is not None:
            pipe.expire(self.key, max(1, int(ttl)))
        elif not self._expiry_set:
            pipe.expire(self.key, self.running_ttl)
        if changes:
            self.meta.update(changes)
            pipe.hset(self.job.key, "meta", self.job.serializer.dumps(self.meta))
        replies = pipe.execute()
        self._expiry_set = True  # only once the pipeline went through (a retried write sets it again)
        return written if written is not None else replies[0]

    def _find_entry(self, payload: str) -> Any:
        """The id of the stream entry holding exactly `payload`, among the newest few, or None. Only this
        writer writes while its lock is held, so an event applied before its reply was lost is at most a few
        entries from the top (other executions of the job wrote before this one started)."""
        for entry_id, fields in self.writer.xrevrange(self.key, count=_RETRY_LOOKBACK):
            data = fields.get(EVENT_FIELD_DATA.encode(), fields.get(EVENT_FIELD_DATA))
            if (data.decode() if isinstance(data, bytes) else data) == payload:
                return entry_id
        return None

    def state(self, state: JobState, *, ttl: int | None = None, **extra: Any) -> str:
        """Announce a state change (event + summary). Extra keys go into the event; `error`/`result`/
        `digests` (and `attempt`, `worker`, `fleet`, `deterministic`) also go into the summary. A success or a
        cancel clears the summary's `error` (the error of an earlier attempt, kept in meta `attempts`)."""
        summary: dict[str, Any] = {"state": state.value}
        if state in TERMINAL_STATES:
            summary["ended_at"] = time.time()  # the job's end (with the pipeline: the upload's, not the render's)
        if state is JobState.UPLOADED:  # (the runner's last stage, `mux`, is long over: the whole job is done)
            summary.update(stage=DONE_STAGE, percent=100.0, eta_s=0.0, error=None)  # (earlier attempts: `attempts`)
        elif state is JobState.CANCELLED:
            # A cancel is the job's outcome, not its last attempt's failure: an error an earlier attempt left
            # (a `retrying` fleet_failure) would read as why it ended. That attempt stays in meta `attempts`.
            summary["error"] = None
        for key in ("error", "result", "attempt", "worker", "fleet", "digests", "deterministic"):
            if key in extra:
                summary[key] = extra[key]
        return self.emit({"type": EventType.STATE.value, "state": state.value, **extra}, summary=summary, ttl=ttl)

    def update_summary(self, **changes: Any) -> None:
        """Write summary fields without an event (e.g. the attempt counter at start)."""
        with self._lock:
            changes["updated_at"] = time.time()
            self.meta.update(changes)
            payload = self.job.serializer.dumps(self.meta)
            with_redis_retry(lambda: self.writer.hset(self.job.key, "meta", payload))
