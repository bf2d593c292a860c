"""Independent SDK checks: a real ``specserve serve`` of the default model (its own
quantized weights and default drafters, as ``make run`` serves it), shared by the
Node ``openai`` package's script and LangChain's ``ChatOpenAI``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.gateway.conftest import _no_specserve_env
from tests.reliability.support import ServeProcess, serve

__all__ = ["_no_specserve_env", "default_server"]

MODEL = "SmolLM2-135M-Instruct"
START_TIMEOUT_S = 300.0  # load and warm the default model and draft on two busy cores


@contextmanager
def serve_default() -> Iterator[ServeProcess]:
    """``specserve serve`` with the default target, as ``make run`` serves it."""
    with serve(Path("default"), "--served-model-name", MODEL, "--max-tokens", "256",
               "--log-level", "warning", start_timeout=START_TIMEOUT_S) as server:
        yield server


@pytest.fixture(scope="session")
def default_server(default_model_dir: Path) -> Iterator[ServeProcess]:
    """The shared server (``default_model_dir`` pulls the model first); its log must
    stay free of tracebacks."""
    with serve_default() as server:
        yield server
        server.assert_clean_log()
