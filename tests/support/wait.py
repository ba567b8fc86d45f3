"""The one way tests wait for something that happens in another thread, process or server."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(
    predicate: Callable[[], Any],
    timeout: float,
    what: str = "the condition",
    *,
    poll: float = 0.05,
    on_fail: Callable[[], str] | None = None,
) -> Any:
    """Call `predicate` every `poll` seconds until it returns a truthy value, and return that value.

    After `timeout` seconds without one, raise AssertionError naming `what`, with `on_fail()` appended (e.g.
    a worker's log tail). The predicate is called at least once, so a zero timeout is a single check. An
    exception from the predicate propagates at once: it is how a predicate says "this will never happen"
    (e.g. the process it waits on has exited).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            break
        time.sleep(poll)
    extra = f"\n{on_fail()}" if on_fail else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{extra}")
