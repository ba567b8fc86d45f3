"""The LoRA cache on a real disk that fills (a 64 MiB tmpfs, or one of 64 inodes; skipped where mounting is
refused) and with real S3 (SeaweedFS): its caps hold at every admission whatever one tenant asks, a job cannot
pin more than its share, the cache keeps the spool's free-space floors (bytes and inodes) and yields its
unpinned files to the spool, a worker whose disk is full says so in `/readyz` and recovers by itself, and a
LoRA job two groups' cache has no room for waits instead of failing."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ltx_contract.lora_refs import LoraRef
from tests.support.workers import SMALL_REQUEST, enqueue
from worker.ops.metrics import WorkerMetrics
from worker.render.lora_cache import LoraCache, LoraCacheFull
from worker.render.loras import LoraRefused, LoraResolver
from worker.settings import WorkerSettings

from .test_lora_file import TARGETS, lora, write_st
from .test_worker_support import launch_worker, pid_alive, wait_for, wait_ready, wait_state, worker_health

MiB = 1 << 20
pytestmark = pytest.mark.timeout(300)


def _tmpfs(root: Path, options: str) -> Iterator[Path]:
    root.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(root)]
    done = subprocess.run(mount, check=False, capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()[:200]}); the disk tests need one")
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs: a disk that really fills."""
    yield from _tmpfs(tmp_path / "disk", "size=64m")


