"""`IpcAll2All` (one rank of a process group) and `LoopbackAll2All` (W ranks in one process).

Contract (the same for both):
- Construction of `IpcAll2All` is a collective over `group`: every rank must build the same instances in
  the same order. Python gathers the IPC handles and checks that all ranks agree (one host, same buffer
  size and dtype); C++ maps the peers and owns every byte of device memory.
- Every op launches one kernel on the current CUDA stream of the instance's device and returns at once.
  `copy_out=True` (default) returns a fresh tensor; `copy_out=False` returns a view of the exchange
  buffer that stays valid only until the next op on this instance is enqueued.
- All ranks must call the same ops in the same order with consistent shapes. A rank that does not
  arrive within `timeout_s` makes the others' kernels give up (no trap: the CUDA context stays usable);
  the failure is recorded in host-mapped memory and raised as `All2AllTimeoutError` by `check()`,
  `synchronize()` or the next op. From then on the instance refuses every op: build a new one.
- `destroy()` is idempotent; a `weakref.finalize` calls it when the instance is collected.
"""

from __future__ import annotations

import socket
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from . import _checks as ck
from ._checks import SUPPORTED_DTYPES
from ._loader import extension

__all__ = ["SUPPORTED_DTYPES", "All2AllError", "All2AllTimeoutError", "IpcAll2All", "LoopbackAll2All"]


class All2AllError(RuntimeError):
    """The exchange instance failed (handshake, launch, or an earlier timeout) and refuses further use."""


class All2AllTimeoutError(All2AllError):
    """A barrier of the exchange timed out: `missing_rank` never arrived while `rank` waited for it."""

    def __init__(self, rank: int, missing_rank: int, phase: str, timeout_s: float) -> None:
        self.rank = rank
        self.missing_rank = missing_rank
        self.phase = phase
        self.timeout_s = timeout_s
        super().__init__(
            f"all2all {phase} barrier timed out after {timeout_s:g} s on rank {rank}: rank {missing_rank} "
            "never arrived. The CUDA context is intact but this all2all instance is unusable; create a new one "
            "(and check why that rank did not call the same exchange)."
        )


class _DeviceBytes:
    """A CUDA-array-interface view of raw device bytes, so torch can wrap the C++-owned buffer."""

    def __init__(self, ptr: int, nbytes: int, owner: Any) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}
        self._owner = owner  # keeps the runtime object alive while a view exists


def _destroy_runtime(rt: Any) -> None:
    rt.destroy()


