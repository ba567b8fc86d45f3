"""Worker settings: environment, settings files, CLI overrides, secrets from files, errors naming fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ltx_mgpu.control.devices import parse_device_group
from worker.settings import (
    BUILTIN_RUNNERS,
    SettingsError,
    WorkerSettings,
    group_label,
    load_settings,
    resolve_runner,
    validate_group,
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith("LTX_"):
            monkeypatch.delenv(key)


def test_defaults_are_valid_and_settings_cli_supervisor_never_import_torch():
    import subprocess
    import sys

    code = (
        "import sys; import worker.cli, worker.runtime.supervisor, ltx_contract.keys, ltx_contract.control; "
        "from worker.settings import load_settings; load_settings(); "
        "engine = {m for m in sys.modules if m.startswith('ltx_mgpu')} - {'ltx_mgpu', 'ltx_mgpu.control', "
        "'ltx_mgpu.control.devices', 'ltx_mgpu.spec', 'ltx_mgpu.spec.bounds', 'ltx_mgpu.spec.image_size', "
        "'ltx_mgpu.spec.request_rules', 'ltx_mgpu.errors'}; "
        "assert 'torch' not in sys.modules and not engine, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    s = load_settings()
    assert s.queues == ["ltx-render"] and s.groups == ["cpu:1"] and s.runner == "smoke"
    assert s.runner_registry["smoke"] == BUILTIN_RUNNERS["smoke"]
    assert s.result_ttl > 0 and s.failure_ttl < 365 * 86400  # never RQ's one-year default


def test_environment_lists_and_types(monkeypatch):
    monkeypatch.setenv("LTX_GROUPS", "0,1,2,3; 4,5,6,7")
    monkeypatch.setenv("LTX_QUEUES", "high,low")
    monkeypatch.setenv("LTX_RENDER_TIMEOUT", "120")
    monkeypatch.setenv("LTX_RUNNER_SETUP", '{"default_steps": 3}')
    monkeypatch.setenv("LTX_RUNNERS", '{"mine": "pkg.mod:Runner"}')
    monkeypatch.setenv("LTX_RUNNER", "mine")
    s = load_settings()
    assert s.groups == ["0,1,2,3", "4,5,6,7"] and s.queues == ["high", "low"]
    assert s.render_timeout == 120.0 and s.runner_setup == {"default_steps": 3}
    assert s.runner_registry["mine"] == "pkg.mod:Runner" and "smoke" in s.runner_registry
    monkeypatch.setenv("LTX_GROUPS", '["cpu:2", "cuda:4,cuda:5"]')
    assert load_settings().groups == ["cpu:2", "4,5"]
    monkeypatch.setenv("LTX_METRICS_PORT", "off")
    assert load_settings().metrics_port is None and load_settings().metrics_port_for(0) is None


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"LTX_RENDER_TIMEOUT": "soon"}, "render_timeout (LTX_RENDER_TIMEOUT)"),
        ({"LTX_GROUPS": "0,1;1,2"}, "groups (LTX_GROUPS)"),
        ({"LTX_GROUPS": "gpu0"}, "groups (LTX_GROUPS)"),
        ({"LTX_QUEUES": "a b"}, "queues (LTX_QUEUES)"),
        ({"LTX_REDIS_URL": "localhost:6379"}, "redis_url (LTX_REDIS_URL)"),
        ({"LTX_RUNNER": "nope"}, "runner (LTX_RUNNER)"),
        ({"LTX_STORAGE_BACKEND": "local"}, "local_storage_dir (LTX_LOCAL_STORAGE_DIR)"),
        ({"LTX_S3_ACCESS_KEY_ID": "k"}, "LTX_S3_SECRET_ACCESS_KEY"),
        ({"LTX_PRESIGN_EXPIRY_S": "999999999"}, "presign_expiry_s (LTX_PRESIGN_EXPIRY_S)"),
        ({"LTX_S3_ENDPOINT_URL": "minio:9000"}, "s3_endpoint_url (LTX_S3_ENDPOINT_URL)"),
        ({"LTX_HEARTBEAT_INTERVAL": "40"}, "job_heartbeat_ttl (LTX_JOB_HEARTBEAT_TTL)"),
        ({"LTX_WARMUP_REQUESTS": '[{"prompt": "x", "width": 100}]'}, "request 0: field 'width'"),
        ({"LTX_WARMUP_REQUESTS": '[{"prompt": "x", "colour": 1}]'}, "warmup_requests (LTX_WARMUP_REQUESTS)"),
        ({"LTX_MAX_QUEUE_DEPTH": "-1"}, "max_queue_depth (LTX_MAX_QUEUE_DEPTH)"),
        ({"LTX_CLIENT_QUOTA": "many"}, "client_quota (LTX_CLIENT_QUOTA)"),
        ({"LTX_CLIENT_QUOTA": "1000001"}, "client_quota (LTX_CLIENT_QUOTA)"),
        ({"LTX_NOT_A_SETTING": "1"}, None),  # unknown LTX_ variables are ignored by pydantic-settings
    ],
)
def test_invalid_settings_name_the_field(monkeypatch, env, needle):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if needle is None:
        load_settings()
        return
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert needle in str(info.value)


@pytest.mark.parametrize(("value", "expected"), [(None, None), ("0", None), ("off", None), ("", None), ("200", 200)])
def test_admission_limits_are_off_when_unset_or_zero_as_for_the_producer(monkeypatch, value, expected):
    for var in ("LTX_MAX_QUEUE_DEPTH", "LTX_CLIENT_QUOTA"):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    s = load_settings()
    assert (s.depth_cap, s.quota) == (expected, expected)


def test_warmup_requests_become_runner_kwargs_like_jobs(monkeypatch):
    monkeypatch.setenv("LTX_WARMUP_REQUESTS", '[{"prompt": "warm", "width": 768, "num_frames": 121}]')
    (job,) = load_settings().warmup_jobs()
    assert job["prompt"] == "warm" and job["width"] == 768 and job["num_frames"] == 121
    assert job["height"] == 512 and "steps" not in job  # schema defaults filled, unset optionals left out
    assert load_settings(warmup_requests=[]).warmup_jobs() == []


def test_settings_files_json_and_toml_with_env_and_cli_precedence(tmp_path, monkeypatch):
    cfg = tmp_path / "worker.json"
    cfg.write_text(json.dumps({"queues": ["from-file"], "render_timeout": 100, "runner": "noop"}))
    s = load_settings(cfg)
    assert s.queues == ["from-file"] and s.render_timeout == 100 and s.runner == "noop"
    monkeypatch.setenv("LTX_RENDER_TIMEOUT", "200")
    assert load_settings(cfg).render_timeout == 200  # env beats the file
    assert load_settings(cfg, render_timeout=300).render_timeout == 300  # CLI beats env
    toml = tmp_path / "worker.toml"
    toml.write_text('queues = ["t"]\nmetrics_port = 9500\n[runner_setup]\ndefault_steps = 2\n')
    s = load_settings(toml)
    assert s.queues == ["t"] and s.metrics_port_for(1) == 9501 and s.runner_setup == {"default_steps": 2}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"render_timout": 1}))
    with pytest.raises(SettingsError, match="render_timout"):
        load_settings(bad)
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings(tmp_path / "missing.json")


def test_credentials_from_files_are_secret(tmp_path):
    (tmp_path / "id").write_text("AKIDEXAMPLE\n")
    (tmp_path / "secret").write_text("s3cr3t\n")
    s = load_settings(s3_access_key_id_file=tmp_path / "id", s3_secret_access_key_file=tmp_path / "secret")
    assert s.s3_access_key_id.get_secret_value() == "AKIDEXAMPLE"
    assert s.s3_secret_access_key.get_secret_value() == "s3cr3t"
    dumped = json.dumps(s.public_dump())
    assert "s3cr3t" not in dumped and "AKIDEXAMPLE" not in dumped and "s3cr3t" not in repr(s)
    with pytest.raises(SettingsError, match="cannot read"):
        load_settings(s3_access_key_id_file=tmp_path / "nope", s3_secret_access_key_file=tmp_path / "secret")


def test_checksum_mode_defaults_on_for_custom_endpoints():
    assert WorkerSettings().checksum_when_required is False
    assert WorkerSettings(s3_endpoint_url="http://seaweed:8333").checksum_when_required is True
    assert WorkerSettings(s3_endpoint_url="http://x:1", s3_checksum_when_required=False).checksum_when_required is False


def test_groups_and_labels():
    assert validate_group("cpu") == "cpu" and validate_group(" 0, 1 ") == "0,1"
    assert group_label("0,1,2,3") == "g0-1-2-3" and group_label("cpu:2") == "cpu2"
    assert validate_group("cpu:1") == "cpu:1" and validate_group("cuda:4, cuda:5") == "4,5"
    for bad in ("cpu:0", "0,0", "a,b", "", "cpu2", "cpux", "0,cpu", "-1"):
        with pytest.raises(ValueError):
            validate_group(bad)
        with pytest.raises(ValueError):  # the engine builds fleets with the same parser
            parse_device_group(bad)
    for good in ("cpu", "cpu:3", " 0, 1 ", "cuda:4,cuda:5"):
        assert parse_device_group(validate_group(good)) == parse_device_group(good)


def test_resolve_runner_imports_by_path():
    from ltx_mgpu.runners.noop import NoopRunner

    assert resolve_runner(WorkerSettings(runner="noop")) is NoopRunner
    s = WorkerSettings(runners={"x": "ltx_mgpu.runners.noop:Missing"}, runner="x")
    with pytest.raises(SettingsError, match="cannot import"):
        resolve_runner(s)


def test_options_before_the_settings_subcommand_apply_to_it():
    """Regression: `ltx-worker --group ... settings` showed groups ["cpu:1"] and the default Redis URL."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("LTX_")}

    def show(*args: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "worker", *args], env=env, capture_output=True, text=True,
                             timeout=60, check=True)  # fmt: skip
        return json.loads(out.stdout)

    shown = show("--group", "cpu:2", "--group", "cpu:1", "--redis-url", "redis://r:7/1", "--queue", "a", "settings")
    assert shown["groups"] == ["cpu:2", "cpu:1"] and shown["redis_url"] == "redis://r:7/1" and shown["queues"] == ["a"]
    # the subcommand's own option wins over the one given before it
    assert show("--redis-url", "redis://r:7/1", "settings", "--redis-url", "redis://own:1/0")["redis_url"] == (
        "redis://own:1/0"
    )


