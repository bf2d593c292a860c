"""A constrained request sent twice to a server with continuation drafts: the second
time the continuation cache drafts the whole earlier answer, its end-of-sequence token
included: a stop token drafted after the grammar has completed (the matcher takes no
more tokens then, though it validated the whole draft) is verified like any other."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.reliability.support import ServeProcess
from tests.sdk.conftest import MODEL, serve_default

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def own_server(default_model_dir: Path) -> Iterator[ServeProcess]:
    """A server of its own: the failure logs a traceback, which the shared one refuses."""
    with serve_default() as server:
        yield server


def test_a_repeated_json_schema_request_with_continuation_drafts(
        own_server: ServeProcess) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "A person, as JSON."}],
            "temperature": 0, "max_tokens": 60, "speculation": {"drafter": "cache"},
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "person", "strict": True, "schema": PERSON}}}
    replies = [httpx.post(f"{own_server.url}/v1/chat/completions", json=body, timeout=120)
               for _ in range(2)]
    assert [r.status_code for r in replies] == [200, 200], replies[-1].text
    assert replies[0].json()["choices"][0]["message"] == replies[1].json()["choices"][0][
        "message"]
