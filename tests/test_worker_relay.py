"""The worker's writes to Redis without a worker: the event relay and the upload pipeline's outcome records
(real Redis; a connection that loses replies stands in for a Redis restart at the worst moment)."""

from __future__ import annotations

import json
import time

import pytest
import redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from ltx_contract.keys import EVENT_FIELD_DATA, EVENT_FIELD_TYPE, events_key
from ltx_contract.states import JobState
from worker.protocol.relay import EventRelay

# ==== relay =============================================================================================


def test_relay_stream_meta_summary_and_expiry(redis_client, unique_name):
    q = Queue(unique_name, connection=redis_client, serializer=JSONSerializer)
    job = q.enqueue("worker.job.render", {"prompt": "x"}, meta={"client": "me"})
    relay = EventRelay(redis_client, job, maxlen=20, running_ttl=500)
    relay.state(JobState.STARTED, attempt=1, worker="w", fleet="cpu:1")
    relay.emit({"type": "stage", "stage": "denoise"})
    for step in range(1, 51):
        relay.emit({"type": "progress", "stage": "denoise", "step": step, "total": 50})
    key = events_key(job.id)
    assert 20 <= redis_client.xlen(key) < 60  # approximate MAXLEN trims
    assert 0 < redis_client.ttl(key) <= 500
    _, fields = redis_client.xrevrange(key, count=1)[0]
    last = json.loads(fields[EVENT_FIELD_DATA.encode()])
    assert fields[EVENT_FIELD_TYPE.encode()] == b"progress" and last["step"] == 50 and last["percent"] == 100.0
    meta = Job.fetch(job.id, connection=redis_client, serializer=JSONSerializer).get_meta()
    assert meta["client"] == "me"  # the producer's keys survive
    assert meta["state"] == "started" and meta["step"] == 50 and meta["total"] == 50 and meta["percent"] == 100.0
    assert meta["eta_s"] == 0.0 and meta["worker"] == "w" and meta["attempt"] == 1
    relay.state(JobState.UPLOADED, result={"key": "k"}, ttl=60)
    assert redis_client.ttl(key) <= 60
    meta = Job.fetch(job.id, connection=redis_client, serializer=JSONSerializer).get_meta()
    assert meta["state"] == "uploaded" and meta["result"] == {"key": "k"}
    relay.emit({"type": "weird", "x": 1})
    _, fields = redis_client.xrevrange(key, count=1)[0]
    assert fields[EVENT_FIELD_TYPE.encode()] == b"other"


def test_relay_eta_from_observed_step_rate(redis_client, unique_name):
    job = Queue(unique_name, connection=redis_client, serializer=JSONSerializer).enqueue("worker.job.render", {})
    relay = EventRelay(redis_client, job, maxlen=100, running_ttl=100)
    t0 = time.monotonic()
    relay.emit({"type": "progress", "stage": "denoise", "step": 1, "total": 11})
    time.sleep(0.2)
    relay.emit({"type": "progress", "stage": "denoise", "step": 2, "total": 11})
    elapsed = time.monotonic() - t0
    # one step took between the sleep and everything around it; 9 steps are left (eta rounded to 1 ms)
    assert 9 * 0.2 - 0.001 <= job.meta["eta_s"] <= 9 * elapsed + 0.001


class _LossyLink:
    """A real Redis connection whose pipelines fail as a restart makes them fail: `lose_reply` of them are
    applied and then raise ConnectionError (Redis executed the write, the reply never came back), `refuse`
    of them raise before anything is sent."""

    def __init__(self, client, *, lose_reply: int = 0, refuse: int = 0) -> None:
        self.client, self.lose_reply, self.refuse = client, lose_reply, refuse

    def __getattr__(self, name):
        return getattr(self.client, name)

    def pipeline(self, *args, **kwargs):
        link, pipe = self, self.client.pipeline(*args, **kwargs)
        real_execute = pipe.execute

        def execute(*a, **kw):
            if link.refuse:
                link.refuse -= 1
                pipe.reset()
                raise redis.ConnectionError("Connection refused (test)")
            replies = real_execute(*a, **kw)
            if link.lose_reply:
                link.lose_reply -= 1
                raise redis.ConnectionError("Connection closed by server (test)")
            return replies

        pipe.execute = execute
        return pipe


