"""Fill-in-the-middle: ``/v1/completions`` with a ``suffix``.

A code model trained to fill in the middle reads the text before the gap and the
text after it between three tokens of its vocabulary, and writes the middle. The
formats below are the ones known (prefix, suffix, middle; the answer follows the
middle token); a model's tokenizer is matched against them at load, by its added
vocabulary, so a model either has one of them or none, and a ``suffix`` sent to a
model without one is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# (models, prefix token, suffix token, middle token)
FORMATS: tuple[tuple[str, str, str, str], ...] = (
    ("Qwen2.5-Coder, CodeGemma", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("StarCoder, SantaCoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("DeepSeek-Coder", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)


@dataclass(frozen=True)
class FimTokens:
    """A model's fill-in-the-middle tokens."""

    models: str  # the family whose format it is
    prefix: int
    suffix: int
    middle: int

    def prompt(self, before: Sequence[int], after: Sequence[int]) -> tuple[int, ...]:
        """The prompt whose answer is the middle between ``before`` and ``after``."""
        return (self.prefix, *before, self.suffix, *after, self.middle)


def fim_tokens(tokenizer: Any) -> FimTokens | None:
    """The tokenizer's fill-in-the-middle tokens, from its added vocabulary (None: it
    has no known format whole)."""
    added = tokenizer.get_added_vocab()
    for models, *marks in FORMATS:
        if all(mark in added for mark in marks):
            prefix, suffix, middle = (int(added[mark]) for mark in marks)
            return FimTokens(models, prefix, suffix, middle)
    return None
