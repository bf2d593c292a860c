"""Value types shared by the decoding core and its callers.

Everything here is a frozen dataclass: requests go in, events come out, and
nothing is mutated on the way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from decoding.constraints import Grammar


class FinishReason(StrEnum):
    """Why a sequence ended, in OpenAI's vocabulary."""

    STOP = "stop"  # EOS token or a stop string
    LENGTH = "length"  # max_tokens or the model's context was reached
    CANCELLED = "cancelled"  # the client went away or the server is shutting down
    TIMEOUT = "timeout"  # the request ran past its deadline
    ERROR = "error"  # the model failed on this request


def _require(**non_negative: bool) -> None:
    """Refuse the first field, in the order given, whose value is negative."""
    for name, ok in non_negative.items():
        if not ok:
            raise ValueError(f"{name} must be >= 0")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` means greedy decoding."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    choice: int = 0  # which of a request's n choices: part of the sampling key
    keyed: bool = True  # randomness keyed by (seed, choice, position); False: rejection
    # sampling with a generator (same distribution; the drafter then changes the text)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def __post_init__(self) -> None:
        _require(temperature=self.temperature >= 0)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        _require(top_k=self.top_k >= 0, choice=self.choice >= 0)


@dataclass(frozen=True)
class SpeculationParams:
    """Per-request control of speculation. ``enabled=False`` decodes plainly."""

    enabled: bool = True
    drafter: str | None = None  # a loaded drafter's name; None picks the server's default
    max_draft_tokens: int | None = None  # caps the adaptive policy's k


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to generate. ``prompt_ids`` are already tokenized.

    ``max_new_tokens`` may be 0: the prompt is read (for its log-probabilities) and
    nothing is generated. ``prompt_logprobs``: the first event also carries every prompt
    token's log-probability after the first (with ``top_logprobs`` alternatives), from
    the prefill's own pass; such a request does not take the prefix cache."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's EOS ids
    logprobs: bool = False
    top_logprobs: int = 0
    speculation: SpeculationParams = field(default_factory=SpeculationParams)
    timeout_s: float | None = None
    request_id: str = ""
    grammar: Grammar | None = None  # the output must match it (structured outputs, tools)
    prompt_logprobs: bool = False
    prediction: tuple[int, ...] = ()  # the client's draft of the answer (``Engine.predicted``)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt must contain at least one token")
        _require(max_new_tokens=self.max_new_tokens >= 0, top_logprobs=self.top_logprobs >= 0)


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of an emitted token, with alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclass(frozen=True)
class RoundTiming:
    """Where one round's time went, in seconds."""

    draft_s: float = 0.0
    verify_s: float = 0.0
    bookkeeping_s: float = 0.0


@dataclass(frozen=True)
class RoundEvent:
    """What one speculation round produced for one sequence.

    ``text`` is safe to show: incomplete UTF-8 and possible stop-string prefixes
    are held back until they resolve. ``token_ids`` are the tokens committed in
    this round (a stop string may end the text before the last of them).
    """

    token_ids: tuple[int, ...]
    text: str
    draft_tokens: int  # proposed this round
    accepted_tokens: int  # of those, accepted by verification
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    timing: RoundTiming = field(default_factory=RoundTiming)
    round_index: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0  # committed so far, this round included
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (first round)
    batch_size: int = 1  # sequences in the forward pass that verified this round
    draft_source: str = ""  # which of a combined drafter's sources drafted ("lookup", "model")
    error: str | None = None  # set only with FinishReason.ERROR; safe to show
    constraint_s: float = 0.0  # seconds spent on grammar masks and matching this round
    forced_tokens: int = 0  # grammar-forced draft tokens verified this round
    forced_accepted: int = 0  # ... of which accepted
    # the first event of a request with ``prompt_logprobs``: prompt tokens 1.. (the first
    # has no context to be scored in), each under the tokens before it
    prompt_logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class PromptChunk:
    """The next piece of a prompt to prefill (round 0), or of what a preempted sequence
    held, computed again (``recompute``: no logits kept, no event)."""

    tokens: Sequence[int]
    final: bool  # the prompt's last chunk: its logits give the first token
    recompute: bool = False
