"""`bench/plan_check.py`'s report: predicted against measured reserved peaks per plan stage, the worst rank of
each (the GPU run itself: the command in the script's docstring; its CPU run is a check of the script)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.plan_check import GIB, stage_rows
from ltx_mgpu.spec import memory_plan


def test_each_plan_stage_is_compared_on_its_worst_rank():
    planned = memory_plan.plan(memory_plan.FleetMemory("distilled", 2), 1536, 1024, 241)
    reserved = {s.stage: [int(s.reserved_gib * GIB * 0.9), int(s.reserved_gib * GIB)] for s in planned.stages}
    output = {"peak_reserved_bytes": {**reserved, "decode": [0, 0]}, "peak_memory_bytes": {"stage1": [GIB, 2 * GIB]},
              "timings_s": {"stage1": 3.5}}  # fmt: skip
    rows = {r["stage"]: r for r in stage_rows("1536x1024x241", planned, output)}
    assert list(rows) == list(memory_plan.STAGES)
    assert rows["stage1"]["error"] == pytest.approx(0.0, abs=0.01) and rows["stage1"]["measured_allocated_gib"] == 2.0
    assert rows["stage1"]["seconds"] == 3.5
    assert "error" not in rows["decode"]  # nothing measured (a CPU fleet): no error claimed


def test_a_smaller_card_is_placed_as_the_worker_would_place_it_there(capsys):
    """`--offered-gib 40` (a 48 GB card emulated) places the fp8 distilled fleet for a card offering 40 GiB, not
    for the local one: Gemma streams, as on such a card; an 80 GB card's figure keeps it resident or parked."""
    import argparse

    from bench.plan_check import place

    args = argparse.Namespace(placement="auto", card=None, offered_gib=40.0, host_gib=100.0)
    setup = {"quantization": "fp8-mm+attn"}
    assert place("distilled", ["cpu"], setup, [(768, 512, 121)], args)["text_encoder"] == "stream"
    assert '"card": "40GiB' in capsys.readouterr().out
    args.offered_gib = 76.9
    assert place("distilled", ["cpu"], setup, [(768, 512, 121)], args)["text_encoder"] != "stream"


def test_every_plan_variant_that_fits_renders_twice_and_the_chosen_one_last(capsys):
    """`--variants`: on an H100-sized two-stage fp8 fleet whose text encoder may park, each variant the size fits
    in is rendered twice with its own `memory_plan` kwarg, the chosen plan last; one that runs out of memory
    is counted (a plan bug) and the rest still run."""
    import json
    from dataclasses import replace

    from bench.plan_check import compare_variants
    from ltx_mgpu import SymmetricRunnerError
    from ltx_mgpu.control.errors import RenderOutOfMemory
    from ltx_mgpu.runners.ltx2 import spec

    cfg = {m: {"stg_scale": 0, "modality_scale": 1, "rescale_scale": 0} for m in ("video", "audio")}
    placement = {"text_encoder": "park", "lora_backup": "host"}
    setup = {"stage1_guidance": cfg, "quantization": "fp8-mm+attn", "placement": placement}
    fleet = replace(spec.memory_fleet("two-stage", 1, setup), capacity_gib=76.9)
    chosen = memory_plan.plan(fleet, 1536, 1024, 121)
    fitting = [v for v in memory_plan.variants(fleet, 1536, 1024, 121) if v.peak.reserved_gib <= v.limit_gib]
    assert len(fitting) >= 2 and chosen.job_kwargs() in [v.job_kwargs() for v in fitting]

    class Fleet:
        def __init__(self):
            self.plans = []

        def stream(self, *, memory_plan, **_):
            self.plans.append(memory_plan)
            if memory_plan.get("park_text_encoder") and not memory_plan["decode_chunked"]:
                raise SymmetricRunnerError([RenderOutOfMemory("CUDA out of memory. Tried to allocate 2 GiB")])
            yield {"type": "output", "timings_s": {"decode": 1.0}}

    ctl = Fleet()
    request = {"width": 1536, "height": 1024, "num_frames": 121}
    oom = compare_variants(ctl, Path("."), request, fleet, chosen, {"wall_s": 9.0})
    parked_whole = [v for v in fitting if v.park_text_encoder and not v.decode_chunked]
    assert oom == len(parked_whole)
    others = [v.job_kwargs() for v in fitting if v.job_kwargs() != chosen.job_kwargs()]
    rendered = [p for p in ctl.plans if not (p.get("park_text_encoder") and not p["decode_chunked"])]
    assert rendered[-2:] == [chosen.job_kwargs()] * 2
    assert len(ctl.plans) == 2 * len(others) - len(parked_whole) + 2
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    summary = [line for line in lines if line["event"] == "variants"][-1]
    assert summary["first_render_s"] == 9.0 and len(summary["wall_s"]) == len(fitting) - len(parked_whole)
    assert set(summary["wall_over_chosen"]) == set(summary["wall_s"]) and summary["chosen"] in summary["wall_s"]
