# syntax=docker/dockerfile:1.7
#
# tserve images, one file for CPU and GPU (docs/deployment.md):
#
#   docker build -t tserve:cpu .                                  # runtime (default target), CPU torch
#   docker build -t tserve:train --target train .                 # trains the default checkpoints
#   docker build -t tserve:gpu \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
#
# Stages: `build` creates /opt/venv on BASE_IMAGE (so the interpreter it links to is the runtime's);
# `runtime` copies the venv and the sources onto BASE_IMAGE; `train` copies the same venv into the
# full Debian image of the same Python, which keeps the gettext catalogs (/usr/share/locale/*/
# LC_MESSAGES/*.mo) that the slim images strip and that `python -m training prepare translation` reads.
# Base images are pinned by exact tag; to pin by digest as well, append `@sha256:...` from
# `docker buildx imagetools inspect <image:tag>`.

# The runtime base: any image with python3 >= 3.11, or a CUDA image without Python (apt installs it).
ARG BASE_IMAGE=python:3.11.7-slim-bookworm
# The train base: must carry the same Python at the same path as BASE_IMAGE (the venv is copied).
ARG TRAIN_IMAGE=python:3.11.7-bookworm

# ---- build: the virtual environment ----------------------------------------------------------------
FROM ${BASE_IMAGE} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG DEBIAN_FRONTEND=noninteractive
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# CUDA base images have no Python; Debian/Ubuntu's own python3 then backs the venv (versions follow
# the base image's release, hence unpinned).
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# The torch wheel index: cpu for the default image, cuXYZ (e.g. cu128) for the GPU image. The wheel
# is torch==2.13.0 either way (the pin in requirements.txt; +cpu / +cuXYZ are local version labels).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
COPY requirements.txt requirements-otel.txt constraints.txt /tmp/deps/
# torch alone from its index, then every other pin from PyPI (torch's own dependencies included,
# all pinned by constraints.txt), OpenTelemetry included (tracing stays off until an endpoint is set).
RUN pip install --no-cache-dir --no-deps --index-url "${TORCH_INDEX}" "$(grep -E '^torch==' /tmp/deps/requirements.txt)" \
    && pip install --no-cache-dir -r /tmp/deps/requirements.txt -r /tmp/deps/requirements-otel.txt \
       -c /tmp/deps/constraints.txt \
    && python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
# The C++ kernels (model/native.py: int8 on AVX512-VNNI, the decoding step), compiled here so that the
# runtime image needs no compiler: g++ (and Python's headers where the base image has none), then one
# build into /opt/tserve-kernels, which the runtime copies. Without them PyTorch's kernels serve.
COPY model/ /tmp/src/model/
# hadolint ignore=DL3008
RUN extra="" \
    && if [ ! -f "$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ]; then \
        extra=python3-dev; \
    fi \
    && apt-get update \
    && apt-get install -y --no-install-recommends g++ ${extra:+"$extra"} \
    && rm -rf /var/lib/apt/lists/* \
    && TSERVE_KERNEL_DIR=/opt/tserve-kernels PYTHONPATH=/tmp/src python -m model.native \
    && ls /opt/tserve-kernels/tserve_kernels_*/tserve_kernels_*.so

# ---- train: `python -m training recipe` into /checkpoints (compose profile `train`) ------------------
FROM ${TRAIN_IMAGE} AS train
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
RUN groupadd --system --gid 10001 tserve \
    && useradd --system --uid 10001 --gid tserve --home-dir /app --no-create-home --shell /usr/sbin/nologin tserve \
    && mkdir -p /app /checkpoints && chown tserve:tserve /app /checkpoints
COPY --from=build /opt/venv /opt/venv
WORKDIR /app
COPY model/ model/
COPY training/ training/
COPY scripts/ scripts/
COPY Makefile pyproject.toml ./
# Fails the build if the copied venv does not match this image's interpreter (see TRAIN_IMAGE).
RUN python -c "import torch, tokenizers, sacrebleu" \
    && find /usr/share/locale -path '*/LC_MESSAGES/*.mo' -print -quit | grep -q .
USER 10001:10001
# The recipe's whole output (models/, adapters/, runs/ with resume states, summary.json) stays on one
# volume: finished runs are renamed from runs/ into models/ and adapters/, which needs one filesystem.
VOLUME ["/checkpoints"]
CMD ["python", "-m", "training", "recipe", "quick", "--out", "/checkpoints", "--data", "/checkpoints/data"]

# ---- runtime: the API server -------------------------------------------------------------------
FROM ${BASE_IMAGE} AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && groupadd --system --gid 10001 tserve \
    && useradd --system --uid 10001 --gid tserve --home-dir /app --no-create-home --shell /usr/sbin/nologin tserve \
    && mkdir -p /models /adapters && chown tserve:tserve /adapters
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/tserve-kernels /opt/tserve-kernels
WORKDIR /app
COPY model/ model/
COPY service/ service/
# training/ too (a few hundred kB): GPU nodes run `torchrun -m training train ...` from this image.
COPY training/ training/
# Checkpoints are read-only; adapters are writable (PUT /v1/models/{model}/adapters/{name} uploads).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TSERVE_KERNEL_DIR=/opt/tserve-kernels \
    TSERVE_MODELS=/models \
    TSERVE_ADAPTERS=/adapters \
    TSERVE_HOST=0.0.0.0 \
    TSERVE_PORT=8000
VOLUME ["/models", "/adapters"]
USER 10001:10001
EXPOSE 8000
# No curl in slim images: the stdlib does the probe. /health answers as soon as the server listens;
# start-period covers model loading and warm-up.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health' % os.environ.get('TSERVE_PORT', '8000'), timeout=4)"]
CMD ["python", "-m", "service"]
