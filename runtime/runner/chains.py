"""A batched runner's greedy draft steps in one native call (``ChainDrafting``).

The native chain (``fused.draft_chain``) is built once per vocabulary it drafts from and
input fusion it runs, over the runner's ``Stack``; it feeds every sequence's tokens,
then drafts and feeds back its steps, in the runner's KV blocks (``KVBlocks``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.matrices.weights import Product
from runtime.runner import fused
from runtime.runner.kv_blocks import BatchedState, KVBlocks
from runtime.runner.layout import Layout, check_items
from runtime.runner.passes import BatchItem, DraftSteps
from runtime.runner.stack import Stack

Fusion = tuple[Product, int]  # a feature head's input product and its input width


class DraftChains:
    """The chains over one runner's stack and KV rows."""

    def __init__(self, stack: Stack, kv: KVBlocks, name: str, max_context: int,
                 hidden_size: int) -> None:
        self.stack, self.kv = stack, kv
        self.name, self.max_context, self.hidden_size = name, max_context, hidden_size
        self._built: dict[tuple[int, int], fused.DraftChain | None] = {}

    def forget(self) -> None:
        """Drop the chains built (the kernels or the captured layers changed)."""
        self._built = {}

    def chain(self, vocab: int, fusion: Fusion | None = None) -> fused.DraftChain | None:
        """The native ``DraftChain`` (``fused.draft_chain``; tokens from ``vocab`` on
        never drafted; with ``fusion``, each step's rows that product of [embedding |
        carried state]), or None where it cannot run."""
        if self.stack.kernels is None:
            return None
        key = (vocab, 0 if fusion is None else id(fusion[0]))
        if key not in self._built:
            self._built[key] = fused.draft_chain(self.stack.kernels, self.stack, vocab, fusion)
        return self._built[key]

    @torch.inference_mode()
    def draft(self, states: Sequence[BatchedState], feeds: Sequence[Sequence[int]],
              steps: Sequence[int], vocab: int, batch_invariant: bool,
              carried: Sequence[torch.Tensor] | None = None,
              fusion: Fusion | None = None) -> list[DraftSteps]:
        """Greedy drafting in one native call: each sequence's ``feeds`` appended to its
        cache, then ``steps`` tokens each the first of the largest logits after the one
        before (every token but the last fed back). Bitwise the tokens of the same steps
        through the runner's passes and an argmax over the first ``vocab`` logits; each
        cache grows by its feed and its steps less one. With ``fusion``, a feed's rows
        are the fusion of its tokens' embeddings beside ``carried`` (``[len(feed), H]``
        a sequence, in the model's dtype), and a drafted token's beside the state the
        step before left (``DraftSteps.state``): a feature head's inputs."""
        chain = self.chain(vocab, fusion)
        if chain is None:
            raise ValueError(f"{self.name}: no native draft chain here")
        if any(k < 1 for k in steps):
            raise ValueError("every sequence drafts at least one token")
        if (carried is None) != (fusion is None):
            raise ValueError("carried states go with an input fusion, and only with one")
        # the checks of a pass holding the feeds and every token the steps feed back
        check_items([BatchItem(s, [*f, *[0] * (k - 1)], 1)
                     for s, f, k in zip(states, feeds, steps, strict=True)],
                    self.max_context, self.hidden_size)
        dtype = self.stack.dtype
        if carried is not None and any(
                tuple(c.shape) != (len(f), self.hidden_size) or c.dtype != dtype
                for c, f in zip(carried, feeds, strict=True)):
            raise ValueError(f"carried states are [len(feed), {self.hidden_size}] in {dtype}")
        items = [BatchItem(s, f, 1) for s, f in zip(states, feeds, strict=True)]
        reach = max(s.length + len(f) + k - 1 for s, f, k in zip(states, feeds, steps,
                                                                  strict=True))
        for state, feed, k in zip(states, feeds, steps, strict=True):
            self.kv.reserve(state, state.length + len(feed) + k - 1)
        batch = Layout.build(items, self.kv.device, batch_invariant, native=True)
        rows = None
        if carried is not None:  # in the pass's order of tokens
            order = sorted(range(len(items)), key=lambda i: batch.offsets[i])
            rows = torch.cat([carried[i] for i in order]).contiguous()
        rotary = self.stack.rotary.tables(reach, self.stack.keys[0])
        assert rotary is not None  # (a chain is built only for tables of positions)
        last = torch.tensor([o + len(f) - 1 for o, f in zip(batch.offsets, feeds, strict=True)])
        tokens, sure, second, second_sure, hidden = chain.run(
            batch.ids, batch.positions, batch.tables, batch.cache_rows, batch.cache_slots,
            batch.limits, batch.extras, last, torch.tensor(list(steps)), *rotary,
            self.stack.keys, self.stack.values, rows)
        out = []
        for i, (state, feed, k) in enumerate(zip(states, feeds, steps, strict=True)):
            state.length += len(feed) + k - 1
            out.append(DraftSteps(tuple(tokens[i, :k].tolist()), tuple(sure[i, :k].tolist()),
                                  (int(second[i]), float(second_sure[i])),
                                  hidden[i].clone() if fusion is not None else None))
        return out