class _Instance:
    """What both modes share: validation, launch, output views, error checks, teardown."""

    def __init__(
        self,
        *,
        world: int,
        rank: int,
        max_tokens_per_rank: int,
        hidden_dim: int,
        dtype: torch.dtype,
        device: torch.device | str | int | None,
        timeout_s: float,
        max_batch: int,
    ) -> None:
        ck.check_world(world)
        self._itemsize = ck.check_dtype(dtype)
        self._dtype = dtype
        self._device = ck.resolve_device(device)
        self._timeout_s = ck.check_timeout(timeout_s)
        self._capacity = ck.capacity_bytes(max_tokens_per_rank, hidden_dim, self._itemsize, max_batch)
        self._world = world
        self._rank = rank
        self._hidden_dim = hidden_dim
        self._counts: list[int] | None = None
        self._rt: Any = None
        self._views: dict[int, torch.Tensor] = {}
        self._finalizer: weakref.finalize | None = None
        self._failure: All2AllError | None = None

    # ---- properties ---------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self._world

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    @property
    def blocks_per_rank(self) -> int:
        return int(self._live().blocks_per_src)

    # ---- configuration -------------------------------------------------------------------------------------
    def set_rank_tokens(self, counts: Sequence[int]) -> None:
        """Per-rank token counts of the next exchanges (host state only: no device traffic, no sync).
        A CUDA graph captures the counts in effect at capture time."""
        c = ck.check_counts(counts, self._world)
        self._live().set_rank_tokens(c)
        self._counts = c

    def set_timeout(self, timeout_s: float) -> None:
        """Barrier timeout for later launches (e.g. raise it for a first compiled forward)."""
        t = ck.check_timeout(timeout_s)
        self._live().set_timeout(t)
        self._timeout_s = t

    def fill_buffers_(self, value: int) -> None:
        """Fill this process's exchange buffer(s) with one byte value (tests poison them to prove that every
        output byte is written). Enqueued on the current stream."""
        ranks = range(self._world) if isinstance(self, LoopbackAll2All) else [self._rank]
        for r in ranks:
            self._view(r, (0,))
            self._views[r].fill_(value)

    # ---- errors and teardown --------------------------------------------------------------------------------
    def check(self) -> None:
        """Raises the recorded failure, if any exchange of this instance failed. Never blocks."""
        if self._failure is not None:
            raise self._failure
        if self._rt is None:
            return
        state = self._rt.error_state()
        if state is not None:
            waiting, missing, phase, _seen, _expected = state
            phase_name = "entry" if phase == 1 else "exit"
            self._failure = All2AllTimeoutError(waiting, missing, phase_name, self._timeout_s)
            raise self._failure

    def synchronize(self) -> None:
        """Waits for the current stream of this device, then raises a recorded failure (if any)."""
        torch.cuda.current_stream(self._device).synchronize()
        self.check()

    def destroy(self) -> None:
        """Frees the buffers and peer mappings; safe to call twice. Views returned with copy_out=False die."""
        self._views.clear()
        if self._finalizer is not None:
            self._finalizer()

    @property
    def destroyed(self) -> bool:
        return self._rt is None or bool(self._rt.destroyed)

    def _live(self) -> Any:
        if self._rt is None or self._rt.destroyed:
            raise All2AllError("this all2all instance was destroyed")
        return self._rt

    def _arm_finalizer(self) -> None:
        self._finalizer = weakref.finalize(self, _destroy_runtime, self._rt)

    # ---- ops ------------------------------------------------------------------------------------------------
    def _view(self, rank: int, shape: tuple[int, ...]) -> torch.Tensor:
        if rank not in self._views:
            ptr = int(self._rt.data_ptr(rank))
            raw = torch.as_tensor(_DeviceBytes(ptr, self._capacity, self._rt), device=self._device)
            self._views[rank] = raw
        nbytes = self._itemsize
        for v in shape:
            nbytes *= v
        return self._views[rank][:nbytes].view(self._dtype).view(shape)

    def _exchange(
        self, op: int, xs: Sequence[torch.Tensor], ranks: Sequence[int], copy_out: bool
    ) -> list[torch.Tensor]:
        rt = self._live()
        self.check()
        for x in xs:
            ck.check_input(x, op, dtype=self._dtype, device=self._device)
        shape = tuple(xs[0].shape)
        if any(tuple(x.shape[0:1]) + tuple(x.shape[2:]) != shape[0:1] + shape[2:] for x in xs):
            raise ValueError(f"{ck.OP_NAMES[op]}: inputs disagree on (B, H, D): {[tuple(x.shape) for x in xs]}")
        shapes = [
            ck.output_shape(op, x.shape, world=self._world, rank=r, counts=self._counts)
            for x, r in zip(xs, ranks, strict=True)
        ]
        for x in xs:
            ck.check_capacity(
                op, x.shape, world=self._world, counts=self._counts, itemsize=self._itemsize, capacity=self._capacity
            )
        b, _, h, d = shape
        stream = torch.cuda.current_stream(self._device).cuda_stream
        try:
            rt.launch(op, [x.data_ptr() for x in xs], b, [int(x.shape[1]) for x in xs], h, d, stream)
        except RuntimeError as exc:
            self._failure = All2AllError(str(exc))
            raise self._failure from exc
        outs = [self._view(r, shp) for r, shp in zip(ranks, shapes, strict=True)]
        if copy_out:
            outs = [o.clone() for o in outs]
        return outs


