#!/usr/bin/env bash
# Start a fresh clone the way docs/operations.md's no-Docker recipe says, N times in a row, and report each
# start: ready or not, any bucket error, seconds to ready. Each start has a fresh SeaweedFS data folder, a
# fresh Redis, new keys (scripts/secrets.sh) and two CPU groups creating the bucket (LTX_S3_CREATE_BUCKET=true,
# as the recipe sets it): the two workers race for CreateBucket on every start.
#
#   bash scripts/fresh_starts.sh 10                     # the committed HEAD of this checkout
#   PYTHON=/path/to/python REV=<commit> bash scripts/fresh_starts.sh 3
#
# The recipe is read from the page itself and run by `python -m tests.support.docstack` (what
# tests/test_doc_stack.py runs once): system folders and fixed ports are replaced, GPU groups become
# `cpu:1` with the smoke model. Exit status: 0 if every start was ready with no bucket error. Each start's
# clone and stack live in a fresh folder under TMPDIR (default /tmp), removed at the end.
set -euo pipefail
n=${1:-10}
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
rev=$(git -C "$root" rev-parse "${REV:-HEAD}")
base=$(mktemp -d "${TMPDIR:-/tmp}/ltx-fresh-XXXXXX")  # (clones and stacks: under TMPDIR when it is set)
trap 'rm -rf "$base"' EXIT
echo "fresh starts of $rev (docs/operations.md, two CPU groups), $n in a row"
results=$base/results.jsonl
: > "$results"
for i in $(seq "$n"); do
    clone=$base/clone
    git clone -q --no-checkout "$root" "$clone"
    git -C "$clone" checkout -q "$rev"
    line=$(cd "$clone" && PYTHONPATH="$clone" "$python" -m tests.support.docstack "$base/stack-$i") || true
    [ -n "$line" ] || line='{"ready": false, "seconds": null, "bucket_error": null, "exit_code": null, "detail": "no report"}'
    printf '%s\n' "$line" >> "$results"
    "$python" - "$i" "$line" << 'EOF'
import json, sys
r = json.loads(sys.argv[2])
state = "ready" if r["ready"] else f"NOT ready (exit {r['exit_code']}): {r['detail'][-300:]!r}"
print(f"start {sys.argv[1]}: {state}, {r['seconds']} s, bucket error: {r['bucket_error'] or 'none'}")
EOF
    rm -rf "$clone" "$base/stack-$i"
done
"$python" - "$results" << 'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
ready = [r for r in rows if r["ready"]]
bucket = [r for r in rows if r["bucket_error"]]
times = sorted(r["seconds"] for r in ready)
median = f"{statistics.median(times):.1f}" if times else "-"
span = f"{times[0]:.1f}-{times[-1]:.1f}" if times else "-"
print(f"{len(ready)}/{len(rows)} ready, {len(bucket)} bucket errors, seconds to ready: median {median} (range {span})")
sys.exit(0 if len(ready) == len(rows) and not bucket else 1)
EOF
