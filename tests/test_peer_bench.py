"""``specserve bench --peer``: a real ``specserve serve`` process benchmarked as two peers
through its streamed chat endpoint, and a peer that is down; ``specbench.peer_run``
starting servers itself, one of which fails; the code prompt sets."""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specbench import peer_run
from specbench.compare import (
    CODE_PROMPT_SETS,
    PROMPT_SETS,
    SHIPPED_PROMPT_SETS,
    TUNING_PROMPT_SETS,
    load_prompts,
)
from specbench.peer import draft_acceptance, parse_peer, quantile
from specbench.peer import main as peer_main
from specserve.cli import main
from tests.conftest import free_port, http_status
from tests.reliability.support import ServeProcess, serve

PROMPTS = 2  # per set
MAX_TOKENS = 12
ROW_KEYS = {"server", "prompt_set", "prompts", "tokens", "seconds", "tokens_per_s",
            "ratio_to_first", "ttft_ms_median", "ttft_ms_p90", "itl_ms_median", "itl_ms_p90",
            "tokens_from", "prompt_tokens", "prefill_tokens_per_s", "draft_acceptance",
            "identical_to_first", "differing_prompts"}


@pytest.fixture(scope="module")
def server(tiny_target_dir: Path) -> Iterator[ServeProcess]:
    with serve(tiny_target_dir, "--draft", "ngram") as process:
        yield process


