"""Deterministic renders on CUDA (`ltx_mgpu.control.determinism`), in the default mode (no
`LTX_DETERMINISTIC`: `auto`, which is `on` on GPU fleets too): five same-seed jobs of each LTX-2 runner on
tiny checkpoints give one frames hash and one audio hash (the audio VAE decoder's and vocoder's convolutions
included: under `off` the audio hash differed job to job on an H100), and a rebuilt fleet (new processes,
new CUDA contexts, new cuDNN/cuBLAS handles) gives the same two. Hashes as the worker computes them
(`runners.common.digest.MediaDigest` over the `media="frames"` hand-off: yuv420p frames, float32 audio).
Every rank of a default fleet has the switches before its runner exists (`SwitchProbe`), and offers the
memory plan the device's total memory from its ready stamp on.

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
from ltx_mgpu.control import determinism
from ltx_mgpu.runners.common.digest import MediaDigest
from ltx_mgpu.runners.ltx2.runners import Ltx2DistilledRunner, Ltx2TwoStageRunner
from tests.support.determinism import ON_SWITCHES, probe_ranks

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


@pytest.fixture
def default_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """No `LTX_DETERMINISTIC` and no `CUBLAS_WORKSPACE_CONFIG` in the environment the ranks inherit: the
    worker's default, with nothing set beforehand by the shell."""
    monkeypatch.delenv(determinism.ENV, raising=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)


def _fleet(runner: type, devices: list[int], tiny: Any, mode: str | None) -> MGPUController:
    """A started fleet in `mode` (None: the default, which must resolve to `on`)."""
    ctl = MGPUController(runner, devices=devices, deterministic=mode)
    ctl.start(timeout=600, **_setup(tiny, runner))
    assert ctl.deterministic == (mode or "on")
    return ctl


def _total_memory(devices: list[int]) -> int:
    return min(torch.cuda.get_device_properties(d).total_memory for d in devices)


@pytest.mark.parametrize("devices", _layouts(), ids=lambda d: f"gpus{len(d)}")
def test_every_rank_of_a_default_gpu_fleet_has_the_switches_before_its_runner_exists(default_mode, devices):
    """On CUDA the switches must be set before the rank's first cuBLAS handle (the workspace size is read
    then) and before cuDNN picks an algorithm: the fleet sets them before it builds the runner."""
    mode, reports = probe_ranks(devices, None)
    assert mode == "on"
    assert [r["rank"] for r in reports] == list(range(len(devices)))
    for report in reports:
        assert report["at_init"] == ON_SWITCHES and report["in_job"] == ON_SWITCHES, report


@pytest.mark.parametrize("devices", _layouts(), ids=lambda d: f"gpus{len(d)}")
@pytest.mark.parametrize(("name", "runner"), RUNNERS)
def test_same_seed_renders_one_video_across_jobs_and_a_rebuild(tiny, default_mode, capsys, name, runner, devices):
    ctl = _fleet(runner, devices, tiny, None)
    try:
        # every rank offered the plan the device's total memory after setup (free memory varies per build)
        assert ctl.startup is not None and ctl.startup.device_memory_bytes == _total_memory(devices)
        hashes = []
        for _ in range(REPEATS):
            h, output = _render(ctl)
            hashes.append(h)
        other, _ = _render(ctl, seed=12)
        # the plan's capacity is the device's total memory, not its free memory (the decode's chunking
        # must not change with what else holds the GPU)
        total = torch.cuda.get_device_properties(devices[0]).total_memory
        assert output.get("device_memory_bytes") == total, output.get("device_memory_bytes")
    finally:
        ctl.shutdown(graceful_timeout=30)
    ctl = _fleet(runner, devices, tiny, None)  # a rebuild: new processes, contexts and library handles
    try:
        rebuilt = [_render(ctl)[0] for _ in range(2)]
    finally:
        ctl.shutdown(graceful_timeout=30)
    with capsys.disabled():
        print(f"\n[determinism gpu] {name} devices={devices}: {len(set(hashes))} distinct of {len(hashes)}, "
              f"after a rebuild {len(set(rebuilt) | set(hashes))} distinct; frames {hashes[0][0][:16]}…")  # fmt: skip
    assert hashes[0][1] is not None  # (the tiny runners render audio on the GPU)
    assert len({h[0] for h in hashes}) == 1, hashes  # one frames hash for the five jobs
    assert len({h[1] for h in hashes}) == 1, hashes  # one audio hash (the vocoder's convolutions included)
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
