"""One worker process: one device group, one warm fleet, one `FleetWorker` loop.

`run_worker()` wires the parts together in dependency order — logging, metrics/health endpoint, Redis,
storage check (fail fast on a configuration error; an unreachable endpoint only marks storage degraded:
renders wait in the spool and uploads retry), spool, runner import,
fleet start (blocks until the model is warm), then RQ's work loop — and returns the process exit code:

| code | meaning                                                                                     |
|------|---------------------------------------------------------------------------------------------|
| 0    | stopped on request (SIGTERM/SIGINT), or burst/max-jobs finished                              |
| 2    | a configuration error: invalid settings, storage misconfigured (4xx, unwritable), Redis      |
|      | refusing our credentials, LTX_REDIS_URL naming a server that is not Redis, a GPU group on a  |
|      | machine whose torch sees no such GPU                                                        |
| 3    | the fleet could not be (re)built `max_rebuild_failures` times in a row                      |

(`worker.runtime.exit_codes` holds them; the supervisor restarts every exit but 2, with back-off, and never gives up.)

Configuration errors end the process at once with one line saying what to fix (and the supervisor does
not restart a worker that exits 2). Transient ones wait: Redis not reachable yet (a start before the
database) is retried with back-off, and the log says so each time; storage unreachable at start only
marks storage degraded.
"""

from __future__ import annotations

import functools
import logging
import signal
from types import FrameType
from typing import Any, NoReturn

from ltx_contract.shared_settings import safe_redis_url
from worker.ops.logs import event_text, rank_logging
from worker.runtime.exit_codes import EXIT_BAD_CONFIG, EXIT_FLEET_UNRECOVERABLE, EXIT_OK
from worker.settings import SettingsError, WorkerSettings, resolve_runner

__all__ = ["EXIT_BAD_CONFIG", "EXIT_OK", "build_worker", "process_started_at", "run_worker"]

log = logging.getLogger("worker.runtime.process")


class _StartupInterrupted(BaseException):  # not an Exception: build-failure handlers must not catch it
    pass


