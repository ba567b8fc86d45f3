"""`ltx-worker` / `python -m worker`: run the render service.

    ltx-worker --group 0,1,2,3 --group 4,5,6,7      # supervisor + one worker process per group
    ltx-worker --group cpu:2                        # a CPU fleet of two ranks (no GPU needed)
    ltx-worker one --group 0,1                      # a single worker in this process (no supervisor)
    ltx-worker health --port 9400                   # probe a worker's /readyz (exit 0 when ready)
    ltx-worker settings                             # print the effective settings (secrets masked)
    ltx-worker plan --runner ltx2-distilled --group 0,1 --size 1536x1024x241   # a memory plan (runtime/plan_cli.py)
    ltx-worker redis-acl --tenant alice --password-dir /run/secrets   # a Redis ACL file (ltx_contract/redis_acl.py)
    ltx-worker redis-proxy --tenant alice=6380 --tenant bob=6381   # per-tenant connection caps (HAProxy config)

Every setting is an environment variable (`LTX_<FIELD>`) or a settings-file entry (`--settings FILE` /
`LTX_SETTINGS_FILE`); the flags below override the most common ones. See docs/worker.md.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import click

from worker.settings import SETTINGS_FILE_ENV, SettingsError, WorkerSettings, load_settings

__all__ = ["main"]

_OVERRIDES = ("redis_url", "runner", "metrics_port", "spool_dir", "log_format", "log_level")


def _common(fn: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option(
            "--settings",
            "settings_file",
            type=click.Path(dir_okay=False),
            default=None,
            help=f"settings file (.json/.toml/.yaml); default ${SETTINGS_FILE_ENV}",
        ),
        click.option("--redis-url", default=None, help="Redis URL (LTX_REDIS_URL)"),
        click.option("--queue", "queues", multiple=True, help="queue to serve, repeatable (LTX_QUEUES)"),
        click.option("--runner", default=None, help="runner name from the registry (LTX_RUNNER)"),
        click.option("--metrics-port", type=int, default=None, help="metrics port, group 0 (LTX_METRICS_PORT)"),
        click.option("--spool-dir", default=None, help="spool directory (LTX_SPOOL_DIR)"),
        click.option("--log-format", type=click.Choice(["json", "text"]), default=None),
        click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]), default=None),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _load(settings_file: str | None, groups: tuple[str, ...], queues: tuple[str, ...], **flags: Any) -> WorkerSettings:
    overrides: dict[str, Any] = {k: v for k, v in flags.items() if k in _OVERRIDES and v is not None}
    if groups:
        overrides["groups"] = list(groups)
    if queues:
        overrides["queues"] = list(queues)
    try:
        return load_settings(settings_file, **overrides)
    except SettingsError as exc:
        click.echo(str(exc), err=True)
        sys.exit(2)


def _child_env(settings: WorkerSettings, settings_file: str | None) -> dict[str, str]:
    """Hand the supervisor's effective settings to its children through LTX_* variables (the file and
    the environment are re-read there; CLI flags become variables)."""
    from worker.runtime.supervisor import child_env

    env: dict[str, str] = {}
    if settings_file:
        env[SETTINGS_FILE_ENV] = settings_file
    data = settings.model_dump(mode="json", include=set(_OVERRIDES) | {"queues"})
    for key, value in data.items():
        if value is None:
            continue
        env[f"LTX_{key.upper()}"] = json.dumps(value) if isinstance(value, list | dict) else str(value)
    return child_env(env)


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--group", "groups", multiple=True, help="device group per worker: '0,1,2,3' or 'cpu:2' (repeatable)")
@click.option("--kill-after", type=float, default=None, help="seconds after a cold stop before SIGKILL")
@_common
@click.pass_context
def main(
    ctx: click.Context,
    groups: tuple[str, ...],
    kill_after: float | None,
    settings_file: str | None,
    queues: tuple[str, ...],
    **flags: Any,
) -> None:
    """Run one worker process per device group under a supervisor (default command).

    Options given before a subcommand apply to it too (`ltx-worker --group cpu:2 settings`); the
    subcommand's own options win."""
    ctx.obj = {"groups": groups, "settings_file": settings_file, "queues": queues, **flags}
    if ctx.invoked_subcommand is not None:
        return
    from worker.ops.logs import setup_logging
    from worker.runtime.supervisor import Supervisor, child_command

    settings = _load(settings_file, groups, queues, **flags)
    setup_logging(settings.log_level, settings.log_format, group="supervisor")
    env = _child_env(settings, settings_file)
    supervisor = Supervisor(
        settings.groups,
        child_command,
        env=env,
        kill_after_s=kill_after,
        backoff_s=settings.restart_backoff_s,
        backoff_max_s=settings.restart_backoff_max_s,
        alarm_after=settings.restart_alarm_after,
        port=settings.supervisor_port,
        host=settings.metrics_host,
    )
    sys.exit(supervisor.run())


