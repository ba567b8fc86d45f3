"""Wire types and channels between the controller and its ranks (no job semantics here).

Channels are pipes carrying `multiprocessing` ForkingPickler payloads, so torch tensors travel by shared
memory (CPU) or CUDA IPC (GPU) instead of being copied through the pipe. Pickling happens in the sender's
own thread (unlike `multiprocessing.Queue`, whose feeder thread drops unpicklable objects silently and
would leave the caller waiting for a message that never comes).

Every wait on a channel is bounded. A pipe holds 64 KiB, and a reader that stopped reading (it died, or a
bug left a channel nobody reads) would block a plain writer inside `write()` forever (once, a channel
nobody read jammed the controller after 176 jobs); a writer that died mid-message would block a plain
reader the same way. `Channel.put`/`get` never block in the kernel: they wait in short slices and check
the caller's liveness test and deadline between them, so a controller cannot hang on a pipe.

Every channel has exactly one writing process (the controller, or one rank), so a thread lock orders
frames; no cross-process lock is needed. That matters: a `multiprocessing` lock is a named POSIX semaphore
in /dev/shm (`sem.mp-*`), removed only by its creator's exit handlers or, once every process holding it
has exited, by the resource tracker; a SIGKILLed worker whose tracker was stopped too left them behind
for good. The controller wakes its own waiting thread with a `Waker` (a self-pipe), never by
writing into a rank's channel.
"""

from __future__ import annotations

import io
import multiprocessing.connection
import os
import pickle
import queue
import select
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from ..errors import LtxMgpuError

__all__ = [
    "Channel",
    "ChannelClosed",
    "ChannelTimeout",
    "Failure",
    "Job",
    "MessageKind",
    "Result",
    "TensorPlaceholder",
    "Waker",
    "fill_tensors",
    "placeholders",
    "receive_any",
    "split_tensors",
]

_SMALL_FRAME = 16384  # frames below this go out in one write
_WAIT_SLICE_S = 0.05  # how often a blocked reader/writer re-checks its liveness test and deadline


class ChannelClosed(LtxMgpuError, EOFError):
    """The other side is gone (broken pipe, end of file mid-message) or the caller's liveness test failed."""


class ChannelTimeout(LtxMgpuError, TimeoutError):
    """A write found no room in the pipe (or no free write lock) before its deadline."""


class Channel:
    """One-writer-process, one-reader message pipe with bounded reads and writes.

    Both ends are non-blocking (the flag lives on the pipe's open file descriptions, which spawned ranks
    share), so every reader and writer goes through `get()`/`put()`. Frames are `multiprocessing`'s (`!i`
    length, or -1 then `!Q` above 2 GiB). After `ChannelClosed` or `ChannelTimeout` a frame may be half
    written or half read: the channel is unusable, and so is the fleet it belongs to (the controller
    poisons it). Frames under `PIPE_BUF` (4 KiB: every control message) are written all or nothing.
    Threads of the writing process share it (a thread lock, recreated when the channel is unpickled).
    """

    def __init__(self, ctx: Any) -> None:
        self._reader, self._writer = ctx.Pipe(duplex=False)
        os.set_blocking(self._reader.fileno(), False)
        os.set_blocking(self._writer.fileno(), False)
        self._wlock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"_reader": self._reader, "_writer": self._writer}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._wlock = threading.Lock()

    def fileno(self) -> int:
        """The reading end (for `multiprocessing.connection.wait`)."""
        return self._reader.fileno()

    def put(self, obj: object, *, alive: Callable[[], bool] | None = None, timeout: float | None = None) -> None:
        """Send one message. While the pipe is full (or another writer holds it), wait in short slices;
        raise `ChannelClosed` when the reader is gone or `alive()` turns false, `ChannelTimeout` after
        `timeout` seconds (None: no deadline)."""
        buf = io.BytesIO()
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
        payload = buf.getbuffer()
        size = len(payload)
        header = struct.pack("!i", size) if size <= 0x7FFFFFFF else struct.pack("!i", -1) + struct.pack("!Q", size)
        # one write for small frames (atomic below PIPE_BUF), header then payload for large ones
        parts = [header + bytes(payload)] if size < _SMALL_FRAME else [header, payload]
        deadline = None if timeout is None else time.monotonic() + timeout
        _wait(lambda wait_s: self._wlock.acquire(timeout=wait_s), alive, deadline, "the channel's write lock")
        try:
            fd = self._writer.fileno()
            for part in parts:
                view = memoryview(part).cast("B")
                while view:
                    try:
                        view = view[os.write(fd, view) :]
                    except BlockingIOError:
                        _wait(
                            lambda wait_s, fd=fd: _ready(fd, select.POLLOUT, wait_s),
                            alive,
                            deadline,
                            "room in the pipe (nobody reads it)",
                        )
                    except BrokenPipeError:
                        raise ChannelClosed("the reading side of the channel is gone") from None
        finally:
            self._wlock.release()

    def get(self, timeout: float | None = None, *, alive: Callable[[], bool] | None = None) -> Any:
        """Next message; raises `queue.Empty` when none starts within `timeout` seconds (None: wait). A
        message that has started is read to its end while `alive()` holds (`ChannelClosed` otherwise)."""
        fd = self._reader.fileno()
        if not _ready(fd, select.POLLIN, timeout):
            raise queue.Empty
        (size,) = struct.unpack("!i", self._read(fd, 4, alive))
        if size == -1:
            (size,) = struct.unpack("!Q", self._read(fd, 8, alive))
        return pickle.loads(self._read(fd, size, alive))

    @staticmethod
    def _read(fd: int, size: int, alive: Callable[[], bool] | None) -> bytearray:
        out = bytearray()
        while len(out) < size:
            try:
                chunk = os.read(fd, min(size - len(out), 1 << 20))
            except BlockingIOError:
                _wait(lambda wait_s: _ready(fd, select.POLLIN, wait_s), alive, None, "the rest of a message")
                continue
            if not chunk:
                raise ChannelClosed("every writer of the channel is gone (end of file mid-message)")
            out += chunk
        return out

    def close(self) -> None:
        for end in (self._reader, self._writer):
            try:
                end.close()
            except OSError:
                pass


