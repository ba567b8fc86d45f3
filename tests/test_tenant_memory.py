"""A tenant filling Redis with keys of her own that each stay under every cap (the security review's finding 3: Redis
has no per-user memory limit), against a real redis-server with the service's memory flags and a real
worker serving tenants (`LTX_TENANT_IDS`, `LTX_TENANTS=alice,bob`) on a CPU rank, real SeaweedFS.

Before `worker.jobs.tenant_memory` the worker waited, degraded, until an operator deleted her keys: bob's job
in flight never recorded its outcome and his next job never ran. Now the worker trims the tenant over
her budget (half of `maxmemory` shared between the two tenants), releases its reserve when refused, and
bob's jobs end `uploaded` without an operator and without a worker restart.
"""

from __future__ import annotations

import time
import urllib.request
import uuid
from typing import Any

import pytest
import redis

from tests.support.fleet import running_worker
from tests.support.wait import wait_for
from tests.support.workers import enqueue, wait_state
from worker.jobs.tenant_memory import key_tenant

pytestmark = pytest.mark.timeout(240)

MB = 1 << 20
_REQUEST = {"width": 64, "height": 64, "num_frames": 9}


def _tenant_bytes(client: Any, tenant: str) -> int:
    total = 0
    for pattern in (f"rq:job:{tenant}-*", f"ltx:job:{tenant}-*", f"rq:results:{tenant}-*"):
        for key in client.scan_iter(match=pattern, count=1000):
            total += client.memory_usage(key, samples=0) or 0
    return total


def _bob_job(w: Any, prompt: str) -> Any:
    return enqueue(w.conn, w.queue, {"prompt": prompt, **_REQUEST}, job_id=f"bob-{uuid.uuid4().hex[:8]}",
                   meta={"client": "bob"})  # fmt: skip


