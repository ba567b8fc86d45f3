"""One set of request rules (`ltx_mgpu.spec.request_rules`) for the schema, the memory plan, `ltx-worker plan`, the
runners and the producer.

Before: `ltx-worker plan` said "fits" for 3840x2176x121 (which the schema refused) and for 1000x500x10 (which
the runners refuse), and suggested sizes the schema refused; `--dry-run` passed a negative prompt to the
distilled runner, which then failed the job as `runner_error`; the plan ignored `frame_rate` (the audio);
a fixed `sp_max_tokens` of 32,768 refused distilled 1536x1024x241, which the plan's memory admits.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rq import Queue
from rq.worker import Worker

from ltx_contract.keys import worker_health_key
from ltx_contract.limits import RuleViolation, RunnerLimits
from ltx_contract.schema import RenderRequest
from ltx_mgpu.runners.ltx2 import spec
from ltx_mgpu.spec import memory_plan
from ltx_mgpu.spec.memory_plan import FleetMemory, plan
from ltx_mgpu.spec.request_rules import GENERIC, MAX_DURATION_S, PRESETS, RequestRuleError, RequestRules, ltx2_rules
from producer.exit_codes import ExitCode
from tests.support.cli import run

ROOT = Path(__file__).resolve().parents[1]
H200_GIB = 139.5


def _passes_everything(kind: str, size: tuple[int, int, int], rate: float = 24.0) -> None:
    """The size passes the request schema and the runner's rules (what the runner checks on every rank)."""
    w, h, f = size
    RenderRequest(prompt="x", width=w, height=h, num_frames=f, frame_rate=rate)
    ltx2_rules(kind).check(width=w, height=h, num_frames=f, frame_rate=rate)


# ==== plan vs schema vs runner: one rule set =============================================================


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["distilled", "two-stage"]), world=st.sampled_from([1, 2, 4, 8]),
       capacity=st.sampled_from([None, 80.0, H200_GIB]), w=st.integers(1, 140), h=st.integers(1, 140),
       f=st.integers(1, 600))  # fmt: skip
def test_whatever_the_plan_calls_fitting_passes_the_schema_and_the_runner(kind, world, capacity, w, h, f):
    fleet = FleetMemory(kind, world, passes=2 if kind == "two-stage" else 1, capacity_gib=capacity)
    size = (w * 32, h * 32, f)
    p = plan(fleet, *size)
    if p.fits:
        _passes_everything(kind, size)
    else:
        assert p.refusal()
    for suggestion in memory_plan.largest(fleet, *size).values():
        if suggestion is not None:
            found = memory_plan.parse_size(suggestion)
            _passes_everything(kind, found)
            assert plan(fleet, *found).fits, suggestion


def test_the_sizes_of_the_issue_are_refused_or_admitted_alike_everywhere():
    fleet = FleetMemory("two-stage", 1, passes=2, capacity_gib=H200_GIB)
    odd = plan(fleet, 1000, 500, 10)  # "fits" before: the runners need multiples of 64 and 8k+1 frames
    assert not odd.fits and "multiples of 64" in (odd.refusal() or "")
    with pytest.raises(RequestRuleError, match="multiples of 64") as refused:
        ltx2_rules("two-stage").check(width=1000, height=500, num_frames=9)
    assert refused.value.field == "size"
    for preset in PRESETS:  # the schema takes every preset now (4K was refused), and so do both runners
        _passes_everything("distilled", memory_plan.parse_size(preset))
    with pytest.raises(ValueError, match="pixels a frame"):
        RenderRequest(prompt="x", width=3840, height=3840, num_frames=9)  # past the largest frame (4K)
    assert GENERIC.size_problem(96, 96, 9) is None and ltx2_rules("distilled").size_problem(96, 96, 9)


def test_the_rules_travel_as_json_and_junk_is_ignored():
    rules = spec.request_rules("two-stage", {"max_steps": 30})
    assert rules.steps_range == (2, 30)
    assert RequestRules.from_json(json.loads(json.dumps(rules.to_json()))) == rules
    for junk in (None, "x", {}, {"runner": "r", "spatial_multiple": 48}, {"runner": "r", "refused_fields": ["seed"]},
                 {"runner": "r", "steps_range": [1]}, {"runner": "r", "max_duration_s": -1}):  # fmt: skip
        assert RequestRules.from_json(junk) is None


