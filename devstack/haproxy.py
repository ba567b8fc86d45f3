"""`RedisProxy`: HAProxy with the configuration `ltx-worker redis-proxy` writes, in front of a development Redis.

The deployment that keeps one tenant from taking every Redis connection (ltx_contract/redis_proxy.py,
docker-compose.yml's `redis-proxy`): one port per tenant, each with its own cap, all forwarding to Redis. This
starts the real `haproxy` (Debian's, `apt-get install haproxy`; or $LTX_TEST_HAPROXY) on free loopback ports
with a configuration rendered by the product's own generator, in the foreground as a child process, stopped by
pid like the other development servers (`devstack.dev_servers`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Self

from devstack.dev_servers import LOOPBACK, ServerError, _ServerProcess, _spawn, _wait_port, free_ports
from ltx_contract.redis_proxy import ProxyPlan, TenantPort, render_config

__all__ = ["RedisProxy", "find_haproxy"]


def find_haproxy() -> str | None:
    """Path of the haproxy binary: $LTX_TEST_HAPROXY (None if no such file), PATH, or Debian's /usr/sbin (not on
    a user's PATH)."""
    explicit = os.environ.get("LTX_TEST_HAPROXY")
    if explicit:
        return explicit if Path(explicit).is_file() else None
    return shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)


class RedisProxy(_ServerProcess):
    """HAProxy serving `plan` (its tenants' ports replaced by free loopback ones: `ports[tenant]`)."""

    def __init__(self, plan: ProxyPlan, *, binary: str | None = None, directory: Path | None = None) -> None:
        super().__init__(directory, "ltx-haproxy-", "haproxy.log", own_session=False)
        chosen = free_ports(len(plan.tenants))
        tenants = tuple(TenantPort(t.tenant, port, t.maxconn) for t, port in zip(plan.tenants, chosen, strict=True))
        self.plan = ProxyPlan(tenants, plan.redis, LOOPBACK, plan.redis_maxclients, plan.reserve)
        self.ports = {t.tenant: t.port for t in tenants}
        self.binary = binary or find_haproxy()
        self.config = self.dir / "haproxy.cfg"

    def url(self, tenant: str, *, scheme: str = "redis") -> str:
        """The Redis URL a tenant's producers use: its own port on the proxy."""
        return f"{scheme}://{LOOPBACK}:{self.ports[tenant]}/0"

    def start(self, timeout: float = 10.0) -> Self:
        if self.binary is None:
            raise ServerError("haproxy not found: `apt-get install -y haproxy`, or set LTX_TEST_HAPROXY")
        self.config.write_text(render_config(self.plan))
        check = _spawn(
            [self.binary, "-c", "-q", "-f", str(self.config)], self.log_path, cwd=self.dir, own_session=False
        )
        if check.wait(timeout) != 0:
            raise ServerError(f"haproxy refused {self.config}:\n{self.log_path.read_text(errors='replace')[-3000:]}")
        self.proc = _spawn([self.binary, "-f", str(self.config)], self.log_path, cwd=self.dir, own_session=False)
        for port in self.ports.values():
            _wait_port(port, self.proc, timeout, "haproxy", self.log_path)
        return self
