"""The producer CLI without a worker: request files, admission, cancel of a waiting job, exit codes, the
import-lightness rule. A real Redis (devstack/dev_servers.py); queues nobody consumes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from ltx_contract.keys import RENDER_FUNC, events_key
from ltx_contract.states import JobState
from producer.cli import cli
from producer.client import content_job_id
from producer.exit_codes import ExitCode
from producer.json_pos import locate, position_at
from producer.request_file import load_requests
from tests.support.cli import run, write

ROOT = Path(__file__).resolve().parents[1]


# ==== validation: exit 2, one line, file position and field ============================================


def test_malformed_json_names_line_and_column(tmp_path: Path, env: dict[str, str]) -> None:
    path = write(tmp_path, "bad.json", '{\n  "prompt": "a cat",\n  "seed": ,\n}\n')
    code, out, err = run(["submit", path], env)
    assert code == ExitCode.USAGE
    assert out == ""
    assert err.count("\n") == 1, err
    assert f"{path}:3:11: invalid JSON: Expecting value" in err
    assert "Traceback" not in err


def test_unknown_field_is_named_with_its_position(tmp_path: Path, env: dict[str, str]) -> None:
    path = write(tmp_path, "typo.json", '{"prompt": "a cat",\n "widht": 256}\n')
    code, _out, err = run(["submit", path], env)
    assert code == ExitCode.USAGE
    assert err.strip() == f"producer: {path}:2:2: unknown field 'widht'; did you mean 'width'?"


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("width", 4096, "width: input should be less than or equal to 3840 (got 4096)"),
        ("width", 100, "width: must be a multiple of 32, got 100"),
        ("num_frames", 500, "num_frames: input should be less than or equal to 481 (got 500)"),
        ("num_frames", 10, "num_frames: must be 8k+1 (1, 9, 17, ..., 481), got 10"),
        ("steps", 0, "steps: input should be greater than or equal to 1 (got 0)"),
    ],
)
def test_out_of_range_values(tmp_path: Path, env: dict[str, str], field: str, value: int, expected: str) -> None:
    path = write(tmp_path, "r.json", json.dumps({"prompt": "x", field: value}, indent=2))
    code, _out, err = run(["submit", path], env)
    assert code == ExitCode.USAGE
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert re.fullmatch(rf"producer: {re.escape(path)}:\d+:\d+: {re.escape(expected)}", lines[0]), lines[0]


def test_json_lines_error_points_at_its_line_and_nothing_is_submitted(
    tmp_path: Path, env: dict[str, str], redis_client
) -> None:
    text = '{"prompt": "one"}\n\n{"prompt": "two"}\n{"prompt": "three", "height": 33}\n'
    path = write(tmp_path, "many.jsonl", text)
    code, _out, err = run(["submit", path], env)
    assert code == ExitCode.USAGE
    assert err.strip() == f"producer: {path}:4:21: height: must be a multiple of 32, got 33"
    assert redis_client.llen(f"rq:queue:{env['LTX_QUEUES']}") == 0  # all validated before any submit


def test_missing_file_wrong_type_and_missing_field(tmp_path: Path, env: dict[str, str]) -> None:
    code, _out, err = run(["submit", str(tmp_path / "nope.json")], env)
    assert (code, err.strip()) == (ExitCode.USAGE, f"producer: {tmp_path / 'nope.json'}: no such file")
    path = write(tmp_path, "list.json", "[1, 2]")
    code, _out, err = run(["submit", path], env)
    expected = f"producer: {path}:1:1: expected a JSON object (a request), got array"
    assert (code, err.strip()) == (ExitCode.USAGE, expected)
    path = write(tmp_path, "noprompt.json", '{"seed": 3}')
    code, _out, err = run(["submit", path], env)
    assert (code, err.strip()) == (ExitCode.USAGE, f"producer: {path}:1:1: missing required field 'prompt'")


def test_invalid_setting_is_a_usage_error(tmp_path: Path, env: dict[str, str]) -> None:
    path = write(tmp_path, "ok.json", '{"prompt": "x"}')
    code, _out, err = run(["submit", path], {**env, "LTX_MAX_QUEUE_DEPTH": "lots"})
    assert code == ExitCode.USAGE
    assert err.startswith("producer: invalid setting max_queue_depth (LTX_MAX_QUEUE_DEPTH)")


@settings(max_examples=60, deadline=None)
@given(
    data=st.dictionaries(
        st.text(min_size=1, max_size=8),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
            max_leaves=8,
        ),
        max_size=5,
    ),
    indent=st.sampled_from([None, 0, 2, 4]),
)
def test_locate_points_at_every_key(data: dict, indent: int | None) -> None:
    text = json.dumps(data, indent=indent)
    offsets = locate(text)
    for key in data:
        offset = offsets[(key,)]
        # the key's own JSON string starts there (json.dumps escapes it the same way)
        assert text.startswith(json.dumps(key), offset)
        pos = position_at(text, offset)
        assert text.splitlines()[pos.line - 1][pos.column - 1] == '"'


# ==== admission control =================================================================================


def test_submit_over_the_cap_is_refused_with_its_own_exit_code(tmp_path: Path, env: dict[str, str]) -> None:
    path = write(tmp_path, "p.json", '{"prompt": "x", "width": 64, "height": 64, "num_frames": 9}')
    capped = {**env, "LTX_MAX_QUEUE_DEPTH": "2"}
    ids = []
    for _ in range(2):
        code, out, _err = run(["submit", path], capped)
        assert code == ExitCode.OK
        ids.append(out.strip())
    code, out, err = run(["submit", path], capped)
    assert code == ExitCode.REFUSED == 3
    assert out == ""
    assert err.strip() == (
        f"producer: refused: queue '{env['LTX_QUEUES']}' is full: 2/2 jobs waiting (admission cap); "
        "try again when it drains, or use `producer backfill`, which waits"
    )
    # cancelling one makes room
    assert run(["cancel", ids[0]], capped)[0] == ExitCode.OK
    assert run(["submit", path], capped)[0] == ExitCode.OK


def test_client_quota(tmp_path: Path, env: dict[str, str]) -> None:
    path = write(tmp_path, "p.json", '{"prompt": "x"}')
    quota = {**env, "LTX_CLIENT_QUOTA": "2"}
    first = run(["submit", path], quota)[1].strip()
    assert run(["submit", path], quota)[0] == ExitCode.OK
    code, _out, err = run(["submit", path], quota)
    assert code == ExitCode.REFUSED
    assert f"client '{env['LTX_CLIENT']}' has 2/2 unfinished jobs (quota)" in err
    # another client is not affected; a finished (here: cancelled) job frees its slot
    assert run(["--client", "other", "submit", path], quota)[0] == ExitCode.OK
    assert run(["cancel", first], quota)[0] == ExitCode.OK
    assert run(["submit", path], quota)[0] == ExitCode.OK


def test_cancel_waiting_job_then_status_and_watch(tmp_path: Path, env: dict[str, str], redis_client) -> None:
    path = write(tmp_path, "p.json", '{"prompt": "cancel me", "seed": 5}')
    job_id = run(["submit", path], env)[1].strip()
    code, out, _ = run(["status", job_id, "--json"], env)
    assert code == 0
    info = json.loads(out)
    assert (info["state"], info["rq_status"], info["request"]["seed"]) == ("queued", "queued", 5)

    code, _out, err = run(["watch", job_id, "--timeout", "1"], env)
    assert code == ExitCode.NOT_FINISHED
    assert "still queued" in err

    code, out, _ = run(["cancel", job_id], env)
    assert (code, out.strip()) == (0, f"cancelled {job_id} (it was waiting; it will not run)")
    assert redis_client.llen(f"rq:queue:{env['LTX_QUEUES']}") == 0
    # the producer wrote the terminal event itself, so any stream reader sees the end
    entries = redis_client.xrange(events_key(job_id))
    assert json.loads(entries[-1][1][b"data"])["state"] == JobState.CANCELLED.value

    code, out, _ = run(["watch", job_id], env)
    assert code == ExitCode.CANCELLED
    assert "cancelled" in out
    code, out, _ = run(["cancel", job_id], env)
    assert (code, out.strip()) == (0, f"{job_id} had already ended (cancelled); nothing to cancel")
    code, _out, err = run(["fetch", job_id, "-o", str(tmp_path / "x.mp4")], env)
    assert code == ExitCode.CANCELLED
    assert not (tmp_path / "x.mp4").exists()


def test_unknown_job_and_unreachable_redis(env: dict[str, str]) -> None:
    for command in (["status", "nope"], ["watch", "nope"], ["cancel", "nope"], ["fetch", "nope"]):
        code, _out, err = run(command, env)
        assert code == ExitCode.NOT_FOUND, command
        assert err.strip() == "producer: no job 'nope' (never submitted, or expired)"


def test_every_command_says_one_line_when_redis_is_unreachable(tmp_path: Path, env: dict[str, str]) -> None:
    """Regression: `producer ls` printed a Python traceback (exit 1) where every other command said one line
    and exited 6."""
    dead = {**env, "LTX_REDIS_URL": "redis://127.0.0.1:1/0"}
    request = write(tmp_path, "p.json", '{"prompt": "x"}')
    commands = [["status", "x"], ["watch", "x"], ["cancel", "x"], ["fetch", "x"], ["ls"], ["stats"],
                ["submit", request]]  # fmt: skip
    for command in commands:
        result = CliRunner().invoke(cli, command, env=dead)
        assert result.exception is None or isinstance(result.exception, SystemExit), (command, result.exc_info)
        assert result.exit_code == ExitCode.UNAVAILABLE, (command, result.output)
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("producer: cannot reach Redis"), command
        assert "Traceback" not in result.output
    # a dry run validates the file anyway and says the runner limits could not be checked
    code, out, err = run(["submit", request, "--dry-run"], dead)
    assert code == 0 and out.strip().endswith(": ok") and "runner limits not checked" in err


def test_priority_high_goes_to_the_front(tmp_path: Path, env: dict[str, str], redis_client) -> None:
    path = write(tmp_path, "p.json", '{"prompt": "x"}')
    normal = run(["submit", path], env)[1].strip()
    urgent = run(["submit", path, "--priority", "high"], env)[1].strip()
    ids = [i.decode() for i in redis_client.lrange(f"rq:queue:{env['LTX_QUEUES']}", 0, -1)]
    assert ids == [urgent, normal]


def test_jobs_are_json_not_pickle(tmp_path: Path, env: dict[str, str], redis_client) -> None:
    import zlib

    path = write(tmp_path, "p.json", '{"prompt": "json please", "width": 64}')
    job_id = run(["submit", path], env)[1].strip()
    data = json.loads(zlib.decompress(redis_client.hget(f"rq:job:{job_id}", "data")))
    assert data[0] == RENDER_FUNC
    assert data[2][0]["prompt"] == "json please"
    assert json.loads(redis_client.hget(f"rq:job:{job_id}", "meta"))["state"] == "queued"


def test_content_job_id_is_stable_and_seed_sensitive(tmp_path: Path) -> None:
    a, b, c = load_requests(
        write(tmp_path, "x.jsonl", '{"prompt": "x"}\n{"seed": 42, "prompt": "x"}\n{"prompt": "x", "seed": 1}\n')
    )
    assert content_job_id(a.request) == content_job_id(b.request) != content_job_id(c.request)
    assert re.fullmatch(r"bf-[0-9a-f]{32}", content_job_id(a.request))


# ==== docs and layering =================================================================================


def test_exit_codes_are_documented_in_help_and_docs(env: dict[str, str]) -> None:
    _code, out, _ = run(["--help"], env)
    for code in ExitCode:
        assert re.search(rf"^\s+{code.value}\s+{code.name.lower().replace('_', ' ')}:", out, re.M), code
    docs = (ROOT / "docs" / "producer.md").read_text()
    for code in ExitCode:
        assert re.search(rf"^\|\s*{code.value}\s*\|\s*`{code.name}`", docs, re.M), f"{code} missing in docs"
    assert "\x08" not in out


def test_producer_never_imports_torch_or_ltx_mgpu() -> None:
    # (but the engine's stdlib-only request specs, `ltx_mgpu.spec`, shared with the runners)
    code = (
        "import sys, producer.cli, producer.client, producer.backfill\n"
        "shared = lambda m: m in ('ltx_mgpu', 'ltx_mgpu.errors') or m.split('.')[:2] == ['ltx_mgpu', 'spec']\n"
        "heavy = ('torch', 'ltx_mgpu', 'boto3')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in heavy and not shared(m))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# ==== the terminal rendering of watch ===================================================================


def _events(*items: tuple[str, dict]) -> list:
    from producer.client import JobEvent

    return [JobEvent(id=f"{i}-0", type=t, data={"type": t, "ts": 1.0e9 + i, **d}) for i, (t, d) in enumerate(items)]


WATCH_EVENTS = _events(
    ("state", {"state": "started", "worker": "w1", "fleet": "cpu:2", "attempt": 1, "queue_wait_s": 0.01}),
    ("state", {"state": "rendering", "devices": "cpu:2", "world_size": 2}),
    ("stage", {"stage": "encode"}),  # a stage with no total yet
    ("stage", {"stage": "denoise", "steps": 3}),
    *[("progress", {"stage": "denoise", "step": k, "total": 3, "eta_s": 0.5 * (3 - k)}) for k in (1, 2, 3)],
    ("stage", {"stage": "decode"}),
    ("output", {"width": 64, "height": 64, "frames": 9, "fps": 24.0, "bytes": 2048}),
    ("upload", {"bytes": 1024, "total": 2048}),
    ("upload", {"attempt": 1, "error": "connection [reset]", "retry_in_s": 1.0}),
    ("upload", {"bytes": 2048, "total": 2048}),
    ("fleet", {"action": "rebuilt", "pids": [1, 2]}),
    ("other", {"note": "[not markup]"}),
    ("state", {"state": "uploaded", "result": {"bucket": "b", "key": "k/v.mp4", "size": 2048, "sha256": "ab" * 32}}),
)


def test_watch_renders_progress_bars_on_a_terminal() -> None:
    """The rich path (what a person sees) must survive every event type, including stages without totals."""
    import io

    from rich.console import Console

    from producer.display import EventPrinter

    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=120, color_system=None)
    with EventPrinter(console, "job-1") as printer:
        assert printer.progress is not None
        for event in WATCH_EVENTS:
            printer.show(event)
    text = buffer.getvalue()
    assert "started on w1 (fleet cpu:2, attempt 1)" in text
    assert "denoise" in text and "3/3" in text and "100.0%" in text
    assert "upload attempt 1 failed: connection [reset]" in text
    assert "uploaded s3://b/k/v.mp4" in text
    assert "[not markup]" in text


def test_watch_plain_lines_off_a_terminal() -> None:
    import io

    from rich.console import Console

    from producer.display import EventPrinter

    buffer = io.StringIO()
    with EventPrinter(Console(file=buffer, width=80), "job-1") as printer:
        assert printer.progress is None
        for event in WATCH_EVENTS:
            printer.show(event)
    lines = [line.split(" ", 1)[1] for line in buffer.getvalue().splitlines()]
    assert lines[:5] == [
        "started on w1 (fleet cpu:2, attempt 1), waited 0.01s",
        "rendering on cpu:2 (2 ranks)",
        "stage encode",
        "stage denoise",
        "denoise 1/3 (33%) eta 1.0s",
    ]
    assert all(len(line) < 200 for line in lines)
    assert lines[-1] == "uploaded s3://b/k/v.mp4 (2.0 KiB, sha256 abababababababab…)"


def test_watch_and_stats_small_print() -> None:
    """Regression: the last upload line read "upload 256.0 KiB/25.3 MiB" right before "uploaded" (the final
    progress line was throttled away), and a one-rank fleet was shown as "(1 ranks)"."""
    import io
    from datetime import UTC, datetime

    from rich.console import Console

    from ltx_contract.health import WorkerHealth
    from producer.client import Stats, WorkerInfo
    from producer.display import EventPrinter, render_stats

    total = 25 * 2**20
    events = _events(
        ("state", {"state": "rendering", "devices": "cpu:1", "world_size": 1}),
        ("upload", {"bytes": 2**18, "total": total}),
        ("upload", {"bytes": total // 2, "total": total}),
        ("upload", {"bytes": total, "total": total, "done": True}),
        ("state", {"state": "uploaded", "result": {"bucket": "b", "key": "k", "size": total, "sha256": "ab" * 32}}),
    )
    buffer = io.StringIO()
    with EventPrinter(Console(file=buffer, width=120), "job-1") as printer:
        for event in events:  # all within one second: the middle line is throttled, the last one is not
            printer.show(event)
    lines = [line.split(" ", 1)[1] for line in buffer.getvalue().splitlines()]
    assert lines[0] == "rendering on cpu:1 (1 rank)"
    assert [x for x in lines if x.startswith("upload ")][-1] == "upload 25.0 MiB/25.0 MiB", lines
    health = WorkerHealth.from_json({"fleet": {"state": "ready", "pids": [11]}, "jobs_done": 3})
    worker = WorkerInfo(name="w", state="idle", queues=["q"], current_job=None, group="cpu:1", fleet_state="ready",
                        last_heartbeat=datetime.now(UTC), health=health)  # fmt: skip
    stats = Stats(queues=[], workers=[worker], failures=[], max_queue_depth=0, client="c", client_quota=0,
                  client_unfinished=0)  # fmt: skip
    buffer = io.StringIO()
    render_stats(Console(file=buffer, width=200), stats)
    assert "ready (1 rank)" in buffer.getvalue() and "ranks" not in buffer.getvalue()


def test_backfill_progress_bar_on_a_terminal() -> None:
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from producer.admission import SubmitRefusal
    from producer.backfill import BackfillSummary, ManifestRecord
    from producer.backfill_console import BackfillProgress

    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=140, color_system=None)
    summary = BackfillSummary(total=5, already_done=1)
    runner = SimpleNamespace(refusal=None)
    with BackfillProgress(console, live=True) as progress:
        progress.update(summary, "start", runner)
        runner.refusal = SubmitRefusal("queue_full", 200, 200, "ltx-render")
        progress.update(summary, "waiting", runner)
        runner.refusal = None
        summary.enqueued, summary.uploaded = 4, 4
        progress.record(ManifestRecord("bf-1", "uploaded", "k", "b", "ab" * 32, 10, 1.0, "f:1:1"))
        progress.update(summary, "finished", runner)
    text = buffer.getvalue()
    assert "waiting: queue 'ltx-render' is full: 200/200 jobs waiting (admission cap)" in text
    assert "5/5" in text and "5 ok" in text
