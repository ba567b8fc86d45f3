"""Loads the compiled extension once and remembers why it could not be loaded."""

from __future__ import annotations

from types import ModuleType

_C: ModuleType | None
IMPORT_ERROR: str | None
try:
    from . import _C  # type: ignore[attr-defined, no-redef]

    IMPORT_ERROR = None
except ImportError as exc:  # built without the extension, or loaded from a source checkout
    _C = None
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

AVAILABLE: bool = _C is not None


def extension() -> ModuleType:
    """The compiled `_C` module; raises a RuntimeError that says how to build it when it is missing."""
    if _C is None:
        raise RuntimeError(
            "ltx_mgpu_kernels._C is not built (" + str(IMPORT_ERROR) + "). "
            "Install it with `pip install ./kernels` on a machine with nvcc (see docs/kernels.md)."
        )
    return _C
