"""The layering rules, held by imports in fresh interpreters (README.md, "Layout": arrows point down only).

`producer -> ltx_contract <- worker`, `ltx_contract -> ltx_mgpu.spec`, `worker -> ltx_mgpu -> kernels`, arrows
down only:
- producer never imports the worker, torch or ltx_mgpu (a light CLI), but for the client contract (`ltx_contract`)
  and the stdlib-only request specs (`ltx_mgpu.spec`: bounds, request rules, image sizes, the memory plan and
  profiles, shared by the request schema, the published limits and the runners), which import nothing of ltx_mgpu
  outside that package (the producer image holds no more: tests/test_compose.py checks its file list);
- ltx_contract never imports worker, producer, torch, boto3 or ltx_mgpu outside its specs, and of RQ only its
  client API (jobs, queues, serializers, commands, the worker list; never registries, results or executions);
- ltx_mgpu never imports ltx_contract, worker, producer, redis, rq or boto3 (the engine knows no service);
- the control plane (`ltx_mgpu/control/`: controller, stream, processes, fleet, rank_faults, runner, transport,
  job_board, devices, errors, events, startup) never imports `ltx_mgpu.runners` or `ltx_mgpu.parallel` (it is
  model-agnostic; lazy imports are held by `tests/test_control_plane_contract.py`, which reads the source);
- worker never imports producer; kernels imports none of the packages above it;
- inside worker/, a layer imports only the layers before it (`WORKER_LAYERS`) and no module is on an import
  cycle; these and the other `SOURCE_RULES` read the source, so an import inside a function counts;
- the RQ wing (worker/rq/) is the only part of the worker that imports RQ (any of it: what the contract may use,
  `RQ_CLIENT_API`, included), and the rest of the worker imports of the wing only its interface
  (`RQ_WING_INTERFACE`); RQ's private state is the wing's alone too (tests/test_worker_rqcompat.py);
- no package, bench/ included, imports tests;
- inside `ltx_mgpu/parallel/`, a subpackage imports of the package only itself and those below it (`PARALLEL_BELOW`),
  never the runners (but the LoRA tracker, their pinned host tier), and no product module imports its test support
  (`ltx_mgpu.parallel.testing`);
- `import ltx_mgpu`, `ltx_mgpu.control.devices`, `devstack.ports`, `ltx_mgpu.spec.*` and the ltx2 runners'
  description (`ltx_mgpu.runners.ltx2.spec`, what `ltx-worker plan` reads) import no torch (the worker's
  settings and dev servers and the producer use them).

Each rule imports every module of its packages in a process of its own, forked from one new interpreter
(its `sys.modules` holds only the standard library and third-party modules the rule does not forbid, so an
import done elsewhere in the test session cannot hide or fake one), and lists, per module, the forbidden
modules that arrived with it (tests/support/import_probe.py). One interpreter for all rules: 14 of them took
30-55 s of every CI run.
Each rule is also run on a copy of the tree with a planted violation and must fail there, so none of them
can pass by checking nothing.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.import_probe import modules_under, run_checks
from tests.support.imports import imported_modules

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Rule:
    name: str
    packages: tuple[str, ...] = ()  #: every module of these packages is imported
    modules: tuple[str, ...] = ()  #: and these, by name
    forbidden: tuple[str, ...] = ()  #: module prefixes none of them may bring in
    plant: tuple[str, str] = ("", "")  #: (file to append to, import line) that must break the rule

    def check(self, root: Path) -> tuple[Path, list[str], tuple[str, ...]]:
        """What `run_checks` needs to check this rule on the tree at `root`."""
        return root, [*modules_under(root, *self.packages), *self.modules], self.forbidden


_CONTROL = "controller stream processes fleet rank_faults runner transport job_board devices errors events startup"
CONTROL_PLANE = tuple(f"ltx_mgpu.control.{m}" for m in _CONTROL.split())

#: Every module of the request specs (`ltx_mgpu/spec/`), and the exact names the producer and they may import
SPEC = tuple(modules_under(ROOT, "ltx_mgpu/spec"))
SHARED = ("!ltx_mgpu", "!ltx_mgpu.errors", *(f"!{m}" for m in SPEC))

RULES = [
    Rule("producer: no torch, no worker, no ltx_mgpu but its specs", packages=("producer",),
         forbidden=("torch", "ltx_mgpu", *SHARED, "worker", "tests"),
         plant=("producer/display.py", "import ltx_mgpu.control.controller")),
    Rule("ltx_contract: no worker, producer or torch, no ltx_mgpu but its specs", packages=("ltx_contract",),
         forbidden=("torch", "ltx_mgpu", *SHARED, "worker", "producer", "boto3", "botocore", "tests"),
         plant=("ltx_contract/states.py", "import worker.errors")),
    Rule("specs: stdlib only, nothing of ltx_mgpu outside them", packages=("ltx_mgpu/spec",),
         forbidden=("torch", "ltx_mgpu", *SHARED, "ltx_contract", "worker", "producer", "tests"),
         plant=("ltx_mgpu/spec/bounds.py", "import ltx_mgpu.control.devices")),
    Rule("ltx_mgpu: no service", packages=("ltx_mgpu",),
         forbidden=("ltx_contract", "worker", "producer", "redis", "rq", "boto3", "botocore", "tests"),
         plant=("ltx_mgpu/parallel/layouts/layout.py", "import redis")),
    Rule("control plane: no runners, no data plane", modules=CONTROL_PLANE,
         forbidden=("ltx_mgpu.runners", "ltx_mgpu.parallel"),
         plant=("ltx_mgpu/control/job_board.py", "import ltx_mgpu.runners.common.args")),
    Rule("worker: no producer, no tests", packages=("worker",), forbidden=("producer", "tests"),
         plant=("worker/protocol/relay.py", "import producer.exit_codes")),
    Rule("kernels: the bottom layer", packages=("kernels",),
         forbidden=("ltx_mgpu", "ltx_contract", "worker", "producer", "tests"),
         plant=("kernels/ltx_mgpu_kernels/_checks.py", "import ltx_mgpu.control.devices")),
    Rule("bench and devstack: no tests", packages=("bench", "devstack"), forbidden=("tests",),
         plant=("bench/controller.py", "import tests.chaos.invariants")),
    Rule("ltx_mgpu, its device parser, port picker, request specs, LoRA file check: no torch",
         modules=("ltx_mgpu", "ltx_mgpu.control.devices", "devstack.ports", *SPEC, "ltx_mgpu.lora_file",
                  "ltx_mgpu.runners.ltx2.spec"),
         forbidden=("torch",),
         plant=("ltx_mgpu/control/devices.py", "import torch")),
]  # fmt: skip


def _copy_tree(dest: Path) -> Path:
    for package in ("producer", "ltx_contract", "worker", "ltx_mgpu", "kernels", "bench", "devstack", "tests"):
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
    """Every rule checked on the real tree and on the planted one: {(rule, "real" | "planted"): found}."""
    jobs = {
        (rule.name, tree): (rule, root) for rule in RULES for tree, root in (("real", ROOT), ("planted", planted_tree))
    }
    keyed = {f"{name}|{tree}": rule.check(root) for (name, tree), (rule, root) in jobs.items()}
    found = run_checks(keyed)
    return {key: found[f"{key[0]}|{key[1]}"] for key in jobs}


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
    """The worker relays runner events under the engine's names; `ltx_contract.keys` (stdlib only, imported by
    the producer) cannot import them, so this holds the two spellings together."""
    from ltx_contract.states import EventType
    from ltx_mgpu.control import events

    assert (EventType.STAGE, EventType.PROGRESS, EventType.OUTPUT) == (events.STAGE, events.PROGRESS, events.OUTPUT)
    assert events.stage_event(events.Stage.MUX) == {"type": "stage", "stage": "mux"}


# ---- the worker's folders, checked on the source (AST), so an import inside a function counts too ----------


def imports_in(path: Path, root: Path) -> set[str]:
    """Every module the file at `path` imports anywhere (`imported_modules`; an `__init__` keeps its own
    name so that its relative imports resolve against its package)."""
    return imported_modules(path.read_text(), ".".join(path.relative_to(root).with_suffix("").parts))


def names_any(name: str, prefixes: tuple[str, ...]) -> bool:
    """True if module `name` is one of `prefixes` or below one ("=name": that exact module only)."""
    return any(name == p.removeprefix("=") or (p[0] != "=" and name.startswith(p + ".")) for p in prefixes)


@dataclass(frozen=True)
class SourceRule:
    name: str
    folders: tuple[str, ...]  #: every .py file below these
    forbidden: tuple[str, ...]  #: module prefixes none of them may import
    allowed: tuple[str, ...] = ()  #: prefixes exempt from `forbidden` ("=name": that exact module only)
    excluded: tuple[str, ...] = ()  #: folders below `folders` not held to the rule
    plant: tuple[str, str] = ("", "")  #: (file to append to, import line) that must break the rule

    def violations(self, root: Path) -> dict[str, list[str]]:
        """{file: forbidden imports} for the tree at `root`."""
        found = {}
        for folder in self.folders:
            for path in sorted((root / folder).rglob("*.py")):
                rel = path.relative_to(root).as_posix()
                if any(rel.startswith(x + "/") for x in self.excluded):
                    continue
                bad = sorted(
                    n for n in imports_in(path, root) if names_any(n, self.forbidden) and not names_any(n, self.allowed)
                )
                if bad:
                    found[rel] = bad
        return found


#: What the contract may import of RQ: its client API (jobs, queues, serializers, exceptions, commands, helpers,
#: the worker list). Registries, results, executions, the intermediate queue and maintenance are the worker's.
RQ_CLIENT_API = (
    "=rq",
    *(f"rq.{m}" for m in "job queue serializers exceptions command utils worker worker_registration".split()),
)

#: What the worker outside `worker/rq/` may import of the RQ wing: the job record the job path holds
#: (`JobRecord`, `fetch_record`, `current_record`) and the RQ worker the runtime's `FleetWorker` extends.
RQ_WING_INTERFACE = ("worker.rq.record", "worker.rq.loop.worker")

SOURCE_RULES = [
    # The producer image copies ltx_contract/ and ltx_mgpu/spec/, nothing of worker/ (Dockerfile, `producer`).
    SourceRule("producer: nothing of the worker", folders=("producer",), forbidden=("worker",),
               plant=("producer/display.py", "from worker.protocol import relay")),
    SourceRule("ltx_contract: nothing of worker or producer, no torch or boto3, of ltx_mgpu only its specs",
               folders=("ltx_contract",),
               forbidden=("worker", "producer", "torch", "boto3", "botocore", "ltx_mgpu", "tests"),
               allowed=("ltx_mgpu.spec",),
               plant=("ltx_contract/keys.py", "from worker.errors import WorkerError")),
    SourceRule("ltx_contract: of RQ only its client API", folders=("ltx_contract",), forbidden=("rq",),
               allowed=RQ_CLIENT_API, plant=("ltx_contract/control.py", "from rq.registry import StartedJobRegistry")),
    SourceRule("worker.protocol: nothing else of the worker", folders=("worker/protocol",),
               forbidden=("worker", "producer", "torch", "boto3", "botocore"),
               allowed=("worker.protocol", "worker.errors"),
               plant=("worker/protocol/relay.py", "from worker.settings import WorkerSettings")),
    # Development servers, the TLS Redis, the S3 gateway, the TCP proxy and the demo stay out of production
    # (bench/ and scripts/ are development tooling and may use them).
    SourceRule("production: no devstack", folders=("worker", "producer", "ltx_contract", "ltx_mgpu", "kernels"),
               forbidden=("devstack",), excluded=("devstack",),
               plant=("worker/render/fleet.py", "from devstack.dev_servers import pid_alive")),
    SourceRule("worker.uploads: bytes only, no redis or rq", folders=("worker/uploads",), forbidden=("redis", "rq"),
               plant=("worker/uploads/uploader.py", "import redis")),
    # The RQ wing (worker/rq/, its docstring): the rest of the worker imports nothing of RQ, not even its client API,
    # so a move to another queue (or to RQ's own executions) touches only the wing; and of the wing only its
    # interface, `RQ_WING_INTERFACE`.
    SourceRule("worker: only the RQ wing imports rq", folders=("worker",), forbidden=("rq",),
               excluded=("worker/rq",), plant=("worker/stages/upload.py", "from rq.job import Job")),
    SourceRule("worker: the RQ wing only through its interface", folders=("worker",), forbidden=("worker.rq",),
               allowed=RQ_WING_INTERFACE, excluded=("worker/rq",),
               plant=("worker/stages/upload.py", "from worker.rq.loop.unstarted import fail_unreadable")),
]  # fmt: skip


#: worker/'s layers, lowest first (`LayerRule`): a folder of worker/ or a module at its top (`__init__` is
#: worker/__init__.py), or a folder inside one named with its dot (`rq.loop`). A new folder goes after every layer
#: it imports, before every layer importing it (`stages`, driven by render/: before it). The RQ wing, `worker/rq/`,
#: is two layers: its job records (`rq`, below the job path that holds them) and its work loop (`rq.loop`, which
#: drives the render service; only the runtime is above it). Development servers live outside worker/, in
#: devstack/ ("production: no devstack").
WORKER_LAYERS = (
    *("__init__", "errors", "protocol", "rq", "settings", "ops", "uploads", "jobs", "stages", "render", "job"),
    *("rq.loop", "runtime", "cli", "__main__"),
)


@dataclass(frozen=True)
class LayerRule:
    """Every module of the package imports (anywhere, lazily too) only its own layer and the layers before it."""

    name: str
    layers: tuple[str, ...]
    folders: tuple[str] = ("worker",)  #: the package
    plant: tuple[str, str] = ("", "")

    def layer_of(self, module: str) -> str:
        """The layer of a dotted name inside the package: its second part (`__init__` for the package), or its
        second and third where the layers name that folder (`rq.loop`)."""
        parts = module.split(".")
        if len(parts) > 2 and f"{parts[1]}.{parts[2]}" in self.layers:
            return f"{parts[1]}.{parts[2]}"
        return parts[1] if len(parts) > 1 else "__init__"

    def violations(self, root: Path) -> dict[str, list[str]]:
        """{file: its imports of a later layer, or of a layer the list lacks (named "in no layer")}."""
        package, rank = self.folders[0], {layer: i for i, layer in enumerate(self.layers)}
        found: dict[str, list[str]] = {}
        for path in sorted((root / package).rglob("*.py")):
            own = self.layer_of(".".join(path.relative_to(root).with_suffix("").parts))
            if own not in rank:
                found[path.relative_to(root).as_posix()] = [f"{own}: in no layer (add it to WORKER_LAYERS)"]
                continue
            names = [n for n in imports_in(path, root) if n == package or n.startswith(package + ".")]
            bad = {f"{n} ({self.layer_of(n)}: in no layer)" if self.layer_of(n) not in rank else n
                   for n in names if rank.get(self.layer_of(n), len(rank)) > rank[own]}  # fmt: skip
            if bad:
                found[path.relative_to(root).as_posix()] = sorted(bad)
        return found


@dataclass(frozen=True)
class CycleRule:
    """No import cycle among the modules of the package, counting imports inside functions: a lazy import
    hides a cycle from the interpreter, not from the reader."""

    name: str
    folders: tuple[str] = ("worker",)  #: the package
    plant: tuple[str, str] = ("", "")

    def violations(self, root: Path) -> dict[str, list[str]]:
        """{file: the modules of the cycle it is on}, for every module on a cycle."""
        files = {}
        for path in sorted((root / self.folders[0]).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
        graph = {m: {n for n in imports_in(path, root) if n in files and n != m} for m, path in files.items()}
        return {files[m].relative_to(root).as_posix(): members for m, members in on_cycles(graph).items()}


def on_cycles(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """{node on a cycle: every node of its cycles} (those it reaches that reach it back)."""
    reach = {}
    for start, edges in graph.items():
        seen, todo = set(), list(edges)
        while todo:
            if (node := todo.pop()) not in seen:
                seen.add(node)
                todo.extend(graph[node])
        reach[start] = seen
    return {m: sorted(n for n in reach[m] if m in reach[n]) for m in graph if m in reach[m]}


SOURCE_RULES += [
    LayerRule("worker: each layer imports only the layers before it", WORKER_LAYERS,
              plant=("worker/settings/base.py", "from worker.render.service import RenderService")),
    # (within one layer: settings.base is below settings.core, which imports it)
    CycleRule("worker: no import cycle",
              plant=("worker/settings/base.py", "from worker.settings.core import WorkerSettings")),
]  # fmt: skip

#: ltx_mgpu/parallel/'s subpackages (each `__init__` says what it is for) and what each may import of the package
#: besides itself: the token partition and collectives at the bottom, the graph-ready forward on them, the SP core on
#: both (its wrapper installs the hoister, its attention asks whether a capture runs), the layouts on the SP core; the
#: pipeline's parallel parts and the LoRA tracker beside them. None imports the package itself, which imports them all.
PARALLEL_BELOW = {
    "sharding": (), "graphs": ("sharding",), "sp": ("sharding", "graphs"), "layouts": ("sharding", "graphs", "sp"),
    "pipeline": ("sharding", "graphs"), "lora": ("sharding",),
}  # fmt: skip
#: The import each must refuse, planted (a file of the subpackage, an import of one it may not reach)
PARALLEL_PLANTS = {
    "sharding": ("collectives.py", "from ..graphs.capture_cache import capturing"),
    "graphs": ("hoist.py", "from ..sp.attention import AttentionManager"),
    "sp": ("wrapper.py", "from ..layouts.router import AttentionRouter"),
    "layouts": ("guidance.py", "from ltx_mgpu.parallel import CudaGraphForward"),
    "pipeline": ("tdp.py", "from ..sp.wrapper import check_token_budget"),
    "lora": ("lora_tracker.py", "from ..pipeline.tdp import shared_weights_model"),
}

SOURCE_RULES += [
    SourceRule(f"parallel.{sub}: of the package only {' and '.join((sub, *below))}",
               folders=(f"ltx_mgpu/parallel/{sub}",), forbidden=("ltx_mgpu.parallel",),
               allowed=tuple(f"ltx_mgpu.parallel.{s}" for s in (sub, *below)),
               plant=(f"ltx_mgpu/parallel/{sub}/{PARALLEL_PLANTS[sub][0]}", PARALLEL_PLANTS[sub][1]))
    for sub, below in PARALLEL_BELOW.items()
]  # fmt: skip
SOURCE_RULES += [
    # The data plane is driven by the runners and never reaches back, but for the LoRA tracker, whose clean copy and
    # factors live in the runners' pinned host tier (`pack_pinned`).
    SourceRule("parallel: no runners (the CUDA graphs, the SP core, the layouts, the pipeline's parts)",
               folders=("ltx_mgpu/parallel",), forbidden=("ltx_mgpu.runners",), excluded=("ltx_mgpu/parallel/lora",),
               plant=("ltx_mgpu/parallel/graphs/cuda_graph.py", "from ...runners.ltx2.resident import Ltx2Resident")),
    SourceRule("parallel.lora: of the runners only their pinned host tier", folders=("ltx_mgpu/parallel/lora",),
               forbidden=("ltx_mgpu.runners",), allowed=("ltx_mgpu.runners.common.host_tier",),
               plant=("ltx_mgpu/parallel/lora/lora_units.py", "from ...runners.common import job_loras")),
    # `LocalWorld` (process worlds for tests) lives in the engine because bench/ uses it too and may not import
    # tests; no product module may use it.
    SourceRule("parallel.testing: imported by no product module",
               folders=("producer", "ltx_contract", "worker", "ltx_mgpu"), forbidden=("ltx_mgpu.parallel.testing",),
               plant=("ltx_mgpu/runners/smoke/runner.py", "from ...parallel.testing import LocalWorld")),
]  # fmt: skip


def test_a_new_folder_fails_the_layer_rule_until_it_is_placed(tmp_path: Path) -> None:
    """A folder WORKER_LAYERS lacks is named, in itself and where it is imported; placed, it passes."""
    rule = next(r for r in SOURCE_RULES if isinstance(r, LayerRule))
    assert [rule.layer_of(m) for m in ("worker.hooks.encode", "worker.job", "worker")] == ["hooks", "job", "__init__"]
    (tmp_path / "worker" / "hooks").mkdir(parents=True)
    (tmp_path / "worker" / "__init__.py").write_text("")
    (tmp_path / "worker" / "hooks" / "encode.py").write_text("from worker.jobs import outcomes\n")
    (tmp_path / "worker" / "render.py").write_text("def f():\n    from worker.hooks import encode\n")
    found = rule.violations(tmp_path)
    assert found["worker/hooks/encode.py"] == ["hooks: in no layer (add it to WORKER_LAYERS)"]
    assert found["worker/render.py"] == [f"worker.hooks{m} (hooks: in no layer)" for m in ("", ".encode")]
    placed = LayerRule(rule.name, (*rule.layers[: (at := rule.layers.index("render"))], "hooks", *rule.layers[at:]))
    assert placed.violations(tmp_path) == {}
    (tmp_path / "worker" / "stages").mkdir()  # (below render/, which feeds them: a stage never imports it)
    (tmp_path / "worker" / "stages" / "upload.py").write_text("def f():\n    from worker.render import service\n")
    assert rule.violations(tmp_path)["worker/stages/upload.py"] == ["worker.render", "worker.render.service"]


def test_the_wing_is_two_layers_and_its_records_never_import_its_loop(tmp_path: Path) -> None:
    """`worker/rq/` is one folder in two layers: its job records below the job path, its work loop above the render
    service. A record that imports the loop (or the job path it sits below) is a layer violation."""
    rule = next(r for r in SOURCE_RULES if isinstance(r, LayerRule))
    assert [rule.layer_of(m) for m in ("worker.rq.record", "worker.rq.loop.worker", "worker.rq")] == [
        "rq",
        "rq.loop",
        "rq",
    ]
    (tmp_path / "worker" / "rq" / "loop").mkdir(parents=True)
    (tmp_path / "worker" / "rq" / "loop" / "worker.py").write_text("from worker.render import service\n")
    (tmp_path / "worker" / "rq" / "record.py").write_text("def f():\n    from worker.rq.loop import worker\n")
    found = rule.violations(tmp_path)
    assert found == {"worker/rq/record.py": ["worker.rq.loop", "worker.rq.loop.worker"]}


def test_cycles_are_found_around_a_loop() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert on_cycles(graph) == {"a": ["a", "b", "c"], "b": ["a", "b", "c"], "c": ["a", "b", "c"]}


@pytest.mark.parametrize("rule", SOURCE_RULES, ids=[r.name for r in SOURCE_RULES])
def test_source_rule_holds(rule: SourceRule) -> None:
    assert rule.violations(ROOT) == {}, f"{rule.name}: forbidden imports (file: what it imports)"


@pytest.mark.parametrize("rule", SOURCE_RULES, ids=[r.name for r in SOURCE_RULES])
def test_source_rule_fails_on_a_planted_violation(rule: SourceRule, tmp_path: Path) -> None:
    path, line = rule.plant
    for folder in {*rule.folders, str(Path(path).parent)}:
        shutil.copytree(ROOT / folder, tmp_path / folder, dirs_exist_ok=True)
    with (tmp_path / path).open("a") as f:
        f.write(f"\ndef _planted():\n    {line}  # planted, lazily, by tests/test_import_contracts.py\n")
    assert path in rule.violations(tmp_path), f"{rule.name}: `{line}` unnoticed"
