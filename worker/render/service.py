"""`RenderService`: what a worker process does with one render job, given its warm fleet.

One instance per worker process (one fleet). `run_job()` is the body of the RQ job function
(`worker.job.render`):

1. bookkeeping (`JobAttempt.start`): attempts (capped: `max_attempts`), the `worker_lost` budget of executions that
   vanished unrecorded (RQ's timeout and TTLs were set by the worker: `JobOutcomes.limits`); a job that poisoned
   fleets is refused;
2. validate the request (`RenderRequest`); a bad one fails at once naming the field, the fleet untouched;
3. render: `controller.stream(**request.runner_kwargs(), output_path=<spool>)`, relaying every event into
   the job's Redis Stream (skipped when the spool already holds a complete render of this job: a re-run
   after an upload failure uploads instead of rendering again);
   With `encode_in_worker` (the default, for runners that take `media`) the fleet hands yuv420p frames and
   audio off instead of writing the file, and `worker.stages.encode.EncodeStage` encodes them beside the next job;
   with `encode_stream` (runners that list "stream" in `media_modes`) the frames arrive while the VAE decodes and
   the encoder's x264 runs start on the first of them (`ltx_mgpu.media.mp4_stream`); a render that
   fails after that aborts them. The drive of the fleet's stream, and every way it fails, is
   `worker.render.fleet_render.FleetRender`;
4. commit the file to the spool (manifest written atomically: `FleetRender.keep`), then either
   - (`upload_pipeline`, the default) hand it to the background `UploadPipeline` and return a small
     hand-off value at once: RQ marks the job `finished` while the state is `rendered`; the pipeline
     writes `uploading` → `uploaded` (or `retrying`/`failed`) and the full result later, or
   - (synchronous, `worker.render.sync_delivery`) upload it here (retries, confirmation), release it and
5. return the result (bucket, key, size, sha256, presigned URL, timings, fleet).

The service state in the job meta (and the event stream) is the source of truth for clients; RQ's
`finished` only means "rendered" when the pipeline is on. See docs/worker.md, "Job lifecycle".

Each execution is one `worker.jobs.attempt.JobAttempt` (the job, its relay, how it ends), handed on to the
encode and upload stages. No step here ends the job: a step that finds the attempt's end returns it as a value
(`worker.jobs.ends.Failure`, `Cancelled`), `_run` returns it at once, and `run_job` hands whatever `_run` returned
to the attempt (`JobAttempt.conclude`), which decides and records it (a terminal or `retrying` state event, RQ's
retry decision from the settings' budget for that reason) and raises what RQ's failure handling then honours.
The worker, not the enqueuer, owns the retry policy.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ltx_contract.health import StorageHealth
from ltx_contract.keys import job_tenant
from ltx_contract.limits import RunnerLimits
from ltx_contract.schema import RenderRequest
from ltx_contract.states import FailureReason, JobState
from ltx_mgpu.spec import memory_plan as memplan
from worker.jobs.attempt import JobAttempt
from worker.jobs.ends import End, Failure
from worker.jobs.outcomes import JobOutcomes
from worker.ops.metrics import WorkerMetrics
from worker.render.fleet import WarmFleet
from worker.render.fleet_render import FleetRender
from worker.render.loras import LoraCacheFull, LoraRefused, LoraResolver
from worker.render.results import JobResults
from worker.render.sync_delivery import SyncDelivery
from worker.render.warmup import WarmupRefused
from worker.rq.record import JobRecord
from worker.settings import WorkerSettings
from worker.stages.encode import EncodeStage, PendingEncode
from worker.stages.upload import PendingUpload, UploadPipeline
from worker.uploads.spool import Spool, SpoolEntry
from worker.uploads.storage import Storage
from worker.uploads.uploader import Uploader, UploadFailed

__all__ = ["RenderService"]

log = logging.getLogger("worker.render.service")


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
        self.group, self.worker_name, self.fleet = group, worker_name, fleet
        self.storage, self.spool, self.metrics = storage, spool, metrics
        self.outcomes = JobOutcomes(settings, worker_name=worker_name, metrics=metrics)
        #: request LoRAs: fetched, cached and checked before the fleet sees them (worker.render.loras)
        self.loras = LoraResolver.for_worker(settings, fleet.runner_cls, storage, metrics)
        self.uploader = Uploader(
            storage,
            spool,
            attempts=settings.upload_attempts,
            backoff_s=settings.upload_backoff_s,
            backoff_max_s=settings.upload_backoff_max_s,
        )
        self.stop_uploads = threading.Event()  # set on cold shutdown: cut upload back-offs short
        self.results = JobResults(storage, fleet, group, worker_name)
        self.pipeline = self._upload_stage()
        self.encoder = EncodeStage(spool=spool, pipeline=self.pipeline, settings=settings, metrics=metrics, group=group)
        self.sync = SyncDelivery(self.pipeline, self.encoder, self.results, self._count_done, self._upload_failed)
        self.hand_off_media = settings.encode_in_worker and _takes(fleet.runner_cls, "media")
        streams = settings.encode_stream and "stream" in getattr(fleet.runner_cls, "media_modes", ())
        self.media_mode = "stream" if streams else "frames"  #: what `media` the fleet is asked for
        self.takes_memory_plan = _takes(fleet.runner_cls, "memory_plan")
        fleet.warm.plans = self.warmup_plans  # the warm-up is planned like a client job (worker.render.warmup)
        self.current: JobAttempt | None = None  #: the job this process is running (at most one)
        # A cancel for the job RQ has started here but whose render has not begun yet (RQ marks it started,
        # then calls the job function): kept until that job's render begins, which then stops at once.
        # Dropping it lost the cancel (CI: "no such job running here", the job rendered to the end).
        self._cancel_before_start: str | None = None
        self.jobs_done = 0
        self.storage_error: str | None = None  # set while storage is degraded (see set_storage_state)
        self.process_started_at: float | None = None  #: wall clock when this worker process started
        self._lock = threading.Lock()

    def _upload_stage(self) -> UploadPipeline:
        """The background uploader. It always exists (it recovers the spool at start); jobs use it only with
        `upload_pipeline` on, otherwise the job function uploads before it returns."""
        s = self.settings
        return UploadPipeline(
            uploader=self.uploader,
            spool=self.spool,
            metrics=self.metrics,
            group=self.group,
            worker_name=self.worker_name,
            threads=s.upload_threads,
            max_pending=s.max_pending_uploads,
            max_pending_bytes=s.max_pending_bytes,
            outcomes=self.outcomes,
            make_result=self.results.for_upload,
            stop=self.stop_uploads,
            on_uploaded=self._count_done,
            on_upload_failed=self._upload_failed,
        )

    @property
    def limits(self) -> RunnerLimits:
        """The runner's limits (published in the health snapshot, checked before each render), with the memory
        each device offers: `LTX_DEVICE_MEMORY_GIB`, else the least of the card's figure (known before loading)
        and what the fleet measured after its ranks' setup and its warm-ups (GPU fleets)."""
        memory = self._limits.memory
        if memory is not None and self.settings.device_memory_gib is None:
            measured = getattr(self.fleet, "device_memory_bytes", None)
            if isinstance(measured, int | float) and measured > 0:  # (the least seen: the card's figure stays a cap)
                self._limits = self._limits.with_capacity(min(round(measured / 2**30, 2), memory.capacity_gib or 1e9))
        return self._limits

    def memory_plans(
        self, width: int, height: int, num_frames: int, frame_rate: float = memplan.DEFAULT_FRAME_RATE
    ) -> list[dict[str, Any] | None]:
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
        plans: list[dict[str, Any] | None] = [first.job_kwargs()]
        if not (first.decode_chunked and first.release_between_stages):  # (unless it is memplan's lowest already)
            plans.append(
                memplan.plan(memory, width, height, num_frames, low_memory=True, frame_rate=frame_rate).job_kwargs()
            )
        return plans

    def warmup_plans(self, kwargs: dict[str, Any]) -> list[dict[str, Any] | None]:
        """A warm-up request's plans (`memory_plans`, as for a client job of its size, with the capacity the fleet
        reported after setup); `WarmupRefused` when a client job of that size would be refused for memory."""
        w, h, f = (int(kwargs[k]) for k in ("width", "height", "num_frames"))
        rate = float(kwargs.get("frame_rate") or memplan.DEFAULT_FRAME_RATE)
        memory = self.limits.memory
        if memory is not None and (refusal := memplan.plan(memory, w, h, f, frame_rate=rate).refusal()) is not None:
            raise WarmupRefused(refusal)
        return self.memory_plans(w, h, f, rate)

    # ==== control from other threads ==================================================================
    def cancel(self, job_id: str | None = None) -> bool:
        """Cooperatively cancel the running job (any thread). Returns True if a job was signalled."""
        with self._lock:
            cur = self.current
            if cur is None or (job_id is not None and cur.id != job_id):
                return False
        cur.request_cancel()
        log.info("cancel requested for job %s", cur.id)
        return True

    def cancel_before_start(self, job_id: str) -> None:
        """Remember a cancel for `job_id`, which RQ has started on this worker but whose render has not begun
        (`run_job` not entered yet): its render stops as soon as it begins. Only the job RQ is starting here
        may be named (the caller checks), so a remembered id never cancels another job; it is forgotten when
        that job's run ends."""
        with self._lock:
            if self.current is None or self.current.id != job_id:
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
    def run_job(self, record: JobRecord, request: Any) -> dict[str, Any]:
        """The job function's body: what this execution gives back, or its end, decided by its attempt."""
        attempt = JobAttempt(record, self.outcomes)
        with self._lock:
            self.current = attempt
            if self._cancel_before_start == attempt.id:
                attempt.cancel.set()
        try:
            return attempt.conclude(self._run(attempt, request))
        finally:
            self.loras.cache.release()  # (the fleet has read this job's LoRAs: others may evict them now)
            with self._lock:
                self.current = None
                if self._cancel_before_start == attempt.id:
                    self._cancel_before_start = None

    def _run(self, attempt: JobAttempt, request: Any) -> dict[str, Any] | End:
        """The steps of one execution; the first that ends the attempt returns its end (`worker.jobs.ends`)."""
        if (result := self._already_uploaded(attempt)) is not None:
            return result
        begun = self._begin(attempt, request)
        if not isinstance(begun, RenderRequest):
            return begun
        if (entry := self._spooled(attempt)) is not None:  # a re-run after an upload failure: upload it again
            return entry if isinstance(entry, Failure) else self._resume(attempt, entry)
        rendered = self._render(attempt, begun)
        return rendered if isinstance(rendered, End) else self._deliver(attempt, *rendered)

    def _already_uploaded(self, attempt: JobAttempt) -> dict[str, Any] | None:
        """Recovery (or a late registry cleanup) re-queued a job whose video is already in storage: its result."""
        result = attempt.recorded_result()
        if (
            result is None
            or self.spool.load(attempt.id) is not None
            or self.pipeline.is_pending(attempt.id)
            or self.encoder.is_pending(attempt.id)
        ):
            return None
        log.info("job %s is already uploaded; returning its recorded result", attempt.id)
        return result

    def _begin(self, attempt: JobAttempt, request: Any) -> RenderRequest | End:
        """The execution counted, if it may run (`JobAttempt.start`), and the request checked: what `producer
        submit` checks at the edge too, a failure naming the field."""
        if (end := attempt.start(worker=self.worker_name, fleet=self.group)) is not None:
            return end
        try:
            req = RenderRequest.model_validate(request)
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(p) for p in err.get("loc", ())) or "(request)"
            errors = [
                {"field": ".".join(str(p) for p in e.get("loc", ())), "message": e.get("msg")} for e in exc.errors()
            ]
            message = f"field {field!r}: {err.get('msg')}"
            return Failure(FailureReason.INVALID_REQUEST, message, details={"field": field, "errors": errors})
        if violations := self.limits.violations(req):
            errors = [{"field": v.field, "message": v.message()} for v in violations]
            details = {"field": violations[0].field, "errors": errors}
            return Failure(FailureReason.INVALID_REQUEST, violations[0].message(), details=details)
        return req

    def _spooled(self, attempt: JobAttempt) -> SpoolEntry | Failure | None:
        """A complete render of this submission left in the spool (a re-run after an upload failure), else None."""
        try:
            entry = self.spool.load(attempt.id)
        except OSError as exc:
            return Failure.spool(exc)
        if entry is not None and not entry.belongs_to(attempt.record.submission):
            # an earlier submission of this id (its job long expired) left its render here: not this job's video
            log.warning(
                "job %s: the spool holds a render of an earlier submission with this id (%s); "
                "discarding it and rendering this one",
                attempt.id,
                entry.submission,
            )
            self.spool.release(entry)
            entry = None
        return entry

    def _resume(self, attempt: JobAttempt, entry: SpoolEntry) -> dict[str, Any] | End:
        """A complete render of this job found in the spool: uploaded instead of rendered again."""
        log.info("job %s: complete render found in the spool; uploading it instead of rendering", attempt.id)
        if self.pipeline.hold(attempt.id):  # recovery already queued it: let that upload finish it
            return attempt.handed_off(0.0, entry)
        attempt.relay.state(JobState.RENDERED, resumed_from_spool=True, sha256=entry.sha256 or None, bytes=entry.size)
        return self._deliver(attempt, entry, 0.0)

    def _deliver(self, attempt: JobAttempt, entry: SpoolEntry | PendingEncode, render_s: float) -> dict[str, Any] | End:
        """Hand the render on beside the next job, to the encode stage (frames) or the upload stage (a file): the
        fleet takes the next job now, and the job function gives back the hand-off. With `upload_pipeline` off
        it is encoded and uploaded here (`worker.render.sync_delivery`)."""
        if not self.settings.upload_pipeline:
            return self.sync.deliver(attempt, entry, render_s)
        frames = isinstance(entry, PendingEncode)
        if frames:
            self.encoder.submit(entry)
        else:
            self.pipeline.submit(PendingUpload(entry=entry, attempt=attempt, render_s=render_s))
        return attempt.handed_off(render_s, None if frames else entry)

    # ---- render ---------------------------------------------------------------------------------------
    def _render(self, attempt: JobAttempt, req: RenderRequest) -> tuple[SpoolEntry | PendingEncode, float] | End:
        """Render on the fleet (`FleetRender`); the video committed to the spool, or its frames for the encoder."""
        prepared = attempt.check_cancelled() or self._runner_kwargs(attempt, req)
        if not isinstance(prepared, tuple):
            return prepared
        kwargs, lower_left = prepared
        run = FleetRender(
            attempt,
            self.fleet,
            self.encoder,
            self.spool,
            self.metrics,
            self.group,
            lower_left,
            storage=self.storage,
            hash_now=not self.settings.upload_pipeline,
        )
        # (the worker's timeout alone: RQ's job_timeout is set from it, never a client's)
        if (end := run.run(kwargs, float(self.settings.render_timeout))) is not None:
            return end
        self.metrics.render_seconds.labels(self.group).observe(run.render_s)
        if "loras" in kwargs and run.output is not None:
            self.loras.record_swap(run.output, attempt.relay)  # (the fleet's swap seconds for this job)
        kept = run.keep(Path(kwargs["output_path"]), run.render_s)
        return kept if isinstance(kept, Failure) else (kept, run.render_s)

    def _runner_kwargs(self, attempt: JobAttempt, req: RenderRequest) -> tuple[dict[str, Any], bool] | End:
        """The request's runner kwargs with its LoRAs (fetched and checked: a bad one is a request error that
        never reaches the fleet's weights), the spool path, the media hand-off and this attempt's memory plan
        (one step down `memory_plans` per out-of-memory attempt before it; `out_of_memory` for good once those
        attempts ran the lowest plan there is); and whether a lower plan is left for a retry."""
        where = "lora cache"  # (whose disk an OSError is: the LoRA cache's, then the spool's)
        try:
            tenant = job_tenant(attempt.id) if self.settings.tenant_ids else None  # (whose S3 folder its LoRAs are in)
            loras = {"loras": self.loras.for_job(req.loras, attempt.relay, tenant)} if req.loras else {}
            where = "spool"
            output_path = self.spool.prepare(attempt.id, self.settings.output_name)
        except (LoraRefused, OSError) as exc:
            return _preparation_failure(exc, where)
        kwargs = {**req.runner_kwargs(), **loras, "output_path": str(output_path)}
        if self.hand_off_media:
            kwargs["media"] = self.media_mode
        steps = attempt.out_of_memory_retries()
        plans = self.memory_plans(req.width, req.height, req.num_frames, req.frame_rate)
        if steps >= len(plans):
            message = f"ran out of memory {steps} time(s); no plan lower in memory than the last one is left"
            return Failure(FailureReason.OUT_OF_MEMORY, message, retryable=False)
        if plans[steps] is not None:
            kwargs["memory_plan"] = plans[steps]
        return kwargs, steps + 1 < len(plans)


def _preparation_failure(exc: LoraRefused | OSError, where: str) -> Failure:
    """How a job ends whose request LoRAs could not be had or whose spool directory could not be made: a LoRA the
    request may not use is the request's fault; a LoRA cache without room now (others' jobs pin it, the disk is
    short) a wait, not a failure; a disk that failed (`where`: the LoRA cache's, the spool's) this host's."""
    if isinstance(exc, LoraRefused):
        return Failure(FailureReason.INVALID_REQUEST, str(exc), details={"field": exc.field})
    if isinstance(exc, LoraCacheFull):
        return Failure.no_room(exc)
    return Failure.spool(exc, where)


def _takes(runner_cls: Any, name: str) -> bool:
    """Whether the runner's job signature accepts `name` (a named parameter; not `**kwargs`, which the test
    and noop runners use to ignore fields: they would never hand frames off nor apply a memory plan)."""
    import inspect

    try:
        return name in inspect.signature(runner_cls.__call__).parameters
    except (TypeError, ValueError):
        return False
