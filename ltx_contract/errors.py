"""The contract's one error root: every exception class of `ltx_contract` subclasses `ContractError`.

Each class also keeps the builtin it has always been (`ValueError`, `RuntimeError`), so every `except`
written against the builtin still catches it; `except ContractError` catches what the contract itself
raised (a health snapshot that is not one, an oversized job hash), and nothing a library raised
(tests/test_error_hierarchy.py). Stdlib only: the producer and the worker both import it.
"""

from __future__ import annotations

__all__ = ["ContractError"]


class ContractError(Exception):
    """Raised by the client contract (snapshots and results read from Redis, job hashes, the request)."""