def test_backfill_manifests_and_demo_output_are_ignored_and_the_help_says_where_the_manifest_goes():
    """Regression: `producer backfill examples/prompts.jsonl` left an untracked, unignored manifest."""
    import subprocess

    from click.testing import CliRunner

    from producer.cli import cli

    root = Path(__file__).resolve().parent.parent
    for path in ("examples/prompts.manifest.jsonl", "ltx-demo-output/video.mp4", "0a1b2c.mp4"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=root, check=False).returncode == 0, path
    help_text = " ".join(CliRunner().invoke(cli, ["backfill", "--help"]).output.split())
    assert "<file>.manifest.jsonl next to the input" in help_text


def test_settings_output_masks_every_secret_and_metrics_listen_on_loopback(monkeypatch, tmp_path):
    """`ltx-worker settings` printed the Redis password; /metrics listened on all interfaces
    outside compose (compose sets 0.0.0.0 inside the container and publishes on the host's loopback)."""
    from click.testing import CliRunner

    from worker.cli import main

    monkeypatch.setenv("LTX_REDIS_URL", "redis://ltx:hunter2-redis@redis.internal:6379/0")
    monkeypatch.setenv("LTX_S3_ACCESS_KEY_ID", "AKIA-not-shown")
    monkeypatch.setenv("LTX_S3_SECRET_ACCESS_KEY", "hunter2-s3")
    result = CliRunner().invoke(main, ["settings"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "hunter2" not in result.output and "AKIA-not-shown" not in result.output
    shown = json.loads(result.stdout)
    assert shown["redis_url"] == "redis://***@redis.internal:6379/0"
    assert shown["metrics_host"] == "127.0.0.1"
    import yaml

    compose = yaml.safe_load((Path(__file__).resolve().parent.parent / "docker-compose.yml").read_text())
    worker = compose["services"]["worker"]
    assert worker["environment"]["LTX_METRICS_HOST"] == "0.0.0.0"
    assert all(str(p).startswith("127.0.0.1:") for p in worker["ports"])


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/abc",
        "redis://127.0.0.1:6379/0/1",
        "rediss://h:6380/db1",
        "redis://h:port/0",
        "unix:///tmp/r.sock?db=x",
    ],
)
def test_a_redis_url_that_names_no_database_number_is_refused_by_worker_and_producer(monkeypatch, url):
    """Regression: redis-py reads `redis://host:6379/abc` as DB 0 without a word, so a typo sent
    the worker and the producer to another database. One check (`check_redis_url`) refuses it in both."""
    from producer.settings import ProducerSettings

    monkeypatch.setenv("LTX_REDIS_URL", url)
    with pytest.raises(SettingsError, match=r"redis_url \(LTX_REDIS_URL\)"):
        load_settings()
    with pytest.raises(ValueError, match="redis_url"):
        ProducerSettings()


@pytest.mark.parametrize("url", ["redis://h", "redis://h:6379/", "redis://h:6379/15", "unix:///tmp/r.sock?db=2"])
def test_redis_urls_with_a_database_number_or_none_are_accepted(monkeypatch, url):
    from producer.settings import ProducerSettings

    monkeypatch.setenv("LTX_REDIS_URL", url)
    assert load_settings().redis_url == url and ProducerSettings().redis_url == url
