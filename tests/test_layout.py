"""The package layout is the architecture: imports point one way.

gateway -> decoding -> runtime, and trt implements decoding's drafter protocol;
benchmarks (specbench) and training (specdistill) import the core and nothing serving
imports them; observability is imported by anyone and imports nothing of ours (callers
hand it plain values); the command line (specserve) is the one place that imports
everything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "decoding", "runtime", "trt", "observability", "specbench",
            "specdistill", "specserve")
# what each package must never import (directly, at any depth of the module)
FORBIDDEN = {
    "decoding": {"gateway", "trt", "specbench", "specdistill", "specserve", "observability",
                 "fastapi", "redis", "tensorrt", "onnxruntime", "uvicorn"},
    "runtime": {"gateway", "trt", "specbench", "specdistill", "specserve", "observability",
                "fastapi", "redis", "tensorrt", "onnxruntime", "uvicorn"},
    "gateway": {"trt", "specbench", "specdistill", "specserve", "tensorrt", "onnxruntime"},
    "trt": {"gateway", "specbench", "specdistill", "specserve"},
    "observability": {"gateway", "decoding", "runtime", "trt", "specbench", "specdistill",
                      "specserve"},
    "specbench": {"specserve", "specdistill"},
    "specdistill": {"specserve", "specbench", "gateway"},
}
MAX_SERVING_LINES = 400  # a serving module longer than this is two modules


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_points_the_wrong_way(package: str) -> None:
    wrong = {f"{path.relative_to(ROOT)} imports {name}"
             for path in _modules(package) for name in _imports(path) & FORBIDDEN[package]}
    assert not wrong, sorted(wrong)


def test_every_package_is_checked() -> None:
    found = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} - {"tests"}
    assert found == set(PACKAGES)


@pytest.mark.parametrize("package", ["decoding", "runtime", "gateway", "observability", "trt"])
def test_serving_modules_stay_small(package: str) -> None:
    long = {str(path.relative_to(ROOT)): n for path in _modules(package)
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_SERVING_LINES}
    assert not long, long
