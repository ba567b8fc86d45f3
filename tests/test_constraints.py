"""Installs repeat: every dependency that scripts/setup.sh installs is pinned to one exact version in
constraints.txt (the versions the suite last passed with), and setup installs through it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    """The normalised project name of a requirement string (PEP 503: case and `-_.` runs do not matter)."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins() -> dict[str, str]:
    pins = {}
    for raw in (ROOT / "constraints.txt").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version and not any(c in version for c in "<>=!~*"), f"not an exact pin: {raw!r}"
            pins[_name(name)] = version
    return pins


def test_every_dependency_is_pinned_exactly() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    wanted += re.findall(r'"([A-Za-z][A-Za-z0-9_.-]*)==', setup)  # torch, ltx-core: installed by setup itself
    pins = _pins()
    missing = sorted({_name(r) for r in wanted} - set(pins))
    assert missing == [], f"pin these in constraints.txt (from .venv/bin/pip freeze): {missing}"
    for name, version in re.findall(r'"([A-Za-z][A-Za-z0-9_.-]*)==([^"]+)"', setup):
        assert pins[_name(name)] == version, f"setup.sh pins {name}=={version}, constraints.txt {pins[_name(name)]}"


def test_setup_installs_through_the_constraints() -> None:
    installs = [line for line in (ROOT / "scripts" / "setup.sh").read_text().splitlines() if "pip install" in line]
    assert installs and all("-c constraints.txt" in line for line in installs), installs
