"""Control-plane contracts on CPU ranks over gloo: the controller's contract (`ltx_mgpu/control/controller.py`'s
docstring: lifecycle, streaming, error classes, poisoning) plus our additions (cancellation, failure
callbacks, devices maps). One module on purpose (a little over 450 lines): its tests share one warm
two-rank fleet (`fleet2`), and a second module would spawn and load another."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from ltx_mgpu import (
    AsymmetricRunnerError,
    ControllerBusyError,
    FleetFailure,
    FleetTimeoutError,
    JobCancelledError,
    MGPUController,
    SymmetricRunnerError,
)
from ltx_mgpu.control.transport import MessageKind, Result
from tests.support.controller_runners import ImportingRunner, NotAGeneratorRunner, ScriptedRunner
from tests.support.wait import wait_for

START_TIMEOUT = 120


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); treat it as dead (reaped or not, it holds nothing).
    try:
        with open(f"/proc/{pid}/stat") as fh:  # (the name in parentheses may hold spaces: split after it)
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # (reaped between kill(0) and the read: ESRCH)
        return False


@pytest.fixture(scope="module")
def fleet2():
    ctl = MGPUController(ScriptedRunner, devices=["cpu", "cpu"])
    ctl.start(timeout=START_TIMEOUT, scale=2.0)
    yield ctl
    pids = ctl.pids
    ctl.shutdown(graceful_timeout=10)
    assert not any(_pid_alive(p) for p in pids)


def _fresh(world: int = 2, **setup) -> MGPUController:
    ctl = MGPUController(ScriptedRunner, devices=["cpu"] * world)
    ctl.start(timeout=START_TIMEOUT, **setup)
    return ctl


# ==== construction ==============================================================================


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="Pass either num_gpus or devices, not both."):
        MGPUController(ScriptedRunner, num_gpus=2, devices=[0, 1])
    with pytest.raises(ValueError, match="non-empty and unique"):
        MGPUController(ScriptedRunner, devices=[])
    with pytest.raises(ValueError, match="allow_shared_devices"):
        MGPUController(ScriptedRunner, devices=[0, 0])
    with pytest.raises(TypeError):
        MGPUController(object, devices=["cpu"])  # type: ignore[arg-type]
    MGPUController(ScriptedRunner, devices=[0, 0], allow_shared_devices=True)  # constructs without CUDA


def test_not_started_and_no_gpus() -> None:
    ctl = MGPUController(ScriptedRunner, devices=["cpu"])
    with pytest.raises(RuntimeError, match="not started"):
        ctl.stream()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="No GPUs available"):
            MGPUController(ScriptedRunner).start(timeout=5)


# ==== happy path over world sizes ================================================================


@pytest.mark.parametrize("world", [1, 3, 4])
def test_stream_yields_and_returns_per_rank(world: int) -> None:
    ctl = _fresh(world)
    try:
        stream = ctl.stream(mode="ok", n=3)
        items = list(stream)
        assert sorted((it["rank"], it["i"]) for it in items) == [(r, i) for r in range(world) for i in range(3)]
        assert stream.result == [r * 10 for r in range(world)]
        # per-rank order is preserved even though ranks interleave
        for r in range(world):
            assert [it["i"] for it in items if it["rank"] == r] == [0, 1, 2]
        assert ctl.is_alive
    finally:
        ctl.shutdown(graceful_timeout=10)


def test_yield_from_returns_rank_results(fleet2: MGPUController) -> None:
    def consume():
        return (yield from fleet2.stream(mode="ok", n=1))

    gen = consume()
    with pytest.raises(StopIteration) as stop:
        while True:
            next(gen)
    assert stop.value.value == [0, 10]


def test_tensors_top_level_and_nested(fleet2: MGPUController) -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    nested = {"t": torch.full((5,), 3.0)}
    items = list(fleet2.stream(mode="tensors", x=x, nested=nested))
    assert len(items) == 2
    for item in items:
        assert item["device"] == "cpu"
        assert item["x_sum_all_ranks"] == pytest.approx(2 * float(x.sum()))
        assert item["nested_sum"] == 15.0
        torch.testing.assert_close(item["scaled"], x * 2.0)  # yielded tensor, computed on the rank


def test_unknown_or_missing_kwarg_is_caller_error(fleet2: MGPUController) -> None:
    with pytest.raises(TypeError, match="invalid job kwargs for ScriptedRunner"):
        fleet2.stream(mode="ok", colour="blue")
    assert fleet2.is_alive
    assert len(list(fleet2.stream(mode="ok", n=1))) == 2


def test_not_a_generator_is_symmetric_error() -> None:
    ctl = MGPUController(NotAGeneratorRunner, devices=["cpu", "cpu"])
    ctl.start(timeout=START_TIMEOUT)
    try:
        with pytest.raises(SymmetricRunnerError, match="must be a generator"):
            list(ctl.stream())
        assert ctl.is_alive
    finally:
        ctl.shutdown(graceful_timeout=10)


# ==== recoverable errors ========================================================================


def test_symmetric_runner_error(fleet2: MGPUController) -> None:
    with pytest.raises(SymmetricRunnerError) as info:
        list(fleet2.stream(mode="runner_error"))
    assert str(info.value) == "bad input on rank 0"
    assert [e.message for e in info.value.errors] == ["bad input on rank 0", "bad input on rank 1"]
    assert fleet2.is_alive
    assert len(list(fleet2.stream(mode="ok", n=1))) == 2


def test_value_error_is_converted(fleet2: MGPUController) -> None:
    with pytest.raises(SymmetricRunnerError, match="width must be positive"):
        list(fleet2.stream(mode="value_error"))
    assert fleet2.is_alive


def test_asymmetric_runner_error(fleet2: MGPUController, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(AsymmetricRunnerError) as info:
        list(fleet2.stream(mode="asymmetric", target_rank=1))
    terminals = info.value.terminals
    assert isinstance(terminals[0], StopIteration)
    assert terminals[1].message == "only one rank objects"
    assert "asymmetric RunnerError" in caplog.text
    assert fleet2.is_alive
    assert len(list(fleet2.stream(mode="ok", n=1))) == 2


# ==== one job at a time, thread ownership, drain ================================================


def test_busy_error_carries_job_id_and_drain_frees(fleet2: MGPUController) -> None:
    stream = fleet2.stream(mode="sleep", sleep_s=0.2)
    with pytest.raises(ControllerBusyError) as info:
        fleet2.stream(mode="ok")
    assert info.value.job_id == stream.job_id
    assert f"MGPU job {stream.job_id} is still in flight" in str(info.value)
    stream.drain()
    assert stream.done
    assert len(list(fleet2.stream(mode="ok", n=1))) == 2


def test_drain_swallows_recoverable_errors(fleet2: MGPUController) -> None:
    fleet2.stream(mode="runner_error").drain()
    fleet2.stream(mode="asymmetric").drain()
    assert fleet2.is_alive


def test_stream_belongs_to_dispatching_thread(fleet2: MGPUController) -> None:
    stream = fleet2.stream(mode="ok", n=1)
    errors: list[BaseException] = []

    def other() -> None:
        try:
            next(stream)
        except BaseException as err:
            errors.append(err)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert isinstance(errors[0], RuntimeError)
    assert "a job belongs to its dispatching thread" in str(errors[0])
    stream.drain()


def test_concurrent_stream_calls_one_wins(fleet2: MGPUController) -> None:
    barrier = threading.Barrier(4)
    outcomes: list[str] = []
    lock = threading.Lock()

    def attempt() -> None:
        barrier.wait()
        try:
            s = fleet2.stream(mode="sleep", sleep_s=0.3)
        except ControllerBusyError:
            with lock:
                outcomes.append("busy")
            return
        with lock:
            outcomes.append("won")
        s.drain()

    threads = [threading.Thread(target=attempt) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["busy", "busy", "busy", "won"]


# ==== cancellation ==============================================================================


def test_cooperative_cancel_keeps_fleet(fleet2: MGPUController) -> None:
    stream = fleet2.stream(mode="cancellable", n=1000, sleep_s=0.01)
    first = next(stream)
    assert first["step"] == 0
    threading.Timer(0.05, stream.cancel).start()  # from another thread
    with pytest.raises(JobCancelledError):
        for _ in stream:
            pass
    assert fleet2.is_alive
    assert list(fleet2.stream(mode="cancellable", n=2, sleep_s=0.0))  # a new job is not cancelled


# ==== fatal errors ==============================================================================


def test_rank_exception_poisons_with_traceback() -> None:
    ctl = _fresh(2)
    pids = ctl.pids
    try:
        stream = ctl.stream(mode="crash", target_rank=1)
        with pytest.raises(FleetFailure) as info:
            list(stream)
        msg = str(info.value)
        assert msg.startswith("MGPU worker(s) failed:")
        assert f"rank 1 (pid {pids[1]}) exit 1:" in msg
        assert "RuntimeError: CUDA error: an illegal memory access was encountered (injected)" in msg
        assert info.value.reason == "rank_failed" and info.value.rank == 1 and info.value.exitcode == 1
        assert not ctl.is_alive
        with pytest.raises(RuntimeError, match="MGPUController is dead; create a new one."):
            ctl.stream(mode="ok")
    finally:
        ctl.shutdown(graceful_timeout=0)
    wait_for(lambda: not any(_pid_alive(p) for p in pids), 5, "the ranks gone", poll=0.01)


def test_rank_death_detected_without_iterating(tmp_path) -> None:
    ctl = _fresh(2)
    pids = ctl.pids
    marker = tmp_path / "died_at"
    try:
        stream = ctl.stream(mode="exit", target_rank=1, marker=str(marker))
        # nobody iterates: the monitor must notice the death on its own, within a second of it
        wait_for(lambda: not ctl.is_alive, 10.0, "the controller dead", poll=0.01)
        with pytest.raises(FleetFailure) as info:
            next(stream)
        assert info.value.detected_at - float(marker.read_text()) < 1.0
        assert f"rank 1 (pid {pids[1]}) exit 7:" in str(info.value)
        assert info.value.exitcode == 7 and info.value.reason == "rank_exited"
    finally:
        ctl.shutdown(graceful_timeout=0)
    wait_for(lambda: not any(_pid_alive(p) for p in pids), 5, "the ranks gone", poll=0.01)


def test_job_timeout_poisons_without_iterating() -> None:
    ctl = _fresh(2)
    pids = ctl.pids
    try:
        dispatched_at = time.time()
        stream = ctl.stream(timeout=0.3, mode="sleep", sleep_s=30)
        wait_for(lambda: not ctl.is_alive, 10.0, "the controller dead", poll=0.01)
        with pytest.raises(FleetTimeoutError, match=rf"MGPU job {stream.job_id} exceeded 0.3s") as info:
            list(stream)
        assert info.value.detected_at - (dispatched_at + 0.3) < 1.0
        # the ranks were killed by the controller, not left sleeping
        wait_for(lambda: not any(_pid_alive(p) for p in pids), 5, "the ranks gone", poll=0.01)
    finally:
        ctl.shutdown(graceful_timeout=0)


def test_desync_is_fatal() -> None:
    ctl = _fresh(2)
    try:
        stream = ctl.stream(mode="sleep", sleep_s=0.5)
        # a message for another job (what a desynced rank would send)
        stale = Result(kind=MessageKind.YIELD, job_id=stream.job_id + 41, rank=1, value="stale")
        ctl._fleet.channels.up[1].put(stale)
        with pytest.raises(FleetFailure, match=rf"MGPU fleet desync: rank 1 sent job {stream.job_id + 41}, expected"):
            list(stream)
        assert not ctl.is_alive
    finally:
        ctl.shutdown(graceful_timeout=0)


def test_startup_crash_raises_and_cleans_up() -> None:
    ctl = MGPUController(ScriptedRunner, devices=["cpu", "cpu"])
    with pytest.raises(FleetFailure) as info:
        ctl.start(timeout=START_TIMEOUT, crash_on_rank=1)
    assert "during startup" in str(info.value)
    assert "setup exploded on rank 1" in str(info.value)
    assert ctl.pids == [] and not ctl.is_alive


def test_startup_timeout_names_missing_ranks() -> None:
    ctl = MGPUController(ScriptedRunner, devices=["cpu", "cpu", "cpu"])
    with pytest.raises(FleetTimeoutError) as info:
        ctl.start(timeout=20, hang_on_rank=2)
    # Ranks 0 and 1 normally check in well within 20 s; on a heavily loaded machine they may not, so the
    # message is checked for its shape and for naming the rank that hangs in setup().
    match = re.match(
        r"MGPU startup: (\d)/3 workers ready after 20s; ranks \[([\d, ]+)\] never checked in", str(info.value)
    )
    assert match, str(info.value)
    missing = [int(r) for r in match.group(2).split(",")]
    assert 2 in missing and int(match.group(1)) == 3 - len(missing)
    assert ctl.pids == []


# ==== shutdown ==================================================================================


def test_shutdown_from_other_thread_mid_job_and_restart() -> None:
    ctl = _fresh(2)
    pids = ctl.pids
    stream = ctl.stream(mode="sleep", sleep_s=30)
    killer = threading.Timer(0.2, lambda: ctl.shutdown(graceful_timeout=0))
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(FleetFailure) as info:
        list(stream)
    killer.join()
    assert info.value.reason == "shutdown"
    assert time.monotonic() - t0 < 10
    assert not any(_pid_alive(p) for p in pids)
    ctl.shutdown()  # idempotent
    ctl.shutdown(graceful_timeout=0)
    # a controller can be started again
    ctl.start(timeout=START_TIMEOUT)
    try:
        assert ctl.is_alive and set(ctl.pids).isdisjoint(pids)
        assert len(list(ctl.stream(mode="ok", n=1))) == 2
    finally:
        ctl.shutdown(graceful_timeout=10)


def test_shutdown_before_start_is_noop() -> None:
    """Nothing to stop: it returns at once (no wait for a graceful exit), starts no process, and leaves
    the controller as it was: startable, and serving jobs once started."""
    ctl = MGPUController(ScriptedRunner, devices=["cpu"])
    t0 = time.monotonic()
    ctl.shutdown(graceful_timeout=60)
    assert time.monotonic() - t0 < 5  # far below graceful_timeout: there was no fleet to wait for
    assert ctl.pids == [] and not ctl.is_alive and ctl.startup is None
    ctl.start(timeout=START_TIMEOUT)
    try:
        assert ctl.is_alive and len(ctl.pids) == 1
        assert list(ctl.stream(mode="ok", n=1)) == [{"rank": 0, "i": 0}]
    finally:
        ctl.shutdown(graceful_timeout=10)


def test_startup_reports_process_start_and_weight_load_per_rank() -> None:
    ctl = MGPUController(ScriptedRunner, devices=["cpu", "cpu"])
    assert ctl.startup is None
    t0 = time.time()
    ctl.start(timeout=START_TIMEOUT, sleep_s=0.6)
    t1 = time.time()
    try:
        startup = ctl.startup
        assert startup is not None
        assert [r.rank for r in sorted(startup.ranks, key=lambda r: r.rank)] == [0, 1]
        assert sorted(r.pid for r in startup.ranks) == sorted(ctl.pids)
        for r in startup.ranks:
            assert t0 <= startup.started_at <= r.booted_at <= r.setup_began_at <= r.ready_at <= t1
            assert r.ready_at - r.setup_began_at >= 0.6  # the "model load" is counted as weight load
        assert startup.weight_load_s >= 0.6 and startup.process_start_s > 0
        assert startup.ready_s == pytest.approx(startup.process_start_s + startup.weight_load_s, abs=1e-6)
        info = startup.as_dict()
        assert info["weight_load_s"] >= 0.6 and [r["rank"] for r in info["ranks"]] == [0, 1]
    finally:
        ctl.shutdown(graceful_timeout=10)


def test_background_imports_run_beside_setup_and_a_missing_module_is_left_to_setup() -> None:
    """A runner's slow late imports start on a side thread when the rank starts, so by the time setup() has
    "loaded its weights" (0.8 s) the probe (0.5 s to import) is in already; the module that does not exist
    is ignored there (setup() would raise its ImportError itself if it needed it)."""
    ctl = MGPUController(ImportingRunner, devices=["cpu", "cpu"])
    ctl.start(timeout=START_TIMEOUT, load_s=0.8)
    try:
        assert ctl.startup is not None
        for r in ctl.startup.ranks:
            phases = r.setup_phases_s
            assert phases["on_side_thread"] == 1.0, phases
            assert phases["imported_after_setup_began_s"] < 0.8, phases  # finished while setup() slept
        assert sorted(ctl.stream()) == [0, 1]  # and the fleet serves jobs
    finally:
        ctl.shutdown(graceful_timeout=10)


_MULTICAST = ["NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"]


def test_ranks_keep_nvlink_multicast_off_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in _MULTICAST:
        monkeypatch.delenv(key, raising=False)
    ctl = _fresh(2)
    try:
        items = list(ctl.stream(mode="env", env=_MULTICAST))
        assert len(items) == 2
        for item in items:
            assert item["env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                   "NVSHMEM_DISABLE_NVLS": "1"}, item  # fmt: skip
    finally:
        ctl.shutdown(graceful_timeout=10)
    assert all(os.environ.get(k) is None for k in _MULTICAST)  # the caller's own environment is untouched
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # an operator's explicit choice wins
    ctl = _fresh(1)
    try:
        (item,) = ctl.stream(mode="env", env=["NCCL_NVLS_ENABLE"])
        assert item["env"] == {"NCCL_NVLS_ENABLE": "1"}
    finally:
        ctl.shutdown(graceful_timeout=10)


def test_ranks_ignore_sigint(fleet2: MGPUController) -> None:
    for pid in fleet2.pids:
        os.kill(pid, signal.SIGINT)
    time.sleep(0.3)
    assert fleet2.is_alive
    assert len(list(fleet2.stream(mode="ok", n=1))) == 2


# ==== a runner defined in __main__ ==============================================================

MAIN_SCRIPT = textwrap.dedent(
    """
    from ltx_mgpu import MGPUController, MGPURunner

    class MainRunner(MGPURunner):
        def setup(self, *, greeting):
            self.greeting = greeting

        def __call__(self, *, name):
            yield f"{self.greeting} {name} from rank {self.rank}/{self.world_size}"

    if __name__ == "__main__":
        ctl = MGPUController(MainRunner, devices=["cpu", "cpu"])
        ctl.start(timeout=120, greeting="hello")
        try:
            for line in sorted(ctl.stream(name="main")):
                print(line)
        finally:
            ctl.shutdown(graceful_timeout=10)
    """
)


def test_runner_defined_in_main_script(tmp_path) -> None:
    script = tmp_path / "main_runner.py"
    script.write_text(MAIN_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["hello main from rank 0/2", "hello main from rank 1/2"]
