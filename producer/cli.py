"""`producer`: the command line of the render service (submit, status, watch, cancel, fetch, ls, stats,
backfill). A thin layer over `producer.client`; see docs/producer.md.

User errors (bad files, bad values, refused submits, unknown jobs) end with one line on stderr and a
documented exit code (`producer.exit_codes`), never a traceback.

Over 450 lines on purpose: eight short click commands sharing one group, its options and the error guard;
their logic lives in `producer.client`, `producer.backfill` (with its console, `producer.backfill_console`) and
`producer.display`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from redis.exceptions import OutOfMemoryError
from rich.console import Console
from rq.exceptions import InvalidJobOperation

from ltx_contract.keys import check_job_id
from ltx_contract.states import JobState
from producer.admission import AdmissionRefused, JobExists
from producer.backfill import Backfill, ManifestRecord, default_manifest_path
from producer.backfill_console import BackfillProgress, first_sigint_sets
from producer.client import (
    FetchRefused,
    IntegrityError,
    InvalidJobId,
    JobNotFound,
    JobNotReady,
    ProducerClient,
    ServiceUnavailable,
)
from producer.display import EventPrinter, human_bytes, printable, render_job_table, render_stats, render_status
from producer.errors import ProducerError
from producer.exit_codes import EXIT_CODE_HELP, ExitCode
from producer.loras import first_lora_problem, with_lora_options
from producer.request_file import RequestFileError, load_requests
from producer.settings import ProducerSettingsError, load_settings

__all__ = ["cli", "main"]

F = TypeVar("F", bound=Callable[..., Any])

_STATE_EXIT = {
    JobState.UPLOADED.value: ExitCode.OK,
    JobState.FAILED.value: ExitCode.JOB_FAILED,
    JobState.CANCELLED.value: ExitCode.CANCELLED,
}


class UserError(ProducerError, click.ClickException):
    """A one-line error with our exit code (click prints `Error: ...`; we print `producer: ...`)."""

    def __init__(self, message: str, code: ExitCode) -> None:
        super().__init__(message)
        self.exit_code = int(code)

    def show(self, file: Any = None) -> None:
        click.echo(f"producer: {' '.join(self.message.split())}", err=True)  # (one line, whatever it quotes)


def _guard(fn: F) -> F:
    """Map the client's exceptions to one-line messages and exit codes."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (RequestFileError, ProducerSettingsError, InvalidJobId, FetchRefused) as exc:
            raise UserError(str(exc), ExitCode.USAGE) from None
        except AdmissionRefused as exc:
            raise UserError(f"refused: {exc}", ExitCode.REFUSED) from None
        except JobExists as exc:
            raise UserError(str(exc), ExitCode.USAGE) from None
        except JobNotFound as exc:
            raise UserError(str(exc), ExitCode.NOT_FOUND) from None
        except JobNotReady as exc:
            code = _STATE_EXIT.get(exc.state, ExitCode.NOT_FINISHED)
            raise UserError(str(exc), code) from None
        except ServiceUnavailable as exc:
            raise UserError(str(exc), ExitCode.UNAVAILABLE) from None
        except OutOfMemoryError:  # (a tenant filled it, or the queue outgrew maxmemory; docs/security.md)
            raise UserError(
                "Redis is out of memory (maxmemory reached): it takes no new job now; try again "
                "later, or ask the operator",
                ExitCode.UNAVAILABLE,
            ) from None
        except IntegrityError as exc:
            raise UserError(str(exc), ExitCode.INTEGRITY) from None
        except InvalidJobOperation as exc:  # (cancel: taken by a worker that has not started it yet)
            raise UserError(f"{exc}; try again in a moment", ExitCode.NOT_FINISHED) from None
        except KeyboardInterrupt:
            raise UserError("interrupted", ExitCode.INTERRUPTED) from None

    return wrapper  # type: ignore[return-value]


def _client(ctx: click.Context, **overrides: Any) -> ProducerClient:
    """A client whose connection is already open: a wrong URL, password or database is one line and exit 6
    before any command runs (and `backfill` fails at once instead of waiting out an "outage")."""
    settings = load_settings(**{**ctx.obj, **overrides})
    client = ProducerClient(settings)
    try:
        client.check_connection()
    except BaseException:
        client.close()
        raise
    return client


