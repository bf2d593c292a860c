"""One name per drafter: what ``--draft`` takes is what ``/v1/models`` lists, what a
request's ``speculation.drafter`` accepts and what metrics label rounds with."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest

from gateway.server import build_drafters, build_engine, build_prefix_cache, create_app
from gateway.service.settings import Settings
from runtime.runner.causal_lm import CausalLM
from tests.gateway.conftest import TINY, in_process, tiny_settings


def test_auto_on_the_default_model_uses_the_names_of_the_flag(default_target: CausalLM) -> None:
    settings = Settings(draft="auto")
    cache = build_prefix_cache(settings, default_target)
    drafters, default, _ = build_drafters(settings, default_target, cache)
    assert default == "ngram+cache+default-draft"
    assert set(drafters) == {"ngram", "cache", "ngram+cache", "default-draft",
                             "ngram+cache+default-draft"}
    assert all(drafter.name == name for name, drafter in drafters.items())


async def test_models_say_what_auto_chose_and_why(tiny_target_dir: Path) -> None:
    """With ``--draft auto``, ``/v1/models`` says which mix auto serves and why; a target
    no draft was made for gets lookup, and says so."""
    engine = build_engine(tiny_settings(target=str(tiny_target_dir), draft="auto"))
    try:
        app = create_app(tiny_settings(draft="auto"), engine=engine)
        async with in_process(app) as client:
            (card,) = (await client.get("/v1/models")).json()["data"]
            assert card["metadata"]["default_drafter"] == "ngram+cache"
            assert card["metadata"]["draft_auto"] == "lookup; no draft was made for this target"
    finally:
        engine.shutdown()
    engine = build_engine(tiny_settings(target=str(tiny_target_dir), draft="ngram"))
    try:
        app = create_app(tiny_settings(draft="ngram"), engine=engine)
        async with in_process(app) as client:
            (card,) = (await client.get("/v1/models")).json()["data"]
            assert card["metadata"]["draft_auto"] is None  # not asked for auto
    finally:
        engine.shutdown()


def test_a_measured_choice_of_none_serves_plain_decoding(
        default_target: CausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the stored measurement found no mix faster than plain decoding, ``auto`` on
    the default model without a prefix cache has no default drafter, and says why."""
    from runtime.drafts.draft_choice import Measured
    from wiring import drafts

    measured = Measured("none", {"chat": 1.0, "grounded": 1.0}, "a CPU", 2, "a command")
    monkeypatch.setattr(drafts, "read_choice", lambda: measured)
    engine = build_engine(Settings(draft="auto", prefix_cache=False, served_model_name=TINY,
                                   api_keys=[], cors_origins=[]))
    try:
        assert engine.default_drafter is None
        assert engine.info["draft_auto"] == measured.reason()
        assert set(engine.drafters) == {"ngram"}
    finally:
        engine.shutdown()


async def test_a_draft_directory_is_named_as_typed(tiny_target_dir: Path,
                                                   tiny_draft_dir: Path) -> None:
    spec = f"ngram+{tiny_draft_dir}"
    engine = build_engine(tiny_settings(target=str(tiny_target_dir), draft=spec))
    try:
        app = create_app(tiny_settings(draft=spec), engine=engine)
        async with in_process(app) as client:
            (card,) = (await client.get("/v1/models")).json()["data"]
            assert card["metadata"]["default_drafter"] == spec
            assert {spec, str(tiny_draft_dir), "ngram"} <= set(card["metadata"]["drafters"])
            for name in (spec, str(tiny_draft_dir)):
                reply = await client.post("/v1/completions", json={
                    "model": TINY, "prompt": "a b a b a b", "max_tokens": 6,
                    "speculation": {"drafter": name}})
                assert reply.status_code == 200, reply.text
                assert reply.json()["speculation"]["drafter"] == name
            refused = await client.post("/v1/completions", json={
                "model": TINY, "prompt": "a", "speculation": {"drafter": "draft"}})
            assert refused.status_code == 400 and spec in refused.text  # lists the names
        scrape = generate_latest(app.state.gateway.telemetry.metrics.registry).decode()
        assert f'drafter="{tiny_draft_dir}"' in scrape and f'drafter="{spec}"' in scrape
    finally:
        engine.shutdown()

