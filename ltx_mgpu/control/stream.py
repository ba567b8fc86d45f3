"""`Stream`: the caller's handle of one dispatched job, and how a job's end is classified.

Iterating it yields every rank's yields in arrival order (the controller reads them, `_next_result`); it ends
when every rank has finished: `StopIteration` with the per-rank results, or the error `_classify` picks
(the contract is in `controller.py`'s docstring). The monitor thread asks it for a "split" job
(`_split_failure`): some ranks ended it with an error and the others did not within the settle time.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NoReturn

from .errors import (
    AsymmetricRunnerError,
    FleetFailure,
    JobCancelledError,
    RunnerCancelled,
    RunnerError,
    SymmetricRunnerError,
)
from .job_board import cancel_key
from .transport import MessageKind

if TYPE_CHECKING:
    from .controller import MGPUController
    from .processes import FleetProcesses

__all__ = ["Stream"]

log = logging.getLogger("ltx_mgpu.control.controller")


class Stream(Iterator[Any]):
    """The handle of one dispatched job. Iterate it from the dispatching thread only.

    Elements are the ranks' yields in arrival order. At the end: `StopIteration` carrying the per-rank
    return values ordered by rank (`result = yield from stream`), or a classified error.
    """

    def __init__(
        self,
        controller: MGPUController,
        fleet: FleetProcesses,
        job_id: int,
        thread_id: int,
        deadline: float | None,
        timeout: float | None,
    ) -> None:
        self.job_id = job_id
        self._controller = controller
        self._fleet = fleet
        self._thread_id = thread_id
        self._deadline = deadline
        self._timeout = timeout
        self._terminals: dict[int, BaseException | StopIteration] = {}
        self._settle_deadline: float | None = None  # set by the first error terminal (`_split_failure`)
        self._finished = False
        self.result: list[Any] | None = None  #: per-rank return values once the job ended cleanly

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Any:
        if threading.get_ident() != self._thread_id:
            raise RuntimeError(
                f"Stream for job {self.job_id} is single-threaded: dispatched on thread {self._thread_id}, "
                f"iterated from thread {threading.get_ident()} -- a job belongs to its dispatching thread."
            )
        if self._finished:
            raise StopIteration
        world = self._controller.world_size
        while True:
            try:
                msg = self._controller._next_result(self)
            except FleetFailure:
                self._finished = True
                raise
            if msg.kind is MessageKind.YIELD:
                return msg.value
            self._terminals[msg.rank] = StopIteration(msg.value) if msg.kind is MessageKind.DONE else msg.value
            if msg.kind is not MessageKind.DONE and self._settle_deadline is None:
                self._settle_deadline = time.monotonic() + self._controller._error_settle_s
            if len(self._terminals) == world:
                self._finished = True
                self._controller._finish(self)
                self._classify()

    def _classify(self) -> NoReturn:
        """Raise how the job ended: `StopIteration(result)` when no rank raised, else the classified error."""
        terminals = [self._terminals[r] for r in range(len(self._terminals))]
        errors = [t for t in terminals if isinstance(t, RunnerError)]
        if not errors:
            self.result = [t.value for t in terminals]  # type: ignore[union-attr]
            raise StopIteration(self.result)
        if len(errors) == len(terminals):
            if all(isinstance(e, RunnerCancelled) for e in errors):
                raise JobCancelledError(errors)
            raise SymmetricRunnerError(errors)
        log.error("asymmetric RunnerError across ranks: %r", terminals)
        raise AsymmetricRunnerError(terminals)

    def _split_failure(self) -> FleetFailure | None:
        """(monitor) Some ranks ended the job with an error and the others have not ended it within the
        settle time: they are blocked in a collective the raising ranks left, and only killing them
        unblocks them. The fleet-level failure to poison with, or None."""
        deadline = self._settle_deadline
        if deadline is None or time.monotonic() <= deadline:
            return None
        terminals = dict(self._terminals)
        raised = {r: t for r, t in terminals.items() if not isinstance(t, StopIteration)}
        pending = [r for r in range(self._controller.world_size) if r not in terminals]
        if not raised or not pending:
            return None
        first = next(iter(raised.values()))
        return FleetFailure(
            f"MGPU job {self.job_id}: rank(s) {sorted(raised)} ended it with an error ({first}) and rank(s) "
            f"{pending} did not end it within {self._controller._error_settle_s:g}s (blocked in a collective "
            "the others left); the fleet is poisoned",
            reason="split",
            rank=pending[0],
        )

    def drain(self) -> None:
        """Consume to the end, discarding yields and recoverable errors; fatal errors propagate."""
        with contextlib.suppress(SymmetricRunnerError, AsymmetricRunnerError):
            for _ in self:
                pass

    def cancel(self) -> None:
        """Ask the runner to stop at its next `raise_if_cancelled()` point. Any thread; idempotent."""
        if self._finished:
            return
        with contextlib.suppress(Exception):
            self._fleet.store.set(cancel_key(self.job_id), b"1")

    @property
    def done(self) -> bool:
        return self._finished