class IpcAll2All(_Instance):
    """One rank's CUDA-IPC exchange over `group` (all ranks on one host, at most 8).

    Arguments:
        group: the process group whose ranks exchange (gloo or NCCL; only objects travel over it).
        max_tokens_per_rank: tokens of the largest local shard (`S_local`) any op will see.
        hidden_dim: `H * D` of the exchanged activations.
        dtype: `torch.bfloat16`, `torch.float16`, `torch.float32` or `torch.float8_e4m3fn`.
        device: the rank's own CUDA device (default: the current device). Never derived from the rank.
        timeout_s: barrier timeout in seconds (default 10).
        max_batch: largest batch size `B` (the buffer holds `max_batch * max_tokens_per_rank * hidden_dim`).
        blocks_per_sm: blocks per SM of the exchange grid (all ranks use the smallest SM count among them).
    """

    def __init__(
        self,
        group: Any = None,
        *,
        max_tokens_per_rank: int,
        hidden_dim: int,
        dtype: torch.dtype,
        device: torch.device | str | int | None = None,
        timeout_s: float = 10.0,
        max_batch: int = 1,
        blocks_per_sm: int = 1,
    ) -> None:
        import torch.distributed as dist

        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        super().__init__(
            world=world,
            rank=rank,
            max_tokens_per_rank=max_tokens_per_rank,
            hidden_dim=hidden_dim,
            dtype=dtype,
            device=device,
            timeout_s=timeout_s,
            max_batch=max_batch,
        )
        _C = extension()
        info: dict[str, Any]
        try:
            self._rt = _C.Runtime(
                self._device.index, rank, world, self._capacity, self._itemsize, self._timeout_s, False
            )
            self._arm_finalizer()
            info = {
                "handle": self._rt.ipc_handle(),
                "host": socket.gethostname(),
                "capacity": self._capacity,
                "itemsize": self._itemsize,
                "sms": self._rt.num_sms,
                "occupancy": self._rt.blocks_per_sm,
                "device": self._device.index,
            }
        except Exception as exc:  # report to peers instead of leaving them blocked in the gather
            info = {"error": f"{type(exc).__name__}: {exc}"}
        infos = _gather(info, group, world)
        self._raise_if_failed(infos, "creating the exchange buffer")
        for key in ("host", "capacity", "itemsize"):
            if len({i[key] for i in infos}) != 1:
                self.destroy()
                raise All2AllError(
                    f"ranks disagree on {key}: {[i[key] for i in infos]}; the ipc all2all needs "
                    "one host and identical max_tokens_per_rank/hidden_dim/dtype/max_batch"
                )
        sms = min(i["sms"] for i in infos)
        limit = min(i["sms"] * i["occupancy"] for i in infos)
        blocks = max(world, min(sms * int(blocks_per_sm), limit))
        try:
            self._rt.open_peers([i["handle"] for i in infos], blocks)
            status: dict[str, Any] = {}
        except Exception as exc:
            status = {"error": f"{type(exc).__name__}: {exc}"}
        self._raise_if_failed(_gather(status, group, world), "mapping peer buffers (is peer access possible?)")
        self._view(rank, (0,))  # wrap the buffer now rather than during a CUDA-graph capture

    def _raise_if_failed(self, infos: list[dict[str, Any]], what: str) -> None:
        errors = {r: i["error"] for r, i in enumerate(infos) if "error" in i}
        if errors:
            self.destroy()
            raise All2AllError(f"ipc all2all failed {what} on rank(s) {sorted(errors)}: {errors}")

    @property
    def rank(self) -> int:
        return self._rank

    def send_recv_heads(self, x: torch.Tensor, *, copy_out: bool = True) -> torch.Tensor:
        """`(B, S_local, H, D)` -> `(B, S_total, H/w, D)`: every rank's tokens, this rank's head slice
        `[rank*H/w, (rank+1)*H/w)`, tokens in rank order."""
        return self._exchange(ck.OP_SEND_RECV, [x], [self._rank], copy_out)[0]

    def gather_heads(self, x: torch.Tensor, *, copy_out: bool = True) -> torch.Tensor:
        """`(B, S_total, H/w, D)` -> `(B, S_local, H, D)`: the inverse of `send_recv_heads`."""
        return self._exchange(ck.OP_GATHER, [x], [self._rank], copy_out)[0]

    def all_gather_heads(self, x: torch.Tensor, *, copy_out: bool = True) -> torch.Tensor:
        """`(B, S, H/w, D)` -> `(B, S, H, D)`: every rank's head slice, same tokens everywhere (audio path)."""
        return self._exchange(ck.OP_ALL_GATHER, [x], [self._rank], copy_out)[0]


class LoopbackAll2All(_Instance):
    """W ranks' buffers on one GPU driven by one process: one launch moves all W ranks' data, with the same
    kernel, routes and barriers as the multi-process case. For measurement and single-GPU tests.

    `blocks_per_rank` defaults to an equal share of the SMs; the whole grid must be co-resident because
    the W virtual ranks wait on each other inside one launch."""

    def __init__(
        self,
        *,
        world: int,
        max_tokens_per_rank: int,
        hidden_dim: int,
        dtype: torch.dtype,
        device: torch.device | str | int | None = None,
        timeout_s: float = 10.0,
        max_batch: int = 1,
        blocks_per_rank: int | None = None,
    ) -> None:
        super().__init__(
            world=world,
            rank=0,
            max_tokens_per_rank=max_tokens_per_rank,
            hidden_dim=hidden_dim,
            dtype=dtype,
            device=device,
            timeout_s=timeout_s,
            max_batch=max_batch,
        )
        self._rt = extension().Runtime(
            self._device.index, 0, world, self._capacity, self._itemsize, self._timeout_s, True
        )
        self._arm_finalizer()
        if blocks_per_rank is not None:
            self._rt.set_loopback_blocks(int(blocks_per_rank))
        for r in range(world):
            self._view(r, (0,))

    @property
    def max_blocks_per_rank(self) -> int:
        return int(self._live().num_sms * self._live().blocks_per_sm // self._world)

    def set_blocks_per_rank(self, blocks: int) -> None:
        self._live().set_loopback_blocks(int(blocks))

    def _all(self, op: int, xs: Sequence[torch.Tensor], copy_out: bool) -> list[torch.Tensor]:
        if len(xs) != self._world:
            raise ValueError(f"{ck.OP_NAMES[op]}: expected {self._world} inputs (one per rank), got {len(xs)}")
        return self._exchange(op, list(xs), list(range(self._world)), copy_out)

    def send_recv_heads(self, xs: Sequence[torch.Tensor], *, copy_out: bool = False) -> list[torch.Tensor]:
        return self._all(ck.OP_SEND_RECV, xs, copy_out)

    def gather_heads(self, xs: Sequence[torch.Tensor], *, copy_out: bool = False) -> list[torch.Tensor]:
        return self._all(ck.OP_GATHER, xs, copy_out)

    def all_gather_heads(self, xs: Sequence[torch.Tensor], *, copy_out: bool = False) -> list[torch.Tensor]:
        return self._all(ck.OP_ALL_GATHER, xs, copy_out)


def _gather(obj: dict[str, Any], group: Any, world: int) -> list[dict[str, Any]]:
    import torch.distributed as dist

    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out
