"""One worker process: one device group, one warm fleet, one `FleetWorker` loop.

`run_worker()` wires the parts together in dependency order — logging, metrics/health endpoint, Redis,
storage check (fail fast on a configuration error; an unreachable endpoint only marks storage degraded:
renders wait in the spool and uploads retry), spool, runner import,
fleet start (blocks until the model is warm), then RQ's work loop — and returns the process exit code:

| code | meaning                                                                |
|------|------------------------------------------------------------------------|
| 0    | stopped on request (SIGTERM/SIGINT), or burst/max-jobs finished         |
| 2    | invalid settings or storage misconfigured at start (4xx, unwritable)    |
| 3    | the fleet could not be (re)built `max_rebuild_failures` times in a row |
"""

from __future__ import annotations

import logging
import signal
from types import FrameType
from typing import Any

from .settings import SettingsError, WorkerSettings, resolve_runner

__all__ = ["EXIT_BAD_CONFIG", "EXIT_OK", "build_worker", "run_worker"]

log = logging.getLogger("worker.process")

EXIT_OK = 0
EXIT_BAD_CONFIG = 2


class _StartupInterrupted(BaseException):  # not an Exception: build-failure handlers must not catch it
    pass


def build_worker(settings: WorkerSettings, group: str, *, controller_factory: Any = None) -> Any:
    """Build (but do not start) the `FleetWorker` for `group`, with its service, fleet and storage."""
    import redis

    from ltx_mgpu.devices import parse_device_group

    from .fleet import FleetSupervisor
    from .job import install_service
    from .limits import RunnerLimits
    from .metrics import WorkerMetrics
    from .rqworker import FleetWorker
    from .service import RenderService
    from .spool import Spool
    from .storage import StorageError, make_storage

    name = settings.worker_name_for(group)
    metrics = WorkerMetrics(group)
    storage = make_storage(settings)
    storage_error: str | None = None
    try:
        storage.check()
    except StorageError as exc:
        if not exc.retryable:
            raise  # a definite configuration error (4xx answer, unwritable directory): do not start
        # Storage unreachable right now (an outage, a restart of the endpoint): start anyway. Renders go to
        # the spool and their uploads retry; health, metrics and the log say storage is degraded.
        storage_error = str(exc)
        log.warning("storage degraded at start (renders wait in the spool, uploads retry): %s", exc)
    spool = Spool(settings.spool_dir)
    runner_cls = resolve_runner(settings)
    try:
        limits = RunnerLimits.of(settings.runner, runner_cls, settings.runner_setup)
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"runner ({settings.runner!r}) request limits: {exc}") from exc

    def fleet_event(event: dict[str, Any]) -> None:
        log.info("fleet %s: %s", group, event)

    fleet = FleetSupervisor(
        runner_cls,
        parse_device_group(group),
        setup_kwargs=settings.runner_setup,
        start_timeout=settings.fleet_start_timeout,
        shutdown_timeout=settings.fleet_shutdown_timeout,
        max_failures=settings.max_rebuild_failures,
        backoff_s=settings.rebuild_backoff_s,
        factory=controller_factory,
        on_event=fleet_event,
    )
    service = RenderService(settings, group=group, worker_name=name, fleet=fleet, storage=storage, spool=spool,
                            metrics=metrics, limits=limits)  # fmt: skip
    service.set_storage_state(storage_error)
    install_service(service)
    connection = redis.Redis.from_url(settings.redis_url, health_check_interval=30)
    return FleetWorker(settings.queues, connection=connection, service=service)


def run_worker(
    settings: WorkerSettings,
    group: str,
    *,
    index: int = 0,
    burst: bool = False,
    max_jobs: int | None = None,
    parent_pid: int | None = None,
) -> int:
    """Run one worker process to completion; returns the exit code (see the module docstring).

    `parent_pid`: the supervisor's pid. Workers run in their own sessions (so a terminal's Ctrl+C reaches
    only the supervisor); if the supervisor dies without stopping them, they warm-stop themselves.
    """
    from .logs import setup_logging
    from .metrics import HealthServer
    from .storage import StorageError

    setup_logging(settings.log_level, settings.log_format, group=group, worker=settings.worker_name_for(group))
    log.info("worker starting: group %s, queues %s, runner %s", group, settings.queues, settings.runner)
    if parent_pid is not None:
        _watch_parent(parent_pid)

    def interrupted(signum: int, frame: FrameType | None) -> None:
        raise _StartupInterrupted(signal.Signals(signum).name)

    old_term = signal.signal(signal.SIGTERM, interrupted)
    old_int = signal.signal(signal.SIGINT, interrupted)
    worker = None
    health = None
    try:
        try:
            worker = build_worker(settings, group)
        except (SettingsError, StorageError) as exc:
            log.critical("cannot start: %s", exc)
            return EXIT_BAD_CONFIG
        port = settings.metrics_port_for(index)
        if port is not None:
            health = HealthServer(worker.service.metrics, worker.health_snapshot, host=settings.metrics_host,
                                  port=port).start()  # fmt: skip
            worker.metrics_port = health.port
            log.info("metrics and health on port %d", health.port)
        from .fleet import FleetUnrecoverable
        from .rqworker import EXIT_FLEET_UNRECOVERABLE

        worker.health.start()  # (the snapshot says "starting" while the fleet loads)
        # Recovery starts before the (possibly minutes-long) fleet start: renders a previous process left
        # in the spool upload meanwhile, and count against the back-pressure bound before the first job.
        worker.service.start_uploads(worker.connection)
        try:
            worker.service.fleet.start()  # warm before the first job
        except FleetUnrecoverable as exc:
            log.critical("%s", exc)
            worker.health.stop()
            return EXIT_FLEET_UNRECOVERABLE
        worker.service.metrics.set_fleet_state(worker.service.fleet.state, alive=worker.service.fleet.is_alive)
        worker.service.update_spool_metrics()
    except _StartupInterrupted as exc:
        log.info("stopped by %s during startup", exc)
        if worker is not None:
            worker.service.fleet.shutdown(0)
            worker.health.stop()
        return EXIT_OK
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)

    try:
        worker.work(burst=burst, max_jobs=max_jobs, logging_level=settings.log_level, with_scheduler=False)
    except SystemExit as exc:  # cold stop (code None/0) or an unrecoverable fleet (code 3)
        code = exc.code if isinstance(exc.code, int) else 0
        return code or worker.exit_code
    finally:
        worker.service.fleet.shutdown(0)
        if health is not None:
            health.stop()
        log.info("worker exiting")
    return worker.exit_code


def _watch_parent(parent_pid: int) -> None:
    """SIGTERM ourselves (a warm stop) once the supervisor is gone (we are re-parented)."""
    import os
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        log.warning("supervisor (pid %d) is gone: stopping", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="ltx-parent-watch", daemon=True).start()
