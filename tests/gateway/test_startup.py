"""Configuration errors at start-up: one clear line on stderr and a non-zero exit,
never a traceback (``specserve serve`` and the other commands, as real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.service.settings import Settings
from gateway.service.startup import StartupError, check_settings
from tests.conftest import KEPT_VARIABLES, free_port

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SPECSERVE_", "OTEL_"))
             or k in KEPT_VARIABLES}
    return subprocess.run([sys.executable, "-m", "specserve.cli", *args], cwd=REPO,
                          env={**clean, **(env or {})}, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize(("args", "env", "says"), [
    (["serve", "--port", "abc"], {}, "argument --port: invalid int value: 'abc'"),
    (["serve", "--port", "99999"], {}, "port (--port, SPECSERVE_PORT): Input should be less"),
    (["serve"], {"SPECSERVE_MAX_QUEUE": "many"}, "max_queue (--max-queue, SPECSERVE_MAX_QUEUE)"),
    (["serve", "--no-prefix-cache", "--draft", "ngram+cache"], {}, "uses the prefix cache"),
    (["serve", "--target", "/nonexistent/model"], {}, "'/nonexistent/model' does not exist"),
    (["serve", "--draft", "ngram+./no-such-draft"], {}, "'./no-such-draft' does not exist"),
    (["generate", "hi", "--target", "/nonexistent/model"], {}, "no config.json"),
])
def test_a_bad_setting_is_one_line(args: list[str], env: dict[str, str], says: str,
                                   tmp_path: Path) -> None:
    if "/nonexistent/model" in args and args[0] == "generate":
        (tmp_path / "model").mkdir()
        args = [a.replace("/nonexistent/model", str(tmp_path / "model")) for a in args]
    result = run_cli(*args, env=env)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert says in lines[0] and "error:" in lines[0]
    assert "Traceback" not in result.stderr + result.stdout


def test_a_model_that_cannot_load_is_one_line_and_exit_1(tmp_path: Path) -> None:
    """Found only when loading (a directory that is no model): the server logs one
    error line, no traceback, and exits with 1."""
    (tmp_path / "empty").mkdir()
    result = run_cli("serve", "--target", str(tmp_path / "empty"), "--host", "127.0.0.1",
                     "--port", str(free_port()), "--metrics-port", str(free_port()),
                     "--log-format", "text")
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "is neither a Hugging Face model directory" in errors[0], \
        result.stderr
    assert "Traceback" not in result.stderr


def test_a_backend_without_its_package_is_refused_before_loading(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # as on a machine without TensorRT
                        lambda name, *a: None if name == "tensorrt" else real(name, *a))
    with pytest.raises(StartupError, match="needs the tensorrt package"):
        check_settings(Settings(draft_backend="tensorrt"))
