"""Units of the worker that need no fleet: fleet supervision logic (a stand-in controller factory; the real
controller is exercised by test_worker_service.py) and the process supervisor (real child processes and
signals). The event relay and the upload pipeline's records: test_worker_relay.py."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support.wait import wait_for
from worker.ops.procs import await_released
from worker.render.fleet import FleetUnrecoverable, WarmFleet
from worker.runtime.supervisor import EXIT_BAD_CONFIG, Supervisor

# ==== fleet supervision (logic) =========================================================================


_NO_SUCH_PID = 2**30  # above any pid_max: "rank processes" that are already gone


class _FakeController:
    """Stands in for MGPUController to drive WarmFleet's state machine deterministically."""

    plan: list[bool] = []  # True = start() succeeds
    made: list[_FakeController] = []

    def __init__(self, runner_cls, devices):
        self.devices = devices
        self.is_alive = False
        self.pids = [_NO_SUCH_PID + len(self.made) * 10 + i for i in range(len(devices))]
        self.shut = False
        _FakeController.made.append(self)

    def start(self, timeout, **kwargs):
        if not _FakeController.plan.pop(0):
            raise RuntimeError("setup exploded")
        self.is_alive = True

    def shutdown(self, graceful_timeout):
        self.is_alive = False
        self.shut = True

    def stream(self, timeout=None, **kwargs):
        """A job: writes its output file, or raises if the request says so (warm-up tests)."""
        self.jobs = [*getattr(self, "jobs", []), kwargs]
        if kwargs.get("prompt") == "explode":
            raise RuntimeError("warm-up exploded")
        if kwargs.get("prompt") == "interrupt":
            raise KeyboardInterrupt  # a stop signal arriving during the warm-up
        Path(kwargs["output_path"]).write_bytes(b"x")
        time.sleep(0.05)
        yield {"type": "output", "path": kwargs["output_path"]}


def _supervisor(plan: list[bool], **kw) -> WarmFleet:
    _FakeController.plan = list(plan)
    _FakeController.made = []
    events: list[dict] = []
    sup = WarmFleet(object, ["cpu", "cpu"], factory=_FakeController, backoff_s=0, on_event=events.append, **kw)
    sup.events = events  # type: ignore[attr-defined]
    return sup


def test_fleet_rebuilds_after_failure_and_retries_failed_builds():
    sup = _supervisor([True, False, True], max_failures=3)
    sup.start()
    assert sup.is_alive and sup.builds == 1 and not sup.ensure_ready()
    first = sup.controller
    first.is_alive = False  # poisoned
    info = sup.record_failure(type("F", (RuntimeError,), {"reason": "rank_exited", "rank": 1, "exitcode": 9})("x"))
    assert info["rank"] == 1 and info["exitcode"] == 9 and sup.state == "failed"
    assert sup.ensure_ready()  # one failed build, then a good one
    assert first.shut and sup.is_alive and sup.rebuilds == 1 and sup.build_failures == 1
    actions = [e["action"] for e in sup.events]
    assert actions == ["starting", "started", "failed", "rebuilding", "rebuild_failed", "rebuilding", "rebuilt"]


def test_a_fleet_failure_reported_twice_is_counted_once():
    """The controller's monitor and the job that hit the failure both report the same object, in either
    order, and the background rebuild may already have replaced the controller in between."""
    sup = _supervisor([True, True])
    seen: list[dict] = []
    sup.on_failure = seen.append
    sup.start()
    failure = type("F", (RuntimeError,), {"reason": "rank_exited", "rank": 1, "exitcode": 9})("x")
    sup.controller.is_alive = False
    sup.record_failure(failure)  # the monitor
    assert sup.ensure_ready()  # rebuilt (a new controller) before the job thread got to it
    sup.record_failure(failure)  # the job
    assert sup.failures == 1 and len(seen) == 1 and sup.state == "ready" and sup.is_alive
    assert [e["action"] for e in sup.events].count("failed") == 1