def test_the_runner_classes_answer_with_the_torch_free_description():
    """The worker asks the class; `ltx-worker plan` reads `spec` without torch: the same answers."""
    from ltx_mgpu.runners.ltx2.runners import Ltx2DistilledRunner, Ltx2TwoStageRunner

    for cls, kind in ((Ltx2DistilledRunner, "distilled"), (Ltx2TwoStageRunner, "two-stage")):
        for name, value in spec.SETUP_DEFAULTS.items():
            assert cls.setup_default(name, {}) == value, name
        setup = {"max_steps": 12, "sp_max_tokens": 4096, "stage1_guidance": {"video": {"stg_scale": 0}}}
        assert cls.request_rules(**setup) == spec.request_rules(kind, setup)
        assert cls.memory_fleet(2, **setup) == spec.memory_fleet(kind, 2, setup)
        built = RunnerLimits.of(kind, cls, setup, world_size=2, capacity_gib=80.0)
        assert built.rules == spec.request_rules(kind, setup) and built.memory is not None
    from ltx_mgpu.runners.ltx2 import two_stage

    assert two_stage.VIDEO_GUIDANCE.cfg_scale == 3.0 and spec.passes("two-stage", {}) == 4


def test_a_rule_refused_on_a_rank_is_a_refused_request_not_a_runner_error():
    """docs/worker.md: a rejected kwarg is `invalid_request`. The rank reports the rule's refusal as
    `RequestRefused` (field kept), and the controller's error says so when every rank refused."""
    import pickle

    from ltx_mgpu.control.errors import RequestRefused, RunnerError, SymmetricRunnerError
    from ltx_mgpu.control.rank_faults import job_error

    try:
        ltx2_rules("distilled").check(negative_prompt="blurry")
    except RequestRuleError as exc:
        err = job_error(exc, 0, 1)
    assert isinstance(err, RequestRefused) and err.field == "negative_prompt" and "no negative prompt" in err.message
    again = pickle.loads(pickle.dumps(err))  # (the rank -> controller pipe)
    assert isinstance(again, RequestRefused) and again.field == "negative_prompt"
    assert SymmetricRunnerError([err, again]).request_refused is err
    assert SymmetricRunnerError([err, RunnerError("over the budget")]).request_refused is None
    assert not isinstance(job_error(ValueError("other"), 0, 1), RequestRefused)


# ==== the producer checks what the worker publishes (real Redis) ==========================================


def _publish(redis_client, env: dict[str, str], limits: RunnerLimits) -> Worker:
    queue = Queue(env["LTX_QUEUES"], connection=redis_client)
    worker = Worker([queue], connection=redis_client, name=f"w-{env['LTX_QUEUES']}")
    worker.register_birth()
    health = {"worker": worker.name, "runner": limits.runner, "limits": limits.to_json()}
    redis_client.set(worker_health_key(worker.name), json.dumps(health), ex=60)
    return worker


@pytest.mark.parametrize(("fields", "says"), [
    ({"negative_prompt": "blurry"}, "runner 'ltx2-distilled' uses no negative prompt"),
    ({"width": 128, "height": 96, "num_frames": 9}, "multiples of 64 from 64 to 3840 (runner 'ltx2-distilled'), "
                                                    "got 128x96"),
    ({"width": 64, "height": 64, "num_frames": 257, "frame_rate": 1.0}, "257 frames at 1 fps = 257.0 s"),
    ({"steps": 4}, "has a fixed schedule"),
    ({"width": 3840, "height": 2176, "num_frames": 481}, "largest that fits: "),
])  # fmt: skip
def test_dry_run_and_submit_refuse_what_the_runner_would_in_one_line(tmp_path, env, redis_client, fields, says):
    setup: dict = {}
    limits = RunnerLimits("ltx2-distilled", spec.request_limits("distilled", setup),
                          replace_capacity(spec.memory_fleet("distilled", 1, setup), 80.0),
                          spec.request_rules("distilled", setup))  # fmt: skip
    worker = _publish(redis_client, env, limits)
    try:
        good = tmp_path / "good.json"
        good.write_text(json.dumps({"prompt": "a fox", "width": 768, "height": 512, "num_frames": 121}))
        code, out, err = run(["submit", "--dry-run", str(good)], env)
        assert code == 0 and out.strip().endswith(": ok") and "not checked" not in err, (out, err)
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"prompt": "a fox", **fields}))
        for args in (["submit", "--dry-run", str(bad)], ["submit", str(bad)]):
            code, out, err = run(args, env)
            assert code == ExitCode.USAGE and out == "" and says in err, (out, err)
            assert err.count("\n") == 1 and "Traceback" not in err, err
        assert Queue(env["LTX_QUEUES"], connection=redis_client).count == 0
    finally:
        worker.register_death()


def replace_capacity(fleet: FleetMemory, capacity: float) -> FleetMemory:
    return FleetMemory(**{**fleet.to_json(), "capacity_gib": capacity})


