"""The batched runner's KV cache in blocks: one pool of fixed-size blocks of positions,
and a block table a sequence (PagedAttention, Kwon et al. 2023, is the model).

One tensor per layer for keys and one for values, ``[blocks, kv_heads, BLOCK, head_dim]``
(held in the runner's ``Stack``, where the layer paths read them). A sequence holds the
blocks its positions lie in, in order, and takes one more as it grows past the last; a
roll-back gives back the blocks past the new length. Block 0 is never handed out: it
stays zero and pads a table where a pass reads past a sequence's blocks (PyTorch's
attention reads whole spans, masked).

Full blocks of a prompt are published under a chained digest of their tokens
(``publish``); a new sequence whose prompt starts with published blocks shares them
(``share``) instead of computing them again, and a block is written only while one
sequence holds it and it is published by none (``reserve`` copies it first otherwise).
With batch invariance a position's keys and values are the same bits however it was
computed, so a shared block is exactly what the sequence would have written. A block no
sequence holds any more is free and no longer findable: the blocks are shared among the
requests that run at once, and across requests apart in time the prefix cache
(``decoding.prefix_cache``: in-process or Redis) is the store.

The pool grows by doubling as sequences need blocks, up to ``limit`` blocks (the KV
budget; ``KVPoolExhausted`` past it), and shrinks back when the last sequence leaves.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from runtime.runner.passes import BLOCK, KVUsage, blocks_for
from runtime.runner.stack import Stack

log = logging.getLogger(__name__)

INITIAL_BLOCKS = 64  # the pool's size when idle (block 0 among them)


class KVPoolExhausted(RuntimeError):
    """A sequence needs more blocks than the pool may hold."""


@dataclass(eq=False)
class BatchedState:
    """One sequence: the blocks its positions lie in, and how many positions it holds."""

    length: int = 0
    blocks: list[int] = field(default_factory=list)
    released: bool = False
    # the chained digest of each of its first blocks whose tokens it knows (``publish``)
    digests: list[bytes] = field(default_factory=list)


def chain_digests(tokens: Sequence[int], start: bytes = b"") -> list[bytes]:
    """The chained digest of each full block of ``tokens`` (each over the one before)."""
    out = []
    previous = start
    for i in range(len(tokens) // BLOCK):
        data = previous + b"".join(int(t).to_bytes(4, "little", signed=True)
                                   for t in tokens[i * BLOCK:(i + 1) * BLOCK])
        previous = hashlib.blake2b(data, digest_size=16).digest()
        out.append(previous)
    return out


class KVBlocks:
    """Hands out, shares, grows and gives back the blocks of ``stack``'s KV pools."""

    def __init__(self, stack: Stack, device: torch.device) -> None:
        self.stack = stack
        self.device = device
        self.limit: int | None = None  # most blocks besides the null one (None: no bound)
        self.states = 0  # sequences alive (not released)
        self._refs: list[int] = []  # per block: sequences holding it
        self._held = 0  # blocks some sequence holds (the null block aside)
        self._free: list[int] = []  # held by none (the last freed first out)
        self._digest: dict[int, bytes] = {}  # block -> its digest, where published
        self._by_digest: dict[bytes, int] = {}
        self._allocate(INITIAL_BLOCKS)

    # -- what the pool holds -------------------------------------------------------

    @property
    def size(self) -> int:
        """Blocks in the pools now (the null block aside)."""
        return len(self._refs) - 1

    def usage(self) -> KVUsage:
        shared = sum(1 for r in self._refs[1:] if r > 1)
        return KVUsage(self.limit, self._held, shared)

    def needed(self, state: BatchedState, positions: int) -> int:
        """The blocks ``state`` would take to hold ``positions`` positions: new ones, and
        copies of the shared or published ones it would write into."""
        if positions <= state.length:
            return 0
        first = state.length // BLOCK
        copies = sum(1 for b in state.blocks[first:] if self._refs[b] > 1 or b in self._digest)
        return max(0, blocks_for(positions) - len(state.blocks)) + copies

    # -- sequences -----------------------------------------------------------------

    def new_state(self) -> BatchedState:
        self.states += 1
        return BatchedState()

    @torch.inference_mode()
    def reserve(self, state: BatchedState, positions: int) -> None:
        """Give ``state`` the blocks it needs to write up to ``positions`` positions: new
        ones at its end, and its own copy of a shared or published block it would write
        into. Raises ``KVPoolExhausted`` (taking nothing) when the pool may not hold them."""
        if state.released:
            raise ValueError("a released sequence cannot run")
        need = self.needed(state, positions)
        if need == 0:
            return
        self._make_room(need)
        for i in range(state.length // BLOCK, len(state.blocks)):  # written into: its own
            block = state.blocks[i]
            if self._refs[block] > 1 or block in self._digest:
                copy = self._take()
                for pool in (*self.stack.keys, *self.stack.values):
                    pool[copy].copy_(pool[block])
                self._drop(block)
                state.blocks[i] = copy
        del state.digests[state.length // BLOCK:]
        while len(state.blocks) < blocks_for(positions):
            state.blocks.append(self._take())

    def release(self, state: BatchedState) -> None:
        """Give the sequence's blocks back (idempotent)."""
        if state.released:
            return
        state.released = True
        self.states -= 1
        self._truncate(state, 0)
        if self.states == 0 and self.size + 1 > INITIAL_BLOCKS:
            self._reset()  # idle: give the memory back

    def rollback(self, state: BatchedState, length: int) -> None:
        """Forget the positions from ``length`` on, and the blocks past them."""
        self._truncate(state, min(state.length, length))

    def publish(self, state: BatchedState, tokens: Sequence[int]) -> None:
        """Make ``state``'s full blocks of ``tokens`` (its first positions, already
        written) findable by later sequences. A block another sequence published under the
        same tokens replaces its own (the same bits under batch invariance): held once."""
        full = min(len(tokens), state.length) // BLOCK
        if full <= len(state.digests):
            return
        start = state.digests[-1] if state.digests else b""
        fresh = chain_digests(tokens[len(state.digests) * BLOCK: full * BLOCK], start)
        for i, digest in enumerate(fresh, start=len(state.digests)):
            block = state.blocks[i]
            found = self._by_digest.get(digest)
            if found is None:
                if block not in self._digest:
                    self._digest[block] = digest
                    self._by_digest[digest] = block
            elif found != block:  # computed twice: keep the published one
                self._hold(found)
                state.blocks[i] = found
                self._drop(block)
            state.digests.append(digest)

    def share(self, state: BatchedState, tokens: Sequence[int]) -> int:
        """For an empty ``state``: hold the published blocks that ``tokens`` start with
        (leaving at least the last token to compute); the positions they cover."""
        if state.length or state.blocks:
            raise ValueError("share needs an empty cache")
        for digest in chain_digests(tokens[: len(tokens) - 1]):
            block = self._by_digest.get(digest)
            if block is None:
                break
            self._hold(block)
            state.blocks.append(block)
            state.digests.append(digest)
        state.length = len(state.blocks) * BLOCK
        return state.length

    @torch.inference_mode()
    def adopt_alternative(self, state: BatchedState, start: int, n: int) -> None:
        """Move the last of a pass's ``n`` positions from ``start`` (an alternative) to
        right after its first, and forget the rest."""
        src, dst = start + n - 1, start + 1
        for pool in (*self.stack.keys, *self.stack.values):
            pool[state.blocks[dst // BLOCK], :, dst % BLOCK].copy_(
                pool[state.blocks[src // BLOCK], :, src % BLOCK])
        self._truncate(state, start + 2)

    @torch.inference_mode()
    def load_kv(self, state: BatchedState,
                kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write ``kv`` (per layer ``[1, kv_heads, n, head_dim]`` keys and values) as the
        sequence's first ``n`` positions."""
        if state.length or state.blocks:
            raise ValueError("load_kv needs an empty cache")
        if not kv:
            return
        n = int(kv[0][0].shape[2])
        self.reserve(state, n)
        for pool_k, pool_v, (keys, values) in zip(self.stack.keys, self.stack.values, kv,
                                                  strict=True):
            for i, block in enumerate(state.blocks):
                lo, hi = i * BLOCK, min(n, (i + 1) * BLOCK)
                pool_k[block, :, : hi - lo].copy_(keys[0, :, lo:hi])
                pool_v[block, :, : hi - lo].copy_(values[0, :, lo:hi])
        state.length = n

    def kv(self, state: BatchedState) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The sequence's keys and values per layer, ``[1, kv_heads, length, head_dim]``
        each (copies)."""
        n = state.length
        index = torch.tensor(state.blocks[: blocks_for(n)], dtype=torch.long, device=self.device)

        def gathered(pool: torch.Tensor) -> torch.Tensor:
            rows = pool[index]  # [b, kv, BLOCK, D]
            return rows.transpose(0, 1).reshape(pool.shape[1], -1, pool.shape[3])[None, :, :n]

        return [(gathered(k), gathered(v))
                for k, v in zip(self.stack.keys, self.stack.values, strict=True)]

    # -- blocks ----------------------------------------------------------------------

    def _truncate(self, state: BatchedState, length: int) -> None:
        keep = blocks_for(length)
        for block in state.blocks[keep:]:
            self._drop(block)
        del state.blocks[keep:]
        del state.digests[length // BLOCK:]
        state.length = length

    def _hold(self, block: int) -> None:
        self._refs[block] += 1

    def _drop(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._held -= 1
            digest = self._digest.pop(block, None)
            if digest is not None:
                del self._by_digest[digest]
            self._free.append(block)

    def _make_room(self, need: int) -> None:
        """Raise unless ``need`` more blocks stay within the limit; grow the pools until
        they can be taken."""
        held = self._held
        if self.limit is not None and held + need > self.limit:
            raise KVPoolExhausted(f"{need} more KV blocks are needed; {held} of "
                                  f"{self.limit} are held")
        if len(self._free) >= need:
            return
        wanted = max(held + need, 2 * self.size)
        if self.limit is not None:
            wanted = min(wanted, self.limit)
        self._allocate(wanted + 1)

    def _take(self) -> int:
        """A free block, now held by one sequence."""
        block = self._free.pop()
        self._refs[block] = 1
        self._held += 1
        return block  # (what it held before stays: no position past a length is read unmasked)

    def _reset(self) -> None:
        self.stack.keys, self.stack.values = [], []
        self._refs, self._free, self._held = [], [], 0
        self._digest.clear()
        self._by_digest.clear()
        self._allocate(INITIAL_BLOCKS)

    @torch.inference_mode()
    def _allocate(self, blocks: int) -> None:
        """Pools of ``blocks`` blocks (the null one among them), the blocks so far kept."""
        stack = self.stack
        shape = (blocks, stack.kv_heads, BLOCK, stack.head_dim)
        keys = [torch.zeros(shape, dtype=stack.dtype, device=self.device) for _ in stack.layers]
        values = [torch.zeros(shape, dtype=stack.dtype, device=self.device)
                  for _ in stack.layers]
        old = len(self._refs)
        for before, after in zip((*stack.keys, *stack.values), (*keys, *values), strict=False):
            after[:old].copy_(before[:old])
        stack.keys, stack.values = keys, values
        if old == 0:
            self._refs = [1]  # the null block: held for good
            old = 1
        self._refs.extend([0] * (blocks - old))
        self._free.extend(range(blocks - 1, old - 1, -1))  # the lowest first out
        log.debug("KV pools: %d blocks of %d positions", blocks, BLOCK)
