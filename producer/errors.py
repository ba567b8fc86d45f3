"""The producer's one error root: every exception class of `producer` subclasses `ProducerError`.

Each class also keeps the builtin it has always been (`RuntimeError`, `ValueError`, `LookupError`, click's
`ClickException`), so every `except` written against the builtin still catches it; `except ProducerError`
catches whatever the producer itself raised, and nothing a library raised (tests/test_error_hierarchy.py).
"""

from __future__ import annotations

__all__ = ["ProducerError"]


class ProducerError(Exception):
    """Raised by the producer (the CLI, its client, admission, settings, request files)."""