def test_fleet_gives_up_after_max_consecutive_failures():
    sup = _supervisor([False, False], max_failures=2)
    with pytest.raises(FleetUnrecoverable, match="2 times in a row"):
        sup.start()
    assert all(c.shut or not c.is_alive for c in _FakeController.made)


def test_fleet_shutdown_interrupts_backoff():
    _FakeController.plan = [False] * 10
    _FakeController.made = []
    sup = WarmFleet(object, ["cpu"], factory=_FakeController, backoff_s=30, max_failures=10)
    timer = threading.Timer(0.3, sup.shutdown)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(FleetUnrecoverable, match="interrupted"):
        sup.start()
    assert time.monotonic() - t0 < 5
    timer.join(5)
    assert sup.state == "stopped"


def test_fleet_warms_up_after_every_start_and_reports_the_phases(tmp_path):
    warm = [{"prompt": "warm a", "width": 64}, {"prompt": "warm b"}]
    sup = _supervisor([True, True], warmup=warm, warmup_dir=tmp_path / "warm")
    sup.start()
    first = sup.controller
    assert [j["prompt"] for j in first.jobs] == ["warm a", "warm b"]
    assert all(Path(j["output_path"]).parent == tmp_path / "warm" for j in first.jobs)
    assert not list((tmp_path / "warm").iterdir())  # outputs are discarded
    report = sup.startup
    assert report["warmup_jobs"] == 2 and report["warmup_s"] >= 0.1
    assert report["started_at"] <= report["ready_at"] and report["ready_s"] >= report["warmup_s"]
    assert sup.events[-1]["action"] == "started" and sup.events[-1]["startup"] == report
    first.is_alive = False
    assert sup.ensure_ready()  # a rebuild warms up again, before any job is taken
    assert [j["prompt"] for j in sup.controller.jobs] == ["warm a", "warm b"]


def test_fleet_warm_up_failure_is_a_failed_build(tmp_path):
    sup = _supervisor([True, True], warmup=[{"prompt": "explode"}], warmup_dir=tmp_path, max_failures=2)
    with pytest.raises(FleetUnrecoverable, match="warm-up request 0 failed"):
        sup.start()
    assert all(c.shut for c in _FakeController.made) and len(_FakeController.made) == 2


def test_fleet_stopped_during_warm_up_leaves_no_fleet_behind(tmp_path):
    sup = _supervisor([True], warmup=[{"prompt": "interrupt"}], warmup_dir=tmp_path)
    with pytest.raises(KeyboardInterrupt):
        sup.start()
    (ctl,) = _FakeController.made
    assert ctl.shut and sup.controller is None and sup.build_failures == 0


_STUBBORN = """
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("up", flush=True)
time.sleep(float(sys.argv[1]))
"""


def test_fleet_rebuild_waits_until_the_old_ranks_are_gone(tmp_path):
    """At real size a fleet loading while the dead one still holds its GPU memory would run out of it: the
    next build starts only once the old rank processes have exited (here: one that outlives shutdown)."""
    rank = subprocess.Popen([sys.executable, "-c", _STUBBORN, "1.5"], stdout=subprocess.PIPE)
    assert rank.stdout.readline() == b"up\n"
    reaper = threading.Thread(target=rank.wait, daemon=True)  # reap it when it exits (as its parent would)
    reaper.start()
    sup = _supervisor([True, True])
    sup.start()
    sup.controller.pids = [rank.pid]  # its "rank" ignores SIGTERM, and this controller's shutdown kills nothing
    sup.controller.is_alive = False
    built_at: list[float] = []
    original = _FakeController.start

    def start(self, timeout, **kwargs):
        built_at.append(time.monotonic())
        original(self, timeout, **kwargs)

    t0 = time.monotonic()
    try:
        _FakeController.start = start
        assert sup.ensure_ready()
    finally:
        _FakeController.start = original
    reaper.join(5)
    assert rank.returncode == 0
    assert built_at and built_at[0] - t0 >= 1.2, "the new fleet started while the old rank was still running"


