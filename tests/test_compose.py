"""docker-compose.yml and the Dockerfile, checked without Docker (it cannot run on these machines).

The compose file must parse; every LTX_* variable it gives the worker must be a real field of the worker's
settings class (and the producer's variables of the producer's), with the file's defaults forming valid
settings; and every image stage, command, console script and file it references must exist.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from producer.settings import ProducerSettings
from producer.settings import load_settings as load_producer_settings
from tests.support.compose import COMPOSE, DOCKERFILE, ROOT, SERVICES, image_files, stage_text, stages
from tests.support.imports import import_closure
from worker.settings import WorkerSettings
from worker.settings import load_settings as load_worker_settings

SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
_VAR = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def substitute(value: Any, env: dict[str, str] | None = None) -> Any:
    """Compose-style ${VAR}, ${VAR:-default}, ${VAR:?error} with `env` (default: nothing set)."""
    env = env or {}
    if not isinstance(value, str):
        return value

    def one(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if name in env:
            return env[name]
        if op in (":-", "-"):
            return arg
        if op in (":?", "?"):
            return f"<{name} required>"
        return ""

    return _VAR.sub(one, value)


def environment(service: str) -> dict[str, str]:
    env = SERVICES[service].get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(substitute(v)) for k, v in env.items()}


def mounted_secrets(service: str, root: Path) -> dict[str, Path]:
    """The service's secrets as compose mounts them (`/run/secrets/<target>`), written under `root` with a
    password each: {container path: file here}."""
    out = {}
    for entry in SERVICES[service].get("secrets", []):
        source, target = (entry, entry) if isinstance(entry, str) else (entry["source"], entry.get("target"))
        target = substitute(target or source)
        assert source in COMPOSE["secrets"], f"{service}: secret {source} is not declared"
        path = root / service / target
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{source}-0123456789abcdef\n")
        out[f"/run/secrets/{target}"] = path
    return out


def service_env_here(service: str, root: Path) -> dict[str, str]:
    """The service's environment with its secret files' container paths mapped to files here."""
    files = mounted_secrets(service, root)
    env = environment(service)
    for name, value in env.items():
        if name.endswith("_FILE") and value.startswith("/run/secrets/"):
            assert value in files, f"{service}: {name}={value} is not one of its mounted secrets"
            env[name] = str(files[value])
    return env


# ==== the file and the services =========================================================================


VERIFIED_REDIS_SERIES = "7.0"  # Debian's redis-server 7.0.15, what tests/test_redis_restart.py runs on


def test_compose_parses_and_has_the_services() -> None:
    assert set(SERVICES) >= {"redis", "s3", "worker", "dashboard", "producer"}
    for name, service in SERVICES.items():
        assert "image" in service or "build" in service, name


def test_redis_keeps_jobs_aof_and_noeviction() -> None:
    command = [str(c) for c in SERVICES["redis"]["command"]]
    joined = " ".join(command)
    assert "--appendonly yes" in joined
    assert "--maxmemory-policy noeviction" in joined
    assert any(v.endswith(":/data") for v in SERVICES["redis"]["volumes"])
    image = SERVICES["redis"]["image"]
    assert re.fullmatch(r"redis:\d+\.\d+\.\d+(-\w+)?", image), image


def test_redis_image_is_the_series_the_restart_test_passed_on() -> None:
    """Regression: Redis replays the AOF as `default`, and the users file once made every MULTI/EXEC fail that
    replay (queued jobs lost on restart). tests/test_redis_restart.py passed on Redis 7.0.15 (and valkey
    9.1.2): compose runs that series, and docs/security.md names the versions."""
    version = SERVICES["redis"]["image"].split(":")[1].split("-")[0]
    assert version.startswith(VERIFIED_REDIS_SERIES + "."), version
    security = (ROOT / "docs" / "security.md").read_text()
    assert f"Redis {version}" in security and "tests/test_redis_restart.py" in security


def test_redis_memory_flags_match_the_dev_servers_and_the_recipes() -> None:
    """The output-buffer and bulk caps in compose, the dev servers and both of
    docs/operations.md's command lines: the same flags, the same values."""
    from ltx_contract.redis_acl import REDIS_MEMORY_ARGS

    command = [str(c) for c in SERVICES["redis"]["command"]]
    pairs = list(zip(REDIS_MEMORY_ARGS[::2], REDIS_MEMORY_ARGS[1::2], strict=True))
    for flag, value in pairs:
        assert command[command.index(flag) + 1] == value, (flag, command)
    text = (ROOT / "docs" / "operations.md").read_text()
    recipes = re.findall(r"^redis-server (?:.*\\\n)*.*$", text, flags=re.M)  # command lines, with continuations
    assert len(recipes) >= 2
    for text in recipes:
        for flag, value in pairs:
            assert f"{flag} {value}" in text or f"{flag} '{value}'" in text, (flag, text)


