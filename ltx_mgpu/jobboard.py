"""Store-key job announcements: how idle ranks wait for work *outside* any collective.

If idle ranks sat inside a pending broadcast between jobs, a long idle period would trip the collective
timeout (NCCL's watchdog, gloo's timeout) and a dead relay would leave them hung in C++. Instead the relay
rank writes each job's skeleton under a sequence-numbered key of the rendezvous store, and the other ranks
block in `store.wait` on the next key (event-driven on the store server: no polling). Only once a job
exists do they enter the tensor broadcast for it.

The controller owns the store server (it outlives any rank), and also uses it for cancellation flags.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["JobBoard", "cancel_key"]

_IDLE_WAIT = timedelta(hours=12)  # re-armed forever; a rank whose parent dies is ended by its watchdog


def cancel_key(job_id: int) -> str:
    return f"cancel/{job_id}"


class JobBoard:
    """Sequence-numbered announcements in a `dist.Store`. Rank 0 posts; every other rank reads in order."""

    def __init__(self, store: dist.Store) -> None:
        self._store = store
        self._seq = 0  # next sequence number to post (relay) or to read (others)

    def post(self, announcement: Any) -> None:
        """Relay only. `None` announces shutdown."""
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
