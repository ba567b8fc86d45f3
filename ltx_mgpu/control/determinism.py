"""Deterministic renders: the switches every rank sets before its first CUDA work (`apply`), the setting that
chooses them (`resolve`), and the device memory a rank offers the memory plan (`offered_memory_bytes`).

What holds with the mode on: the same job kwargs (request, seed), the same fleet layout (devices, world size,
parallel layout), the same software (torch, CUDA, cuDNN, NCCL, ltx-core, this tree) and the same GPU model
give bit-identical frames and audio, job after job and fleet rebuild after fleet rebuild. Nothing is promised
across world sizes (SP and tiled stage 2 change the order of floating-point sums), GPU models or library
versions (kernels differ). docs/producer.md, "Reproducible renders", is the user's statement of it, and
docs/runners.md, "Deterministic renders", what it costs per runner and card.

Modes (`LTX_DETERMINISTIC`, `MGPUController(deterministic=...)`):

| mode     | what a rank sets                                                                                    |
|----------|-----------------------------------------------------------------------------------------------------|
| `on`     | `CUBLAS_WORKSPACE_CONFIG=:4096:8`; `use_deterministic_algorithms(True, warn_only=True)` with torch's |
|          | "no deterministic implementation" warning turned into an error; cuDNN and oneDNN deterministic,    |
|          | no cuDNN benchmark                                                                                  |
|          | (new tensors are not NaN-filled: `fill_uninitialized_memory` off)                                   |
| `strict` | the same with `warn_only=False` and torch's NaN fill of new tensors                                 |
| `off`    | nothing (torch's defaults: cuDNN may pick any convolution algorithm): the explicit opt-out          |
| `auto`   | the default: `on` on every fleet, CPU and GPU                                                       |

Why `auto` is `on` on GPUs too: measured through the service on one H100 (ltx2-distilled 768x512x121), `on`
costs 0.7% of a render (p50 2.98 s against 2.96 s) and is what makes the soundtrack repeat: under `off` five
same-seed jobs gave one frames hash and five audio hashes. The waveform is hashed as float32 (the frames after
rounding to uint8), so any variation of the audio VAE decoder's and the vocoder's convolutions shows: without
`cudnn.deterministic` cuDNN may pick algorithms that accumulate in a varying order (the transposed
convolutions' among them). The rule is "on wherever it costs at most 2%"; docs/runners.md, "Deterministic
renders (the default)", keeps the measured cost per runner and card. `off` buys back that cost, and the memory
plan's capacity measured from free memory (below).

Why `on` and not `strict`: with `warn_only=False` torch refuses cuDNN's fused attention outright (its
*backward* accumulates with atomics; torch's `check_cudnn_deterministic` rejects the backend for forward calls
too), and SDPA falls to flash-attention 2, at about half cuDNN's speed on Hopper at LTX-2's shapes
(docs/performance.md: 308-343 against 581-631 TFLOP/s), so attention alone would cost tens of percent.
cuDNN's attention forward has no atomics: it is deterministic for a given shape, and SDPA's backend choice
depends only on the inputs (dtype, shape, mask), never on free memory. `on` keeps it and still fails loudly:
every other op torch knows to be nondeterministic raises (the warning filter), as under `strict`.

What the switches do not cover is fixed where it lives: the tiled stage 2's cross-rank sum is gathered and
added in rank order (`parallel/pipeline/tdp.py`); the memory plan's capacity is the device's total memory, not its
free memory (`offered_memory_bytes`, reported after `setup()` and by every render), so the decode's chunking
depends only on the request and the GPU model; every random draw comes from a generator seeded from the
request's seed. Imports no torch at module level (the worker's settings read `MODES`).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

__all__ = ["CUBLAS_WORKSPACE", "DEFAULT", "ENV", "MODES", "apply", "offered_memory_bytes", "resolve"]

ENV = "LTX_DETERMINISTIC"  #: the environment variable a controller reads when it is given no mode
MODES = ("auto", "on", "off", "strict")
DEFAULT = "on"  #: what `auto` (the default) resolves to, on CPU and GPU fleets alike (see the module docstring)
#: cuBLAS's deterministic workspace setting (one of the two NVIDIA documents; `:16:8` is the smaller one)
CUBLAS_WORKSPACE = ":4096:8"
#: torch's warning for an op with no deterministic implementation under `warn_only=True`
_NONDETERMINISTIC_WARNING = r".*does not have a deterministic implementation.*"


def resolve(mode: str | bool | None) -> str:
    """The mode a fleet runs in: "on", "strict" or "off". `mode` None reads `LTX_DETERMINISTIC` (default
    "auto"); True/False are "on"/"off"; "auto" is `DEFAULT`. Anything else is a `ValueError` naming the
    accepted values."""
    if mode is None:
        mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if isinstance(mode, bool):
        mode = "on" if mode else "off"
    if mode not in MODES:
        raise ValueError(f"deterministic mode must be one of {', '.join(MODES)}; got {mode!r}")
    return DEFAULT if mode == "auto" else mode


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


def offered_memory_bytes(device: Any) -> int | None:
    """What `device` offers this rank, the capacity the worker's memory plan checks requests against (None off
    CUDA). Under deterministic algorithms the device's total memory, a constant of the GPU model: free memory
    changes from one fleet build to the next (what else holds the GPU, the CUDA context's size), and a plan
    chosen from it (a chunked decode: other frames) would make a rebuilt fleet render other bits. Otherwise
    free memory plus this allocator's reservation (the plan's headroom covers the CUDA context either way)."""
    import torch

    if getattr(device, "type", None) != "cuda":
        return None
    if torch.are_deterministic_algorithms_enabled():
        return int(torch.cuda.get_device_properties(device).total_memory)
    free, _total = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device))
