"""How the CLI shows jobs, events and the service: rich progress bars on a terminal, plain lines elsewhere.

On a terminal `watch` draws one progress bar per stage (denoise, decode, upload, ...) and prints state
changes above them. When stdout is not a terminal (CI logs, pipes, tests) every event becomes one plain,
greppable line instead, because redrawn bars are noise in a log file.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ltx_contract.states import EventType, JobState
from producer.client import JobEvent, JobInfo, Stats

__all__ = ["EventPrinter", "human_bytes", "printable", "render_job_table", "render_stats", "render_status"]


def human_bytes(size: float | None) -> str:
    if size is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _ago(value: datetime | None) -> str:
    if value is None:
        return "-"
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    seconds = max(0.0, time.time() - value.timestamp())
    if seconds < 60:
        return f"{seconds:.0f}s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _count(n: object, noun: str) -> str:
    """ "1 rank", "2 ranks" (and "? ranks" when unknown)."""
    return f"{n} {noun}" if n == 1 else f"{n if n is not None else '?'} {noun}s"


def _clock(ts: float | None) -> str:
    return datetime.fromtimestamp(ts if ts is not None else time.time()).strftime("%H:%M:%S")


def _state_line(data: dict[str, Any]) -> str:
    """A one-line description of a `state` event."""
    state = str(data.get("state"))
    if state == JobState.STARTED.value:
        extra = f" on {data.get('worker')} (fleet {data.get('fleet')}, attempt {data.get('attempt')})"
        if data.get("queue_wait_s") is not None:
            extra += f", waited {float(data['queue_wait_s']):.2f}s"
        return "started" + extra
    if state == JobState.RENDERING.value:
        return f"rendering on {data.get('devices')} ({_count(data.get('world_size'), 'rank')})"
    if state == JobState.RENDERED.value:
        extra = f" in {float(data['render_s']):.2f}s" if data.get("render_s") is not None else ""
        return f"rendered {human_bytes(data.get('bytes'))}{extra}"
    if state == JobState.UPLOADING.value:
        return f"uploading {human_bytes(data.get('bytes'))} to {data.get('key')}"
    if state == JobState.UPLOADED.value:
        result = data.get("result") or {}
        where = f"s3://{result.get('bucket')}/{result.get('key')}" if result.get("bucket") else result.get("url")
        sha = str(result.get("sha256") or "")[:16]
        return f"uploaded {where} ({human_bytes(result.get('size'))}, sha256 {sha}…)"
    if state in (JobState.FAILED.value, JobState.RETRYING.value):
        error = data.get("error") or {}
        head = "failed" if state == JobState.FAILED.value else f"retrying ({data.get('retry')}/{data.get('of')})"
        return f"{head}: {error.get('reason')}: {error.get('message')}"
    if state == JobState.CANCELLED.value:
        return "cancelled" + (f" ({data['message']})" if data.get("message") else "")
    return state


def _fleet_details(data: dict[str, Any]) -> str:
    """`key=value, ...` of a fleet event, without what says nothing: unset values, and the error id, which
    the one-line message already ends with (`[error id ...: details in the worker log]`, printed twice)."""
    message = str(data.get("message") or "")
    shown = {k: v for k, v in data.items() if k not in ("type", "ts", "action") and v is not None}
    if str(shown.get("error_id")) in message:
        del shown["error_id"]
    return ", ".join(f"{k}={v}" for k, v in shown.items())


class _StepsColumn(ProgressColumn):
    """`step/total  pct%`, or nothing while a stage's total is unknown (a stage event carries none)."""

    def render(self, task: Task) -> Text:
        if not task.fields.get("counted", True):
            return Text("done" if task.finished else "")
        if not task.total:
            return Text("")
        if task.description == "upload":
            return Text(f"{human_bytes(task.completed)}/{human_bytes(task.total)} {task.percentage:5.1f}%")
        return Text(f"{task.completed:>4.0f}/{task.total:<4.0f} {task.percentage:5.1f}%")