def wait_for_redis(settings: WorkerSettings, *, first_delay_s: float = 0.5, max_delay_s: float = 10.0) -> None:
    """Return once Redis answers PING; while it is unreachable wait with back-off and say so (transient: it
    may be starting). Refused credentials, no such database, a TLS certificate that does not verify, or a
    server that answers but not in the Redis protocol (LTX_REDIS_URL naming another service's port) are a
    configuration error (`SettingsError`: exit 2, not restarted), in the producer's words
    (`ltx_contract.redis_conn.redis_problem`). A SIGTERM/SIGINT during the wait ends it through the
    caller's startup handler."""
    import ssl
    import time

    import redis

    from ltx_contract.redis_conn import connect

    url = settings.redis_url
    client = connect(settings, socket_connect_timeout=3, socket_timeout=3)
    delay, t0 = first_delay_s, time.monotonic()
    try:
        while True:
            try:
                client.ping()
            except redis.AuthenticationError as exc:
                raise SettingsError(_misconfigured(exc, url)) from exc
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if isinstance(exc.__context__, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(exc):
                    raise SettingsError(_misconfigured(exc, url)) from exc
                log.warning(
                    "Redis at %s is not reachable (%s); waiting %.1fs before trying again (waited %.0fs)",
                    safe_redis_url(url),
                    exc,
                    delay,
                    time.monotonic() - t0,
                )
                time.sleep(delay)
                delay = min(max_delay_s, delay * 2)
                continue
            except (redis.exceptions.InvalidResponse, redis.ResponseError) as exc:  # not Redis (an HTTP port),
                raise SettingsError(_misconfigured(exc, url)) from exc  # NOAUTH, no such database: waiting won't help
            if time.monotonic() - t0 > 1:
                log.info("Redis at %s is reachable", safe_redis_url(url))
            return
    finally:
        client.close()


def _controller(*args: Any, **kwargs: Any) -> Any:
    """`MGPUController(*args, **kwargs)`, imported when the fleet is built (it imports torch)."""
    from ltx_mgpu import MGPUController

    return MGPUController(*args, **kwargs)


def _misconfigured(exc: BaseException, url: str) -> str:
    """What is wrong with the Redis settings, in the words the producer uses for the same error."""
    from ltx_contract.redis_conn import redis_problem

    problem = redis_problem(exc, url)
    return problem[0] if problem else f"Redis at {safe_redis_url(url)} refused us (LTX_REDIS_URL): {exc}"


def check_devices(devices: list[str], group: str) -> None:
    """A GPU group needs those GPUs: a configuration error (`SettingsError`) rather than ranks dying at
    `set_device` over and over. Imports torch only for a GPU group."""
    cuda = [d for d in devices if d.startswith("cuda:")]
    if not cuda:
        return
    import torch

    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [d for d in cuda if int(d.split(":")[1]) >= available]
    if missing:
        seen = f"{available} GPU(s)" if available else "no GPU (CPU-only torch or no driver)"
        raise SettingsError(
            f"group {group!r} needs {', '.join(missing)}, but torch {torch.__version__} sees "
            f"{seen}; on a machine without GPUs use --group cpu:N"
        )


def place_for(settings: WorkerSettings, runner_cls: type, devices: list[str]) -> Any:
    """The fleet's placement and setup kwargs (`worker.render.fleet_plan`); a fleet that fits in no placement is
    a `SettingsError` (one line), as is a runner whose memory description fails."""
    from worker.render.fleet_plan import place_fleet

    describe = getattr(runner_cls, "memory_fleet", None)
    setup = {k: v for k, v in settings.runner_setup.items() if k != "placement"}
    try:
        fleet = describe(len(devices), **setup) if describe is not None else None
    except Exception as exc:  # a runner's bug here is a configuration error of this deployment: exit 2, one line
        raise SettingsError(f"runner ({settings.runner!r}) memory description: {type(exc).__name__}: {exc}") from exc
    return place_fleet(settings, devices, fleet)


def _checked_storage(settings: WorkerSettings) -> tuple[Any, str | None]:
    """The worker's storage, checked: a definite configuration error raises (exit 2); storage unreachable right now
    (an outage, the endpoint restarting) starts anyway, degraded: renders wait in the spool and their uploads retry,
    and health, metrics and the log say so (the second value: why)."""
    from worker.uploads.storage import StorageError, make_storage

    storage = make_storage(settings)
    try:
        storage.check()
    except StorageError as exc:
        if not exc.retryable:
            raise  # a 4xx answer, an unwritable directory: do not start
        log.warning("storage degraded at start (renders wait in the spool, uploads retry): %s", exc)
        return storage, str(exc)
    return storage, None


def _runner_limits(settings: WorkerSettings, runner_cls: type, placed: Any, world_size: int) -> Any:
    """The runner's limits with the fleet's placement and card, and the warm-up requests checked against them: a
    runner's bug here, or a warm-up the limits refuse (it would fail every build), is a configuration error."""
    from ltx_contract.limits import RunnerLimits
    from ltx_contract.schema import RenderRequest

    try:
        limits = RunnerLimits.of(
            settings.runner,
            runner_cls,
            placed.setup_kwargs,
            world_size=world_size,
            capacity_gib=settings.device_memory_gib or placed.capacity_gib,
            headroom_gib=settings.memory_headroom_gib,
            lora_limits=settings.lora_limits(),
        )
    except Exception as exc:  # exit 2, one line
        raise SettingsError(f"runner ({settings.runner!r}) request limits: {type(exc).__name__}: {exc}") from exc
    for i, raw in enumerate(settings.warmup_requests):
        if refused := limits.violations(RenderRequest.model_validate(raw)):
            raise SettingsError(f"LTX_WARMUP_REQUESTS[{i}] is refused by the runner's limits: {refused[0].message()}")
    return limits


def build_worker(settings: WorkerSettings, group: str, *, controller_factory: Any = None) -> Any:
    """Build (but do not start) the `FleetWorker` for `group`, with its service, fleet and storage."""
    from ltx_contract.redis_conn import connect
    from ltx_mgpu.control.devices import parse_device_group
    from worker.job import install_service
    from worker.ops.metrics import WorkerMetrics
    from worker.render.fleet import WarmFleet
    from worker.render.service import RenderService
    from worker.runtime.fleet_worker import FleetWorker
    from worker.uploads.spool import Spool

    devices = parse_device_group(group)
    check_devices(devices, group)
    name = settings.worker_name_for(group)
    metrics = WorkerMetrics(group)
    storage, storage_error = _checked_storage(settings)
    spool = Spool(settings.spool_dir)
    runner_cls = resolve_runner(settings)
    placed = place_for(settings, runner_cls, devices)  # before anything loads: exit 2 if it can never fit
    log.info("fleet %s: %s", group, placed.describe())
    limits = _runner_limits(settings, runner_cls, placed, len(devices))

    def fleet_event(event: dict[str, Any]) -> None:
        if event.get("action") == "warmup_dropped":  # (worker.render.warmup logged it: one warning line)
            metrics.warmup_dropped.labels(group, str(event.get("reason"))).inc()
            return
        log.info("fleet %s: %s", group, event_text(event))
        if isinstance(event.get("startup"), dict):
            metrics.set_fleet_startup(event["startup"])

    if controller_factory is None:  # (its ranks log as this process does: `worker.ops.logs.rank_logging`)
        ranks_log = functools.partial(rank_logging, settings.log_level, settings.log_format, group, name)
        controller_factory = functools.partial(_controller, rank_logging=ranks_log)
    fleet = WarmFleet(
        runner_cls,
        devices,
        setup_kwargs=placed.setup_kwargs,
        start_timeout=settings.fleet_start_timeout,
        shutdown_timeout=settings.fleet_shutdown_timeout,
        error_settle_s=settings.fleet_error_settle_s,
        deterministic=settings.deterministic,
        max_failures=settings.max_rebuild_failures,
        backoff_s=settings.rebuild_backoff_s,
        factory=controller_factory,
        on_event=fleet_event,
        warmup=settings.warmup_jobs(),
        warmup_dir=settings.spool_dir / ".warmup",
        warmup_timeout=settings.render_timeout,
    )
    service = RenderService(
        settings,
        group=group,
        worker_name=name,
        fleet=fleet,
        storage=storage,
        spool=spool,
        metrics=metrics,
        limits=limits,
    )
    service.set_storage_state(storage_error)
    service.process_started_at = process_started_at()
    install_service(service)
    connection = connect(settings, health_check_interval=30)
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
    from worker.ops.logs import setup_logging
    from worker.uploads.storage import StorageError

    setup_logging(settings.log_level, settings.log_format, group=group, worker=settings.worker_name_for(group))
    log.info("worker starting: group %s, queues %s, runner %s", group, settings.queues, settings.runner)
    if parent_pid is not None:
        _watch_parent(parent_pid)

    def interrupted(signum: int, frame: FrameType | None) -> NoReturn:
        raise _StartupInterrupted(signal.Signals(signum).name)

    old_term = signal.signal(signal.SIGTERM, interrupted)
    old_int = signal.signal(signal.SIGINT, interrupted)
    worker = None
    health = None
    try:
        try:
            wait_for_redis(settings)
            worker = build_worker(settings, group)
        except (SettingsError, StorageError) as exc:
            log.critical("cannot start: %s", exc)
            return EXIT_BAD_CONFIG
        health, failed = _start_serving(worker, settings, index)
        if failed is not None:
            return failed
    except _StartupInterrupted as exc:
        log.info("stopped by %s during startup", exc)
        if worker is not None:
            worker.service.fleet.shutdown(0)
            worker.health.stop()
        return EXIT_OK
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)

    return _run_loop(worker, settings, burst, max_jobs, health)