def receive_any(
    channels: Sequence[Channel],
    timeout: float | None,
    *,
    alive: Callable[[], bool] | None = None,
    waker: Waker | None = None,
) -> tuple[int, Any] | None:
    """The next message from whichever of `channels` has one first: `(index, message)`; None when none
    arrived within `timeout` or `waker` was woken. Messages of one channel keep their order."""
    objects: list[Any] = [*channels, *([waker] if waker is not None else [])]
    for ready in multiprocessing.connection.wait(objects, timeout):
        if ready is waker:
            waker.drain()  # type: ignore[union-attr]
            return None
    for index, channel in enumerate(channels):
        try:
            return index, channel.get(0, alive=alive)
        except queue.Empty:
            continue
    return None


class Waker:
    """A self-pipe: `wake()` from any thread makes the owner's `receive_any` return at once."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def fileno(self) -> int:
        return self._r

    def wake(self) -> None:
        try:
            os.write(self._w, b"!")
        except (BlockingIOError, OSError):
            pass  # already woken (pipe full) or closed: either way nobody waits for this byte

    def drain(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


def _ready(fd: int, event: int, timeout: float | None) -> bool:
    """Whether `fd` becomes readable/writable (`event`) within `timeout` seconds (None: no limit)."""
    poller = select.poll()
    poller.register(fd, event)
    return bool(poller.poll(None if timeout is None else max(0.0, timeout) * 1000))


def _wait(
    attempt: Callable[[float], bool], alive: Callable[[], bool] | None, deadline: float | None, what: str
) -> None:
    """Call `attempt(slice_s)` until it returns True, checking `alive()` and `deadline` between slices."""
    while True:
        wait_s = _WAIT_SLICE_S
        if deadline is not None:
            wait_s = min(wait_s, max(0.0, deadline - time.monotonic()))
        if attempt(wait_s):
            return
        if alive is not None and not alive():
            raise ChannelClosed(f"gave up waiting for {what}: the other side is no longer alive")
        if deadline is not None and time.monotonic() >= deadline:
            raise ChannelTimeout(f"gave up waiting for {what}: deadline passed")


# ==== messages ================================================================================


class MessageKind(Enum):
    """What a `Result` (rank → controller) carries."""

    READY = "ready"  #: the rank's `setup()` returned (job_id -1, value None)
    YIELD = "yield"  #: value = one item the rank's generator yielded
    DONE = "done"  #: value = the generator's return value; the rank finished the job
    ERROR = "error"  #: value = a `RunnerError`; the rank finished the job with a recoverable error


@dataclass
class Job:
    """Controller → driver rank: one job. `tensors` are the top-level tensor kwargs, in skeleton order."""

    job_id: int  #: monotonic over the controller's life; results carrying another id mean desync
    skeleton: dict[str, Any]  #: kwargs with top-level tensors replaced by `TensorPlaceholder`
    tensors: list[torch.Tensor]  #: by shared memory (CPU) or CUDA IPC (GPU)


@dataclass(frozen=True)
class TensorPlaceholder:
    """Stands in for a top-level tensor kwarg in the announced skeleton; receivers allocate from it."""

    idx: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Result:
    """Rank → controller: one message of one job (see `MessageKind` for what `value` is)."""

    kind: MessageKind
    job_id: int  #: the job this message belongs to (-1: not a job's, i.e. READY)
    rank: int  #: the sending rank
    value: Any


@dataclass(frozen=True)
class Failure:
    """Rank → controller, on its own channel: why the rank is about to exit 1."""

    rank: int
    pid: int
    traceback: str


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


def placeholders(skeleton: dict[str, Any]) -> list[TensorPlaceholder]:
    """The skeleton's tensor placeholders in index order (what a receiving rank allocates)."""
    return sorted((v for v in skeleton.values() if isinstance(v, TensorPlaceholder)), key=lambda p: p.idx)


def fill_tensors(skeleton: dict[str, Any], tensors: list[torch.Tensor]) -> dict[str, Any]:
    return {
        key: tensors[value.idx] if isinstance(value, TensorPlaceholder) else value for key, value in skeleton.items()
    }
