"""What a loaded model need not keep resident.

Loading frees far more than it keeps (dequantized temporaries, float copies, a
tokenizer's conversion). glibc keeps freed heap pages unless asked, and they would
count as the server's memory; the loaders call ``release_freed_memory`` once their
temporaries are gone. A server also lets go of the plain copies of matrices that run
packed (``release_plain_weights``), and of an input embedding whose rows a tied head's
native packing (``read_embedding_from_head``) or the weights file
(``read_embedding_from_file``) holds. A ``runtime.runner.batched.BatchedLM`` calls these over
its ``runtime.runner.stack.Stack``. A server maps its large allocations apart
(``map_large_allocations``), so that what a burst of requests freed leaves its RSS."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from runtime.matrices.weights import Matrix, drop_weight, linear_modules
from runtime.models.skeleton import Embedding
from runtime.runner import fused
from runtime.runner.stack import Stack

EMBEDDING_KEY = "model.embed_tokens.weight"
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
COMPARED_ROWS = 4096  # rows compared at a time when checking a file's table


def release_freed_memory() -> None:
    """Collect garbage, then return the C heap's free pages to the system (glibc's
    ``malloc_trim``; elsewhere nothing)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# a C allocation this large or larger gets a mapping of its own, unmapped when freed
MMAP_THRESHOLD_BYTES = 4 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def map_large_allocations(size: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Give every C allocation of ``size`` bytes or more a mapping of its own, handed back
    to the system when freed. glibc's own threshold starts at 128 KiB and rises to the
    largest mapped block freed (up to 32 MiB); past that, a batched round's logits (tens
    of MiB) come from the heap, whose freed pages stay resident: a server's RSS rose in
    steps of 20-40 MiB over crowds of clients and never came back down (docs/
    reliability.md). A fixed threshold also stops the rise; at 4 MiB a 1.5B's one-sequence
    round (its logits: 0.6-3 MiB) stays on the heap; decoding is as fast either way
    (specbench/malloc_policy.py). ``MALLOC_MMAP_THRESHOLD_`` in the environment (the
    operator's choice) wins. Returns whether it was set here."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, size))
    except (OSError, AttributeError):  # not glibc: its allocator's own policy stands
        return False


def release_plain_weights(stack: Stack) -> int:
    """Keep only what ``stack``'s products read; returns the bytes of plain rows let go.

    A float matrix multiplied through oneDNN's packed copy (``weights.Matrix``) also
    holds its plain rows, and the model's modules hold views of them or of the
    weights file's mapping: a second copy of every such matrix. Those rows go and
    the modules move to the meta device; a tied head's input embedding reads its rows
    from the weights file (``read_embedding_from_file``) where it can; what the model
    still holds (the input embedding otherwise, the norms) is copied out of the file's
    mapping, so the mapping goes too. The model can no longer run its own (transformers)
    forward pass, which the batched runner never does: a server calls this once its
    drafts are loaded. Quantized matrices hold no plain copy: nothing to do."""
    released = 0
    for w, layer in zip(stack.weights, stack.layers, strict=True):
        for name, modules in linear_modules(layer).items():
            product = getattr(w, name)
            if isinstance(product, Matrix) and product.release_rows():
                released += product.nbytes
                for module in modules:
                    drop_weight(module)
    if not released:
        return 0
    model, embed = stack.model, stack.inner.embed_tokens
    head, matrix = model.get_output_embeddings(), stack.head
    if (isinstance(matrix, Matrix) and matrix.release_rows() and head is not None
            and (head.weight is not embed.weight
                 or read_embedding_from_head(embed, matrix)
                 or read_embedding_from_file(embed, getattr(model, "weight_files", ())))):
        released += matrix.nbytes  # an untied head's own weight, or a tied one's table
        drop_weight(head)

    def key(t: torch.Tensor) -> tuple[int, tuple[int, ...]]:  # a tie stays one copy
        return t.data_ptr(), tuple(t.shape)

    copies: dict[tuple[int, tuple[int, ...]], nn.Parameter] = {}
    for part in model.modules():
        for name, param in list(part.named_parameters(recurse=False)):
            if param.device.type == "cpu":
                if key(param) not in copies:
                    copies[key(param)] = nn.Parameter(param.detach().clone(),
                                                      requires_grad=False)
                setattr(part, name, copies[key(param)])
    if isinstance(matrix, Matrix) and matrix.rows is not None and key(matrix.rows) in copies:
        matrix.rows = copies[key(matrix.rows)].detach()  # a head that does not run packed
    if stack.kernels is not None:  # (the loop holds the norms: made anew with them)
        stack.norms = fused.norm_weights(model, stack.dtype)
        stack.layer_stack = fused.layer_stack(stack.kernels, stack.norms, stack)
    release_freed_memory()
    return released


def read_embedding_from_head(embed: nn.Module, head: Matrix) -> bool:
    """Let the input embedding ``embed`` look its rows up in the tied ``head``'s native
    packing (``Matrix.take``) rather than hold the table: whether it now does. The
    packing was made from the table itself, in its dtype, so every row is bitwise the
    table's; a lookup gathers from memory, where a file read takes a system call a row,
    and a GGUF served ``--quantize none`` has no safetensors file to read."""
    if (not isinstance(embed, Embedding) or embed.rows is not None or head.dense is None
            or head.dense.dtype != embed.weight.dtype
            or head.out_features != embed.weight.shape[0]):
        return False
    embed.read_rows_from(head.take)
    return True


def read_embedding_from_file(embed: nn.Module, files: Sequence[Path]) -> bool:
    """Let the input embedding ``embed`` read its rows from the safetensors file of
    ``files`` it was filled from (``FileRows``) rather than hold the table: whether it
    now does.

    A tied head multiplied packed (``weights.Matrix``) otherwise keeps the table twice,
    once packed and once as the embedding (57 MB each for the default model in bfloat16,
    113 MB in float32). A pass looks up a few rows (a prompt chunk: at most its length),
    read from the file as they are: the operating system's cache keeps the file's
    pages, not the process, so nothing grows with the tokens served (a mapping would:
    the pages it reads stay the process's). The file's rows converted to the embedding's
    dtype are checked bitwise against the table first."""
    if not isinstance(embed, Embedding) or embed.rows is not None:
        return False
    weight = embed.weight.detach()
    for file in files:
        rows = FileRows.open(file, EMBEDDING_KEY)
        if rows is not None:
            break
    else:
        return False
    vocab = weight.shape[0]
    if rows.shape != tuple(weight.shape) or not all(
            torch.equal(rows.span(lo, min(lo + COMPARED_ROWS, vocab)).to(weight.dtype),
                        weight[lo : lo + COMPARED_ROWS])
            for lo in range(0, vocab, COMPARED_ROWS)):
        rows.close()
        return False
    embed.read_rows_from(rows)
    return True


class FileRows:
    """A ``[rows, columns]`` tensor of a safetensors file, read a row at a time from the
    file as rows are asked for (``rows(ids)`` -> ``[..., columns]`` in the file's dtype).
    A file cut short raises ``OSError`` for the lookup that finds it so."""

    def __init__(self, file: Path, offset: int, shape: tuple[int, int],
                 dtype: torch.dtype) -> None:
        self.file, self.offset, self.shape, self.dtype = file, offset, shape, dtype
        self.row_bytes = shape[1] * dtype.itemsize
        self._fd: int | None = os.open(file, os.O_RDONLY)

    @classmethod
    def open(cls, file: Path, name: str) -> FileRows | None:
        """The matrix ``name`` of ``file``; None where the file lacks it or stores it in a
        dtype or shape not read here."""
        with open(file, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            entry = json.loads(f.read(size)).get(name)
        if (entry is None or entry.get("dtype") not in SAFETENSORS_DTYPES
                or len(entry.get("shape", ())) != 2):
            return None
        rows, columns = (int(n) for n in entry["shape"])
        return cls(file, 8 + size + int(entry["data_offsets"][0]), (rows, columns),
                   SAFETENSORS_DTYPES[entry["dtype"]])

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).tolist()
        out = torch.empty((len(flat), self.shape[1]), dtype=self.dtype)
        view = out.view(torch.uint8).reshape(-1).numpy().data
        for i, row in enumerate(flat):
            if not 0 <= row < self.shape[0]:
                raise IndexError(f"row {row} out of range for {self.shape[0]} rows")
            self._read(view[i * self.row_bytes : (i + 1) * self.row_bytes], row)
        return out.view(*ids.shape, self.shape[1])

    def span(self, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo`` to ``hi`` (``[hi - lo, columns]``), in one read."""
        out = torch.empty((hi - lo, self.shape[1]), dtype=self.dtype)
        self._read(out.view(torch.uint8).reshape(-1).numpy().data, lo)
        return out

    def _read(self, into: memoryview, row: int) -> None:
        if self._fd is None:
            raise ValueError(f"{self.file}: closed")
        if os.preadv(self._fd, [into], self.offset + row * self.row_bytes) != into.nbytes:
            raise OSError(f"{self.file} is shorter than its header says")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()
