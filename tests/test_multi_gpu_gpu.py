"""Fleets and sequence parallelism across two distinct GPUs (skipped unless two are visible).

NCCL between GPUs under the controller, a device map with rank 0 on the second GPU, SP numerics and the
ipc kernel across GPUs against the `dist` backend, and two one-GPU fleets side by side. Placement (every
rank on its own GPU only, the caller on none) is read from `nvidia-smi` where it can tell.

Run on the two-GPU host:  pytest -m gpu tests/test_multi_gpu_gpu.py -v
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch

from ltx_mgpu import MGPUController
from ltx_mgpu.parallel.testing import LocalWorld
from ltx_mgpu.runners.smoke.checkpoint import ensure_smoke_checkpoint, tiny_transformer_config
from tests.support.gpu_runners import DeviceProbeRunner, check_placement

from .test_sp_parallel import CASES, HEADS, TOL, _run_numerics

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two distinct GPUs"),
]

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _ipc_available() -> bool:
    try:
        from ltx_mgpu.parallel.sp.backends.ipc import is_available
    except ImportError:
        return False
    return is_available(torch.device("cuda", 0))


BACKENDS = [
    "dist",
    pytest.param("ipc", marks=pytest.mark.skipif(not _ipc_available(), reason="ipc kernel not built/usable")),
]


def _this_process_if_cuda_free() -> list[int]:
    """This test process must hold no CUDA context when it never initialised CUDA (earlier test modules in the
    same session may have, for their own reasons)."""
    return [] if torch.cuda.is_initialized() else [os.getpid()]


def _reports(items: list[Any]) -> list[dict[str, Any]]:
    return sorted((i for i in items if i.get("event") == "report"), key=lambda r: r["rank"])


@pytest.mark.parametrize("devices", [[0, 1], [1, 0]], ids=["0,1", "1,0"])
def test_nccl_fleet_across_gpus_and_rank0_on_either(devices: list[int]) -> None:
    ctl = MGPUController(DeviceProbeRunner, devices=devices)
    ctl.start(timeout=300)
    try:
        assert ctl.backend == "nccl"
        x = torch.arange(1000, dtype=torch.float32)  # a CPU tensor: rank 0 moves it to its GPU and broadcasts it
        reports = _reports(list(ctl.stream(busy_s=0.2, x=x)))
        assert [r["device"] for r in reports] == [f"cuda:{d}" for d in devices]
        assert [r["current"] for r in reports] == devices  # rank r bound to devices[r], not to r
        assert all(r["rank_sum"] == 1.0 for r in reports)  # an NCCL all-reduce across the two GPUs
        assert all(r["x_sum"] == float(x.sum()) for r in reports)  # the broadcast from rank 0 (on cuda:{d0})
        assert [r["x_device"] for r in reports] == [f"cuda:{d}" for d in devices]
        assert all(r["env"] == MULTICAST_OFF for r in reports)
        assert len({r["uuid"] for r in reports}) == 2
        print(check_placement(reports, absent=_this_process_if_cuda_free()))
    finally:
        ctl.shutdown(graceful_timeout=30)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    cfg = tiny_transformer_config(num_heads=HEADS, audio_num_heads=HEADS)
    ck = ensure_smoke_checkpoint(tmp_path_factory.mktemp("sp_2gpu_ckpt"), transformer_config=cfg)
    return str(ck.transformer_path)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("order", [["cuda:0", "cuda:1"], ["cuda:1", "cuda:0"]], ids=["0,1", "1,0"])
def test_sp_numerics_across_gpus(checkpoint: str, backend: str, order: list[str]) -> None:
    with LocalWorld(2, devices=order, backend="nccl", timeout=600) as world:
        fp32 = world.run(_run_numerics, checkpoint, CASES, backend=backend)
        bf16 = world.run(_run_numerics, checkpoint, CASES, backend=backend, dtype="bfloat16")
    for rank_results in fp32:
        for res in rank_results:
            label = f"{backend} {order} case {res['case']}"
            assert res["backend"] == backend, label
            assert res["video_diff"] <= TOL and res["audio_diff"] <= TOL, (label, res["video_diff"], res["audio_diff"])
    for rank_results in bf16:
        for res in rank_results:
            assert res["sp_err"] <= 2 * res["single_err"] + 1e-2, (backend, order, res["case"], res)


def _compare_across(ctx: Any, trials: int, burst: int) -> dict[str, Any]:
    from tests.test_kernels_gpu import _scenario_compare

    return _scenario_compare(ctx.rank, ctx.world_size, trials, burst)


@pytest.mark.skipif(not _ipc_available(), reason="ipc kernel not built/usable")
@pytest.mark.parametrize("order", [["cuda:0", "cuda:1"], ["cuda:1", "cuda:0"]], ids=["0,1", "1,0"])
def test_ipc_kernel_matches_dist_across_gpus(order: list[str]) -> None:
    """The kernel's exchanges over NVLink (peer IPC buffers) byte-equal to NCCL's, every dtype, uneven counts,
    bursts without a host sync in between."""
    trials, burst = 4, 6
    with LocalWorld(2, devices=order, backend="nccl", timeout=600) as world:
        results = world.run(_compare_across, trials, burst)
    assert [r["checks"] for r in results] == [2 * (3 * trials + burst)] * 2


def test_two_one_gpu_fleets_side_by_side() -> None:
    fleets = [MGPUController(DeviceProbeRunner, devices=[d]) for d in (0, 1)]
    try:
        starters = [threading.Thread(target=f.start, kwargs={"timeout": 300}) for f in fleets]
        for t in starters:
            t.start()
        for t in starters:
            t.join(320)
        assert all(f.is_alive for f in fleets)
        alone = _reports(list(fleets[0].stream(busy_s=2.0)))[0]
        results: dict[int, list[Any]] = {}

        def job(i: int) -> None:
            results[i] = list(fleets[i].stream(busy_s=2.0))

        threads = [threading.Thread(target=job, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        (a,), (b,) = (_reports(results[i]) for i in (0, 1))
        assert a["device"] == "cuda:0" and b["device"] == "cuda:1" and a["uuid"] != b["uuid"]
        overlap = min(a["end"], b["end"]) - max(a["start"], b["start"])
        assert overlap > 1.0, (a, b)  # they really ran at the same time
        # each fleet keeps its pace while the other works (measured: no slowdown between the two H200s)
        assert min(a["iters"], b["iters"]) >= 0.8 * alone["iters"], (alone["iters"], a["iters"], b["iters"])
        print(f"matmuls in 2 s: alone {alone['iters']}, side by side {a['iters']} and {b['iters']}")
        print(check_placement([a, b], absent=_this_process_if_cuda_free()))
    finally:
        for f in fleets:
            f.shutdown(graceful_timeout=30)
