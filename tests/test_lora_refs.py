"""The `loras` request field at the edge: its schema (count, strength, name, uri), `producer submit --lora`
and `--dry-run` against what a live worker publishes (real Redis; the worker is an RQ worker registration
with a health snapshot, as `worker.runtime.fleet_worker` writes it).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from pydantic import ValidationError
from rq import Queue
from rq.worker import Worker

from ltx_contract.keys import worker_health_key
from ltx_contract.lora_refs import MAX_LORAS, LoraRef, parse_lora_option, uri_allowed, uri_problem
from ltx_contract.schema import RenderRequest
from producer.exit_codes import ExitCode
from tests.support.cli import run


def request(**loras_field: object) -> RenderRequest:
    return RenderRequest.model_validate({"prompt": "x", **loras_field})


def test_the_field_defaults_to_none_and_takes_names_and_uris() -> None:
    assert request().loras is None
    req = request(loras=[{"name": "dolly-in", "strength": 0.8}, {"uri": "s3://loras/user/a.safetensors"}])
    assert [r.label for r in req.loras] == ["dolly-in", "s3://loras/user/a.safetensors"]
    assert req.loras[1].strength == 1.0
    assert RenderRequest.model_validate_json(req.model_dump_json()) == req  # travels as JSON through Redis


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ({"name": "../etc/passwd"}, "should match pattern"),
        ({"name": "a/b"}, "should match pattern"),
        ({"name": ".hidden"}, "should match pattern"),
        ({"name": "a", "uri": "s3://bucket/a.safetensors"}, "exactly one of"),
        ({"strength": 1.0}, "exactly one of"),
        ({"name": "a", "strength": math.nan}, "finite number"),
        ({"name": "a", "strength": math.inf}, "finite number"),
        ({"name": "a", "strength": 4.5}, "less than or equal to 4"),
        ({"uri": "https://example.com/a.safetensors"}, "must be s3://bucket/key"),
        ({"uri": "s3://Bad_Bucket/a.safetensors"}, "not a valid S3 bucket"),
        ({"uri": "s3://bucket/a/../b.safetensors"}, "no empty, '.' or '..' segments"),
        ({"uri": "s3://bucket/a.ckpt"}, "must end in .safetensors"),
        ({"name": "a", "path": "/x"}, "Extra inputs are not permitted"),
    ],
)
def test_bad_entries_are_refused(lora: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        request(loras=[lora])


def test_at_most_max_loras() -> None:
    request(loras=[{"name": f"l{i}"} for i in range(MAX_LORAS)])
    with pytest.raises(ValidationError, match=f"at most {MAX_LORAS} items"):
        request(loras=[{"name": f"l{i}"} for i in range(MAX_LORAS + 1)])


def test_lora_option_syntax_and_prefixes() -> None:
    assert parse_lora_option("dolly") == LoraRef(name="dolly")
    assert parse_lora_option("dolly:0.5") == LoraRef(name="dolly", strength=0.5)
    assert parse_lora_option("s3://b-1/k/a.safetensors") == LoraRef(uri="s3://b-1/k/a.safetensors")
    assert parse_lora_option("s3://b-1/k/a.safetensors:-1.5").strength == -1.5
    with pytest.raises(ValueError, match="strength 'x' is not a number"):
        parse_lora_option("dolly:x")
    assert uri_allowed("s3://loras/user/a.safetensors", ["loras/user/"])
    assert uri_allowed("s3://loras/a.safetensors", ["loras"])
    assert not uri_allowed("s3://loras2/a.safetensors", ["loras"])  # the bucket matches whole
    assert not uri_allowed("s3://loras/other/a.safetensors", ["loras/user/"])


def test_prefixes_match_whole_path_segments() -> None:
    """`loras/shared` allowed `loras/shared-private/...` and `loras/sharedbackup/...` (a string
    prefix). A prefix names a folder: the key must be inside it, whether the prefix ends in `/` or not."""
    for prefix in ("bkt/loras/shared", "bkt/loras/shared/"):
        assert uri_allowed("s3://bkt/loras/shared/a.safetensors", [prefix])
        assert uri_allowed("s3://bkt/loras/shared/deep/a.safetensors", [prefix])
        outside = ("loras/shared-private/a.safetensors", "loras/sharedbackup/a.safetensors", "loras/shared.safetensors")
        for key in outside:
            assert not uri_allowed(f"s3://bkt/{key}", [prefix]), (prefix, key)
    for shared in (["bkt/loras/shared"], ["bkt/loras/shared/"]):  # the shared list, with and without tenants
        for tenant in (None, "alice"):
            assert uri_problem("s3://bkt/loras/shared/a.safetensors", ["bkt/u"], shared, tenant) is None
            assert uri_problem("s3://bkt/loras/shared-private/a.safetensors", ["bkt/u"], shared, tenant) is not None
    assert uri_problem("s3://bkt/u/alicebackup/a.safetensors", ["bkt/u"], [], "alice") is not None  # (own folder too)
    assert uri_allowed("s3://bkt/anything/a.safetensors", ["bkt"]) and uri_allowed("s3://bkt/a.safetensors", ["bkt/"])


# ==== producer submit --lora / --dry-run ================================================================


def publish(redis_client, env: dict[str, str], offer: dict) -> Worker:
    """An RQ worker registration on the test's queue with a health snapshot offering `offer` as `loras`."""
    queue = Queue(env["LTX_QUEUES"], connection=redis_client)
    worker = Worker([queue], connection=redis_client, name=f"w-{env['LTX_QUEUES']}")
    worker.register_birth()
    redis_client.set(worker_health_key(worker.name), json.dumps({"worker": worker.name, "loras": offer}), ex=60)
    return worker


