from __future__ import annotations

import torch

from decoding.sampling import apply_penalties, logits_to_probs, output_counts
from decoding.types import SamplingParams


def test_top_k_keeps_k_tokens() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs[0] > 0).tolist() == [False, True, True, False, False]
    assert torch.isclose(probs.sum(), torch.tensor(1.0))


def test_top_p_keeps_the_smallest_covering_set() -> None:
    probs_in = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    probs = logits_to_probs(probs_in.log(), SamplingParams(temperature=1.0, top_p=0.8))
    assert (probs[0] > 0).tolist() == [True, True, False, False]
    probs = logits_to_probs(probs_in.log(), SamplingParams(temperature=1.0, top_p=0.81))
    assert (probs[0] > 0).tolist() == [True, True, True, False]


def test_temperature_sharpens() -> None:
    logits = torch.tensor([[1.0, 2.0]])
    cold = logits_to_probs(logits, SamplingParams(temperature=0.5))
    hot = logits_to_probs(logits, SamplingParams(temperature=2.0))
    assert cold[0, 1] > hot[0, 1]


def test_penalties_count_earlier_draft_positions() -> None:
    params = SamplingParams(temperature=1.0, presence_penalty=1.0, frequency_penalty=0.5)
    logits = torch.zeros(3, 4)
    counts = output_counts([1, 1], 4, torch.device("cpu"))
    out = apply_penalties(logits, counts, [2, 2], params)
    # position 0: token 1 seen twice; positions 1 and 2 also see the drafted 2s
    assert out[0].tolist() == [0.0, -2.0, 0.0, 0.0]
    assert out[1].tolist() == [0.0, -2.0, -1.5, 0.0]
    assert out[2].tolist() == [0.0, -2.0, -2.0, 0.0]
