"""The memory plan (`ltx_mgpu.spec.memory_plan`), its limits (`ltx_contract.limits`) and `ltx-worker plan`,
without a fleet.

Calibration: the plan reproduces the peaks measured on one H200 with synthetic full-size weights
(docs/performance.md, "Measured peaks"): distilled 71 GiB at 768x512x121 and 90 GiB at 1536x1024x121 (allocator peaks),
two-stage with CFG 114 GiB at 768x512x121 (allocator peak) and 139.2 GiB in use at 1536x1024x121; refitted
(`decode_bytes`, `runtime_gib`) when the CUDA-graph pools and the SP buffers were counted apart.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from ltx_contract.limits import MemoryViolation, RunnerLimits
from ltx_contract.schema import RenderRequest
from ltx_mgpu.spec import memory_plan, memory_profile
from ltx_mgpu.spec.memory_plan import FleetMemory, plan

H200_GIB = 139.5  # what one H200 offers a rank after its CUDA context (free + reserved)
H100_GIB = 76.9  # what one H100 80GB offers (`placement.CARDS`)


def _fleet(runner: str, world: int = 1, **kw: object) -> FleetMemory:
    passes = 2 if runner == "two-stage" else 1  # the measured two-stage runs: CFG only
    return FleetMemory(runner, world, passes=passes, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("runner", "size", "measured", "field"), [
    ("distilled", (768, 512, 121), 71.0, "allocated_gib"),
    ("distilled", (1536, 1024, 121), 90.0, "allocated_gib"),
    ("two-stage", (768, 512, 121), 114.0, "allocated_gib"),
    ("two-stage", (1536, 1024, 121), 139.2, "reserved_gib"),
])  # fmt: skip
def test_the_fast_plan_reproduces_the_measured_peaks(runner, size, measured, field):
    """Those runs captured every forward; stage 2 at 1536x1024x121 (24,576 tokens) is now over
    `MAX_CAPTURE_TOKEN_ROWS` and runs eager, so its pool (`graph_pool_bytes` a token, the allocator's cache on
    top for a reserved figure) is in the measurement and no longer in the plan: added back, the same fit holds."""
    p = plan(_fleet(runner), *size)  # no limit: the fast plan (the one measured)
    assert not p.decode_chunked and not p.release_between_stages and p.fits
    assert p.peak.stage == "decode" and p.peak.rank == 0
    profile = memory_plan.LTX2_19B
    t2 = (size[0] // 32) * (size[1] // 32) * ((size[2] - 1) // 8 + 1)
    gone = profile.graph_pool_bytes * t2 / 2**30 if t2 > memory_profile.MAX_CAPTURE_TOKEN_ROWS else 0.0
    gone *= 1 + profile.cache_fraction if field == "reserved_gib" else 1.0
    assert getattr(p.peak, field) + gone == pytest.approx(measured, abs=0.5), p.peak


def test_a_fast_plan_too_close_to_the_limit_takes_the_lower_memory_decode():
    """Two-stage CFG at 1536x1024x121 on one H200 was 139.2 of 141 GiB in use: the plan chunks the decode
    (ltx-core's default tiling, the reference CLI's) and releases the cache, leaving over 10 GiB free."""
    p = plan(_fleet("two-stage", capacity_gib=H200_GIB), 1536, 1024, 121)
    assert p.decode_chunked and p.release_between_stages and p.fits
    assert H200_GIB - max(s.reserved_gib for s in p.stages) >= 10.0
    room = round(H200_GIB - memory_plan.DEFAULT_HEADROOM_GIB - p.peak.reserved_gib, 3)
    assert p.job_kwargs() == {"decode_chunked": True, "release_between_stages": True,
                              "predicted_peak_gib": p.peak.reserved_gib,
                              "graph_pool_gib": round(p.graph_pool_gib, 3), "graph_room_gib": room}  # fmt: skip
    fast = plan(_fleet("distilled", capacity_gib=H200_GIB), 1536, 1024, 121)
    assert not fast.decode_chunked and fast.fits  # room enough: the fastest decode
    assert plan(_fleet("distilled", capacity_gib=H200_GIB), 768, 512, 121, low_memory=True).decode_chunked


def test_a_decode_past_32_bit_indexing_is_chunked_whatever_memory_is_free():
    """Distilled 1536x1024x241 on one H200: the plan admitted the one-piece decode (120.4 GiB predicted) and
    torch refused its last Conv3d input ("input tensor must fit into 32-bit index math"). A tile of that many
    pixel-frames is decoded in chunks even without a memory limit; two ranks halve the tile, and the sizes
    that rendered one-piece (1536x1024x121) keep the fast decode."""
    for capacity in (None, 1000.0):
        p = plan(_fleet("distilled", capacity_gib=capacity), 1536, 1024, 241)
        assert p.decode_chunked and p.fits and any("32-bit" in n for n in p.notes), p.notes
    assert not plan(_fleet("distilled"), 1536, 1024, 121).decode_chunked
    assert not plan(_fleet("distilled", world=2), 1536, 1024, 241).decode_chunked  # (a half-size tile per rank)


@pytest.mark.parametrize("runner", ["distilled", "two-stage"])
@pytest.mark.parametrize("world", [1, 2])
def test_the_preset_sizes_on_one_and_two_gpus(runner, world):
    fleet = _fleet(runner, world, capacity_gib=H200_GIB)
    for size in ((768, 512, 121), (1536, 1024, 121)):
        assert plan(fleet, *size).fits, (runner, world, size)
    assert plan(fleet, 1536, 1024, 241).fits  # the default SP budget admits what the memory does (37.4)
    if runner == "distilled":  # stage 2 is SP over 47,616 tokens: over a budget of 32,768 set by hand
        small = plan(_fleet(runner, world, capacity_gib=H200_GIB, sp_max_tokens=32768), 1536, 1024, 241)
        assert not small.fits and "47616 video tokens" in (small.refusal() or "")
    # every rank holds the transformer; the driver the encoder, upsampler and audio; Gemma the last rank
    assert all("transformer" in parts for parts in plan(fleet, 768, 512, 121).resident_gib.values())
    resident = plan(fleet, 768, 512, 121).resident_gib
    assert "upsampler" in resident[0] and "text_encoder" in resident[world - 1]
    if world == 2:
        assert "text_encoder" not in resident[0] and "upsampler" not in resident[1]


def test_two_gpus_lower_the_peak_and_shard_the_lora_backup():
    one, two = plan(_fleet("two-stage", 1), 1536, 1024, 121), plan(_fleet("two-stage", 2), 1536, 1024, 121)
    assert two.peak.reserved_gib < one.peak.reserved_gib
    unit = memory_plan.LTX2_19B.lora_unit_gib  # the owner balance leaves a rank at most one weight over 1/W
    assert two.resident_gib[0]["lora_backup"] == pytest.approx(one.resident_gib[0]["lora_backup"] / 2 + unit, abs=1e-3)
    assert two.decode_tiles == 2 and one.decode_tiles == 1


def test_the_largest_request_is_refused_up_front_with_what_fits():
    fleet = _fleet("distilled", 1, capacity_gib=H100_GIB)
    p = plan(fleet, 3840, 2176, 481)
    assert not p.fits and p.refusal()
    best = memory_plan.largest(fleet, 3840, 2176, 481)
    for text in best.values():
        assert text is not None and plan(fleet, *memory_plan.parse_size(text)).fits
    w, h, f = memory_plan.parse_size(best["frames"])
    # the most frames that fit with the suggestions' margin (2% of the capacity beyond the headroom) ...
    margin = replace(fleet, headroom_gib=fleet.headroom_gib + memory_plan.SUGGESTION_MARGIN * H100_GIB)
    assert (w, h) == (3840, 2176) and plan(margin, w, h, f).fits and not plan(margin, w, h, f + 8).fits
    # ... so a worker on the same card offering a little less still takes every suggested size (a size suggested
    # at 76.9 GiB offered was once refused by the next worker, at 76.8)
    less = replace(fleet, capacity_gib=H100_GIB - 0.1)
    assert all(plan(less, *memory_plan.parse_size(t)).fits for t in best.values() if t)
    # memory alone (a budget that allows the tokens): the refusal names the limit and the stage
    big = _fleet("distilled", 1, capacity_gib=60.0, sp_max_tokens=1 << 20)
    message = plan(big, 1536, 1024, 121).refusal()
    assert message is not None and "limit of 56.0 GiB per device" in message and "at stage" in message


def test_the_fleet_memory_travels_as_json_and_junk_is_ignored():
    fleet = _fleet("two-stage", 2, capacity_gib=80.0, text_encoder_rank=0)
    assert FleetMemory.from_json(json.loads(json.dumps(fleet.to_json()))) == fleet
    junks = [{"runner": "distilled", "world_size": 10**9}, {"runner": "distilled", "world_size": 1, "passes": True},
             {"runner": "distilled", "world_size": 1, "capacity_gib": float("nan")},
             {"runner": "distilled", "world_size": 2, "text_encoder_rank": 2}]  # fmt: skip
    for junk in (None, "x", {"runner": "nope", "world_size": 1}, {"runner": "distilled"}, {"world_size": "a"}, *junks):
        assert FleetMemory.from_json(junk) is None
    assert plan(fleet, 768, 512, 121).notes  # Gemma on the driver: the plan says a later rank has room
    with pytest.raises(ValueError):
        memory_plan.parse_size("1536x1024")


def test_the_ltx2_runners_describe_their_memory_from_their_setup():
    from bench.e2e.stack import CFG_ONLY
    from ltx_mgpu.runners.ltx2.distilled import Ltx2DistilledRunner
    from ltx_mgpu.runners.ltx2.two_stage import Ltx2TwoStageRunner

    assert Ltx2TwoStageRunner.memory_fleet(1).passes == 4  # the reference's CFG + STG + modality guidance
    assert Ltx2TwoStageRunner.memory_fleet(2, stage1_guidance=CFG_ONLY).passes == 2
    distilled = Ltx2DistilledRunner.memory_fleet(2, sp_max_tokens=4096, text_encoder_rank=0, vae_overlap=2)
    assert (distilled.runner, distilled.world_size, distilled.sp_max_tokens) == ("distilled", 2, 4096)
    assert (distilled.gemma_rank, distilled.vae_overlap, distilled.profile) == (0, 2, "ltx2-19b")
    fp8 = Ltx2DistilledRunner.memory_fleet(1, quantization="fp8-mm")
    p = memory_plan.LTX2_19B  # fp8-mm: blocks 1-42 in e4m3 + scales, blocks 0 and 43-47 and the projections bf16
    fp8_gib = p.transformer_gib - p.lora_weights_gib + p.lora_weights_fp8_gib
    assert fp8.fp8_transformer and plan(fp8, 768, 512, 121).resident_gib[0]["transformer"] == pytest.approx(fp8_gib)
    everywhere = Ltx2DistilledRunner.memory_fleet(2, text_encoder="batch-parallel")
    assert all("text_encoder" in parts for parts in plan(everywhere, 768, 512, 121).resident_gib.values())


def test_runner_limits_refuse_what_does_not_fit_and_say_the_same_after_publishing():
    from ltx_mgpu.runners.ltx2.distilled import Ltx2DistilledRunner

    limits = RunnerLimits.of("ltx2-distilled", Ltx2DistilledRunner, {}, world_size=1, capacity_gib=H100_GIB)
    assert limits.violations(RenderRequest(prompt="x", width=1536, height=1024, num_frames=121)) == []
    request = RenderRequest(prompt="x", width=3840, height=2176, num_frames=481)
    (bad,) = limits.violations(request)
    assert isinstance(bad, MemoryViolation) and bad.field == "size"
    most = memory_plan.largest(limits.memory, 3840, 2176, 481)["frames"]  # (its value: the test above)
    assert f"largest that fits: {most} or " in bad.message() and "ltx2-distilled" in bad.message()
    published = RunnerLimits.from_json(json.loads(json.dumps(limits.to_json())))
    assert published == limits and [v.message() for v in published.violations(request)] == [bad.message()]
    # no capacity (a CPU fleet, nothing set): the default SP budget takes every size the rules accept
    free = limits.with_capacity(None)
    assert free.memory is not None and free.memory.capacity_gib is None
    assert free.violations(request) == []
    budget = RunnerLimits.of("ltx2-distilled", Ltx2DistilledRunner, {"sp_max_tokens": 32768}).with_capacity(None)
    assert [v.field for v in budget.violations(request)] == ["size"]  # a budget set by hand: as the runner checks it
    assert budget.violations(RenderRequest(prompt="x", width=1536, height=1024, num_frames=161)) == []


def test_ltx_worker_plan_prints_the_plan_without_a_fleet(monkeypatch):
    from worker.cli import main

    monkeypatch.delenv("LTX_RUNNER_SETUP", raising=False)
    monkeypatch.delenv("LTX_DEVICE_MEMORY_GIB", raising=False)
    cli = CliRunner()
    args = ["plan", "--runner", "ltx2-two-stage", "--group", "0", "--size", "1536x1024x121", "--free-gib", "139.5"]
    out = cli.invoke(main, args)
    assert out.exit_code == 0, out.output
    for text in ("lora_backup", "text_encoder", "decode: 1 spatial tile(s)", "ltx-core's default chunks", "fits: yes"):
        assert text in out.output, out.output
    as_json = cli.invoke(main, [*args, "--json"])
    data = json.loads(as_json.output)
    assert data["fits"] and data["decode"]["chunked"] and data["fleet"]["world_size"] == 1
    refused = cli.invoke(main, ["plan", "--runner", "ltx2-distilled", "--group", "0,1", "--size", "3840x2176x481",
                                "--free-gib", "100"])  # fmt: skip
    assert refused.exit_code == 1 and "fits: NO" in refused.output and "largest that fits" in refused.output
    assert cli.invoke(main, ["plan", "--runner", "smoke", "--group", "cpu:1", "--size", "64x64x9"]).exit_code == 2
    assert cli.invoke(main, ["plan", "--runner", "ltx2-distilled", "--gpus", "0"]).exit_code == 2
    assert cli.invoke(main, ["plan", "--runner", "ltx2-distilled", "--group", "0", "--size", "64x64"]).exit_code == 2


#: What one H100 80GB allocated per stage, fp8-mm+attn distilled, Gemma parked (`bench.plan_check`, 2026-12-07,
#: tree `2e982ab`, the first job of each size: its stage-1 graph captured in it; the figures `memory_profile`'s
#: fp8 constants were fitted to).
H100_FP8_ALLOCATED = {
    (1920, 1088, 241): {"stage1": 28.76, "upsample": 26.01, "stage2": 37.14, "decode": 37.34},
    (1536, 1024, 241): {"stage1": 28.04, "upsample": 25.96, "stage2": 34.35, "decode": 35.07},
}


def test_graph_pools_follow_the_capture_bound_and_fp8_plans_cover_what_the_h100_allocated():
    """A captured forward holds its pool from its own stage on; one over `MAX_CAPTURE_TOKEN_ROWS` holds none.
    With fp8 the plan covers what an H100 allocated at every stage of the sizes it was fitted to, and by no more
    than a quarter (the cache fraction and the pool's overlap with stage 1's activations are counted on top of
    the 4% the constants carry); the two-stage size that once ran out of memory still fits."""
    fleet = _fleet("distilled", capacity_gib=H100_GIB, text_encoder_at="park")
    small, large = plan(fleet, 768, 512, 121), plan(fleet, 1536, 1024, 241)  # stage 2: 6,144 and 47,616 tokens
    stage = {s.stage: s.allocated_gib for s in small.stages}
    pool2 = memory_plan.LTX2_19B.graph_pool_bytes * 6144 / 2**30
    assert stage["stage2"] - stage["upsample"] > pool2  # its own pool in stage 2 (with its activations)
    assert large.graph_pool_gib == pytest.approx(memory_plan.LTX2_19B.graph_pool_bytes * 11904 / 2**30, abs=1e-3)
    fp8 = replace(fleet, fp8_transformer=True)
    for size, measured in H100_FP8_ALLOCATED.items():
        p = plan(fp8, *size)
        assert p.fits, (size, p.peak)
        gemma = 0.0 if p.park_text_encoder else memory_plan.LTX2_19B.text_encoder_gib  # (measured with it parked)
        for s in p.stages:
            if s.stage in measured:
                assert measured[s.stage] <= s.allocated_gib - gemma <= 1.25 * measured[s.stage], (size, s)
    two_stage = _fleet(
        "two-stage", capacity_gib=H100_GIB, text_encoder_at="park", fp8_transformer=True, lora_backup_at="host"
    )
    assert plan(two_stage, 1536, 1024, 121).fits


def test_ltx_worker_plan_for_another_quantization_than_the_settings(monkeypatch):
    """`--quantization` plans the setup the operator is choosing, not only the one configured: an fp8 fleet's
    plan counts the fp8 transformer (a lower peak than bf16 for the same size), `none` takes a configured fp8
    back to bf16, every header names the transformer's dtype, and a name the runners do not know is a usage
    error (exit 2), as it would fail the fleet's setup."""
    from worker.cli import main

    for name in ("LTX_DEVICE_MEMORY_GIB", "LTX_HOST_MEMORY_GIB", "LTX_PLACEMENT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LTX_RUNNER_SETUP", json.dumps({"quantization": "fp8-mm+attn"}))
    cli = CliRunner()
    args = ["plan", "--runner", "ltx2-distilled", "--group", "0", "--size", "768x512x121", "--gpu", "h100-80gb",
            "--host-gib", "100", "--json"]  # fmt: skip
    peaks = {}
    for quantization in (None, "none", "fp8-mm"):
        out = cli.invoke(main, args + ([] if quantization is None else ["--quantization", quantization]))
        assert out.exit_code == 0, out.output
        data = json.loads(out.output)
        peaks[quantization] = data["peak"]["allocated_gib"]
        assert data["fleet"]["fp8_transformer"] is (quantization != "none"), (quantization, data["fleet"])
    assert peaks[None] == peaks["fp8-mm"] < peaks["none"] - 10  # 36.5 GiB of bf16 against 20.1 of fp8, less Gemma
    text = cli.invoke(main, [*args[:-1], "--quantization", "none"]).output
    assert "bf16 transformer" in text.splitlines()[0], text
    table = cli.invoke(main, ["plan", "--runner", "ltx2-two-stage", "--gpus", "1", "--host-gib", "100"])
    assert "fp8 transformer" in table.output.splitlines()[0], table.output
    bad = cli.invoke(main, [*args, "--quantization", "fp8"])
    assert bad.exit_code == 2 and "--quantization must be none or one of" in bad.output
    other = cli.invoke(main, ["plan", "--runner", "smoke", "--group", "cpu:1", "--size", "64x64x9",
                              "--quantization", "fp8-mm"])  # fmt: skip
    assert other.exit_code == 2 and "setup of the ltx2 runners" in other.output, other.output


