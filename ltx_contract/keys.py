"""Redis names of the render service: keys, job ids, tenants and queues, job owners, in one place.

Job states, event types and failure reasons: `ltx_contract.states`; the checks of the `LTX_*` settings
the worker and the producer share: `ltx_contract.shared_settings`.

Imports only the standard library so the producer (and any non-Python client that reads this file as
documentation) can share it without pulling in torch, rq or boto3.

Redis layout (besides RQ's own `rq:*` keys; RQ is used with its JSON serializer, so every RQ value is
JSON too):

| key                              | type   | written by | what                                           |
|----------------------------------|--------|------------|------------------------------------------------|
| `rq:job:<id>` field `meta`       | hash   | worker     | JSON summary: `states.SUMMARY_FIELDS`          |
| `rq:job:<id>` field `ltx_cancel_requested` | hash | a client | a cancel without PUBLISH (`CANCEL_REQUESTED_FIELD`) |
| `rq:job:<id>` field `ltx_requeued` | hash | worker | its last re-queue's token (`REQUEUE_TOKEN_FIELD`) |
| `ltx:job:<id>:events`            | stream | worker     | one entry per event (fields `type`, `data`)    |
| `ltx:worker:<name>:health`       | string | worker     | JSON health snapshot, expires with the worker  |
| `rq:queue:<queue>`               | list   | worker, operators | the shared queue: no tenant may write it |
| `rq:queue:<queue>:t:<tenant>`    | list   | tenant `<tenant>` | its own queue (`tenant_queue`): ids only it can push |
| `rq:queues`                      | set    | worker     | the queues workers serve (tenants may not add to it) |

Tenant queues (`LTX_TENANTS`): every tenant pushes only onto its own RQ queue `<queue>:t:<tenant>` (one per
configured queue, so priorities hold), each with RQ's own registries (`rq:wip:<queue>:t:<tenant>`, ...).
Workers serve the shared queue and every tenant queue of each configured queue, tenants in turn, and check
each id before it counts or runs (`worker.jobs.tenant_queues`): what a tenant pushes lands where only its own
jobs are counted.

The event stream is capped with `XADD ... MAXLEN ~ events_maxlen` and expires with the job (result TTL
on success, failure TTL otherwise). The health key is refreshed with RQ's heartbeat.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "ANONYMOUS_CLIENT",
    "CANCEL_REQUESTED_FIELD",
    "EVENTS_KEY_TEMPLATE",
    "EVENT_FIELD_DATA",
    "EVENT_FIELD_TYPE",
    "JOB_ID_MAX_LEN",
    "KEY_PREFIX",
    "REFUSALS_KEY",
    "RENDER_FUNC",
    "REQUEUE_TOKEN_FIELD",
    "RQ_ENDED_STATUSES",
    "TENANT_QUEUE_INFIX",
    "WORKER_HEALTH_KEY_TEMPLATE",
    "base_queue",
    "check_client_name",
    "check_job_id",
    "check_tenant_name",
    "events_key",
    "job_owner",
    "job_tenant",
    "queue_tenant",
    "tenant_job_id",
    "tenant_queue",
    "worker_health_key",
]


KEY_PREFIX = "ltx"

#: The dotted path producers enqueue (`queue.enqueue(RENDER_FUNC, request_dict, ...)`); RQ resolves it in
#: the worker, so the producer never imports the worker.
RENDER_FUNC = "worker.job.render"

EVENTS_KEY_TEMPLATE = KEY_PREFIX + ":job:{job_id}:events"

#: Longest job id accepted (by the producer at submit and by the worker before it runs a job). An id names
#: a spool directory, an S3 key and Redis keys, and tags every log line of its job: an unbounded one broke
#: the spool (`File name too long`) and flooded the log.
JOB_ID_MAX_LEN = 128
_JOB_ID = re.compile(r"[A-Za-z0-9_-]+")


def check_job_id(job_id: str) -> str:
    """`job_id` if it is 1-`JOB_ID_MAX_LEN` letters, digits, `_` or `-`; else ValueError (never echoes more
    than the start of a long id)."""
    if not isinstance(job_id, str) or not 0 < len(job_id) <= JOB_ID_MAX_LEN or not _JOB_ID.fullmatch(job_id):
        shown = repr(job_id[:40]) + ("..." if len(job_id) > 40 else "") if isinstance(job_id, str) else repr(job_id)
        raise ValueError(
            f"job id {shown} ({len(job_id) if isinstance(job_id, str) else '?'} characters): "
            f"use 1-{JOB_ID_MAX_LEN} letters, digits, _ or -"
        )
    return job_id


# ==== tenant job ids (`<tenant>-<id>`): Redis ACL users own their keys by this prefix ==================

_TENANT_NAME = re.compile(r"[A-Za-z0-9_]{1,32}")


def check_tenant_name(name: str) -> str:
    """`name` if it can own Redis keys by prefix (job ids `<name>-<id>`, ACL key patterns
    `rq:job:<name>-*`): 1-32 letters, digits or `_`. No `-` and no `.`, so tenant `alice`'s `alice-*` never
    matches another tenant's keys (`alice_x-1`); else ValueError."""
    if not isinstance(name, str) or not _TENANT_NAME.fullmatch(name):
        raise ValueError(f"tenant name {str(name)[:40]!r}: use 1-32 letters, digits or _ (no - or .)")
    return name


