"""The producer against the real service: a real Redis, a real S3 (SeaweedFS), and one real worker process
(`python -m worker one --group cpu:2`, the smoke runner on a CPU fleet of two ranks), shared by the module.

Covers: submit → watch → fetch (sha256 verified, decoded with PyAV); watch resuming after a lost
connection; admission refusing a submit while backfill waits and completes; backfill idempotence; backfill
interrupted with SIGINT and resumed, every prompt rendered exactly once; cancel of a running job.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner
from rq.job import Job
from rq.serializers import JSONSerializer

from devstack.dev_servers import RedisServer, S3Server
from ltx_contract.keys import events_key, worker_health_key
from ltx_contract.states import JobState
from producer.cli import cli
from producer.client import ProducerClient
from producer.exit_codes import ExitCode
from producer.settings import load_settings
from tests.support.wait import wait_for

ROOT = Path(__file__).resolve().parents[1]
TINY = {"width": 64, "height": 64, "num_frames": 9, "steps": 2}


@dataclass
class Stack:
    env: dict[str, str]  #: producer environment (with S3 credentials for fetch)
    queue: str
    redis: RedisServer
    s3: S3Server
    worker_pids: list[int]


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    queue = f"prod-{uuid.uuid4().hex[:8]}"
    tmp = tmp_path_factory.mktemp("producer-stack")
    common = {
        "LTX_REDIS_URL": redis_server.url,
        "LTX_QUEUES": queue,
        "LTX_S3_ENDPOINT_URL": s3_server.url,
        "LTX_S3_BUCKET": s3_server.bucket,
        "LTX_S3_ACCESS_KEY_ID": s3_server.access_key,
        "LTX_S3_SECRET_ACCESS_KEY": s3_server.secret_key,
        "LTX_S3_REGION": s3_server.region,
    }
    worker_env = {
        **os.environ,
        **common,
        "LTX_METRICS_PORT": "0",
        "LTX_SPOOL_DIR": str(tmp / "spool"),
        "LTX_LOG_FORMAT": "text",
        "LTX_WORKER_NAME": f"prodtest-{queue}",
        "LTX_FLEET_SHUTDOWN_TIMEOUT": "5",
    }
    log = (tmp / "worker.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker", "one", "--group", "cpu:2"],
        env=worker_env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis_server.client()

    def ready() -> list[int] | None:
        assert proc.poll() is None, (tmp / "worker.log").read_text()[-3000:]
        for key in client.scan_iter(match=worker_health_key(f"prodtest-{queue}*")):
            health = json.loads(client.get(key) or "{}")
            fleet = health.get("fleet") or {}
            if fleet.get("state") == "ready":
                return list(fleet.get("pids") or [])
        return None

    try:
        pids = wait_for(ready, 180, "the worker's fleet to be ready", poll=0.1)
        yield Stack(env={**common, "LTX_CLIENT": f"c-{queue}"}, queue=queue, redis=redis_server, s3=s3_server,
                    worker_pids=pids)  # fmt: skip
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
        client.close()
    for pid in pids:  # the fleet's ranks went down with the worker
        assert not _alive(pid), f"fleet rank {pid} survived the worker"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        status = Path(f"/proc/{pid}/status").read_text()
        if "\nState:\tZ" in status:
            return False
    return True


def run(args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, args, env=env, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def write_requests(path: Path, requests: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    return path


def started_count(redis_client, job_id: str) -> int:
    """How many times a worker started this job (one `started` state event per execution)."""
    count = 0
    for _id, fields in redis_client.xrange(events_key(job_id)):
        data = json.loads(fields[b"data"])
        count += data.get("type") == "state" and data.get("state") == JobState.STARTED.value
    return count


# ==== round trip ========================================================================================


def test_submit_watch_fetch_round_trip(stack: Stack, tmp_path: Path, s3_client) -> None:
    import av

    request = tmp_path / "prompt.json"
    request.write_text(json.dumps({"prompt": "a lighthouse in a storm", "seed": 3, **TINY}, indent=2))
    code, out, err = run(["submit", str(request), "--watch"], stack.env)
    assert code == ExitCode.OK, out + err
    lines = out.splitlines()
    job_id = lines[0].strip()
    text = "\n".join(lines)
    for expected in ("started on prodtest-", "stage denoise", "denoise 1/2", "denoise 2/2", "stage decode",
                     "output 64x64 9 frames", "uploaded s3://", "done: s3://"):  # fmt: skip
        assert expected in text, f"{expected!r} missing from:\n{text}"

    code, out, _ = run(["status", job_id, "--json"], stack.env)
    info = json.loads(out)
    assert (code, info["state"], info["result"]["fleet"]["group"]) == (0, "uploaded", "cpu:2")
    # (the last stage the render announced, `mux`, read as if the job were still in it)
    assert (info["stage"], info["percent"], info["eta_s"]) == ("done", 100.0, 0.0), info

    dest = tmp_path / "out.mp4"
    code, out, err = run(["fetch", job_id, "-o", str(dest)], stack.env)
    assert code == ExitCode.OK, err
    data = dest.read_bytes()
    obj = s3_client.get_object(Bucket=info["result"]["bucket"], Key=info["result"]["key"])["Body"].read()
    assert data == obj
    assert hashlib.sha256(data).hexdigest() == info["result"]["sha256"]
    assert f"sha256 {info['result']['sha256']} verified" in out
    with av.open(str(dest)) as container:
        frames = list(container.decode(video=0))
    assert (len(frames), frames[0].width, frames[0].height) == (9, 64, 64)

    # without S3 credentials fetch uses the presigned URL from the result
    no_creds = {k: v for k, v in stack.env.items() if "ACCESS_KEY" not in k}
    code, out, err = run(["fetch", job_id, "-o", str(tmp_path / "via-url.mp4")], no_creds)
    assert code == ExitCode.OK, err
    assert (tmp_path / "via-url.mp4").read_bytes() == data
    assert "from http://" in out

    # a corrupted object is refused and nothing is written
    s3_client.put_object(Bucket=info["result"]["bucket"], Key=info["result"]["key"], Body=b"not the video")
    bad = tmp_path / "bad.mp4"
    code, _out, err = run(["fetch", job_id, "-o", str(bad)], stack.env)
    assert code == ExitCode.INTEGRITY
    assert "sha256 mismatch" in err and not bad.exists()
    assert not list(tmp_path.glob(".bad.mp4.*"))
    s3_client.put_object(Bucket=info["result"]["bucket"], Key=info["result"]["key"], Body=data)

    # ls and stats see the job, the worker, its group and its fleet
    code, out, _ = run(["ls"], stack.env)
    assert code == 0 and job_id in out
    code, out, _ = run(["stats", "--json"], stack.env)
    stats = json.loads(out)
    assert stats["queues"][0]["name"] == stack.queue and stats["queues"][0]["finished"] >= 1
    (worker,) = stats["workers"]
    assert (worker["group"], worker["fleet_state"]) == ("cpu:2", "ready")
    code, out, _ = run(["stats"], stack.env)
    assert code == 0 and "cpu:2" in out and "ready (2 ranks)" in out


# ==== watch resumes after a lost connection =============================================================


def test_follow_resumes_after_connection_loss(stack: Stack, tcp_proxy_factory) -> None:
    """The producer reaches Redis through a proxy that drops every connection for 1.5 s mid-render; the
    event sequence it reads equals the stream's, with no entry twice and none missing."""
    proxy = tcp_proxy_factory(stack.redis.port)
    settings = load_settings(redis_url=f"redis://127.0.0.1:{proxy.port}/0", queues=[stack.queue])
    direct = ProducerClient(load_settings(redis_url=stack.redis.url, queues=[stack.queue]))
    from ltx_contract.schema import RenderRequest

    job = direct.submit(RenderRequest(prompt="resume", seed=11, **{**TINY, "steps": 12}), max_queue_depth=0)
    client = ProducerClient(settings)
    seen = []
    reconnects = []
    cut = threading.Event()
    for event in client.follow(job.id, on_reconnect=lambda exc, delay: reconnects.append(delay)):
        seen.append(event)
        if event.type == "progress" and not cut.is_set():
            cut.set()
            proxy.block()
            threading.Timer(1.5, proxy.unblock).start()
    assert reconnects, "the connection loss was never noticed"
    ids = [e.id for e in seen]
    assert ids == sorted(set(ids), key=lambda i: tuple(map(int, i.split("-"))))
    recorded = [e.id for e in direct.events(job.id)]
    assert ids == recorded
    steps = [e.data["step"] for e in seen if e.type == "progress" and e.data.get("stage") == "denoise"]
    assert steps == list(range(1, 13))
    assert seen[-1].terminal_state == JobState.UPLOADED.value
    client.close()
    direct.close()


