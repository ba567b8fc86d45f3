"""A security review's queue attacks (tenants pushing onto shared queues), rerun on a real stack:
redis-server with the ACL users `ltx-worker redis-acl` writes (`worker`, `alice`, `bob`), one
`ltx-worker one` on a CPU rank serving both tenants' queues (`LTX_TENANTS`) with `LTX_MAX_QUEUE_DEPTH=5`,
real SeaweedFS. alice attacks with raw Redis; bob only uses the producer. Each attack's test failed before
tenant queues (`worker.jobs.tenant_queues`); the last two check the pieces on a plain Redis.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from ltx_contract.redis_acl import AclUsers, generate
from tests.support.acl_stack import Stack, acl_worker, small_request, tenant_enqueue, wait_client_state, write_passwords
from tests.support.wait import wait_for
from tests.support.workers import events, wait_ready

DEPTH = 5
_REQUEST = {"prompt": "t", "width": 64, "height": 64, "num_frames": 9}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: Any) -> Any:
    from devstack.dev_secure import SecureRedisServer
    from devstack.dev_servers import find_redis_server

    if find_redis_server() is None:
        pytest.skip("redis-server not found")
    tmp = tmp_path_factory.mktemp("tq")
    secrets_dir = tmp / "secrets"
    write_passwords(secrets_dir)
    server = SecureRedisServer(acl=generate(AclUsers(tenants=("alice", "bob")), password_dir=secrets_dir)).start()
    ready = lambda admin, name, proc: wait_ready(admin, name, 1, 120, proc)  # noqa: E731
    with acl_worker(server, s3_server, tmp, secrets_dir, ready, tenants="alice,bob",
                    max_queue_depth=str(DEPTH)) as (proc, queue, name):  # fmt: skip
        st = Stack(server, s3_server, proc, queue, name, secrets_dir)
        try:
            yield st
        finally:
            st.admin.close()


def _bob(stack: Stack) -> Any:
    from producer.client import ProducerClient

    return ProducerClient(stack.settings("bob", max_queue_depth=DEPTH))


def _started(stack: Stack, job_id: str) -> int:
    return sum(1 for e in events(stack.admin, job_id) if e["type"] == "state" and e["state"] == "started")


def _worker_log_has(stack: Stack, text: str) -> bool:
    return text in stack.worker.log_tail(1 << 24)


def test_bogus_ids_and_forged_owners_do_not_make_bobs_jobs_queue_full(stack: Stack) -> None:
    """alice LPUSHed 5 bogus ids (or 5 hashes of her own naming bob as owner) onto the shared queue: all of
    bob's admitted jobs ended queue_full and his next submit was refused ("8/5"). Now she can only push onto
    her own queue, whose entries count against nobody else."""
    alice, shared = stack.raw("alice"), f"rq:queue:{stack.queue}"
    with pytest.raises(redis.exceptions.NoPermissionError):
        alice.lpush(shared, *[f"bogus-{i}" for i in range(DEPTH)])
    with _bob(stack) as bob:
        bob.submit(small_request("t step_s=0.3", steps=10), job_id="slow")  # keeps the worker busy meanwhile
        wait_client_state(bob, "slow", {"rendering"}, stack)
        alice.lpush(f"{shared}:t:alice", *[f"alice-bogus{i}" for i in range(DEPTH)])
        for i in range(DEPTH):
            tenant_enqueue(alice, f"{stack.queue}:t:alice", _REQUEST, job_id=f"alice-forged{i}", meta={"client": "bob"})
        ids = [bob.submit(small_request(f"t n={i}"), job_id=f"mine{i}").id for i in range(3)]  # (the producer admits)
        for job_id in ["bob-slow", *ids]:
            info = wait_client_state(bob, job_id, {"uploaded", "failed"}, stack, timeout=120)
            assert info.state == "uploaded", (job_id, info.error)
        bob.submit(small_request("t again"), job_id="next")  # not refused: alice's entries are not in bob's count
        assert wait_client_state(bob, "next", {"uploaded", "failed"}, stack, timeout=120).state == "uploaded"
    wait_for(lambda: stack.admin.llen(f"{shared}:t:alice") == 0, 60, "alice's queue emptied")
    assert _worker_log_has(stack, "no_job")  # the bogus ids were dropped uncounted (and counted in the metric)
    assert stack.fleet_alive()


def test_100k_bogus_ids_on_a_tenants_queue_neither_refuse_nor_stall_another(stack: Stack) -> None:
    """100k bogus ids took 0.1 s to push, refused every producer for ~25 s and stalled the worker ~13 s.
    Now they sit on alice's own queue: bob's submit is admitted at once, and his job waits at most a
    bounded share of each dequeue (100 drops per queue), not for the whole pile to be cleaned."""
    alice, key = stack.raw("alice"), f"rq:queue:{stack.queue}:t:alice"
    with _bob(stack) as bob:
        t0 = time.monotonic()
        bob.submit(small_request("t base"), job_id="base")
        assert wait_client_state(bob, "base", {"uploaded", "failed"}, stack, timeout=120).state == "uploaded"
        baseline = time.monotonic() - t0  # what one small job takes on this machine right now
        with alice.pipeline(transaction=False) as pipe:
            for chunk in range(10):
                pipe.rpush(key, *[f"alice-bogus{chunk}x{i}" for i in range(10_000)])
            pipe.execute()
        t1 = time.monotonic()
        bob.submit(small_request("t after the flood"), job_id="after")  # admitted: his depth is his own
        info = wait_client_state(bob, "after", {"uploaded", "failed"}, stack, timeout=120)
        took = time.monotonic() - t1
        assert info.state == "uploaded", info.error
    # Cleaning 100k ids one dequeue at a time would take far longer than a job: bob's job did not wait for it.
    assert took < 3 * baseline + 5, (took, baseline)
    # An idle worker goes on dropping junk, dequeue after dequeue, until the queue is empty. Five dequeues' worth
    # show that as well as the ~1000 the whole pile takes (each id costs its round trips: over a minute here).
    from worker.rq.loop.queues import JUNK_PER_QUEUE

    stack.admin.ltrim(key, -5 * JUNK_PER_QUEUE, -1)
    wait_for(lambda: stack.admin.llen(key) == 0, 60, "alice's queue cleaned", on_fail=stack.worker.log_tail)
    assert stack.fleet_alive()


def test_ended_jobs_pushed_again_never_re_run(stack: Stack) -> None:
    """`RPUSH rq:queue:<q> bob-<failed id>` rendered bob's job again. Now: NOPERM on the shared queue and
    on bob's; on alice's own queue another tenant's id is dropped (wrong tenant), and so is alice's own
    ended job (not queued): neither renders."""
    with _bob(stack) as bob:
        bob.submit(small_request("t error=runner"), job_id="broken")
        assert wait_client_state(bob, "broken", {"uploaded", "failed"}, stack).state == "failed"
    with stack.producer("alice") as client:
        client.submit(small_request("t error=runner mine"), job_id="done")
        assert wait_client_state(client, "done", {"uploaded", "failed"}, stack).state == "failed"
    alice, shared = stack.raw("alice"), f"rq:queue:{stack.queue}"
    for key in (shared, f"{shared}:t:bob", f"{shared}:intermediate"):
        with pytest.raises(redis.exceptions.NoPermissionError):
            alice.rpush(key, "bob-broken")
    alice.rpush(f"{shared}:t:alice", "bob-broken", "alice-done", "alice-done")  # (both failed: a re-run renders)
    wait_for(lambda: stack.admin.llen(f"{shared}:t:alice") == 0, 30, "dequeued", on_fail=stack.worker.log_tail)
    with stack.producer("alice") as client:  # a job after them: once it ran, the pushed ids were judged
        client.submit(small_request("t later"), job_id="later")
        assert wait_client_state(client, "later", {"uploaded", "failed"}, stack).state == "uploaded"
    assert _started(stack, "bob-broken") == 1 and _started(stack, "alice-done") == 1
    assert stack.admin.hget("rq:job:bob-broken", "status") == b"failed"
    assert stack.admin.hget("rq:job:alice-done", "status") == b"failed"
    assert _worker_log_has(stack, "wrong_tenant") and _worker_log_has(stack, "not_queued")
    assert stack.admin.llen(f"{shared}:t:alice:intermediate") == 0


def test_a_stale_worker_entry_does_not_crash_tenant_commands(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """RQ's `Worker.all()` removes dead workers with SREM, which a tenant may not do: `submit`, `submit
    --dry-run` and `stats` exited 1 with a traceback after any worker death. Now the producer only reads."""
    from producer.cli import cli

    ghost = "rq:worker:ghost-1"  # a worker SIGKILLed before its registration expired leaves exactly this
    tenant_queue = f"{stack.queue}:t:bob"
    try:
        for key, value in {"LTX_REDIS_URL": stack.server.url, "LTX_REDIS_USERNAME": "bob", "LTX_QUEUES": stack.queue,
                           "LTX_REDIS_PASSWORD_FILE": str(stack.secrets / "bob")}.items():  # fmt: skip
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("LTX_CLIENT", raising=False)
        monkeypatch.delenv("LTX_OPERATOR", raising=False)
        request = Path(stack.secrets.parent / "req.json")
        request.write_text('{"prompt": "t", "width": 64, "height": 64, "num_frames": 9}')
        for args in (["submit", str(request), "--dry-run"], ["stats", "--json"], ["submit", str(request)]):
            stack.admin.sadd("rq:workers", ghost)  # (again: the worker's own maintenance removes it)
            stack.admin.sadd(f"rq:workers:{tenant_queue}", ghost)
            result = CliRunner().invoke(cli, args)
            assert result.exit_code == 0, (args, result.output, result.exception)
        stack.admin.sadd("rq:workers", ghost)
        stack.admin.sadd(f"rq:workers:{tenant_queue}", ghost)
        with _bob(stack) as bob:
            assert [w.name for w in bob.stats().workers] == [wait_ready(stack.admin, stack.name, 1, 30)[0]["worker"]]
            assert bob.runner_limits()  # the live worker's limits, the ghost skipped
        assert not [d for d in stack.acl_denials("bob") if "srem" in d or "sadd" in d]
    finally:
        stack.admin.srem("rq:workers", ghost)
        stack.admin.srem(f"rq:workers:{tenant_queue}", ghost)


def test_an_operator_sees_every_tenant_queue_the_workers_serve(stack: Stack) -> None:
    """Tenants see their own queue; an operator (the worker user) sees the shared queue and every tenant
    queue workers registered, so depths and jobs of all tenants stay visible."""
    from producer.client import ProducerClient

    with stack.producer("bob") as bob:
        bob.submit(small_request("t seen"), job_id="seen")
        wait_client_state(bob, "seen", {"uploaded"}, stack)
        assert [q.name for q in bob.stats(queues=[stack.queue]).queues] == [f"{stack.queue}:t:bob"]
    with ProducerClient(stack.settings("worker", operator=True)) as operator:
        names = [q.name for q in operator.stats(queues=[stack.queue]).queues]
        assert names == [stack.queue, f"{stack.queue}:t:alice", f"{stack.queue}:t:bob"]
        ended = operator.list_jobs([stack.queue], 200)["recently ended"]
        assert "bob-seen" in [i.job_id for i in ended]


# ---- the pieces, against a plain real Redis (no worker) ----------------------------------------------------


def test_tenants_take_turns_within_a_priority_never_across() -> None:
    from worker.jobs.tenant_queues import rotate, served_queue_names

    names = served_queue_names(["hi", "lo"], ["alice", "bob"])
    assert names == ["hi", "hi:t:alice", "hi:t:bob", "lo", "lo:t:alice", "lo:t:bob"]
    assert rotate(names, "hi:t:alice") == ["hi:t:bob", "hi", "hi:t:alice", "lo", "lo:t:alice", "lo:t:bob"]
    assert rotate(names, "lo:t:bob") == names  # (the last of its priority: the order it started with)
    assert rotate(names, "lo") == [*names[:3], "lo:t:alice", "lo:t:bob", "lo"]


def test_one_dequeue_drops_a_bounded_number_of_junk_ids_and_reaches_the_next_tenant(redis_server: Any) -> None:
    """Without a depth cap nothing trims alice's 100k bogus ids: each dequeue drops at most JUNK_PER_QUEUE of
    them (counted), then takes bob's job. RQ's own dequeue skipped missing ids in one loop over the queue."""
    from rq.serializers import JSONSerializer

    from worker.rq.loop.job_class import RenderJob
    from worker.rq.loop.queues import JUNK_PER_QUEUE, TakingQueue

    conn = redis_server.client()
    base = f"q-{uuid.uuid4().hex[:6]}"
    dropped: list[tuple[str, str, str]] = []
    cls = TakingQueue.with_hook(lambda q, j, r: dropped.append((q, j, r)))
    qa, qb = (cls(f"{base}:t:{t}", connection=conn, serializer=JSONSerializer) for t in ("alice", "bob"))
    with conn.pipeline(transaction=False) as pipe:
        for chunk in range(10):
            pipe.rpush(qa.key, *[f"alice-x{chunk}-{i}" for i in range(10_000)])
        pipe.execute()
    job = tenant_enqueue(conn, qb.name, _REQUEST, job_id="bob-real", meta={"client": "bob"})
    taken = cls.dequeue_any([qa, qb], 1, connection=conn, job_class=RenderJob, serializer=JSONSerializer)
    assert taken is not None and taken[0].id == job.id and taken[1].name == qb.name
    assert len(dropped) == JUNK_PER_QUEUE and {r for _, _, r in dropped} == {"no_job"}
    assert conn.llen(qa.key) == 100_000 - JUNK_PER_QUEUE and conn.llen(f"{qa.key}:intermediate") == 0
    assert conn.lrange(f"{qb.key}:intermediate", 0, -1) == [b"bob-real"]  # (RQ's cleanup finds it if we die)
    # junk only: an empty hand at once (the worker's loop beats and comes back), never a block or a full scan
    assert cls.dequeue_any([qa], 1, connection=conn, job_class=RenderJob, serializer=JSONSerializer) is None
    assert len(dropped) == 2 * JUNK_PER_QUEUE
    # a burst worker (timeout None) goes on through the junk: it must not stop while a job waits behind it
    conn.delete(qa.key)
    conn.rpush(qa.key, *[f"alice-y{i}" for i in range(2 * JUNK_PER_QUEUE + 5)])
    later = tenant_enqueue(conn, qa.name, _REQUEST, job_id="alice-real", meta={"client": "alice"})
    assert cls.dequeue_any([qa], 1, connection=conn, job_class=RenderJob, serializer=JSONSerializer) is None
    taken = cls.dequeue_any([qa], None, connection=conn, job_class=RenderJob, serializer=JSONSerializer)
    assert taken is not None and taken[0].id == later.id
    conn.delete(qa.key, f"{qa.key}:intermediate", f"{qb.key}:intermediate", job.key, later.key)
