"""Store-key job announcements: how idle ranks wait for work *outside* any collective.

If idle ranks sat inside a pending broadcast between jobs, a long idle period would trip the collective
timeout (NCCL's watchdog, gloo's timeout) and a dead driver would leave them hung in C++. Instead the driver
rank writes each job's skeleton under a sequence-numbered key of the rendezvous store, and the other ranks
block in `store.wait` on the next key (event-driven on the store server: no polling). Only once a job
exists do they enter the tensor broadcast for it.

The controller owns the store server (it outlives any rank), and also uses it for cancellation flags;
`CancelPoints` turns a flag into one decision that every rank takes at the same step.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any, ClassVar

import torch.distributed as dist

__all__ = ["CancelPoints", "JobBoard", "cancel_key"]

_IDLE_WAIT = timedelta(hours=12)  # re-armed forever; a rank whose parent dies is ended by its watchdog


def cancel_key(job_id: int) -> str:
    return f"cancel/{job_id}"


class JobBoard:
    """Sequence-numbered announcements in a `dist.Store`. Rank 0 posts; every other rank reads in order."""

    def __init__(self, store: dist.Store) -> None:
        self._store = store
        self._seq = 0  # next sequence number to post (driver) or to read (others)

    def post(self, announcement: Any) -> None:
        """Driver only. `None` announces shutdown."""
        self._store.set(f"job/{self._seq}", pickle.dumps(announcement, protocol=pickle.HIGHEST_PROTOCOL))
        if self._seq > 0:
            # Safe: job seq-1 finished on every rank before the controller dispatched this one,
            # so every rank has already read its key.
            self._store.delete_key(f"job/{self._seq - 1}")
        self._seq += 1

    def next(self) -> Any:
        """Block until the next announcement and return it."""
        key = f"job/{self._seq}"
        while True:
            try:
                self._store.wait([key], _IDLE_WAIT)
                break
            except dist.DistStoreError:
                continue
        self._seq += 1
        return pickle.loads(self._store.get(key))


class CancelPoints:
    """Cooperative cancellation decided at the same call on every rank, without a collective.

    Every rank calls `check()` at the same points of a job (e.g. once per denoising step). Every `every`-th
    call is a decision: rank 0 reads the caller's flag (`probe`) and writes its answer under a key of the
    job; the other ranks read that key, waiting in the store only if rank 0 has not got there yet. So rank 0
    never waits for anybody, and the others never run more than `every` calls ahead of it; the gloo
    broadcast this replaces made every rank wait for every other at every step. A world of one reads the
    flag and writes nothing.

    Keys stay bounded however many calls a job makes (a runner may poll in a tight loop): every `ACK_EVERY`
    decisions each other rank adds to a counter of the decisions it has read, and rank 0, every
    `ACK_EVERY` decisions, deletes the keys every rank has read (one `add(key, 0)` per rank: reads that
    never wait). The rest go when the next job starts (`cleanup`): the controller dispatches a job only
    after the previous one ended on every rank, so by then every rank has read them (the JobBoard's
    argument).
    """

    ACK_EVERY: ClassVar[int] = 64  #: decisions between a rank's read report and between rank 0's deletions

    def __init__(
        self, store: dist.Store, job_id: int, *, rank: int, world_size: int, probe: Any = None, every: int = 1
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self._store = store
        self._job_id = int(job_id)
        self._rank = int(rank)
        self._world_size = int(world_size)
        self._probe = probe  # callable() -> bool, rank 0 only
        self.every = int(every)
        self._calls = 0
        self._decisions = 0  # decisions taken so far (this rank)
        self._written: dict[int, str] = {}  # rank 0: decision number -> key not deleted yet

    def check(self) -> bool:
        """True on every rank alike iff rank 0 saw the flag at this decision point."""
        call = self._calls
        self._calls += 1
        if call % self.every:
            return False
        seen = self._rank == 0 and self._probe is not None and bool(self._probe())
        if self._world_size == 1:
            return seen
        decision = self._decisions
        self._decisions += 1
        key = f"{cancel_key(self._job_id)}/at/{decision}"
        if self._rank == 0:
            self._store.set(key, b"1" if seen else b"0")
            self._written[decision] = key
            if self._decisions % self.ACK_EVERY == 0:
                self._drop_read()
            return seen
        answer = self._store.get(key) == b"1"  # waits for rank 0 (bounded by the store's timeout)
        if self._decisions % self.ACK_EVERY == 0:
            self._store.add(self._ack_key(self._rank), self.ACK_EVERY)
        return answer

    def _ack_key(self, rank: int) -> str:
        return f"{cancel_key(self._job_id)}/read/{rank}"

    def _drop_read(self) -> None:
        """Rank 0: delete the decision keys that every other rank has reported read."""
        read = min(self._store.add(self._ack_key(r), 0) for r in range(1, self._world_size))
        for decision in [d for d in self._written if d < read]:
            self._store.delete_key(self._written.pop(decision))

    def cleanup(self) -> None:
        """Rank 0, once every rank is past this job: drop the decision keys and the read counters."""
        for key in self._written.values():
            self._store.delete_key(key)
        self._written.clear()
        if self._rank == 0:
            for r in range(1, self._world_size):
                self._store.delete_key(self._ack_key(r))
