"""`RenderService`: what a worker process does with one render job, given its warm fleet.

One instance per worker process (one fleet). `run_job()` is the body of the RQ job function
(`worker.job.render`):

1. bookkeeping (`JobAttempt.start`): attempts (capped: `max_attempts`), the `worker_lost` budget of executions that
   vanished unrecorded (RQ's timeout and TTLs: `JobOutcomes.own_limits`); a job that poisoned fleets is refused;
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
4. commit the file to the spool (manifest written atomically), then either
   - (`upload_pipeline`, the default) hand it to the background `UploadPipeline` and return a small
     hand-off value at once: RQ marks the job `finished` while the state is `rendered`; the pipeline
     writes `uploading` → `uploaded` (or `retrying`/`failed`) and the full result later, or
   - (synchronous) upload it here (retries, confirmation), release it and
5. return the result (bucket, key, size, sha256, presigned URL, timings, fleet).

The service state in the job meta (and the event stream) is the source of truth for clients; RQ's
`finished` only means "rendered" when the pipeline is on. See docs/worker.md, "Job lifecycle".

Each execution is one `worker.jobs.attempt.JobAttempt` (the job, its relay, how it ends), handed on to the
encode and upload stages. Failures raise `JobFailed(reason, ...)` after `worker.jobs.outcomes` recorded the
attempt (a terminal or `retrying` state event) and set RQ's retry decision from the settings' budget for that
reason, which RQ's failure handling then honours. The worker, not the enqueuer, owns the retry policy.
"""

from __future__ import annotations

import logging
import threading
import time
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
from worker.jobs.outcomes import JobOutcomes
from worker.ops.metrics import WorkerMetrics
from worker.render.fleet import WarmFleet
from worker.render.fleet_render import FleetRender
from worker.render.loras import LoraCacheFull, LoraRefused, LoraResolver
from worker.render.results import JobResults
from worker.render.warmup import WarmupRefused
from worker.rq.record import JobRecord
from worker.settings import WorkerSettings
from worker.stages.encode import EncodeStage, PendingEncode
from worker.stages.upload import PendingUpload, UploadPipeline
from worker.uploads.spool import Spool, SpoolEntry
from worker.uploads.storage import Storage, new_render_id
from worker.uploads.uploader import Uploader, UploadFailed

__all__ = ["RenderService"]

log = logging.getLogger("worker.render.service")


