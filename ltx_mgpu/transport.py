"""Wire types and channels between the controller and its ranks (no job semantics here).

Channels are pipes carrying `multiprocessing` ForkingPickler payloads, so torch tensors travel by shared
memory (CPU) or CUDA IPC (GPU) instead of being copied through the pipe. Pickling happens in the sender's
own thread (unlike `multiprocessing.Queue`, whose feeder thread drops unpicklable objects silently and
would leave the caller waiting for a message that never comes), and reads take a timeout.
"""

from __future__ import annotations

import io
import pickle
import queue
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

__all__ = ["Channel", "Job", "Result", "TensorPlaceholder", "fill_tensors", "split_tensors"]


class Channel:
    """Many-writer, one-reader message pipe with a read timeout."""

    def __init__(self, ctx: Any) -> None:
        self._reader, self._writer = ctx.Pipe(duplex=False)
        self._wlock = ctx.Lock()

    def put(self, obj: object) -> None:
        buf = io.BytesIO()
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
        payload = buf.getbuffer()
        with self._wlock:
            self._writer.send_bytes(payload)

    def get(self, timeout: float | None = None) -> Any:
        """Next message; raises `queue.Empty` after `timeout` seconds (None blocks)."""
        if not self._reader.poll(timeout):
            raise queue.Empty
        return pickle.loads(self._reader.recv_bytes())

    def close(self) -> None:
        for end in (self._reader, self._writer):
            try:
                end.close()
            except OSError:
                pass


# ==== messages ================================================================================


@dataclass
class Job:
    """Controller → relay rank: one job. `tensors` are the top-level tensor kwargs, in skeleton order."""

    job_id: int  #: monotonic over the controller's life; results carrying another id mean desync
    skeleton: dict[str, Any]  #: kwargs with top-level tensors replaced by `TensorPlaceholder`
    tensors: list[torch.Tensor]


@dataclass(frozen=True)
class TensorPlaceholder:
    """Stands in for a top-level tensor kwarg in the announced skeleton; receivers allocate from it."""

    idx: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Result:
    """Rank → controller. `kind` is "yield" (value = a yielded item), "done" (value = the generator's
    return value), "error" (value = a `RunnerError`), or "fatal" (controller-local wake-up; value = the
    `FleetFailure` to raise)."""

    kind: str
    job_id: int
    rank: int
    value: Any


# ==== top-level tensor kwargs =================================================================


def split_tensors(kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Replace top-level tensors with placeholders (index = dict order). Nested tensors stay in place
    and are pickled with the skeleton."""
    skeleton: dict[str, Any] = {}
    tensors: list[torch.Tensor] = []
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            skeleton[key] = TensorPlaceholder(len(tensors), tuple(value.shape), value.dtype)
            tensors.append(value)
        else:
            skeleton[key] = value
    return skeleton, tensors


def fill_tensors(skeleton: dict[str, Any], tensors: list[torch.Tensor]) -> dict[str, Any]:
    return {
        key: tensors[value.idx] if isinstance(value, TensorPlaceholder) else value for key, value in skeleton.items()
    }
