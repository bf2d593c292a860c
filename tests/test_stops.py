"""Stop conditions: stop strings (across rounds), max tokens, stop tokens, UTF-8."""

from __future__ import annotations

import pytest

from decoding.prompting import encode_text
from decoding.round import decode
from decoding.text import TextStream, _backend
from decoding.types import FinishReason, GenerationRequest, SamplingParams
from drafters.model import ModelDrafter
from drafters.ngram import NgramDrafter
from runtime.runner.causal_lm import CausalLM

GREEDY = SamplingParams(temperature=0.0)
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


def _plain(target: CausalLM, n: int = 40) -> tuple[tuple[int, ...], list[int], str]:
    ids = tuple(encode_text(target.tokenizer, PROMPT))
    request = GenerationRequest(prompt_ids=ids, max_new_tokens=n, sampling=GREEDY)
    out = [t for e in decode(target, None, request) for t in e.token_ids]
    return ids, out, target.tokenizer.decode(out, skip_special_tokens=True)


def test_stop_string_is_never_emitted(tiny_target: CausalLM) -> None:
    ids, out, text = _plain(tiny_target)
    # a stop string that spans two tokens in the middle of the output
    tok = tiny_target.tokenizer
    boundary = len(tok.decode(out[:6], skip_special_tokens=True))
    stop = text[boundary - 2 : boundary + 3]
    assert len(stop) == 5
    expected = text[: text.find(stop)]
    for drafter in (None, NgramDrafter(), ModelDrafter(tiny_target, tiny_target)):
        request = GenerationRequest(prompt_ids=ids, max_new_tokens=40, sampling=GREEDY,
                                    stop=(stop, "never-appears-here"))
        events = list(decode(tiny_target, drafter, request))
        deltas = [e.text for e in events]
        assert "".join(deltas) == expected
        assert events[-1].finish_reason is FinishReason.STOP
        assert not any(stop in d for d in deltas)


def test_text_stream_holds_a_partial_stop_across_pushes(tiny_target: CausalLM) -> None:
    tok = tiny_target.tokenizer
    ids = encode_text(tok, "Hello world, this is the end. More text")
    stream = TextStream(tok, stop=("the end",))
    out = []
    stopped = False
    for token in ids:
        update = stream.push([token])
        out.append(update.delta)
        if update.stopped:
            stopped = True
            break
    assert stopped
    assert "".join(out) == "Hello world, this is "
    assert not any("the" in d and "end" in d for d in out)


def test_incomplete_utf8_is_held_back(tiny_target: CausalLM) -> None:
    tok = tiny_target.tokenizer
    ids = encode_text(tok, "Snow ☃ and 日本語 text")
    stream = TextStream(tok)
    deltas = [stream.push([t]).delta for t in ids]
    deltas.append(stream.flush())
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == "Snow ☃ and 日本語 text"


@pytest.mark.parametrize("limit", [1, 2, 7, 13])
def test_max_tokens_exactly_honoured(tiny_target: CausalLM, limit: int) -> None:
    ids = tuple(encode_text(tiny_target.tokenizer, "a b a b a b a b a b"))
    request = GenerationRequest(prompt_ids=ids, max_new_tokens=limit, sampling=GREEDY)
    for drafter in (None, NgramDrafter(), ModelDrafter(tiny_target, tiny_target)):
        events = list(decode(tiny_target, drafter, request))
        assert sum(len(e.token_ids) for e in events) == limit
        assert events[-1].completion_tokens == limit
        assert events[-1].finish_reason is FinishReason.LENGTH


def test_stop_token_ends_generation(tiny_target: CausalLM) -> None:
    ids, out, _ = _plain(tiny_target)
    stop_token = out[5]
    first = out.index(stop_token)
    request = GenerationRequest(prompt_ids=ids, max_new_tokens=40, sampling=GREEDY,
                                stop_token_ids=(stop_token,))
    for drafter in (None, NgramDrafter(), ModelDrafter(tiny_target, tiny_target)):
        events = list(decode(tiny_target, drafter, request))
        got = [t for e in events for t in e.token_ids]
        assert got == out[: first + 1]
        assert events[-1].finish_reason is FinishReason.STOP


def test_context_limit_ends_with_length(tiny_target: CausalLM) -> None:
    room = 5
    ids = tuple([42] * (tiny_target.max_context - room))
    request = GenerationRequest(prompt_ids=ids, max_new_tokens=100, sampling=GREEDY)
    events = list(decode(tiny_target, NgramDrafter(), request))
    assert events[-1].completion_tokens == room
    assert events[-1].finish_reason is FinishReason.LENGTH


def test_incremental_text_equals_decoding_everything_at_once(default_target: CausalLM) -> None:
    tok = default_target.tokenizer
    text = "Grüße aus Köln! 東京タワー 🚲 — «quotes», tabs\tand  double  spaces.\nNew line."
    ids = encode_text(tok, text * 3)
    for chunk in (1, 2, 3, 5):
        stream = TextStream(tok)
        out = "".join(stream.push(ids[i : i + chunk]).delta for i in range(0, len(ids), chunk))
        out += stream.flush()
        assert out == tok.decode(ids, skip_special_tokens=True)


def test_text_stream_decodes_through_the_backend_as_the_wrapper_does(
        default_target: CausalLM) -> None:
    """The stream calls the tokenizers backend directly (1.7 against the wrapper's 4.1 us
    per call); with special tokens among the ids its text is still the wrapper's."""
    tok = default_target.tokenizer
    stream = TextStream(tok)
    assert _backend(tok) is tok._tokenizer
    special = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = [special[0], *encode_text(tok, "assistant\nHi — Grüße 🚲"), special[1], 198,
           special[0], *encode_text(tok, " and  spaces")]
    out = "".join(stream.push([t]).delta for t in ids) + stream.flush()
    assert out == tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert "<|im_end|>" not in out

    class OwnDecoding(type(tok)):  # a tokenizer class that decodes its own way
        def _decode(self, token_ids, **kwargs):  # type: ignore[no-untyped-def]
            return "own"

    tok.__class__, before = OwnDecoding, tok.__class__
    try:
        stream = TextStream(tok)
        assert _backend(tok) is None
        assert stream.push(ids[:3]).delta == "own"
    finally:
        tok.__class__ = before