class RenderService:
    """Per-process job logic around one `WarmFleet`; see the module docstring."""

    def __init__(self, settings: WorkerSettings, *, group: str, worker_name: str, fleet: WarmFleet, storage: Storage,
                 spool: Spool, metrics: WorkerMetrics, limits: RunnerLimits | None = None) -> None:  # fmt: skip
        self.settings = settings
        self._limits = limits or RunnerLimits(settings.runner, {})
        self.group, self.worker_name, self.fleet = group, worker_name, fleet
        self.storage, self.spool, self.metrics = storage, spool, metrics
        self.outcomes = JobOutcomes(settings, worker_name=worker_name, metrics=metrics)
        #: request LoRAs: fetched, cached and checked before the fleet sees them (worker.render.loras)
        self.loras = LoraResolver.for_worker(settings, fleet.runner_cls, storage, metrics)
        self.uploader = Uploader(storage, spool, attempts=settings.upload_attempts, backoff_s=settings.upload_backoff_s,
                                 backoff_max_s=settings.upload_backoff_max_s)  # fmt: skip
        self.stop_uploads = threading.Event()  # set on cold shutdown: cut upload back-offs short
        self.results = JobResults(storage, fleet, group, worker_name)
        self.pipeline = self._upload_stage()
        self.encoder = EncodeStage(spool=spool, pipeline=self.pipeline, settings=settings, metrics=metrics, group=group)
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
        return UploadPipeline(uploader=self.uploader, spool=self.spool, metrics=self.metrics, group=self.group,
                              worker_name=self.worker_name, threads=s.upload_threads, max_pending=s.max_pending_uploads,
                              max_pending_bytes=s.max_pending_bytes, outcomes=self.outcomes,
                              make_result=self.results.for_upload, stop=self.stop_uploads,
                              on_uploaded=self._count_done, on_upload_failed=self._upload_failed)  # fmt: skip

    @property
    def limits(self) -> RunnerLimits:
        """The runner's limits (published in the health snapshot, checked before each render), with the memory
        each device offers: `LTX_DEVICE_MEMORY_GIB`, else the least of the card's figure (known before loading)
        and what the fleet measured after its ranks' setup and its warm-ups (GPU fleets)."""
        memory = self._limits.memory
        if memory is None or self.settings.device_memory_gib is not None:
            return self._limits
        measured = getattr(self.fleet, "device_memory_bytes", None)
        if isinstance(measured, int | float) and measured > 0:  # (the least seen: the card's figure is never raised)
            self._limits = self._limits.with_capacity(min(round(measured / 2**30, 2), memory.capacity_gib or 1e9))
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

    def _memory_plan(self, attempt: JobAttempt, req: RenderRequest) -> tuple[dict[str, Any] | None, bool]:
        """This attempt's `memory_plan` kwarg (None: none sent) and whether a lower one is left for a retry: one
        step down `memory_plans` per out-of-memory attempt before it. Fails the job (`out_of_memory`, not
        retried) when the attempts before it already ran the lowest plan there is."""
        steps = attempt.out_of_memory_retries()
        plans = self.memory_plans(req.width, req.height, req.num_frames, req.frame_rate)
        if steps >= len(plans):
            attempt.fail(FailureReason.OUT_OF_MEMORY, f"ran out of memory {steps} time(s); no plan lower in memory "
                         "than the last one is left", retryable=False)  # fmt: skip
        return plans[steps], steps + 1 < len(plans)

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
        attempt = JobAttempt(record, self.outcomes)
        with self._lock:
            self.current = attempt
            if self._cancel_before_start == attempt.id:
                attempt.cancel.set()
        try:
            return self._run(attempt, request)
        finally:
            self.loras.cache.release()  # (the fleet has read this job's LoRAs: others may evict them now)
            with self._lock:
                self.current = None
                if self._cancel_before_start == attempt.id:
                    self._cancel_before_start = None

    def _run(self, attempt: JobAttempt, request: Any) -> dict[str, Any]:
        if (result := self._already_uploaded(attempt)) is not None:
            return result
        attempt.start(worker=self.worker_name, fleet=self.group)
        if attempt.queue_wait_s is not None:
            self.metrics.queue_wait_seconds.labels(self.group).observe(attempt.queue_wait_s)
        attempt.check_poison(self.group)  # (re-pushed by id after its renders poisoned fleets: worker.jobs.poison)
        req = self._validate(attempt, request)
        entry = self._spooled(attempt)
        render_s = 0.0
        if entry is not None:
            log.info("job %s: complete render found in the spool; uploading it instead of rendering", attempt.id)
            if self.pipeline.hold(attempt.id):  # recovery already queued it: let that upload finish it
                return self.results.handoff(attempt, entry, render_s)
            attempt.state(JobState.RENDERED, resumed_from_spool=True, sha256=entry.sha256 or None, bytes=entry.size)
            return self._deliver(attempt, entry, render_s)
        return self._deliver(attempt, *self._render(attempt, req))

    def _already_uploaded(self, attempt: JobAttempt) -> dict[str, Any] | None:
        """Recovery (or a late registry cleanup) re-queued a job whose video is already in storage: its result."""
        result = attempt.recorded_result()
        if result is None or self.spool.load(attempt.id) is not None:
            return None
        if self.pipeline.is_pending(attempt.id) or self.encoder.is_pending(attempt.id):
            return None
        log.info("job %s is already uploaded; returning its recorded result", attempt.id)
        return result

    def _validate(self, attempt: JobAttempt, request: Any) -> RenderRequest:
        """The request, or a failed attempt naming the field (what `producer submit` checks at the edge too)."""
        try:
            req = RenderRequest.model_validate(request)
        except ValidationError as exc:
            err = exc.errors()[0]
            field_name = ".".join(str(p) for p in err.get("loc", ())) or "(request)"
            attempt.fail(FailureReason.INVALID_REQUEST, f"field {field_name!r}: {err.get('msg')}", field=field_name,
                         errors=[{"field": ".".join(str(p) for p in e.get("loc", ())), "message": e.get("msg")}
                                 for e in exc.errors()])  # fmt: skip
        if violations := self.limits.violations(req):
            first = violations[0]
            attempt.fail(FailureReason.INVALID_REQUEST, first.message(), field=first.field,
                         errors=[{"field": v.field, "message": v.message()} for v in violations])  # fmt: skip
        return req

    def _spooled(self, attempt: JobAttempt) -> SpoolEntry | None:
        """A complete render of this submission left in the spool (a re-run after an upload failure), else None."""
        try:
            entry = self.spool.load(attempt.id)
        except OSError as exc:
            attempt.spool_failed(exc)
        if entry is not None and not entry.belongs_to(attempt.submission):
            # an earlier submission of this id (its job long expired) left its render here: not this job's video
            log.warning("job %s: the spool holds a render of an earlier submission with this id (%s); "
                        "discarding it and rendering this one", attempt.id, entry.submission)  # fmt: skip
            self.spool.release(entry)
            return None
        return entry

    def _deliver(self, attempt: JobAttempt, entry: SpoolEntry | PendingEncode, render_s: float) -> dict[str, Any]:
        """Hand the render on: to the encode stage (frames), the upload stage (a file), or upload it here."""
        if isinstance(entry, PendingEncode):  # frames, not a file: encoded beside the next job
            if self.settings.upload_pipeline:
                self.encoder.submit(entry)
                return self.results.handoff(attempt, None, render_s)
            entry = self._encode_now(attempt, entry)
        if self.settings.upload_pipeline:  # the background uploader; the fleet takes the next job now
            self.pipeline.submit(PendingUpload(entry=entry, attempt=attempt, render_s=render_s))
            return self.results.handoff(attempt, entry, render_s)
        return self._upload_now(attempt, entry, render_s)

    def _upload_now(self, attempt: JobAttempt, entry: SpoolEntry, render_s: float) -> dict[str, Any]:
        """The synchronous path (`upload_pipeline` off): upload, confirm, record, before the job returns."""
        entry = self.spool.ensure_sha256(entry)
        attempt.state(JobState.UPLOADING, key=entry.key, bytes=entry.size)
        t_up = time.monotonic()
        try:
            stored = self.uploader.upload(entry, on_event=self.pipeline.event_fn(attempt), stop=self.stop_uploads)
        except UploadFailed as exc:
            self.metrics.upload_seconds.labels(self.group).observe(time.monotonic() - t_up)
            self._upload_failed(exc)
            attempt.fail(FailureReason.UPLOAD_FAILED, str(exc), retryable=exc.retryable,
                         spool_path=str(exc.entry.path), upload_attempts=exc.attempts)  # fmt: skip
        upload_s = time.monotonic() - t_up
        self.metrics.upload_seconds.labels(self.group).observe(upload_s)
        self.metrics.upload_bytes.labels(self.group).inc(stored.size)
        result = self.results.uploaded(attempt, entry, stored, render_s, upload_s)
        attempt.uploaded(result)
        self._count_done()
        return result

    # ---- render ---------------------------------------------------------------------------------------
    def _render(self, attempt: JobAttempt, req: RenderRequest) -> tuple[SpoolEntry | PendingEncode, float]:
        """Render on the fleet (`FleetRender`); the video committed to the spool, or its frames for the encoder."""
        attempt.check_cancelled()
        kwargs = self._runner_kwargs(attempt, req)
        memory_plan, lower_left = self._memory_plan(attempt, req)
        if memory_plan is not None:
            kwargs["memory_plan"] = memory_plan
        mode = self.deterministic_mode()  # (in the summary from here on: docs/producer.md, "Reproducible renders")
        attempt.state(JobState.RENDERING, devices=self.group, world_size=self.fleet.world_size, deterministic=mode)
        run = FleetRender(attempt, self.fleet, self.encoder, self.spool, self.metrics, self.group,
                          lower_plan_left=lower_left)  # fmt: skip
        t_render = time.monotonic()
        # (the worker's timeout alone: RQ's job_timeout is set from it, never a client's)
        run.run(kwargs, float(self.settings.render_timeout))
        render_s = time.monotonic() - t_render
        self.metrics.render_seconds.labels(self.group).observe(render_s)
        if "loras" in kwargs and run.output is not None:
            self.loras.record_swap(run.output, attempt.relay)  # (the fleet's swap seconds for this job)
        output_path = Path(kwargs["output_path"])
        if run.output is None or (run.media is None and not output_path.exists()):
            run.abort_stream()
            self.spool.discard_incomplete(attempt.id)
            message = f"the runner finished without writing {output_path.name} (output event: {run.output is not None})"
            attempt.fail(FailureReason.NO_OUTPUT, message)
        if run.media is not None:
            return self._pending_encode(attempt, run, output_path, render_s), render_s
        return self._commit(attempt, run, output_path, render_s), render_s

    def _runner_kwargs(self, attempt: JobAttempt, req: RenderRequest) -> dict[str, Any]:
        """The request's runner kwargs with its LoRAs (fetched and checked: a bad one is a request error that
        never reaches the fleet's weights), the spool path and the media hand-off."""
        try:
            tenant = job_tenant(attempt.id) if self.settings.tenant_ids else None  # (whose S3 folder its LoRAs are in)
            loras = {"loras": self.loras.for_job(req.loras, attempt.relay, tenant)} if req.loras else {}
        except LoraRefused as exc:
            attempt.fail(FailureReason.INVALID_REQUEST, str(exc), field=exc.field)
        except LoraCacheFull as exc:  # no room now (others' jobs pin it, the disk is short): a wait, not a failure
            attempt.wait_for_room(exc)
        except OSError as exc:  # the LoRA cache's disk failed: this host's
            attempt.spool_failed(exc, where="lora cache")
        try:
            output_path = self.spool.prepare(attempt.id, self.settings.output_name)
        except OSError as exc:
            attempt.spool_failed(exc)
        kwargs = {**req.runner_kwargs(), **loras, "output_path": str(output_path)}
        if self.hand_off_media:
            kwargs["media"] = self.media_mode
        return kwargs

    def _pending_encode(self, attempt: JobAttempt, run: FleetRender, path: Path, render_s: float) -> PendingEncode:
        """Frames, not a file: the encode stage's crash marker written, the item for it (`_deliver`)."""
        key = self.storage.key_for(attempt.id, new_render_id(), path.name)
        pending = PendingEncode(attempt=attempt, output_path=path, media=run.media, output=run.output, key=key,
                                render_s=render_s, deterministic=run.deterministic)  # fmt: skip
        try:
            self.encoder.prepare(pending)
        except OSError as exc:
            run.abort_stream()
            self.spool.discard_incomplete(attempt.id)
            attempt.spool_failed(exc)
        return pending

    def _commit(self, attempt: JobAttempt, run: FleetRender, path: Path, render_s: float) -> SpoolEntry:
        """The runner's file committed to the spool (manifest written atomically): `rendered`. The pipeline
        hashes it in its own thread, off the critical path; one storage object per render (`new_render_id`).
        The manifest keeps the fleet's mode: the result of a render recovered after a restart names it."""
        output = run.output or {}  # (never None here: `_render` checked it)
        info = {k: output.get(k) for k in ("frames", "fps", "width", "height")}
        info.update(render_s=round(render_s, 4), deterministic=run.deterministic)
        key = self.storage.key_for(attempt.id, new_render_id(), path.name)
        try:
            entry = self.spool.commit(attempt.id, file_name=path.name, key=key, info=info, queue=attempt.record.queue,
                                      content_type=str(output.get("content_type") or "video/mp4"),
                                      hash_now=not self.settings.upload_pipeline,
                                      submission=attempt.submission)  # fmt: skip
        except OSError as exc:
            self.spool.discard_incomplete(attempt.id)
            attempt.spool_failed(exc)
        sha = {"sha256": entry.sha256} if entry.sha256 else {}
        attempt.state(JobState.RENDERED, bytes=entry.size, render_s=round(render_s, 4), **sha)
        return entry

    def _encode_now(self, attempt: JobAttempt, item: PendingEncode) -> SpoolEntry:
        """The synchronous path (`upload_pipeline` off): encode and commit before the upload."""
        try:
            return self.encoder.encode_now(item)
        except OSError as exc:
            self.spool.discard_incomplete(attempt.id)
            attempt.spool_failed(exc)
        except Exception as exc:
            self.spool.discard_incomplete(attempt.id)
            attempt.fail(FailureReason.INTERNAL, f"encode: {type(exc).__name__}: {exc}")


def _takes(runner_cls: Any, name: str) -> bool:
    """Whether the runner's job signature accepts `name` (a named parameter; not `**kwargs`, which the test
    and noop runners use to ignore fields: they would never hand frames off nor apply a memory plan)."""
    import inspect

    try:
        return name in inspect.signature(runner_cls.__call__).parameters
    except (TypeError, ValueError):
        return False
