"""Fill-in-the-middle on ``/v1/completions`` (``suffix``): the model's tokens are found in
its tokenizer's added vocabulary, the prompt is built from them, and a model without
them refuses a suffix by name. Answers of a model trained for it: tests/gateway/test_qwen.py.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from gateway.decode.fim import FORMATS, fim_tokens
from gateway.decode.params import completion_prompts
from gateway.wire.errors import InvalidRequestError
from gateway.wire.requests import CompletionRequest
from tests.gateway.conftest import TINY, openai_client

PREFIX, SUFFIX = "def add(a, b):\n    ", "\n\nprint(add(1, 2))"


@pytest.fixture(scope="module")
def client(tiny_url: str) -> openai.OpenAI:
    return openai_client(tiny_url)


@pytest.fixture(scope="module")
def plain(default_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def starcoder_style(default_model_dir: Path) -> PreTrainedTokenizerBase:
    """The default tokenizer with StarCoder's fill-in-the-middle tokens added."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(FORMATS[1][1:])})
    return tokenizer


def test_a_model_without_fim_tokens_refuses_a_suffix(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=TINY, prompt=PREFIX, suffix=SUFFIX, max_tokens=4)
    assert refused.value.param == "suffix" and "fill-in-the-middle" in refused.value.message
    plain = client.completions.create(model=TINY, prompt=PREFIX, suffix="", max_tokens=2)
    assert plain.choices[0].finish_reason in ("stop", "length")  # empty: no suffix


def test_echo_with_a_suffix_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=TINY, prompt=PREFIX, suffix=SUFFIX, echo=True,
                                  max_tokens=4)
    assert refused.value.param == "echo"


def test_the_tokens_come_from_the_added_vocabulary(
        plain: PreTrainedTokenizerBase, starcoder_style: PreTrainedTokenizerBase) -> None:
    assert fim_tokens(plain) is None
    found = fim_tokens(starcoder_style)
    assert found is not None and found.models == FORMATS[1][0]
    ids = [starcoder_style.convert_tokens_to_ids(t) for t in FORMATS[1][1:]]
    assert (found.prefix, found.suffix, found.middle) == tuple(ids)


def test_the_prompt_is_prefix_suffix_middle(starcoder_style: PreTrainedTokenizerBase) -> None:
    fim = fim_tokens(starcoder_style)
    assert fim is not None
    before = starcoder_style.encode(PREFIX, add_special_tokens=False)
    after = starcoder_style.encode(SUFFIX, add_special_tokens=False)
    for prompt in (PREFIX, before):
        request = CompletionRequest.model_validate(
            {"model": "m", "prompt": prompt, "suffix": SUFFIX})
        [built] = completion_prompts(starcoder_style, request, len(starcoder_style), fim)
        assert built.ids == (fim.prefix, *before, fim.suffix, *after, fim.middle)
    with pytest.raises(InvalidRequestError) as refused:
        completion_prompts(starcoder_style, CompletionRequest.model_validate(
            {"model": "m", "prompt": PREFIX, "suffix": SUFFIX}), len(starcoder_style), None)
    assert refused.value.param == "suffix"
