"""Job ids whose renders poisoned a fleet, remembered by the workers so that re-pushing one cannot make a
fleet rebuild again and again (a security review: a request re-pushed by id crashed the fleet three more
times; each rebuild costs every GPU of the group 33-46 s at real size).

The record is a worker-owned key, `ltx:worker:poisoned:<job id>` (tenants' Redis users may not write, nor
read, `ltx:worker:*` beyond the health snapshots; a job's own hash and meta are theirs to rewrite, so the
count cannot live there). It holds a JSON list of the fleet reasons, one per poisoning, and expires with
the failure TTL.

Policy (`refusal`): a job is not rendered again once its renders poisoned a fleet more often than the
`fleet_failure` budget allows (`LTX_RETRY_FLEET_FAILURE` + 1 poisonings: twice by default), or once for a
cause that a retry on the same fleet would meet again: `split` (the render raised on some ranks while the
others waited in a collective: the request's own fault, not a transient one). A rank that died without a
word or a collective that timed out may be transient (the host's OOM killer, an operator, a slow peer),
so the job keeps its retries for those. Unlike the budget in the job's meta, this record holds when the
id is pushed again or the meta rewritten.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from worker.protocol.keys import KEY_PREFIX

__all__ = ["NON_TRANSIENT", "POISONED_KEY_TEMPLATE", "poisoned_key", "record", "refusal"]

log = logging.getLogger("worker.jobs.poison")

POISONED_KEY_TEMPLATE = KEY_PREFIX + ":worker:poisoned:{job_id}"
#: Fleet failure reasons (`FleetFailure.reason`) that a retry on the same fleet would meet again.
NON_TRANSIENT = frozenset({"split"})
_KEPT = 16  # reasons kept per job (the refusal comes at the budget; this only bounds a loop that ignores it)


def poisoned_key(job_id: str) -> str:
    return POISONED_KEY_TEMPLATE.format(job_id=job_id)


def record(conn: Any, job_id: str, fleet_reason: str | None, ttl: int) -> list[str]:
    """Remember that `job_id`'s render poisoned a fleet (for `fleet_reason`); returns every reason so far."""
    key = poisoned_key(job_id)
    reasons = [*_reasons(conn, key), str(fleet_reason or "unknown")][-_KEPT:]
    conn.set(key, json.dumps(reasons), ex=max(1, int(ttl)))
    return reasons


def refusal(conn: Any, job_id: str, budget: int, reasons: list[str] | None = None) -> str | None:
    """Why `job_id` must not be rendered again (None: it may be), given the `fleet_failure` retry budget.
    `reasons`: what `record` returned, or read from Redis."""
    reasons = _reasons(conn, poisoned_key(job_id)) if reasons is None else reasons
    lasting = [r for r in reasons if r in NON_TRANSIENT]
    if len(reasons) > max(0, budget) or lasting:
        why = f"for a cause a retry would meet again ({lasting[0]})" if lasting else f"{len(reasons)} times"
        return (f"this job's render poisoned a fleet {why}: it is not rendered again "
                f"(fleet reasons: {', '.join(reasons)})")  # fmt: skip
    return None


def _reasons(conn: Any, key: str) -> list[str]:
    raw = conn.get(key)
    if raw is None:
        return []
    try:
        value = json.loads(raw)
    except (TypeError, ValueError):
        value = None
    if not isinstance(value, list):  # (only workers write it; junk still counts as poisoned, never as clean)
        log.warning("unreadable poisoned-job record %s; taking it as a lasting cause", key)
        return ["split"]
    return [str(v)[:40] for v in value]
