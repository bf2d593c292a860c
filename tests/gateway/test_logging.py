"""``specserve serve --log-format json`` as a real process: every line it writes is
JSON, uvicorn's included, and health and readiness polls are not logged at info."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from tests.conftest import KEPT_VARIABLES, free_port, wait_for_status

REPO = Path(__file__).resolve().parents[2]


def _serve_and_poll(model_dir: Path, level: str) -> list[str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECSERVE_", "OTEL_"))
           or k in KEPT_VARIABLES}
    with tempfile.TemporaryFile(mode="w+") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "specserve.cli", "serve", "--target", str(model_dir),
             "--draft", "ngram", "--served-model-name", "tiny", "--host", "127.0.0.1",
             "--port", str(port), "--metrics-port", str(free_port()), "--threads", "1",
             "--log-format", "json", "--log-level", level],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for_status(f"{url}/ready", process, 300, lambda: log.name)
            for path in ("/health", "/ready", "/health", "/ready"):
                assert httpx.get(url + path).status_code == 200
            assert httpx.get(url + "/v1/models").status_code == 200
            assert httpx.get(url + "/v1/nothing").status_code == 404
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=60) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
        log.seek(0)
        return log.read().split("\n")[:-1]


def test_every_line_is_json_and_probes_stay_quiet(tiny_target_dir: Path) -> None:
    lines = _serve_and_poll(tiny_target_dir, "info")
    records = [json.loads(line) for line in lines]  # fails on any line that is not JSON
    loggers = {r["logger"] for r in records}
    assert {"uvicorn.error", "uvicorn.access", "gateway.server"} <= loggers
    access = [r for r in records if r["logger"] == "uvicorn.access"]
    paths = [r["path"] for r in access]
    assert "/v1/models" in paths and "/v1/nothing" in paths
    assert not {"/health", "/ready"} & set(paths), "probes are not logged at info"
    models = next(r for r in access if r["path"] == "/v1/models")
    assert models["method"] == "GET" and models["status"] == 200 and models["level"] == "info"


def test_probes_are_logged_at_debug(tiny_target_dir: Path) -> None:
    records = [json.loads(line) for line in _serve_and_poll(tiny_target_dir, "debug")
               if line.startswith("{")]
    probes = [r for r in records if r["logger"] == "uvicorn.access"
              and r["path"] in ("/health", "/ready")]
    assert probes and {r["level"] for r in probes} == {"debug"}
