"""Attention and rotary embedding for the batched runner (``runtime.runner.batched``).

``GroupedAttention.attend`` runs one padded block ``[rows, width]`` of queries against
the cache rows it covers; ``rotate`` applies the rotary embedding to queries and keys at
once. Every op here treats a token (a query, a row of keys) on its own, so a query's
result does not depend on what else is in the block: the reductions run over the
block's key span, which ``runtime.runner.layout`` pads to a multiple of ``SPAN_ALIGN``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

if TYPE_CHECKING:
    from runtime.runner.layout import Layout


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of ``x`` ``[T, heads, D]`` (queries and keys together) with
    the model's ``cos``/``sin`` ``[T, 1, D]`` (two equal halves, as Llama-family rotary
    tables are): ``x cos + rotate_half(x) sin``, computed on the halves."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[..., :half], sin[..., :half]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: seen) as the additive one attention applies, built once per
    pass rather than once per layer."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf"))


class GroupedAttention:
    """Scaled dot-product attention of padded query blocks over cached keys/values,
    with grouped-query heads."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, scaling: float,
                 fold_single: bool) -> None:
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scaling = scaling
        self._fold_single = fold_single

    def folds(self, width: int) -> bool:
        """Whether a block this wide attends with its query heads folded onto their
        shared key/value heads (grouped-query attention, more than one query per row;
        for one query too on a GPU, where PyTorch's masked grouped-query attention takes
        the reference path, which copies every key and value once per query head, and on
        a CPU in bfloat16, where its grouped-query path is slow; in float32 a CPU's
        grouped-query path is the faster for one query)."""
        return self.heads != self.kv_heads and (width > 1 or self._fold_single)

    def mask(self, mask: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
        """A block's ``[R, 1, W, S]`` boolean mask as ``attend`` takes it (folded when
        the block folds: ``[R, 1, g*W, S]``), additive in ``dtype``."""
        if self.folds(width):
            rows, _, queries, span = mask.shape
            group = self.heads // self.kv_heads
            mask = (mask.unsqueeze(2).expand(rows, 1, group, queries, span)
                    .reshape(rows, 1, group * queries, span))
        return additive_mask(mask, dtype)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:  # q [R, W, h, D] -> [R, W, h, D]
        """Attention of a padded block. With several queries per row and grouped-query
        attention, the query heads that share a key/value head become extra queries of
        that head (``[R, kv, g*W, D]``, ``mask`` folded the same way): the keys and
        values are then read once per key/value head, not once per query head."""
        rows, queries, heads, dim = q.shape
        if not self.folds(queries):
            return F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=mask, scale=self.scaling,
                enable_gqa=self.heads != self.kv_heads).transpose(1, 2)
        group = heads // self.kv_heads
        folded = (q.view(rows, queries, self.kv_heads, group, dim).permute(0, 2, 3, 1, 4)
                  .reshape(rows, self.kv_heads, group * queries, dim))
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask,
                                             scale=self.scaling)  # [R, kv, g*W, D]
        return (out.view(rows, self.kv_heads, group, queries, dim).permute(0, 3, 1, 2, 4)
                .reshape(rows, queries, heads, dim))

    def attend_layer(self, batch: Layout, masks: list[torch.Tensor], q: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, firsts: list[int] | None = None) -> torch.Tensor:
        """Store a pass's keys and values in a layer's pools ``keys``/``values``
        ``[blocks, kv, BLOCK, D]`` through the pass's block tables and attend every group
        of ``batch``, each from its key ``firsts[i]`` on (its mask cut to match; default
        0); ``[T, h * D]``."""
        width = self.heads * self.head_dim
        block = keys.shape[2]
        tables, at = batch.tables, batch.cache_slots
        blocks = tables[batch.cache_rows, at // block]
        keys[blocks, :, at % block] = k  # pool[block, :, offset] for each token: [T, kv, D]
        values[blocks, :, at % block] = v
        single = len(batch.groups) == 1
        out = q.new_empty((q.shape[0], width)) if not single else None
        starts = firsts if firsts is not None else [0] * len(batch.groups)
        for group, mask, first in zip(batch.groups, masks, starts, strict=True):
            group_q = q if single else q[group.tokens]
            if batch.contiguous:  # one sequence: no padding but the block's
                n = q.shape[0]
                padded = (torch.cat((q, q.new_zeros((group.width - n, *q.shape[1:]))))
                          if n < group.width else q)  # (its dummy queries: layout.MIN_WIDTH)
            else:
                padded = q.new_zeros((group.n_rows * group.width, self.heads, self.head_dim))
                padded[group.slots] = group_q
            hi = group.lo + group.n_rows
            attended = self.attend(
                padded.view(group.n_rows, group.width, self.heads, self.head_dim),
                spans(keys, tables[group.lo : hi], group.span, first),
                spans(values, tables[group.lo : hi], group.span, first), mask)  # [R, W, h, D]
            attended = attended.reshape(-1, width)[group.slots]
            if out is None:
                return attended
            out[group.tokens] = attended
        assert out is not None
        return out


def spans(pool: torch.Tensor, tables: torch.Tensor, span: int, first: int = 0) -> torch.Tensor:
    """Positions ``first`` (a multiple of the block) to ``span`` of each table row's
    blocks in ``pool`` ``[blocks, kv, BLOCK, D]``, as ``[rows, kv, span - first, D]`` (a
    copy)."""
    block = pool.shape[2]
    rows = pool[tables[:, first // block : span // block]]  # [R, n / BLOCK, kv, BLOCK, D]
    return rows.transpose(1, 2).reshape(rows.shape[0], pool.shape[1], span - first,
                                        pool.shape[3])
