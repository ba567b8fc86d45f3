"""Redis ACL users, secrets from files and TLS on a real stack (the generator's rules without a server:
`tests/test_redis_acl_rules.py`).

The stack: one redis-server with the ACL file `ltx-worker redis-acl` writes (users `worker`, `alice`, `bob`;
`default` off), listening on TLS only with a throwaway CA (`devstack.dev_secure`); one `ltx-worker one` (CPU
fleet, fault runner) logged in as `worker` over `rediss://` with its password from a file and tenant ids
on; real SeaweedFS. Tenants use `ProducerClient` (and the CLI) as their own users: submit, watch, ls,
status, cancel (queued and running) and fetch work end to end; each attack a tenant could make with raw
Redis access is refused by Redis itself. The last test reads Redis's `ACL LOG`: the worker needed nothing
it was denied.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from ltx_contract.keys import REFUSALS_KEY
from ltx_contract.redis_acl import AclUsers, generate
from tests.support.acl_stack import Stack, acl_worker, small_request, tenant_enqueue, wait_client_state, write_passwords
from tests.support.runners import output_bytes
from tests.support.wait import wait_for
from tests.support.workers import events, wait_ready

# ==== the stack: TLS + ACL Redis, a worker as `worker`, tenants as themselves ==============================


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: Any) -> Any:
    from devstack.dev_secure import SecureRedisServer
    from devstack.dev_servers import find_redis_server

    if find_redis_server() is None:
        pytest.skip("redis-server not found")
    tmp = tmp_path_factory.mktemp("acl")
    secrets_dir = tmp / "secrets"
    write_passwords(secrets_dir)
    acl = generate(AclUsers(tenants=("alice", "bob")), password_dir=secrets_dir)
    server = SecureRedisServer(acl=acl, tls=True).start()
    ready = lambda admin, name, proc: wait_ready(admin, name, 1, 120, proc)  # noqa: E731
    with acl_worker(server, s3_server, tmp, secrets_dir, ready, redis_ca_file=server.ca_file,
                    tenants="alice,bob") as (proc, queue, name):  # fmt: skip
        st = Stack(server, s3_server, proc, queue, name, secrets_dir)
        try:
            yield st
        finally:
            st.admin.close()


def test_a_tenant_submits_watches_lists_and_fetches_its_job_over_tls(stack: Stack, tmp_path: Path) -> None:
    with stack.producer("alice") as alice:
        job = alice.submit(small_request(seed=7), job_id="first")
        assert job.id == "alice-first"
        seen = [e.type for e in alice.follow("first", deadline=time.monotonic() + 60)]
        assert "progress" in seen and seen[-1] == "state"
        info = alice.status("alice-first")
        assert info.state == "uploaded" and info.meta["client"] == "alice"
        listed = alice.list_jobs([stack.queue], 20)
        assert "alice-first" in [i.job_id for i in listed["recently ended"]]
        stats = alice.stats(queues=[stack.queue])
        assert [w.name for w in stats.workers] and stats.queues[0].name == f"{stack.queue}:t:alice"
        fetched = alice.fetch("first", tmp_path / "v.mp4")
        assert (tmp_path / "v.mp4").read_bytes() == output_bytes(7, 4096) and fetched.sha256 == info.result["sha256"]
    with stack.producer("bob") as bob:  # the producer's own-jobs rule on top: bob does not see alice's job
        from producer.client import JobNotFound

        with pytest.raises(JobNotFound):
            bob.status("alice-first")


def test_the_cli_runs_as_a_tenant_from_environment_settings(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    from producer.cli import cli

    for key, value in {"LTX_REDIS_URL": stack.server.url, "LTX_REDIS_USERNAME": "bob", "LTX_QUEUES": stack.queue,
                       "LTX_REDIS_PASSWORD_FILE": str(stack.secrets / "bob"),
                       "LTX_REDIS_CA_FILE": str(stack.server.ca_file)}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("LTX_CLIENT", raising=False)
    monkeypatch.delenv("LTX_OPERATOR", raising=False)
    with stack.producer("bob") as bob:
        bob.submit(small_request(), job_id="cli")
        wait_client_state(bob, "cli", {"uploaded"}, stack)
    result = CliRunner().invoke(cli, ["status", "cli", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["job_id"] == "bob-cli"


def test_a_tenant_cancels_its_queued_job_without_publish_or_queue_writes(stack: Stack) -> None:
    with stack.producer("alice") as alice:
        alice.submit(small_request("t step_s=0.3", steps=12), job_id="busy")
        wait_client_state(alice, "busy", {"rendering"}, stack)
        alice.submit(small_request(), job_id="waiting")
        assert alice.cancel("waiting") == "cancelled"
        assert alice.status("waiting").state == "cancelled"
        wait_client_state(alice, "busy", {"uploaded"}, stack)
        # the worker dequeued it after `busy`, recorded it and never ran it
        wait_for(lambda: stack.admin.lpos(f"rq:queue:{stack.queue}:t:alice", "alice-waiting") is None, 30, "dequeued")
        time.sleep(0.5)
        states = [e["state"] for e in events(stack.admin, "alice-waiting") if e["type"] == "state"]
        assert "started" not in states and states.count("cancelled") == 1, states
        assert stack.admin.zscore(f"rq:canceled:{stack.queue}:t:alice", "alice-waiting") is not None
        assert stack.admin.llen(f"rq:queue:{stack.queue}:t:alice:intermediate") == 0
        assert stack.admin.hget("rq:job:alice-waiting", "status") == b"canceled"
    assert stack.fleet_alive()


def test_a_tenant_backfill_re_runs_its_cancelled_job_under_the_same_id(stack: Stack, tmp_path: Path) -> None:
    """`producer backfill` forgets an ended job before enqueueing it again; RQ's `job.delete()` also edits the
    shared registries, which a tenant may not write: the tenant path deletes only its own keys."""
    from producer.backfill import Backfill
    from producer.models import content_job_id
    from producer.request_file import LoadedRequest

    request = small_request(f"t backfill {uuid.uuid4().hex[:6]}")
    job_id = content_job_id(request)
    with stack.producer("alice") as alice:
        alice.submit(small_request("t step_s=0.3", steps=12), job_id="busy-bf")
        wait_client_state(alice, "busy-bf", {"rendering"}, stack)
        alice.submit(request, job_id=job_id)
        assert alice.cancel(job_id) == "cancelled"
        wait_client_state(alice, "busy-bf", {"uploaded"}, stack)
        run = Backfill(alice, [LoadedRequest(request, "f:1", 0)], manifest=tmp_path / "m.jsonl", concurrency=1)
        denied = stack.denial_counts("alice")
        summary = run.run()
        new = {d: n - denied.get(d, 0) for d, n in stack.denial_counts("alice").items() if n != denied.get(d)}
        assert set(new) <= {"command: info"}, new  # it tried no write on shared keys (RQ's job.delete did)
        assert (summary.enqueued, summary.uploaded, summary.failed) == (1, 1, 0), summary
        assert alice.status(job_id).state == "uploaded"
    assert stack.fleet_alive()


def test_a_tenant_cancels_its_running_job_and_the_fleet_survives(stack: Stack) -> None:
    with stack.producer("alice") as alice:
        alice.submit(small_request("t step_s=0.3", steps=40), job_id="long")
        wait_client_state(alice, "long", {"rendering"}, stack)
        assert alice.cancel("long") == "stop_requested"
        wait_client_state(alice, "long", {"cancelled"}, stack, timeout=30)
        # The state comes from the job's meta, written as the render ends; RQ's status from the worker's end
        # handling right after (two writes): a client may see `cancelled` a moment before RQ says `canceled`.
        wait_for(lambda: alice.status("long").rq_status == "canceled", 10, "RQ records the cancel as canceled")
        states = [e["state"] for e in events(stack.admin, "alice-long") if e["type"] == "state"]
        assert "uploaded" not in states
    assert stack.fleet_alive()


# ---- attacks: one per way a tenant with raw Redis access used to hurt others -----------------------------


def test_a_tenant_cannot_publish_rq_commands(stack: Stack) -> None:
    alice = stack.raw("alice")
    channel = f"rq:pubsub:{wait_ready(stack.admin, stack.name, 1, 30)[0]['worker']}"
    for payload in ({"command": "shutdown"}, {"command": "stop-job", "job_id": "bob-x"}):
        with pytest.raises(redis.exceptions.NoPermissionError):
            alice.publish(channel, json.dumps(payload))
    with pytest.raises(redis.exceptions.NoPermissionError):  # (nor listen to others' commands)
        stack.raw("alice").execute_command("SUBSCRIBE", channel)
    assert stack.fleet_alive()


def test_a_tenant_cannot_edit_or_delete_another_tenants_job_or_events(stack: Stack) -> None:
    with stack.producer("bob") as bob:
        bob.submit(small_request(), job_id="mine")
        wait_client_state(bob, "mine", {"uploaded"}, stack)
    alice = stack.raw("alice")
    attacks = [
        lambda: alice.hset("rq:job:bob-mine", "meta", "{}"),
        lambda: alice.hset("rq:job:bob-mine", "ltx_cancel_requested", "1"),
        lambda: alice.delete("rq:job:bob-mine"),
        lambda: alice.expire("rq:job:bob-mine", 1),
        lambda: alice.xadd("ltx:job:bob-mine:events", {"type": "state"}),
        lambda: alice.delete("ltx:job:bob-mine:events"),
        lambda: alice.hset("rq:job:bob-new", "status", "queued"),  # no job under bob's name either
        lambda: alice.zadd("ltx:producer:client:bob:jobs", {"x": 1}),
        lambda: alice.rename("rq:job:bob-mine", "rq:job:alice-stolen"),
    ]
    for attack in attacks:
        with pytest.raises(redis.exceptions.NoPermissionError):
            attack()
    assert stack.admin.hget("rq:job:bob-mine", "status") == b"finished"


def test_a_tenant_cannot_read_another_tenants_prompt_result_or_events(stack: Stack) -> None:
    """Reads were open to every tenant (`ls` and `stats` read shared registries), so any tenant could read
    every other tenant's prompts, results and presigned URLs; now only ids and counts are shared, and the
    producer's own listing never asks for another tenant's hash."""
    with stack.producer("bob") as bob:
        bob.submit(small_request("bob's secret prompt"), job_id="private")
        wait_client_state(bob, "private", {"uploaded"}, stack)
    alice = stack.raw("alice")
    reads = [
        lambda: alice.hgetall("rq:job:bob-private"),
        lambda: alice.hget("rq:job:bob-private", "meta"),
        lambda: alice.hget("rq:job:bob-private", "data"),
        lambda: alice.xrange("ltx:job:bob-private:events"),
        lambda: alice.xrevrange("rq:results:bob-private"),
        lambda: alice.zrange("ltx:producer:client:bob:jobs", 0, -1),
        lambda: alice.lrange(REFUSALS_KEY, 0, -1),
    ]
    for read in reads:
        with pytest.raises(redis.exceptions.NoPermissionError):
            read()
    # what alice still sees: that a job exists, not what it is
    assert b"bob-private" in alice.zrange(f"rq:finished:{stack.queue}:t:bob", 0, -1)
    with stack.producer("alice") as client:
        listed = [i.job_id for rows in client.list_jobs([stack.queue], 50).values() for i in rows]
        assert "bob-private" not in listed
        assert client.stats(queues=[stack.queue]).queues


def test_a_tenant_cannot_remove_trim_or_steal_from_a_queue(stack: Stack) -> None:
    key = f"rq:queue:{stack.queue}"
    alice = stack.raw("alice")
    for attack in (lambda: alice.delete(key), lambda: alice.lrem(key, 0, "bob-x"), lambda: alice.ltrim(key, 0, 0),
                   lambda: alice.lpop(key), lambda: alice.lmove(key, "rq:queue:mine"), lambda: alice.lset(key, 0, "x"),
                   lambda: alice.srem("rq:queues", key), lambda: alice.delete("rq:queues")):  # fmt: skip
        with pytest.raises(redis.exceptions.NoPermissionError):
            attack()


def test_a_tenant_pushes_only_onto_its_own_queue_and_stays_in_database_0(stack: Stack) -> None:
    """A security review found that tenants could push any id onto the shared queue (and RQ's intermediate
    list), add names to `rq:queues` without bound and `SELECT` databases 1-15. Now: only
    `<queue>:t:<self>`; workers register the queues they serve."""
    alice, shared = stack.raw("alice"), f"rq:queue:{stack.queue}"
    for attack in (lambda: alice.rpush(shared, "bob-x"), lambda: alice.lpush(shared, "bob-x"),
                   lambda: alice.rpush(f"{shared}:intermediate", "x"), lambda: alice.rpush(f"{shared}:t:bob", "x"),
                   lambda: alice.rpush(f"{shared}:t:alice:intermediate", "x"),
                   lambda: alice.sadd("rq:queues", "rq:queue:junk"), lambda: alice.execute_command("SELECT", "1"),
                   lambda: alice.execute_command("SWAPDB", "0", "1")):  # fmt: skip
        with pytest.raises(redis.exceptions.NoPermissionError):
            attack()
    assert alice.rpush(f"{shared}:t:alice", "alice-junk") == 1  # (dropped by the worker: test_tenant_queues.py)
    registered = {m.decode() for m in stack.admin.smembers("rq:queues")}
    assert {shared, f"{shared}:t:alice", f"{shared}:t:bob"} <= registered and "rq:queue:junk" not in registered


def test_neither_a_tenant_nor_the_worker_can_run_admin_commands(stack: Stack) -> None:
    attacks = [("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "SET", "maxmemory", "1"), ("CONFIG", "GET", "*"),
               ("SHUTDOWN", "NOSAVE"), ("DEBUG", "SLEEP", "0"), ("ACL", "LIST"), ("KEYS", "*"),
               ("REPLICAOF", "NO", "ONE")]  # fmt: skip
    for user in ("alice", "worker"):
        conn = stack.raw(user)
        for attack in attacks:
            with pytest.raises(redis.exceptions.NoPermissionError):
                conn.execute_command(*attack)
    assert stack.admin.ping()


def test_without_credentials_or_tls_redis_refuses(stack: Stack) -> None:
    anonymous = redis.Redis(host="127.0.0.1", port=stack.server.port, ssl=True, ssl_ca_certs=str(stack.server.ca_file))
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.ping()
    plain = redis.Redis(host="127.0.0.1", port=stack.server.port, socket_timeout=3, username="alice",
                        password=(stack.secrets / "alice").read_text().strip())  # fmt: skip
    with pytest.raises(redis.exceptions.ConnectionError):
        plain.ping()
    untrusted = redis.Redis.from_url(stack.server.url, socket_timeout=3)  # the system CAs: not ours
    with pytest.raises(redis.exceptions.ConnectionError, match="certificate verify failed"):
        untrusted.ping()


def test_a_worker_with_an_untrusted_certificate_or_a_wrong_password_stops_with_a_clear_error(stack: Stack) -> None:
    """Configuration errors, not an endless wait for Redis: the worker process exits 2 with one line."""
    from worker.runtime.process import wait_for_redis
    from worker.settings import SettingsError, WorkerSettings

    url, ca = stack.server.url, stack.server.ca_file
    # (in the producer's words: ltx_contract.redis_conn.redis_problem)
    untrusted = "TLS with Redis at .* failed .*CERTIFICATE_VERIFY_FAILED.*check LTX_REDIS_CA_FILE"
    with pytest.raises(SettingsError, match=untrusted):
        wait_for_redis(
            WorkerSettings(redis_url=url, redis_username="worker", redis_password_file=stack.secrets / "worker")
        )
    with pytest.raises(SettingsError, match="Redis authentication failed at .*check LTX_REDIS_USERNAME") as err:
        wait_for_redis(
            WorkerSettings(redis_url=url, redis_username="worker", redis_password="wrong-pw-0123", redis_ca_file=ca)
        )
    assert "wrong-pw" not in str(err.value)


def test_a_tenant_job_under_another_clients_name_is_refused(stack: Stack) -> None:
    """alice may write `rq:job:alice-*` and so could record bob as the owner (his quota, his `ls`): the
    worker (tenant ids on) refuses it, and stays warm."""
    job = tenant_enqueue(stack.raw("alice"), f"{stack.queue}:t:alice",
                         {"prompt": "t", "width": 64, "height": 64, "num_frames": 9}, job_id="alice-forged",
                         meta={"client": "bob"})  # fmt: skip
    wait_for(lambda: (job.get_meta(refresh=True) or {}).get("state") == "failed", 30, "refused",
             on_fail=stack.worker.log_tail)  # fmt: skip
    error = job.get_meta(refresh=True)["error"]
    assert error["reason"] == "invalid_request" and "tenant" in error["message"]
    assert stack.fleet_alive()


def test_zz_the_worker_was_never_denied_a_command(stack: Stack) -> None:
    """Runs last: everything the worker did in this module (render, upload records, cancels, refusals,
    heartbeats, registry cleanup) passed its ACL."""
    denied = [d for d in stack.acl_denials("worker") if not d.startswith("auth:")]  # (the wrong-password test)
    assert sorted(denied) == sorted(
        [
            "command: flushall",
            "command: flushdb",
            "command: config|set",
            "command: config|get",
            "command: shutdown",
            "command: debug",
            "command: acl|list",
            "command: keys",
            "command: replicaof",
        ]
    )  # fmt: skip (exactly the admin attacks of test_neither_a_tenant_nor_the_worker_can_run_admin_commands)
    # bob only used the producer (submit, status, the CLI): denied nothing but RQ's server-version probe at
    # enqueue (INFO, which RQ answers itself with a fallback; tenants get no server statistics)
    assert set(stack.acl_denials("bob")) <= {"command: info"}
