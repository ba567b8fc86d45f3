"""One tenant's connection flood against the deployment docker-compose.yml runs, on loopback with real servers;
and that deployment in the compose file itself (read without Docker, like tests/test_compose.py).

Regression: Redis ACLs have no per-user connection limit and `maxclients` is one pool, so 10,100 sockets one
tenant opened and authenticated locked every other client out (the other tenant's `producer submit` exited
6). The deployment now: Redis with ACL users and compose's `--maxclients`; HAProxy in front of it with one
port per tenant, each capped at compose's `--maxconn`, its file rendered by the generator compose's
`redis-proxy-config` runs (`ltx_contract/redis_proxy.py`; a second tenant added, free loopback ports); a
worker on Redis's own port.

The test floods twice, each bounded in count (2,000 authenticated sockets, more than Redis's `maxclients`)
and time (the sockets are closed within seconds):
1. straight at Redis, as the review did: the other tenant's `producer submit` exits 6. This is the attack
   itself, measured on this Redis, so the second half cannot pass by flooding too little;
2. at the flooding tenant's own port on the proxy, with a worker running: no more than her cap is answered,
   her own next connection waits, and meanwhile the other tenant's `producer submit` through his port exits 0,
   the worker renders his job to `uploaded`, and a new connection on Redis's own port is served. Once her
   sockets close, her port serves her again.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import secrets
import selectors
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.acl_stack import acl_worker
from tests.support.wait import wait_for
from tests.support.workers import ROOT, wait_ready

FILE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
COMPOSE = FILE["services"]
FLOOD = 2000  #: sockets per flood: more than compose's maxclients (checked below), bounded
TENANTS = ("alice", "bob")


def _default(value: str) -> str:
    """A compose value with its ${VAR:-default} taken at the default."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))


def environment(service: str) -> dict[str, str]:
    return {k: _default(v) for k, v in (COMPOSE[service].get("environment") or {}).items()}


def compose_numbers() -> dict[str, int]:
    """Redis's --maxclients and the proxy one-shot's --maxconn and --reserve, as compose runs them."""
    redis = [_default(a) for a in COMPOSE["redis"]["command"]]
    proxy = [_default(a) for a in COMPOSE["redis-proxy-config"]["command"]]
    return {
        "maxclients": int(redis[redis.index("--maxclients") + 1]),
        "maxconn": int(proxy[proxy.index("--maxconn") + 1]),
        "reserve": int(proxy[proxy.index("--reserve") + 1]),
    }


