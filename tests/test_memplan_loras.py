"""The memory plan counts what the LoRA tracker holds (issues 30 and 31): its clean copy of every LoRA-able
weight (~1/W per rank), its staging bucket, the setup's LoRA factors and the largest request LoRAs the
worker admits, for every runner that sets one up, and the figures are the tracker's own allocations.

Why a separate file: tests/test_memplan.py pins the calibration; these pin the LoRA arithmetic, against a real
tracker on the tiny model (CPU) and against the full config's shapes on the meta device.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner

from ltx_mgpu.parallel.lora.lora_tracker import LoraSpec, LoraWeightTracker, assign_owners, lora_units, tracked_tensors
from ltx_mgpu.spec import memory_loras, memory_plan
from ltx_mgpu.spec.memory_plan import GIB, FleetMemory, lora_figures, lora_parts, plan

H200_GIB = 139.5  # what one H200 offers a rank (tests/test_memplan.py)
WORKER_DEFAULTS = (4, 4 << 30, 256)  # worker settings lora_max_per_request, lora_max_file_bytes, lora_max_rank


def _distilled(world: int = 1, loras: tuple[int, int, int] | None = WORKER_DEFAULTS, **kw: object) -> FleetMemory:
    fleet = FleetMemory("distilled", world, capacity_gib=H200_GIB, lora_tracker=loras is not None,
                        request_loras=1 if loras else 0, **kw)  # type: ignore[arg-type]  # fmt: skip
    return fleet if loras is None else memory_plan.with_lora_limits(fleet, *loras)


def _tiny_model() -> torch.nn.Module:
    from ltx_core.model.transformer.model_configurator import LTXModelConfigurator

    from ltx_mgpu.runners.ltx2.tiny import tiny_ltx2_config

    model = LTXModelConfigurator.from_config(tiny_ltx2_config()).to_empty(device="cpu").to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _write_lora(path, model: torch.nn.Module, rank: int) -> str:
    """A float32 LoRA of `rank` on every LoRA-able weight: the most factor bytes a LoRA of that rank can be."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(1)
    out = {}
    for name, (rows, cols, _) in lora_units(model).items():
        prefix = "diffusion_model." + name[: -len(".weight")]
        out[f"{prefix}.lora_A.weight"] = torch.randn(rank, cols, generator=gen) * 0.1
        out[f"{prefix}.lora_B.weight"] = torch.randn(rows, rank, generator=gen) * 0.01
    save_file(out, str(path))
    return str(path)


def test_request_loras_on_one_gpu_refuse_what_the_fleet_admits_without_them():
    """ltx2-distilled on one H200: without request LoRAs 1536x1024x121 takes the fast plan; with the worker's
    default limits (4 LoRAs of up to 4 GiB) the clean copy (35.1 GiB) and the factors (16 GiB) push it to the
    chunked decode; with 8 per request (the settings' maximum) it no longer fits and is refused."""
    bare = plan(_distilled(loras=None), 1536, 1024, 121)
    assert bare.fits and not bare.decode_chunked and "lora_backup" not in bare.resident_gib[0]
    default = plan(_distilled(), 1536, 1024, 121)
    parts = default.resident_gib[0]
    assert parts["lora_backup"] == pytest.approx(memory_plan.LTX2_19B.lora_weights_gib, abs=1e-3)
    assert parts["lora_job_factors"] == pytest.approx(16.0)
    assert default.fits and default.decode_chunked
    eight = plan(_distilled(loras=(8, 4 << 30, 256)), 1536, 1024, 121)
    assert not eight.fits and "1536x1024x121 needs" in (eight.refusal() or "")
    # a file limit below what the rank allows binds first; a small rank below the file limit binds instead
    ranked = lora_parts(_distilled(loras=(1, 4 << 30, 32)), memory_plan.LTX2_19B)
    assert ranked["lora_job_factors"] == pytest.approx(32 * memory_plan.LTX2_19B.lora_width_sum * 4 / GIB)


