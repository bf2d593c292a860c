"""Podman for the image checks: the command, a server container, waiting on HTTP.

Everything published goes to a loopback port the kernel picks; a container on a podman
network is reached only by other containers there, or from this host at its bridge
address (nothing listens outside the host).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import require_program
from tests.deploy.conftest import REPO

IMAGE = "specserve:0.1.0"
REDIS_IMAGE = "redis:7.4-alpine"
PREFIX = "specserve-test"
FIRST_START_S = 900  # a first start pulls and converts the default model on a busy machine


def podman(*args: str, check: bool = True, timeout: float = 300,
           input: str | None = None) -> subprocess.CompletedProcess[str]:
    binary = require_program("podman", "podman")
    result = subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout,
                            input=input)
    if check and result.returncode != 0:
        pytest.fail(f"podman {' '.join(args)} failed ({result.returncode}):\n"
                    f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}", pytrace=False)
    return result


def unique(what: str) -> str:
    return f"{PREFIX}-{what}-{uuid.uuid4().hex[:6]}"


def build_image() -> None:
    """`make image`'s script with podman (cached layers make a second build quick)."""
    result = subprocess.run([str(REPO / "scripts" / "build-image.sh"), IMAGE],
                            env=_env(ENGINE="podman", PYTHON=sys.executable),
                            capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        pytest.fail(f"the image build failed:\n{result.stdout[-5000:]}\n{result.stderr[-5000:]}",
                    pytrace=False)


def make_redis_image() -> None:
    """The Redis stand-in from Debian's packages (kept when present)."""
    result = subprocess.run([str(REPO / "scripts" / "make-base-images.sh"), "redis"],
                            env=_env(), capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        pytest.fail(f"the Redis stand-in failed:\n{result.stderr[-5000:]}", pytrace=False)


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}


def pip_passthrough(directory: Path) -> list[tuple[str, str]]:
    """(host path, container path) pairs that give a container this host's pip setup:
    the model is pulled through pip, like the build's dependencies."""
    conf = directory / "pip.conf"
    listing = subprocess.run([sys.executable, str(REPO / "scripts" / "host-pip-config.py"),
                              str(conf)], capture_output=True, text=True, check=True).stdout
    return [(str(conf), "/etc/pip.conf"), *((p, p) for p in listing.split())]


def inspect(name: str) -> dict[str, Any]:
    return json.loads(podman("inspect", name).stdout)[0]


def published(name: str, port: int) -> str:
    """http://127.0.0.1:PORT of a container's published port."""
    line = podman("port", name, str(port)).stdout.split()[0]
    return f"http://{line}"


def logs(name: str) -> str:
    result = podman("logs", "--tail", "60", name, check=False)
    return (result.stdout + result.stderr)[-6000:]


def remove(*names: str) -> None:
    for name in names:
        podman("rm", "-f", "-t", "5", name, check=False, timeout=120)


@dataclass
class Server:
    name: str
    url: str  # the API
    metrics_url: str


def run_server(name: str, *, home: str, mounts: list[tuple[str, str]],
               env: dict[str, str] | None = None, network: str | None = None,
               options: list[str] | None = None) -> Server:
    """A detached server container on loopback ports; returns when it runs (not ready)."""
    args = ["run", "-d", "--name", name, "-p", "127.0.0.1::8000", "-p", "127.0.0.1::9100",
            "-v", f"{home}:/var/lib/specserve"]
    for host, inside in mounts:
        args += ["-v", f"{host}:{inside}:ro"]
    for key, value in (env or {}).items():
        args += ["-e", f"{key}={value}"]
    if network:
        args += ["--network", network]
    podman(*args, *(options or []), IMAGE)
    return Server(name, published(name, 8000), published(name, 9100))


def wait_ready(server: Server, timeout: float = FIRST_START_S) -> list[tuple[int, int]]:
    """Poll /health and /ready until /ready answers 200; returns the (health, ready)
    statuses seen once the port answered."""
    return wait_url_ready(server.url, server.name, timeout)


def wait_url_ready(url: str, container: str, timeout: float = FIRST_START_S
                   ) -> list[tuple[int, int]]:
    seen: list[tuple[int, int]] = []
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, timeout=5) as client:
        while time.monotonic() < deadline:
            try:
                health = client.get("/health").status_code
                ready = client.get("/ready").status_code
            except httpx.HTTPError:
                state = inspect(container)["State"]
                if not state["Running"]:
                    pytest.fail(f"{container} exited ({state['ExitCode']}):\n{logs(container)}",
                                pytrace=False)
                time.sleep(1)
                continue
            seen.append((health, ready))
            if ready == 200:
                return seen
            time.sleep(0.2)
    pytest.fail(f"{container} not ready in {timeout:.0f} s:\n{logs(container)}", pytrace=False)
