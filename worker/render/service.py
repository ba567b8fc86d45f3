"""`RenderService`: what a worker process does with one render job, given its warm fleet.

One instance per worker process (one fleet). `run_job()` is the body of the RQ job function
(`worker.job.render`):

1. bookkeeping: attempt counter (the hard cap `max_attempts`), the `worker_lost` budget of executions that
   vanished unrecorded (RQ's timeout and the TTLs were set from the settings before, `JobOutcomes.own_limits`);
2. validate the request (`RenderRequest`); a bad one fails at once naming the field, the fleet untouched;
3. render: `controller.stream(**request.runner_kwargs(), output_path=<spool>)`, relaying every event into
   the job's Redis Stream (skipped when the spool already holds a complete render of this job: a re-run
   after an upload failure uploads instead of rendering again);
   With `encode_in_worker` (the default, for runners that take `media`) the fleet hands yuv420p frames and
   audio off instead of writing the file, and `worker.stages.encode.EncodeStage` encodes them beside the next job
   (the job function returns at `rendering`; the encoder commits and feeds the upload pipeline); with
   `encode_stream` (runners that list "stream" in `media_modes`) the frames arrive while the VAE decodes and
   the encoder's x264 runs start on the first of them (`ltx_mgpu.runners.common.mp4stream`); a render that
   fails after that aborts them (`_render`'s `finally`);
4. commit the file to the spool (manifest written atomically), then either
   - (`upload_pipeline`, the default) hand it to the background `UploadPipeline` and return a small
     hand-off value at once: RQ marks the job `finished` while the state is `rendered`; the pipeline
     writes `uploading` → `uploaded` (or `retrying`/`failed`) and the full result later, or
   - (synchronous) upload it here (retries, confirmation), release it and
5. return the result (bucket, key, size, sha256, presigned URL, timings, fleet).

The service state in the job meta (and the event stream) is the source of truth for clients; RQ's
`finished` only means "rendered" when the pipeline is on. See docs/worker.md, "Job lifecycle".

Failures raise `JobFailed(reason, ...)` after `worker.jobs.outcomes` recorded the attempt (a terminal or
`retrying` state event) and set RQ's retry decision from the settings' budget for that reason, which RQ's
failure handling then honours. The worker, not the enqueuer, owns the retry policy.

Over 450 lines on purpose: one class, the steps of one job in order; the upload pipeline, the outcomes,
the spool and the event relay are already modules of their own.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn

from pydantic import ValidationError

from ltx_mgpu import memplan
from worker.jobs import poison
from worker.jobs.outcomes import JobOutcomes, attempt_count
from worker.ops.metrics import WorkerMetrics
from worker.protocol import rqcompat
from worker.protocol.handoff import HandOff
from worker.protocol.health import StorageHealth
from worker.protocol.keys import job_tenant
from worker.protocol.limits import RunnerLimits
from worker.protocol.relay import EventRelay
from worker.protocol.schema import RenderRequest
from worker.protocol.states import RUNNING_STATES, FailureReason, JobState
from worker.render.fleet import WarmFleet
from worker.render.loras import LoraRefused, LoraResolver
from worker.render.warmup import WarmupRefused, is_out_of_memory
from worker.settings import WorkerSettings
from worker.stages.encode import EncodeStage, PendingEncode
from worker.stages.upload import PendingUpload, UploadPipeline
from worker.uploads.spool import Spool, SpoolEntry
from worker.uploads.storage import Storage, StoredObject, new_render_id
from worker.uploads.uploader import Uploader, UploadFailed

__all__ = ["JobCancelledByClient", "JobFailed", "RenderService"]

log = logging.getLogger("worker.render.service")
MEDIA_EVENT = "media"  #: `ltx_mgpu.control.events.MEDIA`: the runner's frames hand-off (the engine is imported lazily)
MEDIA_OPEN_EVENT = "media_open"  #: `ltx_mgpu.control.events.MEDIA_OPEN`: a streamed hand-off's buffer
MEDIA_FRAMES_EVENT = "media_frames"  #: `ltx_mgpu.control.events.MEDIA_FRAMES`: frames [0, ready) are final


class JobFailed(Exception):
    """A job ended in failure; `reason` is a `FailureReason`, `details` the machine-readable rest."""

    def __init__(self, reason: FailureReason, message: str, *, retrying: bool = False, **details: Any) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason
        self.message = message
        self.retrying = retrying
        self.details = details


class _NoLowerPlan(Exception):
    """Earlier attempts of this job ran out of memory on every plan there is (`RenderService._memory_plan`)."""


class JobCancelledByClient(Exception):
    """The job was cancelled by a client; the worker turns this into RQ's `stopped` status."""


