"""What a loaded model need not keep resident.

Loading frees far more than it keeps (a GGUF reader's metadata objects, dequantized
temporaries, float copies). glibc keeps freed heap pages unless asked, and they would
count as the server's memory; the loaders call ``release_freed_memory`` once their
temporaries are gone. A server also lets go of the plain copies of matrices that run
packed (``release_plain_weights``)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
from typing import TYPE_CHECKING

import torch
from torch import nn

from decoding import fused
from decoding.weights import Matrix, drop_weight, linear_modules

if TYPE_CHECKING:
    from decoding.batched import BatchedLM


def release_freed_memory() -> None:
    """Collect garbage, then return the C heap's free pages to the system (glibc's
    ``malloc_trim``; elsewhere nothing)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def release_plain_weights(runner: BatchedLM) -> int:
    """Keep only what ``runner``'s products read; returns the bytes of plain rows let go.

    A float matrix multiplied through oneDNN's packed copy (``weights.Matrix``) also
    holds its plain rows, and the model's modules hold views of them or of the
    weights file's mapping: a second copy of every such matrix. Those rows go and
    the modules move to the meta device; what the model still holds (the input
    embedding, the norms) is copied out of the file's mapping, so the mapping goes
    too. The model can no longer run its own (transformers) forward pass, which this
    runner never does: a server calls this once its drafts are loaded. Quantized
    matrices hold no plain copy: nothing to do."""
    released = 0
    for w, layer in zip(runner._weights, runner._layers, strict=True):
        for name, modules in linear_modules(layer).items():
            product = getattr(w, name)
            if isinstance(product, Matrix) and product.release_rows():
                released += product.nbytes
                for module in modules:
                    drop_weight(module)
    if not released:
        return 0
    def key(t: torch.Tensor) -> tuple[int, tuple[int, ...]]:  # a tie stays one copy
        return t.data_ptr(), tuple(t.shape)

    copies: dict[tuple[int, tuple[int, ...]], nn.Parameter] = {}
    for module in runner.model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.device.type == "cpu":
                if key(param) not in copies:
                    copies[key(param)] = nn.Parameter(param.detach().clone(),
                                                      requires_grad=False)
                setattr(module, name, copies[key(param)])
    head, matrix = runner.model.get_output_embeddings(), runner._head
    if isinstance(matrix, Matrix):
        if matrix.release_rows():
            if head is not None and head.weight is not runner._inner.embed_tokens.weight:
                released += matrix.nbytes  # an untied head's own weight
                drop_weight(head)
        elif matrix.rows is not None and key(matrix.rows) in copies:
            matrix.rows = copies[key(matrix.rows)].detach()
    if runner._kernels is not None:
        runner._norms = fused.norm_weights(runner.model, runner.dtype)
    release_freed_memory()
    return released
