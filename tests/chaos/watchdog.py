"""Deadlines for every step of a chaos run, so a stall is a finding with a cause, never a silent hang.

Why: one soak run stopped moving for over three minutes until an outer timeout killed it, with nothing
saying what it waited for. Each step of a run now goes through `Watchdog.step(what, seconds)`; a monitor
thread checks the step's deadline and, when it passes, records what was awaited with every thread's
stack, and interrupts the main thread (a real signal, so even a blocking socket read or a `sleep` is cut
short) with `Stalled(what)`. The run catches it and fails the seed naming the step.

The interrupt needs the run on the main thread (pytest and `tests/chaos/soak.py` both do that); elsewhere the
watchdog still records the stall and the step's own bounded waits end it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from types import FrameType

__all__ = ["Stalled", "Watchdog"]

_SIGNAL = signal.SIGUSR1


class Stalled(BaseException):
    """A step of the run passed its deadline; `what` names what it was waiting for. (A BaseException, so
    the `except Exception` of a retry loop inside the step cannot swallow it.)"""

    def __init__(self, what: str, seconds: float, stacks: str = "") -> None:
        super().__init__(f"stalled: {what} took over {seconds:.0f}s")
        self.what = what
        self.seconds = seconds
        self.stacks = stacks


class Watchdog:
    """Use as a context manager around a run; wrap each step in `with dog.step("...", seconds):`."""

    def __init__(self, poll_s: float = 0.5) -> None:
        self.poll_s = poll_s
        self.stalls: list[str] = []
        self._step: tuple[str, float, float] | None = None  # (what, seconds, deadline)
        self._fired: Stalled | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._main = threading.main_thread()
        self._can_interrupt = threading.current_thread() is self._main
        self._previous_handler: object = None

    def __enter__(self) -> Watchdog:
        if self._can_interrupt:
            self._previous_handler = signal.signal(_SIGNAL, self._on_signal)
        self._thread = threading.Thread(target=self._watch, name="chaos-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._can_interrupt:
            signal.signal(_SIGNAL, self._previous_handler)  # type: ignore[arg-type]

    @contextlib.contextmanager
    def step(self, what: str, seconds: float) -> Iterator[None]:
        """A step that must end within `seconds`; raises `Stalled(what)` in the main thread if it does not.
        Steps do not nest: an inner step replaces the outer one's deadline until it ends."""
        with self._lock:
            outer = self._step
            self._step = (what, seconds, time.monotonic() + seconds)
        try:
            yield
        finally:
            with self._lock:
                self._step = outer

    # ---- internals ------------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                step = self._step
                if step is None or time.monotonic() < step[2] or self._fired is not None:
                    continue
                what, seconds, _ = step
                self._fired = Stalled(what, seconds, _all_stacks())
                self.stalls.append(str(self._fired))
            if self._can_interrupt:
                signal.pthread_kill(self._main.ident, _SIGNAL)  # type: ignore[arg-type]

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        with self._lock:
            fired, self._fired = self._fired, None
        if fired is not None:
            raise fired


def _all_stacks() -> str:
    """Every thread's stack, as faulthandler prints them (it needs a real file)."""
    with tempfile.TemporaryFile("w+") as fh:
        faulthandler.dump_traceback(file=fh, all_threads=True)
        fh.seek(0)
        return fh.read()[-12000:]
