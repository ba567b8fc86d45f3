"""The import probe of the layering rules (tests/test_import_contracts.py): every module of a package imported
in a process forked from one fresh interpreter, listing the forbidden modules each brought in; and the list of a
package's modules, which tests/test_error_hierarchy.py imports the same way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Runs in one fresh interpreter: reads a tree of checks (JSON on stdin, see `_preload_tree`). Each node is
# a forked process that imports its `preload` (third-party modules none of the checks below it forbids:
# importing torch, redis and the like once instead of once per check is what makes this cheap), then forks
# one process per check and one per child node, so every check starts from the standard library plus what
# the nodes above it preloaded. A check first proves that nothing it forbids is loaded yet, then imports
# its modules in order from its own root and lists what each brought in. Prints {check key: result}.
_PROBE = r"""
import importlib, json, os, sys

def check(spec):
    forbidden = [f for f in spec["forbidden"] if not f.startswith("!")]
    allowed = {f[1:] for f in spec["forbidden"] if f.startswith("!")}  # exact module names exempt from the prefixes
    def hits():
        return {m for m in sys.modules for f in forbidden if (m == f or m.startswith(f + ".")) and m not in allowed}
    preloaded = sorted(hits())
    if preloaded:
        return {"error": f"forbidden modules loaded before the check: {preloaded}"}
    sys.path.insert(0, spec["root"])
    found, origins, seen = {}, {}, set()
    for name in spec["modules"]:
        module = importlib.import_module(name)
        origins[name] = getattr(module, "__file__", None) or ""
        new = hits() - seen
        seen |= new
        if new:
            found[name] = sorted(new)
    return {"found": found, "origins": origins}

def node(spec):
    for name in spec["preload"]:
        importlib.import_module(name)
    running = [fork(check, c) for c in spec["checks"]] + [fork(node, n) for n in spec["children"]]
    results = {}
    for proc, key in zip(running, [c["key"] for c in spec["checks"]] + [None] * len(spec["children"])):
        result = collect(*proc)
        results.update({key: result} if key else result)
    return results

def fork(fn, spec):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            result = fn(spec)
        except BaseException as exc:
            result = {"error": f"{type(exc).__name__}: {exc}"}
        with os.fdopen(write, "w") as out:
            json.dump(result, out)
        os._exit(0)
    os.close(write)
    return pid, read

def collect(pid, read):
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return json.loads(text) if text else {"error": "the process died"}

results = node(json.load(sys.stdin))
print(json.dumps(results))
"""

# The third-party modules the packages import that take time (torch alone takes seconds). A check preloads
# those it does not forbid; a check whose preload would bring in something it forbids says so and fails.
PRELOAD = (
    "torch",
    "numpy",
    "safetensors",
    "av",
    "cloudpickle",
    "einops",
    "redis",
    "rq",
    "boto3",
    "botocore",
    "pydantic",
    "pydantic_settings",
    "rich",
    "click",
    "prometheus_client",
)


def modules_under(root: Path, *packages: str) -> list[str]:
    """Every importable module of `packages` below `root` (entry points `__main__` excluded)."""
    names = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__main__" or "__pycache__" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.append(".".join(parts))
    return names


def _allowed(spec: dict) -> set[str]:
    prefixes = [
        f for f in spec["forbidden"] if not f.startswith("!")
    ]  # "!name": exempt (tests/test_import_contracts.py, RULES)
    return {p for p in PRELOAD if not any(p == f or p.startswith(f + ".") for f in prefixes)}


def _preload_tree(specs: list[dict], loaded: set[str]) -> dict:
    """The probe's plan: a node imports what all its checks may preload (beyond `loaded`, what its parent
    holds), runs the checks that may preload nothing more, and hands the others to child nodes split on the
    next module some of them may preload, so each module is imported once per branch, not once per check."""
    here = loaded | set.intersection(*(_allowed(s) for s in specs))
    node: dict = {"preload": [p for p in PRELOAD if p in here - loaded], "checks": [], "children": []}
    rest = []
    for spec in specs:
        (node["checks"] if _allowed(spec) == here else rest).append(spec)
    while rest:
        extra = next(p for p in PRELOAD if any(p in _allowed(s) - here for s in rest))
        node["children"].append(_preload_tree([s for s in rest if extra in _allowed(s)], here))
        rest = [s for s in rest if extra not in _allowed(s)]
    return node


def run_checks(checks: dict[str, tuple[Path, list[str], tuple[str, ...]]]) -> dict[str, dict[str, list[str]]]:
    """{key: {module: forbidden modules that arrived with it}} for checks {key: (root, modules, forbidden)},
    all in one new interpreter (see `_PROBE` and `_preload_tree`)."""
    specs = [
        {"key": key, "root": str(root), "modules": modules, "forbidden": forbidden}
        for key, (root, modules, forbidden) in checks.items()
    ]
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE],
        input=json.dumps(_preload_tree(specs, set())),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, f"import probe failed:\n{proc.stderr[-3000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    found = {}
    for key, (root, _, _) in checks.items():
        result = report[key]
        assert "error" not in result, f"{key}: {result['error']}"
        for name, origin in result["origins"].items():  # the modules under test are the ones at `root`
            assert origin.startswith(str(root)), f"{name} imported from {origin}, not from {root}"
        found[key] = result["found"]
    return found
