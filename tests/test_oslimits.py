"""`ltx_mgpu.os_limits`: a process whose soft open-files limit is low (an ordinary user's 1,024, here 256) gets
it raised to what its hard limit allows before a fleet starts, never lowered, and its children inherit it."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import resource, subprocess, sys
from ltx_mgpu.os_limits import raise_open_files_limit, WANTED_OPEN_FILES
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
assert soft == 256, soft
got = raise_open_files_limit()
want = WANTED_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, WANTED_OPEN_FILES)
assert got == want == resource.getrlimit(resource.RLIMIT_NOFILE)[0], (got, want)
assert raise_open_files_limit(wanted=300) == want  # never lowered
probe = "import resource; print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
inherited = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
assert int(inherited) == want, inherited
print("ok")
"""


def test_a_low_soft_limit_is_raised_to_the_hard_one_and_inherited() -> None:
    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    done = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, preexec_fn=low, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
