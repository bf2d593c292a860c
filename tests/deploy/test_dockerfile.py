"""The Dockerfile, its build context and the small scripts the image carries."""

from __future__ import annotations

import http.server
import re
import shutil
import subprocess
import sys
import threading
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.conftest import REPO, require_tool

DOCKERFILE = REPO / "Dockerfile"
SOURCE_DIRS = ("gateway", "decoding", "drafters", "runtime", "wiring", "grammars", "trt",
               "observability", "specserve", "specbench", "specdistill")


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (KEYWORD, arguments)

    def args(self, keyword: str) -> list[str]:
        return [rest for kw, rest in self.instructions if kw == keyword]


def _instructions(text: str) -> Iterator[tuple[str, str]]:
    logical = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not logical and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # comment inside a continued instruction
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        logical += line
        keyword, _, rest = logical.partition(" ")
        yield keyword.upper(), rest.strip()
        logical = ""


def _stages() -> list[Stage]:
    stages: list[Stage] = []
    for keyword, rest in _instructions(DOCKERFILE.read_text()):
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            assert match, rest
            stages.append(Stage(name=match.group(2) or "", base=match.group(1)))
        elif stages:
            stages[-1].instructions.append((keyword, rest))
    return stages


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return {stage.name: stage for stage in _stages()}


def test_hadolint_is_clean() -> None:
    hadolint = require_tool("hadolint")
    result = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style",
                             str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


def test_cpu_is_the_default_target_and_gpu_a_second_one(stages: dict[str, Stage]) -> None:
    ordered = _stages()
    assert ordered[-1].name == "cpu"  # `docker build .` builds the last stage
    assert "gpu" in stages
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+-runtime-\S+$", text, re.MULTILINE)
    assert stages["gpu-base"].base == "${CUDA_IMAGE}"
    assert stages["gpu"].base == "gpu-base"
    gpu_install = " ".join(stages["gpu-deps"].args("RUN"))
    assert "torch==${TORCH_VERSION}" in gpu_install and "${TENSORRT_PACKAGE}" in gpu_install
    assert re.search(r"^ARG TENSORRT_PACKAGE=tensorrt-cu\d+$", text, re.MULTILINE)
    cpu_install = " ".join(stages["cpu-deps"].args("RUN"))
    assert "--index-url" in cpu_install and "torch==${TORCH_VERSION}" in cpu_install
    assert re.search(r"^ARG TORCH_VERSION=2\.13\.0$", text, re.MULTILINE)


def test_tensorrt_is_pyprojects_range_from_nvidias_index_and_imports(
        stages: dict[str, Stage]) -> None:
    text = DOCKERFILE.read_text()
    package = re.search(r"^ARG TENSORRT_PACKAGE=(\S+)$", text, re.MULTILINE)
    version = re.search(r"^ARG TENSORRT_VERSION=(\S+)$", text, re.MULTILINE)
    assert package and version
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["tensorrt"]
    (requirement,) = (Requirement(r) for r in extra)
    assert canonicalize_name(requirement.name) == canonicalize_name(package.group(1))
    assert requirement.specifier.contains(version.group(1)), (requirement, version.group(1))
    assert re.search(r"^ARG TENSORRT_INDEX_URL=https://pypi\.nvidia\.com$", text, re.MULTILINE)
    runs = stages["gpu-deps"].args("RUN")
    install = next(i for i, r in enumerate(runs) if "${TENSORRT_PACKAGE}" in r)
    assert '--extra-index-url "${TENSORRT_INDEX_URL}"' in runs[install]
    assert runs[install + 1] == 'python -c "import tensorrt; print(tensorrt.__version__)"'


@pytest.mark.parametrize("deps", ["cpu-deps", "gpu-deps"])
def test_dependencies_install_before_the_source_is_copied(stages: dict[str, Stage],
                                                          deps: str) -> None:
    stage = stages[deps]
    copies = stage.args("COPY")
    assert copies == ["pyproject.toml deploy/pyproject_requirements.py ./"]
    order = [kw + " " + rest for kw, rest in stage.instructions]
    copy_at = order.index("COPY " + copies[0])
    installs = [i for i, line in enumerate(order) if "pip install -r requirements.txt" in line]
    assert installs and installs[0] > copy_at
    # the runtime stages take the dependency layer first, then the small project wheel
    runtime = stages[deps.removesuffix("-deps")]
    runtime_lines = [kw + " " + rest for kw, rest in runtime.instructions]
    venv_at = runtime_lines.index(f"COPY --from={deps} /opt/venv /opt/venv")
    wheel_at = next(i for i, line in enumerate(runtime_lines) if "from=wheel" in line)
    assert venv_at < wheel_at


def test_source_is_copied_only_into_the_wheel_stage(stages: dict[str, Stage]) -> None:
    for name, stage in stages.items():
        copied = " ".join(stage.args("COPY"))
        for package in SOURCE_DIRS:
            if name == "wheel":
                assert f"COPY {package}" in " ".join(
                    kw + " " + rest for kw, rest in stage.instructions)
            else:
                assert not re.search(rf"(^|\s){package}(\s|/|$)", copied), (name, package)


