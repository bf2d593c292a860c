"""verify(): the cases a rejection sampler must get right, and its distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from decoding.sampling import SamplingKey
from decoding.verify import verify

VOCAB = 6


def _one_hot_logits(tokens: list[int], vocab: int = VOCAB) -> torch.Tensor:  # [n, vocab]
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_greedy_all_accepted_adds_bonus() -> None:
    verdict = verify([1, 2, 3], None, _one_hot_logits([1, 2, 3, 4]), None)
    assert (verdict.accepted, verdict.next_token, verdict.bonus) == (3, 4, True)
    assert verdict.committed([1, 2, 3]) == [1, 2, 3, 4]


def test_greedy_early_mismatch_keeps_prefix_and_recovers() -> None:
    verdict = verify([1, 5, 3], None, _one_hot_logits([1, 2, 3, 4]), None)
    assert (verdict.accepted, verdict.next_token, verdict.bonus) == (1, 2, False)
    assert verdict.committed([1, 5, 3]) == [1, 2]


def test_greedy_first_token_rejected() -> None:
    verdict = verify([0, 2], None, _one_hot_logits([4, 2, 3]), None)
    assert (verdict.accepted, verdict.next_token) == (0, 4)


def test_empty_draft_is_plain_decoding() -> None:
    assert verify([], None, _one_hot_logits([3]), None).next_token == 3
    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    verdict = verify([], None, probs, generator)
    assert (verdict.accepted, verdict.next_token, verdict.bonus) == (0, 2, True)


def test_greedy_bfloat16_scores_pick_what_their_own_argmax_picks() -> None:
    """bfloat16 logits tie often; verification widens them before its argmax, which
    must keep the first of tied maxima, as argmax on the bfloat16 rows does."""
    torch.manual_seed(0)
    scores = (torch.randn(3, 49152) * 4).to(torch.bfloat16)
    scores[0, 7] = scores[0, 9000] = scores[0, 40000] = 60.0  # a three-way tie
    scores[2, 123] = scores[2, 5] = 60.0
    expected = scores.argmax(dim=-1).tolist()
    assert expected[0] == 7 and expected[2] == 5
    verdict = verify([7, expected[1]], None, scores, None)
    assert (verdict.accepted, verdict.next_token, verdict.bonus) == (2, 5, True)


def test_row_count_is_checked() -> None:
    with pytest.raises(ValueError, match="rows"):
        verify([1, 2], None, _one_hot_logits([1, 2]), None)


def test_greedy_alternative_is_taken_when_the_target_picks_it() -> None:
    """The target's first choice is the alternative, not the draft's first token: the
    alternative and the target's token after it (from the alternative's own row) are
    kept; otherwise the alternative's row changes nothing."""
    after = _one_hot_logits([5])[0]  # [vocab]: the target's scores after the alternative
    verdict = verify([1, 2], None, _one_hot_logits([3, 2, 4]), None, alternative=3,
                     after_alternative=after)
    assert (verdict.alternative_taken, verdict.next_token, verdict.after_alternative) == (
        True, 3, 5)
    assert verdict.committed([1, 2]) == [3, 5] and verdict.accepted == 0
    verdict = verify([1, 3], None, _one_hot_logits([3, 2, 4]), None, alternative=3,
                     after_alternative=after)  # the alternative is the draft's second token
    assert verdict.alternative_taken and verdict.committed([1, 3]) == [3, 5]
    verdict = verify([1, 2], None, _one_hot_logits([1, 2, 4]), None, alternative=3,
                     after_alternative=after)
    assert not verdict.alternative_taken and verdict.committed([1, 2]) == [1, 2, 4]
    verdict = verify([1, 2], None, _one_hot_logits([0, 2, 4]), None, alternative=3,
                     after_alternative=after)  # neither: recovered as without it
    assert not verdict.alternative_taken and verdict.committed([1, 2]) == [0]
    with pytest.raises(ValueError, match="scores after it"):
        verify([1, 2], None, _one_hot_logits([3, 2, 4]), None, alternative=3)
    with pytest.raises(ValueError, match="only greedily"):
        verify([1, 2], None, torch.full((3, VOCAB), 1 / VOCAB), torch.Generator(),
               alternative=3, after_alternative=after)


