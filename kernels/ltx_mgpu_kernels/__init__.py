"""ltx_mgpu_kernels: the CUDA-IPC all2all head exchange used by ltx-mgpu sequence parallelism.

Public API:
- `IpcAll2All`: one rank's instance over a `torch.distributed` process group (handles exchanged in Python,
  memory owned by the C++ runtime). Ops: `send_recv_heads`, `gather_heads`, `all_gather_heads`.
- `LoopbackAll2All`: one process drives W ranks' buffers on one GPU, for measuring the kernel.
- `All2AllError`, `All2AllTimeoutError`: what failed exchanges raise.
- `AVAILABLE`, `IMPORT_ERROR`: whether the compiled extension `_C` loaded (and why not).

The compiled module takes raw device pointers and stream handles, so it builds without torch; this
package's Python side needs torch at run time. Design, layout and limits: docs/kernels.md.
"""

from __future__ import annotations

from ._exchange import (
    SUPPORTED_DTYPES,
    All2AllError,
    All2AllTimeoutError,
    IpcAll2All,
    LoopbackAll2All,
)
from ._loader import AVAILABLE, IMPORT_ERROR

__version__ = "0.1.0"

__all__ = [
    "AVAILABLE",
    "IMPORT_ERROR",
    "SUPPORTED_DTYPES",
    "All2AllError",
    "All2AllTimeoutError",
    "IpcAll2All",
    "LoopbackAll2All",
    "__version__",
]
