"""Fused CPU kernels for the batched runner (``csrc/``), compiled once per machine and
instruction-set level at first use and cached under ``$SPECSERVE_HOME/kernels``.

A decoder layer run op by op in eager PyTorch is some sixty small operations, each
costing a few microseconds of dispatch, and PyTorch's CPU attention pads every query's
keys to whole blocks. The kernels do a layer's elementwise work in four calls (the norm
with the residual addition, the rotary embedding with the cache writes, attention over
exactly the keys each query sees, the gated activation), and multiply float32, bfloat16
and 4- and 8-bit block matrices (int8 matrices stay PyTorch's). Each kernel computes
every token on its own in a fixed order, so a pass's logits do not depend on what else
shares it (docs/performance.md, "Native kernels").

The sources are written once in one vector type (``csrc/vec.h``) and built once per
level, as ATen builds its ``native/cpu`` kernels per ``CPU_CAPABILITY``: ``default``
(no vector extensions), ``avx2``, ``avx512``, ``avx512_vnni`` and ``amx`` (AVX512-VNNI
with the block products of a few tokens as AMX tile products, ``csrc/tiles.h``). The
host's best level is loaded (from its CPU's flags; ``amx`` only once Linux has let the
process use tile data, else ``avx512_vnni`` with a log line saying why);
``SPECSERVE_CPU_CAPABILITY`` forces a lower one. Every level computes bitwise the same
results, only at its own speed. ``amx_emulated``, a build for tests only and never
loaded by the server, runs the amx level's tile code with the tile instructions
emulated in C++ on an AVX512-VNNI host.

They need a C++ compiler (g++) and ninja when first built; where either is missing, or
``--kernels torch`` is set, the runner keeps its PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Literal, get_args

from runtime.files import model_store

if TYPE_CHECKING:  # torch is imported where a build is looked for: settings import this
    import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("csrc")
KernelChoice = Literal["auto", "native", "torch"]
CHOICES: tuple[str, ...] = get_args(KernelChoice)
CAPABILITY_VARIABLE = "SPECSERVE_CPU_CAPABILITY"  # a lower level than the host's best
DIR_VARIABLE = "SPECSERVE_KERNELS_DIR"  # where builds live (default $SPECSERVE_HOME/kernels)
MODULE = "specserve_kernels"

# Each level: the compiler flags it is built with, and the CPU flags (as /proc/cpuinfo
# names them) a host needs to run it; lowest first. x86-64-v3 and -v4 are the psABI's
# levels (AVX2 with FMA, F16C, BMI; AVX-512 F, BW, CD, DQ and VL).
LEVELS: dict[str, tuple[list[str], frozenset[str]]] = {
    "default": ([], frozenset()),
    "avx2": (["-march=x86-64-v3"],
             frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})),
    "avx512": (["-march=x86-64-v4"],
               frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm",
                          "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})),
    "avx512_vnni": (["-march=x86-64-v4", "-mavx512vnni"],
                    frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm",
                               "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl",
                               "avx512_vnni"})),
    # and the process's permission to use tile data (amx_refusal)
    "amx": (["-march=x86-64-v4", "-mavx512vnni", "-mamx-tile", "-mamx-int8"],
            frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm",
                       "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl",
                       "avx512_vnni", "amx_tile", "amx_int8"})),
}
# Builds for tests only, never chosen by capability(): the amx level's tile code with each
# tile instruction emulated in C++ (csrc/tiles.h), run on an avx512_vnni host
EMULATED: dict[str, tuple[list[str], frozenset[str]]] = {
    "amx_emulated": ([*LEVELS["avx512_vnni"][0], "-DSPECSERVE_AMX_EMULATE"],
                     LEVELS["avx512_vnni"][1]),
}

# arch_prctl(2): Linux lets a process use AMX tile data (XSAVE feature 18) once it asks
SYS_ARCH_PRCTL = 158  # x86-64's syscall number
ARCH_GET_XCOMP_PERM, ARCH_REQ_XCOMP_PERM = 0x1022, 0x1023
XFEATURE_XTILEDATA = 18


class KernelsUnavailable(RuntimeError):
    """The native kernels could not be built or loaded here."""


def check_choice(choice: str) -> None:
    if choice not in CHOICES:
        raise ValueError(f"unknown kernels {choice!r}; choose one of {list(CHOICES)}")


def _cpu_flags() -> frozenset[str]:
    """The host CPU's feature flags (cpuid's, as the kernel reports them)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (elsewhere, the platform's)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            label, _, value = line.partition(":")
            if label.strip().lower() in ("model name", "processor name") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _x86_64() -> bool:
    return platform.machine().lower() in {"x86_64", "amd64"}


def _arch_prctl(option: int, argument: int) -> tuple[int, int]:
    """The arch_prctl system call: (its result, errno)."""
    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(option),
                          ctypes.c_ulong(argument))
    return int(result), ctypes.get_errno()


