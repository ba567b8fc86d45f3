"""Deterministic renders, the engine's part (`ltx_mgpu.control.determinism`, `collectives.ordered_sum`, the
memory plan's capacity): the mode's resolution, the switches a rank sets, and the reductions fixed in our own
code. The service-level checks (hashes in the job summary, same request twice) are in
tests/test_determinism_service.py; the GPU ones in tests/test_determinism_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ltx_mgpu.control import determinism
from ltx_mgpu.parallel.testing import LocalWorld
from tests.support.determinism import ON_SWITCHES, SwitchProbe, probe_ranks


# ---- the mode ---------------------------------------------------------------------------------------------
def test_the_default_is_on_for_every_fleet_and_off_is_the_opt_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto` (the default) is `on` on GPU fleets too (0.7% of a distilled render on an H100, and the only way
    the soundtrack repeats: docs/runners.md); `off` and `strict` are taken as given, from the argument or the
    environment."""
    monkeypatch.delenv(determinism.ENV, raising=False)
    assert determinism.resolve(None) == "on"
    assert determinism.resolve("auto") == "on"
    assert determinism.resolve(True) == "on" and determinism.resolve(False) == "off"
    assert determinism.resolve("off") == "off" and determinism.resolve("strict") == "strict"
    monkeypatch.setenv(determinism.ENV, "")
    assert determinism.resolve(None) == "on"
    monkeypatch.setenv(determinism.ENV, " OFF ")
    assert determinism.resolve(None) == "off"
    monkeypatch.setenv(determinism.ENV, "auto")
    assert determinism.resolve(None) == "on"


