"""The RQ wing (`worker.rq`) against the installed RQ: the version it is pinned to, and every RQ signature, attribute
and string it (and `FleetWorker`'s overrides) relies on. An RQ upgrade that changes one fails here, not in
production (RQ's main branch already changed `perform_job`'s signature)."""

from __future__ import annotations

import inspect
import re
import time
import uuid
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import rq
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.registry import CanceledJobRegistry, StartedJobRegistry
from rq.worker import SimpleWorker

from worker.rq import RQ_MINOR
from worker.rq.loop import registries, unstarted
from worker.rq.record import JobRecord
from worker.runtime.fleet_worker import FleetWorker

ROOT = Path(__file__).resolve().parent.parent


def _params(fn: object) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()]  # type: ignore[arg-type]


def test_rq_is_the_pinned_minor_version() -> None:
    major, minor = (int(x) for x in version("rq").split(".")[:2])
    assert (major, minor) == RQ_MINOR
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"rq>={major}.{minor},<{major}.{minor + 1}"' in pyproject


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("execute_job", ["self", "job", "queue"]),
        ("perform_job", ["self", "job", "queue"]),
        ("prepare_execution", ["self", "job"]),
        ("cleanup_execution", ["self", "job", "pipeline"]),
        ("handle_job_failure", ["self", "job", "queue", "started_job_registry", "exc_string"]),
        ("handle_execution_ended", ["self", "job", "queue", "heartbeat_ttl"]),
        ("handle_exception", ["self", "job", "exc_info"]),
        ("dequeue_job_and_maintain_ttl", ["self", "timeout", "max_idle_time"]),
        ("heartbeat", ["self", "timeout", "pipeline"]),
        ("get_heartbeat_ttl", ["self", "job"]),
        ("request_stop", ["self", "signum", "frame"]),
        ("request_force_stop", ["self", "signum", "frame"]),
        ("kill_horse", ["self", "sig"]),
        ("teardown", ["self"]),
        ("serialize", ["self"]),
        ("clean_registries", ["self"]),
        ("prepare_job_execution", ["self", "job", "remove_from_intermediate_queue"]),
        ("reorder_queues", ["self", "reference_queue"]),
    ],
)
def test_worker_methods_we_override_or_call_keep_their_signatures(name: str, params: list[str]) -> None:
    assert _params(getattr(SimpleWorker, name)) == params
    ours = getattr(FleetWorker, name)
    if ours is not getattr(SimpleWorker, name):  # our override (FleetWorker's or a base's) accepts what RQ passes
        assert _params(ours)[: len(params)] == params


def test_rq_internals_used_by_rqcompat_exist(redis_client) -> None:
    worker = SimpleWorker(["q"], connection=redis_client)
    for attribute in ("_stopped_job_id", "_shutdown_requested_date", "_exc_handlers", "execution", "key",
                      "_stop_requested", "_ordered_queues"):  # fmt: skip
        assert hasattr(worker, attribute), attribute
    assert _params(Execution.heartbeat) == ["self", "started_job_registry", "ttl", "pipeline"]
    assert _params(Job.heartbeat) == ["self", "timestamp", "ttl", "pipeline", "xx"]
    assert _params(Job._execute) == ["self"] and "self._execute()" in inspect.getsource(Job.perform)
    assert isinstance(SimpleWorker.horse_pid, property)
    assert _params(StartedJobRegistry.cleanup) == ["self", "timestamp", "exception_handlers"]
    assert _params(StartedJobRegistry.add_execution) == ["self", "execution", "pipeline", "ttl", "xx"]
    # worker.rq.loop.admission reads running job ids from started-registry members `<job id>:<execution id>`
    member = Execution(id="e1", job_id="j1", connection=redis_client).composite_key
    assert registries.started_member_job_id(member.encode()) == "j1"
    assert registries.started_member_job_id(b"j1") == "j1"
    # the intermediate-queue cleanup fails a stuck job with this exact string (the wing matches on it)
    source = (Path(rq.__file__).parent / "intermediate_queue.py").read_text()
    assert f"exc_string='{registries.STUCK_IN_INTERMEDIATE}." in source