# ==== admission control + backfill ======================================================================


def test_cap_refuses_submit_while_backfill_waits_and_completes(stack: Stack, tmp_path: Path) -> None:
    capped = {**stack.env, "LTX_MAX_QUEUE_DEPTH": "2"}
    filler = tmp_path / "filler.jsonl"
    # Fillers slow enough (a few steps each) that the queue stays full while the next lines run.
    write_requests(filler, [{"prompt": f"filler {i}", **TINY, "steps": 5} for i in range(4)])
    code, out, _ = run(["submit", str(filler), "--max-queue-depth", "0"], capped)
    assert code == 0 and len(out.split()) == 4
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"prompt": "one more", **TINY}))
    code, out, err = run(["submit", str(one)], capped)
    assert code == ExitCode.REFUSED, out + err
    assert "is full: " in err and "/2 jobs waiting" in err

    prompts = tmp_path / "prompts.jsonl"
    write_requests(prompts, [{"prompt": f"backfill {i}", "seed": i, **TINY} for i in range(3)])
    manifest = tmp_path / "manifest.jsonl"
    code, out, err = run(["backfill", str(prompts), "-n", "2", "-m", str(manifest)], capped)
    assert code == ExitCode.OK, out + err
    assert "waiting for room" in err, err  # it met the full queue and waited instead of failing
    records = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert sorted(r["state"] for r in records) == ["uploaded"] * 3
    assert all(r["key"] and len(r["sha256"]) == 64 and r["seconds"] > 0 for r in records), records


