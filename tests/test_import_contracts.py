"""The layering rules, held by imports in fresh interpreters (README.md, "Layout": arrows point down only).

`producer -> worker -> ltx_mgpu -> kernels`, arrows down only:
- producer never imports torch or ltx_mgpu (a light CLI), but for the stdlib-only request bounds and image
  parser (`ltx_mgpu.bounds`, `ltx_mgpu.imagesize`, shared by the request schema and the runners);
- ltx_mgpu never imports worker, producer, redis, rq or boto3 (the engine knows no service);
- the control plane (controller, fleet, runner, transport, jobboard, devices, errors, events, startup)
  never imports `ltx_mgpu.runners` (it is model-agnostic);
- worker never imports producer; kernels imports none of the packages above it;
- no package, bench/ included, imports tests;
- `import ltx_mgpu`, `ltx_mgpu.devices`, `ltx_mgpu.ports`, `ltx_mgpu.bounds` and `ltx_mgpu.imagesize` import
  no torch (the worker's settings and dev servers and the producer use them).

Each rule imports every module of its packages in a new interpreter (`sys.modules` starts empty, so an
import done elsewhere in the test session cannot hide or fake one) and lists, per module, the forbidden
modules that arrived with it. Each rule is also run on a copy of the tree with a planted violation and must
fail there, so none of them can pass by checking nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Runs in the fresh interpreter: argv = root, forbidden prefixes (comma-separated), modules to import.
_PROBE = r"""
import importlib, json, sys
root, forbidden, names = sys.argv[1], sys.argv[2].split(","), sys.argv[3:]
allowed = {f[1:] for f in forbidden if f.startswith("!")}  # exact module names exempt from the prefixes
sys.path.insert(0, root)

def hits():
    return {m for m in sys.modules for f in forbidden if (m == f or m.startswith(f + ".")) and m not in allowed}

found, origins, seen = {}, {}, hits()
for name in names:
    module = importlib.import_module(name)
    origins[name] = getattr(module, "__file__", None) or ""
    new = hits() - seen
    seen |= new
    if new:
        found[name] = sorted(new)
