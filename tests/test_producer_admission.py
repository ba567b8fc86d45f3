"""The producer's admission (`producer.admission.enqueue_admitted`) against a real Redis: one atomic decision
per submit under concurrent submitters, and which existing hashes take a job id."""

from __future__ import annotations

import threading

import pytest

from ltx_contract.keys import RENDER_FUNC
from producer.admission import AdmissionPolicy, AdmissionRefused, JobExists, enqueue_admitted
from producer.client import ProducerClient
from producer.settings import load_settings


def test_a_field_written_after_a_jobs_deletion_does_not_take_its_id(redis_url: str, unique_name: str) -> None:
    """A late write to a deleted job's hash (a worker recording an outcome just after `producer backfill`
    forgot the job) leaves a hash without `data` or `created_at`: no client can read it as a job, so it must
    not refuse the id as taken (the backfill retried three times and gave up). A real job still does."""
    settings_ = load_settings(redis_url=redis_url, queues=[f"q-{unique_name}"], client="debris")
    client = ProducerClient(settings_)
    queue = client.queue()
    job = queue.create_job(RENDER_FUNC, args=({"prompt": "p"},), job_id=f"debris-{unique_name}")
    client.connection.hset(job.key, mapping={"status": "canceled", "ended_at": "2026-01-01T00:00:00.000000Z"})
    policy = AdmissionPolicy(max_queue_depth=None)
    enqueue_admitted(queue, job, policy=policy, counted_queues=[queue], client="debris")
    fields = client.connection.hgetall(job.key)
    assert fields[b"status"] == b"queued" and not fields.get(b"ended_at") and b"data" in fields
    assert queue.job_ids == [job.id]
    twin = queue.create_job(RENDER_FUNC, args=({"prompt": "p"},), job_id=job.id)
    with pytest.raises(JobExists):
        enqueue_admitted(queue, twin, policy=policy, counted_queues=[queue], client="debris")
    client.close()


def test_admission_is_atomic_under_concurrent_submits(redis_url: str, unique_name: str) -> None:
    """40 threads race for 7 slots: exactly 7 get in (WATCH/MULTI re-decides on every conflict)."""
    settings_ = load_settings(redis_url=redis_url, queues=[f"q-{unique_name}"], client="racer")
    client = ProducerClient(settings_)
    queue = client.queue()
    outcomes: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        job = queue.create_job(RENDER_FUNC, args=({"prompt": f"p{i}"},))
        try:
            enqueue_admitted(queue, job, policy=AdmissionPolicy(max_queue_depth=7), counted_queues=[queue],
                             client="racer")  # fmt: skip
            result = "ok"
        except AdmissionRefused:
            result = "refused"
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count("ok") == 7
    assert queue.count == 7
    client.close()


# ==== status / watch / cancel without a worker ==========================================================