def test_rq_queue_internals_used_by_tenant_queues_exist() -> None:
    """`worker.rq.loop.queues` replaces `Queue.dequeue_any` and moves ids to RQ's intermediate list itself;
    `ltx_contract.rq_client.enqueue_unregistered` is `enqueue_job` minus its SADD; `live_workers` is `Worker.all` minus
    its SREM."""
    from rq import worker_registration
    from rq.intermediate_queue import IntermediateQueue
    from rq.queue import Queue
    from rq.worker import Worker

    from worker.rq.loop.queues import TakingQueue

    dequeue = ["cls", "queues", "timeout", "connection", "job_class", "serializer", "death_penalty_class"]
    assert _params(Queue.dequeue_any.__func__) == dequeue and _params(TakingQueue.dequeue_any.__func__) == dequeue
    assert IntermediateQueue.get_intermediate_queue_key("rq:queue:x") == "rq:queue:x:intermediate"
    assert _params(Queue._enqueue_job) == ["self", "job", "pipeline", "at_front", "unique"]
    enqueue = inspect.getsource(Queue.enqueue_job)
    assert "sadd(self.redis_queues_keys" in enqueue and "_enqueue_job(" in enqueue
    assert Queue.redis_queues_keys == "rq:queues" and Worker.redis_worker_namespace_prefix == "rq:worker:"
    assert _params(worker_registration.get_keys) == ["queue", "connection"]
    assert "remove_from_intermediate_queue = len(self.queues) == 1" in inspect.getsource(SimpleWorker.perform_job)


def test_rq_maintenance_steps_mirrored_by_rqcompat_exist() -> None:
    """`registries.clean_registries` repeats RQ's maintenance steps with its own lock: RQ's must still be these."""
    from rq import worker_registration
    from rq.intermediate_queue import IntermediateQueue
    from rq.queue import Queue
    from rq.registry import clean_registries

    assert _params(clean_registries) == ["queue", "exception_handlers"]
    assert _params(worker_registration.clean_worker_registry) == ["queue"]
    assert _params(IntermediateQueue.cleanup) == ["self", "worker", "queue"]
    cleanup = inspect.getsource(IntermediateQueue.cleanup)  # (`clean_intermediate` repeats these steps)
    for step in (
        "set_first_seen(job_id)",
        "should_be_cleaned_up(job_id)",
        "started_job_registry",
        f"exc_string='{registries.STUCK_IN_INTERMEDIATE}.'",
    ):
        assert step in cleanup, step
    assert isinstance(Queue.registry_cleaning_key, property) and callable(Queue.release_maintenance_lock)
    source = inspect.getsource(SimpleWorker.clean_registries)
    assert "ex=899" in (Path(rq.__file__).parent / "queue.py").read_text() and "acquire_maintenance_lock" in source


def test_a_cleanup_lock_is_bounded_and_released_even_when_the_cleanup_fails(redis_client, monkeypatch) -> None:
    """A worker killed mid-cleanup (or a Redis restart) left RQ's 899 s lock behind and stopped abandoned-job
    recovery on the queue for 15 minutes. Ours lives `lock_ttl_s` and is released whatever happens."""
    from rq.queue import Queue

    from worker.rq.loop.endings import maintenance_lock_ttl

    queue = Queue("cleanq", connection=redis_client)
    worker = SimpleWorker([queue], connection=redis_client)
    seen: list[int] = []

    def failing_clean(q, handlers):
        seen.append(redis_client.ttl(q.registry_cleaning_key))
        raise ConnectionError("Redis went away mid-cleanup")

    monkeypatch.setattr(registries, "clean_queue_registries", failing_clean)
    with pytest.raises(ConnectionError):
        registries.clean_registries(worker, lock_ttl_s=30)
    assert 0 < seen[0] <= 30  # while held: bounded (RQ's own: 899)
    assert not redis_client.exists(queue.registry_cleaning_key)  # released on the way out
    monkeypatch.undo()
    registries.clean_registries(worker, lock_ttl_s=30)  # the real steps run and record the time
    assert worker.last_cleaned_at is not None and not redis_client.exists(queue.registry_cleaning_key)
    assert maintenance_lock_ttl(2) == 30 and maintenance_lock_ttl(60) == 180


