"""``python -m specbench.predicted``: code edits with a predicted output (OpenAI's
``prediction``: the code being edited), against specserve without one and llama.cpp's
``llama-server``, every server started here.

    python -m specbench.predicted --llama-server ~/llama.cpp/build/bin/llama-server \\
        --target qwen2.5-coder-1.5b --json bench-results/predicted.json

The rows, by name (``--servers`` picks some):

- ``llama-server``: plain decoding, the reference of **x llama**;
- ``llama-server-ngram-mod``, ``llama-server-ngram-simple``: its n-gram speculation;
- ``specserve-none``: ``--draft none``, no prediction;
- ``specserve``: the default drafter (``--draft auto``), no prediction, the reference of
  **x default**;
- ``specserve-predicted``: the default drafter, and the prompt's code as the prediction;
- ``specserve-unrelated``: the default drafter, and another prompt's code as the
  prediction (what a wrong prediction costs).

Each prompt of the set (held out: ``code_edit``, never tuned on) is an edit of one
fenced block of code in its last message; the prediction is that block, as an editor
would send the file it asks to change. Every specserve row is a server of its own, so
that no row drafts from another's answers in the continuation cache. The servers start
one after another and stay up together; prompts go through them prompt by prompt,
greedy, streamed, one at a time, each server warmed up first (``specbench.peer``).
Tokens are the answer's (``usage.completion_tokens`` less the prediction's rejected
tokens, which OpenAI counts as completion tokens). Per row: tokens/s over all the
prompts, its ratios to llama-server plain and to specserve's default, the drafted and
accepted tokens, and whether each answer is the text specserve-none gave (a prediction
changes the speed, never the text). The JSON keeps every reply with its usage, the
machine (CPU, memory read bandwidth before and after, load) and specserve's measured
verify curve (``/v1/models`` ``metadata.speculation``), for the ceiling.
"""

from __future__ import annotations

import argparse
import logging
import re
import shutil
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from specbench.peer import (
    GREEDY_EXTRAS,
    TIMEOUT_S,
    Peer,
    PeerError,
    connect,
    stream_chat,
)
from specbench.peer_run import (
    THREADS,
    Server,
    close_machine_record,
    gguf_file,
    llama_command,
    locate,
    prepare_run,
    running,
    specserve_command,
    versions,
    write_report,
)

log = logging.getLogger(__name__)

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_SET = "code_edit"
DEFAULT_JSON = "bench-results/predicted.json"
MAX_NEW = 256
BASE_PORT = 18300
CONTEXT = 8192
START_TIMEOUT_S = 900.0
LLAMA_ROWS = ("llama-server", "llama-server-ngram-simple", "llama-server-ngram-mod")
SPECSERVE_ROWS = ("specserve-none", "specserve", "specserve-predicted", "specserve-unrelated")
ROWS = (*LLAMA_ROWS, *SPECSERVE_ROWS)
FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)


def edited_code(messages: Sequence[dict[str, Any]]) -> str:
    """The code an edit prompt asks to change: the last fenced block of its last message."""
    blocks = FENCE.findall(str(messages[-1]["content"]))
    if not blocks:
        raise ValueError("an edit prompt needs a fenced block of code in its last message")
    return str(blocks[-1])


def plan(args: argparse.Namespace, target_gguf: Path | None) -> list[Server]:
    wanted = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [w for w in wanted if w not in ROWS]
    if unknown:
        raise ValueError(f"unknown server(s) {unknown}; choose from {', '.join(ROWS)}")
    servers: list[Server] = []
    metrics_port = args.base_port + len(ROWS)
    for name in (r for r in ROWS if r in wanted):
        port = args.base_port + len(servers)
        if name.startswith("llama-server"):
            assert target_gguf is not None
            argv = [*llama_command(args.llama_server, target_gguf, args.threads, CONTEXT),
                    "--port", str(port)]
            if name != "llama-server":
                argv += ["--spec-type", name.removeprefix("llama-server-")]
            servers.append(Server(name, argv, port, "/health", (target_gguf,)))
            continue
        argv = [*specserve_command(args.target, args.threads),
                "--draft", "none" if name == "specserve-none" else "auto",
                "--port", str(port), "--metrics-port", str(metrics_port)]
        metrics_port += 1
        servers.append(Server(name, argv, port, "/ready", ()))
    return servers


def extras_for(name: str, prompts: Sequence[Any], index: int) -> dict[str, Any]:
    """What a row sends with prompt ``index`` besides the messages."""
    if name.startswith("llama-server"):
        return dict(GREEDY_EXTRAS)
    if name == "specserve-predicted":
        return {"prediction": {"type": "content",
                               "content": edited_code(prompts[index].messages)}}
    if name == "specserve-unrelated":  # the next prompt's code: of the same kind, not this
        other = prompts[(index + 1) % len(prompts)]
        return {"prediction": {"type": "content", "content": edited_code(other.messages)}}
    return {}


