"""A GGUF file's tensor records and the metadata the loader needs, read without building
its other metadata.

gguf's ``GGUFReader`` makes an array object for every entry of every metadata array: a
262k-token vocabulary took it 12 s here (the default model's 49k, 2.8 s) and ~160 MB
while it lived. The loader needs the tensors' names, types, shapes and bytes, and a few
values (the architecture), so this reader steps over the rest by its lengths. Tensors are
views of the mapped file, shaped as ``GGUFReader`` shapes them (``tests/test_gguf.py``
checks both readers agree).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

MAGIC = b"GGUF"
# metadata value types: the size of each scalar type, by its number (8: string, 9: array)
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                  10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32
# tensor types stored as numbers (not blocks), by their numpy type
PLAIN_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
               "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class Tensor:
    """A GGUF tensor record."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # GGUF order: inputs first
    data: np.ndarray  # a view of the mapped file: numbers, or [..., bytes per row] of blocks


@dataclass(frozen=True)
class GGUFFile:
    values: dict[str, Any]  # the scalar and string metadata (arrays are stepped over)
    tensors: dict[str, Tensor]


class _Cursor:
    def __init__(self, buffer: np.ndarray, where: str) -> None:
        self.buffer, self.offset, self.where = buffer, 0, where

    def take(self, size: int) -> bytes:
        end = self.offset + size
        if end > len(self.buffer):
            raise ValueError(f"{self.where}: the file ends inside its header (truncated?)")
        data = self.buffer[self.offset : end].tobytes()
        self.offset = end
        return data

    def scalar(self, kind: int) -> Any:
        if kind == STRING:
            return self.take(self.scalar(10)).decode("utf-8", errors="replace")
        if kind not in SCALAR_FORMATS:
            raise ValueError(f"{self.where}: unknown metadata value type {kind}")
        return struct.unpack(SCALAR_FORMATS[kind], self.take(SCALAR_SIZES[kind]))[0]

    def skip_array(self) -> None:
        kind, count = self.scalar(4), self.scalar(10)
        if kind == STRING:
            for _ in range(count):
                length = self.scalar(10)  # (read before the offset it moves is added to)
                self.offset += length
        elif kind == ARRAY:
            for _ in range(count):
                self.skip_array()
        elif kind in SCALAR_SIZES:
            self.offset += SCALAR_SIZES[kind] * count
        else:
            raise ValueError(f"{self.where}: unknown metadata array type {kind}")


def read(path: Path) -> GGUFFile:
    """The file's tensors and its scalar metadata (``general.architecture``...)."""
    import gguf

    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(buffer, path.name)
    if cursor.take(4) != MAGIC:
        raise ValueError(f"{path.name} is not a GGUF file (no GGUF magic)")
    version = cursor.scalar(4)
    if version not in (2, 3):
        raise ValueError(f"{path.name}: GGUF version {version} (this server reads 2 and 3)")
    tensor_count, value_count = cursor.scalar(10), cursor.scalar(10)
    values: dict[str, Any] = {}
    for _ in range(value_count):
        key, kind = cursor.scalar(STRING), cursor.scalar(4)
        if kind == ARRAY:
            cursor.skip_array()
        else:
            values[key] = cursor.scalar(kind)
    records = []
    for _ in range(tensor_count):
        name, dims = cursor.scalar(STRING), cursor.scalar(4)
        shape = np.array([cursor.scalar(10) for _ in range(dims)], dtype=np.uint64)
        records.append((name, shape, cursor.scalar(4), cursor.scalar(10)))
    alignment = int(values.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cursor.offset // alignment) * alignment
    tensors: dict[str, Tensor] = {}
    for name, shape, kind_id, offset in records:
        kind = gguf.GGMLQuantizationType(kind_id)
        dims = tuple(reversed([int(n) for n in shape]))
        elements = int(np.prod(dims))
        block, size = gguf.GGML_QUANT_SIZES[kind]
        at = start + int(offset)
        plain = PLAIN_TYPES.get(kind.name)
        if plain is not None:
            count, item = elements, np.dtype(plain)
        else:
            count, item = elements * size // block, np.dtype(np.uint8)
            dims = gguf.quants.quant_shape_to_byte_shape(dims, kind)
        end = at + count * item.itemsize
        if end > len(buffer):
            raise ValueError(f"{path.name}: tensor {name!r} lies past the end of the file")
        if name in tensors:
            raise ValueError(f"{path.name}: tensor {name!r} appears twice")
        tensors[name] = Tensor(name, kind, shape, buffer[at:end].view(item).reshape(dims))
    return GGUFFile(values, tensors)