def test_published_rules_read_back_equal_and_refuse_alike():
    limits = RunnerLimits("ltx2-distilled", {}, None, ltx2_rules("distilled"))
    back = RunnerLimits.from_json(json.loads(json.dumps(limits.to_json())))
    assert back == limits
    (bad,) = back.violations(RenderRequest(prompt="x", negative_prompt="n"))
    assert isinstance(bad, RuleViolation) and bad.field == "negative_prompt"
    older = {"runner": "x", "ranges": {}}  # a worker from before the rules: nothing more is checked
    assert RunnerLimits.from_json(older).rules is None


# ==== audio: frame_rate sets the clip's duration ===========================================================


def test_the_audio_is_in_the_plan_and_in_the_limits():
    """On the CPU stack, 64x64x257 at 1 fps held 4.86 GB of rank memory against 0.77 GB at 25 fps."""
    fleet = FleetMemory("distilled", 1)
    slow, fast = plan(fleet, 64, 64, 257, frame_rate=1.0), plan(fleet, 64, 64, 257, frame_rate=25.0)
    prof = memory_plan.LTX2_19B
    audio_decode = prof.audio_decode_bytes_per_s * (257 / 1.0 - 257 / 25.0) / memory_plan.GIB
    assert slow.stages[-1].allocated_gib - fast.stages[-1].allocated_gib == pytest.approx(audio_decode, abs=0.02)
    assert slow.peak.reserved_gib > fast.peak.reserved_gib + 3.0  # (16 MiB a second of clip, 247 s more)
    stage2 = {s.stage: s for s in slow.stages}["stage2"].allocated_gib - {s.stage: s for s in fast.stages}[
        "stage2"].allocated_gib  # fmt: skip
    assert stage2 == pytest.approx(prof.audio_token_bytes * (6425 - 257) / memory_plan.GIB, abs=0.02)
    # and the duration rule refuses it outright, at the edge and on the rank
    problems = dict(ltx2_rules("distilled").problems({"width": 64, "height": 64, "num_frames": 257, "frame_rate": 1}))
    assert f"over the {MAX_DURATION_S:g} s" in problems["frame_rate"]
    assert not ltx2_rules("distilled").problems({"width": 64, "height": 64, "num_frames": 257, "frame_rate": 25})


# ==== the SP budget from the plan ===========================================================================


def test_the_default_sp_budget_admits_every_size_the_rules_accept():
    """37.4: `sp_max_tokens=32768` refused distilled 1536x1024x241 (47,616 stage-2 tokens)."""
    for kind, passes in (("distilled", 1), ("two-stage", 4)):
        for world in (1, 2, 4, 8):
            fleet = FleetMemory(kind, world, passes=passes)
            budget = memory_plan.sp_tokens(fleet)
            assert budget == memory_plan.needed_tokens(fleet, 3840, 2176, 481)
            for preset in (*PRESETS, "2176x3840x481"):
                assert plan(fleet, *memory_plan.parse_size(preset)).token_problem is None, (kind, world, preset)
            parts = plan(fleet, 768, 512, 121).resident_gib[0]
            if world == 1:
                assert "sp_buffers" not in parts  # one rank exchanges nothing
            else:  # a rank's share of the budget, counted in the plan
                share = math.ceil(budget / world) * memory_plan.LTX2_19B.sp_buffer_bytes / memory_plan.GIB
                assert parts["sp_buffers"] == pytest.approx(share, abs=1e-3)
    assert memory_plan.sp_tokens(FleetMemory("distilled", 1)) == 120 * 68 * 61  # 4K x 481 frames at stage 2
    assert memory_plan.sp_tokens(FleetMemory("distilled", 1, sp_max_tokens=4096)) == 4096  # a setting wins
    assert plan(FleetMemory("distilled", 1, sp_max_tokens=32768), 1536, 1024, 241).token_problem


# ==== ltx-worker plan: presets on 1/2/4/8 GPUs, arithmetic only ==========================================


def _plan_cli(*args: str) -> subprocess.CompletedProcess:
    probe = ("import sys\nfrom worker.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
             "    code = e.code\nsys.stdout.flush()\n"
             "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code)")  # fmt: skip
    environ = {k: v for k, v in os.environ.items() if not k.startswith("LTX_")}
    return subprocess.run([sys.executable, "-c", probe, "plan", *args], capture_output=True, text=True,
                          env={**environ, "PYTHONPATH": str(ROOT)}, timeout=120, check=False)  # fmt: skip


