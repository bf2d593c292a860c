"""Shared helpers for the deployment checks: locating the tools, rendering the chart.

The tools (helm, hadolint, kubernetes-validate, the docker-compose plugin) are
installed under .venv/tools by scripts/install-deploy-tools.sh, which `make test`
runs first. A test whose tool is missing fails, saying how to install it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "specserve"
TOOLS = Path(os.environ.get("SPECSERVE_DEPLOY_TOOLS", REPO / ".venv" / "tools"))
INSTALL_HINT = "run scripts/install-deploy-tools.sh .venv/tools (make test does)"
RELEASE = "rel"
NAMESPACE = "ml"
KUBE_VERSION = "1.33.0"

Manifest = dict[str, Any]


def find_tool(name: str) -> str | None:
    """The tool under .venv/tools/bin, else on PATH, else None."""
    local = TOOLS / "bin" / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which(name)


def require_tool(name: str) -> str:
    path = find_tool(name)
    if path is None:
        pytest.fail(f"{name} is not installed; {INSTALL_HINT}", pytrace=False)
    return path


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses duplicate keys (Kubernetes would keep only one)."""


def _mapping_without_duplicates(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                 _mapping_without_duplicates)


def load_manifests(text: str) -> list[Manifest]:
    return [doc for doc in yaml.load_all(text, Loader=_UniqueKeyLoader) if doc]


class Rendered:
    """One rendering of the chart: the YAML text and its objects."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.objects = load_manifests(text)

    def all(self, kind: str) -> list[Manifest]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str | None = None) -> Manifest:
        matches = [o for o in self.all(kind) if name is None or o["metadata"]["name"] == name]
        assert len(matches) == 1, f"expected one {kind} {name or ''}, got {len(matches)}"
        return matches[0]

    def kinds(self) -> set[str]:
        return {o["kind"] for o in self.objects}

    @property
    def deployment(self) -> Manifest:
        return self.get("Deployment", f"{RELEASE}-specserve")

    @property
    def pod(self) -> Manifest:
        return self.deployment["spec"]["template"]["spec"]

    @property
    def server(self) -> Manifest:
        (container,) = [c for c in self.pod["containers"] if c["name"] == "specserve"]
        return container


@pytest.fixture(scope="session")
def helm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("helm-home")
    env = dict(os.environ)
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[var] = str(home / var.lower())
    return env


@pytest.fixture(scope="session")
def helm(helm_env: dict[str, str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    binary = require_tool("helm")

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([binary, *args], env=helm_env, capture_output=True, text=True,
                                timeout=60)
        if check and result.returncode != 0:
            pytest.fail(f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result

    return run


def set_args(values: dict[str, str] | None) -> list[str]:
    args: list[str] = []
    for key, value in (values or {}).items():
        args += ["--set-json" if value.startswith(("[", "{")) else "--set", f"{key}={value}"]
    return args


@pytest.fixture(scope="session")
def render(helm: Callable[..., subprocess.CompletedProcess[str]]) -> Callable[..., Rendered]:
    """render(values_file=None, **set) -> Rendered, memoised per argument set."""
    cache: dict[tuple, Rendered] = {}

    def _render(values_file: str | None = None, values: dict[str, str] | None = None
                ) -> Rendered:
        key = (values_file, tuple(sorted((values or {}).items())))
        if key not in cache:
            args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                    "--kube-version", KUBE_VERSION,
                    "--api-versions", "monitoring.coreos.com/v1"]
            if values_file:
                args += ["-f", str(CHART / values_file)]
            cache[key] = Rendered(helm(*args, *set_args(values)).stdout)
        return cache[key]

    return _render


@pytest.fixture(scope="session")
def default_render(render: Callable[..., Rendered]) -> Rendered:
    return render()


@pytest.fixture(scope="session")
def full_render(render: Callable[..., Rendered]) -> Rendered:
    """Every optional part on: GPU, HPA, ServiceMonitor, Redis, PVC, NetworkPolicy, PDB."""
    return render("ci/full-values.yaml")


def walk_containers(pod_spec: Manifest) -> Iterator[Manifest]:
    yield from pod_spec.get("initContainers", [])
    yield from pod_spec["containers"]
