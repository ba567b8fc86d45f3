"""Worker-side admission (`worker/jobs/admission.py`): the queue-depth cap and the per-client
quota hold whatever a client wrote.

Unit tests of the decision (`plan`), then one real `ltx-worker one` (CPU fleet, fault runner, real Redis and
SeaweedFS) with `LTX_MAX_QUEUE_DEPTH=4` and `LTX_CLIENT_QUOTA=2`, flooded with raw RQ enqueues (no
producer) while a held job keeps its fleet busy, so the whole flood is waiting when the worker looks.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from rq.job import JobStatus

from ltx_contract.states import FailureReason
from tests.support.fleet import JobFleet as AbuseWorker
from tests.support.fleet import running_worker
from tests.support.wait import wait_for
from tests.support.workers import events, wait_state
from worker.jobs.admission_rule import STALE, Waiting, plan
from worker.rq.loop.admission import Admission

pytestmark = pytest.mark.timeout(240)

DEPTH, QUOTA = 4, 2
QF, QE = FailureReason.QUEUE_FULL, FailureReason.QUOTA_EXCEEDED


# ==== the decision ========================================================================================


def _ids(refusals: list[Any]) -> list[tuple[str, str]]:
    return [(r.job_id, r.reason.value) for r in refusals]


def test_plan_refuses_a_clients_jobs_past_its_quota_in_serving_order():
    q = Waiting("q", 5, [("a1", "a"), ("b1", "b"), ("a2", "a"), ("a3", "a"), ("b2", "b")])
    out = plan(["a"], ("a0", "q", "a"), [q], depth_cap=None, quota=3)
    assert out.taken is None  # a: one running + the taken one = 2 before a1
    assert _ids(out.refused[0]) == [("a2", "quota_exceeded"), ("a3", "quota_exceeded")]
    assert out.refused[0][0].details == {"client": "a", "unfinished": 3, "quota": 3}
    assert out.cuts == [5]


def test_plan_refuses_the_taken_job_when_its_client_runs_its_quota_elsewhere():
    out = plan(["a", "a", "b"], ("a9", "q", "a"), [Waiting("q", 1, [("a10", "a")])], depth_cap=None, quota=2)
    assert out.taken is not None and out.taken.reason is QE and out.taken.details["unfinished"] == 2
    assert _ids(out.refused[0]) == [("a10", "quota_exceeded")]  # (the refused taken job does not count)


def test_plan_trims_the_newest_past_the_depth_cap_across_queues_in_priority_order():
    high = Waiting("high", 2, [("h1", "x"), ("h2", "y")])
    low = Waiting("low", 4, [("l1", "z"), ("l2", "w")])  # window shorter than the queue: l3, l4 unknown
    out = plan([], None, [high, low], depth_cap=3, quota=None)
    assert out.cuts == [2, 1]
    assert _ids(out.refused[1]) == [("l2", "queue_full")]  # l3, l4: trimmed by the cut, ids read by the caller
    assert out.refused[1][0].details == {"depth": 6, "cap": 3}


def test_plan_quota_refusals_do_not_use_up_the_depth_cap():
    q = Waiting("q", 5, [("a1", "a"), ("a2", "a"), ("b1", "b"), ("c1", "c"), ("d1", "d")])
    out = plan([], None, [q], depth_cap=3, quota=1)
    assert _ids(out.refused[0]) == [("a2", "quota_exceeded"), ("d1", "queue_full")]
    assert out.cuts == [4]  # a2 leaves by LREM; d1 by the trim


def test_plan_admits_what_a_producer_admits_at_exactly_the_caps():
    # at most `quota` unfinished per client (running + taken + waiting) and at most `cap` waiting
    q = Waiting("q", 4, [("a2", "a"), ("b1", "b"), ("b2", "b"), ("c1", "c")])
    out = plan(["c"], ("a1", "q", "a"), [q], depth_cap=4, quota=2)
    assert out.taken is None and out.refused == [[]] and out.cuts == [4]


def test_plan_ignores_stale_jobs_and_counts_malformed_owners_for_nobody():
    q = Waiting("q", 4, [("s", STALE), ("m1", None), ("m2", None), ("a1", "a")])
    out = plan([STALE, None], ("a0", "q", "a"), [q], depth_cap=None, quota=1)
    assert _ids(out.refused[0]) == [("a1", "quota_exceeded")]
    assert plan([], ("m0", "q", None), [], depth_cap=None, quota=1).taken is None  # refused as invalid_request


def test_plan_counts_an_id_queued_twice_once():
    """A tenant's cancelled job stays in the queue (its Redis user cannot take it out); `producer backfill`
    enqueues the id again, so the queue names one job twice. Counted twice, the second entry was refused
    against its client's quota and ended the job the first entry was about to run."""
    q = Waiting("q", 4, [("a1", "a"), ("a1", "a"), ("a0", "a"), ("r", "a")])
    out = plan(["a"], ("a0", "q", "a"), [q], depth_cap=None, quota=3, running_ids=["r"])
    assert out.taken is None and out.refused == [[]] and out.cuts == [4]  # r running + a0 + a1 = 3
    full = plan([], None, [Waiting("q", 3, [("b1", "b"), ("c1", "c"), ("b1", "b")])], depth_cap=1, quota=None)
    assert full.cuts == [1]
    assert _ids(full.refused[0]) == [("c1", "queue_full")]  # not b1 again: it is admitted and runs


