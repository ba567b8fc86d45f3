"""Tenant queues: what a tenant pushes lands where only its own jobs count, and no id runs unchecked.

Why: a tenant's Redis user can push any string onto a queue list it may write, and pushing is far cheaper
than anything done about it. Unless queues are per tenant and every dequeued id is checked, a few bogus ids
(or a tenant's own hashes naming another client as owner) make another tenant's jobs end `queue_full` and its
submits refused; a burst of them refuses every producer and holds the worker for as long as skipping them
takes; and a re-pushed failed id of another tenant renders that job again (RQ's dequeue does not check a
dequeued job's status).

The layout (`ltx_contract.keys`): with `LTX_TENANTS`, each tenant may push only onto its own RQ queue
`<queue>:t:<tenant>` (one per configured queue; its Redis ACL user may `RPUSH`/`LPUSH` nothing else:
`ltx_contract.redis_acl`). A worker serves, per configured queue in priority order, the shared queue (operators,
the worker's own re-queues of jobs enqueued there) and every tenant's queue, and:
- **takes tenants in turn** (`rotate`): after a job from one queue, the next queue of the same priority
  comes first, so a tenant with a long queue cannot keep another waiting behind it;
- **checks every id before it runs** (`worker.rq.loop.queues.entry_problem`): the hash exists, its RQ status
  is `queued` (never an ended job: finished, failed, stopped, canceled, nor one running elsewhere), its `origin`
  is the queue it was taken from, and on a tenant queue the id carries that tenant's prefix. An id failing any of these
  is dropped from RQ's intermediate list without being counted or run
  (`ltx_worker_dropped_queue_entries_total{reason}`); its hash, if any, is left alone (it is not this
  queue's to record);
- **bounds the work of one dequeue** (`worker.rq.loop.queues.TakingQueue.dequeue_any`): at most
  `worker.rq.loop.queues.JUNK_PER_QUEUE` entries are dropped from one queue per dequeue before the next queue is
  looked at; a dequeue that found only junk returns empty-handed (the worker's loop beats, checks its fleet and
  comes back; a burst worker goes on until the queues are empty). RQ's own dequeue skips missing ids in one
  unbounded loop, over the whole queue;
- **counts each tenant on its own** (`worker.rq.loop.queues.TenantAdmissions`): `LTX_MAX_QUEUE_DEPTH` and
  `LTX_CLIENT_QUOTA` hold per tenant over its own queues (and, for the shared queues, over them together), each
  by its own `worker.rq.loop.admission.Admission` pass; nothing one tenant pushes is in another's count, and the
  producer counts the same queues (`producer.client.ProducerClient.queue`).

Without `LTX_TENANTS` (one user, no ACL: the development default) the worker serves the configured queues
as before; the checks on each id and the bound per dequeue hold there too.

This module holds the rules that are names and orders (`served_queue_names`, `rotate`); the RQ side, which
moves ids between RQ's lists and reads RQ's job hashes, is `worker.rq.loop.queues`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ltx_contract.keys import base_queue, tenant_queue

__all__ = ["rotate", "served_queue_names"]


def served_queue_names(queues: Sequence[str], tenants: Sequence[str]) -> list[str]:
    """What a worker serves, in priority order: per configured queue, the shared one then each tenant's."""
    return [name for q in queues for name in (q, *(tenant_queue(q, t) for t in tenants))]


def rotate(ordered: Sequence[Any], taken: Any, name: Callable[[Any], str] = str) -> list[Any]:
    """`ordered` with the queues of `taken`'s priority (same configured queue) turned so that the one after
    `taken` comes first; other priorities keep their places (round robin among tenants, never across
    priorities)."""
    items = list(ordered)
    group = base_queue(name(taken))
    slots = [i for i, q in enumerate(items) if base_queue(name(q)) == group]
    members = [items[i] for i in slots]
    try:
        pos = [name(q) for q in members].index(name(taken))
    except ValueError:
        return items
    turned = members[pos + 1 :] + members[: pos + 1]
    for i, q in zip(slots, turned, strict=True):
        items[i] = q
    return items
