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


def stage_text(name: str) -> str:
    """The Dockerfile's lines of stage `name` (after its FROM, up to the next)."""
    match = re.search(rf"^FROM\s+\S+\s+AS\s+{name}\b(.*?)(?=^FROM\s|\Z)", DOCKERFILE, re.M | re.S | re.I)
    assert match, f"no stage {name}"
    return match.group(1)
