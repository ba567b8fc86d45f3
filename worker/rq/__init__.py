"""The RQ wing: everything in the worker that knows RQ, in one folder behind a small interface, so an RQ upgrade
is a review of this folder (and of the contract's client side, `ltx_contract.rq_client`), and a move to another
queue, or to RQ's own stored executions, touches nothing outside it.

Two layers (tests/test_import_contracts.py, `WORKER_LAYERS`):

- `record` (below the job path): `JobRecord`, one job as RQ stores it, which `worker.jobs`, `worker.stages` and
  `worker.render` hold instead of an `rq.job.Job` (id, queue, meta, submission, requested TTLs, queue wait; RQ's
  retry decision, the worker's limits, and the bookkeeping by hand once the job function returned at
  `rendered`: re-queue, fail, record the upload's result, repair a late cleanup's `failed`), with
  `fetch_record` and `current_record`;
- `loop/` (above the render service, below the runtime): the RQ worker class `worker.rq.loop.worker.RqWorker` and
  its parts: Redis outages (`outages`), the job heartbeat (`beats`), how an execution ends and abandoned jobs
  (`endings`), signals, pubsub commands and teardown (`stops`), RQ's private worker state (`worker_state`), its
  registry maintenance (`registries`), jobs taken and ended or given back without running (`unstarted`), the job
  class (`job_class`: `RenderJob`), the checked dequeue over tenant queues (`queues`), the admission passes
  (`admission`) and the waits whose reply was lost (`lost_pops`). The runtime's `FleetWorker` extends `RqWorker`
  with the worker's health, readiness and fleet policy.

The boundary, held by tests: outside `worker/rq/` no worker module imports `rq` at all (not even its client API),
and of the wing only its interface, `worker.rq.record` and `worker.rq.loop.worker` (import contracts, with
planted violations); what RQ keeps private (attributes and methods RQ's own source names with a leading `_`:
`Worker._stopped_job_id`, `Job._execute`, ...) is read or overridden in `loop/worker_state.py` and
`GuardedJob._execute` alone (`test_nothing_but_the_wing_touches_rq_private_state`); the RQ signatures,
attributes and strings the wing relies on are checked against the installed RQ (tests/test_worker_rqcompat.py).
The contract's own rule stays: `ltx_contract` imports RQ's client API only (jobs, queues, serializers, commands,
the worker list; never registries, results, executions, the intermediate queue or maintenance).

**Why `JobAttempt` does not use RQ's stored `Execution`** (compared with rq 2.12's `rq/executions.py` and
`rq/worker/base.py`, as installed, and measured: tests/test_worker_rqcompat.py,
`test_rqs_execution_holds_no_attempt_and_ends_before_it`). RQ 2.12 stores one `Execution` per run: the hash
`rq:execution:<job id>:<uuid4>` with four fields (`id`, `created_at`, `last_heartbeat`, `worker_name`), a per-job
registry and the started registry's member `<job id>:<execution id>`; the heartbeat refreshes it, it expires like a
heartbeat, and `cleanup_execution` deletes it in the same bookkeeping that records the job function's return or
failure. An attempt (`worker.jobs.attempt.JobAttempt`) needs what that record cannot hold or does not outlive:
- its number among every execution of the job, vanished ones included (meta `attempt`, the `LTX_MAX_ATTEMPTS`
  cap): execution ids are random, nothing counts them;
- how it ended: reason, retries spent per reason, the history (meta `error`, `retries`, `attempts`): the record's
  fields are fixed (`Execution.serialize`);
- to end after the job function returned: with the upload pipeline the attempt ends in the upload or encode stage,
  seconds to minutes after RQ deleted the execution, and a restarted worker's spool recovery ends attempts whose
  execution expired long before;
- to be recorded where no execution exists: jobs ended without running (admission refusals, cancels while queued,
  unreadable hashes) and executions of vanished workers, which another worker's cleanup records once their record
  has expired with their heartbeat.
So the attempt keeps its record in the job's meta and event stream, and the wing uses RQ's executions only where
RQ itself needs them: the running execution's heartbeat (`worker_state.beat`) and the started registry's members
(`registries.started_member_job_id`, `JobRecord`'s move to `finished`).
"""

RQ_MINOR = (2, 12)  #: the RQ minor version the wing is written and tested against (`pyproject.toml` pins it)
