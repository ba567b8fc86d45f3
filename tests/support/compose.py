"""docker-compose.yml and the Dockerfile as the tests read them (no Docker): the parsed compose file, its
services, and the text of one Dockerfile stage. tests/test_compose.py checks them; the dashboard test starts
the dashboard the way its service and stage say."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()
SERVICES = COMPOSE["services"]


def stages() -> set[str]:
    """The Dockerfile's named stages."""
    return set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", DOCKERFILE, re.M | re.I))


def stage_text(name: str, dockerfile: str = DOCKERFILE) -> str:
    """The Dockerfile's lines of stage `name` (after its FROM, up to the next)."""
    match = re.search(rf"^FROM\s+\S+\s+AS\s+{name}\b(.*?)(?=^FROM\s|\Z)", dockerfile, re.M | re.S | re.I)
    assert match, f"no stage {name}"
    return match.group(1)


def image_files(name: str, root: Path = ROOT, dockerfile: str = DOCKERFILE) -> dict[str, tuple[str, Path]]:
    """{path in the image's working directory: (the COPY source that puts it there, the checkout's file)} for
    stage `name`'s `COPY` lines (not `--from`), as Docker copies: a folder's files go below the destination,
    files named together go into a destination folder (`dest/`), one file becomes the destination."""
    found: dict[str, tuple[str, Path]] = {}
    for line in re.findall(r"^COPY\s+(?!--from)(.+)$", stage_text(name, dockerfile), re.M):
        *sources, dest = line.split()
        base = dest.removeprefix("./").rstrip("/")
        for source in sources:
            src = root / source
            if src.is_dir():
                files = [f for f in sorted(src.rglob("*")) if f.is_file() and "__pycache__" not in f.parts]
                found.update({f"{base}/{f.relative_to(src).as_posix()}": (source, f) for f in files})
            else:
                found[f"{base}/{src.name}" if dest.endswith("/") else base] = (source, src)
    return found
