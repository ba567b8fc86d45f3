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


def test_setup_filters_pips_known_noise_and_keeps_real_errors_and_the_exit_status(tmp_path: Path) -> None:
    """Regression: setup printed 82 `WARNING: Location ... is ignored` lines (a pip config naming local index
    folders this machine lacks) and a resolver ERROR about torchaudio that is on purpose. `pip()` in
    scripts/setup.sh drops the first, says the second in one line, and passes everything else through."""
    import subprocess

    setup = (ROOT / "scripts" / "setup.sh").read_text()
    function = re.search(r"^pip\(\) \{\n.*?^\}\n", setup, re.M | re.S)
    assert function, "scripts/setup.sh defines no pip() filter"
    fake = tmp_path / "pip"
    fake.write_text(
        "#!/bin/bash\n"
        + "".join(f"echo {line!r} >&2\n" for line in (
            "WARNING: Location '/srv/wheels' is ignored: it is either a non-existing path or lacks a scheme.",
            "ERROR: pip's dependency resolver does not currently take into account all the packages that are "
            "installed. This behaviour is the source of the following dependency conflicts.",
            "ltx-core 1.0.0 requires torchaudio, which is not installed.",
            "ERROR: Could not find a version that satisfies the requirement nope",
        ))
        + "exit 3\n"
    )  # fmt: skip
    fake.chmod(0o755)
    script = f"set -euo pipefail\nPATH={tmp_path}:$PATH\n{function.group(0)}pip install x\necho unreachable\n"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 3 and "unreachable" not in out.stdout
    assert "is ignored" not in out.stderr and "dependency resolver" not in out.stderr, out.stderr
    assert "Could not find a version that satisfies the requirement nope" in out.stderr
    assert out.stderr.count("torchaudio") == 1 and "on purpose" in out.stderr
