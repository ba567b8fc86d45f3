"""Deterministic renders on CUDA (`ltx_mgpu.control.determinism`): five same-seed jobs of each LTX-2 runner on
tiny checkpoints give one frames hash and one audio hash, and a rebuilt fleet (new processes, new CUDA
contexts, new cuDNN/cuBLAS handles) gives the same two. Hashes as the worker computes them
(`runners.common.digest.MediaDigest` over the `media="frames"` hand-off: yuv420p frames, float32 audio).

Layouts: one GPU; two ranks with a GPU each over NCCL when the machine has two (SP, tiled stage 2 with its
rank-ordered sum). Two layouts need not agree with each other, and are not compared. `strict` (torch's
`warn_only=False`: flash attention instead of cuDNN's) runs one job each to show no op it uses raises.

Skipped without CUDA. On the GPU box:

    pytest -q -m gpu tests/test_determinism_gpu.py
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ltx_mgpu import MGPUController
from ltx_mgpu.runners.common.digest import MediaDigest
from ltx_mgpu.runners.ltx2.runners import Ltx2DistilledRunner, Ltx2TwoStageRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible)"),
]

JOB = {"prompt": "a cat walks along the beach", "width": 256, "height": 192, "num_frames": 17, "frame_rate": 8.0,
       "seed": 11, "media": "frames"}  # fmt: skip
SETUP = {"prompt_tokens": 128, "default_steps": 3, "tdp_overlap": 1, "dtype": "bfloat16"}
RUNNERS = [("ltx2-distilled", Ltx2DistilledRunner), ("ltx2-two-stage", Ltx2TwoStageRunner)]
REPEATS = 5


def _layouts() -> list[list[int]]:
    return [[0], [0, 1]] if torch.cuda.device_count() >= 2 else [[0]]


@pytest.fixture(scope="module")
def tiny() -> Any:
    from ltx_mgpu.runners.ltx2.tiny import ensure_tiny_ltx2

    return ensure_tiny_ltx2()


def _setup(tiny: Any, runner: type) -> dict[str, Any]:
    kw = {**tiny.setup_kwargs(), **SETUP}
    if runner is Ltx2DistilledRunner:
        kw.pop("distilled_lora_path")
    return kw


def _render(ctl: MGPUController, **change: Any) -> tuple[tuple[str | None, str | None], dict[str, Any]]:
    """One job handed off as frames: ((frames sha256, audio sha256), the output event)."""
    events = list(ctl.stream(timeout=600, output_path="/dev/null", **{**JOB, **change}))
    media = next(e for e in events if isinstance(e, dict) and e.get("type") == "media")
    output = next(e for e in events if isinstance(e, dict) and e.get("type") == "output")
    digest = MediaDigest(media["video"], media.get("audio")).result()
    return (digest["frames_sha256"], digest["audio_sha256"]), output


def _fleet(runner: type, devices: list[int], tiny: Any, mode: str) -> MGPUController:
    ctl = MGPUController(runner, devices=devices, deterministic=mode)
    ctl.start(timeout=600, **_setup(tiny, runner))
    assert ctl.deterministic == mode
    return ctl


@pytest.mark.parametrize("devices", _layouts(), ids=lambda d: f"gpus{len(d)}")
@pytest.mark.parametrize(("name", "runner"), RUNNERS)
def test_same_seed_renders_one_video_across_jobs_and_a_rebuild(tiny, capsys, name, runner, devices):
    ctl = _fleet(runner, devices, tiny, "on")
    try:
        hashes = []
        for _ in range(REPEATS):
            h, output = _render(ctl)
            hashes.append(h)
        other, _ = _render(ctl, seed=12)
        # the plan's capacity is the device's total memory, not its free memory (the decode's chunking
        # must not change with what else holds the GPU)
        total = torch.cuda.get_device_properties(0).total_memory
        assert output.get("device_memory_bytes") == total, output.get("device_memory_bytes")
    finally:
        ctl.shutdown(graceful_timeout=30)
    ctl = _fleet(runner, devices, tiny, "on")  # a rebuild: new processes, contexts and library handles
    try:
        rebuilt = [_render(ctl)[0] for _ in range(2)]
    finally:
        ctl.shutdown(graceful_timeout=30)
    with capsys.disabled():
        print(f"\n[determinism gpu] {name} devices={devices}: {len(set(hashes))} distinct of {len(hashes)}, "
              f"after a rebuild {len(set(rebuilt) | set(hashes))} distinct; frames {hashes[0][0][:16]}…")  # fmt: skip
    assert hashes[0][1] is not None  # (the tiny runners render audio on the GPU)
    assert len({h[0] for h in hashes}) == 1, hashes
    assert len({h[1] for h in hashes}) == 1, hashes
    assert set(rebuilt) == {hashes[0]}, (hashes[0], rebuilt)
    assert other[0] != hashes[0][0]  # (another seed, other frames: the hash is not a constant)


@pytest.mark.parametrize(("name", "runner"), RUNNERS)
def test_strict_mode_renders_and_repeats(tiny, name, runner):
    """Under `warn_only=False` every op a render uses has a deterministic CUDA implementation (else torch
    raises, and the job fails with that op's name)."""
    ctl = _fleet(runner, [0], tiny, "strict")
    try:
        first, _ = _render(ctl)
        second, _ = _render(ctl)
    finally:
        ctl.shutdown(graceful_timeout=30)
    assert first == second