def test_two_peers_get_every_prompt_and_agree_with_themselves(
        server: ServeProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "peer.json"
    rc = main(["bench", "--peer", f"first={server.url}", "--peer", f"second={server.url}/v1/",
               "--prompts", str(PROMPTS), "--max-tokens", str(MAX_TOKENS), "--json", str(out)])
    assert rc == 0
    report: dict[str, Any] = json.loads(out.read_text())
    for entry in report["servers"]:
        assert entry["url"] == server.url and entry["model"] == "tiny"
        # specserve refuses fields it does not know: llama.cpp's repeat_penalty is dropped
        assert entry["extras"] == {}
    runs = report["runs"]
    assert [(r["prompt_set"], r["server"]) for r in runs] == [
        (s, n) for s in PROMPT_SETS for n in ("first", "second")]
    for row in runs:
        assert set(row) == ROW_KEYS, row
        assert row["prompts"] == PROMPTS and 0 < row["tokens"] <= PROMPTS * MAX_TOKENS
        assert row["tokens_from"] == "usage" and row["prompt_tokens"] > 0
        # prompt tokens over the time to first token, summed over the prompts
        ttft_s = sum(r["ttft_s"] for r in report["replies"]
                     if (r["server"], r["prompt_set"]) == (row["server"], row["prompt_set"]))
        assert row["prefill_tokens_per_s"] == round(row["prompt_tokens"] / ttft_s, 1)
        assert row["tokens_per_s"] > 0 and row["seconds"] > 0
        assert 0 < row["ttft_ms_median"] <= row["ttft_ms_p90"]
        assert 0 < row["itl_ms_median"] <= row["itl_ms_p90"]
        assert row["identical_to_first"] == PROMPTS and row["differing_prompts"] == []
        assert row["draft_acceptance"] is None  # specserve's stream carries no timings
    assert all(r["ratio_to_first"] == 1.0 for r in runs if r["server"] == "first")
    replies = report["replies"]
    assert len(replies) == 2 * PROMPTS * len(PROMPT_SETS)
    # interleaved: each prompt goes to both servers before the next prompt
    assert [r["server"] for r in replies[:4]] == ["first", "second", "first", "second"]
    assert replies[0]["id"] == replies[1]["id"] != replies[2]["id"]
    assert replies[0]["prompt_tokens"] == replies[1]["prompt_tokens"] > 0
    for reply in replies:
        assert reply["text"] and reply["finish_reason"] in ("length", "stop")
        assert 0 < reply["ttft_s"] <= reply["last_s"] <= reply["seconds"]
    table = capsys.readouterr().out
    assert "TTFT p90" in table and "prefill tok/s" in table
    assert "first" in table and "second" in table
    # the warm-up asks what no prompt set asks, so no measured prompt is cached before
    warmup = report["config"]["warmup_messages"]
    assert all(list(p.messages) != warmup for name in PROMPT_SETS for p in load_prompts(name))
    assert "greedy outputs of first and second: agree on every prompt" in table
    # identical texts share all of themselves
    lengths = [len(r["text"]) for r in replies if r["server"] == "first"]
    assert report["agreement"] == [{"servers": ["first", "second"], "prompts": 2 * PROMPTS,
                                    "identical": 2 * PROMPTS,
                                    "median_shared_prefix_chars": statistics.median(lengths)}]
    png = out.with_name("peer-peer.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_extras_given_are_sent_and_recorded(server: ServeProcess, tmp_path: Path) -> None:
    out = tmp_path / "extras.json"
    extras = {"speculation": {"enabled": False}}  # a specserve extra: accepted, not dropped
    assert peer_main(["--peer", f"plain={server.url}", "--peer-extras", json.dumps(extras),
                      "--prompt-sets", "chat", "--prompts", "1", "--max-tokens", "4",
                      "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["servers"][0]["extras"] == extras
    assert report["runs"][0]["tokens"] > 0


def test_a_peer_that_is_down_is_one_clear_line(server: ServeProcess,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", "--peer", f"up={server.url}", "--peer", f"down={down}",
                 "--prompts", "1", "--max-tokens", "4"]) == 1
    err = capsys.readouterr().err
    assert f"down at {down} is not reachable" in err and "Traceback" not in err


@pytest.mark.parametrize(("flags", "error"), [
    (["--peer", "no-url"], "NAME=URL"),
    (["--peer", "a=ftp://x"], "NAME=URL"),
    (["--peer", "a=http://x", "--peer", "a=http://y"], "a name of its own"),
    (["--peer", "a=http://x", "--peer-extras", "[1]"], "JSON object"),
    (["--peer", "a=http://x", "--prompt-sets", "poetry"], "unknown prompt set"),
])
def test_bad_peer_flags_are_refused_before_any_request(
        flags: list[str], error: str, caplog: pytest.LogCaptureFixture) -> None:
    assert main(["bench", *flags]) == 2
    assert error in caplog.text


def test_peer_and_concurrency_are_not_mixed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--peer", "a=http://x", "--concurrency", "1,2"]) == 2
    assert "separate benchmarks" in capsys.readouterr().err


def test_peer_urls_and_quantiles() -> None:
    assert parse_peer("llama.cpp=http://127.0.0.1:8081/v1/").url == "http://127.0.0.1:8081"
    assert parse_peer(" x = https://h ").name == "x"
    assert quantile([3.0, 1.0, 2.0], 0.9) == 3.0 and quantile([5.0], 0.9) == 5.0
    assert quantile([float(v) for v in range(1, 11)], 0.9) == 9.0
    assert len(load_prompts("chat", PROMPTS)) == PROMPTS


EDIT_KINDS = {"annotate", "rename", "convert style", "rewrite", "fix bug"}
CHAT_KINDS = {"write", "explain", "how-to"}
CODE_SETS = {"code_edit": (8, EDIT_KINDS), "code_edit_tune": (6, EDIT_KINDS),
             "code_chat": (8, CHAT_KINDS), "code_chat_tune": (4, CHAT_KINDS),
             "long_code": (2, {"annotate"})}


def _shipped(name: str) -> dict[str, Any]:
    return json.loads((Path(__file__).parent.parent / "specbench" / "prompts"
                       / f"{name}.json").read_text("utf-8"))


@pytest.mark.parametrize("name", sorted(CODE_SETS))
def test_code_prompt_sets_are_shipped_in_the_format(name: str) -> None:
    count, kinds = CODE_SETS[name]
    data = _shipped(name)
    assert data["name"] == name and name in SHIPPED_PROMPT_SETS
    assert len(data["prompts"]) == count == len(load_prompts(name))
    assert {p["kind"] for p in data["prompts"]} <= kinds
    assert len({p["id"] for p in data["prompts"]}) == count
    for prompt in load_prompts(name):
        assert [m["role"] for m in prompt.messages] == ["user"]
    tuning = name in TUNING_PROMPT_SETS
    assert ("for tuning" in data["description"].lower()) == tuning
    assert ("held out" in data["description"].lower()) == (name in CODE_PROMPT_SETS)


def test_the_tuning_sets_share_nothing_with_the_held_out_ones() -> None:
    def code_lines(names: tuple[str, ...]) -> set[str]:
        return {line.strip() for name in names for p in load_prompts(name)
                for m in p.messages for line in m["content"].splitlines()
                if len(line.strip()) > 24}

    held_out = CODE_PROMPT_SETS + PROMPT_SETS
    assert not code_lines(TUNING_PROMPT_SETS) & code_lines(held_out)
    ids = [p.id for name in SHIPPED_PROMPT_SETS for p in load_prompts(name)]
    assert len(ids) == len(set(ids))
    # edits repeat a function of 20-60 lines; long prompts carry a whole file
    for prompt in load_prompts("code_edit") + load_prompts("code_edit_tune"):
        code = prompt.messages[0]["content"].split("```")[1]
        assert 20 <= len(code.strip().splitlines()) - 1 <= 60, prompt.id
    for prompt in load_prompts("long_code"):
        assert len(prompt.messages[0]["content"]) > 4000


def _run_args(**given: Any) -> argparse.Namespace:
    defaults = {"llama_server": "/opt/llama/llama-server", "target": "qwen", "draft": "small",
                "servers": ",".join(peer_run.SERVERS), "extra": [], "threads": 2,
                "context": 8192, "base_port": 18080}
    return argparse.Namespace(**{**defaults, **given})


def test_the_peer_run_plans_every_server_on_its_own_port(tmp_path: Path) -> None:
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    target.write_bytes(b"0" * 100)
    draft.write_bytes(b"0" * 10)
    servers = peer_run.plan_servers(_run_args(extra=["specserve=--max-active 1"]), target,
                                    draft, {"ngram-simple", "draft-simple"})
    names = [s.name for s in servers]
    # this build lists no ngram-mod: its row is left out
    assert names == ["llama-server", "llama-server-ngram-simple", "llama-server-draft",
                     "specserve-none", "specserve", "specserve-draft"]
    assert [s.port for s in servers] == list(range(18080, 18086))
    by_name = {s.name: s for s in servers}
    for server in servers:
        text = " ".join(server.argv)
        if server.name.startswith("llama-server"):
            assert f"-m {target}" in text and "-t 2 -tb 2 -c 8192 -np 1" in text
            assert server.ready_path == "/health"
        else:
            assert "--target qwen --threads 2" in text and server.ready_path == "/ready"
        assert f"--port {server.port}" in text
    assert "--spec-type ngram-simple" in " ".join(by_name["llama-server-ngram-simple"].argv)
    assert f"-md {draft} --spec-type draft-simple -td 2 -tbd 2" in " ".join(
        by_name["llama-server-draft"].argv)
    assert by_name["llama-server-draft"].models == (target, draft)
    # llama-server's servers share the pages of the files they map; specserve reads its own
    free = peer_run.available_memory()
    assert free is not None
    need = peer_run.OVERHEAD_BYTES["llama-server"] * 3 + peer_run.OVERHEAD_BYTES["specserve"] * 3
    assert peer_run.fits_together(servers) == (need + 110 + 100 * 3 + 10 < free)
    assert by_name["specserve-none"].argv[-6:-2] == ["--draft", "none", "--port", "18083"]
    assert by_name["specserve"].argv[-4:-1] == ["--max-active", "1", "--metrics-port"]
    metrics = [int(s.argv[-1]) for s in servers if s.name.startswith("specserve")]
    assert metrics == [18087, 18088, 18089]
    # without a draft, the draft rows go; unknown names are refused
    assert "specserve-draft" not in [s.name for s in peer_run.plan_servers(
        _run_args(), target, None, set())]
    with pytest.raises(ValueError, match="unknown server"):
        peer_run.plan_servers(_run_args(servers="vllm"), target, draft, set())
    with pytest.raises(ValueError, match="NAME=ARGS"):
        peer_run.parse_extra(["nobody=--x"])


def test_the_peer_run_starts_its_servers_and_stops_them(
        tiny_target_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.json"
    base = free_port()
    # the second server's unknown flag stops it at start-up: recorded, the run goes on
    rc = peer_run.main(["--servers", "specserve-none,specserve", "--target", str(tiny_target_dir),
                        "--draft", "none", "--extra", "specserve=--no-such-flag",
                        "--prompt-sets", "code_edit,code_chat", "--prompts", "1",
                        "--max-tokens", "4", "--threads", "1", "--base-port", str(base),
                        "--start-timeout", "300", "--json", str(out), "--no-progress"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert [r["server"] for r in report["runs"]] == ["specserve-none", "specserve-none"]
    assert report["config"]["servers_up_together"] is True
    assert all(r["tokens"] > 0 and r["prefill_tokens_per_s"] > 0 for r in report["runs"])
    launched = {entry["name"]: entry for entry in report["launch"]}
    assert launched["specserve-none"]["failure"] is None
    assert launched["specserve-none"]["ready_s"] > 0
    assert "--no-such-flag" in launched["specserve"]["command"]
    assert "exited" in launched["specserve"]["failure"]
    assert Path(launched["specserve"]["log"]).parent == tmp_path / "run-logs"
    machine = report["machine"]
    assert machine["memory_read_gb_per_s_start"] > 0 and machine["memory_read_gb_per_s_end"] > 0
    assert machine["cpu"] and "Architecture" in machine["lscpu"]
    assert report["target"]["file"] == str(tiny_target_dir)
    table = capsys.readouterr().out
    assert "specserve-none" in table and "specserve did not start" in table
    assert http_status(f"http://127.0.0.1:{base}/health") is None  # stopped at the end


def test_servers_run_one_at_a_time_make_one_report() -> None:
    prompts = {"s": load_prompts("code_chat", 2)}
    replies = [{"server": name, "prompt_set": "s", "id": p.id, "text": text, "tokens": 4,
                "tokens_from": "usage", "prompt_tokens": 10, "ttft_s": 0.5, "last_s": 1.0,
                "seconds": 1.0, "finish_reason": "length", "itl_s": 0.1}
               for name, text in (("a", "x"), ("b", "y")) for p in prompts["s"]]
    parts = [{"config": {"max_tokens": 4}, "servers": [{"name": n, "url": f"http://{n}"}],
              "replies": [r for r in replies if r["server"] == n]} for n in ("a", "b")]
    report = peer_run.merge(parts, prompts)
    assert [r["server"] for r in report["runs"]] == ["a", "b"]
    assert report["runs"][1]["identical_to_first"] == 0
    assert report["runs"][0]["prefill_tokens_per_s"] == 20.0
    assert report["agreement"][0]["identical"] == 0
    assert report["config"]["order"].startswith("server by server")
    assert report["runs"][0]["draft_acceptance"] is None


def test_drafts_a_server_reports_are_counted() -> None:
    replies = [{"timings": {"draft_n": 10, "draft_n_accepted": 7}},
               {"timings": {"predicted_n": 4}}, {"timings": None},
               {"timings": {"draft_n": 6, "draft_n_accepted": 1}}]
    assert draft_acceptance(replies) == 0.5
    assert draft_acceptance(replies[1:3]) is None
