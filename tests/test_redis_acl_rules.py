"""Redis ACL users, secrets from files and TLS, without a server: the users file `ltx-worker redis-acl`
writes (who may do what, passwords as hashes only), tenant ids and the owner check, and the settings that
read the Redis user, its password file and the TLS files. `tests/test_redis_acl.py` runs a real stack with
them on.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from pathlib import Path

import pytest
from click.testing import CliRunner

from ltx_contract.keys import check_tenant_name, job_tenant, tenant_job_id
from ltx_contract.redis_acl import ACL_PASSWORD_ENV_PREFIX, AclUsers, generate, password_for, render_acl
from tests.support.acl_stack import USERS, write_passwords
from worker.rq.loop.job_class import RefusedJob, check_job_owner

# ==== the generator (no server) =========================================================================


def test_acl_file_turns_default_off_and_holds_only_password_hashes(tmp_path: Path) -> None:
    pw = write_passwords(tmp_path / "secrets")
    text = generate(AclUsers(tenants=("alice", "bob"), ping_user="health"), password_dir=tmp_path / "secrets")
    lines = text.splitlines()
    # off with no password: no client logs in as `default` (its permissions are for the AOF replay only,
    # tests/test_redis_restart.py)
    assert lines[0].startswith("user default off resetpass ") and "nopass" not in lines[0] and ">" not in lines[0]
    by_user = {line.split()[1]: line for line in lines}
    assert set(by_user) == {"default", "worker", "alice", "bob", "health"}
    for user in USERS:
        assert pw[user] not in text
        assert f"#{hashlib.sha256(pw[user].encode()).hexdigest()}" in by_user[user]
    assert "-@dangerous" in by_user["worker"] and "&rq:*" in by_user["worker"]
    alice = by_user["alice"]
    assert "~rq:job:alice-*" in alice and "~ltx:job:alice-*" in alice and "~ltx:producer:client:alice:jobs" in alice
    assert "&" not in alice.replace("&rq", "") and "resetchannels" in alice  # no pubsub channel at all
    # only its own queues, never `rq:queues` (the workers register what they serve), no other database
    assert "(+rpush +lpush %W~rq:queue:*:t:alice)" in alice and "+publish" not in alice and "+sadd" not in alice
    assert "-select" in alice
    assert by_user["health"].endswith("nopass resetkeys resetchannels -@all +ping")
    assert "admin" not in by_user  # (only when asked for: the CLI asks by default)


def test_the_admin_user_reloads_and_reads_the_acls_and_touches_no_data() -> None:
    rules = render_acl(AclUsers(admin="ops"), {"worker": "w" * 16, "ops": "o" * 16}).splitlines()[-1]
    assert rules.startswith(f"user ops on #{hashlib.sha256(b'o' * 16).hexdigest()} resetkeys resetchannels -@all ")
    assert {"+acl|load", "+acl|log"} <= set(rules.split())
    assert "~" not in rules and "&" not in rules and "+acl " not in rules and "+acl|setuser" not in rules


def test_generator_refuses_names_that_could_share_keys_or_clash() -> None:
    for bad in ("alice-x", "a.b", "x" * 33, "", "a*"):
        with pytest.raises(ValueError, match="tenant name|user name"):
            AclUsers(tenants=(bad,))
    with pytest.raises(ValueError, match="differ"):
        AclUsers(worker="alice", tenants=("alice",))
    with pytest.raises(ValueError, match="default"):
        AclUsers(worker="default")
    assert check_tenant_name("alice_2") == "alice_2"


def test_passwords_come_from_files_then_environment_never_short(tmp_path: Path) -> None:
    (tmp_path / "alice").write_text("from-the-file-0123456789\n")
    env = {f"{ACL_PASSWORD_ENV_PREFIX}BOB": "from-the-env-0123456789", f"{ACL_PASSWORD_ENV_PREFIX}ALICE": "ignored"}
    assert password_for("alice", password_dir=tmp_path, environ=env) == "from-the-file-0123456789"
    assert password_for("bob", password_dir=tmp_path, environ=env) == "from-the-env-0123456789"
    with pytest.raises(ValueError, match="no password for Redis user 'carol'"):
        password_for("carol", password_dir=tmp_path, environ=env)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        password_for("empty", password_dir=tmp_path, environ={})
    with pytest.raises(ValueError, match="shorter than 16"):
        render_acl(AclUsers(), {"worker": "short"})


def test_cli_writes_the_file_and_takes_no_password_argument(tmp_path: Path) -> None:
    from worker.cli import main

    pw = write_passwords(tmp_path / "secrets")
    out = tmp_path / "users.acl"
    args = ["redis-acl", "--tenant", "alice", "--tenant", "bob", "--password-dir", str(tmp_path / "secrets")]
    missing = CliRunner().invoke(main, [*args, "--output", str(out)])  # the admin user is on by default
    assert missing.exit_code == 2 and "no password for Redis user 'admin'" in missing.output
    (tmp_path / "secrets" / "admin").write_text(secrets.token_urlsafe(24))
    result = CliRunner().invoke(main, [*args, "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text().count("\nuser ") == 4 and pw["alice"] not in out.read_text()
    assert out.read_text().splitlines()[-1].startswith("user admin on #") and "+acl|load" in out.read_text()
    without = CliRunner().invoke(main, [*args, "--admin-user", ""])
    assert without.exit_code == 0 and "user admin" not in without.output and without.output.count("\nuser ") == 3
    assert oct(out.stat().st_mode & 0o777) == "0o644"
    help_text = CliRunner().invoke(main, ["redis-acl", "--help"]).output
    assert "--password " not in help_text and "--password=" not in help_text
    bad = CliRunner().invoke(main, ["redis-acl", "--tenant", "alice-x", "--password-dir", str(tmp_path / "secrets")])
    assert bad.exit_code == 2 and "tenant name" in bad.output


def test_tenant_ids_and_owner_check() -> None:
    assert tenant_job_id("alice", "42") == "alice-42" and tenant_job_id("alice", "alice-42") == "alice-42"
    assert job_tenant("alice-42") == "alice" and job_tenant("42") is None and job_tenant("a.b-1") is None
    check_job_owner("alice-42", {"client": "alice"})
    for job_id, meta in (("alice-42", {"client": "bob"}), ("alice-42", {}), ("42", {"client": "alice"})):
        with pytest.raises(RefusedJob, match="tenant"):
            check_job_owner(job_id, meta)


# ==== settings: user, password file, TLS files ===========================================================


def test_settings_read_the_password_file_and_never_show_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ltx_contract.redis_conn import connection_kwargs
    from producer.settings import ProducerSettings
    from worker.cli import main
    from worker.settings import WorkerSettings

    for name in ("LTX_REDIS_URL", "LTX_REDIS_PASSWORD", "LTX_CLIENT", "LTX_OPERATOR", "LTX_TENANT_IDS"):
        monkeypatch.delenv(name, raising=False)
    secret = tmp_path / "pw"
    secret.write_text("s3cret-from-a-file\n")
    monkeypatch.setenv("LTX_REDIS_USERNAME", "alice")
    monkeypatch.setenv("LTX_REDIS_PASSWORD_FILE", str(secret))
    worker = WorkerSettings()
    assert connection_kwargs(worker) == {"username": "alice", "password": "s3cret-from-a-file"}
    shown = CliRunner().invoke(main, ["settings"])
    assert shown.exit_code == 0 and "s3cret" not in shown.output
    assert json.loads(shown.output)["redis_password"] == "**********"
    producer = ProducerSettings()
    assert (producer.client, producer.tenant_ids) == ("alice", True)  # implied by the Redis user
    assert ProducerSettings(operator=True).tenant_ids is False
    with pytest.raises(ValueError, match="tenant name"):
        ProducerSettings(client="alice.smith")
    monkeypatch.setenv("LTX_REDIS_URL", "redis://u:pw-in-url@r:6379/0")
    with pytest.raises(ValueError, match="both in LTX_REDIS_URL") as err:
        WorkerSettings()
    assert "s3cret" not in str(err.value) and "pw-in-url" not in str(err.value)  # (inputs hidden in errors)


def test_tls_files_need_rediss_and_become_ssl_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ltx_contract.redis_conn import connection_kwargs
    from worker.settings import WorkerSettings

    for name in ("LTX_REDIS_URL", "LTX_REDIS_USERNAME", "LTX_REDIS_PASSWORD", "LTX_REDIS_PASSWORD_FILE"):
        monkeypatch.delenv(name, raising=False)
    ca = tmp_path / "ca.crt"
    ca.write_text("x")
    with pytest.raises(ValueError, match="rediss://"):
        WorkerSettings(redis_ca_file=ca)
    with pytest.raises(ValueError, match="not a readable file"):
        WorkerSettings(redis_url="rediss://r:6380/0", redis_ca_file=tmp_path / "missing.crt")
    with pytest.raises(ValueError, match="set both or neither"):
        WorkerSettings(redis_url="rediss://r:6380/0", redis_cert_file=ca)
    kwargs = connection_kwargs(WorkerSettings(redis_url="rediss://r:6380/0", redis_ca_file=ca))
    assert kwargs["ssl_ca_certs"] == str(ca) and kwargs["ssl_cert_reqs"].name == "CERT_REQUIRED"
