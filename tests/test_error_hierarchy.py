"""One error hierarchy per package: every exception class of `producer`, `ltx_contract`, `worker` and `ltx_mgpu`
subclasses its package's root (`ProducerError`, `ContractError`, `WorkerError`, `LtxMgpuError`, each alone in
`<package>/errors.py`), so `except <Root>` catches what that package raised and nothing a library did; and no
two exception classes of the product share a name, so a name in a traceback, a log or an `except` means one
class.

Each class keeps its builtin parent too (`class LoraRefused(WorkerError, ValueError)`), so an `except ValueError`
written before the roots existed still catches it. A class deriving from `BaseException` but not `Exception` is a
control-flow signal (like `KeyboardInterrupt`: `except Exception` must not swallow it), not an error: it stays
private to its module. A class defined inside a function cannot be caught by name, so none is an exception.

Every module is imported in a fresh interpreter (`_PROBE`), so nothing the test session imported counts; the
checks run on a planted package too and must name each of its violations.
"""

from __future__ import annotations

import ast
import builtins
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.import_probe import modules_under

ROOT = Path(__file__).resolve().parent.parent

#: package → its root exception class, defined in `<package>/errors.py`.
ROOTS = {
    "producer": "ProducerError",
    "ltx_contract": "ContractError",
    "worker": "WorkerError",
    "ltx_mgpu": "LtxMgpuError",
}

# Runs in a fresh interpreter: imports every module of each package (JSON on stdin: {"paths", "packages":
# {package: [modules]}, "roots": {package: root name}}) and prints, per package, its root's bases and every
# exception class its modules define at their top: where it is defined, where it was imported from, and what
# it subclasses.
_PROBE = r"""
import importlib, inspect, json, sys

spec = json.load(sys.stdin)
sys.path[:0] = spec["paths"]
report = {}
for package, modules in spec["packages"].items():
    errors = importlib.import_module(package + ".errors")
    root = getattr(errors, spec["roots"][package], None)
    found = []
    for name in modules:
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == name:
                found.append({
                    "module": name, "name": obj.__name__, "file": module.__file__,
                    "error": issubclass(obj, Exception), "rooted": root is not None and issubclass(obj, root),
                })
    report[package] = {
        "root": None if root is None else [root.__module__, [b.__name__ for b in root.__bases__]],
        "classes": found,
    }
print(json.dumps(report))
"""


def probe(paths: list[Path], packages: list[str], roots: dict[str, str]) -> dict:
    """`_PROBE`'s report for `packages` found on `paths` (first first)."""
    root_of = {package: next(p for p in paths if (p / package).is_dir()) for package in packages}
    spec = {
        "paths": [str(p) for p in paths],
        "packages": {package: modules_under(root_of[package], package) for package in packages},
        "roots": roots,
    }
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], input=json.dumps(spec), cwd=ROOT, capture_output=True, text=True,
        timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, f"error probe failed:\n{proc.stderr[-3000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for package in packages:
        for cls in report[package]["classes"]:  # the modules checked are the ones under `paths`, not installed ones
            assert cls["file"].startswith(str(root_of[package])), f"{cls['module']} came from {cls['file']}"
    return report


#: Names a class subclasses when it is an exception (for classes defined in functions, which no import reaches).
_BUILTIN_ERRORS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
_LOOKS_LIKE_AN_ERROR = re.compile(r"(Error|Exception|Exit|Interrupt|Warning)$")


def nested_exceptions(folder: Path, known: set[str]) -> list[str]:
    """Classes defined inside a function or class under `folder` (or in a `__main__`, which nothing imports)
    whose base names an exception: a builtin one, one of `known`, or a name ending like one."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text())
        top = set() if path.stem == "__main__" else {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and id(node) not in top:
                names = {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
                if names & (_BUILTIN_ERRORS | known) or any(_LOOKS_LIKE_AN_ERROR.search(n) for n in names):
                    found.append(f"{path.name}:{node.lineno} {node.name}: an exception class out of reach of imports")
    return found


def violations(report: dict, roots: dict[str, str]) -> list[str]:
    """What breaks the rules (module docstring) in `probe`'s report on `roots`' packages, taken as one product."""
    found, names = [], {}
    for package, root in roots.items():
        entry = report[package]
        if entry["root"] != [f"{package}.errors", ["Exception"]]:
            found.append(f"{package}: no {root}(Exception) defined in {package}.errors (found {entry['root']})")
        for cls in entry["classes"]:
            where = f"{cls['module']}.{cls['name']}"
            names.setdefault(cls["name"], []).append(where)
            if cls["error"] and not cls["rooted"]:
                found.append(f"{where}: not a {root}")
            if not cls["error"] and not cls["name"].startswith("_"):
                found.append(f"{where}: a public BaseException that is no Exception (a signal stays private)")
    found += [
        f"{name}: defined {len(where)} times: {', '.join(where)}" for name, where in names.items() if len(where) > 1
    ]
    return found


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A package `planted_errors` with one class of each kind, good and bad."""
    root = tmp_path_factory.mktemp("planted")
    package = root / "planted_errors"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "errors.py": "class PlantedError(Exception):\n    pass\n",
        "good.py": "from planted_errors.errors import PlantedError\n\n\n"
        "class Refused(PlantedError, ValueError):\n    pass\n\n\nclass _Signal(BaseException):\n    pass\n",
        "sub/__init__.py": "",
        "sub/bad.py": "class Stray(RuntimeError):\n    pass\n\n\nclass Refused(ValueError):\n    pass\n\n\n"
        "class Signal(BaseException):\n    pass\n\n\ndef f():\n    class Local(KeyError):\n        pass\n",
        "__main__.py": "class Entry(SystemExit):\n    pass\n",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    return root


@pytest.fixture(scope="module")
def report(planted: Path) -> dict:
    """One probe of the real packages and the planted one."""
    return probe([ROOT, planted], [*ROOTS, "planted_errors"], {**ROOTS, "planted_errors": "PlantedError"})


def test_every_exception_class_subclasses_its_package_root_and_has_a_name_of_its_own(report: dict) -> None:
    assert violations(report, ROOTS) == []
    assert sum(len(report[p]["classes"]) for p in ROOTS) > 40  # (the walk reached the packages' modules)


def test_no_exception_class_is_defined_out_of_reach_of_imports(report: dict) -> None:
    known = {cls["name"] for p in ROOTS for cls in report[p]["classes"]}
    assert [f for package in ROOTS for f in nested_exceptions(ROOT / package, known)] == []


def test_the_checks_name_every_planted_violation(report: dict, planted: Path) -> None:
    roots = {"planted_errors": "PlantedError"}
    assert sorted(violations(report, roots)) == [
        "Refused: defined 2 times: planted_errors.good.Refused, planted_errors.sub.bad.Refused",
        "planted_errors.sub.bad.Refused: not a PlantedError",
        "planted_errors.sub.bad.Signal: a public BaseException that is no Exception (a signal stays private)",
        "planted_errors.sub.bad.Stray: not a PlantedError",
    ]
    assert nested_exceptions(planted / "planted_errors", set()) == [
        "__main__.py:1 Entry: an exception class out of reach of imports",
        "bad.py:14 Local: an exception class out of reach of imports",
    ]
    report = {"planted_errors": {**report["planted_errors"], "root": ["planted_errors.good", ["ValueError"]]}}
    assert violations(report, roots)[0].startswith("planted_errors: no PlantedError(Exception) defined in")