def test_tenants_reach_redis_only_through_a_capped_port_of_their_own(tmp_path: Path, haproxy_binary: str) -> None:
    """Regression: the producer (a tenant) connected to Redis itself, where one tenant's 10,100 sockets took
    every connection `maxclients` allows. Now Redis is on the `backend` network only (workers, dashboard, the
    proxy) with no host port; the producer is on `tenants`, which reaches Redis only through redis-proxy's
    port for its tenant, capped; and Redis's `maxclients` covers every tenant's cap plus the workers' reserve,
    with the same numbers the one-shot checks (it is run here with compose's arguments, and its file checked
    by the real haproxy: compose's `redis` is a name, looked up again while HAProxy runs)."""
    from click.testing import CliRunner

    from ltx_contract.redis_proxy import command as redis_proxy

    redis, proxy, conf = COMPOSE["redis"], COMPOSE["redis-proxy"], COMPOSE["redis-proxy-config"]
    assert redis["networks"] == ["backend"] and "ports" not in redis
    assert COMPOSE["producer"]["networks"] == ["tenants"]
    backend = {name for name, service in COMPOSE.items() if "backend" in service.get("networks", [])}
    assert backend == {"redis", "redis-proxy", "worker", "dashboard", "s3"}, backend
    assert all(s.get("networks") or s.get("network_mode") == "none" for s in COMPOSE.values())  # (no `default`)
    assert environment("worker")["LTX_REDIS_URL"] == "redis://redis:6379/0"
    assert "LTX_REDIS_URL" not in FILE["x-ltx-shared"]
    # the one-shot's file: the tenant's port and cap, Redis as the workers reach it
    args = [_default(a) for a in conf["command"]]
    args[args.index("--output") + 1] = str(tmp_path / "haproxy.cfg")
    result = CliRunner().invoke(redis_proxy, args)
    assert result.exit_code == 0, result.output
    config = (tmp_path / "haproxy.cfg").read_text()
    tenant = environment("producer")["LTX_CLIENT"]
    assert args[args.index("--tenant") + 1] == f"{tenant}=7001"
    assert environment("producer")["LTX_REDIS_URL"] == "redis://redis-proxy:7001/0"
    assert proxy["ports"] == ["127.0.0.1:7001:7001"] and args[args.index("--redis") + 1] == "redis:6379"
    numbers = compose_numbers()
    assert f"frontend tenant_{tenant}\n    bind 0.0.0.0:7001\n    maxconn {numbers['maxconn']}\n" in config, config
    assert re.search(r"^backend redis\n    server redis redis:6379 .* resolvers system ", config, re.M), config
    validate = [haproxy_binary, "-c", "-f", str(tmp_path / "haproxy.cfg")]
    check = subprocess.run(validate, capture_output=True, text=True, check=False)
    assert check.returncode == 0 and "Configuration file is valid" in check.stdout, (check.stdout, check.stderr)
    assert int(args[args.index("--redis-maxclients") + 1]) == numbers["maxclients"]  # Redis's own value
    assert numbers["maxconn"] + numbers["reserve"] <= numbers["maxclients"]
    assert re.fullmatch(r"haproxy:2\.6\.\d+-alpine", proxy["image"]), proxy["image"]  # Debian 12's series
    assert proxy["command"] == ["haproxy", "-f", "/proxy/haproxy.cfg"] and "redis-proxy:/proxy:ro" in proxy["volumes"]
    assert "redis-proxy:/proxy" in conf["volumes"] and conf["entrypoint"][-1] == "ltx_contract.redis_proxy"
    assert proxy["depends_on"]["redis-proxy-config"]["condition"] == "service_completed_successfully"
    assert COMPOSE["producer"]["depends_on"] == {"redis-proxy": {"condition": "service_started"}}


def _auth(user: str, password: str) -> bytes:
    return b"".join([b"*3\r\n$4\r\nAUTH\r\n", f"${len(user)}\r\n{user}\r\n${len(password)}\r\n{password}\r\n".encode()])


@contextlib.contextmanager
def flood(port: int, user: str, password: str, count: int = FLOOD, seconds: float = 20.0) -> Iterator[Counter[str]]:
    """Open `count` sockets to `port` and log each in as `user`; yields the first reply of each (`"+OK"`,
    an error line, or `"none"` for a socket nothing answered) while holding them all open; closes them on exit.
    Stops waiting at `seconds`, or after 2 s without any reply once something answered."""
    socks, replies = [], {}
    selector = selectors.DefaultSelector()
    command = _auth(user, password)
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
            socks.append(sock)
            selector.register(sock, selectors.EVENT_WRITE)
        deadline, last = time.monotonic() + seconds, time.monotonic()
        while time.monotonic() < deadline and len(replies) < count and (not replies or time.monotonic() - last < 2):
            for key, events in selector.select(0.2):
                sock = key.fileobj
                if events & selectors.EVENT_WRITE:
                    with contextlib.suppress(OSError):
                        sock.send(command)
                    selector.modify(sock, selectors.EVENT_READ)
                    continue
                try:
                    data = sock.recv(256)
                except OSError as exc:
                    data = f"-{exc}".encode()
                replies[sock] = (data or b"-closed").split(b"\r\n")[0].decode(errors="replace")
                selector.unregister(sock)
                last = time.monotonic()
        yield Counter([*replies.values(), *["none"] * (count - len(replies))])
    finally:
        selector.close()
        for sock in socks:
            sock.close()


