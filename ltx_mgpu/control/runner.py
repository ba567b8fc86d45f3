"""The contract a pipeline implements once to run on a fleet: `MGPURunner`.

The controller ships the runner *class* by value to every rank, builds one instance per rank with no
arguments (so `__init__` runs before any process group exists: a per-rank pre-init hook, e.g. for
`torch.use_deterministic_algorithms`), binds the rank's device and groups, calls `setup(**setup_kwargs)`
once, then calls the instance once per job with the job kwargs. Both run on every rank (SPMD).

`__call__` must be a generator. Each `yield` becomes one element of the caller's `Stream` (from whichever
rank yields it; yields are never gathered across ranks). The return value rides the terminal.

Failures: raise `RunnerError` (or `ValueError`, converted) identically on every rank and outside any
collective for a recoverable error; anything else kills the rank and poisons the controller, because a
collective that some ranks entered and others did not cannot be unwound.

Request limits: `request_limits(**setup_kwargs)` (a classmethod, so no fleet is needed) names the inclusive
range of each job kwarg the runner accepts beyond what the caller's own schema checks, e.g.
`{"steps": (1, 50)}`. A service publishes them where clients can check a request before submitting it;
the runner still checks them itself (the same numbers), on every rank, before any collective.
`takes_request_loras(**setup_kwargs)` (also a classmethod) says whether a job's `loras` would be fused as
the runner is set up, so a service refuses a request's LoRAs before it fetches them.

Slow imports: `background_imports` names modules `setup()` will need late (e.g. a Hugging Face text
encoder's modeling code, ~10 s of imports on a busy host). Each rank starts importing them on a side thread
as soon as it exists, so they overlap forming the process group and loading the first weights;
`setup()` calls `await_background_imports()` before it uses them.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from .errors import RunnerCancelled

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


__all__ = ["MGPURunner", "ProcessGroups", "RankContext"]

log = logging.getLogger("ltx_mgpu.control.runner")


@dataclass(frozen=True)
class ProcessGroups:
    """Per-component process groups, each spanning the whole fleet (group rank == global rank).

    Separate communicators with identical membership, so collectives of one component never interleave
    with another's. `control_group` is always gloo (CPU tensors): the framework's own small decisions.

    The G x S groups of guidance parallelism are not here: they are the data plane's
    (`ltx_mgpu.parallel.layouts.layout.layout_groups(runner)` makes them once per runner), so the control plane's
    contract names no type of `ltx_mgpu.parallel` (importing it costs seconds and the control plane must
    not depend on it; `tests/test_control_plane_contract.py`).
    """

    gemma_group: dist.ProcessGroup
    transformer_group: dist.ProcessGroup
    vae_group: dist.ProcessGroup
    control_group: dist.ProcessGroup


@dataclass(frozen=True)
class RankContext:
    """Where this rank runs: set by the fleet before `setup()`."""

    rank: int  #: global rank, 0 is the driver rank (it takes jobs from the controller and posts them to the others)
    world_size: int
    device: torch.device  #: the rank's own device (cuda:devices[rank] or cpu); never derived from `rank`
    backend: str  #: "nccl" or "gloo"


class MGPURunner(ABC):
    """Subclass once per pipeline; see the module docstring for the contract."""

    _groups: ProcessGroups | None = None
    _ctx: RankContext | None = None
    _cancel_points: Any = None  # job_board.CancelPoints of the current job, injected by the fleet on every rank
    _import_thread: threading.Thread | None = None

    #: modules setup() imports late and slowly, imported on a side thread from the rank's start (see the
    #: module docstring); an import that fails there is simply retried, and raises, where setup() needs it
    background_imports: ClassVar[tuple[str, ...]] = ()

    def start_background_imports(self) -> None:
        """Called by the fleet on each rank before the process group forms; a no-op without imports."""
        if not self.background_imports or self._import_thread is not None:
            return

        def work() -> None:
            for name in self.background_imports:
                try:
                    importlib.import_module(name)
                except Exception:  # setup() imports it again and reports the real error there
                    log.debug("background import of %s failed", name, exc_info=True)

        self._import_thread = threading.Thread(target=work, name="ltx-mgpu-imports", daemon=True)
        self._import_thread.start()

    def await_background_imports(self) -> None:
        """Block until the side-thread imports are done, so this thread never imports the same packages at
        the same time as the side thread (two threads importing one package graph can deadlock)."""
        if self._import_thread is not None:
            self._import_thread.join()

    # ---- injected state ------------------------------------------------------------------------------
    @property
    def groups(self) -> ProcessGroups:
        if self._groups is None:
            raise RuntimeError("MGPURunner.groups is only available inside a fleet rank")
        return self._groups

    @property
    def context(self) -> RankContext:
        if self._ctx is None:
            raise RuntimeError("MGPURunner.context is only available inside a fleet rank")
        return self._ctx

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def world_size(self) -> int:
        return self.context.world_size

    @property
    def device(self) -> torch.device:
        return self.context.device

    @property
    def is_driver(self) -> bool:
        """Rank 0: the rank that owns outputs (encodes files, yields progress)."""
        return self.context.rank == 0

    # ---- cooperative cancellation --------------------------------------------------------------------
    #: every how many `cancel_requested()` calls the ranks decide (1: every call); a runner whose steps are
    #: short can decide less often (a cancel then takes up to that many steps to land)
    cancel_every: ClassVar[int] = 1

    def cancel_requested(self) -> bool:
        """True on every rank iff the caller cancelled the current job.

        Call it at the same safe points on every rank (e.g. once per denoising step). Every `cancel_every`-th
        call, rank 0 reads the caller's flag once and leaves its answer in the fleet's store for the others
        (`job_board.CancelPoints`): every rank takes the same branch even if the flag flips between reads, and
        no rank waits for any other rank but rank 0 (no collective, no host rendezvous of the group).
        """
        points = self._cancel_points
        return bool(points is not None and points.check())

    def raise_if_cancelled(self) -> None:
        """Raise `RunnerCancelled` on every rank alike if the job was cancelled (see `cancel_requested`)."""
        if self.cancel_requested():
            raise RunnerCancelled("job cancelled")

    # ---- the contract ---------------------------------------------------------------------------------
    @classmethod
    def request_limits(cls, **setup_kwargs: Any) -> Mapping[str, tuple[float, float]]:
        """Inclusive `(low, high)` per job kwarg that this runner, set up with `setup_kwargs`, accepts (none by
        default). Must not need a fleet or a device: services call it on the class."""
        return {}

    @classmethod
    def takes_request_loras(cls, **setup_kwargs: Any) -> bool:
        """Whether this runner, set up with `setup_kwargs`, fuses a job's `loras` (`[{"path", "strength"}]`). By
        default: its job signature names `loras`. A runner that names it but refuses it overrides this, so a
        service refuses a request's LoRAs before it fetches them, not after. No fleet needed."""
        try:
            return "loras" in inspect.signature(cls.__call__).parameters
        except (TypeError, ValueError):
            return False

    @classmethod
    def setup_default(cls, name: str, setup_kwargs: Mapping[str, Any]) -> Any:
        """The value `setup()` would use for its keyword `name`: `setup_kwargs[name]`, else the default of
        the nearest `setup` in the class hierarchy that declares it (a subclass's `setup(**kwargs)` that
        passes the rest on does not hide its base's defaults)."""
        if name in setup_kwargs:
            return setup_kwargs[name]
        for klass in cls.__mro__:
            setup = vars(klass).get("setup")
            if setup is None:
                continue
            parameter = inspect.signature(setup).parameters.get(name)
            if parameter is not None and parameter.default is not inspect.Parameter.empty:
                return parameter.default
        raise TypeError(f"{cls.__name__}.setup() declares no default for {name!r}")

    @abstractmethod
    def setup(self, *args: Any, **kwargs: Any) -> None:
        """Load models once per rank. Runs on every rank; may use collectives."""

    @abstractmethod
    def __call__(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        """Run one job. Must be a generator; each yield reaches the caller's Stream."""