def test_submit_lora_option_adds_to_every_request_and_dry_run_checks_syntax(tmp_path: Path, env) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b", "loras": [{"name": "jib"}]}\n')
    code, out, _ = run(["submit", str(path), "--lora", "dolly:0.5", "--dry-run"], env)
    assert code == 0 and out.count(": ok") == 2
    code, _, err = run(["submit", str(path), "--lora", "dolly:9", "--dry-run"], env)
    assert code == ExitCode.USAGE and "--lora 'dolly:9': strength: input should be less than or equal to 4" in err
    many = [a for i in range(MAX_LORAS) for a in ("--lora", f"x{i}")]  # the second has one: MAX_LORAS + 1
    code, _, err = run(["submit", str(path), *many, "--dry-run"], env)
    assert code == ExitCode.USAGE and f"x7 on {path}:2:1: loras: list should have at most 8 items" in err, err


def test_a_strength_sum_from_the_lora_options_is_one_line_naming_the_flags(tmp_path: Path, env) -> None:
    """`--lora dolly-in:3 --lora dolly-in:2` printed `ok64.json:1:1: with --lora, : Value error, loras: ...`:
    an empty field, pydantic's prefix, no flag named. One line now: the flags, the request, the problem."""
    path = tmp_path / "ok64.json"
    path.write_text('{"prompt": "a", "width": 64, "height": 64, "num_frames": 9}')
    code, out, err = run(["submit", str(path), "--lora", "dolly-in:3", "--lora", "dolly-in:2", "--dry-run"], env)
    problem = "loras: dolly-in: strengths add up to 5 for one file; at most 4 in sum"
    expected = f"producer: --lora dolly-in:3 --lora dolly-in:2 on {path}:1:1: {problem}\n"
    assert (code, out, err) == (ExitCode.USAGE, "", expected)


def test_a_strength_sum_in_a_request_file_points_at_loras_and_echoes_nothing(tmp_path: Path, env) -> None:
    """The same refusal from the file's own `loras` echoed the whole request (`(got {'prompt': ...})`), the
    prompt included, and pointed at the object's first character: now at the `loras` field, nothing echoed."""
    path = tmp_path / "sum.json"
    loras = '[{"name": "dolly-in", "strength": 3}, {"name": "dolly-in", "strength": 2}]'
    path.write_text('{"prompt": "a secret prompt", "loras": ' + loras + "}")
    code, out, err = run(["submit", str(path), "--dry-run"], env)
    column = path.read_text().index('"loras"') + 1  # (where the field is, 1-based, as for any field)
    expected = f"producer: {path}:1:{column}: loras: dolly-in: strengths add up to 5 for one file; at most 4 in sum\n"
    assert (code, out, err) == (ExitCode.USAGE, "", expected)


def test_dry_run_checks_names_prefixes_and_count_a_worker_publishes(tmp_path: Path, env, redis_client) -> None:
    path = tmp_path / "p.json"
    path.write_text('{"prompt": "a"}')
    worker = publish(redis_client, env, {"names": ["dolly", "jib"], "s3_prefixes": ["loras/u/"], "max_per_request": 2})
    try:
        assert run(["submit", str(path), "--lora", "dolly", "--lora", "s3://loras/u/a.safetensors", "--dry-run"],
                   env)[0] == 0  # fmt: skip
        code, _, err = run(["submit", str(path), "--lora", "crane", "--dry-run"], env)
        assert code == ExitCode.USAGE and "loras[0].name: 'crane' is not in the worker's catalogue" in err
        code, _, err = run(["submit", str(path), "--lora", "s3://loras/x/a.safetensors", "--dry-run"], env)
        assert code == ExitCode.USAGE and "under no prefix this worker allows" in err
        code, _, err = run(["submit", str(path), "--lora", "dolly", "--lora", "jib", "--lora", "dolly:0.1"], env)
        assert code == ExitCode.USAGE and "3 LoRAs, the worker takes at most 2" in err and "nothing submitted" in err
        assert Queue(env["LTX_QUEUES"], connection=redis_client).count == 0
    finally:
        worker.register_death()