def test_an_upload_recorded_twice_leaves_one_uploaded_result(redis_client) -> None:
    """A spool recovery can record an upload its first owner recorded already (a crash between RQ's result
    and the `uploaded` state): RQ must still hold one `uploaded` result, which the chaos checker counts."""
    from rq.queue import Queue
    from rq.serializers import JSONSerializer

    queue = Queue("twice", connection=redis_client, serializer=JSONSerializer)
    job = queue.enqueue("worker.job.render", {"prompt": "x"})
    result = {"state": "uploaded", "key": f"videos/{job.id}/video.mp4", "bucket": "b"}
    for recovered in (False, True):
        JobRecord(job).record_success_after_return(result, 60, "w", recovered=recovered)
    uploads = [r for r in job.results() if r.return_value and r.return_value.get("state") == "uploaded"]
    assert len(uploads) == 1 and uploads[0].return_value["bucket"] == "b"
    other = {**result, "key": "videos/other/video.mp4"}  # a different object is a different upload
    JobRecord(job).record_success_after_return(other, 60, "w", recovered=False)
    assert len([r for r in job.results() if r.return_value and r.return_value.get("state") == "uploaded"]) == 2


def test_a_cancelled_job_deleted_after_its_dequeue_is_not_written_back(redis_client) -> None:
    """A tenant's cancelled job waits in the queue until a worker takes and records it; `producer backfill`
    may delete the ended job (to enqueue its id again) between that dequeue and the record. The record used
    to recreate the hash with three fields (no data: unreadable, yet the id taken), and the backfill gave up
    with "it keeps changing" (CI). It is written only to the submission the worker loaded."""
    from rq.queue import Queue
    from rq.serializers import JSONSerializer

    queue = Queue(f"cancelled-{uuid.uuid4().hex[:6]}", connection=redis_client, serializer=JSONSerializer)

    def dequeued(prompt: str) -> Any:
        job = queue.enqueue("worker.job.render", {"prompt": prompt})
        redis_client.lmove(queue.key, queue.intermediate_queue_key)  # (as RQ's dequeue does)
        return job

    recorded = dequeued("kept")  # the usual case: recorded as RQ records a cancelled queued job
    assert unstarted.drop_cancelled_dequeued(recorded, queue, 60)
    assert recorded.get_status(refresh=True) == JobStatus.CANCELED
    assert recorded.id in CanceledJobRegistry(queue.name, connection=redis_client).get_job_ids()

    deleted = dequeued("deleted")
    redis_client.delete(deleted.key)
    assert not unstarted.drop_cancelled_dequeued(deleted, queue, 60)
    assert not redis_client.exists(deleted.key)

    replaced = dequeued("replaced")
    redis_client.delete(replaced.key)
    time.sleep(0.002)  # (RQ's created_at has microseconds: the new submission's differs)
    again = queue.enqueue("worker.job.render", {"prompt": "replaced"}, job_id=replaced.id)
    assert not unstarted.drop_cancelled_dequeued(replaced, queue, 60)
    assert again.get_status(refresh=True) == JobStatus.QUEUED
    assert not redis_client.hget(again.key, "ended_at")
    assert redis_client.ttl(again.key) == -1
    assert redis_client.llen(queue.intermediate_queue_key) == 0
    assert redis_client.lrange(queue.key, 0, -1) == [again.id.encode()]


def _clean_intermediate(redis_client: Any, monkeypatch: Any, queue: Any, jobs: list[Any]) -> tuple[Any, list[str]]:
    """`jobs` in `queue`'s intermediate list, first seen 10 minutes ago, then RQ's cleanup of that list by a
    `FleetWorker` (`registries.clean_intermediate`, RQ's steps): (the list, the ids it recorded lost)."""
    from rq.intermediate_queue import IntermediateQueue
    from rq.utils import now

    intermediate = IntermediateQueue(queue.key, connection=redis_client)
    for job in jobs:
        redis_client.rpush(intermediate.key, job.id)
        redis_client.set(intermediate.get_first_seen_key(job.id), now().timestamp() - 600)
    worker = FleetWorker.__new__(FleetWorker)
    lost: list[str] = []
    monkeypatch.setattr(FleetWorker, "_record_lost", lambda self, job, message: lost.append(job.id))
    monkeypatch.setattr(SimpleWorker, "handle_job_failure", lambda self, job, queue, *a, **k: None)
    registries.clean_intermediate(worker, queue)
    return intermediate, lost