def _job_id(job_id: str) -> str:
    """A job id argument, checked before anything connects: a malformed id is a usage error (exit 2, as for
    `submit --job-id`), never "no such job" or a Redis error."""
    try:
        return check_job_id(job_id)
    except ValueError as exc:
        raise UserError(f"invalid {exc}", ExitCode.USAGE) from None


def _console(*, stderr: bool = False) -> Console:
    """A console; off a terminal (logs, pipes) it is wide, so tables and URLs are not folded at 80."""
    console = Console(highlight=False, stderr=stderr)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(highlight=False, stderr=stderr, width=160)
    return console


# ==== the group =========================================================================================

_EPILOG = (
    "\b\nExit codes:\n" + EXIT_CODE_HELP + "\n\nSettings come from LTX_* environment variables (see docs/producer.md)."
)


@click.group(epilog=_EPILOG, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--redis-url", envvar="LTX_REDIS_URL", help="the service's Redis [env LTX_REDIS_URL]")
@click.option("--client", "client_name", help="client name for quotas [env LTX_CLIENT; default: user name]")
@click.version_option(package_name="ltx-mgpu", prog_name="producer")
@click.pass_context
def cli(ctx: click.Context, redis_url: str | None, client_name: str | None) -> None:
    """Submit render jobs to the ltx-mgpu service and follow them."""
    ctx.obj = {"redis_url": redis_url, "client": client_name}


# ==== submit ============================================================================================


@cli.command(epilog=_EPILOG)
@click.argument("request_file")
@click.option("--queue", "-q", help="queue to submit to [default: first of LTX_QUEUES]")
@click.option(
    "--priority",
    type=click.Choice(["normal", "high"]),
    default="normal",
    show_default=True,
    help="high puts the job at the front of its queue",
)
@click.option("--watch", "-w", is_flag=True, help="follow the job(s) until they end (exit code reflects the end)")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output (one JSON object per line)")
@click.option("--max-queue-depth", type=click.IntRange(min=0), help="override the admission cap (0: none)")
@click.option("--client-quota", type=click.IntRange(min=0), help="override the per-client quota (0: none)")
@click.option("--job-id", help="choose the job id (letters, digits, _ and -; one request only); exit 2 if it exists")
@click.option("--dry-run", is_flag=True, help="validate only; submit nothing")
@click.option(
    "--lora",
    "lora_options",
    multiple=True,
    metavar="NAME[:STRENGTH]",
    help="add a LoRA (catalogue name or s3://bucket/key) to every request; repeatable",
)
@click.pass_context
@_guard
def submit(
    ctx: click.Context,
    request_file: str,
    queue: str | None,
    priority: str,
    watch: bool,
    as_json: bool,
    max_queue_depth: int | None,
    client_quota: int | None,
    job_id: str | None,
    dry_run: bool,
    lora_options: tuple[str, ...] = (),
) -> None:
    """Validate REQUEST_FILE (a JSON object, or JSON Lines of several; - for stdin) and submit it.

    Prints one job id per line. Everything is validated before anything is submitted: a bad request
    stops the command with FILE:LINE:COLUMN and the field.
    """
    requests = load_requests(request_file)
    try:
        requests = with_lora_options(requests, lora_options)
    except ValueError as exc:
        raise UserError(str(exc), ExitCode.USAGE) from None
    if job_id is not None:
        if len(requests) != 1:
            raise UserError(f"--job-id needs exactly one request; {request_file} has {len(requests)}", ExitCode.USAGE)
        try:
            check_job_id(job_id)
        except ValueError as exc:
            raise UserError(f"--job-id: {exc}", ExitCode.USAGE) from None
    if dry_run:
        try:
            with _client(ctx) as client:
                _check_runner_limits(client, requests, queue, say_if_unchecked=True)
        except ServiceUnavailable as exc:
            if exc.misconfigured:  # (Redis answered and refused us: the settings are wrong, say so)
                raise
            click.echo(f"producer: runner limits not checked ({exc}); the request file itself is valid", err=True)
        for loaded in requests:
            click.echo(json.dumps({"source": loaded.source, "valid": True}) if as_json else f"{loaded.source}: ok")
        return
    with _client(ctx) as client:
        _check_runner_limits(client, requests, queue)
        submitted: list[str] = []
        for loaded in requests:
            try:
                job = client.submit(
                    loaded.request,
                    job_id=job_id,
                    queue=queue,
                    priority=priority,
                    max_queue_depth=max_queue_depth,
                    client_quota=client_quota,
                )
            except AdmissionRefused:
                if submitted:
                    click.echo(f"producer: {len(submitted)} of {len(requests)} submitted before the refusal", err=True)
                raise
            submitted.append(job.id)
            if as_json:
                click.echo(json.dumps({"job_id": job.id, "queue": job.origin, "source": loaded.source}))
            else:
                click.echo(job.id)
        if len(requests) > 1 and not as_json:
            click.echo(f"submitted {len(submitted)} jobs to {client.queue(queue).name}", err=True)
        if watch:
            worst = ExitCode.OK
            for submitted_id in submitted:
                code = _watch(client, submitted_id, as_json=as_json, timeout=None)
                worst = code if code != ExitCode.OK and worst == ExitCode.OK else worst
            ctx.exit(int(worst))


def _check_runner_limits(
    client: ProducerClient, requests: list[Any], queue: str | None, *, say_if_unchecked: bool = False
) -> None:
    """Refuse (exit 2, nothing submitted) a request a live worker's runner would reject (ltx_contract.limits)."""
    tenant = client.settings.client if client.settings.tenant_ids else None  # (the id prefix a worker checks)
    if refused := first_lora_problem(client.connection, client.queue(queue), requests, tenant):
        raise UserError(f"{refused}; nothing submitted", ExitCode.USAGE)
    limits = client.runner_limits(queue)
    if not limits:
        if say_if_unchecked:
            click.echo(
                f"producer: no live worker on queue {client.queue(queue).name!r} publishes runner limits; "
                "only the request schema was checked",
                err=True,
            )
        return
    for loaded in requests:
        if violations := client.limit_violations(loaded.request, limits):  # every problem, not the first of them
            said = "; ".join(dict.fromkeys(v.message() for v in violations))
            raise UserError(f"{loaded.source}: {said}; nothing submitted", ExitCode.USAGE)


# ==== status / watch ====================================================================================


@cli.command(epilog=_EPILOG)
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="print the status as one JSON object")
@click.pass_context
@_guard
def status(ctx: click.Context, job_id: str, as_json: bool) -> None:
    """Show a job's state, progress, worker and result."""
    _job_id(job_id)
    with _client(ctx) as client:
        info = client.status(job_id)
    if as_json:
        click.echo(json.dumps(info.as_json(), default=str))
    else:
        render_status(_console(), info)