def test_redis_runs_with_acl_users_from_secret_files_and_a_memory_cap(tmp_path: Path) -> None:
    """Redis loads the users file the `redis-acl` one-shot writes from the password secrets; `default` is off;
    the worker and the producer log in as users of that file with their password files; no password is
    in any environment block; `maxmemory` is set with `noeviction`."""
    from ltx_contract.redis_acl import command as redis_acl

    redis = SERVICES["redis"]
    command = [substitute(str(c)) for c in redis["command"]]
    aclfile = command[command.index("--aclfile") + 1]
    assert re.fullmatch(r"\d+[kmg]b", command[command.index("--maxmemory") + 1]), command
    init = SERVICES["redis-acl"]
    assert redis["depends_on"]["redis-acl"]["condition"] == "service_completed_successfully"
    volume = next(v for v in init["volumes"] if v.endswith(":/acl"))
    assert f"{volume.split(':')[0]}:/acl:ro" in redis["volumes"] and aclfile.startswith("/acl/")
    assert init["build"]["target"] == "producer" and "ltx_contract/redis_acl.py" in image_files("producer")
    assert init["entrypoint"] == ["python", "-m", "ltx_contract.redis_acl"]
    # run the one-shot's command here, with its secrets as compose mounts them
    args = [substitute(str(a)) for a in init["command"]]
    files = mounted_secrets("redis-acl", tmp_path)
    assert args[args.index("--password-dir") + 1] == "/run/secrets" and args[args.index("--output") + 1] == aclfile
    args[args.index("--password-dir") + 1] = str(tmp_path / "redis-acl")
    args[args.index("--output") + 1] = str(tmp_path / "users.acl")
    assert {Path(p).name for p in files} == {"worker", "admin", environment("producer")["LTX_CLIENT"]}
    result = CliRunner().invoke(redis_acl, args)
    assert result.exit_code == 0, result.output
    users = {line.split()[1]: line for line in (tmp_path / "users.acl").read_text().splitlines()}
    assert users["default"].startswith("user default off")
    for service in ("worker", "producer"):
        env = environment(service)
        assert env["LTX_REDIS_USERNAME"] in users, f"{service} logs in as a user the file does not have"
        assert "LTX_REDIS_PASSWORD" not in env and "@" not in env["LTX_REDIS_URL"], f"{service}: password in env"
        assert env["LTX_REDIS_PASSWORD_FILE"] in mounted_secrets(service, tmp_path / "m")
    assert environment("worker")["LTX_TENANT_IDS"] == "true"
    assert "-@dangerous" in users[environment("worker")["LTX_REDIS_USERNAME"]]
    assert "%R~rq:queue:*" in users[environment("producer")["LTX_REDIS_USERNAME"]]  # a tenant, not the worker
    assert users["admin"].startswith("user admin on #") and "+acl|load" in users["admin"]
    assert {"source": "redis_admin_password", "target": "admin"} in init["secrets"]
    assert "redis_admin_password" in redis["secrets"]  # (operators: ACL LOAD from inside the container)
    health = redis["healthcheck"]["test"]
    assert health[health.index("--user") + 1] in users and users[health[health.index("--user") + 1]].endswith("+ping")
    for service in SERVICES.values():  # passwords only as files
        for name in service.get("environment") or {}:
            assert "PASSWORD" not in name or name.endswith("_FILE"), name


