#!/usr/bin/env bash
# Run the numerics-sensitive tests (`-m numerics`) the way other machines would compute them, so that a
# tolerance tuned to this CPU fails here first instead of on a newcomer's machine. Extra arguments go to
# pytest. Settings (each a full run of the 35 marked tests: ~3 min on 2 cores, 5-9 min when shared and loaded):
#   ATEN_CPU_CAPABILITY=default + MKL_CBWR=COMPATIBLE: ATen's scalar kernels and MKL's oldest GEMM path,
#       i.e. a summation order unlike any vector unit's;
#   ATEN_CPU_CAPABILITY=avx2: ATen's AVX2 kernels (what a CPU without AVX-512 runs);
# each at OMP_NUM_THREADS=1 and 2 (MKL and oneDNN choose their blocking, and so their summation order,
# from the thread count). Fleets and LocalWorld ranks honour OMP_NUM_THREADS.
# ATEN_CPU_CAPABILITY alone does not move MKL: MKL dispatches on the CPU itself (AVX-512 kernels on Intel,
# AVX2 ones on this AMD machine), which is why MKL_CBWR is part of the first setting.
# LTX_NUMERICS_SETTINGS="cap:threads ..." picks other settings (e.g. "avx512:2").
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON_BIN:-.venv/bin/python}
SETTINGS=${LTX_NUMERICS_SETTINGS:-"default:1 default:2 avx2:1 avx2:2"}
failed=()
for setting in $SETTINGS; do
  cap=${setting%%:*}
  threads=${setting##*:}
  cbwr=AUTO
  [ "$cap" = default ] && cbwr=COMPATIBLE
  echo "== ATEN_CPU_CAPABILITY=$cap MKL_CBWR=$cbwr OMP_NUM_THREADS=$threads"
  # More threads than cores (worlds of 3 and 4 ranks at 2 threads each): OpenMP threads that spin at every
  # collective turn that into minutes, so they wait passively, and the per-test limit grows with the
  # oversubscription. Neither changes a single float.
  timeout=$((300 * threads))
  ATEN_CPU_CAPABILITY=$cap MKL_CBWR=$cbwr OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads OMP_WAIT_POLICY=PASSIVE \
    "$PY" -m pytest -q -p no:cacheprovider -m numerics -o timeout=$timeout "$@"
  rc=$?
  if [ "$rc" -ne 0 ]; then
    failed+=("$setting (pytest exit $rc)")
  fi
done
if [ "${#failed[@]}" -ne 0 ]; then
  echo "numerics tests failed under: ${failed[*]}" >&2
  exit 1
fi
