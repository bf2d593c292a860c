"""docker-compose.yml (and its GPU override) as `docker compose config` resolves them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import require_program
from tests.deploy.conftest import INSTALL_HINT, REPO, TOOLS

PROMETHEUS_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"


def _compose_command() -> tuple[list[str], dict[str, str]]:
    """`docker compose` with the plugin from .venv/tools, else a standalone docker-compose."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECSERVE_", "COMPOSE_"))}
    plugin_dir = TOOLS / "docker"
    docker = shutil.which("docker")
    if docker and (plugin_dir / "cli-plugins" / "docker-compose").is_file():
        return [docker, "compose"], {**env, "DOCKER_CONFIG": str(plugin_dir)}
    if docker and subprocess.run([docker, "compose", "version"], env=env,
                                 capture_output=True).returncode == 0:
        return [docker, "compose"], env
    standalone = plugin_dir / "cli-plugins" / "docker-compose"
    if standalone.is_file():
        return [str(standalone)], env
    pytest.fail(f"docker compose is not available; {INSTALL_HINT}", pytrace=False)


def _config(*files: str, extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    command, env = _compose_command()
    args = [*command, "--project-directory", str(REPO)]
    for name in files:
        args += ["-f", str(REPO / name)]
    result = subprocess.run([*args, "config", "--format", "json"], env={**env, **(extra_env or {})},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _config("docker-compose.yml")


def _seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration))


def test_compose_config_is_valid_and_quiet() -> None:
    command, env = _compose_command()
    result = subprocess.run([*command, "--project-directory", str(REPO), "-f",
                             str(REPO / "docker-compose.yml"), "config", "--quiet"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_services(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {"specserve", "redis", "prometheus", "jaeger"}


def test_published_ports(compose: dict[str, Any]) -> None:
    def published(service: str) -> set[tuple[int, int]]:
        return {(int(p["published"]), p["target"]) for p in compose["services"][service]["ports"]}

    assert published("specserve") == {(8000, 8000), (9100, 9100)}
    assert (9090, 9090) in published("prometheus")
    assert (16686, 16686) in published("jaeger")
    assert "ports" not in compose["services"]["redis"]  # internal only


def test_every_service_has_a_healthcheck(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        check = service.get("healthcheck")
        assert check and check["test"][0] in ("CMD", "CMD-SHELL"), name
    specserve = compose["services"]["specserve"]["healthcheck"]
    assert specserve["test"][-1] == "/ready"
    assert _seconds(specserve["start_period"]) >= 300  # the first start pulls the model


def test_start_order(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["specserve"]["depends_on"] == {
        "redis": {"condition": "service_healthy", "required": True},
        "jaeger": {"condition": "service_healthy", "required": True},
    }
    assert services["prometheus"]["depends_on"]["specserve"]["condition"] == "service_started"


def test_specserve_is_wired_to_redis_and_jaeger(compose: dict[str, Any]) -> None:
    service = compose["services"]["specserve"]
    env = service["environment"]
    assert env["SPECSERVE_REDIS_URL"] == "redis://redis:6379/0"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
    assert env["OTEL_SERVICE_NAME"] == "specserve"
    assert compose["services"]["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    # drains before the engine kills it
    assert _seconds(service["stop_grace_period"]) > float(env["SPECSERVE_SHUTDOWN_TIMEOUT"])
    assert service["build"]["target"] == "cpu"
    assert {v["target"] for v in service["volumes"]} == {"/var/lib/specserve"}
    assert service["read_only"] is True and service["cap_drop"] == ["ALL"]


def test_api_keys_come_from_the_shell_only() -> None:
    unset = _config("docker-compose.yml")["services"]["specserve"]["environment"]
    assert unset["SPECSERVE_API_KEYS"] is None  # not set at all in the container
    given = _config("docker-compose.yml", extra_env={"SPECSERVE_API_KEYS": "k1,k2"})
    assert given["services"]["specserve"]["environment"]["SPECSERVE_API_KEYS"] == "k1,k2"


def test_prometheus_scrapes_specserve(compose: dict[str, Any]) -> None:
    prometheus = compose["services"]["prometheus"]
    mounts = {Path(v["source"]): v["target"] for v in prometheus["volumes"] if v["type"] == "bind"}
    assert mounts[PROMETHEUS_CONFIG] == "/etc/prometheus/prometheus.yml"
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets = [t for sc in jobs["specserve"]["static_configs"] for t in sc["targets"]]
    assert targets == ["specserve:9100"]
    assert jobs["specserve"]["metrics_path"] == "/metrics"


def test_prometheus_config_passes_promtool() -> None:
    promtool = require_program("promtool", "prometheus")
    result = subprocess.run([promtool, "check", "config", "--syntax-only",
                             str(PROMETHEUS_CONFIG)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_cuda_override_builds_the_gpu_target() -> None:
    merged = _config("docker-compose.yml", "docker-compose.gpu.yml")["services"]["specserve"]
    assert merged["build"]["target"] == "gpu"
    (device,) = merged["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert merged["environment"]["SPECSERVE_REDIS_URL"] == "redis://redis:6379/0"  # kept
