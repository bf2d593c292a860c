#!/usr/bin/env bash
# Install the system programs the test suite runs for real, from Debian's packages:
#   redis-server           throwaway Redis servers (prefix cache over Redis)
#   prometheus, promtool   a real Prometheus scraping the metrics port; config checks
#   the linter shellcheck  for the image's entrypoint script
#   chromium, chromedriver the playground page in a headless browser
#   node, npm              the official openai npm package against a real server (tests/sdk)
#   g++                    builds the fused CPU kernels (runtime/native/csrc), which the tests run
#   podman, runc           build and run the image, the two-replica stack and the chart's pods
#   catatonit              the pause process of the pods `podman kube play` makes
#   debootstrap            stand-in base images from Debian's packages (no registry needed)
#   a DNS plugin           containers on one podman network reach each other by name (the
#                          replicas' Redis): dnsname on the CNI backend, aardvark-dns on netavark
# Idempotent and quick: when every program is on PATH it returns at once. As root with
# apt-get it installs what is missing; otherwise it fails, naming the command to run.
#
# usage: scripts/install-system-deps.sh
set -euo pipefail

# program -> the Debian package that provides it
declare -A PACKAGE=(
    [redis-server]=redis-server
    [prometheus]=prometheus
    [promtool]=prometheus
    [shellcheck]=shellcheck
    [chromium]=chromium
    [chromedriver]=chromium-driver
    [node]=nodejs
    [npm]=npm
    [g++]=g++
    [podman]=podman
    [runc]=runc
    [catatonit]=catatonit
    [debootstrap]=debootstrap
)

# podman as root on a host without systemd: runc (crun refuses some cgroup layouts),
# cgroupfs (no systemd), and no default ulimits (they may exceed the hard limit here).
# Written only where no containers.conf is, so a configured podman is left alone.
CONTAINERS_CONF=/etc/containers/containers.conf
configure_podman() {
    if [ -e "$CONTAINERS_CONF" ] || [ "$(id -u)" -ne 0 ] || ! command -v podman >/dev/null 2>&1
    then
        return 0
    fi
    mkdir -p "$(dirname "$CONTAINERS_CONF")"
    cat > "$CONTAINERS_CONF" <<'CONF'
[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
CONF
    echo "wrote $CONTAINERS_CONF (podman: runc, cgroupfs, no default ulimits)" >&2
}

missing_packages() {
    local program
    for program in "${!PACKAGE[@]}"; do
        command -v "$program" >/dev/null 2>&1 || echo "${PACKAGE[$program]}"
    done | sort -u
}

# podman resolves container names on a network only through its backend's DNS plugin
dns_plugin_package() {
    command -v podman >/dev/null 2>&1 || return 0
    case "$(podman info --format '{{.Host.NetworkBackend}}' 2>/dev/null)" in
        netavark)
            [ -x /usr/lib/podman/aardvark-dns ] || echo aardvark-dns ;;
        *)  # cni, podman 4's default where netavark is not installed
            [ -x /usr/lib/cni/dnsname ] || echo golang-github-containernetworking-plugin-dnsname ;;
    esac
}

mapfile -t missing < <(missing_packages; dns_plugin_package)
if [ "${#missing[@]}" -eq 0 ]; then
    configure_podman
    exit 0
fi

how="apt-get install -y --no-install-recommends ${missing[*]}"
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "error: the tests need ${missing[*]}, which are not installed, and this script can" \
         "only install them as root on a Debian-based system. Install them (as root: $how)," \
         "or put the programs on PATH, then run make test again." >&2
    exit 1
fi

# apt-get install, quietly, once the package lists are fresh
apt_install() {
    apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "$@" >/dev/null
}

# fail, naming what $2 (a command) still finds missing after apt-get ran
check_installed() {
    local what=$1 left
    left=$($2 | xargs)
    if [ -n "$left" ]; then
        echo "error: apt-get ran but $left still provide no $what" >&2
        exit 1
    fi
}

echo "installing ${missing[*]} (apt-get)" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get -o DPkg::Lock::Timeout=300 update -qq
apt_install "${missing[@]}"
check_installed "program on PATH" missing_packages
# podman itself may have come in just now: its backend's DNS plugin is known only then
mapfile -t dns < <(dns_plugin_package)
if [ "${#dns[@]}" -gt 0 ]; then
    echo "installing ${dns[*]} (apt-get): container names on podman networks" >&2
    apt_install "${dns[@]}"
fi
check_installed "DNS plugin for podman" dns_plugin_package
configure_podman
