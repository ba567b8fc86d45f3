"""The docs pages that restate the code, checked against it both ways (like the exit-code test in
test_producer_cli.py): the settings tables, the metrics list, the built-in runners and the request fields.
A row the code lacks and a name the page lacks are both drift. Each checker also runs on a copy of its page
with a planted drift and must report it, so none can pass by reading nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.metrics import MetricWrapperBase

from ltx_contract.schema import RenderRequest
from producer.settings import ProducerSettings
from worker.ops.metrics import WorkerMetrics
from worker.settings import BUILTIN_RUNNERS, WorkerSettings

DOCS = Path(__file__).resolve().parent.parent / "docs"


def section(text: str, heading: str) -> str:
    """The body of the `## heading` section (up to the next heading of level 2)."""
    match = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"no section '## {heading}'"
    return match.group(1)


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the markdown tables in `text`, as stripped cells (header and rule rows dropped)."""
    rows: list[list[str]] = []
    in_table = False
    for line in text.splitlines():
        is_row = line.startswith("|")
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if is_row and in_table and not all(set(c) <= set("-: ") for c in cells):
            rows.append(cells)
        in_table = is_row  # the first row of a table is its header
    return rows


def drift(documented: set[str], actual: set[str], what: str) -> list[str]:
    out = [f"{what}: {name} is in the code, not in the docs" for name in sorted(actual - documented)]
    return out + [f"{what}: {name} is in the docs, not in the code" for name in sorted(documented - actual)]


# ==== the checkers ========================================================================================


def settings_drift(page: str, heading: str, fields: set[str]) -> list[str]:
    """Every settings field has a row (`LTX_<FIELD>`; a row may name several) and every row is a field."""
    documented = {name for row in table_rows(section(page, heading)) for name in re.findall(r"`(LTX_\w+)`", row[0])}
    return drift(documented, {f"LTX_{name.upper()}" for name in fields}, f"{heading} table")