def test_two_ranks_hold_half_the_clean_copy_but_a_request_lora_may_land_on_one():
    one, two = lora_parts(_distilled(1), memory_plan.LTX2_19B), lora_parts(_distilled(2), memory_plan.LTX2_19B)
    p = memory_plan.LTX2_19B
    assert one["lora_backup"] == pytest.approx(p.lora_weights_gib)
    assert two["lora_backup"] == pytest.approx(p.lora_weights_gib / 2 + p.lora_unit_gib)
    assert two["lora_staging"] == memory_loras.LORA_STAGING_GIB and "lora_staging" not in one
    assert two["lora_job_factors"] == one["lora_job_factors"]  # bounded per LoRA, not per rank
    eight = _distilled(2, loras=(8, 4 << 30, 256))
    assert plan(eight, 1536, 1024, 121).fits  # what one GPU refuses, two take
    # two-stage: the distilled LoRA's factors follow their weights' owners
    two_stage = lora_parts(FleetMemory("two-stage", 2), p)
    assert two_stage["lora_factors"] == pytest.approx(p.lora_factors_gib * two["lora_backup"] / p.lora_weights_gib)
    assert lora_parts(FleetMemory("two-stage", 1), p)["lora_factors"] == pytest.approx(p.lora_factors_gib)


def test_fp8_keeps_an_e4m3_clean_copy():
    fp8 = lora_parts(_distilled(1, fp8_transformer=True), memory_plan.LTX2_19B)
    assert fp8["lora_backup"] == pytest.approx(memory_plan.LTX2_19B.lora_weights_fp8_gib)


def test_the_profiles_figures_are_the_configs_shapes():
    """The 19B and tiny constants are `lora_figures` of the synthetic configs' transformers (built on meta, in
    float32 there: counted at the bfloat16 width the runners load), plain and converted to fp8-mm."""
    from ltx_mgpu.fp8.recipe import convert_linears
    from ltx_mgpu.runners.ltx2.synthetic.plan import transformer_meta
    from ltx_mgpu.runners.ltx2.synthetic.profiles import profile

    for name, prof in (("tiny", memory_plan.TINY), ("full", memory_plan.LTX2_19B)):
        meta = transformer_meta(profile(name))
        plain = lora_figures(lora_units(meta, float_bytes=2).values())
        fp8 = lora_figures(lora_units(convert_linears(copy.deepcopy(meta)), float_bytes=2).values())
        assert prof.lora_weights_gib == pytest.approx(plain["weights_gib"], rel=1e-4), name
        assert prof.lora_unit_gib == pytest.approx(plain["unit_gib"], rel=1e-3), name
        assert prof.lora_width_sum == plain["width_sum"], name
        assert prof.lora_weights_fp8_gib == pytest.approx(fp8["weights_gib"], rel=1e-4), name


@pytest.mark.parametrize("fp8", [False, True])
def test_the_plan_equals_what_a_tracker_holds_on_the_tiny_model(tmp_path, fp8):
    """A tracker attached to the tiny transformer (bf16, or fp8-mm's e4m3 + scales), then fused with a float32
    rank-8 LoRA on every weight: its clean copy and kept factors are, to the byte, what the plan predicts
    from the model's shapes; on two ranks the owner balance stays within the plan's share."""
    from ltx_core.loader import LTXV_LORA_COMFY_RENAMING_MAP

    from ltx_mgpu.fp8.recipe import convert_linears

    model = _tiny_model()
    if fp8:
        model = convert_linears(model, quantize=True)
    rank = 8
    path = _write_lora(tmp_path / "user.safetensors", model, rank)
    figures = lora_figures(lora_units(model).values())
    weights = "lora_weights_fp8_gib" if fp8 else "lora_weights_gib"
    prof = replace(memory_plan.TINY, **{weights: figures["weights_gib"]}, lora_unit_gib=figures["unit_gib"],
                   lora_width_sum=figures["width_sum"])  # fmt: skip
    fleet = _distilled(1, loras=(1, 1 << 30, rank), profile="tiny", fp8_transformer=fp8)
    predicted = {k: round(v * GIB) for k, v in lora_parts(fleet, prof).items()}

    tracker = LoraWeightTracker()
    tracker.attach(model)
    assert tracker.held_bytes() == {"backup": predicted["lora_backup"], "factors": 0, "staging": 0}
    tracker.apply([LoraSpec(path, 1.0, LTXV_LORA_COMFY_RENAMING_MAP)])
    assert tracker.held_bytes()["factors"] == predicted["lora_job_factors"]
    if not fp8:
        assert prof.lora_weights_gib == pytest.approx(memory_plan.TINY.lora_weights_gib, rel=1e-4)

    sizes = {k: t.numel() * t.element_size() for k, t in tracked_tensors(model).items()}
    owners = assign_owners(sizes, 2)
    loads = [sum(b for k, b in sizes.items() if owners[k] == r) for r in range(2)]
    share = lora_parts(replace(fleet, world_size=2), prof)["lora_backup"] * GIB
    assert max(loads) <= share + 1 and share - max(loads) <= figures["unit_gib"] * GIB + 1