def test_await_released_gives_up_at_its_deadline():
    rank = subprocess.Popen([sys.executable, "-c", _STUBBORN, "30"], stdout=subprocess.PIPE)
    try:
        assert rank.stdout.readline() == b"up\n"
        t0 = time.monotonic()
        assert not await_released([rank.pid], 0.5)
        assert 0.5 <= time.monotonic() - t0 < 3
        assert await_released([_NO_SUCH_PID], 0.5)
    finally:
        rank.kill()
        rank.wait(10)


# ==== process supervisor ================================================================================

_CHILD = """
import signal, sys, time, pathlib
out = pathlib.Path(sys.argv[1]); group = sys.argv[2]; mode = sys.argv[3]
out.joinpath(f"start-{group}-{time.time_ns()}").touch()
if mode == "crash":
    sys.exit(3)
if mode == "transient" and len(list(out.glob(f"start-{group}-*"))) <= 8:
    sys.exit(1)  # e.g. Redis refusing writes at registration: clears by itself after 8 starts
if mode == "config":
    sys.exit(2)
if mode == "ready-then-crash":  # ready (the supervisor's pipe), then dies: e.g. a rank crash much later
    import os; os.write(int(os.environ["LTX_SUPERVISOR_READY_FD"]), b"1"); time.sleep(0.1); sys.exit(3)
if mode == "clean":
    sys.exit(0)
if mode == "ready-busy-ready":  # reports as a worker does: ready, not (back-pressure), ready again
    import os; fd = int(os.environ["LTX_SUPERVISOR_READY_FD"])
    os.write(fd, b"1\\n"); time.sleep(0.3); os.write(fd, b"0 back-pressure: spool disk nearly full\\n")
    while not out.joinpath(f"resume-{group}").exists(): time.sleep(0.02)
    os.write(fd, b"1\\n")
if mode == "exit-once" and not out.joinpath(f"exited-{group}").exists():
    out.joinpath(f"exited-{group}").touch(); sys.exit(1)
def term(signum, frame):
    out.joinpath(f"term-{group}-{time.time_ns()}").touch()
    n = len(list(out.glob(f"term-{group}-*")))
    if n >= 2: sys.exit(0)  # cold stop
signal.signal(signal.SIGTERM, term)
signal.signal(signal.SIGINT, term)  # (a worker stops alike on either: the supervisor forwards what it got)
while True:
    time.sleep(0.05)
    if len(list(out.glob(f"term-{group}-*"))) == 1 and mode != "cold":
        time.sleep(0.3); sys.exit(0)  # warm stop: finish "the job", then exit (a "cold" child waits)
"""


def _command(tmp, mode):
    return lambda group, index: [sys.executable, "-c", _CHILD, str(tmp), f"{group}{index}", mode]


def _sigterm_after_starts(tmp, starts: int, settle_s: float) -> None:
    """SIGTERM this process (the supervisor under test) once its children started `starts` times."""
    import os

    def stop() -> None:
        with contextlib.suppress(AssertionError):  # (SIGTERM regardless: the test then says what is missing)
            wait_for(lambda: len(list(tmp.glob("start-*"))) >= starts, 40, f"{starts} starts")
        time.sleep(settle_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop, daemon=True).start()


@pytest.mark.timeout(60)
def test_supervisor_restarts_exited_worker_and_warm_stops_all(tmp_path):
    sup = Supervisor(["a", "b"], _command(tmp_path, "exit-once"), backoff_s=0.05, poll_s=0.02)
    _sigterm_after_starts(tmp_path, 4, settle_s=0.3)
    rc = sup.run()
    assert rc == 0
    assert len(list(tmp_path.glob("start-a0-*"))) == 2 and len(list(tmp_path.glob("start-b1-*"))) == 2
    assert all(c.restarts == 1 for c in sup.children)
    assert len(list(tmp_path.glob("term-*"))) == 2  # each live worker got exactly one SIGTERM
    assert sup.pids == []