def measure(up: Sequence[Server], prompts: Sequence[Any], max_tokens: int) -> list[dict[str, Any]]:
    peers = [Peer(name=s.name, url=s.url) for s in up]
    replies: list[dict[str, Any]] = []
    with httpx.Client(timeout=TIMEOUT_S) as client:
        for peer in peers:
            connect(client, peer, GREEDY_EXTRAS if peer.name.startswith("llama") else {},
                    ({"role": "user", "content": "Say hello in one short sentence."},))
        for index, prompt in enumerate(prompts):
            for peer in peers:
                peer.extras = extras_for(peer.name, prompts, index)
                reply = stream_chat(client, peer, prompt.messages, max_tokens)
                log.info("%s %s: %d tokens in %.1f s", prompt.id, peer.name, reply.tokens,
                         reply.seconds)
                replies.append({"server": peer.name, "id": prompt.id, **asdict(reply)})
    return replies


def summarise(names: Sequence[str], replies: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    plain_text = {r["id"]: r["text"] for r in replies if r["server"] == "specserve-none"}
    rates: dict[str, float] = {}
    rows = []
    for name in names:
        mine = [r for r in replies if r["server"] == name]
        tokens = sum(r["tokens"] for r in mine)
        seconds = sum(r["seconds"] for r in mine)
        rates[name] = tokens / seconds if seconds > 0 else 0.0
        details = [(r.get("usage") or {}).get("completion_tokens_details") or {} for r in mine]
        stats = [(r.get("usage") or {}) for r in mine]
        rows.append({
            "server": name, "prompts": len(mine), "tokens": tokens,
            "seconds": round(seconds, 3), "tokens_per_s": round(rates[name], 2),
            "accepted_prediction_tokens": sum(d.get("accepted_prediction_tokens") or 0
                                              for d in details),
            "rejected_prediction_tokens": sum(d.get("rejected_prediction_tokens") or 0
                                              for d in details),
            "same_text_as_specserve_none": (
                sum(plain_text.get(r["id"]) == r["text"] for r in mine) if plain_text else None),
            "finish_reasons": [r["finish_reason"] for r in mine],
            "usage_reported": sum(bool(s) for s in stats),
        })
    for row in rows:
        for ref, key in (("llama-server", "x_llama_plain"), ("specserve", "x_specserve_default")):
            base = rates.get(ref)
            row[key] = round(rates[row["server"]] / base, 3) if base else None
    return rows


def speculation_info(server: Server) -> dict[str, Any] | None:
    """specserve's verify curve and step as it measured them at start-up."""
    try:
        models = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
        return dict(models[0].get("metadata", {}).get("speculation") or {}) or None
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return None


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    head = (f"{'server':<24} {'tokens':>6} {'seconds':>8} {'tok/s':>7} {'x llama':>8} "
            f"{'x default':>9} {'pred acc':>8} {'pred rej':>8} {'same text':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        same = r["same_text_as_specserve_none"]
        same_text = "-" if same is None else f"{same}/{r['prompts']}"
        lines.append(
            f"{r['server']:<24} {r['tokens']:>6} {r['seconds']:>8.1f} {r['tokens_per_s']:>7.2f} "
            f"{_x(r['x_llama_plain']):>8} {_x(r['x_specserve_default']):>9} "
            f"{r['accepted_prediction_tokens']:>8} {r['rejected_prediction_tokens']:>8} "
            f"{same_text:>9}")
    return "\n".join(lines)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def run(args: argparse.Namespace) -> int:
    from specbench.compare import load_prompts

    wants_llama = any(s.strip().startswith("llama-server") for s in args.servers.split(","))
    try:
        if wants_llama and shutil.which(args.llama_server) is None:
            raise ValueError(f"llama-server not found at {args.llama_server!r}: pass "
                             "--llama-server PATH, or leave its rows out with --servers")
        target_gguf = gguf_file(locate(args.target)) if wants_llama else None
        servers = plan(args, target_gguf)
        prompts = load_prompts(args.prompt_set, args.prompts)
        for prompt in prompts:
            edited_code(prompt.messages)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    json_path, logs, machine = prepare_run(args.json, DEFAULT_JSON, args.threads)
    try:
        with running(servers, logs, START_TIMEOUT_S) as up:
            if not up:
                raise PeerError("no server started")
            curve = next((speculation_info(s) for s in up if s.name == "specserve"), None)
            replies = measure(up, prompts, args.max_tokens)
            names = [s.name for s in up]
    except PeerError as exc:
        print(f"specbench: {exc}", file=sys.stderr)
        return 1
    close_machine_record(machine)
    rows = summarise(names, replies)
    report = {"machine": machine, **versions(args.llama_server if wants_llama else None),
              "config": {"target": args.target, "prompt_set": args.prompt_set,
                         "prompts": [p.id for p in prompts], "max_tokens": args.max_tokens,
                         "threads": args.threads, "greedy": True},
              "speculation": curve, "launch": [s.record() for s in servers], "rows": rows,
              "replies": replies}
    print(format_table(rows))
    write_report(json_path, report, servers)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specbench.predicted", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", default="llama-server", help="llama-server binary")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="a model name or GGUF path")
    parser.add_argument("--servers", default=",".join(ROWS), help="rows to run, by name")
    parser.add_argument("--prompt-set", default=DEFAULT_SET,
                        help="edit prompts: a shipped set or a prompt file")
    parser.add_argument("--prompts", type=int, default=None, help="the first N prompts only")
    parser.add_argument("--max-tokens", type=int, default=MAX_NEW)
    parser.add_argument("--threads", type=int, default=THREADS)
    parser.add_argument("--base-port", type=int, default=BASE_PORT)
    parser.add_argument("--json", default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per readiness poll else
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