class EventPrinter:
    """Turns a job's events into progress bars (terminal) or lines (anything else)."""

    def __init__(self, console: Console, job_id: str, *, live: bool | None = None) -> None:
        self.console = console
        self.job_id = job_id
        self.live = console.is_terminal if live is None else live
        self.progress: Progress | None = None
        self.tasks: dict[str, TaskID] = {}
        self._last_plain: dict[str, float] = {}

    def __enter__(self) -> EventPrinter:
        if self.live:
            self.progress = Progress(
                TextColumn("[bold]{task.description:>10}"),
                BarColumn(bar_width=36),
                _StepsColumn(),
                TextColumn("{task.fields[eta]}"),
                TimeElapsedColumn(),
                console=self.console,
                transient=False,
            )
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def _line(self, text: str) -> None:
        """One plain line: no markup (event data may contain brackets), no highlighting, no folding."""
        self.console.print(printable(text), markup=False, highlight=False, soft_wrap=True)

    def note(self, text: str) -> None:
        """A line outside the event stream (reconnects, hints)."""
        self._line(f"{_clock(None)} {text}")

    def show(self, event: JobEvent) -> None:
        data = event.data
        ts = data.get("ts")
        if event.type == EventType.STATE.value:
            self._line(f"{_clock(ts)} {_state_line(data)}")
            if data.get("state") == JobState.UPLOADED.value:
                self._finish_all()
            return
        if event.type == EventType.STAGE.value:
            stage = str(data.get("stage"))
            if self.progress is not None:
                task = self._task(stage, None)
                if not self.progress.tasks[task].total:
                    self.progress.update(task, counted=False)
            else:
                self._line(f"{_clock(ts)} stage {stage}")
            return
        if event.type == EventType.PROGRESS.value:
            stage = str(data.get("stage"))
            step, total = int(data.get("step") or 0), int(data.get("total") or 0)
            eta = data.get("eta_s")
            if self.progress is not None:
                task = self._task(stage, total or None)
                eta_text = f"eta {float(eta):.1f}s" if eta is not None and step < total else ""
                self.progress.update(task, completed=step, total=total or None, eta=eta_text, refresh=True)
            else:
                pct = f" ({100.0 * step / total:.0f}%)" if total else ""
                eta_text = f" eta {float(eta):.1f}s" if eta is not None else ""
                self._line(f"{_clock(ts)} {stage} {step}/{total}{pct}{eta_text}")
            return
        if event.type == EventType.UPLOAD.value:
            if data.get("error"):
                self._line(
                    f"{_clock(ts)} upload attempt {data.get('attempt')} failed: {data.get('error')}; "
                    f"retry in {data.get('retry_in_s')}s",
                )
                return
            done, total = data.get("bytes"), data.get("total")
            if self.progress is not None and total:
                task = self._task("upload", float(total))
                self.progress.update(task, completed=float(done or 0), total=float(total), refresh=True)
            elif total:
                # (throttled to one line a second, but the last one always shows: no "256 KiB/25 MiB" line
                # right before "uploaded")
                line = f"{_clock(ts)} upload {human_bytes(done)}/{human_bytes(total)}"
                self._throttled("upload", line, force=bool(data.get("done")) or done == total)
            return
        if event.type == EventType.OUTPUT.value:
            # (a render whose frames went to the worker's encoder has no file yet: the size comes with `rendered`)
            size = human_bytes(data.get("bytes")) if data.get("bytes") else "to the encoder"
            self._line(
                f"{_clock(ts)} output {data.get('width')}x{data.get('height')} {data.get('frames')} frames "
                f"@ {data.get('fps')} fps, {size}",
            )
            return
        if event.type == EventType.FLEET.value:
            self._line(f"{_clock(ts)} fleet {data.get('action')}: {_fleet_details(data)}")
            return
        self._line(f"{_clock(ts)} {event.type}: {data}")

    def _task(self, name: str, total: float | None) -> TaskID:
        assert self.progress is not None
        if name not in self.tasks:
            self._finish_all()  # a new stage means the previous ones are done
            self.tasks[name] = self.progress.add_task(name, total=total, eta="", counted=True)
        elif total:
            self.progress.update(self.tasks[name], counted=True)
        return self.tasks[name]

    def _finish_all(self) -> None:
        """Show every stage so far as complete (stages that never reported steps say "done")."""
        if self.progress is None:
            return
        for task_id in self.tasks.values():
            task = self.progress.tasks[task_id]
            if task.total:
                self.progress.update(task_id, completed=task.total, eta="")
            else:
                self.progress.update(task_id, total=1, completed=1, eta="", counted=False)
                self.progress.stop_task(task_id)

    def _throttled(self, key: str, line: str, every_s: float = 1.0, *, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_plain.get(key, 0.0) >= every_s:
            self._last_plain[key] = now
            self._line(line)


def printable(text: object) -> str:
    """`text` with control and format characters (terminal escape sequences, carriage returns, bidi
    overrides) written as `\\x1b`-style escapes: prompts, errors and names come from other clients, and must
    never drive the reader's terminal. Line breaks and tabs stay text (a multi-line error reads as lines,
    not as `\\n`): they move the cursor only forward, so they cannot hide or rewrite what was printed."""
    value = str(text).replace("\r\n", "\n").replace("\t", "    ")
    if value.isprintable():
        return value
    return "".join(ch if ch.isprintable() or ch == "\n" else ascii(ch)[1:-1] for ch in value).rstrip("\n")


def _row(table: Table, *cells: object) -> None:
    """Add a row of plain text: worker names, prompts and error messages may contain [brackets] and
    control characters (escaped)."""
    table.add_row(*(Text(printable(cell)) for cell in cells))


def render_status(console: Console, info: JobInfo) -> None:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    _row(table, "job", info.job_id)
    _row(table, "state", info.state + (f"  (rq: {info.rq_status})" if info.rq_status else ""))
    _row(table, "queue", str(info.queue))
    meta = info.meta
    if meta.get("stage") and not info.terminal:
        pct = f" {meta['percent']:.0f}%" if meta.get("percent") is not None else ""
        step = f" {meta.get('step')}/{meta.get('total')}" if meta.get("total") else ""
        eta = f", eta {meta['eta_s']:.1f}s" if meta.get("eta_s") is not None else ""
        _row(table, "stage", f"{meta['stage']}{step}{pct}{eta}")
    if meta.get("worker"):
        _row(table, "worker", f"{meta.get('worker')} (fleet {meta.get('fleet')}, attempt {meta.get('attempt')})")
    if meta.get("deterministic"):  # (the fleet's mode: docs/producer.md, "Reproducible renders")
        _row(table, "deterministic", str(meta["deterministic"]))
    _row(table, "enqueued", _ago(info.enqueued_at))
    if info.requeued_at:
        _row(table, "re-queued", _ago(info.requeued_at))
    if info.started_at:
        _row(table, "started", _ago(info.started_at))
    if info.ended_at:
        _row(table, "ended", _ago(info.ended_at))
    if info.request:
        _row(table, "request", request_line(info.request))
    for used in meta["loras"] if isinstance(meta.get("loras"), list) else []:
        if isinstance(used, dict):  # (worker.render.loras: the request's LoRAs as this job used them)
            how = "cached" if used.get("cached") else f"fetched {human_bytes(used.get('fetch_bytes'))}"
            _row(table, "lora", f"{used.get('lora')} x{used.get('strength')} ({how})")
    if meta.get("lora_swap_s") is not None:
        _row(table, "lora swap", f"{meta['lora_swap_s']} s")
    digests = meta.get("digests") if isinstance(meta.get("digests"), dict) else {}
    if digests.get("frames_sha256"):  # (what was rendered, before the encode: docs/producer.md)
        _row(table, "frames", f"sha256 {digests['frames_sha256']}")
        _row(table, "audio", f"sha256 {digests.get('audio_sha256') or '-'}")
    if info.error:
        _row(table, "error", f"{info.error.get('reason')}: {info.error.get('message')}")
    attempts = info.meta.get("attempts") if isinstance(info.meta.get("attempts"), list) else []
    for a in attempts:
        if isinstance(a, dict):
            _row(table, "attempt", f"{a.get('attempt')}: {a.get('outcome')}, {a.get('reason')} on {a.get('worker')}")
    if info.result:
        r = info.result
        _row(table, "object", f"s3://{r.get('bucket')}/{r.get('key')}" if r.get("bucket") else str(r.get("url")))
        _row(table, "size", f"{human_bytes(r.get('size'))}  sha256 {r.get('sha256')}")
        timings = r.get("timings") or {}
        if timings:
            _row(table, "timings", ", ".join(f"{k} {v}" for k, v in timings.items() if v is not None))
    console.print(table)


def render_job_table(console: Console, rows: list[JobInfo], title: str) -> None:
    table = Table(title=title, title_justify="left")
    for col in ("job", "state", "stage", "progress", "fleet", "enqueued", "prompt"):
        table.add_column(col, no_wrap=col != "prompt", overflow="fold" if col == "prompt" else "ellipsis")
    for info in rows:
        meta = info.meta
        live = not info.terminal
        progress = f"{meta.get('step')}/{meta.get('total')}" if meta.get("total") and live else ""
        prompt = str((info.request or {}).get("prompt", ""))[:40]
        if info.request is None and info.error and info.error.get("reason") == "unreadable":
            prompt = f"(skipped: {info.error.get('message')})"
        stage = str(meta.get("stage") or "") if live else ""
        fleet = str(meta.get("fleet") or "")
        _row(table, info.job_id, info.state, stage, progress, fleet, _ago(info.enqueued_at), prompt)
    console.print(table)


def render_stats(console: Console, stats: Stats) -> None:
    queues = Table(title="queues", title_justify="left")
    for col in ("queue", "waiting", "running", "finished", "failed", "cancelled", "cap"):
        queues.add_column(col, justify="left" if col == "queue" else "right")
    cap = stats.max_queue_depth
    for q in stats.queues:
        fill = f"{q.queued}/{cap}" if cap else "no cap"
        _row(queues, q.name, str(q.queued), str(q.started), str(q.finished), str(q.failed), str(q.canceled), fill)
    console.print(queues)

    workers = Table(title="workers", title_justify="left")
    for col in ("worker", "group", "state", "fleet", "current job", "jobs", "heartbeat"):
        workers.add_column(col)
    for w in stats.workers:
        fleet = w.health.fleet if w.health is not None else None
        fleet_text = w.fleet_state or "?"
        if fleet is not None:
            fleet_text += f" ({_count(len(fleet.pids), 'rank')}"
            fleet_text += f", {fleet.rebuilds} rebuilds)" if fleet.rebuilds else ")"
        jobs_done = w.health.jobs_done if w.health is not None else None
        _row(
            workers,
            w.name,
            w.group or "?",
            w.state,
            fleet_text,
            w.current_job or "-",
            "-" if jobs_done is None else str(jobs_done),
            _ago(w.last_heartbeat),
        )
    if not stats.workers:
        _row(workers, "(none)", "", "", "", "", "", "")
    console.print(workers)
    for w in stats.workers:
        if w.health_error:
            console.print(
                f"worker {w.name}: health snapshot unreadable: {w.health_error}", markup=False, soft_wrap=True
            )

    failures = Table(title="recent failures", title_justify="left")
    for col in ("job", "queue", "reason", "message", "ended"):
        failures.add_column(col, overflow="fold" if col == "message" else "ellipsis")
    for f in stats.failures:
        _row(failures, f.job_id, f.queue, f.reason or "-", f.message[:80], _ago(f.ended_at))
    if not stats.failures:
        _row(failures, "(none)", "", "", "", "")
    console.print(failures)
    quota = (
        f"{stats.client_unfinished}/{stats.client_quota}"
        if stats.client_quota
        else f"{stats.client_unfinished} (no quota)"
    )
    console.print(
        f"admission: cap {cap or 'none'} waiting jobs per queue; client {stats.client!r}: {quota} unfinished",
        markup=False,
        soft_wrap=True,
    )


def request_line(req: dict[str, Any]) -> str:
    """One line for a request: size, frames and seed as far as it names them (a job enqueued through plain
    RQ may carry only a prompt: the worker's defaults apply, and nothing reads `None frames, seed None`)."""
    size = f"{req['width']}x{req['height']}" if req.get("width") and req.get("height") else None
    parts = [
        p
        for p in (
            size,
            f"{req['num_frames']} frames" if req.get("num_frames") is not None else None,
            f"seed {req['seed']}" if req.get("seed") is not None else None,
        )
        if p
    ]
    prompt = f'"{str(req.get("prompt"))[:60]}"'  # (quoted as text: a repr showed escapes)
    return f"{', '.join(parts)}: {prompt}" if parts else prompt