@pytest.mark.timeout(60)
def test_supervisor_second_signal_is_forwarded_as_cold_stop(tmp_path):
    import os

    sup = Supervisor(["a"], _command(tmp_path, "cold"), poll_s=0.02)

    def signals():
        with contextlib.suppress(AssertionError):
            wait_for(lambda: list(tmp_path.glob("start-*")), 20, "a start")
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=signals, daemon=True).start()
    assert sup.run() == 0
    assert len(list(tmp_path.glob("term-a0-*"))) == 2


@pytest.mark.timeout(60)
def test_supervisor_does_not_restart_a_configuration_error(tmp_path):
    """Regression: a worker exiting 2 (bad settings, storage credentials, a missing GPU) was restarted five
    times before the supervisor gave up with 4; restarting cannot fix it."""
    sup = Supervisor(["a", "b"], _command(tmp_path, "config"), backoff_s=0.01, poll_s=0.02)
    t0 = time.monotonic()
    assert sup.run() == EXIT_BAD_CONFIG
    assert time.monotonic() - t0 < 10
    assert all(c.restarts == 0 for c in sup.children)


@pytest.mark.timeout(60)
def test_supervisor_never_gives_up_on_a_worker_that_keeps_dying_young(tmp_path):
    """Regression: a worker dying at registration while Redis was out of memory was restarted 4 times in 32 s,
    then the supervisor gave up (exit 4) and the service stayed down after Redis had memory again. Now
    the back-off grows (to its cap) past any number of quick exits, and the worker runs once the cause
    clears."""
    sup = Supervisor(["a"], _command(tmp_path, "transient"), backoff_s=0.02, backoff_max_s=0.3, alarm_after=3,
                     poll_s=0.01)  # fmt: skip
    _sigterm_after_starts(tmp_path, 9, settle_s=0.5)
    assert sup.run() == 0
    child = sup.children[0]
    assert child.exit_codes == [1] * 8 and child.restarts == 8  # (the 9th was stopped by the signal)
    assert [sup._backoff(n) for n in (1, 2, 3, 8, 10_000)] == [0.02, 0.04, 0.08, 0.3, 0.3]  # doubling, capped
    assert len(list(tmp_path.glob("term-a0-*"))) == 1  # it was up, and warm-stopped


@pytest.mark.timeout(60)
def test_a_worker_that_was_ready_resets_the_back_off(tmp_path):
    """Only exits before readiness grow the back-off: a worker that said ready (then died) restarts after the
    base wait each time, and the supervisor never calls it a crash loop."""
    sup = Supervisor(["a"], _command(tmp_path, "ready-then-crash"), backoff_s=0.05, backoff_max_s=5, alarm_after=2,
                     poll_s=0.01)  # fmt: skip
    _sigterm_after_starts(tmp_path, 5, settle_s=0.05)
    assert sup.run() == 0
    child = sup.children[0]
    assert child.restarts >= 4 and set(child.exit_codes) == {3}
    assert set(child.delays) == {0.05} and child.never_ready_exits == 0  # never grew
    assert sup.metrics.crash_loop.labels("a")._value.get() == 0


