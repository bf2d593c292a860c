"""The package layout is the architecture: imports point one way.

gateway -> decoding -> runtime, and drafters and trt implement decoding's drafter protocol;
decoding sees the runtime only through its contract (``runtime.runner.passes``: the pass's
items and the runner's declared capabilities), and the wiring (``wiring``) builds the
concrete models and drafters from names, above both; benchmarks (specbench) and
training (specdistill) import the core and nothing serving imports them; observability
is imported by anyone and imports nothing of ours (callers hand it plain values); the
command line (specserve) is the one place that imports everything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "decoding", "drafters", "runtime", "wiring", "grammars", "trt",
            "observability", "specbench", "specdistill", "specserve")
# what each package must never import (directly, at any depth of the module)
FORBIDDEN = {
    "decoding": {"gateway", "drafters", "wiring", "grammars", "trt", "specbench", "specdistill",
                 "specserve", "observability", "fastapi", "redis", "tensorrt", "onnxruntime",
                 "uvicorn", "llguidance"},
    "drafters": {"gateway", "wiring", "grammars", "trt", "specbench", "specdistill", "specserve",
                 "observability", "fastapi", "redis", "tensorrt", "onnxruntime", "uvicorn"},
    "runtime": {"gateway", "decoding", "drafters", "wiring", "grammars", "trt", "specbench",
                "specdistill", "specserve", "observability", "fastapi", "redis", "tensorrt",
                "onnxruntime", "uvicorn"},
    "wiring": {"gateway", "trt", "specbench", "specdistill", "specserve", "observability",
               "fastapi", "redis", "tensorrt", "onnxruntime", "uvicorn"},
    "gateway": {"trt", "specbench", "specdistill", "specserve", "tensorrt", "onnxruntime"},
    "trt": {"gateway", "specbench", "specdistill", "specserve"},
    "grammars": {"gateway", "drafters", "runtime", "wiring", "trt", "specbench", "specdistill",
                 "specserve", "observability", "fastapi", "redis", "tensorrt", "onnxruntime",
                 "uvicorn"},
    "observability": {"gateway", "decoding", "drafters", "runtime", "wiring", "grammars", "trt",
                      "specbench", "specdistill", "specserve"},
    "specbench": {"specserve", "specdistill"},
    "specdistill": {"specserve", "specbench", "gateway"},
}


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


# the runtime modules the speculative core may import: the contract, no runner
RUNTIME_CONTRACT = {"runtime.runner.passes"}


def test_the_core_sees_the_runtime_only_through_its_contract() -> None:
    """decoding, and the drafters that plug into it, import no concrete runner, model,
    kernel or file format (not even for type checking): they are handed a target and
    draft models that meet their protocols."""
    names = _module_names()
    concrete = {f"{path.relative_to(ROOT)} imports {name}"
                for package in ("decoding", "drafters") for path in _modules(package)
                for name in _module_imports(path, names)
                if name.split(".")[0] == "runtime" and name not in RUNTIME_CONTRACT}
    assert not concrete, sorted(concrete)


CORE_LINES = 4_500  # the most lines of Python the speculative core holds


def test_the_core_is_the_core() -> None:
    """decoding holds the speculative round, its policies, the engine and their
    protocols; the drafters, the wiring, the grammar engine and the runtime live outside
    it."""
    lines = sum(len(path.read_text(encoding="utf-8").splitlines())
                for path in _modules("decoding"))
    assert lines <= CORE_LINES, lines


# runtime's layers, bottom first: a module imports runtime modules of its own layer or
# those below (the loaders and the shipped drafts stand side by side at the top)
RUNTIME_LAYERS = (("files",), ("native",), ("models",), ("matrices",), ("runner",),
                  ("loaders", "drafts"))
# the gateway's, bottom first: the OpenAI shapes; a request decoded into the engine's
# work; the engine's events encoded into bodies; the server's settings, state and
# stores; a request's run; the routes. gateway/server.py, above them all, builds the app.
GATEWAY_LAYERS = (("wire",), ("decode",), ("encode",), ("service",), ("predict",), ("api",))
GATEWAY_TOP = {"gateway", "gateway.server"}


def _upward_imports(package: str, layers: tuple[tuple[str, ...], ...],
                    top: set[str]) -> tuple[list[str], list[str]]:
    """The modules of ``package`` outside its layers, and the imports of a layer above."""
    rank = {layer: i for i, group in enumerate(layers) for layer in group}
    names = _module_names()
    loose = [name for name in names if name.startswith(package + ".")
             and name not in top and name.split(".")[1] not in rank]
    upward = []
    for name, path in names.items():
        parts = name.split(".")
        if parts[0] != package or len(parts) < 3:
            continue
        for imported in _module_imports(path, names):
            other = imported.split(".")
            if (other[0] == package and len(other) > 1 and other[1] in rank
                    and rank[other[1]] > rank[parts[1]]):
                upward.append(f"{name} imports {imported}")
    return loose, sorted(upward)


def test_the_runtime_is_a_stack_of_layers() -> None:
    """Every runtime module sits in one of the layers' subpackages, and none imports a
    module of a layer above its own (not even inside a function or for type checking)."""
    loose, upward = _upward_imports("runtime", RUNTIME_LAYERS, {"runtime"})
    assert not loose, loose
    assert not upward, upward


def test_the_gateway_is_a_stack_of_layers() -> None:
    """The same for the gateway: every module but the app's builder sits in a layer, and
    none imports a layer above its own (decode and encode never reach the server's state,
    which is why the grammar's compiler comes through a protocol)."""
    loose, upward = _upward_imports("gateway", GATEWAY_LAYERS, GATEWAY_TOP)
    assert not loose, loose
    assert not upward, upward


def test_every_package_is_checked() -> None:
    found = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} - {"tests"}
    assert found == set(PACKAGES)


