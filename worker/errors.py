"""The worker's one error root: every exception class of `worker` subclasses `WorkerError`.

Each class also keeps the builtin it has always been (`RuntimeError`, `ValueError`, `OSError`, ...), so every
`except` written against the builtin still catches it; `except WorkerError` catches whatever the worker itself
raised, and nothing a library raised (tests/test_error_hierarchy.py). Stdlib only and below every worker layer.
The client contract (`ltx_contract`, which the producer image ships) has a root of its own, `ContractError`.

A control-flow signal that `except Exception` must not swallow (like `KeyboardInterrupt`) derives from
`BaseException` and stays private to its module; it is no error and not a `WorkerError`.
"""

from __future__ import annotations

__all__ = ["WorkerError"]


class WorkerError(Exception):
    """Raised by the worker (its protocol, settings, uploads, job bookkeeping, render service, runtime)."""
