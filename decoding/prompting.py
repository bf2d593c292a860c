"""Turning text and chat messages into token ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def encode_text(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Apply the model's chat template and open the assistant's turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use the completions endpoint")
    ids = tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=True, tokenize=True,
    )
    if hasattr(ids, "keys") and "input_ids" in ids:  # a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]
