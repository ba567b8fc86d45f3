"""Both LTX-2 runners on tiny checkpoints with CUDA ranks, printing the peak GPU memory and the wall time of
every stage; every mp4 has its AAC track (audio decoded on the driver's GPU), as long as the video within
0.1 s.

Skipped without CUDA. Cases: one process on cuda:0 (LocalRunner), 2 and 4 ranks oversubscribed on GPU 0
(gloo with host staging), 2 ranks with one GPU each over NCCL when the machine has 2+ GPUs, and the
two-stage runner with fp8-cast quantization (the LoRA fusion then takes ltx-core's triton fp8 path) and
with fp8-mm on one GPU (FP8 GEMMs, CUDA graphs, LoRA fused into e4m3 weights, deterministic). Plus
the synthetic checkpoint generator on CUDA: the tiny profile generated on the GPU renders, and a full-size
file (the 19B profile's upsampler) streams from the GPU and loads.

Run on the GPU box (prints a table even without -s):

    pytest -q -m gpu tests/test_ltx2_runners_gpu.py

Each row: runner, world, devices, stage -> peak `torch.cuda.max_memory_allocated` per rank in MiB (reset at
the start of each stage; all ranks of an oversubscribed world share one GPU, so their peaks add up there)
and the driver's seconds per stage.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from ltx_mgpu import MGPUController
from ltx_mgpu.media.mp4_read import probe_mp4, read_mp4
from ltx_mgpu.runners.common.local import LocalRunner
from ltx_mgpu.runners.ltx2.runners import Ltx2DistilledRunner, Ltx2TwoStageRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible)"),
]

JOB = {"prompt": "a cat walks along the beach", "width": 256, "height": 192, "num_frames": 17, "frame_rate": 8.0}
SETUP = {"prompt_tokens": 128, "default_steps": 3, "tdp_overlap": 1, "dtype": "bfloat16"}
REPORT = os.environ.get("LTX_GPU_REPORT", "ltx2_runner_gpu_memory.jsonl")


@pytest.fixture(scope="module")
def tiny():
    from ltx_mgpu.runners.ltx2.tiny import ensure_tiny_ltx2

    return ensure_tiny_ltx2()


def _setup(tiny, runner, **extra):
    kw = {**tiny.setup_kwargs(), **SETUP, **extra}
    if runner is Ltx2DistilledRunner:
        kw.pop("distilled_lora_path")
    return kw


def _report(capsys, name, world, devices, output, path):
    frames, fps = read_mp4(path)
    assert frames.shape == (JOB["num_frames"], JOB["height"], JOB["width"], 3) and fps == pytest.approx(8.0)
    streams = probe_mp4(path)
    assert (streams.audio_codec, streams.audio_sample_rate, streams.audio_channels) == ("aac", 24000, 2)
    assert abs(streams.audio_duration_s - streams.video_duration_s) < 0.1 and output["audio"] is True
    peaks = output.get("peak_memory_bytes")
    assert peaks, output  # CUDA ranks report their per-stage peaks
    assert set(peaks) == set(output["timings_s"]) >= {"encode", "stage1", "stage2", "decode", "audio_decode", "mux"}
    mib = {stage: [round(b / 2**20, 1) for b in per_rank] for stage, per_rank in peaks.items()}
    row = {"runner": name, "world": world, "devices": devices, "peak_mib": mib, "timings_s": output["timings_s"]}
    with open(REPORT, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")
    with capsys.disabled():
        print(f"\n[ltx2 gpu] {name} world={world} devices={devices}")
        for stage, mib in row["peak_mib"].items():
            print(f"    {stage:<12} {row['timings_s'][stage]:8.3f} s   peak MiB per rank: {mib}")


RUNNERS = [("ltx2-distilled", Ltx2DistilledRunner), ("ltx2-two-stage", Ltx2TwoStageRunner)]


@pytest.mark.parametrize(("name", "runner"), RUNNERS)
def test_one_process_on_cuda(tiny, tmp_path, capsys, name, runner):
    with LocalRunner(runner, device="cuda:0") as local:
        local.start(**_setup(tiny, runner))
        events = local.run(output_path=str(tmp_path / "v.mp4"), **JOB)
    output = next(e for e in events if e.get("type") == "output")
    _report(capsys, name, 1, ["cuda:0"], output, tmp_path / "v.mp4")


def _worlds() -> list[tuple[list[int], bool]]:
    cases = [([0, 0], True), ([0, 0, 0, 0], True)]
    if torch.cuda.device_count() >= 2:
        cases.append(([0, 1], False))
    return cases


@pytest.mark.parametrize(("name", "runner"), RUNNERS)
@pytest.mark.parametrize(("devices", "shared"), _worlds())
def test_fleet_on_cuda(tiny, tmp_path, capsys, name, runner, devices, shared):
    ctl = MGPUController(runner, devices=devices, allow_shared_devices=shared)
    ctl.start(timeout=600, **_setup(tiny, runner))
    try:
        events = list(ctl.stream(timeout=600, output_path=str(tmp_path / "v.mp4"), **JOB))
        output = next(e for e in events if isinstance(e, dict) and e.get("type") == "output")
        _report(capsys, name, len(devices), devices, output, tmp_path / "v.mp4")
        again = list(ctl.stream(timeout=600, output_path=str(tmp_path / "w.mp4"), **JOB))
        assert any(isinstance(e, dict) and e.get("type") == "output" for e in again)
        assert torch.equal(read_mp4(tmp_path / "v.mp4")[0], read_mp4(tmp_path / "w.mp4")[0])  # deterministic
    finally:
        ctl.shutdown(graceful_timeout=30)


def test_two_stage_fp8_cast_on_shared_gpu(tiny, tmp_path, capsys):
    ctl = MGPUController(Ltx2TwoStageRunner, devices=[0, 0], allow_shared_devices=True)
    ctl.start(timeout=600, **_setup(tiny, Ltx2TwoStageRunner, quantization="fp8-cast"))
    try:
        events = list(ctl.stream(timeout=600, output_path=str(tmp_path / "q.mp4"), **JOB))
        output = next(e for e in events if isinstance(e, dict) and e.get("type") == "output")
        _report(capsys, "ltx2-two-stage fp8-cast", 2, [0, 0], output, tmp_path / "q.mp4")
    finally:
        ctl.shutdown(graceful_timeout=30)


def test_two_stage_fp8_mm_on_one_gpu_renders_deterministically(tiny, tmp_path, capsys):
    """fp8-mm with real FP8 GEMMs (the tiny widths are multiples of 16), CUDA graphs, the distilled LoRA fused
    into e4m3 weights and tiled stage 2; a repeat (graphs replayed, LoRAs swapped twice) gives the same video."""
    from ltx_mgpu.fp8 import Fp8Linear, fp8_tensor_cores

    if not fp8_tensor_cores(torch.device("cuda:0")):
        pytest.skip("needs FP8 tensor cores (sm_89 or later)")
    with LocalRunner(Ltx2TwoStageRunner, device="cuda:0") as local:
        local.start(**_setup(tiny, Ltx2TwoStageRunner, quantization="fp8-mm"))
        assert any(isinstance(m, Fp8Linear) for m in local.runner.sp_model.model.modules())
        first = local.run(output_path=str(tmp_path / "a.mp4"), **JOB)
        local.run(output_path=str(tmp_path / "b.mp4"), **JOB)
    output = next(e for e in first if e.get("type") == "output")
    _report(capsys, "ltx2-two-stage fp8-mm", 1, ["cuda:0"], output, tmp_path / "a.mp4")
    assert torch.equal(read_mp4(tmp_path / "a.mp4")[0], read_mp4(tmp_path / "b.mp4")[0])


def test_synthetic_tiny_generated_on_cuda_renders(tmp_path, capsys):
    from ltx_mgpu.runners.ltx2.synthetic import write_checkpoints

    rows = []
    files = write_checkpoints("tiny", tmp_path / "tiny", device="cuda", report=rows.append)
    assert rows[-1]["event"] == "done" and rows[-1]["device"] == "cuda"
    with LocalRunner(Ltx2DistilledRunner, device="cuda:0") as local:
        kw = {**files.setup_kwargs(), **SETUP}
        kw.pop("distilled_lora_path")
        local.start(**kw)
        events = local.run(output_path=str(tmp_path / "v.mp4"), **JOB)
    output = next(e for e in events if e.get("type") == "output")
    assert output["synthetic_weights"] is True
    _report(capsys, "ltx2-distilled (tiny generated on cuda)", 1, ["cuda:0"], output, tmp_path / "v.mp4")


def test_full_size_file_streams_from_the_gpu_and_loads(tmp_path, capsys):
    """The 19B profile's upsampler (0.25 GB): generated on the GPU, staged through pinned buffers, loaded."""
    from ltx_mgpu.runners.common.loading import build_checked
    from ltx_mgpu.runners.ltx2.components import upsampler_builder
    from ltx_mgpu.runners.ltx2.synthetic import plan_files, write_checkpoints

    rows = []
    files = write_checkpoints("full", tmp_path / "full", device="cuda", components=["upsampler"], report=rows.append)
    model = build_checked(upsampler_builder(str(files.upsampler)), torch.device("cuda:0"), torch.bfloat16, "upsampler")
    planned = plan_files("full", ["upsampler"])[0].nbytes  # tensor bytes; the file adds its header
    assert rows[0]["bytes"] == files.upsampler.stat().st_size > planned
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == planned
    assert all(torch.isfinite(p).all() for p in model.parameters())
    with capsys.disabled():
        print(f"\n[synthetic gpu] {json.dumps(rows[0])}")
