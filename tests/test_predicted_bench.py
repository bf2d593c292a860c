"""The predicted-outputs benchmark's rules, without servers: what each row sends with a
prompt, how an answer's tokens are counted beside a prediction's rejected ones, and
the ratios and text checks of its table."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from specbench.compare import load_prompts
from specbench.predicted import ROWS, edited_code, extras_for, format_table, plan, summarise


def test_every_held_out_edit_prompt_has_its_code_as_the_prediction() -> None:
    prompts = load_prompts("code_edit")
    for prompt in prompts:
        code = edited_code(prompt.messages)
        assert code.strip() and code in prompt.messages[-1]["content"] and "```" not in code
    with pytest.raises(ValueError, match="fenced block"):
        edited_code([{"role": "user", "content": "no code here"}])


def test_each_row_sends_its_own_prediction() -> None:
    prompts = load_prompts("code_edit")
    assert extras_for("llama-server", prompts, 0) == {"repeat_penalty": 1.0}
    assert extras_for("specserve", prompts, 0) == {}
    assert extras_for("specserve-none", prompts, 0) == {}
    mine = extras_for("specserve-predicted", prompts, 2)["prediction"]
    assert mine == {"type": "content", "content": edited_code(prompts[2].messages)}
    other = extras_for("specserve-unrelated", prompts, len(prompts) - 1)["prediction"]
    assert other["content"] == edited_code(prompts[0].messages)  # the next prompt's, wrapping


def _reply(server: str, prompt: str, tokens: int, seconds: float, text: str,
           accepted: int = 0, rejected: int = 0) -> dict[str, Any]:
    return {"server": server, "id": prompt, "tokens": tokens, "seconds": seconds, "text": text,
            "finish_reason": "length",
            "usage": {"completion_tokens": tokens + rejected, "completion_tokens_details": {
                "accepted_prediction_tokens": accepted, "rejected_prediction_tokens": rejected}}}


def test_the_table_gives_ratios_to_both_references_and_checks_the_text() -> None:
    replies = [
        _reply("llama-server", "a", 100, 10.0, "x"),
        _reply("specserve-none", "a", 100, 8.0, "same"),
        _reply("specserve", "a", 100, 5.0, "same"),
        _reply("specserve-predicted", "a", 100, 4.0, "same", accepted=90, rejected=7),
        _reply("specserve-unrelated", "a", 100, 5.0, "other", accepted=3, rejected=50),
    ]
    rows = {r["server"]: r for r in summarise(
        ["llama-server", "specserve-none", "specserve", "specserve-predicted",
         "specserve-unrelated"], replies)}
    assert rows["specserve-predicted"]["x_llama_plain"] == 2.5
    assert rows["specserve-predicted"]["x_specserve_default"] == 1.25
    assert rows["specserve-predicted"]["accepted_prediction_tokens"] == 90
    assert rows["specserve-predicted"]["rejected_prediction_tokens"] == 7
    assert rows["specserve-predicted"]["same_text_as_specserve_none"] == 1
    assert rows["specserve-unrelated"]["same_text_as_specserve_none"] == 0
    table = format_table(list(rows.values()))
    assert "2.50x" in table and "1.25x" in table and "0/1" in table


def test_every_row_gets_a_port_and_specserve_rows_a_metrics_port() -> None:
    args = argparse.Namespace(servers=",".join(ROWS), threads=2, base_port=19000,
                              llama_server="llama-server", target="qwen2.5-coder-1.5b")
    servers = plan(args, Path("model.gguf"))
    assert [s.name for s in servers] == list(ROWS)
    assert len({s.port for s in servers}) == len(ROWS)
    ngram = next(s for s in servers if s.name == "llama-server-ngram-mod")
    assert ngram.argv[-2:] == ["--spec-type", "ngram-mod"]
    for server in servers:
        if server.name.startswith("specserve"):
            draft = server.argv[server.argv.index("--draft") + 1]
            assert draft == ("none" if server.name == "specserve-none" else "auto")
            assert "--metrics-port" in server.argv
    with pytest.raises(ValueError, match="unknown server"):
        plan(argparse.Namespace(**{**vars(args), "servers": "vllm"}), None)
