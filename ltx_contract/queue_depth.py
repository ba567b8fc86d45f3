"""What counts as a waiting job when the queue depth is counted: one rule for the producer (at submit,
`producer.admission`) and the worker (each admission pass, `worker.rq.loop.admission`).

An entry of an RQ queue list counts only if it names a job that can still run: its hash exists and its
RQ status is not an ended one (`RQ_ENDED_STATUSES`), counted once however often it is queued. Anything
else (an id with no hash, an ended job pushed again, a repeat) counts for nothing: the dequeue drops it
uncounted (`worker.rq.loop.queues.entry_problem`), so counting it would let junk on a shared queue (no
ACL: anyone may LPUSH there) fill the cap and end jobs the producer had admitted.

Entries are judged within `DEPTH_WINDOW` entries from the heads of the queues (in serving order: one
pipelined read of their statuses); an entry further back is unknown. The producer counts an unknown entry
as a job (it may refuse a submit it could admit: the safe side), the worker counts it for nothing and
trims it only when the cap's worth of jobs is already found ahead of it; so whatever the producer admits,
no worker ends as past the cap. Counting reads nothing when the lists together are shorter than the cap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis

from ltx_contract.keys import RQ_ENDED_STATUSES

__all__ = ["DEPTH_WINDOW", "counts_as_waiting", "waiting_depth"]

DEPTH_WINDOW = 1000  #: entries from the heads of the queues whose statuses a count reads


def counts_as_waiting(status: bytes | str | None) -> bool:
    """Whether a queue entry whose hash has RQ `status` (None: no hash) counts as a waiting job."""
    if status is None:
        return False
    text = status.decode(errors="replace") if isinstance(status, bytes) else status
    return text not in RQ_ENDED_STATUSES


def waiting_depth(connection: Any, queue_keys: Sequence[str], job_key: Callable[[str], str], cap: int) -> int:
    """The waiting jobs on `queue_keys` by the module's rule, exact up to `cap` (a count of `cap` or more
    means "at least the cap"): entries in the first `DEPTH_WINDOW` count when they are jobs, entries past
    it count each. Reads nothing but the lengths while the lists hold fewer than `cap` entries together.
    `connection` may be a WATCHing pipeline (its reads run at once); the statuses are read in one
    pipelined round trip of their own (job hashes are not watched)."""
    lengths = [int(connection.llen(key)) for key in queue_keys]
    if sum(lengths) < cap:
        return sum(lengths)
    ids: list[str] = []
    budget, unknown = DEPTH_WINDOW, 0
    for key, length in zip(queue_keys, lengths, strict=True):
        n = min(length, budget)
        if n:
            ids += [i.decode(errors="replace") for i in connection.lrange(key, 0, n - 1)]
        budget -= n
        unknown += length - n
    pipe = redis.Redis(connection_pool=connection.connection_pool).pipeline(transaction=False)
    for job_id in dict.fromkeys(ids):
        pipe.hget(job_key(job_id), "status")
    return sum(counts_as_waiting(s) for s in pipe.execute()) + unknown