@pytest.mark.parametrize(("lose_reply", "refuse"), [(1, 0), (2, 0), (0, 2), (1, 1)])
def test_relay_retry_after_a_lost_reply_writes_each_event_once(redis_client, unique_name, lose_reply, refuse):
    """A write applied but unanswered (Redis stopped by SIGTERM) is retried without adding the event again:
    consumers must see one terminal event per job (CI's chaos seed 20240607 saw `uploaded` twice)."""
    job = Queue(unique_name, connection=redis_client, serializer=JSONSerializer).enqueue("worker.job.render", {})
    relay = EventRelay(redis_client, job, maxlen=100, running_ttl=100)
    relay.state(JobState.STARTED, attempt=1)
    relay.writer = _LossyLink(redis_client, lose_reply=lose_reply, refuse=refuse)
    entry_id = relay.state(JobState.UPLOADED, result={"key": "k"}, ttl=60)
    relay.writer = redis_client
    relay.emit({"type": "progress", "stage": "upload", "step": 1, "total": 1})
    key = events_key(job.id)
    states = [json.loads(f[EVENT_FIELD_DATA.encode()]).get("state") for _, f in redis_client.xrange(key)]
    assert states == ["started", "uploaded", None]
    assert redis_client.xrange(key)[1][0].decode() == entry_id  # the id of the entry the lost reply named
    assert 0 < redis_client.ttl(key) <= 60
    meta = Job.fetch(job.id, connection=redis_client, serializer=JSONSerializer).get_meta()
    assert meta["state"] == "uploaded" and meta["result"] == {"key": "k"}


# ==== upload pipeline ===================================================================================


def test_the_final_rq_result_is_written_before_the_uploaded_state(monkeypatch):
    """Whoever sees `uploaded` must find the final result (bucket, key); it used to be written just after the
    state, and a reader in between got RQ's placeholder from when the render returned (KeyError 'bucket')."""
    from types import SimpleNamespace

    from worker.jobs.attempt import JobAttempt
    from worker.stages import upload as pipeline_module

    order: list[str] = []
    record = SimpleNamespace(
        id="j",
        result_ttl=None,
        record_success_after_return=lambda *a, **k: order.append("rq result"),
        finish_if_uploaded=lambda *a, **k: False,
    )
    relay = SimpleNamespace(state=lambda *a, **k: order.append("uploaded state"))
    outcomes = SimpleNamespace(settings=None, worker_name="w", result_ttl=lambda ttl: 60, count=lambda *a: None)
    up = pipeline_module.UploadPipeline.__new__(pipeline_module.UploadPipeline)
    up.uploaded, up.outcomes, up.worker_name, up.on_uploaded = 0, outcomes, "w", None
    up.make_result = lambda *a: {"bucket": "b", "key": "k"}
    attempt = JobAttempt(record, outcomes, relay=relay)
    item = SimpleNamespace(attempt=attempt, recovered=False, job_id="j")
    up._record_success(item, SimpleNamespace(key="k"), 0.1, 0.0)
    assert order == ["rq result", "uploaded state"]


@pytest.mark.parametrize("applied", [True, False])
def test_recording_an_upload_rides_out_a_redis_restart(monkeypatch, redis_client, unique_name, applied):
    """A Redis restart while an upload's outcome was recorded left the job `uploading` until the worker
    restarted (the connection error ended the uploader's item). The record is retried, and a retry after a
    lost reply (`applied`: the MULTI went through) does not write a second result."""
    from types import SimpleNamespace

    from worker.jobs.attempt import JobAttempt
    from worker.rq.record import JobRecord
    from worker.stages import upload as pipeline_module

    job = Queue(unique_name, connection=redis_client, serializer=JSONSerializer).enqueue("worker.job.render", {})
    real, calls = JobRecord.record_success_after_return, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            if applied:
                real(*args, **kwargs)
            raise redis.ConnectionError("Connection closed by server (test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(JobRecord, "record_success_after_return", flaky)
    states: list[str] = []
    relay = SimpleNamespace(state=lambda *a, **k: states.append("uploaded"))
    outcomes = SimpleNamespace(settings=None, worker_name="w", result_ttl=lambda ttl: 60, count=lambda *a: None)
    up = pipeline_module.UploadPipeline.__new__(pipeline_module.UploadPipeline)
    up.uploaded, up.outcomes, up.worker_name, up.on_uploaded = 0, outcomes, "w", None
    up.make_result = lambda *a: {"state": "uploaded", "bucket": "b", "key": "k"}
    item = SimpleNamespace(attempt=JobAttempt(JobRecord(job), outcomes, relay=relay), recovered=True, job_id=job.id)
    up._record_success(item, SimpleNamespace(key="k"), 0.1, 0.0)
    assert len(calls) == 2 and states == ["uploaded"]
    results = [r for r in Job.fetch(job.id, connection=redis_client, serializer=JSONSerializer).results()
               if r.type.name == "SUCCESSFUL"]  # fmt: skip
    assert [r.return_value.get("key") for r in results] == ["k"]
