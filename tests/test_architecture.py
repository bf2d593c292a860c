"""The layout's one-way dependencies, read from the sources' import statements:
gateway -> decoding -> runtime, and observability a leaf (shared/DESIGN.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from decoding.policy import MAX_DRAFT_TOKENS
from observability.metrics import POSITION_LABELS

ROOT = Path(__file__).resolve().parent.parent
OURS = ("decoding", "runtime", "gateway", "trt", "observability", "specbench", "specdistill",
        "specserve")


def imports(package: str) -> dict[str, set[str]]:
    """Each module file of ``package`` -> the top-level packages it imports (at any depth
    of the file: a function-local import counts too)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


@pytest.mark.parametrize(("package", "forbidden"), [
    ("observability", set(OURS) - {"observability"}),
    ("decoding", {"gateway", "trt", "specbench", "specdistill", "specserve", "observability",
                  "fastapi", "starlette", "redis", "tensorrt", "onnxruntime"}),
    ("runtime", {"gateway", "trt", "specbench", "specdistill", "specserve", "observability",
                 "fastapi", "redis"}),
    ("gateway", {"trt", "specbench", "specdistill", "specserve"}),
])
def test_a_package_imports_only_what_lies_below_it(package: str, forbidden: set[str]) -> None:
    wrong = {module: sorted(names & forbidden)
             for module, names in imports(package).items() if names & forbidden}
    assert not wrong, f"{package} imports what it must not: {wrong}"


def test_the_position_labels_cover_the_longest_draft() -> None:
    assert POSITION_LABELS >= MAX_DRAFT_TOKENS
