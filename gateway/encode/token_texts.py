"""Token ids as the API shows them: their bytes, their text, and log-probabilities
in both OpenAI formats (chat ``logprobs.content`` and the legacy completions
``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

from decoding.types import TokenLogprob

CACHE_SIZE = 1 << 16


def _byte_level_alphabet() -> dict[str, int]:
    """The printable stand-in characters byte-level BPE uses for each byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


class TokenTexts:
    """Bytes and display text of single tokens, cached per tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._alphabet = _byte_level_alphabet() if _is_byte_level(tokenizer) else None
        self.bytes_of = lru_cache(maxsize=CACHE_SIZE)(self._bytes_of)

    def _bytes_of(self, token_id: int) -> bytes:
        if self._alphabet is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in self._alphabet for c in piece):
                return bytes(self._alphabet[c] for c in piece)
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False)).encode()

    def text_of(self, token_id: int) -> str:
        """The token's text; a token that is not whole UTF-8 shows as ``bytes:\\xNN``."""
        raw = self.bytes_of(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def visible(logprobs: Sequence[TokenLogprob], hidden_ids: frozenset[int]
            ) -> Sequence[TokenLogprob]:
    """Drop a final end-of-sequence token: it is not part of the text."""
    if logprobs and logprobs[-1].token_id in hidden_ids:
        return logprobs[:-1]
    return logprobs


def chat_logprobs(texts: TokenTexts, logprobs: Iterable[TokenLogprob]) -> list[dict[str, Any]]:
    """Entries of a chat choice's ``logprobs.content``."""
    out = []
    for lp in logprobs:
        out.append({
            "token": texts.text_of(lp.token_id),
            "logprob": lp.logprob,
            "bytes": list(texts.bytes_of(lp.token_id)),
            "top_logprobs": [
                {"token": texts.text_of(tid), "logprob": value,
                 "bytes": list(texts.bytes_of(tid))}
                for tid, value in lp.top
            ],
        })
    return out


class LegacyLogprobs:
    """Builds the completions-format logprobs of one choice, chunk by chunk,
    keeping ``text_offset`` running across chunks (from ``start_offset``: the length of
    an echoed prompt)."""

    def __init__(self, texts: TokenTexts, start_offset: int = 0) -> None:
        self.texts = texts
        self.offset = start_offset
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def prompt(self, first_token: int, logprobs: Sequence[TokenLogprob]
               ) -> dict[str, list[Any]]:
        """An echoed prompt's entries, offsets from 0: its first token, which nothing
        before it scores (its logprob and alternatives null), then ``logprobs``."""
        prompt = LegacyLogprobs(self.texts)
        first = prompt.chunk([TokenLogprob(token_id=first_token, logprob=0.0)])
        first["token_logprobs"], first["top_logprobs"] = [None], [None]
        return merge_legacy([first, prompt.chunk(logprobs)])

    def chunk(self, logprobs: Iterable[TokenLogprob]) -> dict[str, list[Any]]:
        tokens: list[str] = []
        values: list[float] = []
        tops: list[dict[str, float]] = []
        offsets: list[int] = []
        for lp in logprobs:
            tokens.append(self.texts.text_of(lp.token_id))
            values.append(lp.logprob)
            tops.append({self.texts.text_of(tid): value for tid, value in lp.top})
            offsets.append(self.offset)
            self.offset += len(self._decoder.decode(self.texts.bytes_of(lp.token_id)))
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}


def merge_legacy(parts: Sequence[dict[str, list[Any]]]) -> dict[str, list[Any]]:
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                    "text_offset": []}
    for part in parts:
        for key, values in part.items():
            merged[key].extend(values)
    return merged
