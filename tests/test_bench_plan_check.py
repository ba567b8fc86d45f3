"""`bench/plan_check.py`'s report: predicted against measured reserved peaks per plan stage, the worst rank of
each (the GPU run itself: the command in the script's docstring; its CPU run is a check of the script)."""

from __future__ import annotations

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
