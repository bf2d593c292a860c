"""Sampling defaults: what a request that leaves temperature, top_p or top_k unset samples
with. The model's recommended values by default (its generation_config.json, or for the
default model its model card's), a setting to override or turn them off, shown in
/v1/models, and a request's own values always win."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from decoding.engine import Engine
from gateway.decode.params import SamplingDefaults, sampling_defaults
from gateway.server import create_app
from gateway.service.settings import Settings, add_settings_flags, settings_from_args
from runtime.files import model_store
from tests.gateway.conftest import CHAT, TINY, in_process, tiny_settings


def test_the_default_model_samples_as_its_model_card_says(default_model_dir: Path) -> None:
    assert model_store.recommended_sampling(str(default_model_dir)) == (
        {"temperature": 0.2, "top_p": 0.9}, "model card")
    gguf = default_model_dir / model_store.GGUF_NAME  # the file the server loads
    assert sampling_defaults("model", str(gguf)) == SamplingDefaults(
        temperature=0.2, top_p=0.9, top_k=0, source="model card")


def test_a_model_directory_recommends_through_its_generation_config(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2}))
    assert sampling_defaults("model", str(tmp_path)) == SamplingDefaults(
        temperature=0.6, top_p=0.95, top_k=20, source="generation_config.json")
    # a value outside a request's range is left out; the others stay
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 7,
                                                                 "top_p": 0.5}))
    assert sampling_defaults("model", str(tmp_path)) == SamplingDefaults(
        top_p=0.5, source="generation_config.json")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert sampling_defaults("model", str(tmp_path)).source.startswith("openai")
    (tmp_path / "generation_config.json").write_text("{not json")
    unreadable = sampling_defaults("model", str(tmp_path))
    assert (unreadable.temperature, unreadable.top_p, unreadable.top_k) == (1.0, 1.0, 0)
    assert sampling_defaults('{"temperature": 0.5}', str(tmp_path)) == SamplingDefaults(
        temperature=0.5, source="settings")


def test_the_setting_takes_model_openai_or_an_object(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().sampling_defaults == "model"
    monkeypatch.setenv("SPECSERVE_SAMPLING_DEFAULTS", "openai")
    assert Settings().sampling_defaults == "openai"
    parser = argparse.ArgumentParser()
    add_settings_flags(parser)
    args = parser.parse_args(["--sampling-defaults", '{"top_p": 0.8, "temperature": 0.3}'])
    assert json.loads(settings_from_args(args).sampling_defaults) == {"temperature": 0.3,
                                                                      "top_p": 0.8}
    for bad in ["greedy", '{"temperature": 3}', '{"min_p": 0.1}', '{"top_k": 1.5}', "[0.2]",
                '{"temperature": true}', '{"top_k": 1e400}', '{"temperature": NaN}']:
        with pytest.raises(ValidationError, match="sampling_defaults"):
            Settings(sampling_defaults=bad)


async def _ask(client: httpx.AsyncClient, **fields: Any) -> str:
    body = {"model": TINY, "messages": CHAT, "max_tokens": 12, **fields}
    reply = await client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["message"]["content"])


async def test_unset_fields_sample_with_the_defaults(tiny_engine: Engine) -> None:
    """Greedy as the server's default: a request without temperature decodes greedily
    (the same text as asking for temperature 0, with any seed); one that sends its own
    temperature samples with it."""
    greedy = tiny_settings(sampling_defaults='{"temperature": 0}')
    async with in_process(create_app(greedy, engine=tiny_engine)) as client:
        card = (await client.get("/v1/models")).json()["data"][0]
        assert card["metadata"]["sampling_defaults"] == {
            "temperature": 0.0, "top_p": 1.0, "top_k": 0, "source": "settings"}
        zero = await _ask(client, temperature=0)
        assert {await _ask(client, seed=s) for s in (1, 2, 3)} == {zero}
        own = {await _ask(client, temperature=1.0, seed=s) for s in (1, 2, 3)}
        assert len(own) > 1  # the request's own temperature won
    async with in_process(create_app(tiny_settings(sampling_defaults="openai"),
                                     engine=tiny_engine)) as client:
        card = (await client.get("/v1/models")).json()["data"][0]
        assert card["metadata"]["sampling_defaults"]["source"] == "openai"
        for seed in (1, 2):  # OpenAI's default: temperature 1, top_p 1
            assert await _ask(client, seed=seed) == await _ask(client, seed=seed,
                                                               temperature=1.0, top_p=1.0)


async def test_responses_report_what_they_sampled_with(tiny_engine: Engine) -> None:
    settings = tiny_settings(sampling_defaults='{"temperature": 0.4, "top_p": 0.7}')
    async with in_process(create_app(settings, engine=tiny_engine)) as client:
        body = {"model": TINY, "input": "Hi", "max_output_tokens": 4}
        unset = (await client.post("/v1/responses", json=body)).json()
        assert (unset["temperature"], unset["top_p"]) == (0.4, 0.7)
        own = (await client.post("/v1/responses", json={**body, "temperature": 1.5})).json()
        assert (own["temperature"], own["top_p"]) == (1.5, 0.7)


def test_a_copied_model_keeps_its_recommendation(tmp_path: Path,
                                                 tiny_target_dir: Path) -> None:
    """A model directory that is not the default model's recommends only what its own
    generation_config.json says."""
    copy = tmp_path / "m"
    shutil.copytree(tiny_target_dir, copy)
    assert model_store.recommended_sampling(str(copy)) == ({}, "none")


def test_stop_strings_come_from_generation_config(tmp_path: Path) -> None:
    """``stop_strings`` beside a GGUF file (or in a model directory) end chat answers;
    none, an unreadable file or a wrong type give none."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    config = tmp_path / "generation_config.json"
    assert model_store.recommended_stops(str(gguf)) == ()
    config.write_text(json.dumps({"stop_strings": ["\nUser:", "", 3]}))
    assert model_store.recommended_stops(str(gguf)) == ("\nUser:",)
    assert model_store.recommended_stops(str(tmp_path)) == ("\nUser:",)
    config.write_text(json.dumps({"stop_strings": "\nUser:"}))
    assert model_store.recommended_stops(str(gguf)) == ("\nUser:",)
    config.write_text("{")
    assert model_store.recommended_stops(str(gguf)) == ()
