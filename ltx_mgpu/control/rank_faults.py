"""What an exception a render raised means on a rank: a fleet-level fault (`fleet_fault`: the rank, or its process
group, can no longer be trusted with a job, so it reports and exits 1), or a job error (`job_error`: the job ends,
the rank stays, and the error travels to the controller as the terminal the caller sees: `RunnerError` and
`ValueError` as they are, the request rules' refusal as `RequestRefused`, an out-of-memory error as
`RenderOutOfMemory`, anything else as `RenderFault`, its traceback left in this rank's log). The rank loop that
acts on the answer is `fleet._run_job`."""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist

from .errors import RenderFault, RenderOutOfMemory, RunnerError, value_error_terminal

__all__ = ["fleet_fault", "job_error"]


#: Exception text of faults that leave a rank's device or its process group unusable (sticky CUDA errors,
#: a communicator that failed or timed out): the rank exits and the fleet is rebuilt.
_FLEET_FAULT_TEXT = (
    "CUDA error",
    "illegal memory access",
    "device-side assert",
    "NCCL",
    "CUBLAS_STATUS",
    "cuDNN error",
    "Connection closed by peer",
    "Connection reset by peer",
    "gloo",
)


def fleet_fault(err: BaseException) -> bool:
    """Whether `err` means this rank (or its process group) can no longer be trusted with a job: anything
    that is not an `Exception` (SystemExit, KeyboardInterrupt), a `torch.distributed` error (a collective
    timed out, a peer vanished), CUDA context loss (`torch.AcceleratorError`), or a `RuntimeError` carrying
    such a fault's text. An out-of-memory error is not one: the allocator recovers once the job is dropped."""
    if isinstance(err, RunnerError | ValueError):
        return False
    if not isinstance(err, Exception) or isinstance(err, dist.DistError):
        return True
    if isinstance(err, torch.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(err, accelerator_error):
        return True
    text = _text(err)
    return isinstance(err, RuntimeError) and any(marker in text for marker in _FLEET_FAULT_TEXT)


_MESSAGE_CHARS = 500  # of an unexpected error's message in the job's error (the traceback stays in the log)


def job_error(err: BaseException, rank: int, job_id: int) -> RunnerError:
    """The terminal a rank reports for an error that ends the job but not the fleet. Unexpected ones are
    logged with their traceback here (the rank's log) and travel as `RenderFault` without it; the
    traceback's frames are cleared so the tensors they hold can be freed."""
    if isinstance(err, RunnerError):
        error: RunnerError = err
    elif isinstance(err, ValueError):  # (the request rules' refusal travels as `RequestRefused`)
        error = value_error_terminal(err, _text(err))
    else:
        try:
            tb = "".join(traceback.format_exception(err))
        except Exception:  # (a message that cannot be printed)
            tb = f"{type(err).__name__} (unprintable)\n"
        sys.stderr.write(
            f"[ltx_mgpu rank {rank} pid {os.getpid()}] job {job_id} ended by {type(err).__name__} "
            f"(the fleet stays up):\n{tb}"
        )
        sys.stderr.flush()
        message = f"{type(err).__name__}: {_text(err)}"[:_MESSAGE_CHARS]
        cpu_oom = isinstance(err, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in message
        kind = RenderOutOfMemory if cpu_oom or isinstance(err, torch.OutOfMemoryError | MemoryError) else RenderFault
        error = kind(message, type(err).__name__)
    if err.__traceback__ is not None:
        traceback.clear_frames(err.__traceback__)
    return error


def _text(err: BaseException) -> str:
    try:
        return str(err)
    except Exception:  # (an exception whose __str__ raises, e.g. on a 5000-digit int)
        return repr(type(err))
