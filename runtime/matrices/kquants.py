"""GGUF's K-quant matrices (Q4_K, Q5_K, Q6_K) as the file holds them, multiplied natively.

A ``KQuantMatrix`` packs the file's super-blocks of 256 inputs per tile of 16 output rows
in exactly the file's bytes (``csrc/kquant_products.cpp``), and multiplies int8-quantized
activations with the file's own scales: ``d * sc * q - dmin * m`` (Q4_K, Q5_K), ``d * sc *
(q - 32)`` (Q6_K). Its rows may come from tensors of different K-quant types (a fused
q/k/v whose v is Q6_K where q and k are Q4_K): each part is a segment of the packing, and
one call multiplies them all. Every instruction-set level computes the same bits
(docs/quantization.md, "K-quant products").
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch

from runtime.matrices.quantized import ACTIVATIONS

# GGML's numbers for the types, by name
TYPES = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
SUPER_BLOCK = 256  # inputs a super-block
TILE = 16  # output rows a tile


def raw_rows(data: np.ndarray) -> torch.Tensor:  # [out, bytes a row] uint8
    """A tensor's bytes (a view of the mapped file) as a torch tensor without a copy; the
    packing only reads them."""
    with warnings.catch_warnings():  # (a read-only mapping: torch warns it is not writable)
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(data))


class KQuantMatrix:
    """Rows of K-quant tensors (each part: its type's name and its rows' bytes ``[out,
    bytes a row]`` as the file stores them), packed for the native ``kquant_product``; called
    like ``weights.Matrix`` (``m(x)``: ``[T, in]`` -> ``[T, out]``, in bfloat16). A token's
    result depends on that token alone, at any row count."""

    def __init__(self, native: ModuleType, parts: Sequence[tuple[str, torch.Tensor]],
                 in_features: int, bias: torch.Tensor | None = None) -> None:
        if in_features % SUPER_BLOCK:
            raise ValueError(f"K-quant rows hold whole super-blocks of {SUPER_BLOCK} inputs; "
                             f"got {in_features}")
        packed, layout, offset = [], [], 0
        for kind, rows in parts:
            if kind not in TYPES:
                raise ValueError(f"{kind} is not a K-quant type ({', '.join(TYPES)})")
            size = native.kquant_block_bytes(TYPES[kind])
            if rows.dim() != 2 or rows.shape[1] != in_features // SUPER_BLOCK * size:
                raise ValueError(f"{kind} rows of {in_features} inputs are "
                                 f"{in_features // SUPER_BLOCK * size} bytes; got "
                                 f"{tuple(rows.shape)}")
            part = native.kquant_pack(rows.contiguous(), TYPES[kind])
            layout.append((TYPES[kind], rows.shape[0], offset))
            offset += part.numel()
            packed.append(part)
        self.packed = packed[0] if len(packed) == 1 else torch.cat(packed)
        self.layout = torch.tensor(layout, dtype=torch.int64)  # [segments, 3]
        self.kinds = [kind for kind, _ in parts]
        self.out_features = sum(int(rows.shape[0]) for _, rows in parts)
        self.in_features = in_features
        self.bias = bias.to(ACTIVATIONS) if bias is not None else None
        self._native = native

    @property
    def nbytes(self) -> int:
        """The bytes a product reads: the file's, where each part's rows fill whole tiles."""
        return int(self.packed.nbytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        y: torch.Tensor = self._native.kquant_product(x.to(ACTIVATIONS).contiguous(),
                                                      self.packed, self.layout, self.bias)
        return y

    def bulk(self, x: torch.Tensor) -> torch.Tensor:  # as fast as a dense product here
        return self(x)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``dequantize()[ids].to(dtype)``, reading only those rows' bytes; ``[n, in]``."""
        out: torch.Tensor = self._native.kquant_rows(self.packed, self.layout, ids,
                                                     self.in_features, dtype)
        return out

    def dequantize(self) -> torch.Tensor:  # [out, in] float32
        """The file's dequantization of every row, as gguf-py computes it."""
        return self.rows(torch.arange(self.out_features))


class KQuantEmbedding(torch.nn.Module):
    """An input embedding read from a ``KQuantMatrix`` of its rows: each looked-up row is
    the file's dequantization in float32, then cast to ``dtype``, bitwise the row of the
    dequantized table, which is never held (467 MB in bfloat16 for Qwen2.5's 151,936 x
    1,536)."""

    def __init__(self, matrix: KQuantMatrix, dtype: torch.dtype = ACTIVATIONS) -> None:
        super().__init__()
        self.matrix = matrix
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = matrix.out_features, matrix.in_features
        # no weights of its own: an empty parameter tells whoever asks the model's first
        # parameter its device and dtype
        self.anchor = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., hidden]
        flat = self.matrix.rows(ids.reshape(-1), self.dtype)
        return flat.view(*ids.shape, self.embedding_dim)
