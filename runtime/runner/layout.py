"""Where a batch's tokens go: packed for the matrix products, padded per block for
attention. ``attention_blocks`` decides which additions share a padded block."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.runner.passes import BLOCK, NULL_BLOCK, BatchItem

# Attention spans are padded to a multiple of this many keys (masked): PyTorch 2.13's CPU
# attention reduces over blocks of 512 keys, and a block's reductions round differently
# at different lengths, so a query must see the same whole blocks whether it attends
# alone or beside later drafts; then a verify pass gives bitwise a one-token step's
# logits (docs/performance.md, "Batch invariance"). A pass's block tables reach a
# multiple of it (padded with the null block).
SPAN_ALIGN = 512
FAST_SPAN_ALIGN = 64  # without batch invariance (``--no-batch-invariance``)
GROUP_WIDTH = 16  # additions up to this many tokens may share one padded attention block
# Without batch invariance, from this many tokens of long additions (prompt chunks) in one
# pass their products take the matrices' bulk path (a quantized matrix dequantized once:
# faster there, but a row's result then depends on the call, and a prompt's keys and
# values on how it was chunked beside other prompts); decoding rounds never do
BULK_MIN_TOKENS = 256
# A block has at least this many queries per row (a one-token step gets a masked dummy
# beside its query): PyTorch 2.13's CPU attention computes a row's single query differently
# from the same query among others, so without it a verify pass would not give a one-token
# step's logits (docs/performance.md, "Batch invariance")
MIN_WIDTH = 2
# What one more attention block per layer costs, in (query, key) pairs (docs/performance.md)
BLOCK_OVERHEAD = 4000
# On a GPU a call costs its kernel launches while the pairs are nearly free, so blocks
# merge far more readily there (docs/performance.md)
GPU_BLOCK_OVERHEAD = 250_000


@dataclass(frozen=True)
class Group:
    """Sequences whose attention runs as one padded ``[rows, width]`` block over the
    pass's block-table rows ``lo .. lo + n_rows`` (an item's table row is its index in
    the pass; rows in the block but not in the group get zero queries whose output is
    dropped)."""

    tokens: torch.Tensor  # [t] the group's tokens' indexes in the packed order
    slots: torch.Tensor  # [t] each token's index in the padded [n_rows * width] layout
    mask: torch.Tensor  # [n_rows, 1, width, span] which positions each padded query sees
    query_positions: torch.Tensor  # [n_rows, width] each padded query's position
    lo: int
    n_rows: int
    width: int
    span: int

    @classmethod
    def build(cls, items: Sequence[BatchItem], members: list[int], offsets: list[int],
              device: torch.device, invariant: bool = True) -> Group:
        lo, n_rows = min(members), max(members) + 1 - min(members)
        width = max(MIN_WIDTH if invariant else 1, *(len(items[i].token_ids) for i in members))
        tokens: list[int] = []
        slots: list[int] = []
        starts = [0] * n_rows
        span = 0
        for i in members:
            item = items[i]
            row, start, n = i - lo, item.state.length, len(item.token_ids)
            tokens.extend(range(offsets[i], offsets[i] + n))
            slots.extend(range(row * width, row * width + n))
            starts[row] = start
            span = max(span, start + n)
        align = SPAN_ALIGN if invariant else FAST_SPAN_ALIGN  # see SPAN_ALIGN
        span = -(-span // align) * align
        query_pos = torch.tensor(starts)[:, None] + torch.arange(width)[None, :]  # [R, W]
        keys = torch.arange(span)
        mask = keys[None, None, :] <= query_pos[:, :, None]  # causal, per row
        for i in members:  # an alternative sees the cache and the pending token, and itself
            item = items[i]
            if item.alternative:
                start, n = item.state.length, len(item.token_ids)
                mask[i - lo, n - 1] = (keys <= start) | (keys == start + n - 1)
                query_pos[i - lo, n - 1] = start + 1
        return cls(tokens=torch.tensor(tokens, dtype=torch.long, device=device),
                   slots=torch.tensor(slots, dtype=torch.long, device=device),
                   mask=mask[:, None].to(device), query_positions=query_pos.to(device),
                   lo=lo, n_rows=n_rows, width=width, span=span)

    def window_start(self, window: int) -> int:
        """The first key a sliding-window layer's queries of this group may see, down to a
        multiple of ``SPAN_ALIGN``: the keys before it are masked for every query, and whole
        blocks of them left out change no query's result (PyTorch's attention reduces over
        blocks of that many keys, and a block no query sees adds nothing to any), while a
        long prompt's windowed layers no longer read every key before the window."""
        first = int(self.query_positions.min()) - window + 1
        return max(0, first // SPAN_ALIGN * SPAN_ALIGN)

    def window_mask(self, window: int) -> torch.Tensor:
        """``mask`` for a sliding-window layer: a query sees the keys of the ``window``
        positions up to its own (an alternative's own key, at a later slot, is within)."""
        keys = torch.arange(self.span, device=self.mask.device)
        late = keys[None, None, :] > self.query_positions[:, :, None] - window  # [R, W, S]
        own = keys[None, None, :] > self.query_positions[:, :, None]  # an alternative's key
        return self.mask & (late | own)[:, None]


@dataclass(frozen=True)
class Layout:
    """Where a batch's tokens go: packed for the matrix products, padded per group
    for attention, in blocks as ``attention_blocks`` decides. Long additions (prompt
    chunks) never share a block with short ones (decoding rounds), so a prompt riding
    along in a decoding pass does not pad every other row to its length."""

    ids: torch.Tensor  # [T] token ids, packed
    positions: torch.Tensor  # [T] position of each token in its sequence
    cache_slots: torch.Tensor  # [T] where its keys and values go in its row (its position,
    # but for an alternative: after the tokens before it, at the position of the second)
    cache_rows: torch.Tensor  # [T] the block-table row of each token (its item's index)
    tables: torch.Tensor  # [items, width] each item's KV blocks, padded with the null block
    offsets: list[int]  # where each item's tokens start in the packed order
    groups: list[Group]
    # packed tokens from here on are long additions' taking the bulk products (T: none,
    # always so with invariance); short additions are packed first
    bulk_from: int
    # the pass is one sequence's plain addition: its queries need no padding
    contiguous: bool
    # for the native kernels, which attend without blocks: each token sees the keys
    # [0, limit) of its row, and the key at ``extra`` too when that is >= its limit (an
    # alternative's own key); -1: none
    limits: torch.Tensor  # [T]
    extras: torch.Tensor  # [T]
    positions_end: int | None = None  # one past the largest of ``positions`` (None: none)

    @classmethod
    def build(cls, items: Sequence[BatchItem], device: torch.device,
              invariant: bool = True, native: bool = False) -> Layout:
        """``invariant``: attention blocks as batch invariance needs them (``SPAN_ALIGN``,
        ``MIN_WIDTH``); else the cheapest. ``native``: no attention blocks (the fused
        kernels read ``limits`` and ``extras``)."""
        ids: list[int] = []
        positions: list[int] = []
        cache_slots: list[int] = []
        cache_rows: list[int] = []
        limits: list[int] = []
        extras: list[int] = []
        offsets = [0] * len(items)
        order = sorted(range(len(items)), key=lambda i: len(items[i].token_ids) > GROUP_WIDTH)
        for i in order:  # short additions first (stable)
            item = items[i]
            start, n = item.state.length, len(item.token_ids)
            offsets[i] = len(ids)
            ids.extend(item.token_ids)
            cache_slots.extend(range(start, start + n))
            positions.extend(range(start, start + n - 1) if item.alternative
                             else range(start, start + n))
            if item.alternative:
                positions.append(start + 1)
            cache_rows.extend([i] * n)
            if item.alternative:  # sees the cache and the pending token, and itself
                limits.extend(range(start + 1, start + n))
                limits.append(start + 1)
                extras.extend([-1] * (n - 1) + [start + n - 1])
            else:
                limits.extend(range(start + 1, start + n + 1))
                extras.extend([-1] * n)
        overhead = BLOCK_OVERHEAD if device.type == "cpu" else GPU_BLOCK_OVERHEAD
        groups = [] if native else [Group.build(items, members, offsets, device, invariant)
                                    for members in attention_blocks(items, overhead)]

        short = sum(len(item.token_ids) for item in items if len(item.token_ids) <= GROUP_WIDTH)
        bulk = not invariant and len(ids) - short >= BULK_MIN_TOKENS
        bulk_from = short if bulk else len(ids)
        only = items[0]
        contiguous = len(items) == 1 and not only.alternative
        reach = max(item.state.length + len(item.token_ids) for item in items)
        width = max(len(item.state.blocks) for item in items)
        if not native:  # attention reads whole aligned spans
            align = SPAN_ALIGN if invariant else FAST_SPAN_ALIGN
            width = max(width, -(-reach // align) * align // BLOCK)
        tables = torch.full((len(items), width), NULL_BLOCK, dtype=torch.long)
        for i, item in enumerate(items):
            if item.state.blocks:
                tables[i, : len(item.state.blocks)] = torch.tensor(item.state.blocks)

        # one tensor for the six index lists (one call instead of six: a step's worth)
        table = torch.tensor([ids, positions, cache_slots, cache_rows, limits, extras],
                             dtype=torch.long, device=device)
        return cls(ids=table[0], positions=table[1], cache_slots=table[2],
                   cache_rows=table[3], tables=tables.to(device), offsets=offsets,
                   groups=groups,
                   bulk_from=bulk_from, contiguous=contiguous, limits=table[4],
                   extras=table[5], positions_end=max(positions) + 1 if positions else None)

    def inputs(self, items: Sequence[BatchItem], embed: torch.nn.Module,
               dtype: torch.dtype) -> torch.Tensor | None:
        """The packed rows the layers start from, ``[T, H]``, where an item gives its own
        (``BatchItem.inputs``): the others' tokens embedded by ``embed`` beside them;
        else None (the runner embeds every token)."""
        if all(item.inputs is None for item in items):
            return None
        rows = embed(self.ids).to(dtype)  # [T, H]
        for start, item in zip(self.offsets, items, strict=True):
            if item.inputs is not None:
                rows[start : start + len(item.token_ids)] = item.inputs
        return rows


def attention_blocks(items: Sequence[BatchItem], overhead: int = BLOCK_OVERHEAD
                     ) -> list[list[int]]:
    """How a pass's additions (indexes into ``items``) are split into padded attention
    blocks. A block pads every cache row in its range to its widest addition, and
    attention reads each row's keys and values once per query, so one stream verifying
    8 drafts among 7 one-token streams would make all 8 rows attend with 9 queries.
    Short additions (decoding rounds): of three layouts (one block; one-token rows apart
    from the rest; each longer addition alone) the cheapest by ``_block_cost`` is used
    (the first on ties). Long ones (prompt chunks): each alone, or all in one block when
    that is cheaper (several prompts joining at once, where calls cost more than padding)."""
    short = [i for i, item in enumerate(items) if len(item.token_ids) <= GROUP_WIDTH]
    long = [i for i, item in enumerate(items) if len(item.token_ids) > GROUP_WIDTH]
    blocks: list[list[int]] = []
    if short:
        ones = [i for i in short if len(items[i].token_ids) == 1]
        more = [i for i in short if len(items[i].token_ids) > 1]
        layouts = [[short]]
        if ones and more:
            layouts.append([ones, more])
        if len(more) > 1 or (ones and more):
            layouts.append(([ones] if ones else []) + [[i] for i in more])
        blocks += _cheapest(items, layouts, overhead)
    if long:
        blocks += _cheapest(items, [[[i] for i in long], [long]], overhead)
    return blocks


def _cheapest(items: Sequence[BatchItem], layouts: list[list[list[int]]], overhead: int
              ) -> list[list[int]]:
    return min(layouts, key=lambda blocks: sum(_block_cost(items, b, overhead) for b in blocks))


def _block_cost(items: Sequence[BatchItem], members: list[int], overhead: int) -> int:
    """(query, key) pairs a padded block computes, plus one call's overhead."""
    width = max(len(items[i].token_ids) for i in members)
    span = max(items[i].state.length + len(items[i].token_ids) for i in members)
    return (max(members) + 1 - min(members)) * width * span + overhead


def check_items(items: Sequence[BatchItem], max_context: int, hidden_size: int) -> None:
    """Refuse what no pass can run: a sequence twice or released, an item without tokens,
    an alternative without a draft before it, a context overflow, input rows of the
    wrong shape."""
    if len({id(item.state) for item in items}) != len(items):
        raise ValueError("a sequence appears twice in one batch")
    if any(item.state.released for item in items):
        raise ValueError("a released sequence cannot run")
    if any(not item.token_ids for item in items):
        raise ValueError("every sequence in a batch needs at least one new token")
    if any(item.alternative and len(item.token_ids) < 3 for item in items):
        raise ValueError("an alternative needs the pending token and a draft before it")
    for item in items:
        if item.state.length + len(item.token_ids) > max_context:
            raise ValueError(f"{len(item.token_ids)} tokens after {item.state.length} "
                             f"exceed the context of {max_context}")
        if item.inputs is not None and item.inputs.shape != (len(item.token_ids), hidden_size):
            raise ValueError(f"input rows of shape {tuple(item.inputs.shape)} for "
                             f"{len(item.token_ids)} tokens of {hidden_size}")
