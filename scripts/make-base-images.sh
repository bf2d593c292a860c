#!/usr/bin/env bash
# Stand-ins for the images the image build and the local stack start from, made from
# Debian's packages where no container registry can be reached:
#   python:3.11-slim-bookworm  Debian bookworm (minbase) with python3 3.11, venv, pip and
#                              the C headers (native extensions build against them);
#                              `python` and `pip` on PATH, as in the official image
#   redis:7.4-alpine           Debian bookworm with redis-server and redis-cli
# Each is made with debootstrap from the Debian mirror apt's sources already name, and
# imported with `podman import`. An image that exists already is left alone (FORCE=1
# remakes it). Runs as root (debootstrap needs it).
#
# usage: scripts/make-base-images.sh [python|redis]...     (default: both)
set -euo pipefail

PYTHON_IMAGE=${PYTHON_IMAGE:-python:3.11-slim-bookworm}
REDIS_IMAGE=${REDIS_IMAGE:-redis:7.4-alpine}
SUITE=bookworm
ENGINE=${ENGINE:-podman}

# The first Debian mirror apt uses: deb822 sources (URIs:) or one-line sources (deb URI).
debian_mirror() {
    local file
    for file in /etc/apt/sources.list.d/*.sources; do
        [ -f "$file" ] || continue
        awk '/^URIs:/ && $2 ~ /\/debian\/?$/ { print $2; exit }' "$file"
    done
    for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$file" ] || continue
        awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i !~ /^\[/) { if ($i ~ /\/debian\/?$/) print $i; break } }' "$file"
    done
}

have_image() {
    "$ENGINE" image exists "$1" 2>/dev/null
}

# make_image NAME PACKAGES SETUP CONFIG...: debootstrap a root with PACKAGES, run the
# function SETUP with the root's path, import the root as NAME with the image
# configuration lines (Dockerfile instructions) CONFIG.
make_image() {
    local name=$1 packages=$2 setup=$3 mirror root line
    shift 3
    if have_image "$name" && [ "${FORCE:-0}" != 1 ]; then
        echo "$name: present" >&2
        return 0
    fi
    mirror=$(debian_mirror | head -n 1)
    if [ -z "$mirror" ]; then
        echo "error: no Debian mirror found in apt's sources" >&2
        exit 1
    fi
    root=$(mktemp -d /var/tmp/specserve-base.XXXXXX)
    # shellcheck disable=SC2064  # expand now: the trap removes this root
    trap "rm -rf '$root' '$root.log'" EXIT
    echo "$name: debootstrap $SUITE with $packages (several minutes)" >&2
    if ! debootstrap --variant=minbase --include="$packages" "$SUITE" "$root" "$mirror" \
            > "$root.log" 2>&1; then
        tail -n 20 "$root.log" >&2
        exit 1
    fi
    # slim: no apt lists, documentation or caches (apt-get update brings the lists back)
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin \
        "$root"/var/cache/apt/archives/*.deb "$root"/usr/share/doc/* \
        "$root"/usr/share/man/* "$root"/usr/share/locale/*
    "$setup" "$root"
    local change=()
    for line in "$@"; do
        change+=(--change "$line")
    done
    tar --numeric-owner -C "$root" -c . | "$ENGINE" import -q "${change[@]}" - "$name" >/dev/null
    rm -rf "$root" "$root.log"
    trap - EXIT
    echo "$name: imported" >&2
}

# Debian's python3 is bookworm's 3.11: `python` and `pip` where the official image has
# them (/usr/local/bin, first on PATH).
python_setup() {
    ln -s /usr/bin/python3 "$1/usr/local/bin/python"
    ln -s /usr/bin/pip3 "$1/usr/local/bin/pip"
}

# The official image's entry point: options alone run redis-server, and redis-server runs
# without protected mode (no configuration file: other containers connect).
redis_setup() {
    cat > "$1/usr/local/bin/docker-entrypoint.sh" <<'SH'
#!/bin/sh
set -e
case "${1:-}" in
    -*) set -- redis-server "$@" ;;
esac
if [ "${1:-}" = redis-server ]; then
    shift
    set -- redis-server --protected-mode no "$@"
fi
exec "$@"
SH
    chmod 0755 "$1/usr/local/bin/docker-entrypoint.sh"
}

make_python() {
    make_image "$PYTHON_IMAGE" python3,python3-venv,python3-pip,libpython3.11-dev,ca-certificates \
        python_setup \
        "ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin" \
        "ENV LANG=C.UTF-8" \
        'CMD ["python"]'
}

make_redis() {
    make_image "$REDIS_IMAGE" redis-server,redis-tools redis_setup \
        "USER redis" \
        "WORKDIR /var/lib/redis" \
        "EXPOSE 6379" \
        'ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]' \
        'CMD ["redis-server"]'
}

if ! command -v "$ENGINE" >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then
    echo "error: $ENGINE and debootstrap are needed (scripts/install-system-deps.sh installs" \
         "them as root)" >&2
    exit 1
fi

for what in "${@:-python redis}"; do
    for part in $what; do
        case "$part" in
            python) make_python ;;
            redis) make_redis ;;
            *) echo "usage: $0 [python|redis]..." >&2; exit 2 ;;
        esac
    done
done
