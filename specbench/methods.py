"""The decoding methods ``specserve bench`` compares, each as a runner.

A runner takes a prompt's token ids and a token budget, generates greedily, and
returns a ``Generation``: the output ids, the wall time of the whole call, and,
for our own engine, what each speculation round did. Our methods go through
``decode()``; the transformers baselines call ``model.generate()`` on the same
weights: the loaded model itself, or where the runner holds only the modules it runs
(``runtime.models.skeleton``), the same files loaded by transformers.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from decoding.drafter import Drafter
from decoding.policy import MAX_DRAFT_TOKENS
from decoding.round import decode
from decoding.types import GenerationRequest, RoundEvent, SamplingParams, SpeculationParams
from drafters.combined import MODEL_MARGIN, CombinedDrafter
from drafters.model import ModelDrafter
from drafters.ngram import DEFAULT_MAX_NGRAM, NgramDrafter
from runtime.drafts import draft_format
from runtime.models.checkpoints import transformers_pretrained
from runtime.models.skeleton import Skeleton
from runtime.runner.causal_lm import CausalLM

PLAIN = "plain"
SPEC_NGRAM = "spec:ngram"
SPEC_DRAFT = "spec:draft"
SPEC_NGRAM_DRAFT = "spec:ngram+draft"  # lookup, and the draft model where lookup does worse
SPEC_FEATURE = "spec:feature"  # the draft that reads the target's features
SPEC_NGRAM_FEATURE = "spec:ngram+feature"  # lookup, and that draft where lookup does worse
HF_PLAIN = "hf:plain"
HF_ASSISTED_NGRAM = "hf:assisted-ngram"
HF_ASSISTED_DRAFT = "hf:assisted-draft"
ALL_METHODS = (PLAIN, SPEC_NGRAM, SPEC_DRAFT, SPEC_NGRAM_DRAFT, SPEC_FEATURE,
               SPEC_NGRAM_FEATURE, HF_PLAIN, HF_ASSISTED_NGRAM, HF_ASSISTED_DRAFT)
DRAFT_METHODS = frozenset({SPEC_DRAFT, SPEC_NGRAM_DRAFT, HF_ASSISTED_DRAFT})
FEATURE_METHODS = frozenset({SPEC_FEATURE, SPEC_NGRAM_FEATURE})  # the shipped feature draft
HF_METHODS = frozenset({HF_PLAIN, HF_ASSISTED_NGRAM, HF_ASSISTED_DRAFT})

# transformers' prompt lookup, set to match our n-gram drafter as closely as it allows:
# at most as many tokens per round as our policy drafts, the same longest n-gram.
HF_PROMPT_LOOKUP_TOKENS = MAX_DRAFT_TOKENS
HF_MAX_MATCHING_NGRAM = DEFAULT_MAX_NGRAM
# transformers' own defaults for assisted generation with a draft model, made explicit.
HF_ASSISTANT_TOKENS = 20
HF_ASSISTANT_SCHEDULE = "constant"
HF_ASSISTANT_CONFIDENCE = 0.4

GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class Generation:
    """One prompt's greedy output and what it cost.

    Round statistics cover the rounds after the first (prefill) round and are
    only known for our engine; transformers' generate() reports none.
    """

    token_ids: tuple[int, ...]
    seconds: float
    rounds: int = 0
    draft_rounds: int = 0  # rounds in which the drafter proposed at least one token
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # of those, accepted
    committed: int = 0  # tokens committed (accepted + recovered/bonus)
    draft_s: float = 0.0
    verify_s: float = 0.0
    bookkeeping_s: float = 0.0
    prefill_s: float = 0.0
    has_rounds: bool = False


Runner = Callable[[Sequence[int], int], Generation]


def engine_runner(target: CausalLM, drafter: Drafter | None) -> Runner:
    """Our ``decode()`` with ``drafter`` (None: plain decoding)."""

    def run(prompt_ids: Sequence[int], max_new_tokens: int) -> Generation:
        request = GenerationRequest(
            prompt_ids=tuple(prompt_ids), max_new_tokens=max_new_tokens, sampling=GREEDY,
            speculation=SpeculationParams(enabled=drafter is not None),
        )
        start = time.perf_counter()
        events = list(decode(target, drafter, request))
        seconds = time.perf_counter() - start
        return _from_events(events, seconds)

    return run


def _from_events(events: Sequence[RoundEvent], seconds: float) -> Generation:
    """Sum the rounds after the prefill round; round 0 is the prefill."""
    later = events[1:]
    tokens = tuple(t for event in events for t in event.token_ids)
    return Generation(
        token_ids=tokens,
        seconds=seconds,
        rounds=len(later),
        draft_rounds=sum(1 for e in later if e.draft_tokens > 0),
        drafted=sum(e.draft_tokens for e in later),
        accepted=sum(e.accepted_tokens for e in later),
        committed=sum(len(e.token_ids) for e in later),
        draft_s=sum(e.timing.draft_s for e in later),
        verify_s=sum(e.timing.verify_s for e in later),
        bookkeeping_s=sum(e.timing.bookkeeping_s for e in later),
        prefill_s=sum(e.timing.verify_s + e.timing.bookkeeping_s for e in events[:1]),
        has_rounds=True,
    )


def hf_runner(target: CausalLM, assistant: Any = None, **settings: Any) -> Runner:
    """transformers' ``generate()`` on the target's model, greedy.

    ``assistant`` is a draft model for assisted generation; ``settings`` are
    further generation-config fields (prompt lookup, assistant knobs).
    """
    model = transformers_model(target)
    pad = target.tokenizer.pad_token_id
    eos = sorted(target.eos_token_ids)
    extra: dict[str, Any] = {} if assistant is None else {"assistant_model": assistant}

    def run(prompt_ids: Sequence[int], max_new_tokens: int) -> Generation:
        config = GenerationConfig(
            do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
            eos_token_id=eos, pad_token_id=pad if pad is not None else eos[0], **settings,
        )
        with torch.inference_mode():
            ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=target.device)
            mask = torch.ones_like(ids)  # [1, n]
            start = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                 **extra)  # [1, n + new]
            seconds = time.perf_counter() - start
        return Generation(token_ids=tuple(out[0, ids.shape[1]:].tolist()), seconds=seconds)

    return run


@functools.cache  # once per runner: every hf: method, and a draft's shared embedding
def transformers_model(runner: CausalLM, target: CausalLM | None = None) -> Any:
    """transformers' model of ``runner``'s weights (``target``: the model a distilled
    draft runner shares its input embedding with)."""
    if not isinstance(runner.model, Skeleton):
        return runner.model
    dtype = str(runner.dtype).removeprefix("torch.")
    if target is not None and draft_format.is_draft_dir(runner.name):
        shared = transformers_model(target)
        return draft_format.load_model(Path(runner.name), shared, dtype).to(runner.device)
    return transformers_pretrained(runner.name, dtype, str(runner.device))[0]


def build_runners(
    methods: Sequence[str], target: CausalLM, draft: ModelDrafter | None,
    spec_draft: Drafter | None = None, feature: Drafter | None = None,
) -> dict[str, Runner]:
    """A runner for each method name; draft methods need ``draft`` (the PyTorch draft,
    which the transformers baseline runs); spec:draft uses ``spec_draft`` when given;
    the feature methods need ``feature`` (the drafter that reads the target's features)."""
    runners: dict[str, Runner] = {}
    for method in methods:
        if method in DRAFT_METHODS and draft is None:
            raise ValueError(f"method {method!r} needs a draft model (--draft PATH)")
        if method in FEATURE_METHODS and feature is None:
            raise ValueError(f"method {method!r} needs the feature draft made for the target")
        runners[method] = _runner(method, target, draft, spec_draft or draft, feature)
    return runners


def _runner(method: str, target: CausalLM, draft: ModelDrafter | None,
            spec_draft: Drafter | None, feature: Drafter | None = None) -> Runner:
    if method == SPEC_FEATURE and feature is not None:
        return engine_runner(target, feature)
    if method == SPEC_NGRAM_FEATURE and feature is not None:
        return engine_runner(target, CombinedDrafter([NgramDrafter()], feature))
    if method == PLAIN:
        return engine_runner(target, None)
    if method == SPEC_NGRAM:
        return engine_runner(target, NgramDrafter())
    if method == SPEC_DRAFT and spec_draft is not None:
        return engine_runner(target, spec_draft)
    if method == SPEC_NGRAM_DRAFT and spec_draft is not None:
        return engine_runner(target, CombinedDrafter([NgramDrafter()], spec_draft))
    if method == HF_PLAIN:
        return hf_runner(target)
    if method == HF_ASSISTED_NGRAM:
        return hf_runner(target, prompt_lookup_num_tokens=HF_PROMPT_LOOKUP_TOKENS,
                         max_matching_ngram_size=HF_MAX_MATCHING_NGRAM)
    if method == HF_ASSISTED_DRAFT and draft is not None:
        if not isinstance(draft.model, CausalLM):
            raise ValueError("hf:assisted-draft needs the draft as a PyTorch model")
        return hf_runner(target, assistant=transformers_model(draft.model, target),
                         num_assistant_tokens=HF_ASSISTANT_TOKENS,
                         num_assistant_tokens_schedule=HF_ASSISTANT_SCHEDULE,
                         assistant_confidence_threshold=HF_ASSISTANT_CONFIDENCE)
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(ALL_METHODS)}")


def method_settings() -> dict[str, Any]:
    """The knobs of each method, for the report's configuration block."""
    return {
        SPEC_NGRAM: {"max_ngram": DEFAULT_MAX_NGRAM, "min_ngram": NgramDrafter().min_ngram,
                     "max_draft_tokens": MAX_DRAFT_TOKENS, "policy": "adaptive"},
        SPEC_DRAFT: {"max_draft_tokens": MAX_DRAFT_TOKENS, "policy": "adaptive"},
        SPEC_NGRAM_DRAFT: {"max_draft_tokens": MAX_DRAFT_TOKENS, "policy": "adaptive",
                           "model_margin": MODEL_MARGIN},
        HF_ASSISTED_NGRAM: {"prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS,
                            "max_matching_ngram_size": HF_MAX_MATCHING_NGRAM},
        HF_ASSISTED_DRAFT: {"num_assistant_tokens": HF_ASSISTANT_TOKENS,
                            "num_assistant_tokens_schedule": HF_ASSISTANT_SCHEDULE,
                            "assistant_confidence_threshold": HF_ASSISTANT_CONFIDENCE},
    }