def test_kernel_sources_are_one_file_per_concern_apart_from_the_core() -> None:
    """The C++ lives in runtime/native/csrc, one file per concern (judged by what each
    holds, not by its length); the speculative core has none."""
    sources = sorted((ROOT / "runtime" / "native" / "csrc").glob("*.[ch]*"))
    assert {p.name for p in sources} >= {"vec.h", "norms_rotary.cpp", "attention.cpp",
                                         "block_products.cpp", "dense_products.cpp",
                                         "layer_stack.cpp", "bindings.cpp"}
    native = [p for ext in ("*.cpp", "*.cc", "*.h", "*.hpp", "*.cu")
              for p in (ROOT / "decoding").rglob(ext)]
    assert not native, native


def _module_names() -> dict[str, Path]:
    names = {}
    for package in PACKAGES:
        for path in _modules(package):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _module_imports(path: Path, names: dict[str, Path]) -> set[str]:
    """Every project module ``path`` imports, wherever the import stands: at the top, in
    a function, or for type checking only."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            candidates = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        found.update(c for c in candidates if c in names)
    return found


def test_no_import_circles() -> None:
    """No module reaches itself through imports, not even through one inside a function
    or under TYPE_CHECKING (each such circle was two modules that were one)."""
    names = _module_names()
    graph = {name: _module_imports(path, names) - {name} for name, path in names.items()}
    circles = []
    for start in graph:  # a path back to start, by depth-first search
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    circles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not circles, sorted(set(circles))[:10]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_reaches(path: Path, module: str, names: dict[str, Path]) -> set[str]:
    """The private names (``_x``) of other project modules that ``path`` imports, or reads
    as an attribute of a module it imported."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    modules: dict[str, str] = {}  # local name -> project module it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in names and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in names:
                    modules[alias.asname or alias.name] = full
                elif _private(alias.name) and node.module != module:
                    found.add(f"imports {full}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in names:
                    modules[alias.asname or alias.name] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = ast.unparse(node.value)
            target = modules.get(owner, owner if owner in names else None)
            if target is not None and target != module:
                found.add(f"reads {target}.{node.attr}")
    return found


def test_no_module_reaches_a_private_name_of_another() -> None:
    """A module's ``_private`` names are its own: another module imports only what is
    public, so a seam between two modules is a public name."""
    names = _module_names()
    found = {f"{path.relative_to(ROOT)} {reach}" for module, path in names.items()
             for reach in _private_reaches(path, module, names)}
    assert not found, sorted(found)


# private attribute reads not yet turned into a public seam: (module, attribute)
OWED_ATTRIBUTE_READS = {("decoding/handoff.py", "_put")}  # RequestStream's


def _private_members(tree: ast.AST) -> set[str]:
    """The private names a module's classes give their instances or themselves: set on
    ``self`` or ``cls``, or defined in a class body."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                and _private(node.attr)):
            found.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names = [item.name]
                elif isinstance(item, ast.Assign | ast.AnnAssign):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    names = [t.id for t in targets if isinstance(t, ast.Name)]
                else:
                    continue
                found.update(n for n in names if _private(n))
    return found


def test_no_module_reads_the_private_attributes_of_another_s_objects() -> None:
    """An object's ``_private`` attributes are its class's module's own: another module
    reads what it needs through a public, typed name (the batched runner hands its layer
    paths ``runtime.runner.stack.Stack``), not through ``Any`` and ``obj._x``. A name some class
    of the reading module also sets is taken for that class's own."""
    trees = {path: ast.parse(path.read_text(encoding="utf-8"))
             for path in _module_names().values()}
    members = {path: _private_members(tree) for path, tree in trees.items()}
    owned = set().union(*members.values())
    found = set()
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in owned
                    and node.attr not in members[path]
                    and ast.unparse(node.value) not in ("self", "cls", "type(self)")):
                found.add((str(path.relative_to(ROOT)), node.attr))
    assert found == OWED_ATTRIBUTE_READS, sorted(found ^ OWED_ATTRIBUTE_READS)