@functools.cache
def amx_refusal() -> str | None:
    """Asks Linux, once a process, to let it use AMX tile data (arch_prctl
    ARCH_REQ_XCOMP_PERM for XTILEDATA, which every thread of the process then holds) and
    checks that it did (ARCH_GET_XCOMP_PERM): None where it did, else why not."""
    if not sys.platform.startswith("linux") or not _x86_64():
        return "AMX tiles are asked for on Linux on x86-64 only"
    result, error = _arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    if result != 0:
        return f"Linux refused the AMX tile data permission ({os.strerror(error)})"
    granted = ctypes.c_ulong(0)
    result, error = _arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.addressof(granted))
    if result != 0:
        return f"the AMX tile data permission could not be read back ({os.strerror(error)})"
    if not granted.value >> XFEATURE_XTILEDATA & 1:
        return "Linux did not grant the AMX tile data permission it was asked for"
    return None


@functools.cache
def _log_amx_fallback(reason: str) -> None:
    log.warning("%s; the native kernels run at avx512_vnni instead of amx", reason)


def _cpu_levels() -> list[str]:
    """The levels this host's CPU has the instructions for, lowest first."""
    if not _x86_64():
        return ["default"]
    flags = _cpu_flags()
    return [level for level, (_, needs) in LEVELS.items() if needs <= flags]


def host_levels() -> list[str]:
    """The levels this host runs, lowest first (only ``default`` off x86-64): its CPU's,
    less ``amx`` where the process may not use tile data (asked for here, before the level
    is ever loaded; refused, a log line says why)."""
    levels = _cpu_levels()
    if "amx" in levels:
        reason = amx_refusal()
        if reason is not None:
            _log_amx_fallback(reason)
            levels.remove("amx")
    return levels


def capability() -> str:
    """The level to load: ``SPECSERVE_CPU_CAPABILITY`` where set (one this host runs),
    else the host's best."""
    runs = host_levels()
    wanted = os.environ.get(CAPABILITY_VARIABLE, "").strip().lower()
    if not wanted:
        return runs[-1]
    if wanted not in LEVELS:
        raise KernelsUnavailable(f"{CAPABILITY_VARIABLE}={wanted!r} is not a level; choose one "
                                 f"of {list(LEVELS)}")
    if wanted not in runs:
        why = amx_refusal() if wanted == "amx" and wanted in _cpu_levels() else None
        raise KernelsUnavailable(f"{CAPABILITY_VARIABLE}={wanted!r}: "
                                 + (f"{why}; this process runs only {runs}" if why else
                                    f"this CPU runs only {runs}"))
    return wanted


def _openmp() -> list[str]:
    """The flags that make at::parallel_for run on PyTorch's threads: it is inline, and
    built without OpenMP where PyTorch's backend is OpenMP its regions run on one thread
    (the library links PyTorch's own libgomp, already loaded under that soname)."""
    import torch

    return ["-fopenmp"] if torch._C.has_openmp else []


def sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.cpp"))


def _cflags(level: str) -> list[str]:
    # no contraction of a * b + c into one instruction behind the sources' back: a fused
    # multiply-add is written as one, so every level computes the same
    return ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fvisibility=hidden",
            *{**LEVELS, **EMULATED}[level][0],
            f"-DSPECSERVE_CAPABILITY={level}", *_openmp()]


def source_digest() -> str:
    """What every build's key starts from: the sources and their headers."""
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.iterdir()):
        if path.suffix in {".cpp", ".h"}:
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def build_dir(level: str | None = None) -> Path:
    """Where this source, PyTorch version and level is built."""
    import torch

    level = level or capability()
    key = hashlib.sha256("\0".join([
        source_digest(), torch.__version__, level, *_cflags(level), sys.version,
    ]).encode()).hexdigest()[:16]
    root = os.environ.get(DIR_VARIABLE)
    return (Path(root) if root else model_store.home() / "kernels") / f"{level}-{key}"


def _module_name(level: str) -> str:
    return f"{MODULE}_{level}"


