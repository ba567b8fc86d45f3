"""Job ids whose renders poisoned a fleet, remembered by the workers so that re-pushing one cannot make a
fleet rebuild again and again: a tenant may re-push a job id, and each rebuild costs every GPU of the group
tens of seconds at real size.

The record is a worker-owned key, `ltx:worker:poisoned:<job id>` (tenants' Redis users may not write, nor
read, `ltx:worker:*` beyond the health snapshots; a job's own hash and meta are theirs to rewrite, so the
count cannot live there). It holds a JSON list of the fleet reasons, one per poisoning, and expires with
the failure TTL.

Policy (`refusal`), from the kind of each poisoning (`lasting`). A job that killed ranks by its own doing is
not rendered again on the same group of devices: the render raised on some ranks while the others waited
in a collective (`split`), or a rank died during the job of a signal the process raises on itself
(SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGSYS, SIGTRAP: a crash in native code or an abort) or was
killed by the kernel's OOM killer (SIGKILL while the cgroup's `oom_kill` count rose during the job: the
render's allocations). The record names the group: another group's worker (other devices, other memory)
may take it once; a second such poisoning anywhere ends it. In a one-group deployment the job is
therefore never rendered again after such a poisoning. Anything else may be transient and keeps the
`fleet_failure` budget (`LTX_RETRY_FLEET_FAILURE` + 1 poisonings in all, twice by default): a rank killed
from outside (SIGKILL without an OOM kill, SIGTERM: an operator, a test's fault), a rank that exited with
a code (ambiguous), a collective or the job timing out, a desync, a fleet lost before or between jobs (a
failure detected before the job was dispatched is not the job's). Unlike the budget in the job's meta,
this record holds when the id is pushed again or the meta rewritten.
"""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path
from typing import Any

from ltx_contract.keys import KEY_PREFIX

__all__ = ["NON_TRANSIENT", "POISONED_KEY_TEMPLATE", "lasting", "oom_kills", "poisoned_key", "record", "refusal"]

log = logging.getLogger("worker.jobs.poison")

POISONED_KEY_TEMPLATE = KEY_PREFIX + ":worker:poisoned:{job_id}"
#: Fleet failure reasons (`FleetFailure.reason`) that a retry on the same fleet would meet again.
NON_TRANSIENT = frozenset({"split"})
#: Signals a process raises on itself when its own code crashes (see the module docstring).
_SELF_INFLICTED = frozenset(
    int(getattr(signal, n))
    for n in ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGSYS", "SIGTRAP")
    if hasattr(signal, n)
)
_KEPT = 16  # entries kept per job (the refusal comes at the budget; this only bounds a loop that ignores it)


def poisoned_key(job_id: str) -> str:
    return POISONED_KEY_TEMPLATE.format(job_id=job_id)


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed in this process's memory cgroup (v2
    `memory.events`, v1 `memory.oom_control`); None where it cannot be read (then a SIGKILL is taken as a kill
    from outside, and the budget still bounds the retries)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        if controllers == "":
            candidate = Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.events"
        elif "memory" in controllers.split(","):
            candidate = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.oom_control"
        else:
            continue
        try:
            for entry in candidate.read_text().splitlines():
                key, _, value = entry.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


def lasting(fleet_reason: str | None, exitcode: int | None, *, during_job: bool, oom_kills_during_job: bool) -> bool:
    """Whether a poisoning was the job's own doing, so a retry on the same group would meet it again (the
    module docstring's rule)."""
    if not during_job:
        return False
    if fleet_reason in NON_TRANSIENT:
        return True
    if fleet_reason == "rank_exited" and isinstance(exitcode, int) and exitcode < 0:
        return -exitcode in _SELF_INFLICTED or (-exitcode == int(signal.SIGKILL) and oom_kills_during_job)
    return False


def record(
    conn: Any, job_id: str, fleet_reason: str | None, ttl: int, *, group: str = "", lasting: bool | None = None
) -> list[dict[str, Any]]:
    """Remember that `job_id`'s render poisoned group `group`'s fleet (for `fleet_reason`; `lasting`: the
    job's own doing, see `lasting`; None: from the reason alone); returns every entry so far."""
    key = poisoned_key(job_id)
    reason = str(fleet_reason or "unknown")
    entry = {
        "reason": reason,
        "group": str(group),
        "lasting": bool(reason in NON_TRANSIENT if lasting is None else lasting),
    }
    entries = [*_entries(conn, key), entry][-_KEPT:]
    conn.set(key, json.dumps(entries), ex=max(1, int(ttl)))
    return entries


def refusal(
    conn: Any, job_id: str, budget: int, entries: list[dict[str, Any]] | None = None, *, group: str = ""
) -> str | None:
    """Why `job_id` must not be rendered again by a worker of `group` (None: it may be), given the
    `fleet_failure` retry budget. `entries`: what `record` returned, or read from Redis."""
    entries = _entries(conn, poisoned_key(job_id)) if entries is None else entries
    reasons = [e["reason"] for e in entries]
    lasting_here = [e for e in entries if e["lasting"] and (e["group"] == str(group) or not e["group"])]
    lasting_all = [e for e in entries if e["lasting"]]
    listed = ", ".join(f"{e['reason']}@{e['group']}" if e["group"] else e["reason"] for e in entries)
    if lasting_here or len(lasting_all) > 1:
        first = (lasting_here or lasting_all)[0]
        where = f" on group {first['group']}" if first["group"] and lasting_here else " on two groups"
        return (
            f"this job's render poisoned a fleet for a cause a retry would meet again ({first['reason']})"
            f"{where}: it is not rendered again there (fleet reasons: {listed})"
        )
    if len(reasons) > max(0, budget):
        return (
            f"this job's render poisoned a fleet {len(reasons)} times: it is not rendered again "
            f"(fleet reasons: {listed})"
        )
    return None


def _entries(conn: Any, key: str) -> list[dict[str, Any]]:
    raw = conn.get(key)
    if raw is None:
        return []
    try:
        value = json.loads(raw)
    except (TypeError, ValueError):
        value = None
    if not isinstance(value, list):  # (only workers write it; junk still counts as poisoned, never as clean)
        log.warning("unreadable poisoned-job record %s; taking it as a lasting cause", key)
        return [{"reason": "split", "group": "", "lasting": True}]
    out = []
    for v in value:
        if isinstance(v, dict):
            out.append(
                {
                    "reason": str(v.get("reason"))[:40],
                    "group": str(v.get("group") or "")[:64],
                    "lasting": bool(v.get("lasting")),
                }
            )
        else:  # (a record written before groups were kept: a bare reason)
            out.append({"reason": str(v)[:40], "group": "", "lasting": str(v) in NON_TRANSIENT})
    return out