def test_with_tenant_ids_a_forged_owner_counts_for_nobody(redis_client):
    """A tenant can create only `<tenant>-*` hashes but writes their meta itself: a job `mallory-*` that
    names `alice` as its client must not fill alice's quota (it is refused when taken, as invalid_request)."""
    tag = uuid.uuid4().hex[:8]
    forged, own, anon = f"mallory{tag}-1", f"alice{tag}-1", f"alice{tag}-2"
    for job_id, meta in ((forged, {"client": f"alice{tag}"}), (own, {"client": f"alice{tag}"}), (anon, {})):
        redis_client.hset(f"rq:job:{job_id}", mapping={"status": "queued", "meta": json.dumps(meta)})

    class JobClass:
        key_for = staticmethod(lambda job_id: f"rq:job:{job_id}")

    def owners(tenant_ids: bool) -> dict[str, Any]:
        admission = Admission(redis_client, [], depth_cap=None, quota=1, outcomes=None, job_class=JobClass,
                              worker_name="w", max_meta_bytes=1 << 16, tenant_ids=tenant_ids)  # fmt: skip
        return admission._owners_of([forged, own, anon])

    assert owners(True) == {forged: None, own: f"alice{tag}", anon: None}
    assert owners(False) == {forged: f"alice{tag}", own: f"alice{tag}", anon: "anonymous"}


def test_with_tenant_ids_a_forged_taken_job_does_not_spend_its_named_owners_quota(redis_client):
    """The job just taken is counted too: forged (`mallory-*` naming alice), it must not push alice's own
    waiting job past her quota of 1 (the forged one is refused as invalid_request when it runs)."""
    from types import SimpleNamespace

    from rq import Queue
    from rq.serializers import JSONSerializer

    from ltx_contract.keys import REFUSALS_KEY

    tag = uuid.uuid4().hex[:8]
    alice, own, forged = f"alice{tag}", f"alice{tag}-1", f"mallory{tag}-1"
    q = Queue(f"q-{tag}", connection=redis_client, serializer=JSONSerializer)
    redis_client.hset(f"rq:job:{own}", mapping={"status": "queued", "meta": json.dumps({"client": alice})})
    redis_client.rpush(q.key, own)

    class JobClass:
        key_for = staticmethod(lambda job_id: f"rq:job:{job_id}")

    admission = Admission(redis_client, [q], depth_cap=None, quota=1, outcomes=None, job_class=JobClass,
                          worker_name="w", max_meta_bytes=1 << 16, tenant_ids=True)  # fmt: skip
    assert admission.police((SimpleNamespace(id=forged, meta={"client": alice}), q)) is True
    assert redis_client.lrange(q.key, 0, -1) == [own.encode()]  # alice's job still waits ...
    assert not any(own in r.decode() for r in redis_client.lrange(REFUSALS_KEY, 0, -1))  # ... unrefused


def test_a_huge_raw_flood_leaves_a_bounded_share_per_pass_and_nothing_is_lost(redis_client):
    """100k raw pushes were trimmed and queued for recording in one pass (~13 s before the next dequeue). A
    pass now takes at most 1000 of the excess (the newest) off the queue; the next passes take the rest,
    so every id still reaches the refusal list once and a job taken in between waits for one pass only."""
    from rq import Queue
    from rq.job import Job

    from ltx_contract.keys import REFUSALS_KEY

    tag = uuid.uuid4().hex[:8]
    q = Queue(f"q-{tag}", connection=redis_client)
    ids = [f"flood{tag}-{i}" for i in range(2500)]
    with redis_client.pipeline(transaction=False) as pipe:  # (waiting jobs: junk would count for nothing)
        for job_id in ids:
            pipe.hset(Job.key_for(job_id), "status", "queued")
        pipe.execute()
    redis_client.rpush(q.key, *ids)
    redis_client.delete(REFUSALS_KEY)
    admission = Admission(redis_client, [q], depth_cap=5, quota=None, outcomes=None, job_class=Job,
                          worker_name="w", max_meta_bytes=1 << 16)  # fmt: skip
    lengths = []
    while redis_client.llen(q.key) > 5:
        admission.police(None)
        lengths.append(redis_client.llen(q.key))
    assert lengths == [1500, 500, 5]
    refused = [json.loads(r)["job_id"] for r in redis_client.lrange(REFUSALS_KEY, 0, -1)]
    assert sorted(refused) == sorted(ids[5:]) and redis_client.lrange(q.key, 0, -1) == [i.encode() for i in ids[:5]]
    redis_client.delete(REFUSALS_KEY, q.key, *(Job.key_for(i) for i in ids))


