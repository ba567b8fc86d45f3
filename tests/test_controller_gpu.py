"""The control plane with CUDA ranks: world 1 over NCCL, worlds 2 and 4 oversubscribed on one GPU over gloo.

Skipped without CUDA. On a single-GPU machine the multi-rank cases share device 0 (NCCL refuses that, so
they use gloo); on a multi-GPU machine the NCCL case uses one GPU per rank.
"""

from __future__ import annotations

import pytest
import torch

from ltx_mgpu import JobCancelledError, MGPUController, SymmetricRunnerError
from tests.support.controller_runners import ScriptedRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible)"),
]


def _cases() -> list[tuple[int, bool]]:
    return [(1, False), (2, True), (4, True)]


@pytest.mark.parametrize(("world", "shared"), _cases())
def test_cuda_fleet_tensors_errors_cancel(world: int, shared: bool) -> None:
    devices = [0] * world if shared else list(range(world))
    ctl = MGPUController(ScriptedRunner, devices=devices, allow_shared_devices=shared)
    ctl.start(timeout=300, scale=3.0)
    try:
        assert ctl.backend == ("gloo" if shared else "nccl")
        x = torch.arange(24, dtype=torch.float32, device="cuda:0").reshape(4, 6)
        nested = {"t": torch.ones(5, device="cuda:0")}
        items = list(ctl.stream(mode="tensors", x=x, nested=nested))
        assert len(items) == world
        for item in items:
            assert item["device"].startswith("cuda")
            assert item["x_sum_all_ranks"] == pytest.approx(world * float(x.sum()))
            assert item["nested_sum"] == 5.0
            assert item["scaled"].is_cuda
            torch.testing.assert_close(item["scaled"].to("cuda:0"), x * 3.0)
        with pytest.raises(SymmetricRunnerError):
            list(ctl.stream(mode="runner_error"))
        stream = ctl.stream(mode="cancellable", n=10_000, sleep_s=0.005)
        next(stream)
        stream.cancel()
        with pytest.raises(JobCancelledError):
            list(stream)
        assert ctl.is_alive
        assert len(list(ctl.stream(mode="ok", n=1))) == world
    finally:
        ctl.shutdown(graceful_timeout=30)