def test_backfill_twice_enqueues_nothing_the_second_time(stack: Stack, tmp_path: Path, redis_client) -> None:
    prompts = tmp_path / "prompts.jsonl"
    reqs = [{"prompt": f"twice {i}", "seed": 100 + i, **TINY} for i in range(3)]
    reqs.append(dict(reqs[0]))  # a duplicate line: same content and seed, same job
    write_requests(prompts, reqs)
    manifest = tmp_path / "m.jsonl"
    code, _out, err = run(["backfill", str(prompts), "-n", "3", "-m", str(manifest), "--json"], stack.env)
    assert code == ExitCode.OK, err
    first = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert len(first) == 3 and {r["state"] for r in first} == {"uploaded"}

    code, out, err = run(["backfill", str(prompts), "-n", "3", "-m", str(manifest), "--json"], stack.env)
    assert code == ExitCode.OK, err
    summary = json.loads(out.splitlines()[-1])
    assert (summary["enqueued"], summary["already_done"], summary["duplicates"]) == (0, 3, 1)
    assert len(manifest.read_text().splitlines()) == 3  # nothing new recorded

    # Even without the manifest, Redis knows the jobs: adopted, not enqueued again.
    manifest.unlink()
    code, out, err = run(["backfill", str(prompts), "-n", "3", "-m", str(manifest), "--json"], stack.env)
    assert code == ExitCode.OK, err
    summary = json.loads(out.splitlines()[-1])
    assert (summary["enqueued"], summary["adopted"], summary["uploaded"]) == (0, 3, 3)
    for record in first:
        assert started_count(redis_client, record["job_id"]) == 1


def test_backfill_interrupted_and_resumed_runs_each_prompt_once(stack: Stack, tmp_path: Path, redis_client) -> None:
    prompts = tmp_path / "prompts.jsonl"
    # A few steps per job so the interrupt surely lands while some are still to do (one in flight at a time).
    write_requests(prompts, [{"prompt": f"resume {i}", "seed": 200 + i, **TINY, "steps": 4} for i in range(5)])
    manifest = tmp_path / "m.jsonl"
    args = [sys.executable, "-m", "producer", "backfill", str(prompts), "-n", "1", "-m", str(manifest)]
    env = {**os.environ, **stack.env}
    proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(
            lambda: manifest.exists() and len(manifest.read_text().splitlines()) >= 2, 120, "two jobs done", poll=0.02
        )
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == ExitCode.INTERRUPTED, out + err
    assert "interrupted:" in err and "run the same command again to resume" in err
    done_before = len(manifest.read_text().splitlines())
    assert 2 <= done_before < 5

    resumed = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert resumed.returncode == ExitCode.OK, resumed.stdout + resumed.stderr
    records = [json.loads(line) for line in manifest.read_text().splitlines()]
    ids = [r["job_id"] for r in records]
    assert len(ids) == len(set(ids)) == 5  # every prompt exactly once in the manifest
    assert {r["state"] for r in records} == {"uploaded"}
    for job_id in ids:  # and rendered exactly once
        assert started_count(redis_client, job_id) == 1
        job = Job.fetch(job_id, connection=redis_client, serializer=JSONSerializer)
        assert len(job.results()) == 1


# ==== cancel a running job ==============================================================================


