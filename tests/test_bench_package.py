"""bench/ is a package run as `python -m bench.<name>`: every module imports as `bench.X` with no `sys.path`
edit, no module reaches into another's private (`_name`) helpers (what two benches share lives in
`bench.common` or `bench.block`), every runnable bench answers `--help`, and each states its method (what it
measures and how) in its module docstring, with the command that runs it.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
FILES = sorted(BENCH.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] in ("__init__", "__main__") else parts)


#: the commands a person types: `python -m bench.X` for each module with a `__main__` entry
RUNNABLE = sorted(
    {module_name(p) for p in FILES if p.name == "__main__.py" or 'if __name__ == "__main__"' in p.read_text()}
)
#: `python -m bench.e2e MODE`: the modes have their own arguments
COMMANDS = [[m] for m in RUNNABLE] + [["bench.e2e", mode] for mode in ("runs", "loras")]
#: words of a docstring that says how it measures (a clock, a count, a ratio, a percentile ...)
METHOD_WORDS = ("measure", "timed", "time", "clock", "events", "seconds", "p50", "ratio")


def private_imports(source: str, module: str) -> list[str]:
    """`from bench.X import _y` and `bench_module._y` uses where bench.X is another module than `module`."""
    tree = ast.parse(source)
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "bench":
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                if alias.name.startswith("_") and node.module != module:
                    found.append(target)
                aliases[alias.asname or alias.name] = target
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "bench":
                    aliases[alias.asname or alias.name] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = ast.unparse(node.value)
            target = aliases.get(base, base if base.startswith("bench.") else None)
            if target is not None and target != module:
                found.append(f"{target}.{node.attr}")
    return found


def test_no_sys_path_edit_in_bench():
    offenders = [str(p.relative_to(ROOT)) for p in FILES if "sys.path" in p.read_text()]
    assert offenders == []


def test_no_bench_module_uses_another_ones_private_helpers():
    found = {module_name(p): private_imports(p.read_text(), module_name(p)) for p in FILES}
    assert {m: f for m, f in found.items() if f} == {}


def test_the_private_helper_check_finds_a_planted_one():
    planted = "from bench.sp_block import _EventTimer\nimport bench.fp8 as f\nf._measure\nfrom bench import common\n"
    assert private_imports(planted, "bench.attention") == ["bench.sp_block._EventTimer", "bench.fp8._measure"]
    assert private_imports("from bench.common import emit\n", "bench.attention") == []


def test_every_module_imports_as_bench_x_without_path_edits():
    """In a fresh interpreter started in the checkout, as `python -m` runs them (torch-heavy ones included)."""
    names = sorted({module_name(p) for p in FILES})
    code = f"import importlib, sys; before = list(sys.path); [importlib.import_module(m) for m in {names!r}]; " \
           "assert sys.path == before, sys.path"  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def test_every_runnable_bench_answers_help():
    """`python -m bench.X --help` for each, in one interpreter (runpy, as `-m` does): exit 0 and a usage text."""
    code = """
import contextlib, io, json, runpy, sys
results = {}
for argv in json.loads(sys.argv[1]):
    sys.argv = [argv[0], *argv[1:], "--help"]
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    results[" ".join(argv)] = [code, buf.getvalue()[:300]]
print(json.dumps(results))
"""
    done = subprocess.run([sys.executable, "-c", code, json.dumps(COMMANDS)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(results) == {" ".join(c) for c in COMMANDS}
    bad = {cmd: r for cmd, r in results.items() if r[0] != 0 or not r[1].strip()}
    assert bad == {}
    assert all("usage" in text.lower() or cmd == "bench.e2e" for cmd, (_, text) in results.items()), results


def test_each_bench_docstring_states_its_method_and_its_command():
    missing = {}
    for path in FILES:
        name = module_name(path)
        if name not in RUNNABLE:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if name == "bench.e2e":  # the tool's modes carry the method
            doc = "\n".join(ast.get_docstring(ast.parse((BENCH / "e2e" / f"{m}.py").read_text())) or ""
                            for m in ("runs", "loras"))  # fmt: skip
        problems = []
        if len(doc.splitlines()) < 3 or not any(w in doc.lower() for w in METHOD_WORDS):
            problems.append("no method")
        if f"python -m {name}" not in doc:
            problems.append(f"no `python -m {name}` command")
        if problems:
            missing[name] = problems
    assert missing == {}
    assert "bench.e2e" in RUNNABLE and len(RUNNABLE) >= 15
