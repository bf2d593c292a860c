# syntax=docker/dockerfile:1
#
# specserve images.
#   CPU (default target):  docker build -t specserve:0.1.0 .
#   NVIDIA GPU flavour:    docker build --target gpu -t specserve:0.1.0-gpu .
#   Default model baked:   docker build --build-arg BAKE_MODEL=true -t specserve:0.1.0-model .
#
# Without BAKE_MODEL the image holds no model: the entry point pulls the default
# model into $SPECSERVE_HOME (a volume) on first start, or an init container does
# (see the Helm chart). Dependencies are installed from pyproject.toml before the
# source is copied, so a source change rebuilds only the small layers at the end.
# The wheel crosses stages with COPY --from, not a bind mount of the stage: an
# interrupted build can leave a cached stage that podman can no longer mount.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04

# ---------------------------------------------------------------------------
# The project as a wheel (pure Python; the same wheel goes into both flavours).
FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY decoding ./decoding
COPY drafters ./drafters
COPY runtime ./runtime
COPY wiring ./wiring
COPY grammars ./grammars
COPY trt ./trt
COPY observability ./observability
COPY specserve ./specserve
COPY specbench ./specbench
COPY specdistill ./specdistill
RUN pip wheel --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------------------
# CPU dependencies: CPU-only PyTorch first, then everything pyproject.toml lists.
FROM ${PYTHON_IMAGE} AS cpu-deps
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Optional extras of the project to include (onnx adds the ONNX Runtime draft backend).
ARG EXTRAS=otlp
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
WORKDIR /src
RUN python -m venv /opt/venv \
    && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
COPY pyproject.toml deploy/pyproject_requirements.py ./
RUN python pyproject_requirements.py pyproject.toml "${EXTRAS}" > requirements.txt \
    && pip install -r requirements.txt

# ---------------------------------------------------------------------------
# The fused CPU kernels (runtime/native/csrc), built here with g++ so the slim runtime needs no
# compiler: once per instruction-set level (default, avx2, avx512, avx512_vnni), so the
# one image runs on any x86-64 host with that host's best level (every level computes
# the same; SPECSERVE_CPU_CAPABILITY forces a lower one).
FROM cpu-deps AS cpu-kernels
ENV SPECSERVE_KERNELS_DIR=/opt/specserve/kernels
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-deps /tmp/wheels/specserve-*.whl \
    && rm -rf /tmp/wheels \
    && python -m runtime.native.kernels --all \
    && for level in default avx2 avx512 avx512_vnni; do \
        test -n "$(find /opt/specserve/kernels -name "specserve_kernels_${level}.so")"; \
    done

# ---------------------------------------------------------------------------
# GPU base: NVIDIA's CUDA runtime image with the distribution's Python.
FROM ${CUDA_IMAGE} AS gpu-base
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# GPU dependencies: CUDA PyTorch (the default wheels are CUDA builds), TensorRT for the
# draft engine, ONNX for its export, then everything pyproject.toml lists. TensorRT's
# PyPI packages are placeholders that fetch the real wheels from NVIDIA's index, so it
# is named here; the version must lie in pyproject's `tensorrt` extra (see docs/tensorrt.md).
FROM gpu-base AS gpu-deps
ARG TORCH_VERSION=2.13.0
ARG TENSORRT_PACKAGE=tensorrt-cu13
ARG TENSORRT_VERSION=10.13.3.9
ARG TENSORRT_INDEX_URL=https://pypi.nvidia.com
ARG EXTRAS=otlp,onnx
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
WORKDIR /src
RUN python3 -m venv /opt/venv \
    && pip install "torch==${TORCH_VERSION}" "${TENSORRT_PACKAGE}==${TENSORRT_VERSION}" \
        --extra-index-url "${TENSORRT_INDEX_URL}"