def test_plan_counts_nothing_past_the_window_until_the_cap_is_found_ahead():
    """Entries past the window are unknown (junk there must not end a job behind it): trimmed only when the
    cap's worth of jobs is admitted ahead of them, else left for a later pass."""
    junk = [(f"x{i}", STALE) for i in range(3)]
    out = plan([], None, [Waiting("q", 10, [*junk, ("j1", "a")])], depth_cap=2, quota=None)
    assert out.cuts == [10] and out.refused == [[]]
    out = plan([], None, [Waiting("q", 10, [*junk, ("j1", "a"), ("j2", "b")])], depth_cap=2, quota=None)
    assert out.cuts == [5] and out.refused == [[]]


@pytest.mark.parametrize("quota", [None, 10])  # (10: a quota on, anonymous jobs under it)
def test_ids_without_a_job_pushed_ahead_of_admitted_jobs_count_for_nothing(redis_client, quota):
    """Regression: with no ACL, LTX_MAX_QUEUE_DEPTH=5, a client's admitted job waiting, then 10 ids with no
    job hash LPUSHed onto the shared queue: the pass counted 11 waiting and ended the job `queue_full`.
    Entries that are not jobs (no hash, an ended job) count for nothing, in the worker's pass and in the
    producer's admission alike (`ltx_contract.queue_depth`)."""
    from rq import Queue
    from rq.job import Job

    from ltx_contract.keys import REFUSALS_KEY
    from producer.admission import AdmissionPolicy, enqueue_admitted

    tag = uuid.uuid4().hex[:8]
    q = Queue(f"q-{tag}", connection=redis_client)
    redis_client.delete(REFUSALS_KEY)
    policy = AdmissionPolicy(max_queue_depth=5)
    admitted = [enqueue_admitted(q, q.create_job("worker.job.render", args=({"prompt": "p"},)), policy=policy,
                                 counted_queues=[q], client=None) for _ in range(2)]  # fmt: skip
    ended = q.create_job("worker.job.render", args=({"prompt": "p"},))
    ended.save()
    redis_client.hset(ended.key, "status", "finished")
    redis_client.lpush(q.key, *[f"junk{tag}-{i}" for i in range(10)], ended.id, ended.id)
    admission = Admission(redis_client, [q], depth_cap=5, quota=quota, outcomes=None, job_class=Job,
                          worker_name="w", max_meta_bytes=1 << 16)  # fmt: skip
    admission.before_dequeue()
    assert redis_client.llen(REFUSALS_KEY) == 0
    assert redis_client.lrange(q.key, -2, -1) == [j.id.encode() for j in admitted]
    # the producer counts the same: three more jobs fit under the cap of 5, the sixth does not
    for _ in range(3):
        enqueue_admitted(q, q.create_job("worker.job.render", args=({"prompt": "p"},)), policy=policy,
                         counted_queues=[q], client=None)  # fmt: skip
    from producer.admission import AdmissionRefused

    with pytest.raises(AdmissionRefused, match="5/5"):
        enqueue_admitted(q, q.create_job("worker.job.render", args=({"prompt": "p"},)), policy=policy,
                         counted_queues=[q], client=None)  # fmt: skip
    admission.before_dequeue()
    assert redis_client.llen(REFUSALS_KEY) == 0 and redis_client.llen(q.key) == 17
    redis_client.delete(q.key, REFUSALS_KEY)


def test_plan_without_limits_refuses_nothing():
    out = plan(["a"] * 5, ("a", "q", "a"), [Waiting("q", 10**6, [("a1", "a")])], depth_cap=None, quota=None)
    assert out.taken is None and out.refused == [[]] and out.cuts == [10**6]


# ==== a real worker, raw RQ enqueues ======================================================================