def test_every_rank_of_a_default_fleet_has_the_switches_before_its_runner_exists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two CPU ranks started with no mode and no `LTX_DETERMINISTIC` (the worker's default): the switches are
    set in each rank process before the fleet builds the runner (on CUDA: after `set_device`, before any
    cuBLAS handle), and still set when a job runs."""
    monkeypatch.delenv(determinism.ENV, raising=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # (the ranks inherit this environment)
    mode, reports = probe_ranks(["cpu", "cpu"], None)
    assert mode == "on"
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        assert report["at_init"] == ON_SWITCHES and report["in_job"] == ON_SWITCHES, report


def test_a_bad_mode_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="one of auto, on, off, strict; got 'yes'"):
        determinism.resolve("yes")
    monkeypatch.setenv(determinism.ENV, "maybe")
    with pytest.raises(ValueError, match="got 'maybe'"):
        determinism.resolve(None)
    from ltx_mgpu import MGPUController
    from ltx_mgpu.runners.smoke import SmokeRunner

    with pytest.raises(ValueError, match="got 'sometimes'"):
        MGPUController(SmokeRunner, devices=["cpu"], deterministic="sometimes")


_PROBE = textwrap.dedent(
    """
    import json, os, sys, warnings
    import torch
    from ltx_mgpu.control import determinism
    determinism.apply(sys.argv[1])
    out = {"algorithms": torch.are_deterministic_algorithms_enabled(),
           "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
           "cudnn_deterministic": torch.backends.cudnn.deterministic, "benchmark": torch.backends.cudnn.benchmark,
           "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
           "fill": torch.utils.deterministic.fill_uninitialized_memory}
    x = torch.zeros(4)
    try:  # put_ without accumulate has no deterministic implementation on any device
        x.put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]), accumulate=False)
        out["nondeterministic_op"] = "ran"
    except (RuntimeError, UserWarning) as exc:
        out["nondeterministic_op"] = type(exc).__name__
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize(
    ("mode", "warn_only", "raised"),
    [("on", True, "UserWarning"), ("strict", False, "RuntimeError"), ("off", False, "ran")],
)
def test_a_rank_sets_the_switches_and_a_nondeterministic_op_raises(mode: str, warn_only: bool, raised: str) -> None:
    """In a fresh interpreter (the switches are process-wide): `on` keeps torch's warn-only mode (so cuDNN's
    attention stays eligible) and still raises on an op torch knows to be nondeterministic."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], check=False, capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["nondeterministic_op"] == raised
    if mode == "off":
        assert not out["algorithms"] and out["cublas"] is None
        return
    assert out["algorithms"] and out["warn_only"] is warn_only
    assert out["cudnn_deterministic"] and not out["benchmark"]
    assert out["cublas"] == ":4096:8"
    assert out["fill"] is (mode == "strict")  # (the NaN fill of new tensors: strict only, see determinism.py)


# ---- the tiled stage 2's cross-rank sum ---------------------------------------------------------------------
#: three partial sums whose float32 total depends on the order they are added in (float32 spacing at 1e8 is 8):
#: (a + b) + c = [0, 0] (1 and 3 are lost next to 1e8) but a + (b + c) = [0, 3] (b + c cancels 1e8 first)
_PARTS = (torch.tensor([1.0e8, 3.0]), torch.tensor([1.0, 1.0e8]), torch.tensor([-1.0e8, -1.0e8]))


def _rank_ordered_sum(ctx: object) -> torch.Tensor:
    import torch.distributed as dist

    from ltx_mgpu.parallel.sharding.collectives import ordered_sum

    return ordered_sum(_PARTS[dist.get_rank()].clone(), None)


def test_ordered_sum_adds_in_rank_order_on_every_rank() -> None:
    """Three ranks (with two, float addition commutes and every order agrees): every rank gets
    ((x0 + x1) + x2) bit for bit, which differs from x0 + (x1 + x2) on these values."""
    left = (_PARTS[0] + _PARTS[1]) + _PARTS[2]
    right = _PARTS[0] + (_PARTS[1] + _PARTS[2])
    assert not torch.equal(left, right)  # (the test's values do tell the orders apart)
    with LocalWorld(3) as world:
        results = world.run(_rank_ordered_sum)
    for got in results:
        assert torch.equal(got, left)


def test_the_tiled_stage_uses_the_ordered_sum_under_deterministic_algorithms(monkeypatch: pytest.MonkeyPatch) -> None:
    """`TiledDataParallelModelWrapper._all_reduce` routes to `ordered_sum` exactly when deterministic
    algorithms are on (a unit check of the switch; the sum itself is checked across ranks above)."""
    from ltx_mgpu.parallel.pipeline import tdp

    calls: list[str] = []
    monkeypatch.setattr(tdp, "ordered_sum", lambda flat, group: calls.append("ordered") or flat)
    monkeypatch.setattr(tdp.dist, "all_reduce", lambda buf, op=None, group=None: calls.append("all_reduce"))
    monkeypatch.setattr(tdp, "needs_host_staging", lambda group, device: False)
    wrapper = object.__new__(tdp.TiledDataParallelModelWrapper)
    wrapper.world_size, wrapper.group = 2, None
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        wrapper._all_reduce(torch.ones(3))
        torch.use_deterministic_algorithms(True, warn_only=True)
        wrapper._all_reduce(torch.ones(3))
    finally:
        torch.use_deterministic_algorithms(previous)
    assert calls == ["all_reduce", "ordered"]


# ---- the memory plan's capacity -----------------------------------------------------------------------------
def test_the_offered_device_memory_is_the_total_under_deterministic_algorithms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker's memory plan takes its capacity from these reports, the least of them: every rank's ready
    stamp after `setup()` (`fleet.ready_stamp`) and the driver's after every render (`StageClock.gpu_report`).
    Free memory changes from one fleet build to the next and would change the decode's chunking, so under
    deterministic algorithms both are the device's total memory (a constant of the GPU model); the ready stamp
    used to be free memory whatever the mode, and being the least, it set the capacity. Unit check with the
    CUDA queries stubbed (no GPU here); tests/test_determinism_gpu.py runs the real one."""
    from types import SimpleNamespace

    from ltx_mgpu.control.startup import ready_stamp
    from ltx_mgpu.runners.common.stages import StageClock

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * gib, 140 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 * gib)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(total_memory=140 * gib)
    )
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")

    def offered(device: torch.device) -> tuple[int | None, int | None]:
        stamp = ready_stamp(0, SwitchProbe(), device, 0.0, 0.0).device_memory_bytes
        return stamp, StageClock(device).gpu_report().get("device_memory_bytes")

    previous = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        assert offered(cuda) == (130 * gib, 130 * gib)  # free + this allocator's reservation
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert offered(cuda) == (140 * gib, 140 * gib)
        assert offered(cpu) == (None, None)
    finally:
        torch.use_deterministic_algorithms(previous)
