"""A stand-in for the ``tensorrt`` package, for the CPU: it checks what the engine is
given and runs the exported step on ONNX Runtime.

Only the part of the TensorRT 10 Python API that trt/ calls is here. The "engine"
it builds is a JSON record of the network and its optimisation profile. Each
``execute_async_v3`` checks every address (set, non-null, 256-byte aligned),
every input shape (inside the profile), reads the inputs from those addresses
(CPU torch tensors), runs ONNX Runtime on them, checks that the output shapes it
reported from ``get_tensor_shape`` are ONNX Runtime's, and writes the outputs back
to the output addresses. ``FAULTS`` causes the failures a real GPU would.
Tests install it with ``monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt)``.
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np

__version__ = "10.13.3.9"
ALIGNMENT = 256
MAGIC = "fake-tensorrt-engine"


class DataType(IntEnum):
    FLOAT = 0
    HALF = 1
    INT32 = 3
    BF16 = 7
    INT64 = 8


class TensorIOMode(IntEnum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class NetworkDefinitionCreationFlag(IntEnum):
    STRONGLY_TYPED = 1


class MemoryPoolType(IntEnum):
    WORKSPACE = 0


class BuilderFlag(IntEnum):
    TF32 = 7


_ONNX_TYPES = {1: DataType.FLOAT, 10: DataType.HALF, 16: DataType.BF16, 7: DataType.INT64,
               6: DataType.INT32}
_NUMPY: dict[DataType, type[np.generic]] = {
    DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT64: np.int64,
    DataType.INT32: np.int32}


@dataclass
class Faults:
    """Failures to cause: set by a test, cleared by ``reset()``."""

    no_context: bool = False  # create_execution_context() returns None (out of memory)
    renamed_outputs: dict[str, str] = field(default_factory=dict)  # engine I/O names differ
    build_fails: bool = False


@dataclass
class Record:
    """What the fake saw, for tests to assert on."""

    loggers: int = 0
    builds: list[dict[str, Any]] = field(default_factory=list)
    executions: list[dict[str, tuple[int, ...]]] = field(default_factory=list)
    streams: list[int] = field(default_factory=list)


FAULTS = Faults()
RECORD = Record()


def reset() -> None:
    global FAULTS, RECORD
    FAULTS = Faults()
    RECORD = Record()


class Logger:
    ERROR = 1
    WARNING = 2
    INFO = 3

    def __init__(self, severity: int = WARNING) -> None:
        RECORD.loggers += 1
        self.severity = severity


class _Network:
    def __init__(self, flags: int) -> None:
        self.flags = flags
        self.onnx_path = ""
        self.io: list[tuple[str, int, int, list[Any]]] = []  # name, mode, dtype, dims


class OnnxParser:
    def __init__(self, network: _Network, logger: Logger) -> None:
        assert isinstance(logger, Logger)
        self.network = network
        self.errors: list[str] = []

    def parse_from_file(self, path: str) -> bool:
        import onnx

        graph = onnx.load(path, load_external_data=False).graph
        self.network.onnx_path = path
        for mode, values in ((TensorIOMode.INPUT, graph.input), (TensorIOMode.OUTPUT,
                                                                 graph.output)):
            for v in values:
                tensor = v.type.tensor_type
                dims = [d.dim_param or d.dim_value for d in tensor.shape.dim]
                self.network.io.append((v.name, int(mode), int(_ONNX_TYPES[tensor.elem_type]),
                                        dims))
        return True

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    def get_error(self, i: int) -> str:
        return self.errors[i]


class _Profile:
    def __init__(self) -> None:
        self.shapes: dict[str, list[list[int]]] = {}

    def set_shape(self, name: str, low: tuple[int, ...], opt: tuple[int, ...],
                  high: tuple[int, ...]) -> None:
        assert all(a <= b <= c for a, b, c in zip(low, opt, high, strict=True)), name
        self.shapes[name] = [list(low), list(opt), list(high)]


class _Config:
    def __init__(self) -> None:
        self.pools: dict[int, int] = {}
        self.cleared: list[int] = []
        self.profiles: list[_Profile] = []

    def set_memory_pool_limit(self, pool: MemoryPoolType, size: int) -> None:
        self.pools[int(pool)] = size

    def clear_flag(self, flag: BuilderFlag) -> None:
        self.cleared.append(int(flag))

    def add_optimization_profile(self, profile: _Profile) -> int:
        self.profiles.append(profile)
        return len(self.profiles) - 1


class Builder:
    def __init__(self, logger: Logger) -> None:
        assert isinstance(logger, Logger)

    def create_network(self, flags: int) -> _Network:
        return _Network(flags)

    def create_builder_config(self) -> _Config:
        return _Config()

    def create_optimization_profile(self) -> _Profile:
        return _Profile()

    def build_serialized_network(self, network: _Network, config: _Config) -> bytes | None:
        (profile,) = config.profiles
        dynamic = {name for name, mode, _, dims in network.io
                   if mode == TensorIOMode.INPUT and any(isinstance(d, str) for d in dims)}
        assert set(profile.shapes) == dynamic, (sorted(profile.shapes), sorted(dynamic))
        record = {"magic": MAGIC, "onnx": network.onnx_path, "flags": network.flags,
                  "profile": profile.shapes, "pools": config.pools, "cleared": config.cleared,
                  "io": network.io}
        RECORD.builds.append(record)
        return None if FAULTS.build_fails else json.dumps(record).encode()


class Runtime:
    def __init__(self, logger: Logger) -> None:
        assert isinstance(logger, Logger)

    def deserialize_cuda_engine(self, data: bytes) -> _Engine | None:
        try:
            record = json.loads(data)
        except ValueError:
            return None  # TensorRT logs the error and returns None
        return _Engine(record) if record.get("magic") == MAGIC else None


class _Engine:
    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record
        self.io = {FAULTS.renamed_outputs.get(name, name): (mode, dtype, dims)
                   for name, mode, dtype, dims in record["io"]}
        self.names = list(self.io)
        self.device_memory_size_v2 = 3 << 30

    @property
    def num_io_tensors(self) -> int:
        return len(self.names)

    def get_tensor_name(self, i: int) -> str:
        return self.names[i]

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return TensorIOMode(self.io[name][0])

    def get_tensor_dtype(self, name: str) -> DataType:
        return DataType(self.io[name][1])

    def create_execution_context(self) -> _Context | None:
        return None if FAULTS.no_context else _Context(self)


class _Context:
    def __init__(self, engine: _Engine) -> None:
        self.engine = engine
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self._session: Any = None

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        low, _, high = self.engine.record["profile"][name]
        if len(shape) != len(low) or not all(
                a <= s <= b for a, s, b in zip(low, shape, high, strict=True)):
            return False  # TensorRT logs the error and returns False
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name: str, address: int) -> bool:
        assert name in self.engine.io, name
        self.addresses[name] = address
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        """An output's shape from the graph's symbolic dims and the input shapes set."""
        symbols: dict[str, int] = {}
        for input_name, (mode, _, dims) in self.engine.io.items():
            if mode == TensorIOMode.INPUT and input_name in self.shapes:
                shape = self.shapes[input_name]
                symbols.update({d: s for d, s in zip(dims, shape, strict=True)
                                if isinstance(d, str)})
        return tuple(_evaluate(d, symbols) for d in self.engine.io[name][2])

    def execute_async_v3(self, stream_handle: int) -> bool:
        RECORD.streams.append(stream_handle)
        inputs = {n for n, (mode, _, _) in self.engine.io.items() if mode == TensorIOMode.INPUT}
        assert set(self.shapes) == inputs, f"input shapes not set: {inputs - set(self.shapes)}"
        assert set(self.addresses) == set(self.engine.io), "an I/O address is not set"
        for name, address in self.addresses.items():
            assert address, f"{name}: null address"
            assert address % ALIGNMENT == 0, f"{name}: address {address:#x} is not aligned"
        feeds = {n: _read(self.addresses[n], self.shapes[n], self.engine.io[n][1])
                 for n in inputs}
        outputs = [n for n in self.engine.names if n not in inputs]
        results = self._ort().run(outputs, feeds)
        made = {n: tuple(a.shape) for n, a in zip(outputs, results, strict=True)}
        RECORD.executions.append(made | self.shapes)
        for name, result in zip(outputs, results, strict=True):
            assert tuple(result.shape) == self.get_tensor_shape(name), (
                f"{name}: ONNX Runtime made {result.shape}, "
                f"get_tensor_shape said {self.get_tensor_shape(name)}")
            result = np.ascontiguousarray(result)
            ctypes.memmove(self.addresses[name], result.ctypes.data, result.nbytes)
        return True

    def _ort(self) -> Any:
        if self._session is None:
            import onnxruntime

            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = 1
            self._session = onnxruntime.InferenceSession(
                self.engine.record["onnx"], options, providers=["CPUExecutionProvider"])
        return self._session


def _read(address: int, shape: tuple[int, ...], dtype: int) -> np.ndarray:
    numpy_dtype = _NUMPY[DataType(dtype)]
    count = int(np.prod(shape))
    if count == 0:
        return np.zeros(shape, dtype=numpy_dtype)
    buffer = (ctypes.c_char * (count * np.dtype(numpy_dtype).itemsize)).from_address(address)
    return np.frombuffer(memoryview(buffer), dtype=numpy_dtype).reshape(shape).copy()


def _evaluate(dim: int | str, symbols: dict[str, int]) -> int:
    """A dimension: a number, a symbol, or symbols and numbers joined by ``+``."""
    if isinstance(dim, int):
        return dim
    return sum(int(t) if t.strip().isdigit() else symbols[t.strip()] for t in dim.split("+"))