def _import_built(directory: Path, name: str) -> ModuleType | None:
    """The module built in ``directory`` before, imported without ninja or a compiler
    (the directory's name is the hash of what built it), or None."""
    path = directory / f"{name}.so"
    spec = importlib.util.spec_from_file_location(name, path) if path.is_file() else None
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(level: str, directory: Path) -> None:
    """Compile and link ``level``'s module into ``directory`` (ninja skips what is up to
    date), one process at a time."""
    from torch.utils import cpp_extension
    from torch.utils.file_baton import FileBaton

    try:  # the ninja package's binary, when the venv's bin is not on PATH
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    except ImportError:
        pass
    directory.mkdir(parents=True, exist_ok=True)
    baton = FileBaton(str(directory / "lock"))
    if not baton.try_acquire():
        baton.wait()  # another process built it meanwhile
        return
    try:
        # load()'s own build step, without the import: a level this host cannot run
        # builds here too (an image builds them all)
        cpp_extension._write_ninja_file_and_build_library(
            name=_module_name(level), sources=[str(p) for p in sources()],
            extra_cflags=_cflags(level), extra_cuda_cflags=[], extra_sycl_cflags=[],
            extra_ldflags=_openmp(), extra_include_paths=[str(SOURCE_DIR)],
            build_directory=str(directory), verbose=False, with_cuda=False,
            with_sycl=False)
    finally:
        baton.release()


_loaded: ModuleType | None = None  # what native() loaded last (loaded())


@functools.cache
def build(level: str) -> ModuleType | None:
    """The kernels module of ``level``, built here if it was not before (None for a
    level this host cannot run: built, never loaded); raises ``KernelsUnavailable``
    saying why not."""
    directory = build_dir(level)
    name = _module_name(level)
    if level in EMULATED:  # tests' builds: the instructions of the level they run on
        runs = _x86_64() and EMULATED[level][1] <= _cpu_flags()
    else:
        runs = level in host_levels()
    try:
        if not (directory / f"{name}.so").is_file():
            _compile(level, directory)
        return _import_built(directory, name) if runs else None
    except Exception as exc:  # a compiler error, no compiler, no ninja, a read-only home
        lines = str(exc).strip().splitlines() or [repr(exc)]
        # the compiler's own message ("...: error: ..."), else the exception's last line
        reason = next((line for line in lines if "error:" in line), lines[-1])
        raise KernelsUnavailable(f"the native kernels ({level}) could not be built in "
                                 f"{directory}: {reason.strip()}") from exc


def native() -> ModuleType:
    """The compiled kernels module of ``capability()``; raises ``KernelsUnavailable``
    saying why not."""
    global _loaded
    module = build(capability())
    if module is None:  # capability() names only levels this host runs
        raise KernelsUnavailable(f"the {capability()} kernels cannot run on this CPU")
    _loaded = module
    return module


def loaded() -> ModuleType | None:
    """The kernels module ``native()`` loaded in this process (never loading or building
    it here), else None."""
    return _loaded


def first_largest(scores: torch.Tensor) -> list[int]:
    """Each row's first largest score's index, as ``scores.float().argmax(-1)``: on the
    kernels this process loaded, for a float32 or bfloat16 CPU tensor (one thread and no
    widened copy, so no other thread a busy machine holds up can delay it:
    docs/performance.md), else torch's."""
    import torch

    module = _loaded if scores.device.type == "cpu" else None
    if (module is not None and scores.dim() == 2 and scores.shape[1] > 0
            and scores.dtype in (torch.float32, torch.bfloat16)):
        picked: list[int] = module.argmax_rows(scores).tolist()
        return picked
    best: list[int] = scores.float().argmax(dim=-1).tolist()
    return best


def resolve(choice: str, device: torch.device) -> ModuleType | None:
    """The kernels module for ``choice`` on ``device``: ``native`` insists (raises when
    they cannot be built), ``auto`` takes them where they build (a CPU) and else warns
    once, ``torch`` never does."""
    check_choice(choice)
    if choice == "torch":
        return None
    if device.type != "cpu":
        if choice == "native":
            raise KernelsUnavailable("the native kernels run on a CPU only")
        return None
    try:
        return native()
    except KernelsUnavailable as exc:
        if choice == "native":
            raise
        _warn_once(str(exc))
        return None


@functools.cache
def _warn_once(message: str) -> None:
    log.warning("%s; running the PyTorch path (--kernels torch)", message)


def main(argv: list[str] | None = None) -> None:
    """``python -m runtime.native.kernels [--all]``: build the kernels now (``make kernels``
    does), for the level this host loads, or with ``--all`` for every level (an image
    built once for hosts of every kind)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m runtime.native.kernels")
    parser.add_argument("--all", action="store_true", help="build every level")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        levels = list(LEVELS) if args.all else [capability()]
        for level in levels:
            build(level)
            log.info("native kernels (%s) ready in %s", level, build_dir(level))
    except KernelsUnavailable as exc:
        log.warning("%s; the server will run its PyTorch path", exc)
        if args.all:
            raise SystemExit(1) from exc


if __name__ == "__main__":
    main()