@dataclass
class Deployment:
    """Redis (ACL users, compose's maxclients), HAProxy (compose's caps), the tenants' password files."""

    server: Any
    proxy: Any
    secrets: Path
    numbers: dict[str, int]
    request: Path

    def password(self, user: str) -> str:
        return (self.secrets / user).read_text().strip()

    def client(self, user: str, url: str, **kwargs: Any) -> Any:
        import redis

        return redis.Redis.from_url(url, username=user, password=self.password(user), **kwargs)

    def serves(self, user: str, url: str) -> bool:
        """True if a new connection of `user` at `url` is answered within 2 s."""
        import redis

        with contextlib.closing(self.client(user, url, socket_connect_timeout=2, socket_timeout=2)) as conn:
            try:
                return bool(conn.ping())
            except redis.RedisError:
                return False

    def submit(self, url: str, user: str, queue: str) -> subprocess.CompletedProcess[str]:
        """`producer submit` as tenant `user` at `url`, in a process of its own, as a tenant runs it."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("LTX_")}
        env.update(
            LTX_REDIS_URL=url,
            LTX_REDIS_USERNAME=user,
            LTX_REDIS_PASSWORD_FILE=str(self.secrets / user),
            LTX_QUEUES=queue,
            PYTHONPATH=str(ROOT),
        )
        command = [sys.executable, "-m", "producer", "submit", str(self.request)]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=False)


def _enough_files(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed and (hard == resource.RLIM_INFINITY or hard >= needed):
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))  # (Redis, started below, inherits it)
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= needed, f"need {needed} open files: ulimit -n"


@contextlib.contextmanager
def deployment(tmp_path: Path, haproxy: str) -> Iterator[Deployment]:
    """Compose's Redis and proxy, with two tenants, on free loopback ports; stopped on exit."""
    from devstack.dev_secure import SecureRedisServer
    from devstack.haproxy import RedisProxy
    from ltx_contract.redis_acl import AclUsers, generate
    from ltx_contract.redis_proxy import ProxyPlan, TenantPort

    numbers = compose_numbers()
    assert FLOOD > numbers["maxclients"] > len(TENANTS) * numbers["maxconn"] + numbers["reserve"], numbers
    _enough_files(numbers["maxclients"] + 3 * FLOOD)
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir()
    for user in ("worker", *TENANTS):
        (secrets_dir / user).write_text(secrets.token_hex(24) + "\n")
    request = tmp_path / "request.json"
    request.write_text('{"prompt": "t", "width": 64, "height": 64, "num_frames": 9}')
    acl = generate(AclUsers(tenants=TENANTS), password_dir=secrets_dir)
    server = SecureRedisServer(acl=acl, server_args=("--maxclients", str(numbers["maxclients"])))
    tenants = tuple(TenantPort(t, 7001 + i, numbers["maxconn"]) for i, t in enumerate(TENANTS))
    plan = ProxyPlan(
        tenants, f"127.0.0.1:{server.port}", redis_maxclients=numbers["maxclients"], reserve=numbers["reserve"]
    )
    proxy = RedisProxy(plan, binary=haproxy, directory=tmp_path / "haproxy")
    try:
        server.start()
        proxy.start()
        yield Deployment(server, proxy, secrets_dir, numbers, request)
    finally:
        proxy.cleanup()
        server.cleanup()


def test_a_tenant_flooding_its_port_leaves_the_others_and_the_workers_their_redis(
    tmp_path: Path, s3_server: Any, haproxy_binary: str
) -> None:
    from devstack.dev_servers import find_redis_server

    if find_redis_server() is None:
        pytest.skip("redis-server not found")
    with deployment(tmp_path, haproxy_binary) as d:
        # 1. the attack as filed, straight at Redis: the other tenant is locked out
        with flood(d.server.port, "alice", d.password("alice")) as replies:
            assert replies["+OK"] <= d.numbers["maxclients"] and replies["+OK"] + replies["none"] < FLOOD, replies
            out = d.submit(d.server.url, "bob", "q-control")
            assert out.returncode == 6, (out.returncode, out.stdout, out.stderr)
        admin = d.server.client(socket_timeout=5)
        wait_for(lambda: admin.info("clients")["connected_clients"] < 10, 30, "the control flood's sockets closed")
        # 2. at alice's own port on the proxy, with a worker on Redis's port
        ready = lambda admin, name, proc: wait_ready(admin, name, 1, 120, proc)  # noqa: E731
        with acl_worker(d.server, s3_server, tmp_path, d.secrets, ready, tenants=",".join(TENANTS)) as started:
            _flood_the_proxy(d, *started)
        admin.close()