def test_ltx_worker_plan_says_which_host_memory_its_placement_was_chosen_for(monkeypatch):
    """A plan made on one machine for a card in another names the pinned host memory it placed the fleet with:
    this machine's unless `--host-gib` gives the target's. On an H100 the bf16 two-stage fleet needs its LoRA
    tiers in host memory (tests/test_placement.py), so with none it gets the all-GPU plan, refused, and says why."""
    from worker.cli import main

    for name in ("LTX_RUNNER_SETUP", "LTX_DEVICE_MEMORY_GIB", "LTX_HOST_MEMORY_GIB", "LTX_PLACEMENT"):
        monkeypatch.delenv(name, raising=False)
    cli = CliRunner()
    args = ["plan", "--runner", "ltx2-two-stage", "--group", "0", "--size", "768x512x121", "--gpu", "h100-80gb"]
    roomy = cli.invoke(main, [*args, "--host-gib", "100"])
    assert roomy.exit_code == 0 and "lora_backup host" in roomy.output, roomy.output
    assert "chosen for 100.0 GiB of pinned host memory" in roomy.output
    none = cli.invoke(main, [*args, "--host-gib", "0", "--json"])
    data = json.loads(none.output)
    assert none.exit_code == 1 and not data["fits"] and data["placement_note"].startswith("no placement fits with 0.0")
    table = cli.invoke(main, ["plan", "--runner", "ltx2-two-stage", "--gpus", "1", "--host-gib", "100"])
    assert "placements for 100.0 GiB of pinned host memory" in table.output.splitlines()[0], table.output
    assert cli.invoke(main, [*args, "--host-gib", "-1"]).exit_code == 2