class Worker(AbuseWorker):
    def enqueue(self, prompt: str = "t", *, client: str | None = None, meta: dict | None = None, **kw: Any) -> Any:
        meta = {**({"client": client} if client is not None else {}), **(meta or {})}
        return super().enqueue(prompt, meta=meta, **kw)

    def refusals(self, reason: str) -> float:
        return self.metric(f'ltx_worker_jobs_total{{group="cpu:1",outcome="failed",reason="{reason}"}}')


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, redis_server: Any, s3_server: Any) -> Any:
    tmp = tmp_path_factory.mktemp("admission")
    with running_worker(tmp, redis_server, s3_server, handle=Worker, max_queue_depth=DEPTH,
                        client_quota=QUOTA) as w:  # fmt: skip
        yield w


class Held:
    """A job (of `client`) that keeps the fleet busy until released: whatever is enqueued meanwhile is
    all waiting when the worker next looks."""

    def __init__(self, worker: Worker, tmp_path: Path, client: str = "holder") -> None:
        self.gate = tmp_path / f"gate-{uuid.uuid4().hex[:6]}"
        self.job = worker.enqueue(f"t hold={self.gate}", client=client)
        wait_state(self.job, "rendering", 60, worker.proc)

    def release(self) -> None:
        self.gate.touch()


def _outcomes(worker: Worker, jobs: list[Any], timeout: float = 90) -> list[str]:
    """Each job's end: `uploaded` or the failure reason."""

    def ended() -> list[str] | None:
        out = []
        for job in jobs:
            meta = job.get_meta(refresh=True)
            if meta.get("state") == "uploaded":
                out.append("uploaded")
            elif meta.get("state") == "failed" and job.get_status(refresh=True) == JobStatus.FAILED:
                out.append(meta["error"]["reason"])
            else:
                return None
        return out

    return wait_for(ended, timeout, "jobs ended", poll=0.2, on_fail=worker.proc.log_tail)


def _states(conn: Any, job_id: str) -> list[str]:
    return [e["state"] for e in events(conn, job_id) if e["type"] == "state"]


def test_a_raw_flood_past_the_depth_cap_renders_exactly_the_cap(worker, tmp_path):
    worker.idle()
    before = worker.refusals("queue_full")
    held = Held(worker, tmp_path)
    flood = [worker.enqueue(client=f"c{i}") for i in range(DEPTH + 5)]  # distinct clients: no quota in play
    held.release()
    assert _outcomes(worker, flood) == ["uploaded"] * DEPTH + ["queue_full"] * 5  # the oldest DEPTH run
    refused = flood[-1]
    meta = refused.get_meta(refresh=True)
    assert meta["error"]["retryable"] is False and meta["error"]["cap"] == DEPTH, meta["error"]
    assert meta["error"]["depth"] == DEPTH + 5
    assert _states(worker.conn, refused.id) == ["failed"]  # never started
    assert worker.conn.zscore(f"rq:failed:{worker.queue}", refused.id) is not None  # RQ's failed registry
    assert worker.refusals("queue_full") == before + 5
    assert _outcomes(worker, [held.job]) == ["uploaded"]
    assert worker.idle()["fleet"]["alive"]


def test_junk_pushed_ahead_of_waiting_jobs_ends_none_of_them(worker, tmp_path):
    """Regression: no ACL, the worker busy, admitted jobs waiting, then 10 ids with no job hash LPUSHed
    onto the queue: the pass counted them and ended a waiting job `queue_full`. They count for nothing and
    the dequeue drops them. (This worker has a quota too; the pass without one, where the count went
    wrong: `test_ids_without_a_job_pushed_ahead_of_admitted_jobs_count_for_nothing`.)"""
    worker.idle()
    before = worker.refusals("queue_full")
    held = Held(worker, tmp_path)
    jobs = [worker.enqueue(client=f"w{i}") for i in range(DEPTH - 1)]
    worker.conn.lpush(f"rq:queue:{worker.queue}", *[f"junk-{uuid.uuid4().hex[:6]}-{i}" for i in range(10)])
    held.release()
    assert _outcomes(worker, [held.job, *jobs]) == ["uploaded"] * DEPTH
    assert worker.refusals("queue_full") == before
    wait_for(lambda: worker.conn.llen(f"rq:queue:{worker.queue}") == 0, 30, "junk dropped")