def test_the_runners_and_the_worker_describe_their_loras(monkeypatch):
    from ltx_contract.limits import RunnerLimits
    from ltx_mgpu.runners.ltx2.distilled import Ltx2DistilledRunner
    from ltx_mgpu.runners.ltx2.two_stage import Ltx2TwoStageRunner
    from worker.cli import main

    assert not Ltx2DistilledRunner.memory_fleet(1).has_tracker
    request = Ltx2DistilledRunner.memory_fleet(1, request_loras=True)
    assert request.has_tracker and request.request_loras == memory_plan.DEFAULT_REQUEST_LORAS
    assert Ltx2DistilledRunner.memory_fleet(1, loras=[("/nowhere.safetensors", 1.0)]).has_tracker
    assert Ltx2TwoStageRunner.memory_fleet(1).has_tracker
    limits = RunnerLimits.of("ltx2-distilled", Ltx2DistilledRunner, {"request_loras": True}, world_size=1,
                             capacity_gib=H200_GIB, lora_limits=(8, 4 << 30, 256))  # fmt: skip
    assert limits.memory is not None and limits.memory.request_loras == 8
    assert RunnerLimits.from_json(json.loads(json.dumps(limits.to_json()))) == limits
    monkeypatch.setenv("LTX_RUNNER_SETUP", json.dumps({"request_loras": True}))
    monkeypatch.setenv("LTX_LORA_MAX_PER_REQUEST", "8")
    monkeypatch.delenv("LTX_DEVICE_MEMORY_GIB", raising=False)
    args = ["plan", "--runner", "ltx2-distilled", "--group", "0", "--size", "1536x1024x121", "--free-gib", "139.5"]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 1, out.output  # 8 LoRAs of 4 GiB: refused on one GPU
    for text in ("lora_backup", "35.14", "lora_job_factors", "32.00", "fits: NO"):
        assert text in out.output, out.output


def test_a_past_jobs_factors_are_freed_before_the_next_jobs_are_read(tmp_path):
    """The plan counts one job's request LoRAs: the runner's swap (`keep_factors`) frees the previous job's
    kept factors before it reads the next job's, so the two are never held at once."""
    from ltx_core.loader import LTXV_LORA_COMFY_RENAMING_MAP as ops

    model = _tiny_model()
    first = LoraSpec(_write_lora(tmp_path / "a.safetensors", model, 8), 1.0, ops)
    second = LoraSpec(_write_lora(tmp_path / "b.safetensors", model, 4), 1.0, ops)
    tracker = LoraWeightTracker()
    tracker.attach(model)
    tracker.apply([first], keep_factors=())
    one_job = tracker.held_bytes()["factors"]
    seen = []
    fuse = tracker._fuse
    tracker._fuse = lambda *a: (seen.append(tracker.held_bytes()["factors"]), fuse(*a))[1]  # type: ignore[method-assign]
    tracker.apply([second], keep_factors=())
    assert seen == [0] and 0 < tracker.held_bytes()["factors"] == one_job // 2  # rank 4 after rank 8
