"""The playground page as the server serves it, and the per-round ``speculation``
extra of stream chunks that the page draws (in-process, tiny model)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from decoding.engine import Engine
from gateway.server import build_engine, create_app
from gateway.service.settings import Settings, add_settings_flags, settings_from_args
from tests.gateway.conftest import TINY, in_process, tiny_settings

ORIGINS = {"lookup", "cache", "model", "prediction", "target", "prompt"}
REPEATING = "one two three four one two three four one two three four one two"


async def test_root_redirects_to_the_page(client: httpx.AsyncClient) -> None:
    root = await client.get("/")
    assert root.status_code == 307 and root.headers["location"] == "/playground"
    page = await client.get("/playground")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<title>specserve playground</title>" in page.text


async def test_the_page_runs_only_its_own_files(client: httpx.AsyncClient) -> None:
    page = await client.get("/playground")
    csp = page.headers["content-security-policy"]
    directives = dict(part.strip().split(" ", 1) for part in csp.split(";"))
    assert directives["default-src"] == "'none'"
    assert directives["script-src"] == "'self'" and directives["connect-src"] == "'self'"
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    # no inline script or style, nothing from another origin
    assert not re.search(r"<script(?![^>]*\bsrc=)", page.text)
    assert "<style" not in page.text and " style=" not in page.text
    assert not re.search(r"(src|href)=\"(https?:)?//", page.text)
    for path, kind in (("/playground/playground.js", "text/javascript"),
                       ("/playground/playground.css", "text/css")):
        asset = await client.get(path)
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
        assert asset.headers["content-security-policy"] == csp
    script = (await client.get("/playground/playground.js")).text
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script
    assert "textContent" in script


async def test_the_page_can_be_turned_off(tiny_engine: Engine) -> None:
    async with in_process(create_app(tiny_settings(playground=False),
                                     engine=tiny_engine)) as client:
        for path in ("/", "/playground", "/playground/playground.js"):
            assert (await client.get(path)).status_code == 404
        assert (await client.get("/health")).status_code == 200


def test_playground_setting_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_settings_flags(parser)
    assert Settings().playground is True
    monkeypatch.setenv("SPECSERVE_PLAYGROUND", "false")
    assert settings_from_args(parser.parse_args([])).playground is False
    assert settings_from_args(parser.parse_args(["--playground"])).playground is True
    monkeypatch.delenv("SPECSERVE_PLAYGROUND")
    assert settings_from_args(parser.parse_args(["--no-playground"])).playground is False


async def test_the_page_is_public_but_the_api_keeps_its_key(tiny_engine: Engine) -> None:
    app = create_app(tiny_settings(api_keys=["secret"]), engine=tiny_engine)
    async with in_process(app) as client:
        assert (await client.get("/playground")).status_code == 200
        assert (await client.get("/v1/models")).status_code == 401


async def _stream(client: httpx.AsyncClient, path: str, body: dict[str, Any]
                  ) -> list[dict[str, Any]]:
    chunks = []
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def _check_spans(text: str, info: dict[str, Any]) -> dict[str, int]:
    """The chunk's spans cover its text exactly; returns characters per origin."""
    counts: dict[str, int] = {}
    for length, origin in info["spans"]:
        assert origin in ORIGINS and length > 0
        counts[origin] = counts.get(origin, 0) + length
    assert sum(counts.values()) == len(text)
    if info["accepted_tokens"] == 0:
        assert set(counts) <= {"target", "prompt"}
    return counts


@pytest.fixture(scope="module")
def cached_engine(tiny_target_dir: Path) -> Iterator[Engine]:
    """The tiny model with the prefix cache, so continuation drafts replay an answer."""
    engine = build_engine(tiny_settings(target=str(tiny_target_dir), draft="ngram+cache",
                                        prefix_block_tokens=16))
    yield engine
    engine.shutdown()


async def test_every_chunk_carries_its_round(cached_engine: Engine) -> None:
    body = {"model": TINY, "messages": [{"role": "user", "content": REPEATING}],
            "max_tokens": 32, "temperature": 0, "speculation": {"drafter": "cache"}}
    async with in_process(create_app(tiny_settings(), engine=cached_engine)) as client:
        whole = (await client.post("/v1/chat/completions", json=body)).json()
        chunks = await _stream(client, "/v1/chat/completions", body)  # drafts: that answer
    opening, *rounds = chunks  # the role, sent before any round
    assert "speculation" not in opening and opening["choices"][0]["delta"]["content"] == ""
    text, accepted, coloured, indexes = "", 0, 0, []
    for chunk in rounds:
        spec = chunk["speculation"]
        info = spec["round"]
        content = chunk["choices"][0]["delta"].get("content", "")
        counts = _check_spans(content, info)
        assert info["source"] in {"cache", "none"}
        assert info["tokens"] >= info["accepted_tokens"] and info["verify_ms"] >= 0
        text += content
        accepted += info["accepted_tokens"]
        coloured += counts.get("cache", 0)
        indexes.append(info["index"])
        assert spec["accepted_tokens"] == accepted  # running totals
        assert spec["drafter"] == "cache"
    assert text == whole["choices"][0]["message"]["content"]
    assert indexes == sorted(indexes) and len(set(indexes)) == len(indexes)
    assert accepted >= 16 and coloured > len(text) / 2, "the replayed answer is coloured"
    assert chunks[-1]["speculation"]["rounds"] < whole["speculation"]["rounds"]


