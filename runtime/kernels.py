"""Fused CPU kernels for the batched runner (``csrc/kernels.cpp``), compiled once per
machine at first use and cached under ``$SPECSERVE_HOME/kernels``.

A decoder layer run op by op in eager PyTorch is some sixty small operations, each
costing a few microseconds of dispatch, and PyTorch's CPU attention pads every query's
keys to whole blocks. The kernels do a layer's elementwise work in four calls (the norm
with the residual addition, the rotary embedding with the cache writes, attention over
exactly the keys each query sees, the gated activation), and multiply float32, bfloat16
and 4- and 8-bit block matrices (int8 matrices stay PyTorch's). Each kernel computes
every token on its own in a fixed order, so a pass's logits do not depend on what else
shares it (docs/performance.md, "Native kernels").

They need a C++ compiler (g++) and ninja when first built; where either is missing, or
``--kernels torch`` is set, the runner keeps its PyTorch path.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from runtime import model_store

if TYPE_CHECKING:  # torch is imported where a build is looked for: settings import this
    import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "kernels.cpp"
KernelChoice = Literal["auto", "native", "torch"]
CHOICES: tuple[str, ...] = get_args(KernelChoice)
# -march for the build: the machine's own instruction set; set it (x86-64-v3, say) when
# the build is carried to other machines, as a container image is
ARCH_VARIABLE = "SPECSERVE_KERNELS_ARCH"
DIR_VARIABLE = "SPECSERVE_KERNELS_DIR"  # where builds live (default $SPECSERVE_HOME/kernels)
MODULE = "specserve_kernels"


class KernelsUnavailable(RuntimeError):
    """The native kernels could not be built or loaded here."""


def check_choice(choice: str) -> None:
    if choice not in CHOICES:
        raise ValueError(f"unknown kernels {choice!r}; choose one of {list(CHOICES)}")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _openmp() -> list[str]:
    """The flags that make at::parallel_for run on PyTorch's threads: it is inline, and
    built without OpenMP where PyTorch's backend is OpenMP its regions run on one thread
    (the library links PyTorch's own libgomp, already loaded under that soname)."""
    import torch

    return ["-fopenmp"] if torch._C.has_openmp else []


def build_dir() -> Path:
    """Where this source, PyTorch version and instruction set is built: a build made for
    another processor is never loaded."""
    import torch

    arch = os.environ.get(ARCH_VARIABLE, "native")
    key = hashlib.sha256("\0".join([
        SOURCE.read_text(), torch.__version__, arch, _cpu_flags() if arch == "native" else "",
        *_openmp(),
    ]).encode()).hexdigest()[:16]
    root = os.environ.get(DIR_VARIABLE)
    return (Path(root) if root else model_store.home() / "kernels") / key


def _import_built(directory: Path) -> Any | None:
    """The module built in ``directory`` before, imported without ninja or a compiler
    (the directory's name is the hash of what built it), or None."""
    path = directory / f"{MODULE}.so"
    spec = importlib.util.spec_from_file_location(MODULE, path) if path.is_file() else None
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def native() -> Any:
    """The compiled kernels module; raises ``KernelsUnavailable`` saying why not."""
    from torch.utils import cpp_extension

    try:  # the ninja package's binary, when the venv's bin is not on PATH
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    except ImportError:
        pass
    directory = build_dir()
    arch = os.environ.get(ARCH_VARIABLE, "native")
    try:
        try:
            built = _import_built(directory)
        except (ImportError, OSError):  # a build another process is still writing
            built = None
        if built is not None:
            return built
        directory.mkdir(parents=True, exist_ok=True)
        openmp = _openmp()
        return cpp_extension.load(
            name=MODULE, sources=[str(SOURCE)], build_directory=str(directory),
            extra_cflags=["-O3", f"-march={arch}", "-fno-math-errno", *openmp],
            extra_ldflags=openmp, verbose=False)
    except Exception as exc:  # a compiler error, no compiler, no ninja, a read-only home
        lines = str(exc).strip().splitlines() or [repr(exc)]
        # the compiler's own message ("...: error: ..."), else the exception's last line
        reason = next((line for line in lines if "error:" in line), lines[-1])
        raise KernelsUnavailable(f"the native kernels could not be built in {directory}: "
                                 f"{reason.strip()}") from exc


def resolve(choice: str, device: torch.device) -> Any | None:
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


def main() -> None:
    """``python -m runtime.kernels``: build the kernels now (``make kernels`` does)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        native()
    except KernelsUnavailable as exc:
        log.warning("%s; the server will run its PyTorch path", exc)
        return
    log.info("native kernels ready in %s", build_dir())


if __name__ == "__main__":
    main()
