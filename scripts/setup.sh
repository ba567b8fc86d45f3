#!/usr/bin/env bash
# Create .venv with everything the project, its tests and its demo need (CPU machine).
# Idempotent: re-running only installs what is missing. See docs/operations.md for why each pin exists.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip with two kinds of noise filtered from its stderr, everything else (real errors) kept, and its exit
# status kept (pipefail): "WARNING: Location '...' is ignored" (a pip config pointing at local index folders
# that this machine lacks: one line per folder and package, 80+ per setup), and the resolver's complaint that
# ltx-core's torchaudio is not installed, which is on purpose (see below): said once, in one line.
pip() {
  command pip "$@" 2> >(awk '
    /^WARNING: Location .* is ignored/ { next }
    /^ERROR: pip.s dependency resolver does not currently take into account/ { held = $0; next }
    held != "" && /requires torchaudio/ { note = 1; held = ""; next }
    held != "" { print held > "/dev/stderr"; held = "" }
    { print > "/dev/stderr" }
    END { if (held != "") print held > "/dev/stderr"; if (note) print "setup: ltx-core declares torchaudio, left out on purpose (CPU torch; see scripts/setup.sh)" > "/dev/stderr" }
  ')
}
# Every install goes through constraints.txt: the exact versions the suite last passed with (see its header
# for how to upgrade), so a fresh machine gets what CI tested, not whatever was released since.
# torch pinned: the CPU wheel for 2.13.0 is served locally; anything unpinned pulls a multi-GB CUDA build.
pip install -q -c constraints.txt "torch==2.13.0" numpy
# ltx-core declares torchaudio, whose CUDA build breaks imports next to CPU torch: install without deps.
pip install -q -c constraints.txt --no-deps "ltx-core==1.0.0"
pip install -q -c constraints.txt -e ".[dev]"
# The CUDA-IPC all2all extension (kernels/) compiles with nvcc even without a GPU; skip where nvcc is absent
# (the kernel tests then skip and say why). A rebuild with an existing build folder takes ~2 s.
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  pip install -q -c constraints.txt --no-build-isolation --no-deps ./kernels
fi