@dataclass
class _Current:
    """The job this process is running (at most one)."""

    job_id: str
    cancel: threading.Event = field(default_factory=threading.Event)
    stream: Any = None  # ltx_mgpu.Stream while the fleet renders


class RenderService:
    """Per-process job logic around one `WarmFleet`; see the module docstring."""

    def __init__(
        self,
        settings: WorkerSettings,
        *,
        group: str,
        worker_name: str,
        fleet: WarmFleet,
        storage: Storage,
        spool: Spool,
        metrics: WorkerMetrics,
        limits: RunnerLimits | None = None,
    ) -> None:
        self.settings = settings
        self._limits = limits or RunnerLimits(settings.runner, {})
        self.group = group
        self.worker_name = worker_name
        self.fleet = fleet
        self.storage = storage
        self.spool = spool
        self.metrics = metrics
        self.outcomes = JobOutcomes(settings, worker_name=worker_name, metrics=metrics)
        #: request LoRAs: fetched, cached and checked before the fleet sees them (worker.render.loras)
        self.loras = LoraResolver(settings, s3_client=lambda: getattr(storage, "client", None), metrics=metrics)
        self.uploader = Uploader(
            storage,
            spool,
            attempts=settings.upload_attempts,
            backoff_s=settings.upload_backoff_s,
            backoff_max_s=settings.upload_backoff_max_s,
        )
        self.stop_uploads = threading.Event()  # set on cold shutdown: cut upload back-offs short
        # The background uploader. It always exists (it recovers the spool at start); jobs use it only
        # with `upload_pipeline` on, otherwise the job function uploads before it returns.
        self.pipeline = UploadPipeline(
            uploader=self.uploader,
            spool=spool,
            metrics=metrics,
            group=group,
            worker_name=worker_name,
            threads=settings.upload_threads,
            max_pending=settings.max_pending_uploads,
            max_pending_bytes=settings.max_pending_bytes,
            outcomes=self.outcomes,
            make_result=self._pipeline_result,
            stop=self.stop_uploads,
            on_uploaded=self._count_done,
            on_upload_failed=self._upload_failed,
        )
        self.encoder = EncodeStage(spool=spool, pipeline=self.pipeline, settings=settings, metrics=metrics, group=group)
        self.hand_off_media = settings.encode_in_worker and _takes(fleet.runner_cls, "media")
        streams = settings.encode_stream and "stream" in getattr(fleet.runner_cls, "media_modes", ())
        self.media_mode = "stream" if streams else "frames"  #: what `media` the fleet is asked for
        self.takes_memory_plan = _takes(fleet.runner_cls, "memory_plan")
        fleet.warm.plans = self.warmup_plans  # the warm-up is planned like a client job (worker.render.warmup)
        self.current: _Current | None = None
        # A cancel for the job RQ has started here but whose render has not begun yet (RQ marks it started,
        # then calls the job function): kept until that job's render begins, which then stops at once.
        # Dropping it lost the cancel (CI: "no such job running here", the job rendered to the end).
        self._cancel_before_start: str | None = None
        self.jobs_done = 0
        self.storage_error: str | None = None  # set while storage is degraded (see set_storage_state)
        self.process_started_at: float | None = None  #: wall clock when this worker process started
        self._lock = threading.Lock()

    @property
    def limits(self) -> RunnerLimits:
        """The runner's limits (published in the health snapshot, checked before each render), with the memory
        each device offers: `LTX_DEVICE_MEMORY_GIB`, else what the fleet measured after its ranks' setup (and
        its warm-up renders; GPU fleets), known before the warm-up."""
        memory = self._limits.memory
        if memory is None or self.settings.device_memory_gib is not None:
            return self._limits
        measured = getattr(self.fleet, "device_memory_bytes", None)
        if isinstance(measured, int | float) and measured > 0:
            self._limits = self._limits.with_capacity(round(float(measured) / 2**30, 2))
        return self._limits

    def deterministic_mode(self) -> str | None:
        """The warm fleet's deterministic mode ("on", "strict", "off"; `ltx_mgpu.control.determinism`), recorded
        beside each render's hashes: equal hashes are promised only between renders of a deterministic fleet."""
        mode = getattr(getattr(self.fleet, "controller", None), "deterministic", None)
        return mode if isinstance(mode, str) else None

    def memory_plans(self, width: int, height: int, num_frames: int,
                     frame_rate: float = memplan.DEFAULT_FRAME_RATE) -> list[dict[str, Any] | None]:  # fmt: skip
        """The runner's `memory_plan` job kwargs for a request of this size: the plan a job gets first, then each
        strictly lower-memory one down to the lowest (memplan's lower-memory plan, unless the first already is
        it). An out-of-memory attempt moves the job one step down; `[None]`: the runner takes no plan (nothing
        lower to retry with). Without a described memory (no `memory_fleet`) the first is the runner's default
        and the lower one the chunked decode with the cache released between stages."""
        if not self.takes_memory_plan:
            return [None]
        memory = self.limits.memory
        if memory is None:
            return [None, {"decode_chunked": True, "release_between_stages": True}]
        first = memplan.plan(memory, width, height, num_frames, frame_rate=frame_rate)
        if first.decode_chunked and first.release_between_stages:  # (already memplan's lowest)
            return [first.job_kwargs()]
        low = memplan.plan(memory, width, height, num_frames, low_memory=True, frame_rate=frame_rate)
        return [first.job_kwargs(), low.job_kwargs()]

    def warmup_plans(self, kwargs: dict[str, Any]) -> list[dict[str, Any] | None]:
        """A warm-up request's plans (`memory_plans`, as for a client job of its size, with the capacity the fleet
        reported after setup); `WarmupRefused` when a client job of that size would be refused for memory."""
        w, h, f = (int(kwargs[k]) for k in ("width", "height", "num_frames"))
        rate = float(kwargs.get("frame_rate") or memplan.DEFAULT_FRAME_RATE)
        memory = self.limits.memory
        if memory is not None and (refusal := memplan.plan(memory, w, h, f, frame_rate=rate).refusal()) is not None:
            raise WarmupRefused(refusal)
        return self.memory_plans(w, h, f, rate)

    def _memory_plan(self, job: Any, req: RenderRequest) -> tuple[dict[str, Any] | None, bool]:
        """This attempt's `memory_plan` kwarg (None: none sent) and whether a lower one is left for a retry: one
        step down `memory_plans` per out-of-memory attempt before it. Fails the job (`out_of_memory`, not
        retried) when the attempts before it already ran the lowest plan there is."""
        meta = job.meta if isinstance(job.meta, dict) else {}
        retries = meta.get("retries") if isinstance(meta.get("retries"), dict) else {}
        steps = int(retries.get(FailureReason.OUT_OF_MEMORY.value) or 0)
        plans = self.memory_plans(req.width, req.height, req.num_frames, req.frame_rate)
        if steps >= len(plans):
            raise _NoLowerPlan(f"ran out of memory {steps} time(s); no plan lower in memory than the last one is left")
        return plans[steps], steps + 1 < len(plans)

    # ==== control from other threads ==================================================================
    def cancel(self, job_id: str | None = None) -> bool:
        """Cooperatively cancel the running job (any thread). Returns True if a job was signalled."""
        with self._lock:
            cur = self.current
            if cur is None or (job_id is not None and cur.job_id != job_id):
                return False
            cur.cancel.set()
            stream = cur.stream
        if stream is not None:
            stream.cancel()
        log.info("cancel requested for job %s", cur.job_id)
        return True

    def cancel_before_start(self, job_id: str) -> None:
        """Remember a cancel for `job_id`, which RQ has started on this worker but whose render has not begun
        (`run_job` not entered yet): its render stops as soon as it begins. Only the job RQ is starting here
        may be named (the caller checks), so a remembered id never cancels another job; it is forgotten when
        that job's run ends."""
        with self._lock:
            if self.current is None or self.current.job_id != job_id:
                self._cancel_before_start = job_id
                log.info("cancel for job %s before its render began: it stops as soon as it begins", job_id)
                return
        self.cancel(job_id)

    def start_uploads(self, connection: Any) -> int:
        """Start the background uploader and queue what the spool still holds (recovery). Returns how
        many renders were recovered."""
        self.pipeline.start(connection)
        try:
            self.encoder.recover(connection)  # jobs whose worker died mid-encode: they render again
            return self.pipeline.recover()
        except Exception:
            log.exception("spool recovery failed; the renders stay in the spool")
            return 0

    def job_returned(self, job_id: str) -> None:
        """RQ finished handling the job function's return (status, result): the pipeline may record the
        upload's outcome for this job now."""
        self.pipeline.released(job_id)
        self.encoder.released(job_id)

    def _count_done(self) -> None:
        self.jobs_done += 1
        if self.storage_error is not None:
            self.set_storage_state(None)  # a confirmed upload: storage is reachable again

    def _upload_failed(self, exc: UploadFailed) -> None:
        """Every attempt of an upload failed: storage is degraded (health, `ltx_worker_storage_up`) until
        an upload is confirmed again (it said `ok` all through an S3 outage after a good start)."""
        if exc.retryable:
            self.set_storage_state(f"uploads failing: {str(exc)[:300]}")

    def set_storage_state(self, error: str | None) -> None:
        """`error`: why storage is degraded (unreachable at start), or None once it is usable. A degraded
        worker still renders (videos wait in the spool, uploads retry); health and metrics say so."""
        if error is None and self.storage_error is not None:
            log.info("storage reachable again (an upload was confirmed)")
        self.storage_error = error
        self.metrics.storage_up.labels(self.group).set(0 if error else 1)

    @property
    def storage_state(self) -> StorageHealth:
        return StorageHealth("degraded" if self.storage_error else "ok", self.storage_error)

    def update_spool_metrics(self) -> None:
        """Publish how many complete renders wait in the spool (and their bytes)."""
        self.pipeline.update_spool_metrics()

    # ==== the job =====================================================================================
    def run_job(self, job: Any, request: Any) -> dict[str, Any]:
        t0 = time.time()
        cur = _Current(job.id)
        with self._lock:
            self.current = cur
            if self._cancel_before_start == job.id:
                cur.cancel.set()
        try:
            return self._run(job, request, cur, t0)
        finally:
            self.loras.cache.release()  # (the fleet has read this job's LoRAs: others may evict them now)
            with self._lock:
                self.current = None
                if self._cancel_before_start == job.id:
                    self._cancel_before_start = None

    def _run(self, job: Any, request: Any, cur: _Current, t0: float) -> dict[str, Any]:
        s = self.settings
        relay = self.outcomes.relay(job)
        meta = relay.meta
        previous_state = meta.get("state")
        if (
            previous_state == JobState.UPLOADED.value
            and isinstance(meta.get("result"), dict)
            and self.spool.load(job.id) is None
            and not self.pipeline.is_pending(job.id)
            and not self.encoder.is_pending(job.id)
        ):
            # Recovery (or a late registry cleanup) re-queued a job whose video is already in storage.
            log.info("job %s is already uploaded; returning its recorded result", job.id)
            return dict(meta["result"])
        lost_before = previous_state in RUNNING_STATES  # an earlier execution vanished mid-job, unrecorded
        if lost_before:
            self.outcomes.lost_unrecorded(job, relay)
        attempt = attempt_count(meta) + 1
        queue_wait = _queue_wait(job)
        if queue_wait is not None:
            self.metrics.queue_wait_seconds.labels(self.group).observe(queue_wait)
        relay.state(
            JobState.STARTED,
            attempt=attempt,
            worker=self.worker_name,
            fleet=self.group,
            queue_wait_s=None if queue_wait is None else round(queue_wait, 4),
            **({"previous_attempt_lost": True} if lost_before else {}),
        )
        # ---- the hard cap: whatever re-queued it, a job runs at most `max_attempts` times ----------------
        if attempt > s.max_attempts:
            self._fail(job, relay, FailureReason.ATTEMPTS_EXHAUSTED,
                       f"execution {attempt} exceeds the cap of {s.max_attempts} (LTX_MAX_ATTEMPTS)",
                       retryable=False, attempts_cap=s.max_attempts)  # fmt: skip
        lost = int((relay.meta.get("retries") or {}).get(FailureReason.WORKER_LOST.value, 0))
        if lost_before and lost > self.outcomes.budget(FailureReason.WORKER_LOST):
            # (executions that vanish unrecorded spend the worker_lost budget like recorded losses)
            self._fail(job, relay, FailureReason.WORKER_LOST,
                       f"{lost} executions vanished; the worker_lost budget is spent", retryable=False)  # fmt: skip

        # ---- a job whose renders poisoned fleets is not rendered again (re-pushed by id: worker.jobs.poison) ----
        if refused := poison.refusal(job.connection, job.id, s.retry_fleet_failure, group=self.group):
            self._fail(job, relay, FailureReason.FLEET_FAILURE, refused, retryable=False, poisoned=True)

        # ---- validate -------------------------------------------------------------------------------
        try:
            req = RenderRequest.model_validate(request)
        except ValidationError as exc:
            err = exc.errors()[0]
            field_name = ".".join(str(p) for p in err.get("loc", ())) or "(request)"
            self._fail(job, relay, FailureReason.INVALID_REQUEST,
                       f"field {field_name!r}: {err.get('msg')}", field=field_name,
                       errors=[{"field": ".".join(str(p) for p in e.get("loc", ())), "message": e.get("msg")}
                               for e in exc.errors()])  # fmt: skip
        if violations := self.limits.violations(req):  # (what `producer submit` checks at the edge)
            first = violations[0]
            self._fail(job, relay, FailureReason.INVALID_REQUEST, first.message(), field=first.field,
                       errors=[{"field": v.field, "message": v.message()} for v in violations])  # fmt: skip

        # ---- render (unless a complete render of this job is already in the spool) ------------------
        try:
            entry = self.spool.load(job.id)
        except OSError as exc:
            self._spool_failed(job, relay, exc)
        if entry is not None and not entry.belongs_to(rqcompat.submission_of(job)):
            # an earlier submission of this id (its job long expired) left its render here: not this job's video
            log.warning("job %s: the spool holds a render of an earlier submission with this id (%s); "
                        "discarding it and rendering this one", job.id, entry.submission)  # fmt: skip
            self.spool.release(entry)
            entry = None
        render_s = 0.0
        if entry is not None:
            log.info("job %s: complete render found in the spool; uploading it instead of rendering", job.id)
            if self.pipeline.hold(job.id):  # recovery already queued it: let that upload finish it
                return self._handoff(job, entry, render_s)
            relay.state(JobState.RENDERED, resumed_from_spool=True, sha256=entry.sha256 or None, bytes=entry.size)
        else:
            entry, render_s = self._render(job, req, relay, cur)
        if isinstance(entry, PendingEncode):  # frames, not a file: encoded beside the next job
            entry.attempt, entry.queue_wait_s, entry.t0 = attempt, queue_wait, t0
            if s.upload_pipeline:
                self.encoder.submit(entry)
                return self._handoff(job, None, render_s)
            entry = self._encode_now(job, relay, entry)

        if s.upload_pipeline:
            # ---- hand over to the background uploader; the fleet takes the next job now ------------------
            self.pipeline.submit(PendingUpload(entry=entry, job=job, relay=relay, attempt=attempt,
                                               queue_wait_s=queue_wait, render_s=render_s, t0=t0))  # fmt: skip
            return self._handoff(job, entry, render_s)

        # ---- synchronous upload ---------------------------------------------------------------------
        entry = self.spool.ensure_sha256(entry)
        relay.state(JobState.UPLOADING, key=entry.key, bytes=entry.size)
        t_up = time.monotonic()
        try:
            stored = self.uploader.upload(entry, on_event=self._upload_event(relay), stop=self.stop_uploads)
        except UploadFailed as exc:
            self.metrics.upload_seconds.labels(self.group).observe(time.monotonic() - t_up)
            self._upload_failed(exc)
            self._fail(job, relay, FailureReason.UPLOAD_FAILED, str(exc), retryable=exc.retryable,
                       spool_path=str(exc.entry.path), upload_attempts=exc.attempts)  # fmt: skip
        upload_s = time.monotonic() - t_up
        self.metrics.upload_seconds.labels(self.group).observe(upload_s)
        self.metrics.upload_bytes.labels(self.group).inc(stored.size)

        result = self._result(job, entry, stored, t0, queue_wait, render_s, upload_s, attempt)
        self.outcomes.uploaded(job, relay, result)
        self._count_done()
        return result

    # ---- render ---------------------------------------------------------------------------------------
    def _render(
        self, job: Any, req: RenderRequest, relay: EventRelay, cur: _Current
    ) -> tuple[SpoolEntry | PendingEncode, float]:
        from ltx_mgpu import AsymmetricRunnerError, FleetFailure, JobCancelledError, SymmetricRunnerError

        s = self.settings
        if cur.cancel.is_set():
            self._cancelled(job, relay)
        try:  # a bad LoRA ends the job here, as a request error: it never reaches the fleet's weights
            tenant = job_tenant(job.id) if s.tenant_ids else None  # (whose S3 folder its LoRA uris must be in)
            loras = {"loras": self.loras.for_job(req.loras, relay, tenant)} if req.loras else {}
        except LoraRefused as exc:
            self._fail(job, relay, FailureReason.INVALID_REQUEST, str(exc), field=exc.field)
        except OSError as exc:  # the LoRA cache's disk (full, or the cache cannot make room now): this host's
            self._spool_failed(job, relay, exc, where="lora cache")
        try:
            output_path = self.spool.prepare(job.id, s.output_name)
        except OSError as exc:
            self._spool_failed(job, relay, exc)
        kwargs = {**req.runner_kwargs(), **loras, "output_path": str(output_path)}
        if self.hand_off_media:
            kwargs["media"] = self.media_mode
        try:
            memory_plan, lower_left = self._memory_plan(job, req)
        except _NoLowerPlan as exc:
            self._fail(job, relay, FailureReason.OUT_OF_MEMORY, str(exc), retryable=False)
        if memory_plan is not None:
            kwargs["memory_plan"] = memory_plan
        # an out-of-memory end is retried only onto a strictly lower-memory plan (never the one that ran out)
        oom_retry = None if lower_left else False
        oom_note = "" if lower_left else " (the lowest-memory plan ran out of memory: not retried)"
        timeout = float(s.render_timeout)  # (the worker's alone: RQ's job_timeout is set from it, never a client's)
        relay.state(JobState.RENDERING, devices=self.group, world_size=self.fleet.world_size)
        output: dict[str, Any] | None = None
        media: dict[str, Any] | None = None
        streamed: Any = None  #: the encoder's side of a streamed hand-off (`Mp4Stream`) once it began
        completed = False
        t_render = time.monotonic()
        dispatched_at, oom_kills = time.time(), poison.oom_kills()
        stream = None
        try:
            ctl = self.fleet.controller
            if ctl is None:
                raise FleetFailure("fleet is not running", reason="rank_exited")
            # (a poisoned controller's stream() raises "MGPUController is dead" caused by its own failure,
            # the same object its monitor reported: counted once)
            try:
                stream = ctl.stream(timeout=timeout, **kwargs)
            except TypeError as exc:  # kwargs the runner does not accept: the request, not the fleet
                self._fail(job, relay, FailureReason.INVALID_REQUEST, str(exc), field="(runner kwargs)")
            except RuntimeError as exc:  # "MGPUController is dead": poisoned between jobs
                cause = exc.__cause__ if isinstance(exc.__cause__, FleetFailure) else None
                raise cause or FleetFailure(str(exc), reason="rank_exited") from exc
            with self._lock:
                cur.stream = stream
            if cur.cancel.is_set():
                stream.cancel()
            for item in stream:
                if not isinstance(item, dict) or "type" not in item:
                    continue  # non-driver ranks or diagnostic yields: nothing a client needs
                if item["type"] == MEDIA_OPEN_EVENT:  # the decode begins: x264 runs start as frames arrive
                    streamed = self.encoder.open_stream(item)
                    continue
                if item["type"] == MEDIA_FRAMES_EVENT:
                    if streamed is not None:
                        streamed.advance(item)
                    continue
                if item["type"] == MEDIA_EVENT:
                    # frames and waveform in shared memory: for the encoder, never relayed
                    media = streamed.finish(item) if streamed is not None else item
                    continue
                if item["type"] == "output":
                    output = item
                    self.metrics.fleet_busy_seconds.labels(self.group).inc(float(item.get("gpu_busy_s") or 0.0))
                relay.emit(_public_output(item) if item["type"] == "output" else item)
            completed = True
        except JobCancelledError:
            self.spool.discard_incomplete(job.id)
            self._cancelled(job, relay)
        except SymmetricRunnerError as exc:
            self.spool.discard_incomplete(job.id)
            if (refused := exc.request_refused) is not None:  # a rule the edge checks too: a request error
                self._fail(job, relay, FailureReason.INVALID_REQUEST, str(exc), field=refused.field)
            if exc.out_of_memory:  # (the ranks freed what it held; the retry takes the lower-memory plan)
                self._fail(job, relay, FailureReason.OUT_OF_MEMORY, f"{exc}{oom_note}", retryable=oom_retry)
            self._fail(job, relay, FailureReason.RUNNER_ERROR, str(exc))
        except AsymmetricRunnerError as exc:
            self.spool.discard_incomplete(job.id)
            if is_out_of_memory(exc):  # (a driver-only stage: the other ranks had finished; nobody waits)
                self._fail(job, relay, FailureReason.OUT_OF_MEMORY, f"{_first_error(exc)}{oom_note}",
                           retryable=oom_retry)  # fmt: skip
            self._fail(job, relay, FailureReason.ASYMMETRIC_RUNNER_ERROR, str(exc))
        except FleetFailure as exc:
            self.spool.discard_incomplete(job.id)
            info = self.fleet.record_failure(exc)  # (counted once: the monitor may have reported it already)
            relay.emit({"type": "fleet", "action": "failed", **info})
            after = poison.oom_kills()
            oom_killed = oom_kills is not None and after is not None and after > oom_kills
            lasting = poison.lasting(info.get("fleet_reason"), info.get("exitcode"), oom_kills_during_job=oom_killed,
                                     during_job=getattr(exc, "detected_at", 0.0) >= dispatched_at)  # fmt: skip
            entries = poison.record(job.connection, job.id, info.get("fleet_reason"), self.outcomes.failure_ttl(job),
                                    group=self.group, lasting=lasting)  # fmt: skip
            refused = poison.refusal(job.connection, job.id, self.settings.retry_fleet_failure, entries,
                                     group=self.group)  # fmt: skip
            # (the refusal first: a long fleet message is cut to its first line for Redis, and the reason it is
            # not retried must survive that)
            message = f"{refused}: {info['message']}" if refused else info["message"]
            self._fail(job, relay, FailureReason.FLEET_FAILURE, message,
                       retryable=False if refused else None,
                       **{k: v for k, v in info.items() if k != "message"})  # fmt: skip
        except BaseException as exc:
            # RQ's death penalty (JobTimeoutException), a cold stop (SystemExit) or a bug: the fleet may be
            # mid-job, so it cannot be trusted with the next one. Kill it; it is rebuilt before the next job.
            self.spool.discard_incomplete(job.id)
            if stream is not None and not stream.done:
                self.fleet.kill_for_rebuild()
            reason = _reason_for(exc)
            if reason is FailureReason.WORKER_SHUTDOWN:
                self._fail(job, relay, reason, "worker stopped cold mid-job", reraise=exc)
            self._fail(job, relay, reason, f"{type(exc).__name__}: {exc}", reraise=exc)
        finally:
            with self._lock:
                cur.stream = None
            if streamed is not None and not completed:  # (no x264 run is left waiting for frames)
                self._abort_stream(streamed)
        render_s = time.monotonic() - t_render
        self.metrics.render_seconds.labels(self.group).observe(render_s)
        if loras and output is not None:
            self.loras.record_swap(output, relay)  # (the fleet's swap seconds for this job: status, metrics)
        if output is None or (media is None and not output_path.exists()):
            if streamed is not None:
                self._abort_stream(streamed)
            self.spool.discard_incomplete(job.id)
            message = f"the runner finished without writing {output_path.name} (output event: {output is not None})"
            self._fail(job, relay, FailureReason.NO_OUTPUT, message)
        if media is not None:
            key = self.storage.key_for(job.id, new_render_id(), output_path.name)
            pending = PendingEncode(job=job, relay=relay, output_path=output_path, media=media, output=output,
                                    key=key, render_s=render_s,
                                    digest_extra={"deterministic": self.deterministic_mode()})  # fmt: skip
            try:
                self.encoder.prepare(pending)
            except OSError as exc:
                if streamed is not None:
                    self._abort_stream(streamed)
                self.spool.discard_incomplete(job.id)
                self._spool_failed(job, relay, exc)
            return pending, render_s
        info = {k: output.get(k) for k in ("frames", "fps", "width", "height")}
        info["render_s"] = round(render_s, 4)
        try:
            entry = self.spool.commit(
                job.id,
                file_name=output_path.name,
                key=self.storage.key_for(job.id, new_render_id(), output_path.name),  # (one object per render)
                content_type=str(output.get("content_type") or "video/mp4"),
                queue=job.origin,
                info=info,
                hash_now=not s.upload_pipeline,  # the pipeline hashes in its own thread, off the critical path
                submission=rqcompat.submission_of(job),
            )
        except OSError as exc:
            self.spool.discard_incomplete(job.id)
            self._spool_failed(job, relay, exc)
        sha = {"sha256": entry.sha256} if entry.sha256 else {}
        relay.state(JobState.RENDERED, bytes=entry.size, render_s=round(render_s, 4), **sha)
        return entry, render_s

    def _abort_stream(self, streamed: Any) -> None:
        """A streamed hand-off whose render failed: its x264 runs not started are cancelled (`Mp4Stream.abort`)."""
        if not streamed.aborted:
            streamed.abort()
            self.metrics.encode_aborted.labels(self.group).inc()

    def _encode_now(self, job: Any, relay: EventRelay, item: PendingEncode) -> SpoolEntry:
        """The synchronous path (`upload_pipeline` off): encode and commit before the upload."""
        try:
            return self.encoder.encode_now(item)
        except OSError as exc:
            self.spool.discard_incomplete(job.id)
            self._spool_failed(job, relay, exc)
        except Exception as exc:
            self.spool.discard_incomplete(job.id)
            self._fail(job, relay, FailureReason.INTERNAL, f"encode: {type(exc).__name__}: {exc}")

    # ---- outcomes (recorded by worker.jobs.outcomes; these only raise what RQ's failure handling sees) -----
    def _cancelled(self, job: Any, relay: EventRelay) -> NoReturn:
        self.outcomes.cancelled(job, relay)
        raise JobCancelledByClient(f"job {job.id} cancelled")

    def _fail(
        self,
        job: Any,
        relay: EventRelay,
        reason: FailureReason,
        message: str,
        *,
        retryable: bool | None = None,
        reraise: BaseException | None = None,
        **details: Any,
    ) -> NoReturn:
        """Record the failed attempt (retrying or terminal) and raise: `reraise` if given, else `JobFailed`."""
        retry = self.outcomes.failed(job, reason, message, relay=relay, retryable=retryable, **details)
        if reraise is not None:
            raise reraise
        raise JobFailed(reason, message, retrying=retry, **details) from None

    def _spool_failed(self, job: Any, relay: EventRelay, exc: OSError, where: str = "spool") -> NoReturn:
        """The spool (or the LoRA cache) could not hold this job's files (ENOSPC, EIO, ...): a failure with its
        reason and errno, re-queued within `retry_spool_error` (another host may have room), never an
        unrecorded loop."""
        code = errno.errorcode.get(exc.errno or 0)
        message = f"{where}: {exc.strerror or exc} ({code or type(exc).__name__})"
        retryable = exc.errno != errno.ENAMETOOLONG
        self._fail(job, relay, FailureReason.SPOOL_ERROR, message, errno=code, retryable=retryable)

    # ---- helpers ------------------------------------------------------------------------------------
    def _upload_event(self, relay: EventRelay) -> Any:
        def emit(event: dict[str, Any]) -> None:
            if "error" in event:
                self.metrics.upload_retries.labels(self.group).inc()
            try:
                relay.emit(event)
            except Exception:
                log.warning("could not relay upload event", exc_info=True)

        return emit

    def _handoff(self, job: Any, entry: SpoolEntry | None, render_s: float) -> dict[str, Any]:
        """The job function's return value with the pipeline on (`worker.protocol.handoff`). `entry` None:
        the video is still being encoded (`worker.stages.encode`)."""
        if entry is None:
            handoff = HandOff(job.id, JobState.RENDERING.value, encode="pending")
        else:
            handoff = HandOff(job.id, JobState.RENDERED.value, key=entry.key, bytes=entry.size)
        return replace(handoff, render_s=round(render_s, 4), worker=self.worker_name).to_json()

    def _pipeline_result(
        self, item: PendingUpload, stored: StoredObject, upload_s: float, wait_s: float
    ) -> dict[str, Any]:
        result = self._result(item.job, item.entry, stored, item.t0, item.queue_wait_s, item.render_s, upload_s,
                              item.attempt)  # fmt: skip
        result["timings"]["upload_wait_s"] = round(wait_s, 4)
        if item.recovered:
            result["recovered"] = True
        return result

    def _result(
        self,
        job: Any,
        entry: SpoolEntry,
        stored: StoredObject,
        t0: float,
        queue_wait: float | None,
        render_s: float,
        upload_s: float,
        attempt: int,
    ) -> dict[str, Any]:
        url, url_expires_at = stored.url, stored.url_expires_at
        kept = self.outcomes.kept_result_ttl(job)
        if url_expires_at is not None and kept > 0 and url_expires_at > time.time() + kept:
            # a URL must not outlive the result it is recorded in: once the job expired its id can be reused,
            # and the old URL would serve the new owner's video
            url, url_expires_at = self.storage.url_for(stored.key, expiry_s=kept)
        return {
            "job_id": job.id,
            "state": JobState.UPLOADED.value,
            "storage": stored.backend,
            "bucket": stored.bucket,
            "key": stored.key,
            "size": stored.size,
            "sha256": stored.sha256,
            "digests": entry.info.get("digests"),  #: the frames' and audio's sha256 (`runners.common.digest`)
            "content_type": stored.content_type,
            "url": url,
            "url_expires_at": url_expires_at,
            "reused_object": stored.reused,
            "output": {k: v for k, v in entry.info.items() if k in ("frames", "fps", "width", "height")},
            "timings": {
                "queue_wait_s": None if queue_wait is None else round(queue_wait, 4),
                "render_s": round(render_s, 4),
                "upload_s": round(upload_s, 4),
                "total_s": round(time.time() - t0, 4),
            },
            "fleet": {
                "group": self.group,
                "devices": [str(d) for d in self.fleet.devices],
                "world_size": self.fleet.world_size,
                "worker": self.worker_name,
            },
            "attempt": attempt,
        }