@pytest.mark.parametrize("kept", [0, 1], ids=["first-draft-token-cut", "one-kept"])
def test_a_cut_draft_token_is_rejected_and_recovered_from_the_residual(kept: int) -> None:
    """A draft token the grammar cut after the kept draft would have been rejected for
    certain: once every kept token is accepted, the next token is drawn from
    max(0, target - cut row), never the target alone, and the draws follow that residual.
    With nothing kept (the drafter's first token was cut) the same holds at row 0."""
    generator = torch.Generator().manual_seed(0)
    sure = [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]  # the target's row where the kept token is 1
    target = torch.tensor([sure] * kept + [[0.1, 0.2, 0.3, 0.4, 0.0, 0.0]])  # [k + 1, vocab]
    draft = torch.tensor([sure] * kept).reshape(kept, VOCAB)  # [k, vocab]
    cut = torch.tensor([0.0, 0.0, 0.3, 0.6, 0.1, 0.0])  # [vocab]
    counts = [0] * VOCAB
    for _ in range(600):
        verdict = verify([1] * kept, draft, target, generator, cut_probs=cut)
        assert verdict.accepted == kept and not verdict.bonus
        counts[verdict.next_token] += 1
    assert counts[2] == counts[3] == 0  # the target alone would give these 70% of the time
    # the residual: 0.1 and 0.2 left of tokens 0 and 1, so 1/3 and 2/3
    assert chisquare(counts[:2], [200, 400]).pvalue > 1e-3


def test_sampled_accepts_when_draft_equals_target() -> None:
    generator = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(4, VOCAB, generator=generator), dim=-1)
    draft_tokens = [int(torch.multinomial(target[i], 1, generator=generator)) for i in range(3)]
    verdict = verify(draft_tokens, target[:3], target, generator)
    assert verdict.accepted == 3 and verdict.bonus


def test_sampled_never_accepts_a_token_the_target_forbids() -> None:
    generator = torch.Generator().manual_seed(0)
    target = torch.full((2, VOCAB), 1.0 / (VOCAB - 1))
    target[0, 0] = 0.0
    for _ in range(200):
        verdict = verify([0], None, target, generator)
        assert verdict.accepted == 0 and verdict.next_token != 0


def test_seeded_determinism() -> None:
    source = torch.Generator().manual_seed(1)
    target = torch.softmax(torch.randn(5, VOCAB, generator=source), dim=-1)
    draft = torch.softmax(torch.randn(4, VOCAB, generator=source), dim=-1)
    tokens = [int(torch.multinomial(draft[i], 1, generator=source)) for i in range(4)]

    def run(seed: int) -> list[tuple[int, int]]:
        generator = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(50):
            v = verify(tokens, draft, target, generator)
            out.append((v.accepted, v.next_token))
        return out

    assert run(7) == run(7)
    assert run(7) != run(8)


@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_sampled_tokens_follow_the_target_distribution(deterministic_draft: bool) -> None:
    """Chi-square: the first emitted token is distributed as target_probs[0],
    whatever the draft proposed (Leviathan et al. 2023, Theorem 1)."""
    source = torch.Generator().manual_seed(3)
    target = torch.softmax(torch.randn(3, VOCAB, generator=source) * 1.5, dim=-1)  # [3, V]
    draft = torch.softmax(torch.randn(2, VOCAB, generator=source) * 1.5, dim=-1)  # [2, V]
    generator = torch.Generator().manual_seed(4)
    samples = 20000
    counts = torch.zeros(VOCAB)
    for _ in range(samples):
        if deterministic_draft:
            tokens, probs = [2, 4], None
        else:
            tokens = [int(torch.multinomial(draft[i], 1, generator=generator)) for i in range(2)]
            probs = draft
        verdict = verify(tokens, probs, target, generator)
        first = tokens[0] if verdict.accepted >= 1 else verdict.next_token
        counts[first] += 1
    expected = target[0] * samples
    result = chisquare(counts.numpy(), expected.numpy())
    assert result.pvalue > 1e-3, (counts, expected)
    # and the test has power: the draft's own distribution is rejected
    if not deterministic_draft:
        assert chisquare(counts.numpy(), (draft[0] * samples).numpy()).pvalue < 1e-6


def test_second_position_is_conditionally_exact() -> None:
    """Given the first draft token was accepted, the second emitted token is
    distributed as target_probs[1]."""
    source = torch.Generator().manual_seed(5)
    target = torch.softmax(torch.randn(3, VOCAB, generator=source), dim=-1)
    target[0] = torch.tensor([0.9, 0.02, 0.02, 0.02, 0.02, 0.02])
    draft = torch.softmax(torch.randn(2, VOCAB, generator=source), dim=-1)
    draft[0] = torch.tensor([0.9, 0.02, 0.02, 0.02, 0.02, 0.02])
    generator = torch.Generator().manual_seed(6)
    counts = torch.zeros(VOCAB)
    for _ in range(20000):
        second = int(torch.multinomial(draft[1], 1, generator=generator))
        verdict = verify([0, second], draft, target, generator)
        if verdict.accepted >= 1:
            counts[second if verdict.accepted == 2 else verdict.next_token] += 1
    result = chisquare(counts.numpy(), (target[1] * counts.sum()).numpy())
    assert result.pvalue > 1e-3


