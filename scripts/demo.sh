#!/usr/bin/env bash
# Set everything up and run the main job end to end on embedded defaults: a real Redis-compatible server,
# a real S3-compatible server (SeaweedFS), a worker with two CPU fleets running the smoke model, one
# render submitted and watched through the producer, the video fetched and checked; then everything is
# torn down. No root, no Docker.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/ltx-demo "$@"