@pytest.mark.timeout(60)
def test_the_supervisor_answers_what_its_worker_last_reported(tmp_path):
    """A worker reported "ready" once and the supervisor said ready from then on, while the worker's
    own /readyz said 503. Every report counts now: not ready with the worker's reason, then ready again; and
    being ready once still resets the never-ready count. (The live pair: test_worker_supervisor.py.)"""
    import os

    sup = Supervisor(["a"], _command(tmp_path, "ready-busy-ready"), poll_s=0.01)
    seen: list[tuple[bool, str | None, float]] = []

    def watch() -> None:
        with contextlib.suppress(AssertionError):
            for ready in (True, False):
                wait_for(lambda r=ready: sup.status()[0] is r, 20, f"ready={ready}")
                seen.append((*sup.status()[:2], sup.metrics.worker_ready.labels("a")._value.get()))
            tmp_path.joinpath("resume-a0").touch()
            wait_for(lambda: sup.status()[0], 20, "ready again")
            seen.append((*sup.status()[:2], sup.metrics.worker_ready.labels("a")._value.get()))
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True).start()
    assert sup.run() == 0
    busy = "group a: the worker is not ready: back-pressure: spool disk nearly full"
    assert seen == [(True, None, 1), (False, busy, 0), (True, None, 1)], seen
    assert sup.children[0].never_ready_exits == 0


def test_readiness_lines_are_one_line_each_and_fit_an_atomic_pipe_write():
    import os

    from worker.runtime.readiness import ReadinessPipe, decode, encode

    assert encode((True, None)) == b"1\n" and decode(b"1") == (True, None)
    line = encode((False, "a\nmulti-line " + "x" * 5000))
    assert line.count(b"\n") == 1 and len(line) <= 512 and decode(line)[1].startswith("a multi-line xx")
    read, write = os.pipe()
    pipe = ReadinessPipe(read)
    os.write(write, b"1\n0 back-pressure: uploads\n1")  # (a bare "1" then EOF: an older worker's one byte)
    assert pipe.poll() == [(True, None), (False, "back-pressure: uploads")]
    os.close(write)
    assert pipe.poll() == [(True, None)] and pipe.closed


@pytest.mark.timeout(60)
def test_supervisor_restarts_unasked_clean_exits_and_never_gives_up_on_them(tmp_path):
    """Five RQ `shutdown` PUBLISHes (each worker exits 0) made the supervisor give up."""
    sup = Supervisor(["a"], _command(tmp_path, "clean"), backoff_s=0.01, backoff_max_s=0.05, alarm_after=3,
                     poll_s=0.02)  # fmt: skip
    _sigterm_after_starts(tmp_path, 8, settle_s=0)
    assert sup.run() == 0
    assert len(list(tmp_path.glob("start-a0-*"))) >= 8 and sup.children[0].restarts >= 7


# ==== cancel before the render begins =====================================================================


def test_a_cancel_before_the_render_begins_stops_that_render_and_no_other():
    """RQ marks a job started, then calls the job function: a stop command in between found no running render
    and was dropped, so the job rendered to the end (CI: `test_cancel_right_after_start_is_honoured`). The
    service now keeps it for that job's render, which starts cancelled; nothing else is touched."""
    from types import SimpleNamespace

    from worker.render.service import RenderService

    svc = RenderService.__new__(RenderService)
    svc._lock, svc.current, svc._cancel_before_start = threading.Lock(), None, None
    svc.loras = SimpleNamespace(cache=SimpleNamespace(release=lambda: None))  # (pins released after each run)
    svc.outcomes = SimpleNamespace(relay=lambda job: None)  # (each run's JobAttempt: no Redis here)
    svc._run = lambda attempt, request: attempt.cancel.is_set()  # (what the render sees when it begins)
    svc.cancel_before_start("j1")
    assert svc.run_job(SimpleNamespace(id="j2"), None) is False  # another job: untouched
    assert svc.run_job(SimpleNamespace(id="j1"), None) is True  # that job: cancelled from its first step
    assert svc.run_job(SimpleNamespace(id="j1"), None) is False  # forgotten once its run ended (a retry runs)
    seen = []
    svc._run = lambda attempt, request: (svc.cancel_before_start(attempt.id), seen.append(attempt.cancel.is_set()))
    svc.run_job(SimpleNamespace(id="j3"), None)  # while it runs: an ordinary cancel
    assert seen == [True] and svc._cancel_before_start is None
