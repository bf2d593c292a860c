"""Build a TensorRT engine from the exported ONNX, and keep it next to the export.

Written against the TensorRT 10 Python API (see docs/tensorrt.md for the tested
range). The network is strongly typed: the precision is the export's (export
float16 or bfloat16 for a half-precision engine), so the casts the model code
makes (e.g. float32 RMSNorm) are kept. One optimisation profile covers every
shape the drafter uses: 1..``max_step_tokens`` new tokens (longer prompts are fed
in chunks) after 0..max past tokens, tuned for one new token after a few hundred.
Engines are specific to a GPU model, a TensorRT version and the build settings,
so the file name carries a hash of all of them and a sidecar JSON records the
full key; an engine whose key differs is built anew.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from trt.errors import BackendUnavailableError, DraftBackendError, MissingDependencyError
from trt.manifest import INPUT_IDS, Manifest

log = logging.getLogger(__name__)

ENGINES_DIR = "engines"
MAX_STEP_TOKENS = 128  # the most tokens one engine call takes; bounds its activation memory
OPT_PAST = 256  # the profile's optimum: decoding one token after this many
WORKSPACE_BYTES = 1 << 30

Shape = tuple[int, ...]


class EngineBuildError(DraftBackendError):
    """TensorRT could not parse the ONNX or build (or load) an engine from it."""


class EngineMismatchError(EngineBuildError):
    """The engine's inputs and outputs are not the ones the export's manifest names."""


def import_tensorrt() -> ModuleType:
    try:
        import tensorrt
    except ImportError as exc:
        raise MissingDependencyError(
            "the TensorRT draft backend needs the tensorrt package, which is not installed: "
            "pip install 'specserve[tensorrt]' --extra-index-url https://pypi.nvidia.com (on a "
            "machine with an NVIDIA GPU), or use --draft-backend onnx / torch") from exc
    return tensorrt


@functools.cache
def shared_logger(trt: ModuleType) -> Any:
    """The one ``trt.Logger`` of the process: TensorRT keeps a single logger pointer, so
    every builder and runtime gets this one."""
    return trt.Logger(trt.Logger.WARNING)


def tensorrt_unavailable_reason() -> str | None:
    """Why TensorRT cannot run here, or None when it can (checked without importing it)."""
    if importlib.util.find_spec("tensorrt") is None:
        return "the tensorrt package is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to PyTorch"
    return None


def require_tensorrt() -> None:
    reason = tensorrt_unavailable_reason()
    if reason is None:
        return
    if "not installed" in reason:
        import_tensorrt()  # raises MissingDependencyError with the install hint
    raise BackendUnavailableError(f"the TensorRT draft backend cannot run here: {reason}")


@dataclass(frozen=True)
class BuildSettings:
    """What the engine is built for, besides the export itself."""

    max_positions: int
    max_step_tokens: int = MAX_STEP_TOKENS
    opt_past: int = OPT_PAST
    workspace_bytes: int = WORKSPACE_BYTES

    @property
    def max_past(self) -> int:
        return self.max_positions - 1

    @property
    def step_tokens(self) -> int:
        return min(self.max_step_tokens, self.max_positions)


@dataclass(frozen=True)
class EngineKey:
    """Everything an engine depends on; a stored engine is reused only on an exact match."""

    gpu: str
    compute_capability: str
    tensorrt: str
    dtype: str
    source_hash: str
    export_created: str
    max_positions: int
    max_step_tokens: int
    opt_past: int
    workspace_bytes: int

    @property
    def filename(self) -> str:
        gpu = re.sub(r"[^a-z0-9]+", "-", self.gpu.lower()).strip("-")
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()
        return (f"{gpu}-sm{self.compute_capability}-trt{self.tensorrt}-{self.dtype}"
                f"-ctx{self.max_positions}-{digest[:12]}.engine")


def device_identity(device: torch.device) -> tuple[str, str]:
    """The GPU's name and compute capability, which an engine is specific to."""
    if device.type != "cuda":  # only the tests' stand-in for TensorRT runs on the CPU
        return device.type, "none"
    major, minor = torch.cuda.get_device_capability(device)
    return torch.cuda.get_device_name(device), f"{major}{minor}"


def engine_key(manifest: Manifest, settings: BuildSettings, device: torch.device) -> EngineKey:
    trt = import_tensorrt()
    gpu, capability = device_identity(device)
    return EngineKey(gpu=gpu, compute_capability=capability, tensorrt=str(trt.__version__),
                     dtype=manifest.dtype, source_hash=manifest.source_hash,
                     export_created=manifest.created, **asdict(settings))


def engine_path(export_dir: Path, key: EngineKey) -> Path:
    return export_dir / ENGINES_DIR / key.filename


def read_engine(path: Path, key: EngineKey) -> bytes | None:
    """The stored engine for ``key``, or None when there is none (or it is for another key)."""
    sidecar = path.with_suffix(".json")
    try:
        stored = json.loads(sidecar.read_text())
        if stored != asdict(key):
            log.info("engine %s was built for %s; rebuilding", path, stored)
            return None
        return path.read_bytes()
    except (OSError, ValueError):
        return None


def save_engine(path: Path, key: EngineKey, data: bytes) -> bool:
    """Store the engine for later starts; an unwritable directory is only a warning."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, data)
        _write_atomic(path.with_suffix(".json"), json.dumps(asdict(key), indent=2).encode())
    except OSError as exc:
        log.warning("could not store the TensorRT engine in %s (%s); serving it anyway, but "
                    "the next start builds it again", path.parent, exc)
        return False
    return True


def profile_shapes(manifest: Manifest, settings: BuildSettings
                   ) -> dict[str, tuple[Shape, Shape, Shape]]:
    """(min, opt, max) for every dynamic input of the exported step."""
    heads, dim = manifest.num_kv_heads, manifest.head_dim
    opt_past = min(settings.opt_past, settings.max_past)
    shapes: dict[str, tuple[Shape, Shape, Shape]] = {
        INPUT_IDS: ((1, 1), (1, 1), (1, settings.step_tokens)),
    }
    for name in manifest.past_names:
        shapes[name] = ((1, heads, 0, dim), (1, heads, opt_past, dim),
                        (1, heads, settings.max_past, dim))
    return shapes


def build_engine(onnx_path: Path, manifest: Manifest, settings: BuildSettings) -> bytes:
    """Parse the ONNX and build a serialized engine (minutes for large drafts)."""
    trt = import_tensorrt()
    logger = shared_logger(trt)
    builder = trt.Builder(logger)
    # Strongly typed: TensorRT 10 needs the flag; TensorRT 11 always is, and ignores it.
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineBuildError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, settings.workspace_bytes)
    if manifest.dtype == "float32":
        config.clear_flag(trt.BuilderFlag.TF32)  # a float32 engine computes in float32
    profile = builder.create_optimization_profile()
    for name, (low, opt, high) in profile_shapes(manifest, settings).items():
        profile.set_shape(name, low, opt, high)
    config.add_optimization_profile(profile)
    log.warning("building a TensorRT engine for %s (%s); this takes a while, once",
                manifest.source_spec, manifest.dtype)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineBuildError(
            f"TensorRT failed to build an engine from {onnx_path}; see its log above")
    return bytes(serialized)


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
