"""Writes that must happen once, when Redis executes them and the reply never arrives (a restart cuts the
connection after the write: Redis persisted it, the client saw an error). A TCP proxy in front of a real
Redis drops the reply (`TcpProxy.drop_replies`); redis-py's own retries and ours must not repeat the write,
and the writer must not mistake its own write for somebody else's."""

from __future__ import annotations

import json

import redis
from rq import Queue
from rq.serializers import JSONSerializer

from devstack.tcp_proxy import TcpProxy
from ltx_contract.keys import EVENT_FIELD_DATA, RENDER_FUNC, events_key
from ltx_contract.states import JobState
from worker.protocol.relay import EventRelay


def _proxied(redis_server_factory):
    server = redis_server_factory()
    proxy = TcpProxy(server.port).start()
    return proxy, redis.Redis(host="127.0.0.1", port=proxy.port, socket_timeout=5)


def test_relay_event_once_when_redis_executed_it_but_the_reply_was_lost(redis_server_factory, unique_name):
    """An event's write cut after Redis ran it is in the stream once (redis-py 8 re-sent it by itself:
    CI's chaos seed 20240607 saw a job's `uploaded` event twice)."""
    proxy, conn = _proxied(redis_server_factory)
    try:
        job = Queue(unique_name, connection=conn, serializer=JSONSerializer).enqueue("worker.job.render", {})
        relay = EventRelay(conn, job, maxlen=100, running_ttl=100)
        relay.state(JobState.STARTED, attempt=1)
        proxy.drop_replies(1)
        relay.state(JobState.UPLOADED, result={"key": "k"}, ttl=60)
        states = [json.loads(f[EVENT_FIELD_DATA.encode()]).get("state") for _, f in conn.xrange(events_key(job.id))]
        assert states == ["started", "uploaded"]
    finally:
        conn.close()
        proxy.stop()


def test_submit_whose_enqueue_reply_was_lost_is_one_job_and_succeeds(redis_server_factory, unique_name):
    """The producer's admission transaction (WATCH, MULTI/EXEC) ran, its EXEC reply was cut: the retry must
    find its own job (not report it as a duplicate of somebody else's) and push it once."""
    from producer.admission import AdmissionPolicy, enqueue_admitted

    proxy, conn = _proxied(redis_server_factory)
    try:
        queue = Queue(unique_name, connection=conn, serializer=JSONSerializer)
        job = queue.create_job(RENDER_FUNC, args=({"prompt": "p"},), job_id=f"{unique_name}-job")
        proxy.drop_replies(1, after=b"EXEC")
        enqueued = enqueue_admitted(queue, job, policy=AdmissionPolicy(max_queue_depth=10), counted_queues=[queue],
                                    client="me")  # fmt: skip
        assert enqueued.id == job.id
        assert conn.lrange(queue.key, 0, -1) == [job.id.encode()]
        assert conn.zrange("ltx:producer:client:me:jobs", 0, -1) == [job.id.encode()]
    finally:
        conn.close()
        proxy.stop()


def test_requeue_after_a_failed_upload_pushes_the_id_once_through_a_lost_reply(redis_server_factory, unique_name):
    """A job whose upload failed (RQ saw it finish at `rendered`) is put back on its queue; a cut reply made
    redis-py re-send the whole transaction, the id was queued twice, and two idle workers could each take an
    entry. Retried with its token (as the upload pipeline does), it is queued once."""
    import uuid

    from rq.job import JobStatus
    from rq.registry import FinishedJobRegistry

    from ltx_contract.redis_retry import with_redis_retry
    from worker.rq.record import JobRecord

    proxy, conn = _proxied(redis_server_factory)
    try:
        queue = Queue(unique_name, connection=conn, serializer=JSONSerializer)
        job = queue.enqueue(RENDER_FUNC, {"prompt": "p"})
        conn.lpop(queue.key)  # taken by a worker, which returned at `rendered`: RQ recorded it finished
        finished = FinishedJobRegistry(queue.name, connection=conn)
        with conn.pipeline() as pipe:
            job.set_status(JobStatus.FINISHED, pipeline=pipe)
            finished.add(job, ttl=60, pipeline=pipe)
            pipe.expire(job.key, 60)
            pipe.execute()
        token = uuid.uuid4().hex
        proxy.drop_replies(1, after=b"EXEC")
        with_redis_retry(lambda: JobRecord(job).requeue_after_return(token))
        assert conn.lrange(queue.key, 0, -1) == [job.id.encode()]
        assert job.get_status(refresh=True) == JobStatus.QUEUED and job.id not in finished.get_job_ids()
        assert conn.ttl(job.key) == -1
        JobRecord(job).requeue_after_return(token)  # (a retry that finds its own token writes nothing)
        assert conn.lrange(queue.key, 0, -1) == [job.id.encode()]
    finally:
        conn.close()
        proxy.stop()
