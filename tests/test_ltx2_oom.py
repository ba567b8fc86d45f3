"""An out-of-memory error in every stage of the real LTX-2 two-stage runner (tiny checkpoints, 2 CPU ranks):
it ends the job, never the fleet, and the next job renders on the same processes, with the lower-memory plan.

The error is injected by the runners' stage clock (`LTX_MGPU_INJECT_OOM` names a file listing the stages to
fail; `ltx_mgpu/runners/common/stages.py`), so it rises where a real allocation failure would: at a stage's
start, on every rank that runs the stage. Stages every rank runs end the job symmetrically
(`SymmetricRunnerError.out_of_memory`); the driver's own stages (audio decode, mux) end it on the driver
while the other ranks had finished (`AsymmetricRunnerError`, whose out-of-memory terminal the worker treats
as an out-of-memory job: tests/test_worker_memory.py).
"""

from __future__ import annotations

import os

import pytest

from ltx_mgpu import AsymmetricRunnerError, MGPUController, RenderOutOfMemory, SymmetricRunnerError
from ltx_mgpu.runners.common.stages import INJECT_OOM_ENV
from ltx_mgpu.runners.ltx2.runners import Ltx2TwoStageRunner

from .test_ltx2_runners import JOB, START_TIMEOUT, render, two_stage_setup

pytestmark = pytest.mark.timeout(900)

EVERY_RANK = ("encode", "lora_swap_stage1", "stage1", "upsample", "lora_swap_stage2", "stage2", "decode")
DRIVER_ONLY = ("audio_decode", "mux")


@pytest.fixture(scope="module")
def tiny():
    from ltx_mgpu.runners.ltx2.tiny import ensure_tiny_ltx2

    return ensure_tiny_ltx2()


@pytest.fixture(scope="module")
def fleet(tiny, tmp_path_factory):
    stages = tmp_path_factory.mktemp("oom") / "stages"
    stages.write_text("")
    previous = os.environ.get(INJECT_OOM_ENV)
    os.environ[INJECT_OOM_ENV] = str(stages)  # (the ranks inherit it at spawn)
    try:
        ctl = MGPUController(Ltx2TwoStageRunner, devices=["cpu", "cpu"], error_settle_s=60)
        ctl.start(timeout=START_TIMEOUT, **two_stage_setup(tiny))
    finally:
        if previous is None:
            os.environ.pop(INJECT_OOM_ENV, None)
        else:
            os.environ[INJECT_OOM_ENV] = previous
    yield ctl, stages
    ctl.shutdown(graceful_timeout=10)


@pytest.mark.parametrize("stage", EVERY_RANK + DRIVER_ONLY)
def test_an_out_of_memory_error_in_a_stage_ends_the_job_not_the_fleet(fleet, stage, tmp_path):
    ctl, stages = fleet
    pids = ctl.pids
    stages.write_text(stage + "\n")
    try:
        expected = SymmetricRunnerError if stage in EVERY_RANK else AsymmetricRunnerError
        with pytest.raises(expected) as info:
            list(ctl.stream(timeout=300, output_path=str(tmp_path / "x.mp4"), **JOB))
    finally:
        stages.write_text("")
    terminals = info.value.errors if stage in EVERY_RANK else info.value.terminals
    ooms = [t for t in terminals if isinstance(t, RenderOutOfMemory)]
    assert ooms and f"in stage {stage}" in ooms[0].message, terminals
    assert len(ooms) == (2 if stage in EVERY_RANK else 1)
    assert ctl.is_alive and ctl.pids == pids


def test_the_lower_memory_plan_renders_on_the_same_fleet(fleet, tmp_path):
    ctl, _ = fleet
    pids = ctl.pids
    plan = {"decode_chunked": True, "release_between_stages": True, "predicted_peak_gib": 0.1}
    _, out, _ = render(ctl, tmp_path / "low.mp4", memory_plan=plan)
    assert out["memory_plan"] == plan and ctl.pids == pids


def test_the_memory_plan_switches_the_decode_per_job_and_back(tiny, tmp_path):
    """`decode_chunked` decodes in ltx-core's default chunks for that job only; a clip smaller than one chunk
    decodes to the same frames either way (the chunks are the reference CLI's tiling, not a new blend)."""
    from ltx_core.model.video_vae import TilingConfig

    from ltx_mgpu.media.mp4_read import read_mp4
    from ltx_mgpu.runners.common.local import LocalRunner
    from ltx_mgpu.runners.ltx2.runners import Ltx2DistilledRunner

    from .test_ltx2_runners import distilled_setup

    with LocalRunner(Ltx2DistilledRunner) as local:
        local.start(**distilled_setup(tiny, dtype="float32"))
        runner = local.runner
        seen = []
        decode = runner.decoder.decode

        def spy(*args, **kwargs):
            seen.append(runner.decoder.chunk_tiling)
            return decode(*args, **kwargs)

        runner.decoder.decode = spy
        plan = {"decode_chunked": True, "release_between_stages": True}
        local.run(output_path=str(tmp_path / "low.mp4"), memory_plan=plan, **JOB)
        local.run(output_path=str(tmp_path / "fast.mp4"), **JOB)
    assert seen == [TilingConfig.default(), None]
    low, fast = read_mp4(tmp_path / "low.mp4")[0], read_mp4(tmp_path / "fast.mp4")[0]
    assert (low.float() - fast.float()).abs().mean().item() < 0.5