def _inherit(
    ctx: click.Context, settings_file: str | None, queues: tuple[str, ...], flags: dict[str, Any]
) -> tuple[str | None, tuple[str, ...], dict[str, Any]]:
    """Merge the options given before the subcommand (on `main`) under the subcommand's own."""
    parent = ctx.obj or {}
    merged = {k: v if v is not None else parent.get(k) for k, v in flags.items()}
    return settings_file or parent.get("settings_file"), queues or tuple(parent.get("queues", ())), merged


def _parent_groups(ctx: click.Context) -> tuple[str, ...]:
    return tuple((ctx.obj or {}).get("groups", ()))


@main.command("one")
@click.option("--group", default=None, help="this worker's device group (default: the one --group given before)")
@click.option("--index", type=int, default=0, help="group index (metrics port offset)")
@click.option("--burst", is_flag=True, help="exit when the queues are empty")
@click.option("--max-jobs", type=int, default=None, help="exit after this many jobs")
@click.option("--parent-pid", type=int, default=None, hidden=True, help="warm-stop when this process dies")
@_common
@click.pass_context
def one(
    ctx: click.Context,
    group: str | None,
    index: int,
    burst: bool,
    max_jobs: int | None,
    parent_pid: int | None,
    settings_file: str | None,
    queues: tuple[str, ...],
    **flags: Any,
) -> None:
    """Run a single worker (one fleet) in this process."""
    from worker.runtime.process import run_worker
    from worker.settings import validate_group

    settings_file, queues, flags = _inherit(ctx, settings_file, queues, flags)
    parent_groups = _parent_groups(ctx)
    if group is None:
        if len(parent_groups) != 1:
            click.echo("ltx-worker one: give exactly one --group", err=True)
            sys.exit(2)
        group = parent_groups[0]
    settings = _load(settings_file, (), queues, **flags)
    try:
        group = validate_group(group)
    except ValueError as exc:
        click.echo(f"--group: {exc}", err=True)
        sys.exit(2)
    sys.exit(run_worker(settings, group, index=index, burst=burst, max_jobs=max_jobs, parent_pid=parent_pid))


@main.command("health")
@click.option("--url", default=None, help="probe URL (default http://127.0.0.1:<port>/readyz)")
@click.option("--port", type=int, default=9400)
@click.option("--live", is_flag=True, help="probe liveness (/healthz) instead of readiness")
def health(url: str | None, port: int, live: bool) -> None:
    """Probe a worker's health endpoint; exit 0 if healthy, 1 if not (for container health checks)."""
    target = url or f"http://127.0.0.1:{port}/{'healthz' if live else 'readyz'}"
    try:
        with urllib.request.urlopen(target, timeout=5) as resp:
            click.echo(resp.read().decode())
            sys.exit(0)
    except urllib.error.HTTPError as exc:
        click.echo(exc.read().decode() or str(exc), err=True)
    except (urllib.error.URLError, OSError) as exc:
        click.echo(f"unreachable: {exc}", err=True)
    sys.exit(1)


@main.command("settings")
@_common
@click.pass_context
def show_settings(ctx: click.Context, settings_file: str | None, queues: tuple[str, ...], **flags: Any) -> None:
    """Print the effective settings as JSON (secrets masked); exit 2 if they are invalid."""
    settings_file, queues, flags = _inherit(ctx, settings_file, queues, flags)
    settings = _load(settings_file, _parent_groups(ctx), queues, **flags)
    click.echo(json.dumps(settings.public_dump(), indent=2, sort_keys=True))


def _add_redis_acl() -> None:
    from ltx_contract.redis_acl import (
        command,  # (light: the producer image runs it as `python -m ltx_contract.redis_acl`)
    )

    main.add_command(command, "redis-acl")


def _add_redis_proxy() -> None:
    from ltx_contract.redis_proxy import command  # (light, like redis-acl)

    main.add_command(command, "redis-proxy")


def _add_plan() -> None:
    from worker.runtime.plan_cli import command  # (light until run: the runner class is imported by the command)

    main.add_command(command, "plan")


_add_redis_acl()
_add_redis_proxy()
_add_plan()