async def test_drafters_are_listed_and_asked_for_by_their_names(cached_engine: Engine) -> None:
    async with in_process(create_app(tiny_settings(), engine=cached_engine)) as client:
        (card,) = (await client.get("/v1/models")).json()["data"]
        names = card["metadata"]["drafters"]
        assert set(names) == {"ngram", "cache", "ngram+cache", "none"}
        assert card["metadata"]["default_drafter"] == "ngram+cache"
        for name in names:
            body = {"model": TINY, "prompt": REPEATING, "max_tokens": 4,
                    "speculation": {"drafter": name}}
            reply = await client.post("/v1/completions", json=body)
            assert reply.status_code == 200, (name, reply.text)
            assert reply.json()["speculation"]["drafter"] == (None if name == "none" else name)


async def test_speculation_off_is_all_target(client: httpx.AsyncClient) -> None:
    body = {"model": TINY, "messages": [{"role": "user", "content": REPEATING}],
            "max_tokens": 20, "temperature": 0, "speculation": {"enabled": False}}
    for chunk in (await _stream(client, "/v1/chat/completions", body))[1:]:  # past the role
        info = chunk["speculation"]["round"]
        content = chunk["choices"][0]["delta"].get("content", "")
        assert info["source"] == "none" and info["draft_tokens"] == 0
        assert set(_check_spans(content, info)) <= {"target"}


async def test_echoed_prompt_is_its_own_span(client: httpx.AsyncClient) -> None:
    body = {"model": TINY, "prompt": REPEATING, "max_tokens": 12, "temperature": 0,
            "echo": True}
    chunks = await _stream(client, "/v1/completions", body)
    first = chunks[0]
    assert first["choices"][0]["text"].startswith(REPEATING)
    assert first["speculation"]["round"]["spans"][0] == [len(REPEATING), "prompt"]
    for chunk in chunks:
        _check_spans(chunk["choices"][0]["text"], chunk["speculation"]["round"])


def test_origins_follow_the_text_through_multibyte_tokens(default_model_dir: Path) -> None:
    """Windowed decoding gives the lengths a whole decode would, over text whose
    characters span several tokens; spans cover whatever text is sent."""
    import random

    from transformers import AutoTokenizer

    from decoding.types import RoundEvent
    from gateway.encode.speculation import TextOrigins

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    ids = tokenizer.encode("Héllo wörld! 日本語のテキスト 🎉🎉 def f(x): return x**2\n" * 12)
    origins, rng, at = TextOrigins(tokenizer), random.Random(0), 0
    while at < len(ids):
        new = ids[at:at + rng.randint(1, 5)]
        accepted = rng.randint(0, len(new))
        origins.add(RoundEvent(token_ids=tuple(new), text="", draft_tokens=accepted,
                               accepted_tokens=accepted), "model")
        at += len(new)
        whole = tokenizer.decode(ids[:at], skip_special_tokens=True,
                                 clean_up_tokenization_spaces=False)
        assert origins.segments[-1][0] == len(whole)
        sent = whole[origins.sent:len(whole) - rng.randint(0, 2)]  # some text held back
        assert sum(n for n, _ in origins.spans(sent)) == len(sent)


@pytest.mark.parametrize("path", ["/playground", "/playground/playground.js", "/health",
                                  "/ready", "/v1/models", "/", "/favicon.ico"])
async def test_head_answers_as_get_without_the_body(client: httpx.AsyncClient,
                                                    path: str) -> None:
    get = await client.get(path)
    head = await client.head(path)
    assert head.status_code == get.status_code and head.content == b""
    for name in ("content-type", "content-length", "content-security-policy", "location"):
        assert head.headers.get(name) == get.headers.get(name), name


async def test_head_where_there_is_no_get(client: httpx.AsyncClient) -> None:
    head = await client.head("/v1/chat/completions")
    assert head.status_code == 405 and head.content == b""
    assert head.headers["allow"] == "POST"
    assert (await client.head("/nowhere")).status_code == 404