@cli.command(epilog=_EPILOG)
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="print each event as a JSON line")
@click.option("--timeout", type=click.FloatRange(min=0), help="stop watching after this many seconds (exit 8)")
@click.pass_context
@_guard
def watch(ctx: click.Context, job_id: str, as_json: bool, timeout: float | None) -> None:
    """Follow a job's events until it ends; the exit code is its final state (0 uploaded, 1 failed,
    4 cancelled). A lost Redis connection is retried and resumes at the last event seen."""
    _job_id(job_id)
    with _client(ctx) as client:
        ctx.exit(int(_watch(client, job_id, as_json=as_json, timeout=timeout)))


def _watch(client: ProducerClient, job_id: str, *, as_json: bool, timeout: float | None) -> ExitCode:
    console = _console()
    deadline = None if timeout is None else time.monotonic() + timeout
    printer = EventPrinter(console, job_id, live=False if as_json else None)

    def reconnecting(exc: Exception, retry_in: float) -> None:
        if as_json:
            click.echo(json.dumps({"type": "reconnect", "error": str(exc), "retry_in_s": retry_in}))
        else:
            printer.note(f"connection lost ({type(exc).__name__}); resuming in {retry_in:.1f}s")

    try:
        with printer if not as_json else contextlib.nullcontext():
            if not as_json:
                printer.note(f"watching {job_id}")
            for event in client.follow(job_id, on_reconnect=reconnecting, deadline=deadline):
                if as_json:
                    click.echo(json.dumps({"id": event.id, **event.data}, default=str))
                else:
                    printer.show(event)
    except KeyboardInterrupt:
        click.echo(f"producer: stopped watching; job {job_id} keeps running (`producer watch {job_id}`)", err=True)
        return ExitCode.INTERRUPTED
    info = client.status(job_id)
    if not info.terminal:
        click.echo(f"producer: job {job_id} is still {info.state} after {timeout}s", err=True)
        return ExitCode.NOT_FINISHED
    if as_json:
        click.echo(json.dumps({"type": "final", **info.as_json()}, default=str))
    elif info.state == JobState.UPLOADED.value and info.result:
        r = info.result
        where = f"s3://{r.get('bucket')}/{r.get('key')}" if r.get("bucket") else r.get("url")
        console.print(printable(f"done: {where}"), markup=False, soft_wrap=True)
        if r.get("url"):
            console.print(printable(f"url:  {r['url']}"), markup=False, soft_wrap=True)
    elif info.error:
        line = f"job {info.state}: {info.error.get('reason')}: {info.error.get('message')}"
        console.print(printable(line), markup=False, soft_wrap=True)
    elif info.state == JobState.CANCELLED.value:
        console.print("job cancelled", markup=False, soft_wrap=True)
    return _STATE_EXIT.get(info.state, ExitCode.JOB_FAILED)