def test_s3_is_pinned_and_binds_only_its_api_beyond_loopback() -> None:
    s3 = SERVICES["s3"]
    image = s3["image"]
    assert not image.endswith(":latest") and re.search(r":\d", image), f"pin the S3 image: {image}"
    if "minio" in image:  # MinIO community images stopped in 2025: only a dated release tag is acceptable
        assert re.search(r":RELEASE\.\d{4}-\d{2}-\d{2}", image), image
    command = [substitute(str(c)) for c in s3["command"]]
    # `weed server` (mini has no separate S3 bind): internals on loopback, the S3 API on every interface of
    # the container (published on the host's loopback only); the real weed's listeners: test_s3_gateway.py
    assert command[:1] == ["server"] and "-s3" in command
    assert "-ip.bind=127.0.0.1" in command and "-ip=127.0.0.1" in command and "-s3.ip.bind=0.0.0.0" in command
    assert "-s3.port.iceberg=0" in command and "-s3.port.lance=0" in command  # they would bind with the S3 API
    assert not any(c.startswith(("-master.ip.bind", "-volume.ip.bind", "-filer.ip.bind")) for c in command)
    assert s3["ports"] == ["127.0.0.1:8333:8333"]
    # the entrypoint builds the identities from secret files: no AWS_* fallback identity, no secret literal
    assert s3["entrypoint"] == ["/bin/sh", "/ltx/s3-start.sh"]
    assert "./scripts/s3-start.sh:/ltx/s3-start.sh:ro" in s3["volumes"]
    assert not any(name.startswith("AWS_") or "SECRET" in name for name in s3["environment"])
    assert set(s3["secrets"]) == {name for name in COMPOSE["secrets"] if name.startswith("s3_")}
    # the bucket is the worker's to create (weed server has no -bucket; the worker identity may)
    assert environment("s3")["LTX_S3_BUCKET"] == environment("worker")["LTX_S3_BUCKET"]
    assert environment("worker")["LTX_S3_CREATE_BUCKET"] == "true"
    assert "healthz" in " ".join(s3["healthcheck"]["test"])


def test_s3_keys_come_from_secret_files_and_the_producer_gets_the_read_only_one(tmp_path: Path) -> None:
    shared = COMPOSE["x-ltx-shared"]
    assert not any("ACCESS_KEY" in name or "SECRET" in name for name in shared), "no S3 key in the shared block"
    for service, who in (("worker", "worker"), ("producer", "producer")):
        env = environment(service)
        assert "LTX_S3_ACCESS_KEY_ID" not in env and "LTX_S3_SECRET_ACCESS_KEY" not in env, service
        names = {env["LTX_S3_ACCESS_KEY_ID_FILE"], env["LTX_S3_SECRET_ACCESS_KEY_FILE"]}
        expected = {f"s3_{who}_access_key", f"s3_{who}_secret_key"}
        assert names == {f"/run/secrets/{n}" for n in expected}, service
        s3_secrets = {e if isinstance(e, str) else e["source"] for e in SERVICES[service]["secrets"]}
        if service == "worker":  # and the producers' read-only key, to sign result URLs with (not its own id)
            presign = {env["LTX_S3_PRESIGN_ACCESS_KEY_ID_FILE"], env["LTX_S3_PRESIGN_SECRET_ACCESS_KEY_FILE"]}
            assert presign == {"/run/secrets/s3_producer_access_key", "/run/secrets/s3_producer_secret_key"}
            expected |= {"s3_producer_access_key", "s3_producer_secret_key"}
        assert {n for n in s3_secrets if n.startswith("s3_")} == expected, service  # and no other service's key
    # every secret compose mounts is a file scripts/secrets.sh makes
    from devstack.s3_gateway import make_secrets

    made = {p.name for p in make_secrets(tmp_path / "secrets").iterdir()}
    assert {Path(spec["file"]).name for spec in COMPOSE["secrets"].values()} == made
    assert all(spec["file"].startswith("./secrets/") for spec in COMPOSE["secrets"].values())
    assert "/secrets/" in (ROOT / ".gitignore").read_text().splitlines()


# ==== the worker: settings fields, GPUs, groups =========================================================


def test_every_worker_variable_is_a_settings_field() -> None:
    env = environment("worker")
    assert env, "the worker sets no environment"
    fields = set(WorkerSettings.model_fields)
    for name in env:
        assert name.startswith("LTX_"), f"{name}: the worker is configured only through LTX_* settings"
        assert name.removeprefix("LTX_").lower() in fields, f"{name} is not a WorkerSettings field"