# -- keyed sampling ---------------------------------------------------------------------


def _keyed_chain(target: torch.Tensor, key: SamplingKey, position: int) -> list[int]:
    """What plain decoding draws, row by row, with ``key`` from ``position``."""
    return [key.draw(target[i], position + i) for i in range(target.shape[0])]


def test_keyed_verdict_is_plain_decoding_whatever_was_drafted() -> None:
    source = torch.Generator().manual_seed(8)
    target = torch.softmax(torch.randn(9, VOCAB, generator=source), dim=-1)  # [9, V]
    key = SamplingKey(seed=21, choice=1)
    plain = _keyed_chain(target, key, position=40)
    for accepted in range(9):
        draft = plain[:accepted] + ([(plain[accepted] + 1) % VOCAB] if accepted < 8 else [])
        draft += [0] * (8 - len(draft))  # whatever follows a mismatch
        verdict = verify(draft, None, target, key, position=40)
        assert verdict.committed(draft) == plain[: accepted + 1]
        assert verdict.accepted == accepted
        assert verdict.bonus == (accepted == 8)
    assert _keyed_chain(target, SamplingKey(seed=21, choice=1), 40) == plain  # a fresh key
    assert _keyed_chain(target, SamplingKey(seed=21, choice=0), 40) != plain
    assert _keyed_chain(target, SamplingKey(seed=21, choice=1), 41) != plain


def test_keyed_draw_never_picks_a_forbidden_token() -> None:
    probs = torch.tensor([0.0, 0.0, 1e-6, 0.0, 1.0 - 1e-6, 0.0])
    for seed in range(300):
        assert SamplingKey(seed).draw(probs, 0) in (2, 4)


@pytest.mark.parametrize("keyed", [True, False])
def test_the_bonus_after_eight_accepted_follows_the_last_row(keyed: bool) -> None:
    """Drafts drawn from the target itself are all accepted; the bonus token after
    eight of them is distributed as target_probs[8] (and not as the row before)."""
    source = torch.Generator().manual_seed(9)
    target = torch.softmax(torch.randn(9, VOCAB, generator=source) * 1.5, dim=-1)  # [9, V]
    samples = 6000
    counts = torch.zeros(VOCAB)
    generator = torch.Generator().manual_seed(10)
    for seed in range(samples):
        if keyed:
            key = SamplingKey(seed)
            draft = [key.draw(target[i], i) for i in range(8)]
            verdict = verify(draft, target[:8], target, key, position=0)
        else:
            draft = [int(torch.multinomial(target[i], 1, generator=generator)) for i in range(8)]
            verdict = verify(draft, target[:8], target, generator)
        assert verdict.bonus
        counts[verdict.next_token] += 1
    assert chisquare(counts.numpy(), (target[8] * samples).numpy()).pvalue > 1e-3
    assert chisquare(counts.numpy(), (target[7] * samples).numpy()).pvalue < 1e-6


def test_keyed_tokens_follow_the_target_distribution_at_every_row() -> None:
    """Over seeds, the keyed draw at each row is distributed as that row, whatever a
    (poor) draft proposed: the committed token at the first rejected row included."""
    source = torch.Generator().manual_seed(11)
    target = torch.softmax(torch.randn(4, VOCAB, generator=source) * 1.5, dim=-1)  # [4, V]
    draft_probs = torch.softmax(torch.randn(3, VOCAB, generator=source), dim=-1)  # [3, V]
    samples = 6000
    first = torch.zeros(VOCAB)
    for seed in range(samples):
        key = SamplingKey(seed)
        draft = [key.draw(draft_probs[i], i) for i in range(3)]  # the drafter's keyed draws
        verdict = verify(draft, draft_probs, target, key)
        first[verdict.committed(draft)[0]] += 1
    assert chisquare(first.numpy(), (target[0] * samples).numpy()).pvalue > 1e-3
    assert chisquare(first.numpy(), (draft_probs[0] * samples).numpy()).pvalue < 1e-6