@pytest.fixture
def few_inodes(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs of 64 inodes: a disk whose inodes run out long before its bytes."""
    yield from _tmpfs(tmp_path / "inodes", "size=64m,nr_inodes=64")


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def free_inodes(path: Path) -> int:
    return os.statvfs(path).f_favail


def lora_runner_setup(tmp_path: Path) -> str:
    """The fault runner taking request LoRAs (it ignores them), and a checkpoint header naming `TARGETS`, from
    which the worker checks them: what a LoRA-capable fleet looks like to the worker, at no model's cost."""
    ckpt = write_st(
        tmp_path / "ckpt.safetensors",
        {f"model.diffusion_model.{k}": ("BF16", list(shape)) for k, shape in TARGETS.items()},
    )
    return json.dumps({"request_loras": True, "checkpoint_path": str(ckpt)})


def tenant_job(w: Any, tenant: str, prompt: str, **request: Any) -> Any:
    return enqueue(
        w.conn,
        w.queue,
        {"prompt": prompt, **SMALL_REQUEST, **request},
        job_id=f"{tenant}-{uuid.uuid4().hex[:8]}",
        meta={"client": tenant},
    )


def big_lora(path: Path, size: int) -> bytes:
    """A valid LoRA of about `size` bytes (its header padded: what counts here is the bytes)."""
    return write_st(path, lora(), header_pad=size).read_bytes()


def resolver(cache_dir: Path, s3: Any, cap: int, **settings: Any) -> LoraResolver:
    s = WorkerSettings(lora_cache_dir=cache_dir, lora_cache_bytes=max(cap, MiB), **settings)
    r = LoraResolver(s, s3_client=lambda: s3, metrics=WorkerMetrics("g"))
    r._targets = dict(TARGETS)
    r.cache.cap_bytes = cap
    return r


@pytest.fixture
def bucket(s3_client: Any) -> str:
    name = f"loras-{uuid.uuid4().hex[:10]}"
    s3_client.create_bucket(Bucket=name)
    return name


def test_one_tenant_cannot_grow_the_cache_past_its_cap(tmp_path: Path, s3_client: Any, bucket: str) -> None:
    """The issue's attack: one LoRA under 12 keys, jobs of 4 uris. The sum of a job's LoRAs is checked from
    their HEADs before any fetch (lora_too_large), and after every job the cache holds at most its cap."""
    body = big_lora(tmp_path / "l.safetensors", 256 << 10)
    for i in range(12):
        s3_client.put_object(Bucket=bucket, Key=f"u/copy{i}.safetensors", Body=body)
    cap = 3 * len(body) + 100
    r = resolver(tmp_path / "cache", s3_client, cap, lora_s3_prefixes=[f"{bucket}/u/"])
    uris = [LoraRef(uri=f"s3://{bucket}/u/copy{i}.safetensors") for i in range(12)]
    for job in range(3):
        with pytest.raises(LoraRefused, match=r"^loras: lora_too_large: these LoRAs hold \d+ bytes together"):
            r.resolve(uris[4 * job : 4 * job + 4])
    assert r.metrics.registry.get_sample_value("ltx_worker_lora_fetch_bytes_total", {"group": "g"}) in (None, 0.0)
    for job in range(6):  # two uris a job: fits; every job evicts the last one's files, never exceeds the cap
        got = r.resolve(uris[2 * job : 2 * job + 2])
        assert [g.cached for g in got] == [False, False]
        assert r.cache.usage() <= cap, (job, r.cache.usage())
    r.cache.release()
    assert sum(p.stat().st_size for p in (tmp_path / "cache").glob("*.safetensors")) <= cap


def test_the_cache_keeps_the_spools_floor_on_a_disk_that_fills(small_disk: Path, s3_client: Any, bucket: str) -> None:
    """Cap above the disk: the floor (the spool's `spool_min_free_bytes`) is what holds. A fetch that would go
    under it evicts unpinned files first; one that cannot is refused (LoraCacheFull: ENOSPC, an OSError the
    service records as spool_error). `make_room` gives the spool its space back."""
    body = big_lora(small_disk / "src.safetensors", 4 * MiB)
    (small_disk / "src.safetensors").unlink()
    for i in range(8):
        s3_client.put_object(Bucket=bucket, Key=f"u/c{i}.safetensors", Body=body)
    floor = 40 * MiB
    r = resolver(small_disk / "cache", s3_client, 1 << 30, lora_s3_prefixes=[f"{bucket}/u/"],
                 spool_min_free_bytes=floor, lora_max_per_request=8)  # fmt: skip
    for i in range(8):  # one LoRA a job: 32 MiB in all would go under the floor; the LRU ones go instead
        r.resolve([LoraRef(uri=f"s3://{bucket}/u/c{i}.safetensors")])
        assert free_bytes(small_disk) >= floor, i
        r.cache.release()
    kept = len(list((small_disk / "cache").glob("*.safetensors")))
    assert 1 <= kept < 8
    # 28 MiB, pinned together (copies of one file: their strengths, summed, within the bound)
    pinned = [LoraRef(uri=f"s3://{bucket}/u/c{i}.safetensors", strength=0.5) for i in range(7)]
    with pytest.raises(LoraCacheFull) as info:
        r.resolve(pinned)
    assert info.value.errno == 28 and "under the spool's floor" in str(info.value)  # ENOSPC
    assert free_bytes(small_disk) >= floor
    r.cache.release()
    assert r.cache.make_room(64 * MiB)  # the spool's need: every unpinned file goes
    assert not list((small_disk / "cache").glob("*.safetensors"))


def test_pins_hold_across_processes_and_dead_fetches_are_reclaimed(tmp_path: Path) -> None:
    """A file another process pins (a sibling group's running job) is never evicted; a `.incoming-` file of a
    process that died is removed; one still being written counts at its reserved size."""
    cache = LoraCache(tmp_path / "c", cap_bytes=300)
    with cache.incoming(100) as tmp:
        tmp.write_bytes(bytes(100))
        path = cache.commit(tmp, "a")
    cache.release()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl,sys,time; f=open(sys.argv[1],'rb'); "
                               "fcntl.flock(f, fcntl.LOCK_SH); print('pinned', flush=True); time.sleep(60)", str(path)],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "pinned"
        with pytest.raises(LoraCacheFull, match="beside 100 bytes in use"):
            cache.incoming(250).__enter__()
        assert path.exists()
    finally:
        holder.kill()
        holder.wait()
    (cache.root / ".incoming-5000-dead.safetensors").write_bytes(b"x")  # its process died: nothing locks it
    with cache.incoming(250) as tmp:  # "a" unpinned now: evicted, and the dead fetch's leftover removed
        assert not path.exists() and not (cache.root / ".incoming-5000-dead.safetensors").exists()
        assert cache.usage() == 250  # (this fetch, counted at its reservation before a byte is written)


