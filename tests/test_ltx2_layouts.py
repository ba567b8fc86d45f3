"""The two-stage runner's stage 1 under guidance-parallel layouts, end to end on 2 CPU ranks: the layout
comes from the `parallel_layout` setup kwarg or the cost model, is reported in the stage-1 event, and the
render is the same video whichever layout ran it (the tiny checkpoints of `ltx2.tiny`, bf16 weights: the
two layouts batch the passes differently, so frames agree to within a few levels, not bit for bit)."""

from __future__ import annotations

import pytest

from ltx_mgpu import MGPUController
from ltx_mgpu.media.mp4_read import read_mp4
from ltx_mgpu.runners.ltx2.runners import Ltx2TwoStageRunner

JOB = {"prompt": "a cat walks along the beach", "width": 128, "height": 128, "num_frames": 9, "frame_rate": 8.0}
SETUP = {"prompt_tokens": 128, "default_steps": 2, "enhance_max_new_tokens": 6, "tdp_overlap": 1}


@pytest.fixture(scope="module")
def tiny():
    from ltx_mgpu.runners.ltx2.tiny import ensure_tiny_ltx2

    return ensure_tiny_ltx2()


def _render(tiny, tmp_path, parallel_layout):
    """One fleet, one job: (stage-1 event, frames)."""
    ctl = MGPUController(Ltx2TwoStageRunner, devices=["cpu", "cpu"])
    ctl.start(timeout=300, **tiny.setup_kwargs(), **SETUP, parallel_layout=parallel_layout)
    try:
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.mp4"
        events = list(ctl.stream(timeout=300, output_path=str(path), **JOB))
    finally:
        ctl.shutdown(graceful_timeout=10)
    stage1 = next(e for e in events if isinstance(e, dict) and e.get("type") == "stage" and e["stage"] == "stage1")
    frames, _ = read_mp4(path)
    return stage1, frames


def test_stage1_layout_is_chosen_reported_and_faithful(tiny, tmp_path):
    gp_event, gp = _render(tiny, tmp_path, None)  # the cost model: 4 passes over 8 tokens -> 2x1
    sp_event, sp = _render(tiny, tmp_path, {"stage1": "1x2"})
    layout = gp_event["layout"]
    assert (layout["name"], layout["guidance"], layout["sequence"], layout["source"]) == ("2x1", 2, 1, "auto")
    assert set(layout["estimated_step_ms"]) == {"1x2", "2x1"}
    assert sp_event["layout"] == {"name": "1x2", "guidance": 1, "sequence": 2, "source": "override"}
    assert gp.shape == sp.shape and gp.float().std() > 1.0
    assert (gp.float() - sp.float()).abs().mean() < 2.0, (gp.float() - sp.float()).abs().mean()


def test_bad_layout_fails_setup(tiny):
    ctl = MGPUController(Ltx2TwoStageRunner, devices=["cpu", "cpu"])
    with pytest.raises(Exception, match="parallel_layout 3x1 does not fit a fleet of 2 ranks"):
        ctl.start(timeout=300, **tiny.setup_kwargs(), **SETUP, parallel_layout="3x1")
    ctl.shutdown(graceful_timeout=10)
