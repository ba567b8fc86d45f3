"""The invariant checker: reads Redis, the bucket and the runner's execution log after a chaos run.

Invariants (each violation is counted, with the job id and why):
- lost: an accepted job does not end in exactly one terminal state (meta `state` uploaded/failed/cancelled,
  one terminal `state` event in its stream, an RQ status that agrees);
- duplicated: a job's render started again without the earlier execution recorded as failed first (a
  `retrying` event between the two starts), more than one successful RQ result, or one event in its stream
  twice (each event's payload carries its emit time: two equal entries are one write applied twice);
- corrupt: an uploaded job whose object is missing or whose bytes' sha256/size differ from its result;
- leaked processes: pids of the run (collected while it ran, or carrying its environment marker) alive
  after the supervisor stopped;
- Redis memory: every job key expires (TTL set), and memory / keys per finished job stay under a bound.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rq.job import Job
from rq.serializers import JSONSerializer

from ltx_contract.keys import EVENT_FIELD_DATA, events_key
from tests.chaos.runner import read_exec_log

__all__ = ["Accepted", "Verdict", "check"]

TERMINAL = {"uploaded", "failed", "cancelled"}
RQ_FOR_STATE = {"uploaded": {"finished"}, "failed": {"failed"}, "cancelled": {"stopped", "canceled"}}
MAX_BYTES_PER_JOB = 64 * 1024
MAX_KEYS_PER_JOB = 8  # rq:job, rq:results, ltx:job:<id>:events, + registries' share


@dataclass
class Accepted:
    """A job the service accepted, what was done to it and what it should end as."""

    job_id: str
    kind: str  # "normal" or a fault kind
    expected: str = "uploaded"
    expected_reasons: tuple[str, ...] = ()


@dataclass
class Verdict:
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)  # ended, but not as planned (a fault not survived)
    leaked: list[int] = field(default_factory=list)
    memory: list[str] = field(default_factory=list)
    outcomes: dict[str, str] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.corrupt or self.leaked or self.memory)


def _raw_events(conn: Any, job_id: str) -> list[bytes]:
    return [f[EVENT_FIELD_DATA.encode()] for _, f in conn.xrange(events_key(job_id))]


def job_state(conn: Any, job_id: str) -> str | None:
    raw = conn.hget(f"rq:job:{job_id}", "meta")
    try:
        return json.loads(raw).get("state") if raw else None
    except (ValueError, AttributeError):
        return None


def check(conn: Any, s3: Any, exec_log_dir: Path, accepted: list[Accepted], *, baseline_memory: int,
          baseline_keys: int) -> Verdict:  # fmt: skip
    v = Verdict()
    for acc in accepted:
        jid = acc.job_id
        try:
            job = Job.fetch(jid, connection=conn, serializer=JSONSerializer)
        except Exception as exc:
            v.lost.append(f"{jid}: job hash gone ({type(exc).__name__})")
            continue
        meta = job.get_meta(refresh=False)
        state = meta.get("state")
        status = str(job.get_status(refresh=False).value)
        raw_events = _raw_events(conn, jid)
        evts = [json.loads(raw) for raw in raw_events]
        if len(set(raw_events)) != len(raw_events):
            v.duplicated.append(f"{jid} ({acc.kind}): {len(raw_events) - len(set(raw_events))} event(s) written twice")
        terminal_events = [e for e in evts if e["type"] == "state" and e.get("state") in TERMINAL]
        v.outcomes[jid] = state or "none"
        if state not in TERMINAL:
            v.lost.append(f"{jid} ({acc.kind}): state {state!r}, RQ {status}")
            continue
        if len(terminal_events) != 1:
            v.lost.append(f"{jid} ({acc.kind}): {len(terminal_events)} terminal state events")
        if status not in RQ_FOR_STATE[state]:
            v.lost.append(f"{jid} ({acc.kind}): state {state} but RQ status {status}")
        # ---- duplicated ------------------------------------------------------------------------------
        starts = sorted((r for r in read_exec_log(exec_log_dir, jid) if r["event"] == "start" and r["rank"] == 0),
                        key=lambda r: r["t"])  # fmt: skip
        retrying = sorted(e["ts"] for e in evts if e["type"] == "state" and e.get("state") == "retrying")
        for prev, nxt in itertools.pairwise(starts):
            if not any(prev["t"] < ts < nxt["t"] for ts in retrying):
                v.duplicated.append(f"{jid} ({acc.kind}): render started at {nxt['t']:.3f} after one at "
                                    f"{prev['t']:.3f} with no failure recorded in between")  # fmt: skip
        # (RQ may hold two successful results per job: `rendered` from the job function, `uploaded` from the
        # background uploader; two *uploads* would be a duplicate)
        uploads = [r for r in job.results() if r.type.name == "SUCCESSFUL"
                   and isinstance(r.return_value, dict) and r.return_value.get("state") == "uploaded"]  # fmt: skip
        if len(uploads) > 1:
            v.duplicated.append(f"{jid} ({acc.kind}): {len(uploads)} uploaded results")
        # ---- corrupt / outcome ----------------------------------------------------------------------
        if state == "uploaded":
            result = meta.get("result") or {}
            try:
                body = s3.get_object(Bucket=result["bucket"], Key=result["key"])["Body"].read()
                digest = hashlib.sha256(body).hexdigest()
                if digest != result.get("sha256") or len(body) != result.get("size"):
                    v.corrupt.append(f"{jid}: object sha256 {digest[:12]} size {len(body)} vs result "
                                     f"{str(result.get('sha256'))[:12]} {result.get('size')}")  # fmt: skip
            except Exception as exc:
                v.corrupt.append(f"{jid}: object missing ({type(exc).__name__}: {exc})")
        expected, reasons = acc.expected, acc.expected_reasons
        if acc.kind == "raise" and not any(r["event"] == "fault" for r in read_exec_log(exec_log_dir, jid)):
            # the fault fires on a job's first attempt only; that attempt was lost before it fired (its
            # worker was killed by another fault), so the retry rendered without it: expect success
            expected, reasons = "uploaded", ()
        if state != expected:
            v.unexpected.append(f"{jid} ({acc.kind}): {state} (expected {expected}); "
                                f"error {meta.get('error')}")  # fmt: skip
        elif reasons and (meta.get("error") or {}).get("reason") not in reasons:
            v.unexpected.append(f"{jid} ({acc.kind}): reason {(meta.get('error') or {}).get('reason')} "
                                f"(expected one of {reasons})")  # fmt: skip
    # ---- Redis memory ------------------------------------------------------------------------------
    finished = max(1, len(accepted))
    used = int(conn.info("memory")["used_memory"])
    keys = int(conn.dbsize())
    per_job = (used - baseline_memory) / finished
    keys_per_job = (keys - baseline_keys) / finished
    no_ttl = []
    for pattern in ("rq:job:*", "ltx:job:*", "rq:results:*"):
        for key in conn.scan_iter(match=pattern, count=500):
            if conn.ttl(key) == -1:
                no_ttl.append(key.decode())
    accepted_ids = {a.job_id for a in accepted}
    no_ttl = [k for k in no_ttl if any(j in k for j in accepted_ids)]
    if no_ttl:
        v.memory.append(f"{len(no_ttl)} keys of finished jobs never expire, e.g. {no_ttl[:3]}")
    if per_job > MAX_BYTES_PER_JOB:
        v.memory.append(f"{per_job:.0f} bytes of Redis memory per finished job (bound {MAX_BYTES_PER_JOB})")
    if keys_per_job > MAX_KEYS_PER_JOB:
        v.memory.append(f"{keys_per_job:.2f} keys per finished job (bound {MAX_KEYS_PER_JOB})")
    v.stats.update(redis_bytes_per_job=round(per_job), redis_keys_per_job=round(keys_per_job, 2),
                   redis_used_memory=used, redis_keys=keys)  # fmt: skip
    return v