# ids avoid the bare word "gpu": tests/conftest.py skips tests carrying that keyword on CPUs
@pytest.mark.parametrize("runtime", ["cpu", "gpu"], ids=["cpu-image", "cuda-image"])
def test_runtime_stage_is_non_root_with_health_and_ports(stages: dict[str, Stage],
                                                         runtime: str) -> None:
    stage = stages[runtime]
    (user,) = stage.args("USER")
    assert user.split(":")[0] not in ("root", "0")
    assert stage.args("EXPOSE") == ["8000 9100"]
    (health,) = stage.args("HEALTHCHECK")
    assert "healthcheck.py" in health and '"/health"' in health
    assert re.search(r"--start-period=\d+m", health)
    assert stage.args("ENTRYPOINT") == ['["/opt/specserve/docker-entrypoint.sh"]']
    assert stage.args("VOLUME") == ['["/var/lib/specserve"]']
    env = " ".join(stage.args("ENV"))
    assert "SPECSERVE_HOME=/var/lib/specserve" in env
    # models are not baked unless asked for
    assert "BAKE_MODEL=false" in stage.args("ARG")
    (bake,) = [run for run in stage.args("RUN") if "BAKE_MODEL" in run]
    assert '"${BAKE_MODEL}" = "true"' in bake and "specserve models pull" in bake


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex: `*` stays within a directory, `**` crosses them."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def _dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matching a parent matches too."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        regex = _pattern_regex(pattern.removeprefix("!").strip("/"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = not negate
    return excluded


@pytest.mark.parametrize("path", [
    ".git/HEAD", ".venv/bin/python", "tests/test_verify.py", "helm/specserve/Chart.yaml",
    "bench-results/bench.json", "gateway/__pycache__/cli.cpython-311.pyc",
    "decoding/.mypy_cache/x.json", "models/SmolLM2/model.safetensors", "Dockerfile",
    "docker-compose.yml", ".ci/run",
])
def test_dockerignore_keeps_out(path: str) -> None:
    assert _dockerignore_excludes(path)


def test_dockerignore_lets_in_the_shipped_draft() -> None:
    """The default draft is package data (pyproject.toml), so the image must get it."""
    drafts = sorted((REPO / "runtime" / "drafts").glob("*/draft.safetensors"))
    assert drafts
    for path in drafts:
        assert not _dockerignore_excludes(str(path.relative_to(REPO)))
    assert _dockerignore_excludes("runtime/drafts/x/other.safetensors")


def test_dockerignore_lets_in_everything_the_build_copies(stages: dict[str, Stage]) -> None:
    sources: set[str] = set()
    for stage in stages.values():
        for rest in stage.args("COPY"):
            words = [w for w in rest.split() if not w.startswith("--")]
            if "--from=" not in rest:
                sources.update(words[:-1])
    assert "pyproject.toml" in sources and "deploy/docker-entrypoint.sh" in sources
    for source in sources:
        path = REPO / source
        assert path.exists(), source
        files = [path] if path.is_file() else [p for p in path.rglob("*.py")]
        for file in files:
            relative = file.relative_to(REPO).as_posix()
            if "__pycache__" not in relative:
                assert not _dockerignore_excludes(relative), relative


def test_the_wheel_builds_from_the_build_context_alone(tmp_path: Path) -> None:
    """What .dockerignore lets through is enough for the image's `pip wheel .`."""
    pytest.importorskip("setuptools")
    context = tmp_path / "context"
    for file in REPO.rglob("*"):
        relative = file.relative_to(REPO).as_posix()
        if file.is_file() and not relative.startswith(".venv/") \
                and not _dockerignore_excludes(relative):
            (context / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(file, context / relative)
    assert not (context / "tests").exists() and not (context / ".git").exists()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(tmp_path / "wheels"), "."],
                   cwd=context, check=True, capture_output=True, timeout=120)
    (wheel,) = (tmp_path / "wheels").glob("specserve-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        assert "specserve = specserve.cli:main" in archive.read(entry_points).decode()
    for package in SOURCE_DIRS:
        assert f"{package}/__init__.py" in names
    assert any(n.startswith("specbench/prompts/") and n.endswith(".json") for n in names)


def test_pyproject_requirements_lists_dependencies_and_extras() -> None:
    script = REPO / "deploy" / "pyproject_requirements.py"
    result = subprocess.run([sys.executable, str(script), str(REPO / "pyproject.toml"),
                             "otlp"], capture_output=True, text=True, check=True)
    lines = result.stdout.splitlines()
    assert "torch==2.13.0" in lines
    assert any(line.startswith("fastapi") for line in lines)
    assert any(line.startswith("opentelemetry-exporter-otlp") for line in lines)
    assert not any(line.startswith("pytest") for line in lines)
    bad = subprocess.run([sys.executable, str(script), str(REPO / "pyproject.toml"), "nope"],
                         capture_output=True, text=True)
    assert bad.returncode == 0 and "no extra 'nope'" in bad.stderr
    # the OTLP exporter is a main dependency now; the 'otlp' extra is kept, empty
    assert bad.stdout.splitlines() == lines


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def fake_server() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("path, code", [(None, 0), ("/health", 0), ("/ready", 1)])
def test_healthcheck_script(fake_server: int, path: str | None, code: int) -> None:
    args = [sys.executable, str(REPO / "deploy" / "healthcheck.py")] + ([path] if path else [])
    result = subprocess.run(args, env={"SPECSERVE_PORT": str(fake_server)},
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == code, result.stderr


def test_healthcheck_fails_when_nothing_listens(fake_server: int) -> None:
    result = subprocess.run([sys.executable, str(REPO / "deploy" / "healthcheck.py")],
                            env={"SPECSERVE_PORT": "1"}, capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 1
