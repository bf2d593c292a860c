"""The prefill benchmark's rules, without servers: prompts cut to exact token counts by the
default model's own tokenizer, each with a first line of its own; the requests each server
is sent and in what order; the medians, ratios, table and JSON path of its report."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from itertools import count
from pathlib import Path
from typing import Any

import httpx
import pytest

from decoding.prompting import encode_text
from gateway.wire.requests import CompletionRequest
from specbench.peer import Peer
from specbench.peer_run import Server, gguf_file
from specbench.prefill import (
    CONTEXT_MARGIN,
    SERVERS,
    LongPrompt,
    build_prompt,
    complete,
    cut_to_tokens,
    default_json,
    extras_for,
    format_table,
    main,
    measure,
    parse_lengths,
    plan,
    plan_prompts,
    source_text,
    summarise,
    usable_lengths,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    """The default model's tokenizer, loaded as specserve loads it for its GGUF file."""
    from runtime.loaders.gguf_weights import config_and_tokenizer

    return config_and_tokenizer(gguf_file(default_model_dir))[1]


@pytest.mark.real_model
def test_every_prompt_is_its_length_in_tokens_and_begins_with_a_line_of_its_own(
        tokenizer: Any) -> None:
    nonces = (f"{n:04x}" for n in count())
    body = source_text()
    prompts = plan_prompts(tokenizer, body, [1500, 4000, 8000], 2, lambda: next(nonces))
    assert [(p.round, p.length) for p in prompts] == [
        (0, 1500), (0, 4000), (0, 8000), (1, 1500), (1, 4000), (1, 8000)]
    for prompt in prompts:
        assert len(encode_text(tokenizer, prompt.text)) == prompt.length
    assert [p.first_line for p in prompts] == [
        "# run 0 of length 1500: 0000", "# run 0 of length 4000: 0001",
        "# run 0 of length 8000: 0002", "# run 1 of length 1500: 0003",
        "# run 1 of length 4000: 0004", "# run 1 of length 8000: 0005"]
    # the text after the first line is the shipped code, repeated where it runs out
    assert prompts[2].text.split("\n", 1)[1].startswith(body[:200])
    assert body[:200] in prompts[2].text.split("\n", 1)[1][len(body):]
    # unseeded, no two first lines are alike
    lines = [p.first_line for p in plan_prompts(tokenizer, body, [40, 50], 3)]
    assert len(set(lines)) == len(lines) == 6


@pytest.mark.real_model
def test_a_length_no_cut_reaches_is_reached_from_another_start(tokenizer: Any) -> None:
    # "x(" then a newline and a tab: the text up to the tab encodes as 3 tokens, not 4
    # (the two are one token at its end), and up to the next as 5; so no cut is 4 tokens
    text = 'x(\n\t"encoding/json"\n\t"errors"\n'
    assert [len(encode_text(tokenizer, tokenizer.decode(encode_text(tokenizer, text)[:k])))
            for k in range(6)] == [0, 1, 2, 3, 3, 5]
    assert cut_to_tokens(tokenizer, text, 4) is None
    assert cut_to_tokens(tokenizer, text, 3) == 'x(\n'  # the nearest cut first
    prompt = build_prompt(tokenizer, "", text, 4, len(encode_text(tokenizer, text)))
    assert len(encode_text(tokenizer, prompt)) == 4
    assert prompt == '\t"encoding/'  # from the next line on
    with pytest.raises(ValueError, match="fewer than"):
        cut_to_tokens(tokenizer, "short", 50)


def test_lengths_past_the_context_are_cut_to_it() -> None:
    assert usable_lengths([1500, 4000, 8000], 8192) == [1500, 4000, 8000]
    assert usable_lengths([1500, 4000, 8000], 4096) == [1500, 4000, 4096 - CONTEXT_MARGIN]
    assert usable_lengths([1500, 4050, 8000], 4096) == [1500, 4096 - CONTEXT_MARGIN]
    assert usable_lengths([8000, 9000], 8192) == [8000, 8192 - CONTEXT_MARGIN]
    with pytest.raises(ValueError, match="no room"):
        usable_lengths([10], CONTEXT_MARGIN)
    assert parse_lengths("1500, 4000,8000") == [1500, 4000, 8000]
    for bad in ("", "1500,x", "0,100"):
        with pytest.raises(ValueError, match="--lengths"):
            parse_lengths(bad)


