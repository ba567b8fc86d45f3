"""The console side of a running `producer backfill`: its progress (a bar on a terminal; otherwise one line per
finished job, per admission wait and per Redis outage) and its Ctrl+C (the first asks the loop to stop cleanly, with
the manifest flushed; the second aborts at once). The command itself is `producer.cli.backfill`; the loop is
`producer.backfill.Backfill`."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from producer.backfill import Backfill, BackfillSummary, ManifestRecord

__all__ = ["BackfillProgress", "first_sigint_sets"]


class BackfillProgress:
    """A progress bar on a terminal; otherwise one line per finished job and per admission wait."""

    def __init__(self, console: Console, *, live: bool) -> None:
        self.console = console
        self.live = live
        self.bar: Progress | None = None
        self.task: Any = None
        self._waiting = False
        self._down = False

    def __enter__(self) -> BackfillProgress:
        if self.live:
            self.bar = Progress(
                TextColumn("[bold]backfill"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self.bar.start()
            self.task = self.bar.add_task("backfill", total=None, info="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def update(self, summary: BackfillSummary, note: str, runner: Backfill) -> None:
        refusal = runner.refusal
        waiting = f" · waiting: {refusal.message().split(';')[0]}" if refusal is not None else ""
        if self.bar is not None:
            info = (
                f"{summary.uploaded + summary.already_done} ok · {summary.failed} failed · "
                f"enqueued {summary.enqueued} · adopted {summary.adopted}{waiting}"
            )
            self.bar.update(self.task, total=summary.total, completed=summary.done, info=info, refresh=True)
            return
        if note == "start":
            self.console.print(f"backfill: {summary.total} jobs, {summary.already_done} already done per manifest")
        elif note == "unavailable" and not self._down:
            self.console.print("backfill: Redis unreachable; retrying (Ctrl+C to stop, run again to resume)")
        elif note == "reconnected":
            self.console.print("backfill: Redis reachable again; continuing")
        self._down = note == "unavailable" or (self._down and note != "reconnected")
        if refusal is not None and not self._waiting:
            self.console.print(f"backfill: waiting for room{waiting.removeprefix(' · waiting')}")
        self._waiting = refusal is not None

    def record(self, record: ManifestRecord) -> None:
        if self.bar is None:
            where = f" {record.key}" if record.key else ""
            err = f" {record.error.get('reason')}: {record.error.get('message')}" if record.error else ""
            self.console.print(f"backfill: {record.job_id} {record.state}{where}{err} ({record.source})")


@contextlib.contextmanager
def first_sigint_sets(stop: threading.Event) -> Iterator[None]:
    """First Ctrl+C: ask the loop to stop cleanly (manifest flushed); second: abort at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
