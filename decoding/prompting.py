"""Turning text and chat messages into token ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, object]],
                tools: Sequence[Mapping[str, object]] | None = None) -> list[int]:
    """Apply the model's chat template and open the assistant's turn (``tools`` go to
    a template that takes them). The tokenizer is left untyped: what its
    ``apply_chat_template`` returns differs between transformers' versions."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use the completions endpoint")
    extra = {"tools": [dict(t) for t in tools]} if tools else {}
    ids = tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=True, tokenize=True, **extra,
    )
    if hasattr(ids, "keys") and "input_ids" in ids:  # a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]