def test_cancel_running_job_keeps_the_fleet(stack: Stack, tmp_path: Path) -> None:
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps({"prompt": "long one", **TINY, "steps": 40}))
    job_id = run(["submit", str(slow), "--max-queue-depth", "0"], stack.env)[1].strip()
    owner = stack.env["LTX_CLIENT"]  # (a client sees its own jobs only)
    client = ProducerClient(load_settings(redis_url=stack.redis.url, queues=[stack.queue], client=owner))
    wait_for(lambda: (client.status(job_id).meta.get("step") or 0) >= 1, 120, "the render to make progress", poll=0.1)
    code, out, _ = run(["cancel", job_id], stack.env)
    assert (code, out.strip().split(";")[0]) == (0, f"stop requested for {job_id}")
    code, out, _ = run(["watch", job_id], stack.env)
    assert code == ExitCode.CANCELLED, out
    assert "cancelled" in out
    # the fleet survived: the next job renders on the same ranks
    quick = tmp_path / "quick.json"
    quick.write_text(json.dumps({"prompt": "after cancel", **TINY}))
    code, out, _ = run(["submit", str(quick), "--watch", "--max-queue-depth", "0"], stack.env)
    assert code == ExitCode.OK, out
    health = json.loads(stack.redis.client().get(next(iter(
        stack.redis.client().scan_iter(match=worker_health_key(f"prodtest-{stack.queue}*"))))))  # fmt: skip
    assert sorted(health["fleet"]["pids"]) == sorted(stack.worker_pids)
    client.close()


def test_backfill_rides_out_a_redis_outage(stack: Stack, tmp_path: Path, tcp_proxy_factory, redis_client) -> None:
    """The producer's Redis connection is cut for ~2.5 s mid-backfill: it waits, then finishes every job
    exactly once (a submit whose reply was lost is adopted, not repeated)."""
    proxy = tcp_proxy_factory(stack.redis.port)
    env = {**stack.env, "LTX_REDIS_URL": f"redis://127.0.0.1:{proxy.port}/0"}
    prompts = tmp_path / "prompts.jsonl"
    # 12 steps: with the background uploader 4 jobs of 3 steps ended before the cut at 1 s (nothing to ride out)
    write_requests(prompts, [{"prompt": f"outage {i}", "seed": 300 + i, **TINY, "steps": 12} for i in range(4)])
    manifest = tmp_path / "m.jsonl"

    def cut() -> None:
        proxy.block()
        threading.Timer(2.5, proxy.unblock).start()

    timer = threading.Timer(1.0, cut)
    timer.start()
    try:
        code, out, err = run(["backfill", str(prompts), "-n", "2", "-m", str(manifest)], env)
    finally:
        timer.cancel()
    assert code == ExitCode.OK, out + err
    assert "Redis unreachable; retrying" in err and "Redis reachable again" in err, err
    records = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert len(records) == len({r["job_id"] for r in records}) == 4
    assert {r["state"] for r in records} == {"uploaded"}
    for record in records:
        assert started_count(redis_client, record["job_id"]) == 1


def test_runner_limits_are_checked_at_the_edge(stack: Stack, tmp_path: Path, redis_client) -> None:
    """Regression: `steps: 200` passed `--dry-run` and `submit` and failed in the worker with `runner_error`
    (the smoke model takes at most 50 steps). The worker publishes its runner's limits; the producer checks
    them before anything is submitted, in `--dry-run` too."""
    over = tmp_path / "over.json"
    over.write_text(json.dumps({"prompt": "too many steps", **TINY, "steps": 200}))
    jobs_before = set(redis_client.scan_iter(match="rq:job:*"))
    for extra in (["--dry-run"], []):
        code, out, err = run(["submit", str(over), *extra], stack.env)
        assert code == ExitCode.USAGE, (extra, out, err)
        assert "steps: 200 is outside [1, 50] accepted by runner 'smoke'" in err and "nothing submitted" in err, err
        assert "Traceback" not in err
    assert set(redis_client.scan_iter(match="rq:job:*")) == jobs_before  # nothing enqueued
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps({"prompt": "fifty steps", **TINY, "steps": 50}))
    code, out, err = run(["submit", str(ok), "--dry-run"], stack.env)
    assert code == 0 and out.strip().endswith(": ok"), (out, err)
    # what the worker published, read back through the client
    with ProducerClient(load_settings(redis_url=stack.env["LTX_REDIS_URL"], queues=[stack.queue])) as client:
        published = client.runner_limits()
    assert published and all(limits.ranges == {"steps": (1.0, 50.0), "audio_latents": (1.0, 6144.0)}
                             for _, limits in published)  # fmt: skip
    # the audio track against the runner's token budget: 257 frames at 1 fps is 6425 audio latents
    long_audio = tmp_path / "long-audio.json"
    long_audio.write_text(json.dumps({"prompt": "slow", **TINY, "num_frames": 257, "frame_rate": 1.0}))
    for extra in (["--dry-run"], []):
        code, out, err = run(["submit", str(long_audio), *extra], stack.env)
        assert code == ExitCode.USAGE and "audio_latents" in err and "6425 is outside [1, 6144]" in err, (out, err)
    assert set(redis_client.scan_iter(match="rq:job:*")) == jobs_before
