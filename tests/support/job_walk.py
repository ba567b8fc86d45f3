"""The walk of one job through the worker, measured, so that a job's path keeps one owner and stays short: how
many modules a reader follows from `RenderService.run_job` to the hand-off to the stages, how often the path
changes module, and how many `return` statements the functions on it hold; and how many calls outside the
attempt end a job by raising.

`walk()` runs one real job in this process: a real Redis (devstack's), the worker built as `ltx-worker one`
builds it (`worker.runtime.process.build_worker`), local storage, a warm CPU fleet of one rank with the smoke
runner (the worker's encode hand-off, streamed, as in production), and RQ's own loop taking the job
(`work(burst=True)`). A profile hook (`sys.setprofile`, the main thread only: the stages run beside it) records
every call into `worker/` between `run_job`'s entry and its return, which is the job function's whole work:
with the upload pipeline on it ends at the hand-off (`EncodeStage.submit`), what the stages do after is theirs.

- `modules`: the distinct worker modules whose code ran on the walk;
- `visits`: how often control moved into a worker module from another one (calls and returns both);
- `functions`: the distinct worker functions that ran;
- `returns`: the `return` statements those functions hold (read from their source: what a reader of the path
  follows, whichever ran this time);
- `ends_raised` (static, `raised_ends`): calls outside the attempt's own module that end a job by raising
  through it (`attempt.fail(...)`, `.spool_failed`, `.wait_for_room`, `.cancelled`, `.check_cancelled`).

`python -m tests.support.job_walk` prints them as one JSON object (`--raw` adds the module visits in order).
"""

from __future__ import annotations

import ast
import contextlib
import json
import re
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "worker"
#: a call that ends the attempt by raising through it (`JobAttempt`'s raising methods)
_RAISED_END = re.compile(r"\battempt\.(fail|spool_failed|wait_for_room|cancelled|check_cancelled)\(")


@dataclass
class Walk:
    modules: int
    visits: int
    functions: int
    returns: int
    ends_raised: int
    per_module: dict[str, int] = field(default_factory=dict)  #: visits per module
    path: list[str] = field(default_factory=list)  #: the modules in the order the walk entered them


def _module_of(code: CodeType) -> str | None:
    path = Path(code.co_filename)
    try:
        rel = path.resolve().relative_to(ROOT)
    except ValueError:
        return None
    if rel.parts[0] != "worker":
        return None
    return ".".join(rel.with_suffix("").parts)


def returns_in(code: CodeType) -> int:
    """The `return` statements of the function `code` runs (its own body: nested functions are theirs)."""
    lines = Path(code.co_filename).read_text().splitlines()
    start = code.co_firstlineno - 1
    while start < len(lines) and lines[start].lstrip().startswith("@"):
        start += 1
    source = []
    indent = len(lines[start]) - len(lines[start].lstrip())
    for i, line in enumerate(lines[start:]):
        if i and line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        source.append(line)
    tree = ast.parse(textwrap.dedent("\n".join(source)))
    func = tree.body[0]
    count = 0
    todo: list[ast.AST] = list(ast.iter_child_nodes(func))
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue
        count += isinstance(node, ast.Return)
        todo.extend(ast.iter_child_nodes(node))
    return count


def raised_ends(root: Path = ROOT) -> int:
    """Calls outside `worker/jobs/attempt.py` that end a job by raising through its attempt (module docstring)."""
    total = 0
    for path in sorted((root / "worker").rglob("*.py")):
        if path.relative_to(root).as_posix() != "worker/jobs/attempt.py":
            total += len(_RAISED_END.findall(path.read_text()))
    return total


class _Recorder:
    """The profile hook: records worker frames between `run_job`'s entry and its return."""

    def __init__(self, start: CodeType) -> None:
        self.start, self.depth, self.done = start, 0, False
        self.codes: set[CodeType] = set()
        self.path: list[str] = []

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.done or event not in ("call", "return"):
            return
        code = frame.f_code
        if code is self.start:
            self.depth += 1 if event == "call" else -1
            if self.depth == 0 and event == "return":
                self.done = True
        if self.depth == 0 and not (code is self.start and event == "return"):
            return
        here = code if event == "call" else (frame.f_back.f_code if frame.f_back is not None else None)
        module = _module_of(here) if here is not None else None
        if module is None:
            return
        if event == "call":
            self.codes.add(code)
        if not self.path or self.path[-1] != module:
            self.path.append(module)


def measure(recorder: _Recorder) -> Walk:
    per_module: dict[str, int] = {}
    for module in recorder.path:
        per_module[module] = per_module.get(module, 0) + 1
    return Walk(
        modules=len(per_module),
        visits=len(recorder.path),
        functions=len(recorder.codes),
        returns=sum(returns_in(c) for c in recorder.codes),
        ends_raised=raised_ends(),
        per_module=dict(sorted(per_module.items(), key=lambda kv: -kv[1])),
        path=recorder.path,
    )


@contextlib.contextmanager
def _redis() -> Iterator[str]:
    from devstack.dev_servers import RedisServer

    server = RedisServer().start()
    try:
        yield server.url
    finally:
        server.stop()


def walk(redis_url: str, tmp: Path) -> Walk:
    """One job from enqueue to its hand-off, recorded (module docstring)."""
    from rq import Queue
    from rq.serializers import JSONSerializer

    from ltx_contract.keys import RENDER_FUNC
    from worker.render.service import RenderService
    from worker.runtime.process import build_worker
    from worker.settings import WorkerSettings

    queue = f"walk-{uuid.uuid4().hex[:6]}"
    settings = WorkerSettings(
        redis_url=redis_url,
        queues=[queue],
        runner="smoke",
        spool_dir=tmp / "spool",
        storage_backend="local",
        local_storage_dir=tmp / "store",
        metrics_port=None,
        worker_name=f"walk-{uuid.uuid4().hex[:6]}",
    )
    worker = build_worker(settings, "cpu:1")
    service = worker.service
    service.start_uploads(worker.connection)
    service.fleet.start()
    recorder = _Recorder(RenderService.run_job.__code__)
    try:
        Queue(queue, connection=worker.connection, serializer=JSONSerializer).enqueue(
            RENDER_FUNC, {"prompt": "walk", "width": 64, "height": 64, "num_frames": 9}
        )
        sys.setprofile(recorder)
        try:
            worker.work(burst=True, max_jobs=1, with_scheduler=False)
        finally:
            sys.setprofile(None)
        assert recorder.done, "the job never ran"
    finally:
        service.fleet.shutdown(0)
        service.pipeline.drain(30)
    return measure(recorder)


def main(argv: list[str] | None = None) -> int:
    raw = "--raw" in (argv if argv is not None else sys.argv[1:])
    with _redis() as url, tempfile.TemporaryDirectory() as tmp:
        result = asdict(walk(url, Path(tmp)))
    if not raw:
        result.pop("path")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