print(json.dumps({"found": found, "origins": origins}))
"""


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


def forbidden_imports(root: Path, modules: list[str], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    """{module: forbidden modules that arrived with it}, importing `modules` in order in a new interpreter."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(root), ",".join(forbidden), *modules],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, f"import probe failed:\n{proc.stderr[-3000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, origin in report["origins"].items():  # the modules under test are the ones at `root`
        assert origin.startswith(str(root)), f"{name} imported from {origin}, not from {root}"
    return report["found"]


@dataclass(frozen=True)
class Rule:
    name: str
    packages: tuple[str, ...] = ()  #: every module of these packages is imported
    modules: tuple[str, ...] = ()  #: and these, by name
    forbidden: tuple[str, ...] = ()  #: module prefixes none of them may bring in
    plant: tuple[str, str] = ("", "")  #: (file to append to, import line) that must break the rule

    def check(self, root: Path) -> dict[str, list[str]]:
        return forbidden_imports(root, [*modules_under(root, *self.packages), *self.modules], self.forbidden)


CONTROL_PLANE = tuple(
    f"ltx_mgpu.{m}"
    for m in ("controller", "fleet", "runner", "transport", "jobboard", "devices", "errors", "events", "startup")
)

RULES = [
    # (but the request bounds and the image parser: stdlib only, shared by the schema and the runners)
    Rule("producer: no torch, no ltx_mgpu", packages=("producer",),
         forbidden=("torch", "ltx_mgpu", "!ltx_mgpu", "!ltx_mgpu.bounds", "!ltx_mgpu.imagesize", "tests"),
         plant=("producer/display.py", "import ltx_mgpu.controller")),
    Rule("ltx_mgpu: no service", packages=("ltx_mgpu",),
         forbidden=("worker", "producer", "redis", "rq", "boto3", "botocore", "tests"),
         plant=("ltx_mgpu/parallel/layout.py", "import redis")),
    Rule("control plane: no runners", modules=CONTROL_PLANE, forbidden=("ltx_mgpu.runners",),
         plant=("ltx_mgpu/jobboard.py", "import ltx_mgpu.runners.common.args")),
    Rule("worker: no producer, no tests", packages=("worker",), forbidden=("producer", "tests"),
         plant=("worker/keys.py", "import producer.exitcodes")),
    Rule("kernels: the bottom layer", packages=("kernels",), forbidden=("ltx_mgpu", "worker", "producer", "tests"),
         plant=("kernels/ltx_mgpu_kernels/_checks.py", "import ltx_mgpu.devices")),
    Rule("bench: no tests", packages=("bench",), forbidden=("tests",),
         plant=("bench/controller.py", "import tests.chaos.invariants")),
    Rule("ltx_mgpu, its device parser, port picker, request bounds, image parser and LoRA file check: no torch",
         modules=("ltx_mgpu", "ltx_mgpu.devices", "ltx_mgpu.ports", "ltx_mgpu.bounds", "ltx_mgpu.imagesize",
                  "ltx_mgpu.lorafile"),
         forbidden=("torch",),
         plant=("ltx_mgpu/devices.py", "import torch")),
]  # fmt: skip


def _copy_tree(dest: Path) -> Path:
    for package in ("producer", "worker", "ltx_mgpu", "kernels", "bench", "tests"):
        shutil.copytree(ROOT / package, dest / package, symlinks=True)  # with __pycache__: saves recompiling
    return dest


@pytest.fixture(scope="module")
def planted_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the packages with every rule's violation planted (each in a file of its own rule's reach)."""
    root = _copy_tree(tmp_path_factory.mktemp("planted"))
    for rule in RULES:
        path, line = rule.plant
        with (root / path).open("a") as f:
            f.write(f"\n{line}  # planted by tests/test_import_contracts.py\n")
    return root


@pytest.fixture(scope="module")
def findings(planted_tree: Path) -> dict[tuple[str, str], dict[str, list[str]]]:
    """Every rule checked on the real tree and on the planted one: {(rule, "real" | "planted"): found}.
    Each check is its own interpreter; they run a few at a time (each spends seconds importing torch)."""
    jobs = {
        (rule.name, tree): (rule, root) for rule in RULES for tree, root in (("real", ROOT), ("planted", planted_tree))
    }
    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as pool:
        futures = {key: pool.submit(rule.check, root) for key, (rule, root) in jobs.items()}
        return {key: future.result() for key, future in futures.items()}


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_layering_rule_holds(rule: Rule, findings: dict) -> None:
    assert findings[rule.name, "real"] == {}, f"{rule.name}: forbidden imports (module: what it brought in)"


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_layering_rule_fails_on_a_planted_violation(rule: Rule, findings: dict) -> None:
    # The real tree passes (test above), so whatever turns up here came with a plant; this rule's own plant
    # must be among it (other rules' plants may be reached too, and the module named is the first importer).
    target = rule.plant[1].removeprefix("import ")
    found = findings[rule.name, "planted"]
    assert any(target in arrived for arrived in found.values()), f"{rule.name}: `{rule.plant[1]}` unnoticed"


def test_lazy_engine_names_resolve():
    """Every public name of the lazy `ltx_mgpu` resolves to its submodule's object, and nothing else does."""
    import ltx_mgpu

    for name in ltx_mgpu.__all__:
        obj = getattr(ltx_mgpu, name)
        assert getattr(sys.modules[obj.__module__], name) is obj
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = ltx_mgpu.nope
    assert set(ltx_mgpu.__all__) == set(ltx_mgpu._EXPORTS)


def test_runner_event_types_are_the_engines():
    """The worker relays runner events under the engine's names; `worker.keys` (stdlib only, imported by
    the producer) cannot import them, so this holds the two spellings together."""
    from ltx_mgpu import events
    from worker.keys import EventType

    assert (EventType.STAGE, EventType.PROGRESS, EventType.OUTPUT) == (events.STAGE, events.PROGRESS, events.OUTPUT)
    assert events.stage_event(events.Stage.MUX) == {"type": "stage", "stage": "mux"}