def _start_serving(worker: Any, settings: WorkerSettings, index: int) -> tuple[Any, int | None]:
    """The metrics and health port, the spool's recovery (renders a previous process left upload while the fleet
    starts, and count against the back-pressure bound before the first job), the fleet warm, and the supervisor
    told. Returns the health server and, when the fleet could not be started, the exit code."""
    from worker.ops.metrics import HealthServer
    from worker.render.fleet import FleetUnrecoverable
    from worker.runtime.readiness import report_to_supervisor

    health = None
    port = settings.metrics_port_for(index)
    if port is not None:
        health = HealthServer(worker.service.metrics, worker.health_snapshot, host=settings.metrics_host, port=port)
        health.start()
        worker.metrics_port = health.port
        log.info("metrics and health on port %d", health.port)
    worker.health.start()  # (the snapshot says "starting" while the fleet loads)
    worker.service.start_uploads(worker.connection)
    try:
        worker.service.fleet.start()  # warm before the first job
    except FleetUnrecoverable as exc:
        log.critical("%s", exc)
        worker.health.stop()
        return health, EXIT_FLEET_UNRECOVERABLE
    worker.service.metrics.set_fleet_state(worker.service.fleet.state, alive=worker.service.fleet.is_alive)
    worker.service.update_spool_metrics()
    report_to_supervisor(worker.readiness)  # (its `/readyz` answer, kept current for the supervisor's)
    return health, None


def _run_loop(worker: Any, settings: WorkerSettings, burst: bool, max_jobs: int | None, health: Any) -> int:
    """The work loop until it stops; the fleet and the health server stopped on the way out. Returns the exit code."""

    # RQ installs its handlers only once its loop starts, after it has registered the worker: a signal in
    # between would take the default action and kill the process (-15) with the fleet still up. Until then a
    # signal asks the loop to stop at its first turn: a warm stop like any other.
    def stop_when_the_loop_starts(signum: int, frame: FrameType | None) -> None:
        log.info("stop requested (%s) while the work loop starts", signal.Signals(signum).name)
        worker.stop_at_first_turn()

    signal.signal(signal.SIGTERM, stop_when_the_loop_starts)
    signal.signal(signal.SIGINT, stop_when_the_loop_starts)
    try:
        worker.run(burst=burst, max_jobs=max_jobs, logging_level=settings.log_level)
    except SystemExit as exc:  # cold stop (code None/0) or an unrecoverable fleet (code 3)
        code = exc.code if isinstance(exc.code, int) else 0
        return code or worker.exit_code
    finally:
        worker.service.fleet.shutdown(0)
        if health is not None:
            health.stop()
        log.info("worker exiting")
    return worker.exit_code


def process_started_at(pid: int | None = None) -> float:
    """When a process started (wall clock), from Linux /proc; now where /proc cannot tell."""
    import os
    import time
    from pathlib import Path

    try:
        fields = Path(f"/proc/{pid or os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime: seconds after boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])  # (btime is whole seconds: too coarse)
        return time.time() - (uptime - started)
    except (OSError, ValueError, IndexError):
        return time.time()


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