def test_ltx_worker_plan_tables_the_presets_without_importing_torch():
    t0 = time.process_time()
    out = _plan_cli("--runner", "ltx2-distilled")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "NO-TORCH 0", out.stdout  # arithmetic: torch was a 6-14 s import
    assert "predicted, not measured" in lines[0]
    for preset in PRESETS:
        rows = [line for line in lines if line.startswith(preset)]
        assert [int(r.split()[1]) for r in rows] == [1, 2, 4, 8], rows
    rows = [json.loads(line) for line in _plan_cli("--runner", "ltx2-two-stage", "--json", "--free-gib", "80",
                                                    "--size", "3840x2176x481").stdout.splitlines()[:-1]]  # fmt: skip
    assert [r["gpus"] for r in rows] == [1, 2, 4, 8]
    for row in rows:
        for suggestion in (row["largest"] or {}).values() if not row["fits"] else ():
            if suggestion:
                _passes_everything("two-stage", memory_plan.parse_size(suggestion))
    odd = _plan_cli("--runner", "ltx2-two-stage", "--group", "0", "--size", "1000x500x10")
    assert (
        odd.stdout.splitlines()[-1] == "NO-TORCH 1"
        and "fits: NO: width and height must be multiples of 64" in odd.stdout
    )
    assert time.process_time() - t0 < 1.0  # (this process only waits)


def test_plan_checks_every_rule_the_dry_run_checks_and_says_what_it_could_not():
    """`ltx-worker plan` and `producer submit --dry-run` are one rule set (duration and frame rate included); the
    plan names the card in every line, refuses a rule-breaking size without a peak, exits 1 when no asked size fits
    anywhere, and says it could not check the memory of a GPU group whose card it does not know."""
    from click.testing import CliRunner

    from worker.cli import main

    cli = CliRunner()
    base = ["plan", "--runner", "ltx2-distilled"]
    env = {"LTX_DEVICE_MEMORY_GIB": None, "LTX_RUNNER_SETUP": None, "LTX_PLACEMENT": None}  # (unset)
    # 481 frames at 1 fps is an 8-minute clip: the schema's duration rule refuses it, and so does the plan now
    long = cli.invoke(
        main, [*base, "--group", "0", "--size", "64x64x481", "--frame-rate", "1", "--gpu", "h100-80gb"], env=env
    )
    assert long.exit_code == 1 and "fits: NO" in long.output and "481 frames at 1 fps" in long.output, long.output
    assert "worst rank" not in long.output  # (no peak for a size the rules refuse)
    for rate in ("0.5", "200"):  # the schema's frame rates are 1-120
        bad = cli.invoke(main, [*base, "--group", "0", "--size", "768x512x121", "--frame-rate", rate], env=env)
        assert bad.exit_code == 2 and "--frame-rate must be in [1, 120]" in bad.output, bad.output
    # every line of the plan names its card
    named = cli.invoke(main, [*base, "--group", "0", "--size", "768x512x121", "--gpu", "h100-80gb"], env=env)
    assert named.exit_code == 0, named.output
    assert all("h100-80gb" in line for line in named.output.strip().splitlines()), named.output
    # a GPU group on a machine with no GPU and no card named: the memory is not checked, and it says so (exit 2)
    unknown = cli.invoke(main, [*base, "--group", "0", "--size", "768x512x121"], env=env)
    if "no card" in unknown.output:  # (a machine with a GPU plans for its own card instead)
        assert unknown.exit_code == 2 and "fits: UNKNOWN" in unknown.output and "fits: yes" not in unknown.output
    # a table in which no asked size fits anywhere exits 1; sizes the rules refuse print no peak
    table = cli.invoke(main, [*base, "--size", "100x100x10", "--gpus", "1,2", "--gpu", "h100-80gb"], env=env)
    assert table.exit_code == 1, table.output
    rows = [line for line in table.output.splitlines() if line.startswith("100x100x10")]
    assert len(rows) == 2 and all(" - " in row and "NO" in row for row in rows), rows
    # suggestions never repeat one size ("2880x2880x121 or 2880x2880x121")
    big = cli.invoke(main, [*base, "--size", "3840x2176x121", "--gpus", "1", "--gpu", "h100-80gb", "--json"], env=env)
    for line in big.output.strip().splitlines():
        largest = json.loads(line)["largest"] or {}
        found = [v for v in largest.values() if v]
        assert len(found) == len(set(found)), line


def test_dry_run_names_every_rule_a_request_breaks(tmp_path, env, redis_client):
    """ "got 128x96 (and 2 more)" named one problem of three: the refusal lists them all, in one line."""
    setup: dict = {}
    limits = RunnerLimits("ltx2-distilled", spec.request_limits("distilled", setup),
                          replace_capacity(spec.memory_fleet("distilled", 1, setup), 80.0),
                          spec.request_rules("distilled", setup))  # fmt: skip
    worker = _publish(redis_client, env, limits)
    try:
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"prompt": "a fox", "width": 128, "height": 96, "num_frames": 9,
                                   "negative_prompt": "blurry", "steps": 4}))  # fmt: skip
        code, _, err = run(["submit", "--dry-run", str(bad)], env)
        assert code == ExitCode.USAGE and err.count("\n") == 1, err
        for says in ("got 128x96", "uses no negative prompt", "has a fixed schedule"):
            assert says in err, err
        assert "more)" not in err
    finally:
        worker.register_death()
