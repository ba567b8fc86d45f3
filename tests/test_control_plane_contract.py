"""The engine's control plane (`ltx_mgpu/control/`: controller, stream, processes, fleet and its rank faults,
runner contract, transport, job board, devices, errors, events, startup) names nothing of the data plane
(`ltx_mgpu.parallel`) or of the model runners (`ltx_mgpu.runners`): not at import time, not in a function body, not
under `TYPE_CHECKING`.

Why by reading the source (AST) rather than importing: `tests/test_import_contracts.py` sees what an import
pulls in, which misses a lazy import inside a function (the runner contract used to build the data plane's
`LayoutGroups` that way, and its type annotation dragged all of `ltx_mgpu.parallel`, seconds of imports,
into every reader of the contract). A lazy import is still a dependency: the control plane is meant to be
usable, and testable, with any runner and without the parallel package.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.imports import imported_modules

ROOT = Path(__file__).resolve().parent.parent
CONTROL = ROOT / "ltx_mgpu" / "control"
FORBIDDEN = ("ltx_mgpu.parallel", "ltx_mgpu.runners")


def violations(source: str, module: str) -> list[str]:
    return sorted(m for m in imported_modules(source, module) for f in FORBIDDEN if m == f or m.startswith(f + "."))


def control_modules() -> list[str]:
    return sorted(p.stem for p in CONTROL.glob("*.py"))


def test_the_control_folder_holds_the_control_plane() -> None:
    expected = {"controller", "stream", "processes", "fleet", "runner", "transport", "job_board", "startup"}
    assert expected <= set(control_modules())


@pytest.mark.parametrize("name", control_modules())
def test_control_plane_module_names_no_data_plane(name: str) -> None:
    # (`ltx_mgpu.control.__init__` resolves relative imports against `ltx_mgpu.control`, as Python does)
    assert violations((CONTROL / f"{name}.py").read_text(), f"ltx_mgpu.control.{name}") == []


@pytest.mark.parametrize(
    "planted",
    [
        "from ..parallel.layouts.layout import LayoutGroups",  # relative, at the top
        "def f():\n    from ..parallel import AttentionRouter\n",  # lazy, inside a function
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import ltx_mgpu.runners.common.args\n",
        "from .. import parallel",  # the package itself, through `from .. import`
    ],
)
def test_the_check_finds_a_planted_import(planted: str) -> None:
    """So the check above cannot pass by finding nothing."""
    assert violations(planted, "ltx_mgpu.control.runner"), planted


def test_an_innocent_import_is_not_a_violation() -> None:
    innocent = "from .errors import RunnerCancelled\nfrom ..ports import free_port\nimport torch.distributed as dist\n"
    assert violations(innocent, "ltx_mgpu.control.runner") == []
