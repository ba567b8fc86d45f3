"""The worker's admission rule as a pure function of one snapshot (`plan`): which jobs a pass refuses, and
where it trims each queue. The rule itself, and the Redis passes that take the snapshot and apply the plan,
are in `worker.rq.loop.admission`; kept apart so the rule is unit-tested without Redis
(`tests/test_worker_admission.py`)."""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from ltx_contract.states import FailureReason

__all__ = ["STALE", "Owner", "Plan", "Refusal", "Waiting", "plan"]

STALE = "\x00stale"  #: owner marker of a job whose hash is gone or ended: it counts for nothing
Owner = str | None  # a client name, None for a malformed one, or STALE


@dataclass(frozen=True)
class Refusal:
    """One job ended without running, and why."""

    job_id: str
    queue: str
    reason: FailureReason
    details: dict[str, Any] = field(default_factory=dict)

    def message(self) -> str:
        d = self.details
        if self.reason is FailureReason.QUEUE_FULL:
            return (
                f"{d.get('depth')} jobs were waiting (LTX_MAX_QUEUE_DEPTH={d.get('cap')}); this one, among the "
                f"newest, was ended without running"
            )
        return (
            f"client {d.get('client')!r} had {d.get('unfinished')} unfinished jobs ahead of this one "
            f"(LTX_CLIENT_QUOTA={d.get('quota')}); it was ended without running"
        )

    def to_json(self) -> str:
        return json.dumps(
            {"job_id": self.job_id, "queue": self.queue, "reason": self.reason.value, "details": self.details}
        )

    @classmethod
    def from_json(cls, raw: bytes | str) -> Refusal:
        data = json.loads(raw)
        return cls(str(data["job_id"]), str(data["queue"]), FailureReason(data["reason"]), dict(data["details"]))


@dataclass(frozen=True)
class Waiting:
    """One queue as a pass sees it: its length and the owners of its first jobs (the window)."""

    name: str
    length: int
    window: Sequence[tuple[str, Owner]] = ()  #: (job id, owner) from the head; may be shorter than `length`


@dataclass
class Plan:
    """What a pass does: refuse the taken job or not, and per queue what leaves it."""

    taken: Refusal | None = None
    cuts: list[int] = field(default_factory=list)  #: per queue: keep positions [0, cut); the rest is trimmed
    refused: list[list[Refusal]] = field(default_factory=list)  #: per queue: window jobs refused (any position)


def plan(
    running: Sequence[Owner],
    taken: tuple[str, str, Owner] | None,
    queues: Sequence[Waiting],
    *,
    depth_cap: int | None,
    quota: int | None,
    running_ids: Collection[str] = (),
) -> Plan:
    """Walk the unfinished jobs in serving order (running, the taken job `(id, queue, owner)`, the waiting
    ones) and refuse what the rule (`worker.rq.loop.admission`'s docstring) refuses. A STALE entry (not a
    job: no hash, ended, a repeat; `ltx_contract.queue_depth`) counts for nothing. Positions past a
    queue's window are unknown: they count for nothing, and are trimmed only when `depth_cap` jobs are
    admitted ahead of them.

    An id seen before in that order (`running_ids`, the taken job, an earlier entry) counts for nothing, as
    an ended job does: it is the same job queued twice (a tenant cannot take a cancelled job out of the
    queue, and `producer backfill` enqueues its id again), the second entry is dropped when dequeued, and
    counting it against its client's quota would end the one job both entries name."""
    seen = {*running_ids, *([taken[0]] if taken is not None else [])}
    queues = [Waiting(q.name, q.length, _repeats_stale(list(q.window)[: q.length], seen)) for q in queues]
    counts: dict[str, int] = {}
    for owner in running:
        if owner is not None and owner != STALE:
            counts[owner] = counts.get(owner, 0) + 1
    out = Plan()
    if taken is not None:
        job_id, queue, owner = taken
        n = counts.get(owner, 0) if owner is not None and owner != STALE else 0
        if quota is not None and owner is not None and owner != STALE and n >= quota:
            out.taken = Refusal(
                job_id, queue, FailureReason.QUOTA_EXCEEDED, {"client": owner, "unfinished": n, "quota": quota}
            )
        elif owner is not None and owner != STALE:
            counts[owner] = n + 1
    total = sum(q.length for q in queues)
    admitted = 0
    for q in queues:
        refused: list[Refusal] = []
        cut = q.length
        window = list(q.window)[: q.length]
        for pos, (job_id, owner) in enumerate(window):
            if owner == STALE:
                continue
            n = counts.get(owner, 0) if owner is not None else 0
            if quota is not None and owner is not None and n >= quota:
                refused.append(
                    Refusal(
                        job_id, q.name, FailureReason.QUOTA_EXCEEDED, {"client": owner, "unfinished": n, "quota": quota}
                    )
                )
                continue
            if depth_cap is not None and admitted >= depth_cap:
                cut = pos
                break
            admitted += 1
            if owner is not None:
                counts[owner] = n + 1
        else:
            # Past the window nothing is known: those entries count for nothing (junk there must not end a
            # job behind it) and are trimmed only when the cap's worth of jobs is already admitted ahead of
            # them. Otherwise they are judged once they move into the window (the dequeue drops junk).
            if depth_cap is not None and q.length > len(window) and admitted >= depth_cap:
                cut = len(window)
        if cut < q.length:  # everything from the cut on is trimmed: label what the window knows
            done = {r.job_id for r in refused}
            for job_id, owner in window[cut:]:
                if job_id not in done and owner != STALE:
                    refused.append(
                        Refusal(job_id, q.name, FailureReason.QUEUE_FULL, {"depth": total, "cap": depth_cap})
                    )
        out.cuts.append(cut)
        out.refused.append(refused)
    return out


def _repeats_stale(window: Sequence[tuple[str, Owner]], seen: set[str]) -> list[tuple[str, Owner]]:
    """`window` with the owner of each id already in `seen` replaced by STALE; adds the window's ids to it."""
    out: list[tuple[str, Owner]] = []
    for job_id, owner in window:
        out.append((job_id, STALE if job_id in seen else owner))
        seen.add(job_id)
    return out
