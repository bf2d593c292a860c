"""``/tokenize`` and ``/detokenize`` on the tiny model, in-process: the ids the
completion endpoints would run, vLLM's fields, strict validation in OpenAI's error
format, the API key, and the published schema."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from decoding.engine import Engine
from decoding.prompting import encode_chat
from gateway.server import create_app
from runtime.runner.causal_lm import CausalLM
from tests.gateway.conftest import CHAT, TINY, in_process, tiny_settings
from tests.gateway.test_inprocess import assert_error

TEXT = "Count the tokens of this sentence, please."
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


async def test_a_prompt_counts_as_completions_counts_it(client: httpx.AsyncClient,
                                                        tiny_target: CausalLM) -> None:
    r = await client.post("/tokenize", json={"model": TINY, "prompt": TEXT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["tokens"] == tiny_target.tokenizer.encode(TEXT, add_special_tokens=False)
    assert body["count"] == len(body["tokens"]) and body["token_strs"] is None
    assert body["max_model_len"] == tiny_target.max_context
    used = await client.post("/v1/completions", json={"model": TINY, "prompt": TEXT,
                                                      "max_tokens": 1})
    assert used.json()["usage"]["prompt_tokens"] == body["count"]
    strs = (await client.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True}
                              )).json()["token_strs"]
    assert strs == tiny_target.tokenizer.convert_ids_to_tokens(body["tokens"])


async def test_messages_count_as_chat_completions_renders_them(
        client: httpx.AsyncClient, tiny_target: CausalLM) -> None:
    r = await client.post("/tokenize", json={"model": TINY, "messages": CHAT})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert ids == encode_chat(tiny_target.tokenizer, CHAT)
    used = await client.post("/v1/chat/completions", json={"model": TINY, "messages": CHAT,
                                                           "max_tokens": 1})
    assert used.json()["usage"]["prompt_tokens"] == r.json()["count"]
    with_tools = (await client.post("/tokenize", json={"messages": CHAT, "tools": TOOLS})
                  ).json()
    used = await client.post("/v1/chat/completions", json={
        "model": TINY, "messages": CHAT, "tools": TOOLS, "max_tokens": 1})
    assert with_tools["count"] == used.json()["usage"]["prompt_tokens"] > len(ids)
    bare = (await client.post("/tokenize", json={"messages": CHAT,
                                                 "add_generation_prompt": False})).json()
    assert bare["count"] < len(ids) and ids[: bare["count"]] == bare["tokens"]
    reply = [*CHAT, {"role": "assistant", "content": "Once upon"}]
    open_end = (await client.post("/tokenize", json={
        "messages": reply, "add_generation_prompt": False, "continue_final_message": True})
                ).json()
    text = tiny_target.tokenizer.decode(open_end["tokens"])
    assert text.endswith("Once upon")


async def test_detokenize_is_the_echoed_text(client: httpx.AsyncClient,
                                             tiny_target: CausalLM) -> None:
    ids = tiny_target.tokenizer.encode(TEXT, add_special_tokens=False)
    r = await client.post("/detokenize", json={"model": TINY, "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": TEXT}
    echoed = await client.post("/v1/completions", json={"model": TINY, "prompt": ids,
                                                        "max_tokens": 0, "echo": True})
    assert echoed.json()["choices"][0]["text"] == TEXT
    assert (await client.post("/detokenize", json={"tokens": []})).json() == {"prompt": ""}
    as_floats = await client.post("/detokenize", json={"tokens": [float(t) for t in ids]})
    assert as_floats.json() == {"prompt": TEXT}  # JSON Schema's integers include 5.0


async def test_the_vocabulary_ends_where_the_model_says(client: httpx.AsyncClient,
                                                     tiny_target: CausalLM) -> None:
    """The last id decodes; the first id past it is a 400 naming it, not an empty text."""
    last = tiny_target.vocab_size - 1
    assert (await client.post("/detokenize", json={"tokens": [last]})).status_code == 200
    past = await client.post("/detokenize", json={"tokens": [tiny_target.vocab_size, 1]})
    assert_error(past, 400, "tokens[0]")
    assert str(tiny_target.vocab_size) in past.json()["error"]["message"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "temperature": 0}, "temperature"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": CHAT, "prompt": "x"}, "prompt"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ 1 }}"}, "chat_template"),
    ("/tokenize", {"messages": CHAT, "tools": TOOLS * 2}, "tools"),
    ("/tokenize", {}, "prompt"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]"),
    ("/detokenize", {"tokens": ["1"]}, "tokens[0]"),
    ("/detokenize", {"tokens": [1.5]}, "tokens[0]"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, "skip_special_tokens"),
])
async def test_bad_input_is_a_400_naming_the_field(client: httpx.AsyncClient, path: str,
                                                   body: dict[str, Any], param: str) -> None:
    assert_error(await client.post(path, json=body), 400, param)


async def test_unknown_model_and_bad_json(client: httpx.AsyncClient) -> None:
    assert_error(await client.post("/tokenize", json={"model": "gpt-4o", "prompt": "x"}), 404,
                 "model", "model_not_found")
    assert_error(await client.post("/detokenize", json={"model": "gpt-4o", "tokens": [1]}),
                 404, "model", "model_not_found")
    assert_error(await client.post("/tokenize", content=b"[1, 2]"), 400, code="invalid_json")
    assert_error(await client.post("/detokenize", content=b"{"), 400, code="invalid_json")


async def test_an_api_key_guards_them(tiny_engine: Engine) -> None:
    app = create_app(tiny_settings(api_keys=["secret"]), engine=tiny_engine)
    async with in_process(app) as client:
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            assert_error(await client.post(path, json=body), 401)
            ok = await client.post(path, json=body, headers={"Authorization": "Bearer secret"})
            assert ok.status_code == 200
        document = (await client.get("/openapi.json")).json()
    for path in ("/tokenize", "/detokenize"):
        operation = document["paths"][path]["post"]
        assert operation["security"] == [{"bearerAuth": []}]
        assert {"200", "400", "401", "404"} <= set(operation["responses"])
    body = document["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["anyOf"] == [
        {"$ref": "#/components/schemas/TokenizeCompletionRequest"},
        {"$ref": "#/components/schemas/TokenizeChatRequest"}]
    schemas = document["components"]["schemas"]
    ids = schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert (ids["minimum"], ids["maximum"]) == (0, tiny_engine.target.vocab_size - 1)
    forms = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert forms[2]["items"] == forms[3]["items"]["items"] == ids  # token-id prompts
    assert {"TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest",
            "TokenizeResponse", "DetokenizeResponse"} <= set(schemas)