# ==== cancel / fetch ====================================================================================


@cli.command(epilog=_EPILOG)
@click.argument("job_id")
@click.pass_context
@_guard
def cancel(ctx: click.Context, job_id: str) -> None:
    """Cancel a job: a waiting one never runs; a running one stops at its next step (its fleet survives)."""
    _job_id(job_id)
    with _client(ctx) as client:
        outcome = client.cancel(job_id)
    messages = {
        "cancelled": f"cancelled {job_id} (it was waiting; it will not run)",
        "stop_requested": f"stop requested for {job_id}; it ends at its next step (`producer watch {job_id}`)",
    }
    click.echo(
        messages.get(outcome, f"{job_id} had already ended ({outcome.removeprefix('already_')}); nothing to cancel")
    )


@cli.command(epilog=_EPILOG)
@click.argument("job_id")
@click.option(
    "--output", "-o", type=click.Path(dir_okay=False, writable=True), help="where to write [default: <job id>.mp4]"
)
@click.option("--wait", is_flag=True, help="wait for the job to end first")
@click.option("--timeout", type=click.FloatRange(min=0), help="with --wait: give up after this many seconds")
@click.pass_context
@_guard
def fetch(ctx: click.Context, job_id: str, output: str | None, wait: bool, timeout: float | None) -> None:
    """Download a finished job's video and verify its sha256 (nothing is written on a mismatch)."""
    dest = Path(output or f"{_job_id(job_id)}.mp4")
    with _client(ctx) as client:
        if wait:
            client.wait(job_id, timeout=timeout)
        result = client.fetch(job_id, dest)
    click.echo(
        f"saved {result.path} ({human_bytes(result.size)}, sha256 {result.sha256} verified) from {result.source}"
    )


# ==== ls / stats ========================================================================================


@cli.command(name="ls", epilog=_EPILOG)
@click.option("--queue", "-q", "queues", multiple=True, help="queue(s) to list [default: LTX_QUEUES]")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True, help="jobs per section")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per job")
@click.pass_context
@_guard
def ls(ctx: click.Context, queues: tuple[str, ...], limit: int, as_json: bool) -> None:
    """List jobs: waiting, running, and recently ended."""
    with _client(ctx) as client:
        sections = client.list_jobs(list(queues) or client.settings.queues, limit)
    if as_json:
        for section, rows in sections.items():
            for info in rows:
                click.echo(json.dumps({"section": section, **info.as_json()}, default=str))
        return
    console = _console()
    for section, rows in sections.items():
        render_job_table(console, rows, f"{section} ({len(rows)})")


