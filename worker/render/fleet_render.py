"""`FleetRender`: one attempt's drive of the warm fleet, from `controller.stream()` to its last event, and what
the render left, kept for the stages (`keep`: the frames for the encode stage, or the file committed to the spool).

The service prepares the request (LoRAs, the spool path, the memory plan) and hands the runner kwargs here;
this relays every event into the job's stream and keeps what the rest of the job needs: the runner's
`output` event and, when the fleet hands frames off instead of writing the file, its `media` event (with
`media="stream"` the encoder's `Mp4Stream` is fed while the VAE decodes, and aborted if the render fails).

Every way the render can fail is told here, once, as the attempt's end (a `worker.jobs.ends` value that `run`
returns and the attempt decides: `JobAttempt.conclude`):

- a cancel (`JobCancelledError`) is a cancel;
- a runner error is a request error (a rule the edge checks too), out of memory (retried onto a lower plan
  while one is left) or `runner_error`; a driver-only runner error is `asymmetric_runner_error`;
- a fleet failure is counted once, recorded for the poison rules (`worker.jobs.poison`) and retried within
  the budget unless the job is refused from now on;
- kwargs the runner does not accept (`TypeError` from `stream()`) are the request's fault: `invalid_request`;
- anything else (RQ's death penalty, a cold stop, a bug) kills a fleet that may be mid-job (it is rebuilt
  before the next job) and is `job_timeout`, `worker_shutdown` or `internal`, raised again once recorded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ltx_contract.states import FailureReason, JobState
from worker.jobs import poison
from worker.jobs.attempt import JobAttempt
from worker.jobs.ends import CANCELLED, End, Failure
from worker.ops.metrics import WorkerMetrics
from worker.render.fleet import WarmFleet
from worker.render.warmup import is_out_of_memory
from worker.stages.encode import EncodeStage, PendingEncode
from worker.uploads.spool import Spool, SpoolEntry
from worker.uploads.storage import Storage, new_render_id

__all__ = ["MEDIA_EVENT", "MEDIA_FRAMES_EVENT", "MEDIA_OPEN_EVENT", "FleetRender"]

MEDIA_EVENT = "media"  #: `ltx_mgpu.control.events.MEDIA`: the runner's frames hand-off (the engine is imported lazily)
MEDIA_OPEN_EVENT = "media_open"  #: `ltx_mgpu.control.events.MEDIA_OPEN`: a streamed hand-off's buffer
MEDIA_FRAMES_EVENT = "media_frames"  #: `ltx_mgpu.control.events.MEDIA_FRAMES`: frames [0, ready) are final


@dataclass(eq=False)
class FleetRender:
    """One attempt's render on the fleet; `run()` once, then read `output` and `media`."""

    attempt: JobAttempt
    fleet: WarmFleet
    encoder: EncodeStage
    spool: Spool
    metrics: WorkerMetrics
    group: str
    #: an out-of-memory end is retried only onto a strictly lower-memory plan (never the one that ran out)
    lower_plan_left: bool = True
    storage: Storage | None = None  #: where the video will go (its object key is chosen when it is kept)
    hash_now: bool = False  #: hash the committed file now (no upload stage to do it off the critical path)
    #: the deterministic mode of the controller it was dispatched to ("on", "strict", "off"; None: unknown):
    #: added to the relayed `output` event, kept beside the render's hashes and in its result (equal hashes are
    #: promised only between renders of a deterministic fleet: `ltx_mgpu.control.determinism`)
    deterministic: str | None = None
    render_s: float = 0.0  #: seconds from `rendering` to the render's last event (`run`)
    output: dict[str, Any] | None = None  #: the runner's `output` event
    media: dict[str, Any] | None = None  #: the runner's frames hand-off (`media`), for the encode stage
    streamed: Any = None  #: the encoder's side of a streamed hand-off (`Mp4Stream`) once it began
    completed: bool = False
    _stream: Any = None  #: the controller's `Stream` once dispatched
    _dispatching: bool = False  #: `controller.stream()` is being called

    def run(self, kwargs: dict[str, Any], timeout: float) -> End | None:
        """`rendering` (on the fleet's devices, in its deterministic mode), then the render with `kwargs`, every
        event relayed; how the attempt ended if the render did not complete. `render_s`: how long it took."""
        ctl = self.fleet.controller
        # (the mode is in the summary from here on: docs/producer.md, "Reproducible renders")
        mode = getattr(ctl, "deterministic", None)
        self.deterministic = mode if isinstance(mode, str) else None
        world = self.fleet.world_size
        self.attempt.relay.state(
            JobState.RENDERING, devices=self.group, world_size=world, deterministic=self.deterministic
        )
        t0 = time.monotonic()
        dispatched_at, oom_kills = time.time(), poison.oom_kills()
        end = None
        try:
            self._stream = self._dispatch(ctl, kwargs, timeout)
            self.attempt.watch(self._stream)
            for item in self._stream:
                self._take(item)
            self.completed = True
        except BaseException as exc:
            self.spool.discard_incomplete(self.attempt.id)
            end = self._ended_by(exc, dispatched_at, oom_kills)
        finally:
            self.attempt.unwatch()
            if self.streamed is not None and not self.completed:  # (no x264 run is left waiting for frames)
                self.abort_stream()
            self.render_s = time.monotonic() - t0
        return end

    def keep(self, path: Path, render_s: float) -> SpoolEntry | PendingEncode | Failure:
        """What a completed render left, kept for the stages: its frames for the encode stage, or the runner's
        file committed to the spool; `no_output` when the runner wrote neither."""
        if self.output is None or (self.media is None and not path.exists()):
            self.abort_stream()
            self.spool.discard_incomplete(self.attempt.id)
            message = f"the runner finished without writing {path.name} (output event: {self.output is not None})"
            return Failure(FailureReason.NO_OUTPUT, message)
        assert self.storage is not None  # (a render kept has a storage to go to)
        key = self.storage.key_for(self.attempt.id, new_render_id(), path.name)  # (one storage object per render)
        return (
            self._pending_encode(path, key, render_s) if self.media is not None else self._commit(path, key, render_s)
        )

    def _pending_encode(self, path: Path, key: str, render_s: float) -> PendingEncode | Failure:
        """Frames, not a file: the encode stage's crash marker written, the item for it."""
        pending = PendingEncode(
            attempt=self.attempt,
            output_path=path,
            media=self.media,
            output=self.output,
            key=key,
            render_s=render_s,
            deterministic=self.deterministic,
        )
        try:
            self.encoder.prepare(pending)
        except OSError as exc:
            self.abort_stream()
            self.spool.discard_incomplete(self.attempt.id)
            return Failure.spool(exc)
        return pending

    def _commit(self, path: Path, key: str, render_s: float) -> SpoolEntry | Failure:
        """The runner's file committed to the spool (manifest written atomically): `rendered`. With the upload
        stage it hashes the file in its own thread, off the critical path. The manifest keeps the fleet's mode:
        the result of a render recovered after a restart names it."""
        output, record = self.output or {}, self.attempt.record
        info = {k: output.get(k) for k in ("frames", "fps", "width", "height")}
        info.update(render_s=round(render_s, 4), deterministic=self.deterministic)
        content_type = str(output.get("content_type") or "video/mp4")
        try:
            entry = self.spool.commit(
                self.attempt.id,
                file_name=path.name,
                key=key,
                info=info,
                queue=record.queue,
                content_type=content_type,
                hash_now=self.hash_now,
                submission=record.submission,
            )
        except OSError as exc:
            self.spool.discard_incomplete(self.attempt.id)
            return Failure.spool(exc)
        sha = {"sha256": entry.sha256} if entry.sha256 else {}
        self.attempt.relay.state(JobState.RENDERED, bytes=entry.size, render_s=round(render_s, 4), **sha)
        return entry

    def abort_stream(self) -> None:
        """A streamed hand-off whose render failed: its x264 runs not started are cancelled (`Mp4Stream.abort`)."""
        if self.streamed is not None and not self.streamed.aborted:
            self.streamed.abort()
            self.metrics.encode_aborted.labels(self.group).inc()

    # ---- the stream ------------------------------------------------------------------------------------
    def _dispatch(self, ctl: Any, kwargs: dict[str, Any], timeout: float) -> Any:
        from ltx_mgpu import FleetFailure

        if ctl is None:
            raise FleetFailure("fleet is not running", reason="rank_exited")
        # (a poisoned controller's stream() raises "MGPUController is dead" caused by its own failure, the same
        # object its monitor reported: counted once)
        self._dispatching = True  # (a TypeError now is kwargs the runner does not accept: the request's fault)
        try:
            stream = ctl.stream(timeout=timeout, **kwargs)
        except RuntimeError as exc:  # "MGPUController is dead": poisoned between jobs
            cause = exc.__cause__ if isinstance(exc.__cause__, FleetFailure) else None
            raise cause or FleetFailure(str(exc), reason="rank_exited") from exc
        self._dispatching = False
        return stream

    def _take(self, item: Any) -> None:
        """One item of the stream: relayed to clients, or kept for the encode stage."""
        if not isinstance(item, dict) or "type" not in item:
            return  # non-driver ranks or diagnostic yields: nothing a client needs
        kind = item["type"]
        if kind == MEDIA_OPEN_EVENT:  # the decode begins: x264 runs start as frames arrive
            self.streamed = self.encoder.open_stream(item)
        elif kind == MEDIA_FRAMES_EVENT:
            if self.streamed is not None:
                self.streamed.advance(item)
        elif kind == MEDIA_EVENT:  # frames and waveform in shared memory: for the encoder, never relayed
            self.media = self.streamed.finish(item) if self.streamed is not None else item
        elif kind == "output":
            self.output = item
            self.metrics.fleet_busy_seconds.labels(self.group).inc(float(item.get("gpu_busy_s") or 0.0))
            self.attempt.relay.emit({**_public_output(item), "deterministic": self.deterministic})
        else:
            self.attempt.relay.emit(item)

    # ---- how a render fails ------------------------------------------------------------------------------
    def _ended_by(self, exc: BaseException, dispatched_at: float, oom_kills: int | None) -> End:
        """The attempt's end, from what ended the render (the module docstring)."""
        from ltx_mgpu import AsymmetricRunnerError, FleetFailure, JobCancelledError, SymmetricRunnerError

        if isinstance(exc, TypeError) and self._dispatching:  # kwargs the runner does not accept: the request's
            return Failure(FailureReason.INVALID_REQUEST, str(exc), details={"field": "(runner kwargs)"})
        if isinstance(exc, JobCancelledError):
            return CANCELLED
        if isinstance(exc, SymmetricRunnerError):
            return self._runner_error(exc)
        if isinstance(exc, AsymmetricRunnerError):
            if is_out_of_memory(exc):  # (a driver-only stage: the other ranks had finished; nobody waits)
                return self._out_of_memory(_first_error(exc))
            return Failure(FailureReason.ASYMMETRIC_RUNNER_ERROR, str(exc))
        if isinstance(exc, FleetFailure):
            return self._fleet_failure(exc, dispatched_at, oom_kills)
        return self._broken(exc)

    def _out_of_memory(self, message: str) -> Failure:
        """(the ranks freed what the job held; the retry takes the lower-memory plan, if one is left)"""
        if self.lower_plan_left:
            return Failure(FailureReason.OUT_OF_MEMORY, message)
        note = " (the lowest-memory plan ran out of memory: not retried)"
        return Failure(FailureReason.OUT_OF_MEMORY, f"{message}{note}", retryable=False)

    def _runner_error(self, exc: Any) -> Failure:
        if (refused := exc.request_refused) is not None:  # a rule the edge checks too: a request error
            return Failure(FailureReason.INVALID_REQUEST, str(exc), details={"field": refused.field})
        if exc.out_of_memory:
            return self._out_of_memory(str(exc))
        return Failure(FailureReason.RUNNER_ERROR, str(exc))

    def _fleet_failure(self, exc: Any, dispatched_at: float, oom_kills: int | None) -> Failure:
        info = self.fleet.record_failure(exc)  # (counted once: the monitor may have reported it already)
        self.attempt.relay.emit({"type": "fleet", "action": "failed", **info})
        after = poison.oom_kills()
        oom_killed = oom_kills is not None and after is not None and after > oom_kills
        during_job = getattr(exc, "detected_at", 0.0) >= dispatched_at
        lasting = poison.lasting(
            info.get("fleet_reason"), info.get("exitcode"), oom_kills_during_job=oom_killed, during_job=during_job
        )
        refused = self.attempt.poisoned(info.get("fleet_reason"), group=self.group, lasting=lasting)
        # (the refusal first: a long fleet message is cut to its first line for Redis, and the reason it is not
        # retried must survive that)
        message = f"{refused}: {info['message']}" if refused else info["message"]
        details = {k: v for k, v in info.items() if k != "message"}
        return Failure(FailureReason.FLEET_FAILURE, message, retryable=False if refused else None, details=details)

    def _broken(self, exc: BaseException) -> Failure:
        """RQ's death penalty (JobTimeoutException), a cold stop (SystemExit) or a bug: the fleet may be
        mid-job, so it cannot be trusted with the next one. Kill it; it is rebuilt before the next job. The
        exception is raised again once the end is recorded (RQ must see it)."""
        if self._stream is not None and not self._stream.done:
            self.fleet.kill_for_rebuild()
        reason = _reason_for(exc)
        message = "worker stopped cold mid-job" if reason is FailureReason.WORKER_SHUTDOWN else None
        return Failure(reason, message or f"{type(exc).__name__}: {exc}", reraise=exc)


def _first_error(exc: Any) -> str:
    from ltx_mgpu import RunnerError

    return next((t.message for t in getattr(exc, "terminals", ()) if isinstance(t, RunnerError)), str(exc))


def _public_output(event: dict[str, Any]) -> dict[str, Any]:
    """The runner's `output` event for clients: the file's name, not the worker's local spool path."""
    public = {k: v for k, v in event.items() if k != "path"}
    if event.get("path"):
        public["file"] = str(event["path"]).rsplit("/", 1)[-1]
    return public


def _reason_for(exc: BaseException) -> FailureReason:
    if isinstance(exc, SystemExit | KeyboardInterrupt):
        return FailureReason.WORKER_SHUTDOWN
    if type(exc).__name__ == "JobTimeoutException":
        return FailureReason.JOB_TIMEOUT
    return FailureReason.INTERNAL
