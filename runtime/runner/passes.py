"""What a forward pass takes and gives: the runtime's side of ``decoding.target.Target``.

Every runner (``causal_lm.TransformersLM``, ``batched.BatchedLM``) declares its
``TargetCapabilities`` and runs ``BatchItem``s, prepared as a ``PreparedPass``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import torch

S = TypeVar("S")  # a runner's per-sequence state
S_contra = TypeVar("S_contra", contravariant=True)


BLOCK = 16  # KV positions a block (a power of two: the kernels find a position by shifts)
NULL_BLOCK = 0  # the block that pads a pass's block tables: never handed out, never written


def blocks_for(positions: int) -> int:
    """KV blocks that hold ``positions`` positions."""
    return -(-positions // BLOCK)


@dataclass(frozen=True)
class KVUsage:
    """A target's KV blocks: how many it may hold (None: no bound), how many sequences
    hold (each once), and how many of those more than one sequence holds."""

    limit: int | None
    used: int
    shared: int
    block: int = BLOCK  # positions a block


@dataclass(frozen=True)
class TargetCapabilities:
    """What a target runner can do, declared rather than probed."""

    batched: bool  # ``forward_batch`` runs its sequences in one forward pass
    branches: bool  # ``forward_batch`` takes ``BatchItem.alternative`` (a two-branch tree)
    features: bool = False  # a pass gives final hidden states (``BatchItem.features``) and
    # starts from given rows (``BatchItem.inputs``)
    draft_chain: bool = False  # drafts greedy steps of many sequences in one native call
    # (``ChainDrafting``), where its ``chain`` for a vocabulary is not None


@dataclass(frozen=True)
class DraftSteps:
    """What a ``ChainDrafting`` runner's ``draft_chain`` drafted for one sequence."""

    tokens: tuple[int, ...]  # [k] the first of the largest logits at each step
    confidences: tuple[float, ...]  # [k] the probability of each (softmax over the head)
    runner_up: tuple[int, float]  # the first step's second choice and its probability
    state: torch.Tensor | None = None  # [H]: the state after the last fed token (a fusion's)


class ChainDrafting(Protocol[S_contra]):
    """A runner whose capabilities declare ``draft_chain``: greedy drafting of several
    sequences, each fed its tokens and then ``steps`` tokens drafted and fed back, in
    one native call, bitwise the same tokens as those steps through ``forward_batch``."""

    batch_invariant: bool  # (without it a long feed takes the bulk products instead)

    def chain(self, vocab: int) -> object | None:
        """The native chain drafting from the first ``vocab`` tokens, or None where it
        cannot run (no native kernels)."""
        ...

    def draft_chain(self, states: Sequence[S_contra], feeds: Sequence[Sequence[int]],
                    steps: Sequence[int], vocab: int) -> list[DraftSteps]: ...


@dataclass(frozen=True)
class BatchItem(Generic[S]):
    """Tokens to append to one sequence; the logits after the last ``keep`` of them
    come back (0: none, e.g. a prefill chunk that is not the prompt's last).

    ``alternative``: the last token is not the next in line but a second candidate for
    ``token_ids[1]``'s position (a branch of a token tree): it sees the cache and
    ``token_ids[0]`` only, and only the tokens before it see nothing of it. Only a
    runner with ``branches`` takes one; its KV sits after the others' until
    ``adopt_alternative`` moves it into place."""

    state: S
    token_ids: Sequence[int]
    keep: int
    alternative: bool = False
    features: bool = False  # the pass also gives every new token's final hidden state
    inputs: torch.Tensor | None = None  # [n, H]: the rows the layers start from, in place
    # of the tokens' embeddings (a draft that reads the target's features makes them)


@dataclass
class PreparedPass(Generic[S]):
    """A forward pass made ready to run (``prepare_pass``): its items, and whatever the
    runner built for it before its long call (the layout, the embedded tokens)."""

    items: Sequence[BatchItem[S]]
    work: object = None  # the runner's own (``BatchedLM``: a ``PassWork``)
    # after the run, per item: its new tokens' final hidden states (normed by the final
    # norm: what the output head reads), [n, H], where the item asked for them, else None
    features: list[torch.Tensor | None] = field(default_factory=list)
    # and, on a runner capturing layers (``BatchedLM.capture_layers``), those layers'
    # outputs (the residual stream after each), side by side: [n, layers * H]
    layers: list[torch.Tensor | None] = field(default_factory=list)