def test_a_stale_intermediate_entry_does_not_queue_a_job_twice(redis_client, monkeypatch) -> None:
    """A worker SIGKILLed between taking a job and starting it leaves the id in RQ's intermediate list. When
    the job has been queued again meanwhile (the abandoned-job cleanup), RQ's intermediate cleanup used to
    re-queue it a second time, and it rendered twice (chaos suite). Only a job absent from its queue is lost."""
    from rq.queue import Queue
    from rq.serializers import JSONSerializer

    queue = Queue("stale", connection=redis_client, serializer=JSONSerializer)
    waiting = queue.enqueue("worker.job.render", {"prompt": "x"})  # queued again: in the queue list
    stuck = queue.create_job("worker.job.render", args=({"prompt": "y"},))  # queued, but in no list
    stuck.save()
    intermediate, lost = _clean_intermediate(redis_client, monkeypatch, queue, [waiting, stuck])
    assert lost == [stuck.id]  # the really stuck one is recorded lost (and re-queued by its budget)
    assert redis_client.lrange(queue.key, 0, -1).count(waiting.id.encode()) == 1
    assert intermediate.get_job_ids() == []
    assert registries.stale_intermediate_entry(waiting, queue) and not registries.stale_intermediate_entry(stuck, queue)


def test_another_queues_job_on_an_intermediate_list_is_not_recorded_lost(redis_client, monkeypatch) -> None:
    """Wherever clients can write RQ's intermediate lists (a Redis without ACLs: the chaos soak pushes there),
    another queue's waiting job id pushed onto one was taken for a job this queue's worker lost: recorded
    `worker_lost` (spending its budget) and queued a second time. An entry whose job is not this queue's is
    stale, whatever its status."""
    from rq.queue import Queue
    from rq.serializers import JSONSerializer

    mine = Queue("mine", connection=redis_client, serializer=JSONSerializer)
    theirs = Queue("theirs", connection=redis_client, serializer=JSONSerializer)
    foreign = theirs.create_job("worker.job.render", args=({"prompt": "z"},))  # queued, in no list of `mine`
    foreign.save()
    intermediate, lost = _clean_intermediate(redis_client, monkeypatch, mine, [foreign])
    assert lost == [] and intermediate.get_job_ids() == []
    assert registries.stale_intermediate_entry(foreign, mine)


def _rq_private_names() -> set[str]:
    """Every `_name` (not dunder) RQ's own source defines or reads as an attribute: its private state."""
    import ast

    names: set[str] = set()
    for path in Path(rq.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "name", None)
            if isinstance(name, str) and name.startswith("_") and not name.startswith("__"):
                names.add(name)
    return names


#: The wing's module of RQ's private worker state (`worker_state`: stopped job, stop flags, exception handlers,
#: polled queue order, the stand-in horse pid): by design the one file that reads and writes them.
WORKER_STATE = "worker/rq/loop/worker_state.py"


