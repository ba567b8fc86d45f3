"""The placement a fleet gets before it loads (`ltx_mgpu.spec.placement`, `worker.render.fleet_plan`; docs/memory.md,
"Placement"): what each card chooses for each runner, the per-job parking of the text encoder, host memory as a
limit, and the refusal of a fleet that fits in no placement before anything loads (one line, exit 2, no restart).

The figures are the plan's (`ltx_mgpu.spec.memory_profile`), so these tests hold the decisions, not the GPU: each
expectation is derived from the resident sets in docs/memory.md (e.g. the 19B two-stage fleet in bf16 needs 35.5
transformer + 35.1 clean copy + 22.7 Gemma + 6.9 LoRA factors = 100+ GiB, more than an 80 GB card offers).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ltx_mgpu.runners.ltx2 import spec
from ltx_mgpu.spec import memory_plan as mp
from ltx_mgpu.spec import placement as pl

CFG = {m: {"stg_scale": 0, "modality_scale": 1, "rescale_scale": 0} for m in ("video", "audio")}
H100, H200 = pl.CARDS["h100-80gb"], pl.CARDS["h200"]


def fleet(kind: str, world: int = 1, **setup) -> mp.FleetMemory:
    return spec.memory_fleet(kind, world, setup)


def test_two_stage_bf16_on_one_h100_moves_every_movable_part_to_the_host():
    best, judged = pl.choose(fleet("two-stage", stage1_guidance=CFG), H100, host_gib=100)
    assert best is not None
    assert best.placement == {"text_encoder": "park", "lora_backup": "host", "lora_factors": "host"}
    # the all-GPU placement is judged and refused with the plan's own words
    all_gpu = next(c for c in judged if set(c.placement.values()) == {"gpu"})
    assert all_gpu.problem and "over this fleet's limit" in all_gpu.problem
    # per job it pays the clean copy's and the factors' trips over the link (35.1 + 6.9 GiB at the card's rate)
    assert best.seconds == pytest.approx((35.142 + 6.9) * 2**30 / (H100.h2d_gbps * 1e9), rel=0.01)
    assert sum(pl.host_parts(best.fleet).values()) == pytest.approx(22.7 + 35.14 + 6.9, abs=0.05)


def test_an_h200_keeps_the_lora_parts_on_the_gpu_and_the_text_encoder_parkable():
    best, _ = pl.choose(fleet("two-stage", stage1_guidance=CFG), H200, host_gib=100)
    assert best.placement == {"text_encoder": "park", "lora_backup": "gpu", "lora_factors": "gpu"}
    assert best.seconds == 0.0


def test_a_parkable_text_encoder_is_parked_only_by_jobs_that_need_its_room():
    placed = pl.choose(fleet("distilled"), H100, host_gib=100)[0].fleet
    small = mp.plan(placed, 768, 512, 121)
    large = mp.plan(placed, 1536, 1024, 241)
    assert not small.park_text_encoder and small.fits
    assert large.park_text_encoder and large.fits and "park_text_encoder" in large.job_kwargs()
    # parked: every stage after the encode holds the resident set less Gemma; the encode holds it all
    encode, stage1 = (next(s for s in large.stages if s.stage == n) for n in ("encode", "stage1"))
    assert encode.allocated_gib - stage1.allocated_gib > 22.7 - 1.5  # less its activations
    assert [s.stage for s in large.stages][-1] == "unpark"
    # an out-of-memory retry takes the lowest plan: chunked and parked, and nothing is below it
    low = mp.plan(placed, 1536, 1024, 241, low_memory=True)
    assert low.is_lowest and low.decode_chunked and low.park_text_encoder


def test_host_memory_limits_the_placement():
    tight, judged = pl.choose(fleet("two-stage", stage1_guidance=CFG), H100, host_gib=30)
    assert tight is None  # without the 35 GiB clean copy in host memory the fleet cannot hold its resident set
    assert all(c.problem for c in judged)
    assert any("pinned host memory" in c.problem for c in judged)


def test_a_fleet_that_fits_no_placement_is_refused_in_one_line_that_says_what_would_fit():
    small_card = pl.Card("a-48gb-card", 48.0, 25.0, "test")  # (60 GiB now fits: the text encoder streamed)
    two_stage = fleet("two-stage", stage1_guidance=CFG)
    best, judged = pl.choose(two_stage, small_card, host_gib=200)
    assert best is None
    alternatives = {
        "quantization 'fp8-mm'": pl.choose(replace(two_stage, fp8_transformer=True), small_card, host_gib=200)[0],
        "2 GPUs per group": pl.choose(replace(two_stage, world_size=2), small_card, host_gib=200)[0],
    }
    line = pl.refusal(two_stage, small_card, judged, alternatives)
    assert "\n" not in line and "cannot hold its resident set" in line and "a-48gb-card" in line
    assert "would fit:" in line


def test_a_card_too_small_for_gemma_beside_the_transformer_streams_the_text_encoder():
    """A 40 GiB card (a 48 GB one's room, the issue's stretch) cannot hold the fp8 distilled fleet with Gemma on
    the GPU even for the encode (20.4 + 22.7 + the rest): the plan streams Gemma's layers (1.3 GiB stays: the
    token table gathers on the host) and charges every job their copy; where Gemma fits resident or parked, as
    on an H100, streaming is never chosen (it costs every job, parking costs nothing until a job needs the
    room)."""
    small = pl.Card("a-40gib-card", 40.0, 25.0, "test")
    fp8 = fleet("distilled", quantization="fp8-mm+attn")
    best, judged = pl.choose(fp8, small, host_gib=100)
    assert best is not None and best.placement["text_encoder"] == "stream"
    profile = mp.PROFILES[fp8.profile]
    assert best.plan.resident_gib[0]["text_encoder"] == profile.text_encoder_streamed_gib
    assert best.seconds == pytest.approx(profile.text_encoder_layers_gib * 2**30 / (25.0 * 1e9), rel=1e-3)
    assert pl.host_parts(best.fleet)["text_encoder"] == profile.text_encoder_layers_gib
    assert not any(c.problem is None for c in judged if c.placement["text_encoder"] != "stream")
    assert best.plan.park_text_encoder is False and "unpark" not in [s.stage for s in best.plan.stages]
    for card in (H100, H200):
        chosen, _ = pl.choose(fp8, card, host_gib=100)
        assert chosen is not None and chosen.placement["text_encoder"] != "stream", card
    assert fleet("distilled", placement={"text_encoder": "stream"}).text_encoder_at == "stream"


def test_the_runner_setup_placement_reaches_the_plan_and_is_checked():
    placed = fleet("two-stage", placement={"text_encoder": "park", "lora_backup": "host"})
    assert placed.placement == {"text_encoder": "park", "lora_backup": "host", "lora_factors": "gpu"}
    assert "lora_backup" not in mp.plan(placed, 768, 512, 121).resident_gib[0]
    for bad in ({"text_encoder": "host"}, {"vae": "host"}):
        with pytest.raises(ValueError, match="placement"):
            fleet("two-stage", placement=bad)


def test_cards_are_known_by_their_device_names():
    assert pl.card_for("NVIDIA H100 80GB HBM3", int(79.2 * 2**30)).name == "h100-80gb"
    assert pl.card_for("NVIDIA H200", int(139.8 * 2**30)).name == "h200"
    other = pl.card_for("NVIDIA L40S", 48 * 2**30)
    assert other.offered_gib == pytest.approx(48 - pl.CONTEXT_GIB, abs=0.1)


def _worker_settings(tmp_path, **env):
    from worker.settings import load_settings

    (tmp_path / "s.json").write_text(json.dumps(env))
    return load_settings(str(tmp_path / "s.json"))


def test_the_worker_refuses_before_loading_a_fleet_that_fits_no_placement(tmp_path):
    from ltx_mgpu.runners.ltx2.runners import Ltx2TwoStageRunner
    from worker.runtime.process import place_for
    from worker.settings import SettingsError

    settings = _worker_settings(
        tmp_path, runner="ltx2-two-stage", device_memory_gib=40.0, host_memory_gib=200.0, groups=["cpu:1"]
    )
    with pytest.raises(SettingsError) as caught:
        place_for(settings, Ltx2TwoStageRunner, ["cpu"])
    assert "cannot hold its resident set" in str(caught.value) and "\n" not in str(caught.value)
    fits = _worker_settings(
        tmp_path, runner="ltx2-two-stage", device_memory_gib=76.9, host_memory_gib=200.0, groups=["cpu:1"]
    )
    placed = place_for(fits, Ltx2TwoStageRunner, ["cpu"])
    assert placed.setup_kwargs["placement"]["lora_backup"] == "host" and placed.capacity_gib == 76.9


def test_ltx_worker_exits_2_at_once_without_starting_a_fleet(tmp_path, redis_server, s3_server):
    """The whole process: the supervisor's worker for a fleet that can never fit says why in one line and exits
    2 (a permanent code: the supervisor stops instead of restarting it), before any model could load."""
    from tests.support.workers import launch_worker

    tiny = __import__("ltx_mgpu.runners.ltx2.tiny", fromlist=["x"]).ensure_tiny_ltx2()
    setup = json.dumps({**tiny.setup_kwargs(), "prompt_tokens": 128})
    w = launch_worker(
        tmp_path,
        redis_server,
        s3_server,
        ["--group", "cpu:1"],
        runner="ltx2-two-stage",
        runner_setup=setup,
        device_memory_gib=0.05,
        host_memory_gib=200,
    )
    try:
        assert w.proc.wait(timeout=120) == 2, w.proc.log_tail()
    finally:
        w.proc.stop()
    log = w.proc.log_tail()
    refusals = [line for line in log.splitlines() if "cannot hold its resident set" in line]
    assert len(refusals) == 1, log
    assert "restarting cannot fix it: stopping" in log and "restarting in" not in log


@pytest.mark.parametrize(
    ("quantization", "capability", "refused"),
    [
        ("fp8-mm", (8, 0), True),  # A100: no FP8 tensor cores
        ("fp8-mm", (8, 9), False),  # L40S, RTX 4090
        ("fp8-mm+attn", (8, 9), True),  # cuDNN's FP8 attention wants Hopper
        ("fp8-mm+attn", (9, 0), False),
        ("fp8-cast", (7, 0), False),  # fp8 storage, bf16 compute: any GPU
        (None, (7, 0), False),
    ],
)
def test_each_quantization_states_the_gpu_it_needs_and_what_to_use_instead(quantization, capability, refused):
    from ltx_mgpu.spec.gpu_needs import capability_problem

    problem = capability_problem(quantization, capability, "NVIDIA X")
    assert (problem is not None) == refused
    if refused:
        assert f"is {capability[0]}.{capability[1]}" in problem and "NVIDIA X" in problem and "\n" not in problem
        assert ("'fp8-cast'" if quantization == "fp8-mm" else "'fp8-mm'") in problem


def test_the_worker_refuses_fp8_gemms_on_an_a100_before_loading(tmp_path, monkeypatch):
    """The group's compute capability, read without a CUDA context (NVML here, faked; nvidia-smi's `compute_cap`
    where NVML is missing, a GPU it reports without one unknown), refuses `fp8-mm` on an A100 in one line
    before any weight loads (exit 2, no rebuilds); an H100 takes it; where neither answers, the ranks' own
    check stands."""
    from ltx_mgpu.runners.ltx2.runners import Ltx2DistilledRunner
    from worker.render import fleet_plan, gpu_query
    from worker.runtime.process import place_for
    from worker.settings import SettingsError

    gpus = {"a100": ("NVIDIA A100-SXM4-80GB", (8, 0)), "h100": ("NVIDIA H100 80GB HBM3", (9, 0))}
    settings = _worker_settings(tmp_path, runner="ltx2-distilled", runner_setup={"quantization": "fp8-mm"},
                                device_memory_gib=76.9, host_memory_gib=200.0, groups=["cpu:1"])  # fmt: skip
    for card, refused in (("a100", True), ("h100", False)):
        monkeypatch.setattr(gpu_query, "nvml_rows", lambda idx, read, card=card: [gpus[card]] * len(idx))
        if refused:
            with pytest.raises(SettingsError) as caught:
                place_for(settings, Ltx2DistilledRunner, ["cuda:0"])
            line = str(caught.value)
            assert line.startswith("GPU group cuda:0: quantization 'fp8-mm' needs FP8 tensor cores") and "8.0" in line
        else:
            fleet_plan.check_quantization(settings, ["cuda:0"])
    monkeypatch.setattr(gpu_query, "nvml_rows", lambda idx, read: None)
    smi = "0, NVIDIA A100-SXM4-80GB, 8.0\n1, NVIDIA H100 80GB HBM3, 9.0\n2, Tesla K80, [N/A]\n"
    monkeypatch.setattr(gpu_query.subprocess, "run", lambda *a, **k: type("R", (), {"stdout": smi})())
    assert fleet_plan.group_capability(["cuda:1", "cuda:0"]) == ("NVIDIA A100-SXM4-80GB", (8, 0))
    assert fleet_plan.group_capability(["cuda:1"]) == ("NVIDIA H100 80GB HBM3", (9, 0))
    assert fleet_plan.group_capability(["cuda:2"]) is None and fleet_plan.group_capability(["cpu"]) is None
    assert fleet_plan.group_capability(["cuda:3"]) is None
    fleet_plan.check_quantization(settings, ["cuda:2"])  # (unknown: left to the ranks)


def test_ltx_worker_plan_on_the_local_gpus_refuses_what_the_worker_would_refuse(monkeypatch):
    """`ltx-worker plan` for the local GPUs (no `--gpu`, no `--free-gib`) says the worker's refusal of a
    quantization they cannot run, exit 2; for a named card it plans (the named cards are Hopper)."""
    from click.testing import CliRunner

    from worker.cli import main
    from worker.render import gpu_query

    for name in ("LTX_DEVICE_MEMORY_GIB", "LTX_HOST_MEMORY_GIB", "LTX_PLACEMENT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LTX_RUNNER_SETUP", json.dumps({"quantization": "fp8-mm"}))
    monkeypatch.setattr(gpu_query, "capabilities", lambda idx: [("NVIDIA A100-SXM4-80GB", (8, 0))] * len(idx))
    args = ["plan", "--runner", "ltx2-distilled", "--group", "0", "--size", "768x512x121"]
    local = CliRunner().invoke(main, args)
    assert local.exit_code == 2 and "needs FP8 tensor cores" in local.output, local.output
    named = CliRunner().invoke(main, [*args, "--gpu", "h100-80gb", "--host-gib", "100"])
    assert named.exit_code == 0 and "fits: yes" in named.output, named.output


def test_the_local_card_is_read_from_nvidia_smi_where_nvml_is_missing(monkeypatch):
    """`local_card` without NVML: nvidia-smi's name, total and free MiB per index; the group's smallest card and
    least free memory (less the CUDA context), an index it does not list: nothing known."""
    from worker.render import fleet_plan, gpu_query

    smi = "0, NVIDIA H100 80GB HBM3, 81559, 81000\n1, NVIDIA H100 80GB HBM3, 81559, 60000\n"
    monkeypatch.setattr(gpu_query, "nvml_rows", lambda idx, read: None)
    monkeypatch.setattr(gpu_query.subprocess, "run", lambda *a, **k: type("R", (), {"stdout": smi})())
    card, free = fleet_plan.local_card(["cuda:0", "cuda:1"])
    assert card.name == "h100-80gb" and free == pytest.approx(60000 / 1024 - pl.CONTEXT_GIB)
    assert fleet_plan.local_card(["cuda:2"]) is None