def test_a_tenant_filling_redis_with_small_hashes_is_trimmed_and_others_outcomes_are_recorded(
    tmp_path, redis_server_factory, s3_server
):
    server = redis_server_factory()
    hold = tmp_path / "hold"
    with running_worker(tmp_path, server, s3_server, tenant_ids="true", tenants="alice,bob") as w:
        pid = w.proc.proc.pid
        alice = server.client()
        running = _bob_job(w, f"in flight hold={hold} step_s=0.05")
        wait_state(running, "rendering", 60, w.proc)
        limit = int(alice.info("memory")["used_memory"]) + 24 * MB
        alice.config_set("maxmemory", limit)
        n = 0
        with pytest.raises(redis.exceptions.OutOfMemoryError):  # 1 MB hashes: each far under the job bound
            for n in range(200):
                alice.hset(f"rq:job:alice-fill{n}", mapping={"status": "finished", "pad": b"a" * MB})
        assert n > 10
        # Redis still takes a small write at the edge; the limit brought under what is used refuses them all
        # (what her last writes and her clients' buffers would do): nobody can write now.
        limit = int(alice.info("memory")["used_memory"]) - 6 * MB  # (her refused write's buffer shrinks later)
        alice.config_set("maxmemory", limit)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            alice.xadd("ltx:job:alice-fill0:events", {"type": "x"})
        hold.write_text("go")  # bob's render now writes its events and outcome into a full Redis
        assert wait_state(running, {"uploaded", "failed"}, 90, w.proc) == "uploaded", running.get_meta(refresh=True)
        budget = limit // 2 // 2
        assert _tenant_bytes(alice, "alice") <= budget
        assert alice.exists(running.key)  # bob's keys untouched
        after = _bob_job(w, "after the flood")
        assert wait_state(after, {"uploaded", "failed"}, 90, w.proc) == "uploaded", after.get_meta(refresh=True)
        assert w.proc.proc.pid == pid and w.proc.proc.poll() is None
        log = w.proc.log_tail(400_000)
        assert "tenant alice held" in log and "unhandled exception" not in log, log[-4000:]
        port = w.health()["metrics_port"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        names = ("ltx_worker_tenant_keys_deleted_total", "ltx_worker_tenant_bytes_deleted_total")
        deleted = {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(names)}  # fmt: skip
        assert any('tenant="alice"' in k and v > 0 for k, v in deleted.items() if "keys" in k), deleted
        assert not any('tenant="bob"' in k for k in deleted), deleted  # bob was never over budget
        # the reserve: released when refused, held again once Redis has room for it
        wait_for(lambda: any(alice.scan_iter(match="ltx:worker:reserve:*")), 30, "the reserve taken again")
        alice.close()


def test_keys_are_counted_for_the_tenant_that_owns_them() -> None:
    assert key_tenant("rq:job:alice-123") == ("alice", "alice-123")
    assert key_tenant("ltx:job:alice-123:events") == ("alice", "alice-123")
    assert key_tenant("rq:results:bob-9") == ("bob", "bob-9")
    assert key_tenant("ltx:producer:client:alice:jobs") == ("alice", None)
    assert key_tenant("rq:queue:ltx-render:t:alice") == ("alice", None)
    for other in ("rq:queue:ltx-render", "rq:queue:ltx-render:t:alice:intermediate", "ltx:worker:w1:health",
                  "rq:job:nodash", "rq:workers", f"ltx:worker:poisoned:alice-{time.time_ns()}"):  # fmt: skip
        assert key_tenant(other) is None, other


def test_the_sweep_trims_only_the_tenant_over_budget_ended_first_never_a_running_job(redis_server_factory) -> None:
    """`TenantMemory.sweep` on a real Redis: alice over her budget loses her largest ended keys first, then
    queued ones, never a started job's; bob, under his, keeps everything; the reserve is released when Redis
    refuses for memory and taken again only when there is room for it twice over."""
    from worker.jobs.tenant_memory import TenantMemory

    redis_client = redis_server_factory().client()  # (its own server: the sweep looks at every key)
    tag = uuid.uuid4().hex[:6]
    pad = b"p" * (256 << 10)
    keys = {
        "started": f"rq:job:alice-{tag}-run",
        "ended": f"rq:job:alice-{tag}-old",
        "queued": f"rq:job:alice-{tag}-wait",
        "events": f"ltx:job:alice-{tag}-old:events",
        "bob": f"rq:job:bob-{tag}-x",
    }
    redis_client.hset(keys["started"], mapping={"status": "started", "pad": pad * 4})
    redis_client.hset(keys["ended"], mapping={"status": "finished", "pad": pad * 2})
    redis_client.hset(keys["queued"], mapping={"status": "queued", "pad": pad * 3})
    redis_client.xadd(keys["events"], {"data": pad})
    redis_client.hset(keys["bob"], mapping={"status": "finished", "pad": pad * 4})
    tm = TenantMemory(redis_client, worker_name=f"w{tag}.cpu1.123", tenants=("alice", "bob"),
                      budget_bytes=int(1.5 * MB), reserve_bytes=64 << 10)  # fmt: skip
    try:
        # alice: 1 MB started (kept) + 0.5 ended + 0.25 events + 0.75 queued = 2.5 MB; over by ~1 MB: the ended
        # hash and her events go first, then the queued one; the started job stays even though it is largest
        trimmed = tm.sweep()
        assert set(trimmed) == {"alice"}, trimmed
        assert redis_client.exists(keys["started"]) and redis_client.exists(keys["bob"])
        assert not redis_client.exists(keys["ended"]) and not redis_client.exists(keys["events"])
        assert not redis_client.exists(keys["queued"])
        assert tm.reserve_key.endswith(f"w{tag}.cpu1")  # (a restarted worker of the slot takes it over)
        assert tm.take_reserve() and redis_client.strlen(tm.reserve_key) == 64 << 10
        tm.relieve()
        assert not redis_client.exists(tm.reserve_key)
        used = int(redis_client.info("memory")["used_memory"])
        redis_client.config_set("maxmemory", used + (64 << 10))  # room for it once, not twice: not taken
        assert not tm.take_reserve() and not redis_client.exists(tm.reserve_key)
    finally:
        redis_client.close()


def test_the_sweep_runs_as_the_worker_acl_user_and_a_tenant_cannot_touch_the_reserve(tmp_path) -> None:
    """Under the generated ACL users: `SCAN`, `MEMORY USAGE`, `INFO` and `DEL` pass as `worker`; alice can
    fill her own keys but cannot read or delete a worker's reserve."""
    from devstack.dev_secure import SecureRedisServer
    from devstack.dev_servers import find_redis_server
    from ltx_contract.redis_acl import AclUsers, generate
    from tests.support.acl_stack import write_passwords
    from worker.jobs.tenant_memory import TenantMemory

    if find_redis_server() is None:
        pytest.skip("redis-server not found")
    pw = write_passwords(tmp_path / "secrets")
    server = SecureRedisServer(acl=generate(AclUsers(tenants=("alice", "bob")), password_dir=tmp_path / "secrets"))
    server.start()
    try:
        worker = server.user_client("worker", pw["worker"])
        alice = server.user_client("alice", pw["alice"])
        for i in range(4):
            alice.hset(f"rq:job:alice-{i}", mapping={"status": "finished", "pad": b"a" * (512 << 10)})
        tm = TenantMemory(worker, worker_name="w.cpu1.1", tenants=("alice", "bob"), budget_bytes=MB)
        assert tm.take_reserve()
        assert tm.sweep().keys() == {"alice"}
        assert sum(worker.exists(f"rq:job:alice-{i}") for i in range(4)) <= 2
        for attempt in (lambda: alice.get(tm.reserve_key), lambda: alice.delete(tm.reserve_key)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
        assert worker.exists(tm.reserve_key)
        worker.close()
        alice.close()
    finally:
        server.stop()