def _rq_private_uses(root: Path, private: set[str]) -> list[str]:
    """Places in worker/, ltx_contract/ and producer/ outside `WORKER_STATE` that touch RQ's private state: `x._name`
    on anything but `self`, and `self._name` or `def _name` inside a class derived from an RQ class, for the
    names RQ keeps private; plus any `horse_pid` (a stand-in pid only `WORKER_STATE` may fake)."""
    import ast

    paths = [p for d in ("worker", "ltx_contract", "producer") for p in sorted((root / d).rglob("*.py"))]
    trees = {p: ast.parse(p.read_text()) for p in paths if p.relative_to(root).as_posix() != WORKER_STATE}
    rq_names: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "rq":
                rq_names.update(a.asname or a.name for a in node.names)
    derived: set[str] = set()
    while True:  # classes of ours that derive from an RQ class, transitively
        found = {c.name for t in trees.values() for c in ast.walk(t) if isinstance(c, ast.ClassDef)
                 and any(ast.unparse(b).split(".")[-1] in rq_names | derived for b in c.bases)}  # fmt: skip
        if found <= derived:
            break
        derived |= found
    uses: list[str] = []
    for path, tree in trees.items():
        where = path.relative_to(root)
        for cls in [c for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name in derived]:
            for node in ast.walk(cls):
                name = node.name if isinstance(node, ast.FunctionDef) else None
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                    name = node.attr
                if name in private:
                    uses.append(f"{where}:{node.lineno} {cls.name}.{name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in private:
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    uses.append(f"{where}:{node.lineno} .{node.attr}")
            if getattr(node, "name", None) == "horse_pid" or getattr(node, "attr", None) == "horse_pid":
                uses.append(f"{where}:{node.lineno} horse_pid")
    return uses


#: The wing's one private hook besides `WORKER_STATE`: RQ calls the job function from `Job._execute`, which
#: `GuardedJob` overrides to refuse a job right before the call (no public hook runs there).
WING_PRIVATE_USES = ["worker/rq/loop/job_class.py GuardedJob._execute", "worker/rq/loop/job_class.py ._execute"]
#: The one private call outside the wing: a tenant's enqueue is RQ's `enqueue_job` minus its `SADD`, which only
#: `Queue._enqueue_job` does, and the producer may not import the worker (its signature: the queue test above).
CLIENT_PRIVATE_USES = ["ltx_contract/rq_client.py ._enqueue_job"]


def test_nothing_but_the_wing_touches_rq_private_state() -> None:
    """An RQ upgrade must be a review of the RQ wing and the contract's client side alone: no other module
    overrides or reads what RQ keeps private (`Job._execute`, `Worker._ordered_queues`, ...) or fakes a horse
    pid; inside the wing only `WORKER_STATE` and `GuardedJob` do, and the client side makes the one named call."""
    private = _rq_private_names()
    assert {"_execute", "_ordered_queues", "_stopped_job_id"} <= private  # (the scan sees RQ's source)
    uses = [re.sub(r":\d+ ", " ", use) for use in _rq_private_uses(ROOT, private)]
    assert uses == WING_PRIVATE_USES + CLIENT_PRIVATE_USES


def test_the_private_state_scan_finds_a_planted_use(tmp_path: Path) -> None:
    """The scan above fails on a job-path module reading RQ's private worker state, or overriding a private
    hook in a class of its own derived from an RQ class (so it cannot pass by scanning nothing)."""
    (tmp_path / "worker" / "jobs").mkdir(parents=True)
    (tmp_path / "worker" / "jobs" / "planted.py").write_text(
        "from rq.worker import SimpleWorker\n\n\n"
        "class Mine(SimpleWorker):\n    def _execute(self):\n        return self._ordered_queues\n\n\n"
        "def stopped(worker):\n    return worker._stopped_job_id\n"
    )
    uses = [re.sub(r":\d+ ", " ", use) for use in _rq_private_uses(tmp_path, _rq_private_names())]
    assert uses == [
        "worker/jobs/planted.py Mine._execute",
        "worker/jobs/planted.py Mine._ordered_queues",
        "worker/jobs/planted.py ._stopped_job_id",
    ]


def test_a_fleet_worker_shows_rq_a_horse_only_while_a_render_runs() -> None:
    """RQ's kill-horse command reaches `kill_horse` (a cooperative cancel) only while `horse_pid` is truthy."""
    from types import SimpleNamespace

    worker = FleetWorker.__new__(FleetWorker)
    worker.service = SimpleNamespace(current=None)
    assert worker.horse_pid == 0
    worker.service.current = object()
    assert worker.horse_pid == 1


def test_entries_that_are_no_jobs_do_not_stop_the_intermediate_cleanup(redis_client, monkeypatch) -> None:
    """RQ's cleanup raised on the first intermediate entry that is no valid job id (or not UTF-8, or names an
    unreadable hash), which ended the worker's loop: the worker quit mid-soak while a tenant's queue of junk
    passed through the list (each id is moved there before it is checked). Junk ids are dropped, an
    unreadable hash is failed once stuck, and the real stuck job behind them is still recorded lost."""
    from rq.intermediate_queue import IntermediateQueue
    from rq.queue import Queue
    from rq.serializers import JSONSerializer
    from rq.utils import now

    queue = Queue("junk", connection=redis_client, serializer=JSONSerializer)
    intermediate = IntermediateQueue(queue.key, connection=redis_client)
    stuck = queue.create_job("worker.job.render", args=({"prompt": "y"},))
    stuck.save()
    unreadable = queue.create_job("worker.job.render", args=({"prompt": "z"},), job_id="unreadable-1")
    unreadable.save()
    redis_client.hset(unreadable.key, "created_at", "yesterday")  # (Job.fetch raises on it)
    for entry in (b"bogus 1 \x00 x", b"\xff\xfe", b"unreadable-1", stuck.id.encode()):
        redis_client.rpush(intermediate.key, entry)
    worker = FleetWorker.__new__(FleetWorker)
    lost: list[str] = []
    monkeypatch.setattr(FleetWorker, "_record_lost", lambda self, job, message: lost.append(job.id))
    monkeypatch.setattr(SimpleWorker, "handle_job_failure", lambda self, job, queue, *a, **k: None)
    registries.clean_intermediate(worker, queue)  # first pass: junk dropped, the rest only seen
    assert redis_client.lrange(intermediate.key, 0, -1) == [b"unreadable-1", stuck.id.encode()] and lost == []
    for job_id in ("unreadable-1", stuck.id):  # ... ten minutes later
        redis_client.set(intermediate.get_first_seen_key(job_id), now().timestamp() - 600)
    registries.clean_intermediate(worker, queue)
    assert redis_client.lrange(intermediate.key, 0, -1) == [] and lost == [stuck.id]
    assert redis_client.hget("rq:job:unreadable-1", "status") == b"failed"


def test_a_retrying_job_cancelled_while_it_waits_keeps_no_error(redis_client) -> None:
    """Regression: a job re-queued after a fleet failure (state `retrying`, meta `error` that attempt's) and
    cancelled before a worker took it again kept `error.reason: fleet_failure, retryable: true` as if that
    were why it ended. The cancel clears it; the failed attempt stays in meta `attempts`."""
    from rq.queue import Queue
    from rq.serializers import JSONSerializer

    from ltx_contract.control import CANCELLED, cancel_job

    queue = Queue(f"retrying-{uuid.uuid4().hex[:6]}", connection=redis_client, serializer=JSONSerializer)
    job = queue.enqueue("worker.job.render", {"prompt": "p"})
    attempts = [{"attempt": 1, "outcome": "retrying", "reason": "fleet_failure", "message": "rank 1 exit -9"}]
    job.meta.update(state="retrying", attempt=1, attempts=attempts,
                    error={"reason": "fleet_failure", "message": "rank 1 exit -9", "retryable": True})  # fmt: skip
    job.save_meta()
    assert cancel_job(redis_client, job.id) == CANCELLED
    meta = Job.fetch(job.id, connection=redis_client, serializer=JSONSerializer).get_meta(refresh=True)
    assert meta["state"] == "cancelled" and meta.get("error") is None and meta["attempts"] == attempts, meta


def test_rqs_execution_holds_no_attempt_and_ends_before_it(redis_client) -> None:
    """The evidence behind `JobAttempt` not using RQ's stored `Execution` (`worker.rq`'s docstring). While a job
    runs RQ 2.12 keeps `rq:execution:<job>:<uuid>` with four fields (no attempt number, outcome, reason or
    retries; a random id, so nothing counts or orders executions), expiring like a heartbeat (a vanished
    worker's record is gone by the time the abandoned-job cleanup could read it); RQ deletes it in its
    bookkeeping of the job function's return, before the upload stage records how the attempt ended. If RQ ever
    keeps more, or keeps it past that, this fails and the decision is to be made again."""
    from rq.queue import Queue
    from rq.serializers import JSONSerializer

    queue = Queue(f"exec-{uuid.uuid4().hex[:6]}", connection=redis_client, serializer=JSONSerializer)
    job = queue.enqueue("tests.support.rq_probe.stored_executions")
    worker = SimpleWorker([queue], connection=redis_client, serializer=JSONSerializer)
    worker.work(burst=True, with_scheduler=False)
    assert job.get_status(refresh=True) == JobStatus.FINISHED
    (during,) = job.return_value().values()  # one record while it ran
    ttl = int(during.pop("ttl"))
    assert set(during) == {"id", "created_at", "last_heartbeat", "worker_name"}
    assert re.fullmatch(r"[0-9a-f]{32}", during["id"])  # (a uuid4)
    assert 0 < ttl <= job.timeout + 60  # (a heartbeat's expiry: gone within the run's time after its worker)
    assert not list(redis_client.scan_iter(match=f"rq:execution:{job.id}:*"))  # gone once RQ saw the return
    assert not redis_client.exists(f"rq:executions:{job.id}")
