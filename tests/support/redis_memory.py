"""Redis refusing writes for memory, as a test makes it: `fill_past_maxmemory` (and `used_memory`)."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from worker.jobs.tenant_memory import RESERVE_BYTES

MB = 1 << 20


def used_memory(client: Any) -> int:
    return int(client.info("memory")["used_memory"])


def fill_past_maxmemory(client: Any, prefix: str, n: int = 16) -> int:
    """`n` MB of strings, then `maxmemory` set below what is used: every write that needs memory is refused
    (filling up to the limit is not enough: the refused write's own buffer is freed and small writes fit).
    Returns `n`; the keys are `<prefix>0` .. `<prefix>n-1` (delete them to give the memory back)."""
    for i in range(n):
        client.set(f"{prefix}{i}", b"x" * MB)
    # (idle clients' query buffers shrink later; a worker releases its reserve when refused)
    client.config_set("maxmemory", used_memory(client) - 4 * MB - 2 * RESERVE_BYTES)
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.set(f"{prefix}probe", b"x")
    return n
