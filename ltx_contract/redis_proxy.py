"""Per-tenant connection caps in front of Redis: an HAProxy configuration (`ltx-worker redis-proxy`).

Why: Redis ACLs have no per-user connection limit and `maxclients` is one pool for every client, so one
tenant that opened and authenticated 10,100 sockets locked every other tenant out (`producer submit` exited
6) and would have locked out the workers too. Redis cannot tell tenants apart by their connections, but a
TCP proxy can by the port they arrive on: this module writes an HAProxy configuration with one listener per
tenant, each with its own `maxconn`, all forwarding to Redis. The workers connect to
Redis itself, on an address the tenants cannot reach (compose: a network the producer is not on; without
Docker: Redis bound to loopback or an internal address), and Redis's `maxclients` is sized above the sum
of the tenants' caps plus a reserve for the workers, operators and dashboards: whatever one tenant opens,
Redis keeps room for everyone else.

What a cap does: HAProxy stops accepting on a tenant's port once that port holds `maxconn` connections;
further connections wait in the kernel's accept queue (then are dropped) until one closes, while every
other port and Redis's own keep answering (`tests/test_redis_flood.py` floods one port with thousands of
authenticated sockets and renders another tenant's job meanwhile). What it does not do (docs/security.md):
tell who a connection is: anyone who reaches a tenant's port can use up that tenant's cap, with any
credentials or none, so give each tenant a port only it can reach where tenants distrust each other.

Mode `tcp`: the bytes pass unchanged (TLS too, so `rediss://` works through it end to end). Timeouts: an
idle connection is closed after `IDLE_TIMEOUT` (the producer pings every 15 s and a `watch` reads with a
1 s block, so only abandoned sockets are that idle); HAProxy runs in the foreground, as whoever starts it.
Redis named by a host name (compose's `redis`) is looked up again while HAProxy runs (`resolvers`), so a
Redis container that comes back on another address is found.

Run as `ltx-worker redis-proxy` or `python -m ltx_contract.redis_proxy` (compose's `redis-proxy-config`
one-shot, in the producer image); it imports click and `ltx_contract.keys` only.
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import click

from ltx_contract.keys import check_tenant_name

__all__ = [
    "DEFAULT_RESERVE",
    "IDLE_TIMEOUT",
    "REDIS_DEFAULT_MAXCLIENTS",
    "ProxyPlan",
    "TenantPort",
    "command",
    "parse_tenant",
    "render_config",
]

#: Redis's own default `maxclients` (what a server started without `--maxclients` allows).
REDIS_DEFAULT_MAXCLIENTS = 10000
#: Connections kept for clients that do not come through the proxy: each worker process holds a handful
#: (its RQ connection, heartbeats, the relay, uploads, health: 5 with one group in tests/test_redis_flood.py),
#: plus the dashboard, operators and health checks. 256 leaves room for dozens of groups.
DEFAULT_RESERVE = 256
#: How long a connection may stay silent in both directions before HAProxy closes it.
IDLE_TIMEOUT = "10m"
_ADDRESS = re.compile(r"[A-Za-z0-9_.:\[\]-]{1,253}")


@dataclass(frozen=True)
class TenantPort:
    """One tenant's listener: its name, the port it connects to, and how many connections it may hold."""

    tenant: str
    port: int
    maxconn: int

    def __post_init__(self) -> None:
        check_tenant_name(self.tenant)
        if not 1 <= self.port <= 65535:
            raise ValueError(f"tenant {self.tenant}: port {self.port} is not 1-65535")
        if self.maxconn < 1:
            raise ValueError(f"tenant {self.tenant}: maxconn {self.maxconn} must be at least 1")


def parse_tenant(text: str, default_maxconn: int) -> TenantPort:
    """`NAME=PORT` or `NAME=PORT/MAXCONN` (a cap of its own) as a `TenantPort`; ValueError with the reason."""
    name, sep, rest = text.partition("=")
    port, slash, cap = rest.partition("/")
    if not sep or not port.isdigit() or (slash and not cap.isdigit()):
        raise ValueError(f"--tenant {text[:60]!r}: write NAME=PORT or NAME=PORT/MAXCONN")
    return TenantPort(name, int(port), int(cap) if cap else default_maxconn)