def tenant_job_id(tenant: str, job_id: str) -> str:
    """`job_id` in `tenant`'s namespace: `<tenant>-<job_id>`, unless it already starts with `<tenant>-`."""
    prefix = check_tenant_name(tenant) + "-"
    return job_id if job_id.startswith(prefix) else prefix + job_id


def job_tenant(job_id: str) -> str | None:
    """The tenant a tenant-namespaced job id belongs to (its part before the first `-`), or None."""
    head, sep, rest = job_id.partition("-")
    return head if sep and rest and _TENANT_NAME.fullmatch(head) else None


#: Infix of a tenant's own queue: `<queue>:t:<tenant>` (configured queue names may not contain it).
TENANT_QUEUE_INFIX = ":t:"


def tenant_queue(queue: str, tenant: str) -> str:
    """The RQ queue name of `tenant`'s own queue for the configured `queue` (idempotent)."""
    suffix = TENANT_QUEUE_INFIX + check_tenant_name(tenant)
    return queue if queue.endswith(suffix) else queue + suffix


def queue_tenant(queue: str) -> str | None:
    """The tenant owning the RQ queue `queue` (`<queue>:t:<tenant>`), None for a shared queue."""
    head, sep, tenant = queue.rpartition(TENANT_QUEUE_INFIX)
    return tenant if sep and head and _TENANT_NAME.fullmatch(tenant) else None


def base_queue(queue: str) -> str:
    """The configured queue a tenant queue belongs to (the queue itself when shared)."""
    return queue.rpartition(TENANT_QUEUE_INFIX)[0] if queue_tenant(queue) else queue


#: Job-hash field a client sets to cancel a job without `PUBLISH` or access to the shared queue list (a
#: tenant's Redis user: `ltx_contract.control`). Workers skip a dequeued job that carries it and stop a running
#: one at the next heartbeat. Neither RQ nor the worker ever writes or clears it, so no save can undo it.
CANCEL_REQUESTED_FIELD = KEY_PREFIX + "_cancel_requested"

#: Job-hash field the worker writes with the (random) token of each re-queue of a job RQ saw finish
#: (`worker.rq.record.JobRecord.requeue_after_return`): a retry after a lost reply finds its own token and
#: pushes nothing a second time. A tenant may write the field but cannot guess a token.
REQUEUE_TOKEN_FIELD = KEY_PREFIX + "_requeued"

WORKER_HEALTH_KEY_TEMPLATE = KEY_PREFIX + ":worker:{name}:health"

#: Jobs a worker took out of its queues without running them (over the depth cap or a client's quota),
#: waiting to be recorded as failed (`worker.rq.loop.admission`): a list of JSON objects.
REFUSALS_KEY = KEY_PREFIX + ":worker:refusals"

# ==== job owners (the client a job counts against; checked by the producer and by the worker) =========

#: The owner of a job whose meta names no `client` (enqueued without the producer).
ANONYMOUS_CLIENT = "anonymous"
_CLIENT_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")

#: RQ statuses after which a job no longer counts as unfinished (for quotas, on both sides).
RQ_ENDED_STATUSES = frozenset({"finished", "failed", "stopped", "canceled"})


def check_client_name(client: str) -> str:
    """`client` if it is 1-64 letters, digits or `_.@-` (it becomes part of a Redis key and is shown to
    operators); else ValueError (a 10k-character name and `"x:*\\nFAKE"` passed the API before)."""
    if not isinstance(client, str) or not _CLIENT_NAME.fullmatch(client):
        raise ValueError(f"client name {str(client)[:40]!r}: use 1-64 letters, digits or _.@-")
    return client


def job_owner(meta: Any) -> str:
    """The client a job counts against: its meta `client` (written by the producer), checked by
    `check_client_name` (ValueError if malformed); a job whose meta names none is `ANONYMOUS_CLIENT`'s."""
    client = meta.get("client") if isinstance(meta, dict) else None
    return ANONYMOUS_CLIENT if client is None else check_client_name(client)


#: Stream entry fields: `type` (an `EventType` value, for cheap filtering) and `data` (the whole event as
#: a JSON object, which repeats `type` and adds `ts`, the worker's wall-clock time in seconds).
EVENT_FIELD_TYPE = "type"
EVENT_FIELD_DATA = "data"


def events_key(job_id: str) -> str:
    """The Redis Stream holding a job's events."""
    return EVENTS_KEY_TEMPLATE.format(job_id=job_id)


def worker_health_key(name: str) -> str:
    return WORKER_HEALTH_KEY_TEMPLATE.format(name=name)