_UNITS = {"": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def settings_defaults_drift(page: str, heading: str, fields: dict[str, object]) -> list[str]:
    """Every numeric default the table shows (`10`, `16 MiB`; a row naming several fields lists theirs in
    order, `5, 60`) is the field's default."""
    out = []
    for row in table_rows(section(page, heading)):
        names = re.findall(r"`(LTX_\w+)`", row[0])
        shown = [re.fullmatch(r"(\d+(?:\.\d+)?) ?(KiB|MiB|GiB)?", v.strip(" `")) for v in row[2].split(",")]
        if len(shown) != len(names) or not all(shown):
            continue  # not a number (a path, a list, "-"): nothing to compare
        for name, match in zip(names, shown, strict=True):
            default = getattr(fields.get(name.removeprefix("LTX_").lower()), "default", None)
            value = float(match.group(1)) * _UNITS[match.group(2) or ""]
            if isinstance(default, int | float) and not isinstance(default, bool) and value != default:
                out.append(f"{heading} table: {name} defaults to {default}, the docs say {row[2]}")
    return out


def metrics_drift(page: str) -> list[str]:
    """The metric names in "Observability" are the families `WorkerMetrics` registers (counters `_total`)."""
    metrics = WorkerMetrics("g")
    actual = set()
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            name = value._name  # the family name as exposed, minus a counter's `_total`
            actual.add(f"{name}_total" if value._type == "counter" else name)
    documented = set(re.findall(r"`(ltx_worker_[a-z_]+)", section(page, "Observability")))
    return drift(documented, actual, "metrics")


def runners_drift(page: str) -> list[str]:
    """The "Built-in runners" table is `BUILTIN_RUNNERS`: the same names, each with its import path."""
    rows = {row[0].strip("`"): row[1].strip("`") for row in table_rows(section(page, "Built-in runners"))}
    out = drift(set(rows), set(BUILTIN_RUNNERS), "built-in runners")
    return out + [
        f"built-in runners: {name} is {BUILTIN_RUNNERS[name]}, the docs say {path}"
        for name, path in rows.items()
        if name in BUILTIN_RUNNERS and BUILTIN_RUNNERS[name] != path
    ]


def request_fields_drift(page: str) -> list[str]:
    """The request-fields table is `RenderRequest`: the same fields, each with its default as JSON."""
    rows = {
        row[0].strip("`"): row[2].strip("`")
        for row in table_rows(section(page, "Request files and validation"))
        if row[0].startswith("`")
    }
    out = drift(set(rows), set(RenderRequest.model_fields), "request fields")
    for name, shown in rows.items():
        field = RenderRequest.model_fields.get(name)
        if field is None:
            continue
        expected = "required" if field.is_required() else json.dumps(field.default)
        if shown != expected:
            out.append(f"request fields: {name} defaults to {expected}, the docs say {shown}")
    return out


CHECKS: dict[str, tuple[str, Callable[[str], list[str]]]] = {
    "worker settings": ("worker.md", lambda p: settings_drift(p, "Settings", set(WorkerSettings.model_fields))),
    "worker settings defaults": (
        "worker.md",
        lambda p: settings_defaults_drift(p, "Settings", dict(WorkerSettings.model_fields)),
    ),
    "producer settings": ("producer.md", lambda p: settings_drift(p, "Settings", set(ProducerSettings.model_fields))),
    "metrics": ("worker.md", metrics_drift),
    "built-in runners": ("worker.md", runners_drift),
    "request fields": ("producer.md", request_fields_drift),
}

#: One planted drift per check: (text to find in its page, what to put there instead).
PLANTS: dict[str, list[tuple[str, str]]] = {
    "worker settings": [
        ("| `LTX_UPLOAD_THREADS` |", "| `LTX_UPLOAD_THREDS` |"),  # a renamed field: both directions
        ("| `LTX_REDIS_URL` |", "| `LTX_NOT_A_SETTING` | str | - | - |\n| `LTX_REDIS_URL` |"),
    ],
    "worker settings defaults": [  # (the spool's free-space floor was documented at half its value)
        ("| `LTX_SPOOL_MIN_FREE_BYTES` | int | 1 GiB |", "| `LTX_SPOOL_MIN_FREE_BYTES` | int | 536870912 |"),
        ("| `LTX_RENDER_TIMEOUT` | float s | 3600 |", "| `LTX_RENDER_TIMEOUT` | float s | 360 |"),
    ],
    "producer settings": [("| `LTX_CLIENT_QUOTA` |", "| `LTX_CLIENT_QUOTAS` |")],
    "metrics": [("`ltx_worker_storage_up`", "`storage_up`"), ("`ltx_worker_busy`", "`ltx_worker_bizy`")],
    "built-in runners": [
        ("| `noop` |", "| `no-op` |"),
        ("ltx_mgpu.runners.smoke:SmokeRunner", "ltx_mgpu.runners.smoke:Smoke"),
    ],
    "request fields": [("| `images` |", "| `image` |"), ("| `seed` | int | `42` |", "| `seed` | int | `0` |")],
}


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_docs_match_the_code(check: str) -> None:
    page, checker = CHECKS[check]
    problems = checker((DOCS / page).read_text())
    assert not problems, f"docs/{page} drifted:\n" + "\n".join(problems)


@pytest.mark.parametrize(("check", "plant"), [(c, p) for c in sorted(PLANTS) for p in PLANTS[c]])
def test_docs_checks_fail_on_a_planted_drift(check: str, plant: tuple[str, str]) -> None:
    page, checker = CHECKS[check]
    text = (DOCS / page).read_text()
    assert text.count(plant[0]) == 1, f"the plant's anchor {plant[0]!r} is not once in docs/{page}"
    assert checker(text.replace(plant[0], plant[1])), f"{check}: the planted drift {plant[1]!r} went unnoticed"


# ==== comments cite only what is in the repository ========================================================

ROOT = DOCS.parent
#: An issue number (the word, a space, a number) or a path into the workspace outside the repository.
_OUTSIDE = re.compile(r"\b[Ii]ssue #?\d+\b|(?<![\w.])(?:\.\./)?shared/(?:reference|ENVIRONMENT|ARCHITECTURE|STYLE)")


def outside_citations(path: str, text: str) -> list[str]:
    return [f"{path}:{n}: {line.strip()[:100]}" for n, line in enumerate(text.splitlines(), 1) if _OUTSIDE.search(line)]


def test_code_cites_nothing_outside_the_repository() -> None:
    """Issue trackers and workspace notes are not in the repository: a comment citing an issue number or a
    workspace note sends a reader nowhere. Say the why in place (or cite a file that is here)."""
    import subprocess

    listed = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    patterns = ["*.py", "*.sh", "Dockerfile", "*.yml", "*.toml"]
    files = subprocess.run([*listed, *patterns], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    found = [hit for f in files if (ROOT / f).is_file() for hit in outside_citations(f, (ROOT / f).read_text())]
    assert not found, "comments citing what is not in the repository:\n" + "\n".join(found)
    issue = "issue"  # (spelled apart so this file does not cite one itself)
    planted = ["# see " + "shared/" + "reference/x.md", f"# retried ({issue} 16)", "# SP issues 7 more ops"]
    expected = [f"x.py:{n}: {line}" for n, line in enumerate(planted[:2], 1)]
    assert outside_citations("x.py", "\n".join(planted)) == expected


def test_every_shell_block_of_the_docs_is_run_or_listed_with_a_reason() -> None:
    """tests/support/docstack.py's lists: each block of README.md and docs/*.md is run on the live stack
    (tests/test_doc_stack.py), run by another test, or skipped with its reason; no list names a block
    that is gone."""
    from tests.support.docstack import check_lists, shell_blocks

    check_lists(shell_blocks())


def test_a_shell_block_on_no_list_fails_the_check() -> None:
    from tests.support.docstack import Block, check_lists, shell_blocks

    planted = Block("docs/operations.md", 1, "console", "$ ltx-worker --group cpu:4   # a new recipe\n")
    with pytest.raises(AssertionError, match="no list names"):
        check_lists([*shell_blocks(), planted])
    with pytest.raises(AssertionError, match="no longer have"):
        check_lists([b for b in shell_blocks() if b.page != "docs/kernels.md"])