@dataclass(frozen=True)
class ProxyPlan:
    """The proxy's listeners, where Redis is, and the numbers that must add up: every tenant's cap plus
    `reserve` must fit within Redis's `maxclients`, or one tenant at its cap could still crowd out the rest."""

    tenants: tuple[TenantPort, ...]
    redis: str  #: host:port of Redis as the proxy reaches it (the workers' address)
    listen: str = "0.0.0.0"  #: the address the tenants' ports are bound to
    redis_maxclients: int = REDIS_DEFAULT_MAXCLIENTS
    reserve: int = DEFAULT_RESERVE

    def __post_init__(self) -> None:
        if not self.tenants:
            raise ValueError("no tenant: give at least one --tenant NAME=PORT")
        names = [t.tenant for t in self.tenants]
        ports = [t.port for t in self.tenants]
        if len(set(names)) != len(names) or len(set(ports)) != len(ports):
            raise ValueError(f"each tenant once, each on a port of its own: {names} on {ports}")
        host, _, port = self.redis.rpartition(":")
        if not host or not port.isdigit() or not _ADDRESS.fullmatch(host) or not _ADDRESS.fullmatch(self.listen):
            raise ValueError(f"--redis {self.redis[:60]!r} / --listen {self.listen[:60]!r}: expected HOST:PORT / HOST")
        if self.reserve < 1:
            raise ValueError(f"--reserve {self.reserve}: the workers need at least one connection")
        if self.total + self.reserve > self.redis_maxclients:
            raise ValueError(
                f"the tenants' caps ({self.total}) plus the reserve ({self.reserve}) exceed Redis's maxclients "
                f"({self.redis_maxclients}): raise --redis-maxclients (and redis-server --maxclients) to at least "
                f"{self.total + self.reserve}, or lower the caps"
            )

    @property
    def total(self) -> int:
        """Connections the proxy may hold to Redis at most: one per tenant connection."""
        return sum(t.maxconn for t in self.tenants)


def render_config(plan: ProxyPlan) -> str:
    """The HAProxy configuration: one `frontend` per tenant (its port, its `maxconn`), one backend (Redis)."""
    lines = [
        "# written by `ltx-worker redis-proxy` (ltx_contract/redis_proxy.py): one port per tenant, each",
        f"# capped; Redis at {plan.redis} keeps {plan.redis_maxclients - plan.total} of its {plan.redis_maxclients} "
        "clients for everyone else (the workers).",
        "global",
        f"    maxconn {plan.total}",
        "defaults",
        "    mode tcp",
        "    timeout connect 5s",
        f"    timeout client {IDLE_TIMEOUT}",
        f"    timeout server {IDLE_TIMEOUT}",
        "    timeout client-fin 30s",
        "    timeout server-fin 30s",
    ]
    for t in plan.tenants:
        lines += [
            f"frontend tenant_{t.tenant}",
            f"    bind {plan.listen}:{t.port}",
            f"    maxconn {t.maxconn}",
            "    default_backend redis",
        ]
    server = f"    server redis {plan.redis} maxconn {plan.total}"
    if _is_name(plan.redis.rpartition(":")[0]):
        # A name (compose's `redis`) is looked up again while HAProxy runs, not only at its start: a Redis
        # container restarted with another address is found again (the system's resolvers; Docker's in compose).
        lines += ["resolvers system", "    parse-resolv-conf", "    hold valid 10s"]
        server += " resolvers system init-addr last,libc,none"
    lines += ["backend redis", server]
    return "\n".join(lines) + "\n"


def _is_name(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return True
    return False


def _write(text: str, output: str) -> None:
    tmp = Path(output).with_name(Path(output).name + ".tmp")
    tmp.write_text(text)
    tmp.chmod(0o644)  # (no secret in it; haproxy runs as another user in its container)
    os.replace(tmp, output)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--tenant",
    "tenants",
    multiple=True,
    metavar="NAME=PORT[/MAXCONN]",
    help="a tenant's port (its producers' LTX_REDIS_URL), optionally with a cap of its own",
)
@click.option(
    "--maxconn",
    default=64,
    show_default=True,
    type=click.IntRange(1),
    help="connections each tenant may hold at once (its port's cap)",
)
@click.option(
    "--redis",
    "redis_address",
    default="127.0.0.1:6379",
    show_default=True,
    help="HOST:PORT of Redis as the proxy reaches it (where the workers connect; no tenant's way in)",
)
@click.option("--listen", default="0.0.0.0", show_default=True, help="the address the tenants' ports bind to")
@click.option(
    "--redis-maxclients",
    default=REDIS_DEFAULT_MAXCLIENTS,
    show_default=True,
    type=click.IntRange(1),
    help="Redis's --maxclients: refused unless the caps plus --reserve fit in it",
)
@click.option(
    "--reserve",
    default=DEFAULT_RESERVE,
    show_default=True,
    type=int,
    help="Redis connections kept for the workers, the dashboard and operators",
)
@click.option("--output", type=click.Path(dir_okay=False), default=None, help="write here (default: stdout)")
def command(
    tenants: Iterable[str],
    maxconn: int,
    redis_address: str,
    listen: str,
    redis_maxclients: int,
    reserve: int,
    output: str | None,
) -> None:
    """Print an HAProxy configuration that caps each tenant's Redis connections on a port of its own.

    Start it with `haproxy -f FILE`; see docs/operations.md ("Connections per tenant")."""
    try:
        plan = ProxyPlan(
            tuple(parse_tenant(t, maxconn) for t in tenants), redis_address, listen, redis_maxclients, reserve
        )
    except ValueError as exc:
        click.echo(f"redis-proxy: {exc}", err=True)
        sys.exit(2)
    text = render_config(plan)
    if output is None:
        click.echo(text, nl=False)
        return
    _write(text, output)
    ports = ", ".join(f"{t.tenant} :{t.port} (at most {t.maxconn})" for t in plan.tenants)
    click.echo(f"wrote {output}: {ports}; Redis keeps {redis_maxclients - plan.total} connections", err=True)


if __name__ == "__main__":
    command()
