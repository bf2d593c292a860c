"""Settings: exact SPECSERVE_* names, comma-separated lists, flags over variables."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.server import add_serve_command
from gateway.service.settings import Settings, settings_from_args


def _serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_defaults() -> None:
    settings = Settings()
    assert (settings.host, settings.port, settings.metrics_port) == ("0.0.0.0", 8000, 9100)
    assert (settings.target, settings.dtype) == ("default", "float32")
    assert settings.draft == "auto"
    assert settings.prefix_cache and settings.redis_url is None
    assert settings.api_keys == [] and settings.cors_origins == []
    assert settings.shutdown_timeout == 30
    assert settings.model_name == "SmolLM2-135M-Instruct"
    assert "default" in settings.model_aliases()


def test_environment_names(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "SPECSERVE_HOST": "127.0.0.1", "SPECSERVE_PORT": "8080", "SPECSERVE_METRICS_PORT": "9200",
        "SPECSERVE_TARGET": "some/model", "SPECSERVE_DRAFT": "none",
        "SPECSERVE_DTYPE": "bfloat16", "SPECSERVE_API_KEYS": "k1, k2,k3",
        "SPECSERVE_MAX_QUEUE": "5", "SPECSERVE_MAX_ACTIVE": "2",
        "SPECSERVE_MAX_PROMPT_TOKENS": "100", "SPECSERVE_MAX_TOKENS": "50",
        "SPECSERVE_REQUEST_TIMEOUT": "7.5",
        "SPECSERVE_CORS_ORIGINS": "https://a.example,https://b.example",
        "SPECSERVE_SHUTDOWN_TIMEOUT": "3", "SPECSERVE_LOG_LEVEL": "DEBUG",
        "SPECSERVE_SERVED_MODEL_NAME": "my-model", "SPECSERVE_PREFILL_CHUNK": "64",
        "SPECSERVE_KV_CACHE_BYTES": "1000000", "SPECSERVE_BATCH_SPECULATION": "always",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    s = Settings()
    assert (s.host, s.port, s.metrics_port) == ("127.0.0.1", 8080, 9200)
    assert (s.target, s.draft, s.dtype) == ("some/model", "none", "bfloat16")
    assert s.api_keys == ["k1", "k2", "k3"]
    assert (s.max_queue, s.max_active, s.max_prompt_tokens, s.max_tokens) == (5, 2, 100, 50)
    assert s.request_timeout == 7.5
    assert s.cors_origins == ["https://a.example", "https://b.example"]
    assert (s.shutdown_timeout, s.log_level, s.model_name) == (3, "debug", "my-model")
    assert {"my-model", "some/model"} <= s.model_aliases()
    assert (s.prefill_chunk, s.kv_cache_bytes, s.batch_speculation) == (64, 1000000, "always")


def test_json_list_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_API_KEYS", '["a,b", "c"]')
    assert Settings().api_keys == ["a,b", "c"]


def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_PORT", "8080")
    monkeypatch.setenv("SPECSERVE_API_KEYS", "from-env")
    monkeypatch.setenv("SPECSERVE_MAX_QUEUE", "9")
    args = _serve_args(["--port", "9000", "--api-key", "a", "--api-key", "b",
                        "--cors-origin", "https://x.example", "--draft", "none",
                        "--served-model-name", "m", "--shutdown-timeout", "1"])
    s = settings_from_args(args)
    assert s.port == 9000 and s.api_keys == ["a", "b"] and s.max_queue == 9
    assert s.cors_origins == ["https://x.example"] and s.draft == "none"
    assert s.model_name == "m" and s.shutdown_timeout == 1


def test_invalid_values_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_DTYPE", "int4")
    with pytest.raises(ValidationError, match="dtype"):
        Settings()
    with pytest.raises(ValidationError, match="max_active"):
        Settings(dtype="float32", max_active=0)


def test_served_name_from_a_model_directory(tmp_path: Path) -> None:
    model_dir = tmp_path / "My-Model-1B"
    model_dir.mkdir()
    assert Settings(target=str(model_dir)).model_name == "My-Model-1B"


def test_the_verify_curve_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--verify-curve`` and where curves are kept: flags, variables, defaults."""
    from gateway.service.curve_store import curve_dir
    from runtime.files import model_store

    monkeypatch.delenv("SPECSERVE_VERIFY_CURVE_DIR", raising=False)
    assert (Settings().verify_curve, Settings().verify_curve_dir) == ("stored", None)
    assert curve_dir(Settings()) == model_store.home() / "curves"
    monkeypatch.setenv("SPECSERVE_VERIFY_CURVE", "measure")
    monkeypatch.setenv("SPECSERVE_VERIFY_CURVE_DIR", "/srv/curves")
    assert (Settings().verify_curve, curve_dir(Settings())) == ("measure", Path("/srv/curves"))
    s = settings_from_args(_serve_args(["--verify-curve", "stored", "--verify-curve-dir", "/c"]))
    assert (s.verify_curve, s.verify_curve_dir) == ("stored", "/c")
    with pytest.raises(ValidationError, match="verify_curve"):
        Settings(verify_curve="sometimes")