def test_a_client_past_its_quota_is_refused_while_another_clients_jobs_all_run(worker, tmp_path):
    worker.idle()
    before = worker.refusals("quota_exceeded")
    held = Held(worker, tmp_path)
    jobs = [worker.enqueue(client=c) for c in ("greedy", "polite", "greedy", "polite", "greedy", "greedy")]
    held.release()  # (its job is finished for RQ before the worker looks: it counts for nobody then)
    ends = _outcomes(worker, jobs)
    assert ends == ["uploaded"] * 4 + ["quota_exceeded"] * 2, ends  # (and no queue_full: 4 admitted = the cap)
    error = jobs[4].get_meta(refresh=True)["error"]
    assert error["client"] == "greedy" and error["unfinished"] == QUOTA and error["quota"] == QUOTA, error
    assert worker.refusals("quota_exceeded") == before + 2


def test_jobs_without_an_owner_share_the_anonymous_quota(worker, tmp_path):
    worker.idle()
    held = Held(worker, tmp_path)
    jobs = [worker.enqueue() for _ in range(QUOTA + 2)]  # raw enqueues naming no client
    held.release()
    assert _outcomes(worker, jobs) == ["uploaded"] * QUOTA + ["quota_exceeded"] * 2
    assert jobs[-1].get_meta(refresh=True)["error"]["client"] == "anonymous"


def test_the_taken_job_is_refused_when_its_client_runs_its_quota_on_other_workers(worker):
    """Two of `busy`'s jobs run elsewhere (as another worker's executions look in RQ's started registry)."""
    from rq import Queue
    from rq.serializers import JSONSerializer

    from ltx_contract.keys import RENDER_FUNC

    worker.idle()
    conn = worker.conn
    q = Queue(worker.queue, connection=conn, serializer=JSONSerializer)
    elsewhere = []
    for _ in range(QUOTA):  # hashes and started-registry entries only: never in this worker's queue
        job = q.create_job(RENDER_FUNC, args=({"prompt": "t"},), meta={"client": "busy"}, status=JobStatus.STARTED)
        job.save()
        conn.zadd(f"rq:wip:{worker.queue}", {f"{job.id}:elsewhere": time.time() + 3600})
        elsewhere.append(job)
    try:
        job = worker.enqueue(client="busy")
        assert _outcomes(worker, [job]) == ["quota_exceeded"]
        assert _states(conn, job.id) == ["failed"]
        other = worker.enqueue(client="idle-client")
        assert _outcomes(worker, [other]) == ["uploaded"]
    finally:
        for job in elsewhere:
            conn.zrem(f"rq:wip:{worker.queue}", f"{job.id}:elsewhere")
            conn.delete(job.key)


def test_a_malformed_owner_is_refused_before_it_runs(worker):
    worker.idle()
    before = worker.refusals("invalid_request")
    pids = worker.health()["fleet"]["pids"]
    for bad in ("x:*\nFAKE", "x" * 65, "", 42):
        job = worker.enqueue(meta={"client": bad})
        assert _outcomes(worker, [job]) == ["invalid_request"]
        assert "owner" in job.get_meta(refresh=True)["error"]["message"]
        assert _states(worker.conn, job.id) == ["failed"]
    assert worker.refusals("invalid_request") == before + 4
    assert worker.idle()["fleet"]["pids"] == pids  # warm, untouched


def test_producer_admitted_jobs_at_exactly_both_caps_all_run(worker, tmp_path, redis_server):
    """The producer admits up to the caps (same values); the worker must run every one of them. (A guard
    against over-refusal: it passes without worker-side admission too; an off-by-one in `plan` fails it.)"""
    from ltx_contract.schema import RenderRequest
    from producer.admission import AdmissionRefused
    from producer.client import ProducerClient
    from producer.settings import ProducerSettings

    worker.idle()
    before = worker.refusals("queue_full") + worker.refusals("quota_exceeded")
    gate = tmp_path / "gate"
    settings = ProducerSettings(redis_url=redis_server.url, queues=[worker.queue], max_queue_depth=DEPTH,
                                client_quota=QUOTA)  # fmt: skip
    request = {"width": 64, "height": 64, "num_frames": 9}
    with ProducerClient(settings) as client:
        held = client.submit(RenderRequest(prompt=f"t hold={gate}", **request), client="a")
        wait_state(held, "rendering", 60, worker.proc)
        jobs = [client.submit(RenderRequest(prompt="t", **request), client=c) for c in ("a", "b", "b", "c")]
        with pytest.raises(AdmissionRefused):  # the queue is full: the producer's early answer
            client.submit(RenderRequest(prompt="t", **request), client="d")
        with pytest.raises(AdmissionRefused):  # (and `a` is at its quota)
            client.submit(RenderRequest(prompt="t", **request), client="a", max_queue_depth=0)
    gate.touch()
    assert _outcomes(worker, [held, *jobs]) == ["uploaded"] * 5
    assert worker.refusals("queue_full") + worker.refusals("quota_exceeded") == before
