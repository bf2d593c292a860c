"""The layout the native kernels' ``dense_product`` reads a float32 or bfloat16 matrix in
(``weights.Matrix.use_native``): groups of ``ROWS`` output rows, each group input by input,
so one token streams the matrix once with the group's 64 sums side by side
(docs/performance.md, "Dense products")."""

from __future__ import annotations

import torch

ROWS = 64  # output rows packed together (csrc/kernels.h kDenseRows)


def pack(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` ``[out, in]`` as the native ``dense_product`` reads them: groups of
    ``ROWS`` output rows (the last padded with zeros), each input by input: float32
    ``[groups, in, 64]``; bfloat16 ``[groups, in / 2, 64, 2]``, each row's inputs in pairs.
    Copied straight into place: no padded or transposed copy of the whole matrix."""
    out, inputs = rows.shape
    groups, full, rest = -(-out // ROWS), out // ROWS, out % ROWS
    pairs = rows.dtype == torch.bfloat16

    def layout(part: torch.Tensor, n: int, width: int) -> torch.Tensor:  # [n, width, in]
        if pairs:
            return part.view(n, width, inputs // 2, 2).permute(0, 2, 1, 3)
        return part.view(n, width, inputs).transpose(1, 2)

    shape = (groups, inputs // 2, ROWS, 2) if pairs else (groups, inputs, ROWS)
    packed = rows.new_zeros(shape) if rest else rows.new_empty(shape)
    if full:
        packed[:full] = layout(rows[: full * ROWS], full, ROWS)
    if rest:  # the rows' axis is the third in either layout
        packed[full:, :, :rest] = layout(rows[full * ROWS :], 1, rest)
    return packed


def unpack(packed: torch.Tensor, out: int) -> torch.Tensor:
    """The ``[out, in]`` rows ``pack`` packed."""
    if packed.dim() == 4:
        groups, pairs = packed.shape[:2]
        return (packed.permute(0, 2, 1, 3).reshape(groups * ROWS, 2 * pairs)[:out]
                .contiguous())
    groups, inputs = packed.shape[:2]
    return packed.transpose(1, 2).reshape(groups * ROWS, inputs)[:out].contiguous()


def take(packed: torch.Tensor, out: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (``[...]``) of the ``[out, in]`` matrix ``pack`` packed, ``[..., in]``,
    gathered from the packing."""
    flat = ids.reshape(-1)
    if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < out:
        raise IndexError(f"a row id out of range for {out} rows")
    group, column = flat // ROWS, flat % ROWS
    if packed.dim() == 4:  # bfloat16: [groups, in / 2, 64, 2]
        rows = packed[group, :, column, :].reshape(flat.numel(), -1)
    else:
        rows = packed[group, :, column]
    return rows.reshape(*ids.shape, rows.shape[-1])