def _flood_the_proxy(d: Deployment, worker: Any, queue: str, name: str) -> None:
    """alice floods her own port while bob submits through his and the worker renders his job."""

    from producer.client import ProducerClient
    from producer.settings import ProducerSettings

    admin, cap = d.server.client(socket_timeout=5), d.numbers["maxconn"]
    with flood(d.proxy.ports["alice"], "alice", d.password("alice")) as replies:
        assert replies["+OK"] == cap and replies["none"] == FLOOD - cap, replies
        users = Counter(c.get("user") for c in admin.client_list())
        assert users["alice"] == cap, users  # what reached Redis: her cap, no more
        assert not d.serves("alice", d.proxy.url("alice"))  # her own next connection waits: her cap
        out = d.submit(d.proxy.url("bob"), "bob", queue)
        assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
        job_id = out.stdout.split()[0]
        settings = ProducerSettings(
            redis_url=d.proxy.url("bob"), redis_username="bob", redis_password_file=d.secrets / "bob", queues=[queue]
        )
        with ProducerClient(settings) as bob:
            done = wait_for(
                lambda: (i := bob.status(job_id)).state in ("uploaded", "failed") and i,
                60,
                f"{job_id} rendered",
                on_fail=worker.log_tail,
            )
        assert done.state == "uploaded", done
        assert d.serves("worker", d.server.url) and wait_ready(admin, name, 1, 30, worker)  # Redis's own port
        workers = Counter(c.get("user") for c in admin.client_list())["worker"]
        assert workers <= d.numbers["reserve"], workers  # (5 with one group: the reserve holds dozens)
    wait_for(lambda: d.serves("alice", d.proxy.url("alice")), 30, "alice's port serving her again")
    admin.close()


def test_the_proxy_file_is_refused_in_one_line_when_the_caps_do_not_fit_or_a_tenant_is_wrong() -> None:
    """`ltx-worker redis-proxy` refuses (exit 2, one line) what would not hold: caps that with the reserve do
    not fit in Redis's maxclients (one tenant at its cap could then still crowd out the rest), a tenant
    name that cannot own Redis keys, two tenants on one port, a port or cap that is not a number."""
    from click.testing import CliRunner

    from ltx_contract.redis_proxy import command as redis_proxy

    def run(*args: str) -> Any:
        return CliRunner().invoke(redis_proxy, [*args, "--redis-maxclients", "1024"])

    ok = run("--tenant", "alice=7001", "--tenant", "bob=7002/8", "--maxconn", "384")
    assert ok.exit_code == 0, ok.output
    assert "frontend tenant_alice\n    bind 0.0.0.0:7001\n    maxconn 384\n" in ok.output
    assert "frontend tenant_bob\n    bind 0.0.0.0:7002\n    maxconn 8\n" in ok.output and "maxconn 392\n" in ok.output
    refused = {
        ("--tenant", "alice=7001", "--tenant", "bob=7002", "--maxconn", "385"): "raise --redis-maxclients",
        ("--tenant", "al-ice=7001"): "tenant name",
        ("--tenant", "alice=7001", "--tenant", "bob=7001"): "a port of its own",
        ("--tenant", "alice=70x1"): "NAME=PORT",
        ("--tenant", "alice=7001/"): "NAME=PORT",
        ("--maxconn", "8"): "no tenant",
    }
    for args, says in refused.items():
        out = run(*args)
        lines = out.output.strip().splitlines()
        assert out.exit_code == 2 and len(lines) == 1 and says in lines[0], (args, out.output)
        assert lines[0].startswith("redis-proxy: "), lines
