"""`python -m bench.e2e runs` on CPU, as CI runs it: the whole stack (Redis, SeaweedFS, `ltx-worker` with a CPU fleet of
two ranks, the real LTX-2 distilled runner on tiny checkpoints) and every field of its SUMMARY filled, except
what a CPU run cannot know (GPU memory). Plus the pieces of the benchmark that have logic of their own.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.e2e.clock import gpu_busy_ratio, idle_gaps_ms
from bench.e2e.runs import cold_ready, ratios
from bench.e2e.stack import discover_weights, make_workload
from devstack.dev_servers import pid_alive

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = ["profile", "runner", "layout", "cold_ready_s", "e2e_p50_s", "e2e_p90_s", "stages_p50_s",
            "videos_per_hour", "gpu_busy_ratio", "fleet_idle_p50_ms", "peak_mem_gib", "rebuild_s"]  # fmt: skip
CPU_CANNOT_KNOW = {"peak_mem_gib", "gpu_mem_used_max_gib"}


@pytest.mark.timeout(900)
def test_cpu_run_fills_every_summary_field(tmp_path):
    out = tmp_path / "e2e.jsonl"
    cmd = [sys.executable, "-m", "bench.e2e", "runs", "--profile", "tiny", "--groups", "cpu:2", "--jobs", "3",
           "--out", str(out), "--workdir", str(tmp_path / "work")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=840, check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    lines = out.read_text().splitlines()
    assert lines[-1].startswith("SUMMARY ") and proc.stdout.rstrip().splitlines()[-1] == lines[-1]
    summary = json.loads(lines[-1].removeprefix("SUMMARY "))
    for key in REQUIRED:
        assert key in summary, key
        assert summary[key] is not None or key in CPU_CANNOT_KNOW, (key, summary)
    assert summary["profile"] == "tiny" and summary["runner"] == "ltx2-distilled" and summary["layout"] == "cpu:2"
    assert summary["peak_mem_gib"] is None and summary["failures"] == [] and len(summary["runs"]) == 1

    split = summary["cold_ready"]
    assert all(split[k] > 0 for k in ("process_start_s", "weight_load_s", "warmup_s")), split
    assert sum(split[k] for k in ("process_start_s", "weight_load_s", "warmup_s")) == pytest.approx(
        summary["cold_ready_s"], abs=0.01
    )
    # where each rank's start went: the setup parts of the LTX-2 runner, timed on every rank
    (ranks,) = summary["cold_ready_ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["boot_s"] > 0 and r["groups_s"] >= 0 and r["setup_s"] > 0, r
        phases = r["setup_phases_s"]
        assert {"prepare", "sp_attention", "transformer", "video_decoder", "text_encoder"} <= set(phases), r
        # the timed parts lie inside setup(): their sum is at most its span, up to rounding (each part and the
        # span to 1 ms, so 0.5 ms each) and the two clocks' rates (perf_counter against the wall clock, which
        # NTP may slew by at most 500 ppm); what setup() runs outside the parts has no bound under load
        rounding = 0.0005 * (len(phases) + 1)
        assert sum(phases.values()) <= r["setup_s"] * (1 + 500e-6) + rounding, r
    assert "driver_models" in ranks[0]["setup_phases_s"] and "driver_models" not in ranks[1]["setup_phases_s"]
    stages = summary["stages_p50_s"]
    # the worker encodes (the default): the fleet's last stage is the hand-off, the mp4 is the worker's
    assert {"encode", "stage1", "upsample", "stage2", "decode", "handoff", "worker_encode", "queue_wait", "upload",
            "e2e"} <= set(stages) and "mux" not in stages  # fmt: skip
    assert all(v is not None and v >= 0 for v in stages.values()), stages
    assert 0 < summary["e2e_p50_s"] <= summary["e2e_p90_s"]
    assert summary["videos_per_hour"] > 0 and summary["fleet_idle_p50_ms"] >= 0 and summary["event_gap_p50_ms"] >= 0
    assert 0 < summary["gpu_busy_ratio"] <= 1
    assert summary["denoise_beside_encode"]["denoise_alone_p50_s"] > 0  # (beside: only if an encode overlapped)
    assert summary["passes_per_step"] == 1

    jobs = [json.loads(line) for line in lines if line.startswith("{") and json.loads(line)["kind"] == "job"]
    assert [j["phase"] for j in jobs] == ["warm"] * 3 + ["backlog"] * 3 + ["rebuild"]
    assert all(j["state"] == "uploaded" and j["bytes"] > 0 for j in jobs), jobs
    killed = summary["killed_job"]
    assert killed["state"] == "uploaded" and killed["attempts"] == 2, killed  # retried once, then rendered
    assert killed["first_failure"]["reason"] == "fleet_failure", killed
    assert summary["rebuild_s"] >= summary["rebuild"]["fleet_startup"]["weight_load_s"]
    # Nothing the benchmark started survives it: the killed rank, the rebuilt fleet's ranks.
    pids = [summary["rebuild"]["killed_pid"], *(r["pid"] for r in summary["rebuild"]["fleet_startup"]["ranks"])]
    assert not [p for p in pids if pid_alive(p)]


def test_weights_are_found_by_content_not_by_name(tmp_path):
    from ltx_mgpu.runners.ltx2.tiny import ensure_tiny_ltx2

    tiny = ensure_tiny_ltx2()
    (tmp_path / "loras").mkdir()
    renamed = {
        "a.safetensors": tiny.checkpoint,
        "b.safetensors": tiny.upsampler,
        "loras/c.safetensors": tiny.distilled_lora,
    }
    for name, src in renamed.items():
        (tmp_path / name).symlink_to(src)
    shutil.copytree(tiny.gemma_root, tmp_path / "text-encoder")  # its own model-*.safetensors are not candidates
    assert discover_weights(tmp_path) == {
        "checkpoint_path": str(tmp_path / "a.safetensors"),
        "spatial_upsampler_path": str(tmp_path / "b.safetensors"),
        "distilled_lora_path": str(tmp_path / "loras" / "c.safetensors"),
        "gemma_root": str(tmp_path / "text-encoder"),
    }
    (tmp_path / "loras" / "c.safetensors").unlink()
    with pytest.raises(SystemExit, match="distilled_lora_path"):
        discover_weights(tmp_path)


def test_workloads_default_to_the_one_stage_request():
    weights = {"checkpoint_path": "c", "spatial_upsampler_path": "u", "gemma_root": "g", "distilled_lora_path": "l"}
    distilled = make_workload("ltx2-distilled", "full", weights)
    assert distilled.request["width"] == 768 and distilled.request["height"] == 512
    assert distilled.request["num_frames"] == 121 and distilled.request["frame_rate"] == 24.0
    assert "distilled_lora_path" not in distilled.setup and "steps" not in distilled.request  # 8 + 3, fixed
    two = make_workload("ltx2-two-stage", "full", weights)
    assert "steps" not in two.request  # the reference's default (40 for LTX-2.0 checkpoints)
    assert len(two.setup["stage2_sigmas"]) == 4 and "stage1_guidance" not in two.setup  # 3 distilled sigmas
    cfg = make_workload("ltx2-two-stage:cfg", "full", weights)
    assert cfg.setup["stage1_guidance"]["video"] == {"cfg_scale": 4.0, "stg_scale": 0.0, "rescale_scale": 0.0,
                                                      "modality_scale": 1.0}  # fmt: skip
    from ltx_mgpu.runners.ltx2.denoise import STAGE2_DISTILLED_SIGMAS

    assert tuple(two.setup["stage2_sigmas"]) == STAGE2_DISTILLED_SIGMAS
    with pytest.raises(SystemExit):
        make_workload("ltx2-distilled:cfg", "full", weights)


def test_sizes_are_repeatable_and_the_presets_cover_both_runners_on_one_and_two_gpus():
    from bench.e2e.plans import PLANS, refusal, sized
    from bench.e2e.runs import parse_args, specs_from

    args = parse_args(["--groups", "0", "--size", "1536x1024x121", "--size", "1536X1024X241",
                       "--runner", "ltx2-distilled", "--runner", "ltx2-two-stage:cfg"])  # fmt: skip
    specs = specs_from(args)
    assert [(s.runner, s.size) for s in specs] == [
        (r, z) for r in ("ltx2-distilled", "ltx2-two-stage:cfg") for z in ("1536x1024x121", "1536x1024x241")
    ]
    assert [s.size for s in specs_from(parse_args(["--groups", "0"]))] == [None]  # the default is unchanged
    with pytest.raises(SystemExit):
        parse_args(["--size", "1536x1024"])
    weights = {"checkpoint_path": "c", "spatial_upsampler_path": "u", "gemma_root": "g", "distilled_lora_path": "l"}
    big = sized(make_workload("ltx2-distilled", "full", weights), "1536x1024x241")
    assert (big.request["width"], big.request["height"], big.request["num_frames"]) == (1536, 1024, 241)
    assert big.request["frame_rate"] == 24.0 and sized(big, None) is big
    # ten seconds at 1536x1024 is 47,616 tokens in the distilled runner's stage 2: the default budget takes it
    assert "sp_max_tokens" not in big.setup and refusal(big, [1]) is None and refusal(big, [2]) is None
    huge = sized(make_workload("ltx2-two-stage:cfg", "full", weights), "3840x2176x481")
    assert "sp_max_tokens" not in huge.setup and refusal(huge, [1]) is None  # (no capacity: the budget only)
    over = dataclasses.replace(huge, setup={**huge.setup, "sp_max_tokens": 32768})
    assert "over the runner's SP token budget" in (refusal(over, [1]) or "")
    for plan, layout in (("sizes-gpu1", "0"), ("sizes-gpu2", "0,1")):
        covered = {(s.runner.split(":")[0], s.size) for s in PLANS[plan] if s.layout == layout}
        assert covered == {(r, z) for r in ("ltx2-distilled", "ltx2-two-stage")
                           for z in ("768x512x121", "1536x1024x121", "1536x1024x241")}, plan  # fmt: skip


def test_idle_gaps_are_per_fleet_and_cold_ready_phases_add_up():
    records = [
        {"worker": "a", "busy": [10.0, 12.0]},
        {"worker": "b", "busy": [10.5, 13.0]},
        {"worker": "a", "busy": [12.02, 14.0]},
        {"worker": "b", "busy": [13.1, 15.0]},
        {"worker": "a", "busy": None},
    ]
    assert [round(g, 3) for g in sorted(idle_gaps_ms(records))] == [20.0, 100.0]

    # the device clock: a fleet busy 2 + 1.5 s of the 4 s from its first device work to its last
    clocked = [{"worker": "a", "gpu_window": [10.0, 12.0], "gpu_busy_s": 2.0},
               {"worker": "a", "gpu_window": [12.5, 14.0], "gpu_busy_s": 1.5},
               {"worker": "b", "gpu_window": None, "gpu_busy_s": None}]  # fmt: skip
    assert gpu_busy_ratio(clocked) == 0.875 and idle_gaps_ms(clocked, "gpu_window") == [500.0]

    class W:
        launched_at = 100.0

    ready = [
        {"process_started_at": 100.5, "fleet": {"startup": {"started_at": 101.0, "process_start_s": 4.0,
                                                            "loaded_at": 110.0, "ready_at": 112.0}}},
        {"process_started_at": 100.6, "fleet": {"startup": {"started_at": 101.0, "process_start_s": 5.0,
                                                            "loaded_at": 111.0, "ready_at": 115.0}}},
    ]  # fmt: skip
    got = cold_ready(W(), ready)
    assert got["cold_ready_s"] == 15.0
    assert got["cold_ready"] == {"process_start_s": 6.0, "weight_load_s": 5.0, "warmup_s": 4.0,
                                 "worker_process_s": 0.6}  # fmt: skip


def test_encode_both_compares_the_worker_encode_with_the_fleet_encode():
    from bench.e2e.runs import parse_args, specs_from

    specs = specs_from(parse_args(["--encode", "both", "--groups", "0", "--profile", "tiny"]))
    assert [(s.groups, s.encode) for s in specs] == [(("0",), "worker"), (("0",), "fleet")]
    run = {"runner": "ltx2-distilled", "variant": "", "layout": "0"}
    got = ratios(
        [
            {**run, "encode": "worker", "e2e_p50_s": 3.0, "videos_per_hour": 1200.0, "gpu_busy_ratio": 0.96},
            {**run, "encode": "fleet", "e2e_p50_s": 4.0, "videos_per_hour": 800.0, "gpu_busy_ratio": 0.64},
        ]
    )
    name = "ltx2-distilled: 0 worker encode vs fleet encode"
    assert got == {f"{name}: e2e_p50_s": 0.75, f"{name}: videos_per_hour": 1.5, f"{name}: gpu_busy_ratio": 1.5}


def test_denoising_beside_an_encode_is_compared_with_denoising_alone():
    from bench.e2e.clock import denoise_beside_encode

    def job(worker, window, stage1, stage2, encode=None):
        return {"worker": worker, "gpu_window": window, "encode_window": encode,
                "stages_s": {"stage1": stage1, "upsample": 0.01, "stage2": stage2}}  # fmt: skip

    alone = [job("a", [0.0, 2.0], 1.0, 0.99), job("a", [5.0, 7.0], 1.1, 0.89)]  # denoise 2.0 and 2.0
    backlog = [
        job("a", [10.0, 12.0], 1.0, 1.0, encode=[12.1, 12.7]),  # first of the backlog: nothing encodes beside it
        job("a", [12.05, 14.1], 1.0, 1.09, encode=[14.2, 14.8]),  # beside the first one's whole encode
        job("a", [14.15, 14.4], 1.0, 1.19),  # 0.2 s of a 0.6 s encode: under half of it, not counted
        job("b", [14.2, 16.2], 1.5, 1.5),  # another fleet: the encode of "a" does not count
    ]
    got = denoise_beside_encode(alone, backlog)
    assert got == {"denoise_alone_p50_s": 2.0, "denoise_beside_encode_p50_s": 2.1, "jobs_beside_encode": 1,
                   "ratio": 1.05}  # fmt: skip
    assert denoise_beside_encode(alone, backlog[:1])["ratio"] is None  # nothing beside an encode: no ratio


def test_encode_stream_vs_once_compares_the_streamed_hand_off_with_one_hand_off():
    from bench.e2e.runs import parse_args, specs_from

    args = parse_args(["--encode", "stream-vs-once", "--groups", "0", "--profile", "tiny", "--vae-chunk-frames", "64"])
    assert [(s.groups, s.encode) for s in specs_from(args)] == [(("0",), "worker"), (("0",), "once")]
    run = {"runner": "ltx2-distilled", "variant": "", "layout": "0", "size": "768x512x121"}
    got = ratios([{**run, "encode": "worker", "e2e_p50_s": 2.7}, {**run, "encode": "once", "e2e_p50_s": 3.0}])
    assert got == {"ltx2-distilled: 0 768x512x121 streamed vs one hand-off: e2e_p50_s": 0.9}


def test_the_fleet_idle_gap_is_cut_at_the_events_that_mark_it():
    from bench.e2e.clock import idle_parts_ms

    def job(worker, window, busy_end, started, rendering):
        return {"worker": worker, "gpu_window": window, "busy": [window[0], busy_end], "started_at": started,
                "rendering_at": rendering}  # fmt: skip

    records = [
        job("a", [10.0, 12.0], 12.01, 9.9, 9.95),
        job("a", [12.2, 14.0], 14.02, 12.1, 12.15),  # 200 ms idle: 10 to output, 90 to started, 50, 50
        job("b", [13.0, 15.0], 15.0, 12.0, 12.5),  # another fleet: never paired with "a"
    ]
    got = idle_parts_ms(records)
    assert got == {"fleet_to_output": 10.0, "output_to_started": 90.0, "started_to_rendering": 50.0,
                   "rendering_to_device": 50.0}  # fmt: skip
    assert sum(got.values()) == 200.0  # the parts add up to the gap