def test_a_full_spool_disk_is_not_ready_and_recovers_by_itself(small_disk: Path, tmp_path: Path, redis_server: Any,
                                                               s3_server: Any) -> None:  # fmt: skip
    """A live worker (real Redis, real S3), its spool and LoRA cache on one 64 MiB disk. Cache files filling
    the disk are evicted for the spool (the worker does not stop taking jobs); a foreign file filling it puts
    the worker in back-pressure, `/readyz` answering 503 with the reason; deleting that file, the worker
    recovers without a restart or a commit and the waiting job renders."""
    cache_dir = small_disk / "lora-cache"
    cache_dir.mkdir()
    for i in range(10):  # what a tenant's fetches left (files no job pins)
        (cache_dir / f"s3-{i:02d}.safetensors").write_bytes(os.urandom(5 * MiB))
    assert free_bytes(small_disk) < 16 * MiB
    w = launch_worker(tmp_path, redis_server, s3_server, ["one", "--group", "cpu:1"], prefix="d",
                      spool=small_disk / "spool", lora_cache_dir=cache_dir, spool_min_free_bytes=16 * MiB)  # fmt: skip
    try:
        (info,) = wait_ready(w.conn, w.name, 1, 120, w.proc)
        job = w.submit("t bytes=100000", seed=1)
        assert wait_state(job, {"uploaded", "failed"}, 60, w.proc) == "uploaded", job.get_meta(refresh=True)
        assert free_bytes(small_disk) >= 16 * MiB and len(list(cache_dir.glob("*.safetensors"))) < 10
        for left in cache_dir.glob("*.safetensors"):  # (else the cache would yield them, and recover at once)
            left.unlink()
        blob = small_disk / "operator-blob"  # not the cache's: nothing the worker may delete
        blob.write_bytes(bytes(free_bytes(small_disk) - 8 * MiB))
        job = w.submit("t bytes=100000", seed=2)  # (taken by the dequeue already waiting; the next check stops)
        assert wait_state(job, {"uploaded", "failed"}, 60, w.proc) == "uploaded", job.get_meta(refresh=True)

        def probe() -> tuple[int, dict[str, Any]]:
            port = next(h for h in worker_health(w.conn, w.name) if pid_alive(h["pid"]))["metrics_port"]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
                    return resp.status, json.loads(resp.read())
            except urllib.error.HTTPError as exc:
                return exc.code, json.loads(exc.read())

        _, body = wait_for(lambda: (p := probe())[0] == 503 and p, 60, "not ready", on_fail=w.proc.log_tail)
        assert body["ready"] is False and "spool disk nearly full" in body["uploads"]["backpressure_reason"], body
        job = w.submit("t bytes=100000", seed=3)
        time.sleep(2)
        assert job.get_meta(refresh=True).get("state") in (None, "queued"), job.get_meta(refresh=True)
        blob.unlink()
        assert wait_state(job, {"uploaded", "failed"}, 60, w.proc) == "uploaded", job.get_meta(refresh=True)
        wait_for(lambda: probe()[0] == 200, 30, "ready again", on_fail=w.proc.log_tail)
        assert info
    finally:
        assert w.proc.stop(90) == 0, w.proc.log_tail()


# ==== inodes, shares, a job without room waits ============================================================


def test_tiny_loras_never_take_the_spools_inodes(
    few_inodes: Path, tmp_path: Path, redis_server: Any, s3_server: Any
) -> None:
    """Tiny LoRAs on a disk of 64 inodes (spool and LoRA cache on it; real Redis and SeaweedFS; tenants
    alice and bob). What an earlier worker's fetches left, tiny files taking every inode, no longer keeps
    the next worker from rendering: its back-pressure evicts them for inodes as for bytes (the spool stayed
    stuck, restarts included). Then alice's jobs, four new tiny LoRAs each, are admitted only while the disk
    keeps its inode floor, and bob's job behind them renders."""
    spool, cache_dir = few_inodes / "spool", few_inodes / "lora-cache"
    spool.mkdir()
    cache_dir.mkdir()
    n = 0
    while True:  # 554-byte files until no inode is left: the byte cap and the free bytes never bind
        try:
            (cache_dir / f"s3-left{n:03d}.safetensors").write_bytes(bytes(554))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
            break
        n += 1
    assert free_inodes(few_inodes) == 0
    bucket, s3 = s3_server.bucket, s3_server.client()
    body = write_st(tmp_path / "tiny.safetensors", lora()).read_bytes()
    w = launch_worker(
        tmp_path,
        redis_server,
        s3_server,
        ["one", "--group", "cpu:1"],
        prefix="i",
        spool=spool,
        lora_cache_dir=cache_dir,
        spool_min_free_bytes=4 * MiB,
        tenant_ids="true",
        tenants="alice,bob",
        lora_s3_prefixes=f"{bucket}/loras",
        runner_setup=lora_runner_setup(tmp_path),
    )
    try:
        wait_ready(w.conn, w.name, 1, 120, w.proc)
        bob = tenant_job(w, "bob", "bob bytes=1000", seed=1)
        assert wait_state(bob, {"uploaded", "failed"}, 60, w.proc) == "uploaded", bob.get_meta(refresh=True)
        assert len(list(cache_dir.glob("s3-left*"))) < n  # evicted for the spool's inodes
        for job in range(12):  # 48 new files in all, four a job; the disk has 64 inodes
            refs = []
            for i in range(4):
                key = f"loras/alice/j{job}-{i}.safetensors"
                s3.put_object(Bucket=bucket, Key=key, Body=body)
                refs.append({"uri": f"s3://{bucket}/{key}", "strength": 0.5})
            alice = tenant_job(w, "alice", "alice bytes=1000", seed=job, loras=refs)
            assert wait_state(alice, {"uploaded", "failed"}, 60, w.proc) == "uploaded", alice.get_meta(refresh=True)
            assert free_inodes(few_inodes) >= 16 - 4, job  # (the spool's job files come and go: 4 at most)
        bob = tenant_job(w, "bob", "bob again bytes=1000", seed=2)
        assert wait_state(bob, {"uploaded", "failed"}, 30, w.proc) == "uploaded", bob.get_meta(refresh=True)
        assert len(list(cache_dir.glob("s3-*.safetensors"))) < 48
    finally:
        assert w.proc.stop(90) == 0, w.proc.log_tail()