def test_worker_defaults_are_valid_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in list(os.environ):
        if name.startswith("LTX_"):
            monkeypatch.delenv(name)
    for name, value in service_env_here("worker", tmp_path).items():
        monkeypatch.setenv(name, value)
    settings = load_worker_settings()
    assert settings.groups == ["0,1,2,3", "4,5,6,7"]  # two groups, from the environment
    assert settings.redis_url == "redis://redis:6379/0"
    assert settings.s3_endpoint_url == "http://s3:8333"
    assert settings.metrics_port == 9400
    assert str(settings.spool_dir) == "/spool"
    assert settings.s3_access_key_id is not None and settings.s3_secret_access_key is not None
    # the worker holds the admission limits itself, with the same values the producer checks early
    assert settings.depth_cap == 200 and settings.quota is None
    for name in ("LTX_MAX_QUEUE_DEPTH", "LTX_CLIENT_QUOTA"):
        assert environment("worker")[name] == environment("producer")[name]


def test_worker_reserves_gpus_and_stops_warm() -> None:
    worker = SERVICES["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert worker["shm_size"]
    assert worker["stop_grace_period"]
    assert worker["build"]["target"] in stages()
    assert any(v.startswith("spool:") for v in worker["volumes"])
    health = worker["healthcheck"]["test"]
    assert health[1] == "ltx-worker" and health[1] in SCRIPTS
    from worker.cli import main as worker_cli

    result = CliRunner().invoke(worker_cli, [*health[2:], "--help"])
    assert result.exit_code == 0, result.output


def test_producer_variables_are_settings_fields(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env = environment("producer")
    fields = set(ProducerSettings.model_fields)
    for name in env:
        assert name.removeprefix("LTX_").lower() in fields, f"{name} is not a ProducerSettings field"
    for name in list(os.environ):
        if name.startswith("LTX_"):
            monkeypatch.delenv(name)
    for name, value in service_env_here("producer", tmp_path).items():
        monkeypatch.setenv(name, value)
    settings = load_producer_settings()
    assert (settings.max_queue_depth, settings.client_quota, settings.client) == (200, 0, "compose")
    assert settings.tenant_ids and settings.redis_username == "compose"  # a tenant user: ids compose-<id>
    assert settings.has_s3_credentials  # fetch reads from s3:8333 inside compose, not the public URL


# ==== images, commands and files exist ==================================================================


def test_build_targets_and_copied_files_exist() -> None:
    for name, service in SERVICES.items():
        build = service.get("build")
        if not build:
            continue
        assert (ROOT / build["context"] / build["dockerfile"]).is_file(), name
        assert build["target"] in stages(), f"{name}: no stage {build['target']}"
    for line in re.findall(r"^COPY\s+(?!--from)(.+)$", DOCKERFILE, re.M):
        *sources, _dest = line.split()
        for source in sources:
            assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"


def test_entrypoints_are_real_commands() -> None:
    assert '["ltx-worker"]' in stage_text("worker") and "ltx-worker" in SCRIPTS
    assert SCRIPTS["ltx-worker"] == "worker.cli:main"
    assert '["python", "-m", "producer"]' in stage_text("producer")
    assert (ROOT / "producer" / "__main__.py").is_file()
    dashboard = stage_text("dashboard")
    assert re.search(r"rq-dashboard==\d", dashboard) and '["rq-dashboard"]' in dashboard
    # the dashboard logs in as the worker user, its password read from the secret file at start
    dash = SERVICES["dashboard"]
    assert "environment" not in dash or "RQ_DASHBOARD_REDIS_URL" not in dash["environment"]
    script = dash["entrypoint"][-1]
    assert dash["entrypoint"][:2] == ["/bin/sh", "-c"] and script.endswith("exec rq-dashboard --json")
    assert 'redis://worker:$$(cat /run/secrets/redis_password)@redis:6379/0"' in script
    assert {"source": "redis_worker_password", "target": "redis_password"} in dash["secrets"]


def test_bind_mounts_exist() -> None:
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("./"):
                target = ROOT / source
                assert target.exists() or source == "./out", f"{name} mounts {source}, which does not exist"


def test_producer_image_file_list_is_enough_and_light(tmp_path: Path) -> None:
    """Copy exactly what the producer stage copies into an empty directory and import the CLI from there:
    it must work and pull in neither torch, nor the worker, nor ltx_mgpu's engine."""
    for path, (_, src) in image_files("producer").items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, tmp_path / path)
    code = (
        "import sys\n"
        "sys.path = [p for p in sys.path if 'site-packages' in p or p.endswith('.zip') or 'lib/python' in p]\n"
        # the editable install's finder would serve any module the image lacks from the checkout
        "sys.meta_path = [f for f in sys.meta_path if '__editable__' not in getattr(f, '__module__', '')]\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "from producer.cli import cli\nimport producer.client, producer.backfill, ltx_contract.redis_acl\n"
        "assert all(m.__file__.startswith(sys.path[0]) for n, m in sys.modules.items() if n.startswith('ltx_')), "
        "[m.__file__ for n, m in sys.modules.items() if n.startswith('ltx_')]\n"
        "assert producer.client.__file__.startswith(sys.path[0]), producer.client.__file__\n"
        "shared = lambda m: m in ('ltx_mgpu', 'ltx_mgpu.errors') or m.split('.')[:2] == ['ltx_mgpu', 'spec']\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ltx_mgpu', 'worker') and not shared(m))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def producer_image_starts(root: Path = ROOT) -> list[str]:
    """What runs in the producer image: every module of producer/ (the CLI, `python -m producer`) and the
    module each compose service built from that image runs (`python -m ...`: the ACL and proxy one-shots)."""
    modules = [".".join(p.relative_to(root).with_suffix("").parts) for p in sorted((root / "producer").rglob("*.py"))]
    built_on = [s for s in SERVICES.values() if s.get("build", {}).get("target") == "producer"]
    one_shots = [s["entrypoint"][2] for s in built_on if s.get("entrypoint", [])[:2] == ["python", "-m"]]
    assert one_shots, "no compose service runs a module of the producer image: the list below checks nothing"
    return [m.removesuffix(".__init__") for m in modules] + one_shots


def image_gaps(root: Path, files: dict[str, tuple[str, Path]], starts: list[str]) -> tuple[list[str], list[str]]:
    """(the files of `root` that the modules `starts` can run need and the image's `files` lack, the COPY
    sources of Python files none of them needs): the image must hold what runs, and nothing else of ours."""
    needed = {path.relative_to(root).as_posix() for path in import_closure(root, starts).values()}
    used = {files[path][0] for path in needed & files.keys()}
    python = {source for source, src in files.values() if src.suffix == ".py"}
    return sorted(needed - files.keys()), sorted(python - used)


def test_producer_image_holds_every_module_the_producer_runs_and_nothing_else(tmp_path: Path) -> None:
    """The producer image used to copy five cherry-picked parts of the worker, and a module the producer
    reached only lazily (or through the worker) could be missing without any import test noticing. Its file
    list, read from the Dockerfile, must hold every module of the checkout that the producer and the one-shots
    built from it can import (transitively, lazy imports too), and no COPY line of Python that none of them
    needs: the client contract, the request specs and the producer, nothing of the worker."""
    files = image_files("producer")
    assert image_gaps(ROOT, files, producer_image_starts()) == ([], [])
    assert {path.split("/")[0] for path in files if path.endswith(".py")} == {"producer", "ltx_contract", "ltx_mgpu"}
    engine = {path for path in files if path.startswith("ltx_mgpu/") and not path.startswith("ltx_mgpu/spec/")}
    assert engine == {"ltx_mgpu/__init__.py", "ltx_mgpu/errors.py"}
    # Planted: a lazy import of the worker in a producer module; a COPY line dropped; one added.
    for package in ("ltx_contract", "ltx_mgpu", "worker"):
        (tmp_path / package).symlink_to(ROOT / package)
    shutil.copytree(ROOT / "producer", tmp_path / "producer", ignore=shutil.ignore_patterns("__pycache__"))
    with (tmp_path / "producer" / "display.py").open("a") as f:
        f.write("\n\ndef _planted():\n    from worker.jobs import poison\n")
    missing, unused = image_gaps(tmp_path, image_files("producer", tmp_path), producer_image_starts(tmp_path))
    assert {"worker/__init__.py", "worker/jobs/poison.py"} <= set(missing) and unused == []
    spec = "COPY ltx_mgpu/spec ./ltx_mgpu/spec\n"  # (in the producer stage only)
    missing, _ = image_gaps(ROOT, image_files("producer", ROOT, DOCKERFILE.replace(spec, "")), producer_image_starts())
    assert "ltx_mgpu/spec/bounds.py" in missing
    added = DOCKERFILE.replace(spec, spec + "COPY worker ./worker\n")
    assert image_gaps(ROOT, image_files("producer", ROOT, added), producer_image_starts()) == ([], ["worker"])


def test_env_example_documents_what_compose_needs() -> None:
    example = (ROOT / "examples" / ".env.example").read_text()
    documented = set(re.findall(r"^#?\s*(\w+)=", example, re.M))
    text = (ROOT / "docker-compose.yml").read_text()
    required = {m.group(1) for m in _VAR.finditer(text) if m.group(2) in (":?", "?")}
    assert required <= documented, f"required but not in .env.example: {required - documented}"
    referenced = {m.group(1) for m in _VAR.finditer(text)}
    assert referenced <= documented, f"undocumented compose variables: {referenced - documented}"
    worker_fields, producer_fields = set(WorkerSettings.model_fields), set(ProducerSettings.model_fields)
    for name in documented:
        if name.startswith("LTX_"):
            field = name.removeprefix("LTX_").lower()
            assert field in worker_fields | producer_fields, f".env.example: {name} is no settings field"


def test_operations_recipe_without_docker_matches_compose(tmp_path: Path) -> None:
    """Regression: docs/operations.md's "Without Docker" covered Redis and the worker only (the SeaweedFS
    command and its AWS_* identity had to be copied out of docker-compose.yml), and its public-endpoint
    example broke presigned URLs when copied as is."""
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text[text.index("Without Docker") :]
    recipe = section[section.index("```bash") + 7 : section.index("```", section.index("```bash") + 7)]
    commands = [line for line in recipe.replace("\\\n", " ").splitlines() if line and not line.startswith("#")]
    start = next(c for c in commands if "scripts/s3-start.sh" in c)
    weed_args = start.split()[start.split().index("scripts/s3-start.sh") + 1 :]
    compose_args = [str(a) for a in SERVICES["s3"]["command"]]
    flag = lambda a: a.split("=")[0]  # noqa: E731
    assert [flag(a) for a in weed_args] == [flag(a) for a in compose_args], (weed_args, compose_args)
    assert [a for a in weed_args if not a.startswith("-dir=")] == [a for a in compose_args if not a.startswith("-dir=")]
    settings_of_start = dict(part.split("=", 1) for part in start.split() if "=" in part and not part.startswith("-"))
    secrets_dir = settings_of_start["LTX_S3_SECRETS"]
    assert any(c.startswith("scripts/secrets.sh " + secrets_dir) for c in commands)
    exported = dict(part.split("=", 1) for c in commands if c.startswith("export") for part in c.split()[1:])
    assert exported["LTX_S3_ACCESS_KEY_ID_FILE"] == f"{secrets_dir}/s3_worker_access_key"
    assert exported["LTX_S3_SECRET_ACCESS_KEY_FILE"] == f"{secrets_dir}/s3_worker_secret_key"
    assert exported["LTX_S3_ENDPOINT_URL"].endswith(":8333")
    for name in exported:
        assert name.removeprefix("LTX_").lower() in WorkerSettings.model_fields, name
    # whatever the recipe sets as it stands must be valid settings (with the secret files made)
    from devstack.s3_gateway import make_secrets

    made = make_secrets(tmp_path / "secrets")
    exported = {k: v.replace(secrets_dir, str(made)) for k, v in exported.items()}
    load_worker_settings(**{k.removeprefix("LTX_").lower(): v for k, v in exported.items()})
    # a public endpoint set as is must be the endpoint clients reach the same S3 API at (not a made-up host)
    assert "LTX_S3_PUBLIC_ENDPOINT_URL" not in exported
    assert "example.com" not in recipe
