"""Weight-only quantized matrices: int4 in groups along the input, int8 per output channel,
and block matrices (4- or 8-bit codes with a scale and minimum per 32 inputs).

All are called like ``weights.Matrix`` (``m(x)``, ``x`` ``[T, in]`` -> ``[T, out]``). Int4
and int8 run PyTorch's CPU weight-only kernels with bfloat16 activations (their float32
paths are slow fallbacks); block matrices the native kernels' products with int8
activations (a GGUF's Q4_0, Q4_1, Q8_0 and Q5_0 tensors exactly as the file holds them;
its K-quants are ``runtime.matrices.kquants``' matrices, and only its Q5_1 and float tensors are
widened to bfloat16). The kernels compute each row of a product on its own, at any row
count, so a token's logits do not depend on what else shares the pass. ``bulk`` (a long
prompt chunk) dequantizes an int4 or int8 matrix to bfloat16 once per call and takes the
ordinary product, faster from a few hundred tokens on. Method and figures:
docs/quantization.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import functional as F

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

INT4_GROUP = 32  # weights sharing a scale and a zero along the input dimension
INT4_TILES = 2  # the kernel's inner K tiles (K must be a multiple of 16 x this)
PACK_ROWS = 64  # the CPU packing interleaves blocks of up to 64 output rows
ACTIVATIONS = torch.bfloat16
METHODS = ("none", "int8", "int4")


@dataclass(frozen=True)
class Int4Rows:
    """An int4 matrix before packing: ``codes * scale + low`` per group of ``group``
    inputs (``low`` the group's minimum), as Q4_0/Q4_1/Q4_K and ``quantize_int4`` give."""

    codes: torch.Tensor  # [out, in] uint8 in 0..15
    scale: torch.Tensor  # [out, in / group] float32
    low: torch.Tensor  # [out, in / group] float32
    group: int = INT4_GROUP

    def dequantize(self) -> torch.Tensor:  # [out, in] float32
        g = self.group
        return (self.codes.float() * self.scale.repeat_interleave(g, 1)
                + self.low.repeat_interleave(g, 1))

    @staticmethod
    def cat(parts: list[Int4Rows]) -> Int4Rows:
        """The rows of ``parts`` stacked (a fused q/k/v or gate/up)."""
        if len({p.group for p in parts}) != 1:
            raise ValueError("int4 parts with different group sizes cannot be fused")
        return Int4Rows(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                        torch.cat([p.low for p in parts]), parts[0].group)

    def take(self, rows: torch.Tensor) -> Int4Rows:  # rows: [n] indices
        return Int4Rows(self.codes[rows], self.scale[rows], self.low[rows], self.group)


@functools.cache
def packed_block_rows() -> int:
    """How many output rows PyTorch's CPU int4 packing interleaves: it depends on the
    instruction set its kernel runs (64 with AVX-512, 32 with AVX2), so it is read off
    a probe: one code set at row 32, input 0, found where each block size puts it."""
    probe = torch.zeros(PACK_ROWS, 16 * INT4_TILES, dtype=torch.int32)
    probe[32, 0] = 1
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, INT4_TILES).reshape(-1)
    for rows in (64, 32, 16):
        block, d = divmod(32, rows)
        byte = block * probe.shape[1] * (rows // 2) + d % (rows // 2)
        if int(packed[byte]) == (1 << 4 if d >= rows // 2 else 1):
            return rows
    raise RuntimeError("PyTorch's int4 packing has a layout this runtime does not read")


class Int4Matrix:
    """A matrix of 4-bit codes with a bfloat16 scale and zero per group of inputs, in
    the CPU kernel's packed layout (``(q - 8) * scale + zero``: zero = low + 8 scale)."""

    def __init__(self, rows: Int4Rows, bias: torch.Tensor | None = None) -> None:
        out, inputs = rows.codes.shape
        if inputs % (16 * INT4_TILES) or inputs % rows.group:
            raise ValueError(f"int4 needs an input size divisible by {16 * INT4_TILES} and "
                             f"the group {rows.group}; got {inputs}")
        self.out_features, self.in_features, self.group = out, inputs, rows.group
        padded = -(-out // PACK_ROWS) * PACK_ROWS  # the packing wants whole row blocks
        codes = F.pad(rows.codes.to(torch.int32), (0, 0, 0, padded - out))
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INT4_TILES)
        zero = rows.low + 8 * rows.scale
        pairs = torch.stack([rows.scale, zero], dim=-1)  # [out, groups, 2]
        pairs = F.pad(pairs, (0, 0, 0, 0, 0, padded - out))
        self.scales_zeros = pairs.transpose(0, 1).contiguous().to(ACTIVATIONS)  # [groups, out, 2]
        self.bias = bias.to(ACTIVATIONS) if bias is not None else None
        self._padded = padded

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        x = x.to(ACTIVATIONS)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group,
                                                       self.scales_zeros)
        if self._padded != self.out_features:
            y = y[:, : self.out_features]
        return y + self.bias if self.bias is not None else y

    def bulk(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out], T large
        return F.linear(x.to(ACTIVATIONS), self.dequantize(), self.bias)

    def codes(self) -> torch.Tensor:  # [out, in] uint8: the 4-bit codes, unpacked
        # the layout: [out / B, in, B / 2] bytes; the low nibble holds row d of each block
        # of B rows, the high nibble row B / 2 + d (B: ``packed_block_rows``)
        rows = packed_block_rows()
        blocks = self.packed.view(self._padded // rows, self.in_features, rows // 2)
        halves = torch.cat([blocks & 15, blocks >> 4], dim=2)  # [out / B, in, B]
        return halves.transpose(1, 2).reshape(self._padded, self.in_features)[
            : self.out_features]

    def dequantize(self) -> torch.Tensor:  # [out, in] in bfloat16, what the kernel multiplies
        pairs = self.scales_zeros[:, : self.out_features].transpose(0, 1)  # [out, groups, 2]
        scale = pairs[..., 0].repeat_interleave(self.group, 1)
        zero = pairs[..., 1].repeat_interleave(self.group, 1)
        return ((self.codes().to(ACTIVATIONS) - 8) * scale + zero).to(ACTIVATIONS)


class BlockMatrix:
    """A matrix of 4- or 8-bit codes with a float16 scale and minimum per block of 32
    inputs (``code * scale + low``), multiplied by the native kernels' ``block_product``:
    each token's activations are quantized to int8 per block of 32, as llama.cpp does,
    and AVX512-VNNI (or AVX2) sums the block exactly in int32 (docs/quantization.md, "Int8
    activations"). A row's result depends on that row alone, at any row count."""

    def __init__(self, native: ModuleType, codes: torch.Tensor, scale: torch.Tensor,
                 low: torch.Tensor, bits: int, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = codes.shape
        self.bits = bits
        self.packed = native.block_pack(codes.contiguous(), scale.float().contiguous(),
                                        low.float().contiguous(), bits)
        self.bias = bias.to(ACTIVATIONS) if bias is not None else None
        self._native = native

    @classmethod
    def int4(cls, native: ModuleType, rows: Int4Rows, bias: torch.Tensor | None = None
             ) -> BlockMatrix:
        if rows.group != 32:
            raise ValueError(f"block matrices take groups of 32 inputs; got {rows.group}")
        return cls(native, rows.codes, rows.scale, rows.low, 4, bias)

    @classmethod
    def int8(cls, native: ModuleType, codes: torch.Tensor, scale: torch.Tensor,
             bias: torch.Tensor | None = None) -> BlockMatrix:
        """Signed 8-bit codes ``[out, in]`` with a scale per block of 32 (a GGUF's Q8_0):
        held as code + 128 with the minimum -128 scale."""
        unsigned = (codes.to(torch.int16) + 128).to(torch.uint8)
        return cls(native, unsigned, scale, -128 * scale.float(), 8, bias)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return self._native.block_product(x.to(ACTIVATIONS).contiguous(), self.packed,
                                          self.out_features, self.bits, self.bias)

    def bulk(self, x: torch.Tensor) -> torch.Tensor:  # as fast as a dense product here
        return self(x)

    def _tiles(self) -> torch.Tensor:  # [tiles of 16 rows, blocks of 32 inputs, bytes]
        return self.packed.view(-(-self.out_features // 16), self.in_features // 32, -1)

    def codes(self) -> torch.Tensor:  # [out, in] uint8, as given (8-bit: code + 128)
        tiles = self._tiles()
        n, blocks = tiles.shape[0], tiles.shape[1]
        if self.bits == 4:  # [tile, block, group j, row, 4 inputs]; high nibbles: j + 4
            groups = tiles[:, :, :256].reshape(n, blocks, 4, 16, 4)
            groups = torch.cat([groups & 15, groups >> 4], dim=2)
        else:
            groups = tiles[:, :, :512].reshape(n, blocks, 8, 16, 4)
        codes = groups.permute(0, 3, 1, 2, 4).reshape(n * 16, self.in_features)
        return codes[: self.out_features]

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each block's float16 scale and minimum, ``[out, in / 32]`` each."""
        tiles = self._tiles()
        size = tiles.shape[2]

        def part(lo: int) -> torch.Tensor:
            half = tiles[:, :, lo : lo + 32].contiguous().view(torch.float16)  # [n, blocks, 16]
            return half.permute(0, 2, 1).reshape(-1, tiles.shape[1])[: self.out_features]

        return part(size - 64), part(size - 32)

    def dequantize(self) -> torch.Tensor:  # [out, in] float32: what a product multiplies by
        scale, low = (s.float().repeat_interleave(32, 1) for s in self.scales())
        return self.codes().float() * scale + low

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``dequantize()[ids].to(dtype)``, reading only those rows' bytes; ``[n, in]``."""
        return self._native.block_rows(self.packed, ids, self.out_features, self.in_features,
                                       self.bits, dtype)


class BlockEmbedding(torch.nn.Module):
    """An input embedding read from a ``BlockMatrix`` of its rows (a GGUF's tied head):
    each looked-up row dequantized in float32, then cast to ``dtype``. Where the file's
    dequantization is ``code * scale + low`` exactly (Q4_0, Q4_1, Q8_0), that is bitwise
    the row of the dequantized table, which is then never held (54 MB for the default
    model in bfloat16)."""

    def __init__(self, matrix: BlockMatrix, dtype: torch.dtype = ACTIVATIONS) -> None:
        super().__init__()
        self.matrix = matrix
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = matrix.out_features, matrix.in_features
        # no weights of its own: an empty parameter still tells whoever asks the model's
        # first parameter (CausalLM, a draft sharing the embedding) its device and dtype
        self.anchor = torch.nn.Parameter(torch.empty(0, dtype=dtype,
                                                     device=matrix.packed.device),
                                         requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., hidden]
        flat = self.matrix.rows(ids.reshape(-1), self.dtype)
        return flat.view(*ids.shape, self.embedding_dim)


def block_kernels(native: ModuleType | None, int8_activations: bool) -> ModuleType | None:
    """``native`` (the kernels module; every level has block products) where int8
    activations are wanted, else None (the matrices stay PyTorch's int4/int8/bfloat16
    ones)."""
    if native is None or not int8_activations:
        return None
    return native


class Int8Matrix:
    """A matrix of int8 codes with a bfloat16 scale per output row (symmetric)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        self.weight = codes.to(torch.int8).contiguous()  # [out, in]
        self.scales = scales.to(ACTIVATIONS).contiguous()  # [out]
        self.bias = bias.to(ACTIVATIONS) if bias is not None else None
        self.out_features, self.in_features = self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        x = x.to(ACTIVATIONS)
        y = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)
        return y + self.bias if self.bias is not None else y

    def bulk(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out], T large
        return F.linear(x.to(ACTIVATIONS), self.dequantize(), self.bias)

    def dequantize(self) -> torch.Tensor:  # [out, in] bfloat16
        return self.weight.to(ACTIVATIONS) * self.scales[:, None]


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> Int4Rows:
    """Asymmetric round-to-nearest: each group of ``group`` inputs of a row maps its
    [min, max] onto the codes 0..15 (scale = (max - min) / 15)."""
    out, inputs = weight.shape  # [out, in]
    w = weight.detach().float().view(out, inputs // group, group)
    low = w.amin(dim=-1)
    high = w.amax(dim=-1)
    scale = ((high - low) / 15).clamp_min(1e-12)
    # the scale as the kernel will hold it, so the codes are chosen for what runs
    scale = scale.to(ACTIVATIONS).float()
    codes = torch.round((w - low[..., None]) / scale[..., None]).clamp_(0, 15)
    return Int4Rows(codes.to(torch.uint8).view(out, inputs), scale, low, group)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest per output row: codes -127..127 and scale = max|w| / 127."""
    w = weight.detach().float()  # [out, in]
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12).to(ACTIVATIONS).float()
    codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def quantized(weight: torch.Tensor, bias: torch.Tensor | None, method: str,
              blocks: ModuleType | None = None) -> Int4Matrix | Int8Matrix | BlockMatrix:
    """``weight`` (``[out, in]``) quantized by ``method`` (int4 or int8); int4 as a
    ``BlockMatrix`` when ``blocks`` (``block_kernels``) is given."""
    if method == "int4":
        rows = quantize_int4(weight)
        if blocks is not None:
            return BlockMatrix.int4(blocks, rows, bias)
        return Int4Matrix(rows, bias)
    if method == "int8":
        return Int8Matrix(*quantize_int8(weight), bias)
    raise ValueError(f"unknown quantization {method!r}; choose one of {list(METHODS)}")


def load_quantized(path: str, method: str, device: str = "cpu"
                   ) -> tuple[Any, PreTrainedTokenizerBase]:
    """A model directory's model in bfloat16 (its matrices to be quantized by ``method``)
    and its tokenizer."""
    from runtime.models import checkpoints

    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose one of "
                         f"{['auto', *METHODS]}")
    return checkpoints.pretrained(path, str(ACTIVATIONS).removeprefix("torch."), device)
