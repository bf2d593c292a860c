from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from decoding.drafters import DraftContext, ModelDrafter, NgramDrafter
from decoding.target import CausalLM, TokenizerMismatchError
from decoding.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def test_ngram_proposes_the_continuation_of_the_latest_match() -> None:
    drafter = NgramDrafter(max_ngram=3, min_ngram=2)
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 0, 2, 3]
    state = drafter.begin(tokens)
    proposal = drafter.propose(state, DraftContext(tokens, GREEDY, None), 3)
    assert proposal.tokens == (7, 8, 0)  # latest "2 3" was followed by 7 8 0
    assert proposal.probs is None


def test_ngram_continues_a_repetition_past_the_end() -> None:
    drafter = NgramDrafter(max_ngram=2, min_ngram=2)
    tokens = [9, 1, 2, 3, 1, 2, 3, 1, 2]  # period 3: the latest "1 2" starts 3 back
    proposal = drafter.propose(drafter.begin(tokens), DraftContext(tokens, GREEDY, None), 7)
    assert proposal.tokens == (3, 1, 2, 3, 1, 2, 3)


def test_ngram_prefers_longer_matches_and_never_matches_itself() -> None:
    drafter = NgramDrafter(max_ngram=3, min_ngram=1)
    state = drafter.begin([])
    assert drafter.propose(state, DraftContext([5, 6, 7], GREEDY, None), 4).tokens == ()
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]
    assert drafter.propose(state, DraftContext(tokens, GREEDY, None), 2).tokens == (4, 9)


def test_model_drafter_rollback_reuses_the_committed_prefix(tiny_target: CausalLM) -> None:
    drafter = ModelDrafter(tiny_target, tiny_target)
    tokens = [10, 11, 12, 13]
    state = drafter.begin(tokens)
    first = drafter.propose(state, DraftContext(tokens, GREEDY, None), 4)
    assert len(first.tokens) == 4
    assert state.cache.length == len(tokens) + 3
    committed = [*tokens, first.tokens[0], 999]  # one accepted, then a recovered token
    drafter.rollback(state, len(committed))
    second = drafter.propose(state, DraftContext(committed, GREEDY, None), 2)
    fresh_state = drafter.begin(committed)
    fresh = drafter.propose(fresh_state, DraftContext(committed, GREEDY, None), 2)
    assert second.tokens == fresh.tokens


def test_model_drafter_sampling_returns_its_distribution(tiny_target: CausalLM) -> None:
    import torch

    drafter = ModelDrafter(tiny_target, tiny_target)
    params = SamplingParams(temperature=0.8, top_k=20)
    generator = torch.Generator().manual_seed(0)
    proposal = drafter.propose(drafter.begin([1, 2]), DraftContext([1, 2], params, generator), 3)
    assert proposal.probs is not None and proposal.probs.shape == (3, tiny_target.vocab_size)
    for i, token in enumerate(proposal.tokens):
        assert proposal.probs[i, token] > 0
        assert int((proposal.probs[i] > 0).sum()) <= 20


def test_mismatched_tokenizer_is_refused(
    tiny_target: CausalLM, tiny_draft_dir: Path, tmp_path: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_draft_dir)
    tokenizer.add_tokens(["<extra-token-a>", "<extra-token-b>"])
    draft = CausalLM.load(str(tiny_draft_dir))
    draft.tokenizer = tokenizer
    with pytest.raises(TokenizerMismatchError, match="does not share the target's tokenizer"):
        ModelDrafter(draft, tiny_target)
