"""Deterministic renders: the switches every rank sets before its first CUDA work (`apply`), and the setting
that chooses them (`resolve`).

What holds with the mode on: the same job kwargs (request, seed), the same fleet layout (devices, world size,
parallel layout), the same software (torch, CUDA, cuDNN, NCCL, ltx-core, this tree) and the same GPU model
give bit-identical frames and audio, job after job and fleet rebuild after fleet rebuild. Nothing is promised
across world sizes (SP and tiled stage 2 change the order of floating-point sums), GPU models or library
versions (kernels differ). docs/producer.md, "Reproducible renders", is the user's statement of it.

Modes (`LTX_DETERMINISTIC`, `MGPUController(deterministic=...)`):

| mode     | what a rank sets                                                                                    |
|----------|-----------------------------------------------------------------------------------------------------|
| `off`    | nothing (torch's defaults: cuDNN may pick any convolution algorithm)                                |
| `on`     | `CUBLAS_WORKSPACE_CONFIG=:4096:8`; `use_deterministic_algorithms(True, warn_only=True)` with torch's |
|          | "no deterministic implementation" warning turned into an error; cuDNN and oneDNN deterministic,    |
|          | no cuDNN benchmark                                                                                  |
|          | (new tensors are not NaN-filled: `fill_uninitialized_memory` off)                                   |
| `strict` | the same with `warn_only=False` and torch's NaN fill of new tensors                                 |
| `auto`   | `on` for CPU fleets, `off` for GPU fleets (the GPU default stays off until its cost is measured)    |

Why `on` and not `strict`: with `warn_only=False` torch refuses cuDNN's fused attention outright (its
*backward* accumulates with atomics; torch's `check_cudnn_deterministic` rejects the backend for forward calls
too), and SDPA falls to flash-attention 2, at about half cuDNN's speed on Hopper at LTX-2's shapes
(docs/performance.md: 307-356 against 600-680 TFLOP/s), so attention alone would cost tens of percent.
cuDNN's attention forward has no atomics: it is deterministic for a given shape, and SDPA's backend choice
depends only on the inputs (dtype, shape, mask), never on free memory. `on` keeps it and still fails loudly:
every other op torch knows to be nondeterministic raises (the warning filter), as under `strict`.

What the switches do not cover is fixed where it lives: the tiled stage 2's cross-rank sum is gathered and
added in rank order (`parallel/tdp.py`); the memory plan's capacity is the device's total memory, not its
free memory (`runners/common/stages.py`), so the decode's chunking depends only on the request and the GPU
model; every random draw comes from a generator seeded from the request's seed. Imports no torch at module
level (the worker's settings read `MODES`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

__all__ = ["CUBLAS_WORKSPACE", "ENV", "MODES", "apply", "resolve"]

ENV = "LTX_DETERMINISTIC"  #: the environment variable a controller reads when it is given no mode
MODES = ("auto", "on", "off", "strict")
#: cuBLAS's deterministic workspace setting (one of the two NVIDIA documents; `:16:8` is the smaller one)
CUBLAS_WORKSPACE = ":4096:8"
#: torch's warning for an op with no deterministic implementation under `warn_only=True`
_NONDETERMINISTIC_WARNING = r".*does not have a deterministic implementation.*"


def resolve(mode: str | bool | None, devices: Sequence[str]) -> str:
    """The mode a fleet on `devices` runs in: "on", "strict" or "off". `mode` None reads `LTX_DETERMINISTIC`
    (default "auto"); True/False are "on"/"off"; "auto" is "on" when every device is a CPU. Anything else is a
    `ValueError` naming the accepted values."""
    if mode is None:
        mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if isinstance(mode, bool):
        mode = "on" if mode else "off"
    if mode not in MODES:
        raise ValueError(f"deterministic mode must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == "auto":
        return "on" if all(str(d).startswith("cpu") for d in devices) else "off"
    return mode


def apply(mode: str) -> None:
    """Set this process's deterministic switches for `mode` ("on", "strict"; "off" sets nothing). Call it in a
    rank before its first CUDA work: cuBLAS reads `CUBLAS_WORKSPACE_CONFIG` when its first handle is made."""
    if mode == "off":
        return
    if mode not in ("on", "strict"):
        raise ValueError(f"apply() takes 'on', 'strict' or 'off'; got {mode!r}")
    configured = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    if configured not in (":4096:8", ":16:8"):  # (an operator's smaller deterministic choice is kept)
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    import torch

    strict = mode == "strict"
    torch.use_deterministic_algorithms(True, warn_only=not strict)
    # torch then fills every new tensor with NaN (a memset per op output, replayed in every CUDA graph): a
    # cost `on` does not pay. Our kernels write what they allocate; `strict` keeps the fill, so a read of
    # memory nothing wrote shows as NaN (the runners' finite checks raise) instead of varying silently.
    torch.utils.deterministic.fill_uninitialized_memory = strict  # type: ignore[attr-defined]
    if not strict:  # still an error for every op torch knows to be nondeterministic (see the module docstring)
        warnings.filterwarnings("error", message=_NONDETERMINISTIC_WARNING)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False  # (benchmarking picks algorithms by timing)
    if hasattr(torch.backends, "mkldnn") and hasattr(torch.backends.mkldnn, "deterministic"):
        torch.backends.mkldnn.deterministic = True  # (CPU ranks: oneDNN's convolutions)
