# syntax=docker/dockerfile:1
# Images of the ltx-mgpu service (used by docker-compose.yml):
#
#   target `worker`    CUDA torch + ltx-core + this project (+ the CUDA-IPC all2all kernel): `ltx-worker`
#   target `producer`  the light client only (producer/ + ltx_contract/, the client contract): `producer`
#   target `dashboard` rq-dashboard, pinned to a release that works with rq 2.x
#
# The worker needs the NVIDIA Container Toolkit on the host (compose reserves the GPUs). Versions are build
# arguments so a deployment can pin what its driver supports.

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ==== worker ===========================================================================================
FROM ${CUDA_IMAGE} AS worker
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG LTX_CORE_VERSION=1.0.0
ARG BUILD_KERNELS=1
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    # Multi-GPU hygiene for H100/H200 hosts (ltx_mgpu/control/devices.py MULTICAST_OFF_ENV): NVLink multicast off.
    NCCL_NVLS_ENABLE=0 \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev ffmpeg ca-certificates cmake \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
# torch pinned and taken from the CUDA index: an unpinned install picks whatever the resolver likes.
RUN pip install "torch==${TORCH_VERSION}" numpy --index-url "${TORCH_INDEX_URL}" --extra-index-url https://pypi.org/simple
# ltx-core declares torchaudio; the worker does not need it (no audio decode), so install it without deps.
RUN pip install --no-deps "ltx-core==${LTX_CORE_VERSION}"
WORKDIR /app
COPY pyproject.toml README.md ./
COPY ltx_mgpu ./ltx_mgpu
COPY ltx_contract ./ltx_contract
COPY worker ./worker
COPY producer ./producer
RUN pip install .
# The CUDA-IPC all2all kernel (optional: without it the `dist` all2all backend is used).
COPY kernels ./kernels
RUN if [ "${BUILD_KERNELS}" = "1" ]; then pip install ./kernels; fi
COPY examples ./examples
RUN useradd --create-home --uid 1000 ltx && mkdir -p /spool /models && chown ltx /spool /models
USER ltx
ENV LTX_SPOOL_DIR=/spool \
    LTX_MGPU_CACHE=/models/ltx-mgpu-cache
EXPOSE 9400 9401
# The supervisor: one worker process per group in LTX_GROUPS; SIGTERM = warm stop, a second = cold stop.
ENTRYPOINT ["ltx-worker"]

# ==== producer =========================================================================================
FROM ${PYTHON_IMAGE} AS producer
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 PYTHONPATH=/app
# Exactly what the producer imports: the client contract (ltx_contract/: nothing of worker/, no torch) and of
# ltx_mgpu only its stdlib-only request specs (ltx_mgpu/spec/: bounds, request rules, image sizes, the memory
# plan), shared with the runners. tests/test_compose.py builds this file list and checks every module the
# producer imports is in it; tests/test_import_contracts.py holds the packages to it.
RUN pip install "pydantic>=2.7" "pydantic-settings>=2.3" "redis>=5" "rq>=2.12,<2.13" "boto3>=1.36" "click>=8" "rich>=13"
WORKDIR /app
COPY producer ./producer
COPY ltx_contract ./ltx_contract
COPY ltx_mgpu/__init__.py ltx_mgpu/errors.py ./ltx_mgpu/
COPY ltx_mgpu/spec ./ltx_mgpu/spec
COPY examples ./examples
RUN useradd --create-home --uid 1000 ltx
USER ltx
ENTRYPOINT ["python", "-m", "producer"]
CMD ["--help"]

# ==== dashboard ========================================================================================
FROM ${PYTHON_IMAGE} AS dashboard
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
# 0.9.0 was checked against rq 2.12 (tests/test_dashboard.py: its pages on our JSON jobs); rq pinned to 2.12
# like the service. It imports `six` without declaring it: without six it stops at start.
RUN pip install "rq-dashboard==0.9.0" "six==1.17.0" "rq>=2.12,<2.13"
RUN useradd --create-home --uid 1000 ltx
USER ltx
EXPOSE 9181
ENTRYPOINT ["rq-dashboard"]
