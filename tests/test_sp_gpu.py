"""SP on CUDA: W ranks oversubscribed on one GPU (gloo between processes; NCCL refuses two ranks on one
device), so multi-rank SP runs on a single H200. Skipped cleanly without CUDA.

Every rank's device comes from the caller ("cuda:0" for all of them), never from its rank number: ranks
1..W-1 run on a device whose index differs from their rank, which is the `devices=[4,5,6,7]` situation the
reference breaks on.

Run on the GPU machine:  pytest -m gpu tests/test_sp_gpu.py tests/test_smoke_runner_gpu.py -v
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ltx_mgpu.parallel.testing import LocalWorld
from ltx_mgpu.runners.smoke.checkpoint import ensure_smoke_checkpoint, tiny_transformer_config

from .test_sp_parallel import CASES, HEADS, TOL, _round_trip, _run_numerics

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _ipc_available() -> bool:
    try:
        from ltx_mgpu.parallel.sp.backends.ipc import is_available
    except ImportError:
        return False
    return torch.cuda.is_available() and is_available(torch.device("cuda", 0))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    cfg = tiny_transformer_config(num_heads=HEADS, audio_num_heads=HEADS)
    return str(ensure_smoke_checkpoint(tmp_path_factory.mktemp("sp_gpu_ckpt"), transformer_config=cfg).transformer_path)


_WORLDS: dict[int, LocalWorld] = {}


@pytest.fixture(scope="module")
def worlds() -> Any:
    yield _WORLDS
    for world in _WORLDS.values():
        world.begin_close()  # all worlds wind down concurrently
    for world in _WORLDS.values():
        world.close()
    _WORLDS.clear()


def _world(size: int) -> LocalWorld:
    world = _WORLDS.get(size)
    if world is None or not world.healthy:
        world = _WORLDS[size] = LocalWorld(size, devices=["cuda:0"] * size, backend="gloo", timeout=300)
    return world


BACKENDS = [
    "dist",
    pytest.param("ipc", marks=pytest.mark.skipif(not _ipc_available(), reason="ipc kernel not built/usable")),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_sp_fp32_matches_single_device(worlds: dict, checkpoint: str, world_size: int, backend: str) -> None:
    per_rank = _world(world_size).run(_run_numerics, checkpoint, CASES, backend=backend)
    for rank_results in per_rank:
        for res in rank_results:
            label = f"{backend} world {world_size} case {res['case']}"
            assert res["backend"] == backend, label
            assert res["video_diff"] <= TOL, f"{label}: video {res['video_diff']:.3g}"
            assert res["audio_diff"] <= TOL, f"{label}: audio {res['audio_diff']:.3g}"
            padded = res["tokens"] + (-res["tokens"]) % world_size
            assert res["tile"] == [padded // world_size] and res["attn_heads"] == [HEADS // world_size], label


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_sp_bf16_is_no_worse_than_single_device_bf16(
    worlds: dict, checkpoint: str, world_size: int, backend: str
) -> None:
    """bf16 SP vs bf16 single device cannot be bit-equal (different kernels and row counts); both are
    compared with an fp32 single-device reference and SP must stay within 2x the single-device error."""
    per_rank = _world(world_size).run(_run_numerics, checkpoint, CASES, backend=backend, dtype="bfloat16")
    for rank_results in per_rank:
        for res in rank_results:
            label = f"{backend} world {world_size} case {res['case']}"
            assert res["sp_err"] <= 2 * res["single_err"] + 1e-2, (
                f"{label}: SP bf16 error {res['sp_err']:.3g} vs single-device bf16 error {res['single_err']:.3g}"
            )


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_dist_round_trip_on_cuda_is_byte_exact(worlds: dict, world_size: int, dtype: str) -> None:
    uneven = [(3 * r + 2) % 7 + 1 for r in range(world_size)]
    for tokens in ([6] * world_size, uneven):
        for rank, res in enumerate(_world(world_size).run(_round_trip, tokens, dtype, 2)):
            assert all(res.values()), f"rank {rank}, tokens {tokens}: {res}"
