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
- `ends_raised` (static, `raised_ends`): calls outside the attempt's own module to an attempt's method that ends
  the job by raising (found in `JobAttempt`'s source: a method that raises, or calls one of its own that does).

`python -m tests.support.job_walk` prints them as one JSON object (`--raw` adds the module visits in order and each
function's returns). It measures the `worker` package it imports: with `PYTHONPATH` at another checkout (and the
script run by its path) it measures that one, so before and after compare with one script.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import json
import re
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

_COMPREHENSIONS = frozenset({"<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>"})


def _root() -> Path:
    """The tree measured: the one the `worker` package is imported from (`PYTHONPATH`), so the same script
    measures another checkout too."""
    import worker

    return Path(worker.__file__).resolve().parents[1]


@dataclass
class Walk:
    modules: int
    visits: int
    functions: int
    returns: int
    ends_raised: int
    per_module: dict[str, int] = field(default_factory=dict)  #: visits per module
    path: list[str] = field(default_factory=list)  #: the modules in the order the walk entered them
    per_function: dict[str, int] = field(default_factory=dict)  #: the returns of each function that ran


def _module_of(code: CodeType) -> str | None:
    path = Path(code.co_filename)
    try:
        rel = path.resolve().relative_to(_root())
    except ValueError:
        return None
    if rel.parts[0] != "worker":
        return None
    return ".".join(rel.with_suffix("").parts)


def returns_in(code: CodeType) -> int:
    """The `return` statements of the function `code` runs (its own body: nested functions are theirs)."""
    func = _function_at(code.co_filename, code.co_firstlineno)
    count = 0
    todo: list[ast.AST] = list(ast.iter_child_nodes(func))
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue
        count += isinstance(node, ast.Return)
        todo.extend(ast.iter_child_nodes(node))
    return count


@functools.cache
def _functions(filename: str) -> dict[int, ast.AST]:
    """{first line (its first decorator's, as the code object counts it): function} of a source file."""
    found: dict[int, ast.AST] = {}
    for node in ast.walk(ast.parse(Path(filename).read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            decorators = getattr(node, "decorator_list", [])
            found[min([node.lineno, *(d.lineno for d in decorators)])] = node
    return found


def _function_at(filename: str, line: int) -> ast.AST:
    return _functions(filename)[line]


def raised_ends(root: Path | None = None) -> int:
    """Calls outside `worker/jobs/attempt.py` to a `JobAttempt` method that ends the job by raising (one that
    raises, or calls one of its own that does), on an attempt (`attempt.x(`, `self.attempt.x(`, `item.attempt.x(`)."""
    root = root or _root()
    tree = ast.parse((root / "worker" / "jobs" / "attempt.py").read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "JobAttempt")
    methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
    calls = {
        name: {
            n.func.attr
            for n in ast.walk(f)
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "self"
        }
        for name, f in methods.items()
    }
    raising = {name for name, f in methods.items() if any(isinstance(n, ast.Raise) for n in ast.walk(f))}
    while grown := {name for name, called in calls.items() if called & raising} - raising:
        raising |= grown
    pattern = re.compile(rf"\battempt\.({'|'.join(sorted(raising))})\(") if raising else None
    total = 0
    for path in sorted((root / "worker").rglob("*.py")):
        if pattern is not None and path.relative_to(root).as_posix() != "worker/jobs/attempt.py":
            total += len(pattern.findall(path.read_text()))
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
        if event == "call" and code.co_name not in _COMPREHENSIONS:  # (a comprehension is part of its function)
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
        per_function={f"{_module_of(c)}.{c.co_qualname}": returns_in(c) for c in sorted(recorder.codes, key=_order)},
    )


def _order(code: CodeType) -> tuple[str, int]:
    return code.co_filename, code.co_firstlineno


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
    with _redis() as url, tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
        result = asdict(walk(url, Path(tmp)))  # (RQ's own log lines go to stderr: stdout is the JSON)
    if not raw:
        result.pop("path")
        result.pop("per_function")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
