"""The engine's one error root: every exception class of `ltx_mgpu` subclasses `LtxMgpuError`.

Each class also keeps the builtin it has always been (`ValueError`, `RuntimeError`, `TimeoutError`, ...), so
every `except` written against the builtin still catches it; `except LtxMgpuError` catches whatever the engine
itself raised, and nothing torch or a library raised (tests/test_error_hierarchy.py). Stdlib only: the
producer imports the request rules and the image parser, which import it. The control plane's errors, each
named for how a caller recovers, are in `ltx_mgpu.control.errors`.
"""

from __future__ import annotations

__all__ = ["LtxMgpuError"]


class LtxMgpuError(Exception):
    """Raised by the engine (the control plane, request rules, image and LoRA file checks, the runners)."""