# The build fails here, not on a GPU at start-up, when TensorRT did not really install.
RUN python -c "import tensorrt; print(tensorrt.__version__)"
COPY pyproject.toml deploy/pyproject_requirements.py ./
RUN python pyproject_requirements.py pyproject.toml "${EXTRAS}" > requirements.txt \
    && pip install -r requirements.txt

# ---------------------------------------------------------------------------
# GPU runtime.
FROM gpu-base AS gpu
ARG BAKE_MODEL=false
LABEL org.opencontainers.image.title="specserve" \
      org.opencontainers.image.description="OpenAI-compatible LLM server with lossless speculative decoding (NVIDIA GPU)" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    SPECSERVE_HOME=/var/lib/specserve \
    HF_HOME=/var/lib/specserve/huggingface \
    XDG_CACHE_HOME=/tmp/.cache \
    TRITON_CACHE_DIR=/tmp/.triton \
    SPECSERVE_DRAFT_BACKEND=auto \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN groupadd --system --gid 10001 specserve \
    && useradd --system --uid 10001 --gid specserve --create-home --home-dir /home/specserve \
        --shell /usr/sbin/nologin specserve \
    && mkdir -p /var/lib/specserve /opt/specserve \
    && chown specserve:specserve /var/lib/specserve
COPY --from=gpu-deps /opt/venv /opt/venv
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-deps /tmp/wheels/specserve-*.whl \
    && rm -rf /tmp/wheels
COPY --chmod=0755 deploy/docker-entrypoint.sh /opt/specserve/docker-entrypoint.sh
COPY deploy/healthcheck.py /opt/specserve/healthcheck.py
RUN if [ "${BAKE_MODEL}" = "true" ]; then \
        SPECSERVE_HOME=/opt/specserve HF_HOME=/tmp/bake-hf specserve models pull \
        && rm -rf /tmp/bake-hf; \
    fi
USER 10001:10001
WORKDIR /home/specserve
VOLUME ["/var/lib/specserve"]
EXPOSE 8000 9100
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "/opt/specserve/healthcheck.py", "/health"]
ENTRYPOINT ["/opt/specserve/docker-entrypoint.sh"]
CMD []

# ---------------------------------------------------------------------------
# CPU runtime (the default target, so it comes last).
FROM ${PYTHON_IMAGE} AS cpu
ARG BAKE_MODEL=false
LABEL org.opencontainers.image.title="specserve" \
      org.opencontainers.image.description="OpenAI-compatible LLM server with lossless speculative decoding (CPU)" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    SPECSERVE_HOME=/var/lib/specserve \
    HF_HOME=/var/lib/specserve/huggingface \
    XDG_CACHE_HOME=/tmp/.cache \
    SPECSERVE_KERNELS_DIR=/opt/specserve/kernels
RUN groupadd --system --gid 10001 specserve \
    && useradd --system --uid 10001 --gid specserve --create-home --home-dir /home/specserve \
        --shell /usr/sbin/nologin specserve \
    && mkdir -p /var/lib/specserve /opt/specserve \
    && chown specserve:specserve /var/lib/specserve
COPY --from=cpu-deps /opt/venv /opt/venv
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-deps /tmp/wheels/specserve-*.whl \
    && rm -rf /tmp/wheels
COPY --from=cpu-kernels /opt/specserve/kernels /opt/specserve/kernels
COPY --chmod=0755 deploy/docker-entrypoint.sh /opt/specserve/docker-entrypoint.sh
COPY deploy/healthcheck.py /opt/specserve/healthcheck.py
RUN if [ "${BAKE_MODEL}" = "true" ]; then \
        SPECSERVE_HOME=/opt/specserve HF_HOME=/tmp/bake-hf specserve models pull \
        && rm -rf /tmp/bake-hf; \
    fi
USER 10001:10001
WORKDIR /home/specserve
VOLUME ["/var/lib/specserve"]
EXPOSE 8000 9100
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "/opt/specserve/healthcheck.py", "/health"]
ENTRYPOINT ["/opt/specserve/docker-entrypoint.sh"]
CMD []