@cli.command(epilog=_EPILOG)
@click.option("--queue", "-q", "queues", multiple=True, help="queue(s) to show [default: LTX_QUEUES]")
@click.option("--failures", type=click.IntRange(min=0), default=5, show_default=True, help="recent failures to show")
@click.option("--json", "as_json", is_flag=True, help="print everything as one JSON object")
@click.pass_context
@_guard
def stats(ctx: click.Context, queues: tuple[str, ...], failures: int, as_json: bool) -> None:
    """Queue depths, workers with their device groups and fleet states, recent failures, admission."""
    with _client(ctx) as client:
        result = client.stats(queues=list(queues) or None, failures=failures)
    if as_json:
        click.echo(json.dumps(result.as_json(), default=str))
    else:
        render_stats(_console(), result)


# ==== backfill ==========================================================================================


@cli.command(epilog=_EPILOG)
@click.argument("requests_file")
@click.option(
    "--concurrency",
    "-n",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="jobs in flight (queued or running) at most",
)
@click.option(
    "--manifest",
    "-m",
    type=click.Path(dir_okay=False),
    help="results manifest (JSON Lines) [default: <file>.manifest.jsonl next to the input]",
)
@click.option("--queue", "-q", help="queue to submit to [default: first of LTX_QUEUES]")
@click.option("--priority", type=click.Choice(["normal", "high"]), default="normal", show_default=True)
@click.option(
    "--retry-failed/--no-retry-failed",
    default=True,
    show_default=True,
    help="re-run jobs that ended failed or cancelled",
)
@click.option("--json", "as_json", is_flag=True, help="print each manifest record and a summary as JSON lines")
@click.pass_context
@_guard
def backfill(
    ctx: click.Context,
    requests_file: str,
    concurrency: int,
    manifest: str | None,
    queue: str | None,
    priority: str,
    retry_failed: bool,
    as_json: bool,
) -> None:
    """Render every request of REQUESTS_FILE with at most N in flight; safe to interrupt and re-run.

    Job ids derive from each request's content and seed, so a re-run skips what is done or still queued,
    and Ctrl+C loses nothing: run the same command again to resume. When the queue is full the backfill
    waits instead of failing. Exit code: 0 if every job was uploaded, 1 if any failed, 130 if interrupted.

    The results manifest (one JSON line per job: id, state, key or error) is written next to the input,
    as <file>.manifest.jsonl (e.g. prompts.manifest.jsonl; git ignores *.manifest.jsonl), unless
    --manifest names another file.
    """
    requests = load_requests(requests_file)
    manifest_path = Path(manifest) if manifest else default_manifest_path(requests_file)
    console = _console(stderr=True)
    with _client(ctx) as client:
        runner: Backfill
        progress = BackfillProgress(console, live=console.is_terminal and not as_json)

        def on_record(record: ManifestRecord) -> None:
            if as_json:
                click.echo(record.to_json())
            progress.record(record)

        runner = Backfill(
            client,
            requests,
            manifest=manifest_path,
            concurrency=concurrency,
            queue=queue,
            priority=priority,
            retry_failed=retry_failed,
            on_change=lambda s, note: progress.update(s, note, runner),
            on_record=on_record,
        )
        stop = threading.Event()
        with first_sigint_sets(stop), progress:
            summary = runner.run(stop)
    line = (
        f"backfill: {summary.done}/{summary.total} done ({summary.already_done} already, {summary.uploaded} uploaded, "
        f"{summary.failed} failed, {summary.cancelled} cancelled); enqueued {summary.enqueued}, adopted "
        f"{summary.adopted}; manifest {manifest_path}"
    )
    if as_json:
        click.echo(json.dumps({"type": "summary", **summary.__dict__, "manifest": str(manifest_path)}))
    if summary.interrupted:
        console.print(line)
        console.print(
            f"interrupted: {summary.in_flight} jobs still queued or running (they keep going), "
            f"{summary.remaining} not submitted; run the same command again to resume"
        )
        ctx.exit(int(ExitCode.INTERRUPTED))
    console.print(line)
    ctx.exit(int(ExitCode.JOB_FAILED if summary.failed or summary.cancelled else ExitCode.OK))


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (`producer`)."""
    try:
        cli.main(args=argv, prog_name="producer")
    except KeyboardInterrupt:
        click.echo("producer: interrupted", err=True)
        sys.exit(int(ExitCode.INTERRUPTED))


if __name__ == "__main__":
    main()
