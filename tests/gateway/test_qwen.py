"""Qwen2.5-Coder-1.5B-Instruct, served for real, through the official ``openai`` client:
fill-in-the-middle with its own tokens, and a forced call written with its own
``<tool_call>`` token. Runs where the model has been pulled; skipped otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from runtime.files import model_store
from tests.gateway.conftest import openai_client
from tests.reliability.support import ServeProcess, serve

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(1200)]

QWEN = "qwen2.5-coder-1.5b"
START_TIMEOUT_S = 900.0  # 1.5B parameters on two busy cores
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def qwen_path() -> Path:
    """The pulled model, or a skip: it is never pulled here."""
    try:
        path = Path(model_store.resolve(QWEN, pull=False))
    except FileNotFoundError:
        path = Path(QWEN)
    if not path.exists():
        pytest.skip(f"needs `specserve models pull {QWEN}`")
    return path


@pytest.fixture(scope="module")
def qwen_server() -> Iterator[ServeProcess]:
    with serve(qwen_path(), "--served-model-name", QWEN, "--threads", "2", "--draft", "none",
               start_timeout=START_TIMEOUT_S) as server:
        yield server


@pytest.fixture(scope="module")
def client(qwen_server: ServeProcess) -> openai.OpenAI:
    return openai_client(qwen_server.url)


def test_fill_in_the_middle(client: openai.OpenAI, qwen_server: ServeProcess) -> None:
    out = client.completions.create(model=QWEN, prompt="def add(a, b):\n    ",
                                    suffix="\n\nprint(add(1, 2))", max_tokens=8,
                                    temperature=0)
    assert out.choices[0].text.startswith("return a + b"), out.choices[0].text
    # the suffix decides the middle: it returns a name only the middle can define
    area = client.completions.create(model=QWEN, prompt="def area(radius):\n    ",
                                     suffix="\n    return result\n", max_tokens=16,
                                     temperature=0)
    assert area.choices[0].text.startswith("result ="), area.choices[0].text
    plain = client.completions.create(model=QWEN, prompt="def area(radius):\n    ",
                                      max_tokens=4, temperature=0)
    assert not plain.choices[0].text.lstrip().startswith("result")
    assert "fill-in-the-middle: the Qwen2.5-Coder" in qwen_server.log_text()
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=QWEN, prompt="x", suffix="y", echo=True, max_tokens=1)
    assert refused.value.param == "echo"


def test_a_forced_call_is_written_with_the_model_s_own_tags(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=QWEN, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=40,
        temperature=0)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.tool_calls
    assert message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}
