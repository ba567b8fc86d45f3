"""The producer refuses what the runners cannot do, with one line and no traceback (docs/security.md):
`frame_rate: 1e-300` passed `--dry-run` and `submit`, then killed a rank on every attempt; a 5000-digit
integer in a request file and a fetch URL whose port is not a number gave tracebacks.
Real Redis; the CLI through click's runner (the worker's side: tests/test_worker_bounds.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rq import Queue
from rq.serializers import JSONSerializer

from producer.exit_codes import ExitCode
from tests.support.cli import run, write

ATTACK = '{"prompt":"a fox","width":128,"height":96,"num_frames":9,"frame_rate":%s,"steps":2}'


def _one_line(err: str) -> None:
    assert err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize(("value", "says"), [
    ("1e-300", "frame_rate: input should be greater than or equal to 1 (got 1e-300)"),
    ("1e-6", "frame_rate: input should be greater than or equal to 1 (got 1e-06)"),
    ("121", "frame_rate: input should be less than or equal to 120 (got 121)"),
    ("NaN", "frame_rate: input should be a finite number"),
    ("Infinity", "frame_rate: input should be a finite number"),
])  # fmt: skip
def test_a_frame_rate_the_runners_cannot_do_is_refused_at_dry_run_and_submit(tmp_path, env, redis_client, value,
                                                                             says):  # fmt: skip
    path = write(tmp_path, "attack.json", ATTACK % value)
    for args in (["submit", "--dry-run", path], ["submit", path]):
        code, out, err = run(args, env)
        assert code == ExitCode.USAGE and out == "", (out, err)
        _one_line(err)
        assert f"{path}:1:58: {says}" in err, err
    assert Queue(env["LTX_QUEUES"], connection=redis_client, serializer=JSONSerializer).count == 0


def test_a_5000_digit_integer_in_a_request_file_is_one_clear_line(tmp_path, env):
    digits = "9" * 5000
    path = write(tmp_path, "big.json", '{"prompt": "a", "seed": ' + digits + "}")
    code, out, err = run(["submit", "--dry-run", path], env)
    assert code == ExitCode.USAGE, (out, err)
    _one_line(err)
    assert f"{path}:1:25: an integer of 5000 digits; no request field takes one longer than 100" in err
    lines = write(tmp_path, "big.jsonl", '{"prompt": "a"}\n{"prompt": "b", "width": -' + digits + "}\n")
    code, out, err = run(["submit", lines], env)
    assert code == ExitCode.USAGE, (out, err)
    _one_line(err)
    assert f"{lines}:2:26: an integer of 5000 digits" in err
    # the Python API (no file to parse) says the same without a traceback
    from producer.request_file import RequestFileError, validate_request

    with pytest.raises(RequestFileError, match="seed: input should be less than or equal to 4294967295 "
                                               r"\(got an integer of about 5001 digits\)"):  # fmt: skip
        validate_request({"prompt": "a", "seed": 10**5000})
    # (a long integer that Python can still convert is refused by its field's range, as before)
    path = write(tmp_path, "long.json", '{"prompt": "a", "seed": ' + "9" * 60 + "}")
    code, out, err = run(["submit", "--dry-run", path], env)
    assert code == ExitCode.USAGE and "seed: input should be less than or equal to 4294967295" in err, err


def test_a_fetch_url_whose_port_is_not_a_number_is_refused_in_one_line(tmp_path, env, redis_client):
    q = Queue(env["LTX_QUEUES"], connection=redis_client, serializer=JSONSerializer)
    result = {"url": "http://127.0.0.1:9000.nip.io/x", "sha256": "0" * 64, "key": "k"}
    job = q.create_job("worker.job.render", args=({"prompt": "t"},), meta={"state": "uploaded", "result": result})
    job.save()
    code, out, err = run(["fetch", job.id, "-o", str(tmp_path / "out.mp4")], {**env, "LTX_S3_ENDPOINT_URL":
                                                                               "http://127.0.0.1:8333"})  # fmt: skip
    assert code != 0, (out, err)
    _one_line(err)
    assert "refusing to fetch 'http://127.0.0.1:9000.nip.io/x'" in err, err
    assert not Path(tmp_path / "out.mp4").exists()
