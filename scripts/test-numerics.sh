#!/usr/bin/env bash
# Run the numerics-sensitive tests (`-m numerics`) the way other machines would compute them, so that a
# tolerance tuned to this CPU fails here first instead of on a newcomer's machine. Extra arguments go to
# pytest. Settings (each a full run of the 35 marked tests: 78-101 s on 2 shared cores, measured 2026-12-01):
#   default: ATEN_CPU_CAPABILITY=default + MKL_CBWR=COMPATIBLE + ONEDNN_MAX_CPU_ISA=SSE41: ATen's scalar
#       kernels, MKL's oldest GEMM path and oneDNN's oldest, i.e. a summation order unlike any vector unit's;
#   avx2: ATEN_CPU_CAPABILITY=avx2 + MKL_CBWR=AVX2 + ONEDNN_MAX_CPU_ISA=AVX2: what a CPU without AVX-512
#       runs in all three libraries;
# each at OMP_NUM_THREADS=1 and 2 (MKL and oneDNN choose their blocking, and so their summation order,
# from the thread count). Fleets and LocalWorld ranks honour OMP_NUM_THREADS.
# ATEN_CPU_CAPABILITY alone moves neither MKL nor oneDNN: both dispatch on the CPU itself (MKL: AVX-512
# kernels on Intel, AVX2 ones on AMD; oneDNN: its AVX-512 BF16 matmul on this AMD EPYC under
# ATEN_CPU_CAPABILITY=default, seen with ONEDNN_VERBOSE=1). Capped below AVX-512 BF16, oneDNN is no longer
# used for bf16 matmuls at all and torch takes its own bf16 GEMM, as it does on a CPU without it.
# LTX_NUMERICS_SETTINGS="cap:threads ..." picks other settings (e.g. "avx512:2": nothing capped).
# LTX_NUMERICS_SIDE_BY_SIDE=1 starts every setting at once (each its own pytest, its output printed whole once
# it ends, in the order given): one pytest leaves cores idle (the Triton-interpreter test is one Python thread,
# and fleets wait on their ranks' start), and no setting's floats depend on what else runs. .ci/run uses it:
# "default:1 avx2:2" side by side took 369 s, each setting 343-362 s of it (45 marked tests, 2 cores shared
# with other work at load 3-12, measured 2026-12-04).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON_BIN:-.venv/bin/python}
SETTINGS=${LTX_NUMERICS_SETTINGS:-"default:1 default:2 avx2:1 avx2:2"}
SIDE_BY_SIDE=${LTX_NUMERICS_SIDE_BY_SIDE:-0}
failed=()
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
run_setting() {  # run_setting CAP THREADS [pytest args]: one setting's pytest; its exit code
  local cap=$1 threads=$2 cbwr isa timeout
  shift 2
  case "$cap" in
    default) cbwr=COMPATIBLE isa=SSE41 ;;
    avx2) cbwr=AVX2 isa=AVX2 ;;
    *) cbwr=AUTO isa=ALL ;;
  esac
  echo "== ATEN_CPU_CAPABILITY=$cap MKL_CBWR=$cbwr ONEDNN_MAX_CPU_ISA=$isa OMP_NUM_THREADS=$threads"
  # More threads than cores (worlds of 3 and 4 ranks at 2 threads each, settings side by side): OpenMP threads
  # that spin at every collective turn that into minutes, so they wait passively, and the per-test limit grows
  # with the oversubscription. Neither changes a single float.
  timeout=$((300 * threads * sharing))
  ATEN_CPU_CAPABILITY=$cap MKL_CBWR=$cbwr ONEDNN_MAX_CPU_ISA=$isa OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads OMP_WAIT_POLICY=PASSIVE \
    "$PY" -m pytest -q -p no:cacheprovider -m numerics -o timeout=$timeout "$@"
}
sharing=1  # settings that share the cores
[ "$SIDE_BY_SIDE" = 1 ] && sharing=$(echo "$SETTINGS" | wc -w)
settings=()
pids=()
for setting in $SETTINGS; do
  settings+=("$setting")
  if [ "$SIDE_BY_SIDE" = 1 ]; then
    run_setting "${setting%%:*}" "${setting##*:}" "$@" >"$logs/${#settings[@]}.log" 2>&1 &
    pids+=($!)
  else
    run_setting "${setting%%:*}" "${setting##*:}" "$@"
    rc=$?
    [ "$rc" -ne 0 ] && failed+=("$setting (pytest exit $rc)")
  fi
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"
  rc=$?
  cat "$logs/$((i + 1)).log"
  [ "$rc" -ne 0 ] && failed+=("${settings[$i]} (pytest exit $rc)")
done
if [ "${#failed[@]}" -ne 0 ]; then
  echo "numerics tests failed under: ${failed[*]}" >&2
  exit 1
fi