def _args(**given: Any) -> argparse.Namespace:
    values = {"servers": ",".join(SERVERS), "threads": 3, "base_port": 19400,
              "llama_server": "/opt/llama-server", "target": "default"}
    return argparse.Namespace(**{**values, **given})


def test_each_server_gets_its_own_port_threads_and_the_context() -> None:
    llama, specserve = plan(_args(), Path("model.gguf"), 8064)
    assert llama.argv == ["/opt/llama-server", "-m", "model.gguf", "--host", "127.0.0.1",
                          "-t", "3", "-tb", "3", "-c", "8064", "-np", "1", "--port", "19400"]
    assert llama.ready_path == "/health" and llama.port == 19400
    assert specserve.argv[-12:] == ["--threads", "3", "--log-format", "text", "--draft",
                                    "none", "--request-timeout", "3600", "--port", "19401",
                                    "--metrics-port", "19402"]
    assert specserve.argv[specserve.argv.index("--target") + 1] == "default"
    assert extras_for(llama) == {"cache_prompt": False} and extras_for(specserve) == {}
    only = plan(_args(servers="specserve-none"), Path("model.gguf"), 8064)
    assert [s.name for s in only] == ["specserve-none"] and only[0].port == 19400
    with pytest.raises(ValueError, match="--servers"):
        plan(_args(servers="vllm"), Path("model.gguf"), 8064)


def test_the_body_sent_to_specserve_is_one_its_completions_endpoint_accepts() -> None:
    sent: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"text": "x", "finish_reason": "length"}],
                                         "usage": {"prompt_tokens": 1234}})

    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        got = complete(client, Peer("specserve-none", "http://s", "SmolLM2"), "# run 0\ncode")
    assert (got.prompt_tokens, got.finish_reason, got.timings) == (1234, "length", None)
    accepted = CompletionRequest.model_validate_json(json.dumps(sent[0]))
    assert (accepted.prompt, accepted.max_tokens, accepted.temperature) == (
        "# run 0\ncode", 1, 0.0)


def _fake_servers(sent: list[tuple[int, str, Any]]) -> httpx.Client:
    """A transport that answers as each server would, told apart by port, and notes the
    port, the first line and ``cache_prompt`` of every completion it is sent."""
    def answer(request: httpx.Request) -> httpx.Response:
        port = request.url.port or 0
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": f"model-{port}"}]})
        body = json.loads(request.content)
        assert request.url.path == "/v1/completions" and body["model"] == f"model-{port}"
        assert (body["max_tokens"], body["temperature"]) == (1, 0.0)
        sent.append((port, body["prompt"].split("\n", 1)[0], body.get("cache_prompt")))
        return httpx.Response(200, json={"usage": {"prompt_tokens": 7},
                                         "timings": {"prompt_ms": 5.0},
                                         "choices": [{"finish_reason": "length"}]})

    return httpx.Client(transport=httpx.MockTransport(answer))


def test_servers_take_turns_on_each_prompt_after_a_warm_up() -> None:
    up = [Server("llama-server", [], 1, "/health", ()),
          Server("specserve-none", [], 2, "/ready", ())]
    prompts = [LongPrompt(r, n, f"# run {r} of length {n}\nbody") for r in (0, 1)
               for n in (10, 20)]
    sent: list[tuple[int, str, Any]] = []
    with _fake_servers(sent) as client:
        requests = measure(client, up, prompts,
                           {"llama-server": "# warm 1\nx", "specserve-none": "# warm 2\nx"})
    assert sent == [(1, "# warm 1", False), (2, "# warm 2", None),
                    (1, "# run 0 of length 10", False), (2, "# run 0 of length 10", None),
                    (1, "# run 0 of length 20", False), (2, "# run 0 of length 20", None),
                    (2, "# run 1 of length 10", None), (1, "# run 1 of length 10", False),
                    (2, "# run 1 of length 20", None), (1, "# run 1 of length 20", False)]
    assert [(r["server"], r["round"], r["length"]) for r in requests][4:6] == [
        ("specserve-none", 1, 10), ("llama-server", 1, 10)]
    first = requests[0]
    assert (first["prompt_tokens"], first["timings"], first["finish_reason"]) == (
        7, {"prompt_ms": 5.0}, "length")
    assert first["first_line"] == "# run 0 of length 10" and first["seconds"] >= 0


