"""Mutation testing of what a change touched: mutmut over each changed module, with only
the tests that cover it, and the mutants that survive listed with their diffs.

    python scripts/mutate.py [--base REF] [--modules PATH ...] [--children N]

Modules are the Python files of the project's packages changed since ``--base`` (default
``origin/main``; committed, staged and unstaged changes alike), or ``--modules``. Each runs
in a copy of the tree of its own under ``.mutmut/``: mutmut instruments the module there,
runs its tests once for the functions each test reaches, then every mutant against the
tests that reach the mutated function. A module's tests are ``test_<name>.py`` anywhere
under ``tests/``, plus ``TESTS`` below where the names differ. The C++ kernels are not
mutated: their tests compare every instruction-set level bitwise, and a change to
``runtime/native/csrc`` is listed as not covered here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# mutmut's command (its mutants import mutmut.__main__, which must be the module already run)
MUTMUT = [sys.executable, "-c", "from mutmut.__main__ import cli; cli()"]
WORK = ROOT / ".mutmut"
PACKAGES = ("gateway", "decoding", "drafters", "runtime", "wiring", "grammars", "trt",
            "observability", "specbench", "specdistill", "specserve")

# module -> pytest arguments (files, then an optional -k or -m expression), where the test file is
# not named after the module or where a test file holds far more than the module's tests
TESTS: dict[str, list[str]] = {
    "drafters/ngram.py": ["tests/test_drafters.py", "-k", "ngram"],
    "drafters/combined.py": ["tests/test_drafters.py", "-k", "combined or source"],
    "drafters/continuation.py": ["tests/test_prefix_cache.py", "-k", "continuation"],
    "drafters/prediction.py": ["tests/test_prediction.py", "-m", "not real_model"],
    "decoding/policy/curve.py": ["tests/test_verify_curve.py"],
    "decoding/policy/cost.py": ["tests/test_verify_curve.py", "tests/test_policy.py"],
    "decoding/verify.py": ["tests/test_verify.py"],
    "gateway/encode/tool_calls.py": ["tests/gateway/test_tool_calls_after_text.py"],
    "gateway/decode/tool_plan.py": ["tests/gateway/test_tool_calls_after_text.py"],
    "gateway/decode/params.py": ["tests/gateway/test_answer_limits.py"],
    "gateway/encode/totals.py": ["tests/gateway/test_inprocess.py"],
    "runtime/files/model_store.py": ["tests/test_model_store.py"],
    "runtime/runner/memory.py": ["tests/test_memory.py"],
}
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests",
          34: "skipped", 35: "suspicious", 36: "timeout", 24: "timeout", -24: "timeout",
          152: "timeout", 255: "timeout", -11: "segfault", -9: "segfault", None: "not checked"}


def git(*args: str) -> list[str]:
    out = subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if line]


def changed_files(base: str) -> list[str]:
    """Files changed since ``base``'s common ancestor with HEAD, and in the work tree
    (``origin/main`` falls back to ``main`` in a clone without that remote)."""
    found = subprocess.run(["git", "rev-parse", "--verify", "-q", base], cwd=ROOT,
                           capture_output=True, check=False).returncode == 0
    if not found and base == "origin/main":
        base = "main"
    merge_base = git("merge-base", base, "HEAD")[0]
    return sorted(set(git("diff", "--name-only", merge_base)) | set(
        git("ls-files", "--others", "--exclude-standard")))


def modules_of(files: list[str]) -> list[str]:
    return [f for f in files if f.endswith(".py") and f.split("/")[0] in PACKAGES
            and (ROOT / f).exists() and not f.endswith("__init__.py")]


def tests_for(module: str) -> list[str]:
    if module in TESTS:
        return TESTS[module]
    name = f"test_{Path(module).stem}.py"
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob(name))


def copy_tree(dest: Path) -> None:
    """The work tree's tracked files of the packages and tests (as they are now, changes
    included), and pyproject.toml."""
    if dest.exists():
        shutil.rmtree(dest)
    for rel in git("ls-files", "--cached", "--others", "--exclude-standard", "--",
                   *PACKAGES, "tests", "pyproject.toml"):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_module(module: str, tests: list[str], children: int) -> dict[str, object]:
    work = WORK / module.removesuffix(".py").replace("/", "__")
    copy_tree(work)
    # every package is copied into mutmut's tree; only the module is mutated; mutants run
    # in workers forked from a server process free of torch's threads (forkserver)
    (work / "setup.cfg").write_text(
        "[mutmut]\n"
        "source_paths =\n" + "".join(f"    {p}\n" for p in PACKAGES)
        + f"only_mutate = {module}\n"
        "pytest_add_cli_args_test_selection =\n" + "".join(f"    {t}\n" for t in tests)
        + "process_isolation = forkserver\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # fork-safe children
    start = time.monotonic()
    subprocess.run([*MUTMUT, "run", "--max-children", str(children)],
                   cwd=work, env=env, stdin=subprocess.DEVNULL, check=False)
    meta = json.loads((work / "mutants" / f"{module}.meta").read_text())
    statuses = {name: STATUS.get(code, "suspicious")
                for name, code in meta["exit_code_by_key"].items()}
    survivors = sorted(n for n, s in statuses.items() if s != "killed")
    diffs = {}
    for name in survivors:
        shown = subprocess.run([*MUTMUT, "show", name], cwd=work, stdin=subprocess.DEVNULL,
                               env=env, capture_output=True, text=True, check=False)
        diffs[name] = shown.stdout.strip()
    return {"module": module, "tests": tests, "mutants": len(statuses),
            "killed": sum(s == "killed" for s in statuses.values()),
            "survived": [{"mutant": n, "status": statuses[n], "diff": diffs[n]}
                         for n in survivors],
            "seconds": round(time.monotonic() - start)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="origin/main")
    parser.add_argument("--modules", nargs="*", help="paths of modules (default: the changed)")
    parser.add_argument("--children", type=int, default=1, help="mutants run at once")
    args = parser.parse_args()
    if args.modules:
        modules, files = args.modules, args.modules
    else:
        files = changed_files(args.base)
        modules = modules_of(files)
    native = [f for f in files if f.startswith("runtime/native/csrc/")]
    if native:
        print("not mutated (the kernels' tests compare every level bitwise): "
              + ", ".join(native))
    results = []
    for module in modules:
        tests = tests_for(module)
        if not tests:
            print(f"{module}: no tests found (add it to TESTS in scripts/mutate.py)")
            continue
        print(f"== {module}: {' '.join(tests)}", flush=True)
        results.append(run_module(module, tests, args.children))
    WORK.mkdir(exist_ok=True)
    (WORK / "report.json").write_text(json.dumps(results, indent=1) + "\n")
    for r in results:
        survived = r["survived"]
        assert isinstance(survived, list)
        print(f"\n{r['module']}: {r['mutants']} mutants, {r['killed']} killed, "
              f"{len(survived)} not killed ({r['seconds']} s)")
        for s in survived:
            print(f"--- {s['mutant']} ({s['status']})\n{s['diff']}")
    print(f"\nreport: {(WORK / 'report.json').relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
