"""`FleetRender`: one attempt's drive of the warm fleet, from `controller.stream()` to its last event.

The service prepares the request (LoRAs, the spool path, the memory plan) and hands the runner kwargs here;
this relays every event into the job's stream and keeps what the rest of the job needs: the runner's
`output` event and, when the fleet hands frames off instead of writing the file, its `media` event (with
`media="stream"` the encoder's `Mp4Stream` is fed while the VAE decodes, and aborted if the render fails).

Every way the render can fail ends the attempt here, once, through `JobAttempt`:

- a cancel (`JobCancelledError`) is recorded as cancelled;
- a runner error is a request error (a rule the edge checks too), out of memory (retried onto a lower plan
  while one is left) or `runner_error`; a driver-only runner error is `asymmetric_runner_error`;
- a fleet failure is counted once, recorded for the poison rules (`worker.jobs.poison`) and retried within
  the budget unless the job is refused from now on;
- kwargs the runner does not accept (`TypeError` from `stream()`) are the request's fault: `invalid_request`;
- anything else (RQ's death penalty, a cold stop, a bug) kills a fleet that may be mid-job (it is rebuilt
  before the next job) and is recorded as `job_timeout`, `worker_shutdown` or `internal`.

An end already recorded (`JobFailed`, `JobCancelledByClient`) passes through untouched: recording it again
as `internal` wrote two outcomes for one attempt.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, NoReturn

from ltx_contract.states import FailureReason
from worker.jobs import poison
from worker.jobs.attempt import JobAttempt, JobCancelledByClient, JobFailed
from worker.ops.metrics import WorkerMetrics
from worker.render.fleet import WarmFleet
from worker.render.warmup import is_out_of_memory
from worker.stages.encode import EncodeStage
from worker.uploads.spool import Spool

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
    #: the deterministic mode of the controller it was dispatched to ("on", "strict", "off"; None: unknown):
    #: added to the relayed `output` event, kept beside the render's hashes and in its result
    deterministic: str | None = None
    output: dict[str, Any] | None = None  #: the runner's `output` event
    media: dict[str, Any] | None = None  #: the runner's frames hand-off (`media`), for the encode stage
    streamed: Any = None  #: the encoder's side of a streamed hand-off (`Mp4Stream`) once it began
    completed: bool = False
    _stream: Any = None  #: the controller's `Stream` once dispatched

    def run(self, kwargs: dict[str, Any], timeout: float) -> None:
        """Render with `kwargs`, relaying every event; raises what ends the attempt (after recording it)."""
        from ltx_mgpu import AsymmetricRunnerError, FleetFailure, JobCancelledError, SymmetricRunnerError

        dispatched_at, oom_kills = time.time(), poison.oom_kills()
        try:
            self._stream = self._dispatch(kwargs, timeout)
            self.attempt.watch(self._stream)
            for item in self._stream:
                self._take(item)
            self.completed = True
        except (JobFailed, JobCancelledByClient):
            self.spool.discard_incomplete(self.attempt.id)
            raise  # (recorded already)
        except JobCancelledError:
            self.spool.discard_incomplete(self.attempt.id)
            self.attempt.cancelled()
        except SymmetricRunnerError as exc:
            self._runner_error(exc)
        except AsymmetricRunnerError as exc:
            self.spool.discard_incomplete(self.attempt.id)
            if is_out_of_memory(exc):  # (a driver-only stage: the other ranks had finished; nobody waits)
                self._out_of_memory(_first_error(exc))
            self.attempt.fail(FailureReason.ASYMMETRIC_RUNNER_ERROR, str(exc))
        except FleetFailure as exc:
            self._fleet_failure(exc, dispatched_at, oom_kills)
        except BaseException as exc:
            self._broken(exc)
        finally:
            self.attempt.unwatch()
            if self.streamed is not None and not self.completed:  # (no x264 run is left waiting for frames)
                self.abort_stream()

    def abort_stream(self) -> None:
        """A streamed hand-off whose render failed: its x264 runs not started are cancelled (`Mp4Stream.abort`)."""
        if self.streamed is not None and not self.streamed.aborted:
            self.streamed.abort()
            self.metrics.encode_aborted.labels(self.group).inc()

    # ---- the stream ------------------------------------------------------------------------------------
    def _dispatch(self, kwargs: dict[str, Any], timeout: float) -> Any:
        from ltx_mgpu import FleetFailure

        ctl = self.fleet.controller
        if ctl is None:
            raise FleetFailure("fleet is not running", reason="rank_exited")
        # (a poisoned controller's stream() raises "MGPUController is dead" caused by its own failure, the same
        # object its monitor reported: counted once)
        mode = getattr(ctl, "deterministic", None)
        self.deterministic = mode if isinstance(mode, str) else None
        try:
            return ctl.stream(timeout=timeout, **kwargs)
        except TypeError as exc:  # kwargs the runner does not accept: the request, not the fleet
            self.attempt.fail(FailureReason.INVALID_REQUEST, str(exc), field="(runner kwargs)")
        except RuntimeError as exc:  # "MGPUController is dead": poisoned between jobs
            cause = exc.__cause__ if isinstance(exc.__cause__, FleetFailure) else None
            raise cause or FleetFailure(str(exc), reason="rank_exited") from exc

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
            self.attempt.emit({**_public_output(item), "deterministic": self.deterministic})
        else:
            self.attempt.emit(item)

    # ---- how a render fails ------------------------------------------------------------------------------
    def _out_of_memory(self, message: str) -> NoReturn:
        """(the ranks freed what the job held; the retry takes the lower-memory plan, if one is left)"""
        if self.lower_plan_left:
            self.attempt.fail(FailureReason.OUT_OF_MEMORY, message, retryable=None)
        note = " (the lowest-memory plan ran out of memory: not retried)"
        self.attempt.fail(FailureReason.OUT_OF_MEMORY, f"{message}{note}", retryable=False)

    def _runner_error(self, exc: Any) -> NoReturn:
        self.spool.discard_incomplete(self.attempt.id)
        if (refused := exc.request_refused) is not None:  # a rule the edge checks too: a request error
            self.attempt.fail(FailureReason.INVALID_REQUEST, str(exc), field=refused.field)
        if exc.out_of_memory:
            self._out_of_memory(str(exc))
        self.attempt.fail(FailureReason.RUNNER_ERROR, str(exc))

    def _fleet_failure(self, exc: Any, dispatched_at: float, oom_kills: int | None) -> NoReturn:
        self.spool.discard_incomplete(self.attempt.id)
        info = self.fleet.record_failure(exc)  # (counted once: the monitor may have reported it already)
        self.attempt.emit({"type": "fleet", "action": "failed", **info})
        after = poison.oom_kills()
        oom_killed = oom_kills is not None and after is not None and after > oom_kills
        lasting = poison.lasting(info.get("fleet_reason"), info.get("exitcode"), oom_kills_during_job=oom_killed,
                                 during_job=getattr(exc, "detected_at", 0.0) >= dispatched_at)  # fmt: skip
        refused = self.attempt.poisoned(info.get("fleet_reason"), group=self.group, lasting=lasting)
        # (the refusal first: a long fleet message is cut to its first line for Redis, and the reason it is not
        # retried must survive that)
        message = f"{refused}: {info['message']}" if refused else info["message"]
        self.attempt.fail(FailureReason.FLEET_FAILURE, message, retryable=False if refused else None,
                          **{k: v for k, v in info.items() if k != "message"})  # fmt: skip

    def _broken(self, exc: BaseException) -> NoReturn:
        """RQ's death penalty (JobTimeoutException), a cold stop (SystemExit) or a bug: the fleet may be
        mid-job, so it cannot be trusted with the next one. Kill it; it is rebuilt before the next job."""
        self.spool.discard_incomplete(self.attempt.id)
        if self._stream is not None and not self._stream.done:
            self.fleet.kill_for_rebuild()
        reason = _reason_for(exc)
        if reason is FailureReason.WORKER_SHUTDOWN:
            self.attempt.fail(reason, "worker stopped cold mid-job", reraise=exc)
        self.attempt.fail(reason, f"{type(exc).__name__}: {exc}", reraise=exc)


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