def _takes(runner_cls: Any, name: str) -> bool:
    """Whether the runner's job signature accepts `name` (a named parameter; not `**kwargs`, which the test
    and noop runners use to ignore fields: they would never hand frames off nor apply a memory plan)."""
    import inspect

    try:
        return name in inspect.signature(runner_cls.__call__).parameters
    except (TypeError, ValueError):
        return False


def _first_error(exc: Any) -> str:
    from ltx_mgpu import RunnerError

    return next((t.message for t in getattr(exc, "terminals", ()) if isinstance(t, RunnerError)), str(exc))


def _public_output(event: dict[str, Any]) -> dict[str, Any]:
    """The runner's `output` event for clients: the file's name, not the worker's local spool path."""
    public = {k: v for k, v in event.items() if k != "path"}
    if event.get("path"):
        public["file"] = str(event["path"]).rsplit("/", 1)[-1]
    return public


def _queue_wait(job: Any) -> float | None:
    enq = getattr(job, "enqueued_at", None)
    if enq is None:
        return None
    start = getattr(job, "started_at", None)
    try:
        end = start.timestamp() if start is not None else time.time()
        return max(0.0, end - enq.timestamp())
    except (AttributeError, OSError, ValueError):
        return None


def _reason_for(exc: BaseException) -> FailureReason:
    if isinstance(exc, SystemExit | KeyboardInterrupt):
        return FailureReason.WORKER_SHUTDOWN
    if type(exc).__name__ == "JobTimeoutException":
        return FailureReason.JOB_TIMEOUT
    return FailureReason.INTERNAL