def _request(server: str, length: int, tokens: int | None, seconds: float, round_: int = 0
             ) -> dict[str, Any]:
    timings = ({"prompt_per_second": {0: 90.0, 1: 80.0, 2: 15.0}[round_]}
               if server == "llama-server" and length == 1500 else None)
    return {"server": server, "round": round_, "length": length, "prompt_tokens": tokens,
            "seconds": seconds, "finish_reason": "length", "timings": timings}


def test_rows_give_the_median_rate_and_its_ratio_to_llama_server() -> None:
    requests = [
        _request("llama-server", 1500, 1501, 10.0), _request("specserve-none", 1500, 1500, 5.0),
        _request("llama-server", 1500, 1501, 20.0, 1), _request("specserve-none", 1500, 1500,
                                                                  15.0, 1),
        _request("llama-server", 1500, 1501, 100.0, 2),
        _request("specserve-none", 1500, 1500, 6.0, 2),
        _request("llama-server", 4000, 4001, 40.01), _request("specserve-none", 4000, None, 8.0),
    ]
    rows = summarise(["llama-server", "specserve-none"], requests)
    assert [(r["length"], r["server"]) for r in rows] == [
        (1500, "llama-server"), (1500, "specserve-none"), (4000, "llama-server"),
        (4000, "specserve-none")]
    llama, spec, llama_4k, spec_4k = rows
    assert llama["prefill_tokens_per_s"] == 75.0  # 1501/20, not the mean of 150.1, 75, 15
    assert llama["seconds_median"] == 20.0 and llama["prompt_tokens"] == 1501
    assert spec["prefill_tokens_per_s"] == 250.0  # 1500/6
    assert spec["prefill_tokens_per_s_each"] == [300.0, 100.0, 250.0]
    assert llama["x_llama_server"] == 1.0 and spec["x_llama_server"] == round(250 / 75.05, 3)
    assert llama_4k["prefill_tokens_per_s"] == 100.0 and llama_4k["requests"] == 1
    assert spec_4k["prefill_tokens_per_s"] is None and spec_4k["x_llama_server"] is None
    assert llama["server_prefill_tokens_per_s"] == 80.0  # the median of its own 90, 80, 15
    assert spec["server_prefill_tokens_per_s"] is None
    table = format_table(rows, ["llama-server", "specserve-none"])
    lines = table.splitlines()
    assert len(lines) == 4 and "specserve-none / llama-server" in lines[0]
    assert lines[2].split() == ["1500", "1501", "20.00", "75.0", "1500", "6.00", "250.0",
                                f"{250 / 75.05:.2f}x"]
    assert lines[3].split() == ["4000", "4001", "40.01", "100.0", "-", "8.00", "-", "-"]


def test_the_json_is_named_after_the_target(tmp_path: Path) -> None:
    assert default_json("qwen2.5-coder-1.5b") == "bench-results/prefill-qwen2.5-coder-1.5b.json"
    assert default_json("default") == "bench-results/prefill-default.json"
    model = tmp_path / "My Model.Q4_K_M.gguf"
    model.write_bytes(b"")
    assert default_json(str(model)) == "bench-results/prefill-My-Model.Q4_K_M.json"


def test_help_names_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--llama-server", "--target", "--lengths", "--repeats", "--threads", "--json"):
        assert flag in out
    run = subprocess.run([sys.executable, "-m", "specbench.prefill", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0 and "--lengths" in run.stdout
