"""A development Redis with the production hardening on: ACL users from a file, TLS with a throwaway CA.

`SecureRedisServer` is a `devstack.dev_servers.RedisServer` (same lifecycle: free loopback port, private
directory, stopped by pid) that adds

- `--aclfile`: the text it is given (e.g. `ltx_contract.redis_acl.render_acl(...)`) plus an `admin` user with a
  random password that only the server object knows (tests read `ACL LOG` and set up keys with it; the
  service's users never get such rights);
- TLS (`tls=True`): a CA and a server certificate for 127.0.0.1, made with the `openssl` command line
  tool in the server's directory; the server listens on TLS only (`--port 0 --tls-port`), so a plain
  `redis://` client cannot talk to it. `ca_file` is what clients put in `LTX_REDIS_CA_FILE`.

Both need Redis 6+ (ACL selectors: 7+); Debian's redis-server 7.0 has TLS built in.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Any

from devstack.dev_servers import LOOPBACK, RedisServer, ServerError

__all__ = ["ADMIN_USER", "SecureRedisServer", "make_test_ca"]

ADMIN_USER = "admin"


def make_test_ca(directory: Path, *, host: str = LOOPBACK) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for `host` (IP SAN), valid two days: (ca, cert, key)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ServerError("openssl not found (apt-get install -y openssl)")
    d = Path(directory)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        proc = subprocess.run([openssl, *args], cwd=d, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise ServerError(f"openssl {args[0]} failed: {proc.stderr[-2000:]}")

    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=ltx-test-ca")
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", f"/CN={host}")
    (d / "san.ext").write_text(f"subjectAltName=IP:{host}\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "2", "-extfile", "san.ext")  # fmt: skip
    for name in ("server.key", "ca.key"):
        (d / name).chmod(0o600)
    return d / "ca.crt", d / "server.crt", d / "server.key"


class SecureRedisServer(RedisServer):
    """See the module docstring. `acl`: ACL file text (None: no ACL file); `tls`: TLS only; `server_args`: more
    redis-server arguments, last (e.g. `("--maxclients", "1024")`, as compose runs it)."""

    def __init__(
        self, *, acl: str | None = None, tls: bool = False, server_args: tuple[str, ...] = (), **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.acl = acl
        self.tls = tls
        self.server_args = server_args
        self.admin_password = secrets.token_hex(16)
        self.ca_file: Path | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{LOOPBACK}:{self.port}/0"

    def extra_args(self) -> list[str]:
        args: list[str] = []
        if self.acl is not None:
            path = self.dir / "users.acl"
            admin = f"user {ADMIN_USER} on >{self.admin_password} ~* &* +@all\n"
            path.write_text(self.acl.rstrip("\n") + "\n" + admin)
            # DEBUG on, so that the ACL (not the server's default refusal) is what keeps users from it
            args += ["--aclfile", str(path), "--enable-debug-command", "yes"]
        if self.tls:
            if self.ca_file is None:
                self.ca_file, cert, key = make_test_ca(self.dir)
            else:
                cert, key = self.dir / "server.crt", self.dir / "server.key"
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(cert),
                     "--tls-key-file", str(key), "--tls-ca-cert-file", str(self.ca_file),
                     "--tls-auth-clients", "no"]  # fmt: skip
        return [*args, *self.server_args]

    def client(self, **kwargs: Any) -> Any:
        """A redis-py client for this server as the admin user (over TLS when on)."""
        import redis

        if self.acl is not None:
            kwargs.setdefault("username", ADMIN_USER)
            kwargs.setdefault("password", self.admin_password)
        if self.tls:
            kwargs.setdefault("ssl_ca_certs", str(self.ca_file))
        return redis.Redis.from_url(self.url, **kwargs)

    def user_client(self, username: str, password: str, **kwargs: Any) -> Any:
        """A client logged in as one of the ACL file's users."""
        return self.client(username=username, password=password, **kwargs)
