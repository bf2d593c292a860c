"""The target's log-probabilities of the tokens a round committed (OpenAI ``logprobs``),
and of a prompt's own tokens (``echo`` with ``logprobs``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decoding.types import TokenLogprob


def token_logprobs(
    tokens: Sequence[int],  # [n] committed tokens
    logits: torch.Tensor,  # [>= n, vocab] the raw target logits behind each of them
    top_n: int,
) -> tuple[TokenLogprob, ...]:
    """Each token's log-probability under the target, with its ``top_n`` alternatives."""
    if not tokens:
        return ()
    logp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)  # [n, vocab]
    chosen = logp[torch.arange(len(tokens)), torch.tensor(list(tokens))].tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if top_n > 0:
        values, indices = torch.topk(logp, min(top_n, logp.shape[-1]), dim=-1)
        tops = [list(zip(i, v, strict=True))
                for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
    return tuple(TokenLogprob(token_id=t, logprob=lp, top=tuple(top))
                 for t, lp, top in zip(tokens, chosen, tops, strict=True))


ROWS_PER_BLOCK = 64  # prompt rows turned into log-probabilities at a time (bounds memory)


def prompt_token_logprobs(
    tokens: Sequence[int],  # [n] the prompt tokens each row predicts
    logits: torch.Tensor,  # [>= n, vocab] the raw target logits of the positions before them
    top_n: int,
) -> tuple[TokenLogprob, ...]:
    """``token_logprobs`` over a prompt chunk, a block of rows at a time."""
    out: list[TokenLogprob] = []
    for start in range(0, len(tokens), ROWS_PER_BLOCK):
        block = tokens[start : start + ROWS_PER_BLOCK]
        out.extend(token_logprobs(block, logits[start : start + len(block)], top_n))
    return tuple(out)


class PromptLogprobs:
    """A prompt's log-probabilities as its chunks are prefilled, handed out once."""

    def __init__(self, prompt_ids: Sequence[int], top_n: int) -> None:
        self.prompt_ids = prompt_ids
        self.top_n = top_n
        self._scored: list[TokenLogprob] = []

    def add(self, prefilled: int, rows: int,
            logits: torch.Tensor,  # [>= rows, vocab] the chunk's raw target logits
            ) -> None:
        """The chunk after ``prefilled`` prompt tokens, ``rows`` long: its rows predict
        the prompt tokens one further on."""
        scored = self.prompt_ids[prefilled + 1 : prefilled + 1 + rows]
        self._scored.extend(prompt_token_logprobs(scored, logits, self.top_n))

    def take(self) -> tuple[TokenLogprob, ...]:
        """What was scored so far, once (for the first event)."""
        taken, self._scored = tuple(self._scored), []
        return taken
