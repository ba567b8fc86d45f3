"""Process helpers from Linux /proc, for production and the development servers alike (a fleet waits for its
ranks to be gone; the dev servers and the demo leave nothing running)."""

from __future__ import annotations

import os
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """True if `pid` runs; a zombie (exited, not yet reaped by its parent) counts as gone."""
    if pid <= 0:  # kill(0) and kill(-1) address process groups, not a process
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (not Linux): kill(0) said it exists
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
