#!/usr/bin/env bash
# Build the CPU image (`make image`): with docker where a docker engine answers, else with
# podman. With podman:
#   - the base image is pulled when a registry serves it, else a stand-in is made from
#     Debian's packages (scripts/make-base-images.sh);
#   - the build's pip uses this host's pip setup: one configuration file written from
#     `pip config list` (scripts/host-pip-config.py) at /etc/pip.conf, and the paths it
#     names (CA bundle, local index and wheel directories), all mounted read-only;
#     the torch index is this host's package index;
#   - the Docker format keeps the HEALTHCHECK.
# Extra arguments go to the build (e.g. --build-arg BAKE_MODEL=true -t specserve:0.1.0-model).
#
# usage: scripts/build-image.sh [TAG] [BUILD ARGUMENTS...]    (ENGINE=podman forces podman)
set -euo pipefail
cd "$(dirname "$0")/.."

TAG=${1:-specserve:0.1.0}
shift || true
PYTHON_IMAGE=${PYTHON_IMAGE:-python:3.11-slim-bookworm}
PYTHON=${PYTHON:-python3}

if [ -z "${ENGINE:-}" ]; then
    if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
        ENGINE=docker
    elif command -v podman >/dev/null 2>&1; then
        ENGINE=podman
    else
        echo "error: neither a docker engine nor podman is here (make system-deps installs" \
             "podman as root)" >&2
        exit 1
    fi
fi

if [ "$ENGINE" = docker ]; then
    exec docker build -t "$TAG" "$@" .
fi

if ! podman image exists "$PYTHON_IMAGE"; then
    if ! timeout 120 podman pull -q "docker.io/library/$PYTHON_IMAGE" >/dev/null 2>&1; then
        echo "$PYTHON_IMAGE cannot be pulled; making a stand-in from Debian's packages" >&2
        PYTHON_IMAGE=$PYTHON_IMAGE scripts/make-base-images.sh python
    fi
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mapfile -t paths < <("$PYTHON" scripts/host-pip-config.py "$work/pip.conf")
volumes=(-v "$work/pip.conf:/etc/pip.conf:ro")
for path in "${paths[@]}"; do
    volumes+=(-v "$path:$path:ro")
done
# the torch wheels come from wherever this host's pip finds them
index=$("$PYTHON" -m pip config get global.index-url 2>/dev/null || true)
index=${PIP_INDEX_URL:-${index:-https://pypi.org/simple}}

podman build --format docker --layers -t "$TAG" \
    --build-arg "PYTHON_IMAGE=$PYTHON_IMAGE" \
    --build-arg "TORCH_INDEX_URL=$index" \
    "${volumes[@]}" "$@" .