def test_a_job_the_shared_cache_has_no_room_for_waits_and_each_gets_its_share(
    tmp_path: Path, redis_server: Any, s3_server: Any
) -> None:
    """Two groups (two worker processes) on one queue share a 1 MiB LoRA cache. Group A, alone,
    pins a 590 KiB LoRA in a held render; group B starts (one job's share is half the cap now) and takes a job
    of a 440 KiB LoRA, within its share but not beside A's pin: it waits, re-queued without spending a retry
    budget or an execution (it failed `spool_error` twice, its retry included), and renders once A's job
    ends. Then the 590 KiB LoRA alone is refused before any fetch: over one job's share."""
    bucket, s3 = s3_server.bucket, s3_server.client()
    for name, pad in (("big", 590 << 10), ("small", 440 << 10)):
        s3.put_object(
            Bucket=bucket, Key=f"loras/u/{name}.safetensors", Body=big_lora(tmp_path / f"{name}.safetensors", pad)
        )
    settings = {
        "lora_cache_dir": tmp_path / "lora-cache",
        "lora_cache_bytes": MiB,
        "lora_s3_prefixes": f"{bucket}/loras/u",
        "runner_setup": lora_runner_setup(tmp_path),
    }
    queue = f"q-{uuid.uuid4().hex[:8]}"

    def group(name: str) -> Any:
        """One group's worker process on the shared queue and cache, ready."""
        w = launch_worker(
            tmp_path,
            redis_server,
            s3_server,
            ["one", "--group", "cpu:1"],
            prefix=name,
            queue=queue,
            spool=tmp_path / f"spool-{name}",
            **settings,
        )
        wait_ready(w.conn, w.name, 1, 120, w.proc)
        return w

    a = group("a")
    b = None
    hold = tmp_path / "hold"
    try:
        held = a.submit(f"a hold={hold}", loras=[{"uri": f"s3://{bucket}/loras/u/big.safetensors"}])
        assert wait_state(held, {"rendering", "failed"}, 60, a.proc) == "rendering", held.get_meta(refresh=True)
        b = group("b")
        waiting = b.submit("b", loras=[{"uri": f"s3://{bucket}/loras/u/small.safetensors"}])

        def waited_twice() -> bool:
            meta = waiting.get_meta(refresh=True)
            assert meta.get("state") != "failed", meta["error"]  # (was: spool_error "LoRA cache full", retry too)
            return sum(e.get("outcome") == "deferred" for e in meta.get("attempts") or []) >= 2

        wait_for(waited_twice, 60, "two waits for room", on_fail=b.proc.log_tail)
        meta = waiting.get_meta(refresh=True)
        assert meta["state"] != "failed" and meta["error"]["deferred"] and "LoRA cache full" in meta["error"]["message"]
        hold.write_text("go")
        assert wait_state(held, {"uploaded", "failed"}, 60, a.proc) == "uploaded", held.get_meta(refresh=True)
        assert wait_state(waiting, {"uploaded", "failed"}, 60, b.proc) == "uploaded", waiting.get_meta(refresh=True)
        meta = waiting.get_meta(refresh=True)
        assert not meta.get("retries") and meta["attempt"] == 1, meta  # no budget, no execution spent waiting
        alone = a.submit("a again", loras=[{"uri": f"s3://{bucket}/loras/u/big.safetensors"}])
        assert wait_state(alone, {"uploaded", "failed"}, 60, a.proc) == "failed"
        error = alone.get_meta(refresh=True)["error"]
        assert error["reason"] == "invalid_request" and "over one job's share of the LoRA cache" in error["message"]
        assert "2 worker processes sharing it" in error["message"], error
    finally:
        hold.touch()
        for w in (a, b):
            if w is not None:
                assert w.proc.stop(90) == 0, w.proc.log_tail()
