"""Structure the tree keeps: files stay under 450 lines unless their module docstring says why (it names the
"450 lines" it is over and the reason), so a file that keeps growing is split while splitting is still
cheap; no module of producer/, ltx_contract/, worker/ or ltx_mgpu/ is over 600 lines whatever its docstring
says (past that, a reason is a split put off); one free-port picker (`devstack/ports.py`) serves the dev
servers, the benchmarks and the tests; and no test module imports another (what tests share lives in
tests/support/: importing a test module runs its module-level code and re-registers its fixtures, and its
helpers change with its tests)."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 450
HARD_LIMIT = 600  #: product modules only: no docstring reason lets one grow past this
PRODUCT = ("producer/", "ltx_contract/", "worker/", "ltx_mgpu/")
#: Over the limit while a branch editing them lands, to be split or given a reason then (none now).
PENDING: set[str] = set()


def _python_files() -> list[str]:
    listed = ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"]
    return subprocess.run(listed, cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


def oversized(path: str, text: str) -> bool:
    """True if `text` is over the limit and its module docstring does not say why."""
    if text.count("\n") <= LIMIT:
        return False
    docstring = ast.get_docstring(ast.parse(text)) or ""
    return f"{LIMIT} lines" not in docstring


def test_files_over_the_limit_say_why() -> None:
    found = sorted(f for f in _python_files() if (ROOT / f).is_file() and oversized(f, (ROOT / f).read_text()))
    assert set(found) <= PENDING, f"over {LIMIT} lines without a reason in the docstring: {set(found) - PENDING}"
    assert PENDING <= set(found), f"no longer over the limit (remove from PENDING): {PENDING - set(found)}"


def over_the_hard_limit(path: str, text: str) -> bool:
    """True if `path` is a product module with more than `HARD_LIMIT` lines (a docstring reason does not count)."""
    return path.startswith(PRODUCT) and text.count("\n") > HARD_LIMIT


def test_no_product_module_is_over_the_hard_limit() -> None:
    found = sorted(
        f for f in _python_files() if (ROOT / f).is_file() and over_the_hard_limit(f, (ROOT / f).read_text())
    )
    assert not found, f"over {HARD_LIMIT} lines (split them; a docstring reason is not enough here): {found}"


def test_the_size_check_fails_on_a_planted_file() -> None:
    body = "x = 1\n" * (LIMIT + 1)
    assert oversized("big.py", '"""A module."""\n' + body)
    assert not oversized("big.py", f'"""A module, over {LIMIT} lines on purpose: one class."""\n' + body)
    assert not oversized("small.py", '"""A module."""\nx = 1\n')
    reasoned = f'"""A module, over {LIMIT} lines on purpose."""\n' + "x = 1\n" * HARD_LIMIT
    assert over_the_hard_limit("worker/big.py", reasoned) and not over_the_hard_limit("bench/big.py", reasoned)
    assert not over_the_hard_limit("worker/big.py", "x = 1\n" * HARD_LIMIT)


#: Asking the kernel for a port: binding port 0 and reading it back.
_PICKS_A_PORT = re.compile(r"\.getsockname\(\)\[1\]|\.bind\(\([^)]*,\s*0\)\)")


def test_one_free_port_picker() -> None:
    pickers = sorted(
        f for f in _python_files() if (ROOT / f).is_file() and _PICKS_A_PORT.search((ROOT / f).read_text())
    )
    assert pickers == ["devstack/ports.py"], f"pick ports with devstack.ports, not in {pickers}"
    planted = "s.bind" + '(("127.0.0.1", 0))'  # (split so this file does not match itself)
    assert _PICKS_A_PORT.search(planted) and _PICKS_A_PORT.search("return s.getsockname" + "()[1]")


# ==== test modules import no other test module ============================================================

#: Test modules that still import another test module: none may be added, and one that stops leaves the list.
#: What they share (LoRA files, LTX-2 runner fixtures, GPU numerics cases, doc sections) is to move into
#: tests/support/ as the branches editing those modules land.
IMPORTS_PENDING = {
    "tests/test_bench_attention.py",
    "tests/test_doc_recipes.py",
    "tests/test_doc_snippets.py",
    "tests/test_fp8.py",
    "tests/test_fp8_attention_gpu.py",
    "tests/test_fp8_runners.py",
    "tests/test_graph_ready.py",
    "tests/test_graphs.py",
    "tests/test_image_lies.py",
    "tests/test_job_loras.py",
    "tests/test_job_loras_units.py",
    "tests/test_lora_device_cache.py",
    "tests/test_lora_disk.py",
    "tests/test_lora_file.py",
    "tests/test_lora_tenants.py",
    "tests/test_ltx2_oom.py",
    "tests/test_ltx2_runners_schema.py",
    "tests/test_multi_gpu_gpu.py",
    "tests/test_sp_gpu.py",
    "tests/test_tdp_gpu.py",
    "tests/test_worker_encode_stream.py",
    "tests/test_worker_lora_abuse.py",
    "tests/test_worker_loras.py",
}


def imported_test_modules(path: str, text: str) -> list[str]:
    """The test modules (`tests[.sub].test_*`) that the module at `path` (relative to the root) imports,
    anywhere in it: `from tests.test_x import y`, `from .test_x import y`, `from . import test_x`, `import
    tests.test_x`. A test module's names belong to its tests; what two modules share lives in tests/support/."""
    package = Path(path).with_suffix("").parts[:-1]
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] if node.level else ())
            module = ".".join(p for p in (base, node.module or "") if p)
            targets = [module] if node.module else [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [t for t in targets if t.startswith("tests.") and t.rsplit(".", 1)[-1].startswith("test_")]
    return sorted(set(found))


def test_no_test_module_imports_another() -> None:
    modules = [f for f in _python_files() if f.startswith("tests/") and Path(f).name.startswith("test_")]
    found = {
        f: hits for f in modules if (ROOT / f).is_file() and (hits := imported_test_modules(f, (ROOT / f).read_text()))
    }
    assert set(found) <= IMPORTS_PENDING, (
        "test modules importing test modules (move what they share to "
        f"tests/support/): {dict((f, found[f]) for f in set(found) - IMPORTS_PENDING)}"
    )
    assert IMPORTS_PENDING <= set(found), f"no longer importing test modules (remove): {IMPORTS_PENDING - set(found)}"


def test_the_test_import_check_fails_on_a_planted_module() -> None:
    planted = (
        "from tests.test_compose import SERVICES\nfrom .test_lora_file import write_st\n"
        "def f():\n    from . import test_producer_cli\n    import tests.chaos.test_chaos\n"
        "from tests.support.wait import wait_for\nfrom . import conftest\n"
    )
    assert imported_test_modules("tests/test_x.py", planted) == [
        "tests.chaos.test_chaos",
        "tests.test_compose",
        "tests.test_lora_file",
        "tests.test_producer_cli",
    ]
    assert imported_test_modules(
        "tests/chaos/test_y.py", "from ..test_compose import SERVICES\nfrom .test_chaos import x\n"
    ) == ["tests.chaos.test_chaos", "tests.test_compose"]


# ==== function length ======================================================================================
#: No product function is longer than this many lines (as the formatter writes them), but for the ones named
#: below, each with the reason it is one piece.
FUNCTION_LIMIT = 80
LONG_FUNCTIONS: dict[str, str] = {
    "ltx_mgpu/runners/ltx2/resident.py:setup": "every rank builds its resident models in one collective order (the "
    "SP groups, the tracker's owners, the decoder's tiles); a split must be checked on a GPU, which this change had "
    "no time on",
    "worker/ops/metrics.py:__init__": "a declaration list: one Prometheus metric per statement, read as a table",
    "ltx_mgpu/fused/block.py:fused_classes": "the Triton kernels' module classes built in one closure over the "
    "kernels it imports lazily (a split must be checked on a GPU)",
    "worker/rq/loop/admission.py:police": "one optimistic Redis transaction: everything between WATCH and EXEC reads "
    "and writes one pipeline, and a conflict restarts the whole of it",
    "ltx_mgpu/runners/common/fast_load.py:_copy": "the staged copy's pipeline (readers, pinned ring, side stream) "
    "in one loop whose buffers must be released in order; GPU code",
}


def long_functions(path: str, text: str) -> list[tuple[str, int]]:
    """(`path:name`, lines) of every function of `text` longer than `FUNCTION_LIMIT` lines."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > FUNCTION_LIMIT:
                out.append((f"{path}:{node.name}", lines))
    return out


def test_no_product_function_is_long_without_a_named_reason() -> None:
    found = {
        name: lines
        for f in _python_files()
        if f.startswith(PRODUCT) and (ROOT / f).is_file()
        for name, lines in long_functions(f, (ROOT / f).read_text())
    }
    unnamed = {name: lines for name, lines in found.items() if name not in LONG_FUNCTIONS}
    assert not unnamed, f"functions over {FUNCTION_LIMIT} lines without a named reason (split them): {unnamed}"
    stale = sorted(set(LONG_FUNCTIONS) - set(found))
    assert not stale, f"named as long but no longer are (drop them from LONG_FUNCTIONS): {stale}"


def test_the_function_length_check_fails_on_a_planted_function() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_LIMIT))
    assert long_functions("worker/x.py", f"def big():\n{body}") == [("worker/x.py:big", FUNCTION_LIMIT + 1)]
    assert long_functions("worker/x.py", "def small():\n    return 1\n") == []


# ==== lines as the formatter writes them ===================================================================
#: Product code (and kernels/' Python) is laid out by `ruff format` everywhere, so the line limits above count what
#: the formatter writes, not what a hand layout packed: a `# fmt: skip` or `# fmt: off` is allowed only on a genuine
#: table (aligned rows of data), its file named here with the reason (none now: the last 31 kept six modules under
#: their limits, which were split instead).
FORMATTER_EXEMPT: dict[str, str] = {}
FORMATTED = (*PRODUCT, "kernels/")
_FORMATTER_OFF = re.compile(r"#\s*fmt:\s*(skip|off)\b")


def formatter_skips(text: str) -> int:
    """How many lines of `text` keep the formatter off (`# fmt: skip`, `# fmt: off`)."""
    return sum(1 for line in text.splitlines() if _FORMATTER_OFF.search(line))


def test_product_code_is_laid_out_by_the_formatter() -> None:
    found = {
        f: n
        for f in _python_files()
        if f.startswith(FORMATTED) and (ROOT / f).is_file() and (n := formatter_skips((ROOT / f).read_text()))
    }
    unnamed = {f: n for f, n in found.items() if f not in FORMATTER_EXEMPT}
    assert not unnamed, f"formatter kept off outside a named table (let `ruff format` lay them out): {unnamed}"
    stale = sorted(set(FORMATTER_EXEMPT) - set(found))
    assert not stale, f"named as tables but no longer kept off the formatter (drop them): {stale}"


def test_the_formatter_check_fails_on_a_planted_skip() -> None:
    assert formatter_skips("x = f(a,\n      b)  # fmt: skip\n") == 1
    assert formatter_skips("# fmt: off\nrows = [1,  2]\n# fmt: on\n") == 1
    assert formatter_skips("x = f(a, b)\n") == 0
