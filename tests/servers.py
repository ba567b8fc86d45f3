"""Test-side names for the development servers, which live in the product (`worker.devservers`,
`worker.tcpproxy`) so the demo and the benchmarks use the same code without importing `tests`.

Kept so test modules can keep importing `tests.servers`; `http_ok` is a test-only probe helper.
"""

from __future__ import annotations

import urllib.error
import urllib.request

from worker.devservers import RedisServer, S3Server, ServerError, find_redis_server, find_weed, free_port
from worker.tcpproxy import TcpProxy

__all__ = [
    "RedisServer",
    "S3Server",
    "ServerError",
    "TcpProxy",
    "find_redis_server",
    "find_weed",
    "free_port",
    "http_ok",
]


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """True if GET `url` answers 2xx (used by health-probe tests)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError):
        return False
