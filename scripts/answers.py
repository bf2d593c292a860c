"""What the server answers to a fixed set of requests, to hold a change against.

    python scripts/answers.py dump before.json   # in one checkout (serves it, default model)
    python scripts/answers.py dump after.json    # in the other
    python scripts/answers.py compare before.json after.json

``dump`` serves the checkout it is run in (``specserve serve``, the default model, the
``--draft`` given), sends each request whole and streamed, and writes the bodies and the
stream events without what differs between any two runs (ids, times, the speculation
figures). ``compare`` holds two dumps: every body the same, and every stream the same
text, tool calls, log-probabilities and finish reasons per choice. How a stream's tokens
fall into events follows the rounds, whose lengths the policies choose from measured
times: two runs of one checkout differ there, so the count of events is only reported.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

VOLATILE = {"id", "created", "created_at", "speculation", "item_id", "call_id",
            "system_fingerprint", "response_id"}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CHAT = [{"role": "user", "content": "Write a short Python function that adds two numbers, "
         "then repeat it exactly."}]
REQUESTS: list[tuple[str, str, dict[str, Any]]] = [
    ("chat-greedy", "/v1/chat/completions",
     {"messages": CHAT, "max_tokens": 48, "temperature": 0}),
    ("chat-greedy-logprobs", "/v1/chat/completions",
     {"messages": CHAT, "max_tokens": 24, "temperature": 0, "logprobs": True,
      "top_logprobs": 2}),
    ("chat-seeded-n2", "/v1/chat/completions",
     {"messages": CHAT, "max_tokens": 32, "temperature": 0.8, "seed": 7, "n": 2}),
    ("chat-tools-required", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
      "tool_choice": "required", "max_tokens": 40, "temperature": 0}),
    ("chat-json", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Give a JSON object with a name."}],
      "response_format": {"type": "json_object"}, "max_tokens": 30, "temperature": 0}),
    ("completion-echo", "/v1/completions",
     {"prompt": "def fib(n):", "max_tokens": 32, "temperature": 0, "echo": True,
      "logprobs": 1}),
    ("completion-two-prompts", "/v1/completions",
     {"prompt": ["The capital of France is", "1, 2, 3, 4,"], "max_tokens": 16,
      "temperature": 0}),
    ("responses", "/v1/responses",
     {"input": "Say hello twice.", "max_output_tokens": 24, "temperature": 0}),
    ("too-many-choices", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "n": 99}),
    ("too-long", "/v1/completions", {"prompt": "x " * 9000, "max_tokens": 4}),
]


def steady(value: Any) -> Any:
    """``value`` without what differs between two runs of one checkout."""
    if isinstance(value, dict):
        return {k: steady(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [steady(v) for v in value]
    if isinstance(value, str) and value.startswith(("call_", "msg_", "resp_", "fc_")):
        return value.split("_")[0] + "_*"
    return value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def dump(out: Path, draft: str) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}  # this checkout, whatever is installed
    with open(f"{out}.log", "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "specserve.cli", "serve", "--host", "127.0.0.1", "--port",
             str(port), "--metrics-port", str(free_port()), "--draft", draft],
            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                if httpx.get(f"{url}/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not get ready: see {out}.log")
            time.sleep(0.5)
        answers = {}
        with httpx.Client(base_url=url, timeout=600) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            for name, path, body in REQUESTS:
                body = {"model": model, **body}
                whole = client.post(path, json=body)
                events: list[Any] = []
                with client.stream("POST", path, json={**body, "stream": True}) as stream:
                    for line in stream.iter_lines():
                        if line.startswith("event: "):
                            events.append(line)
                        elif line.startswith("data: ") and line != "data: [DONE]":
                            events.append(steady(json.loads(line[6:])))
                answers[name] = {"status": whole.status_code, "body": steady(whole.json()),
                                 "events": events}
        out.write_text(json.dumps(answers, indent=1, sort_keys=True))
    finally:
        server.terminate()
        server.wait(60)


def streamed(events: list[Any]) -> dict[str, Any]:
    """A stream's content, however its tokens fell into events: per choice its text, tool
    calls, log-probability lists and finish reason; a Responses stream's text and final
    response."""
    out: dict[str, Any] = {}
    for event in events:
        if isinstance(event, str):
            continue
        for choice in event.get("choices", ()):
            seen = out.setdefault(str(choice.get("index")), {
                "text": "", "tool": "", "logprobs": {}, "finish": None})
            delta = choice.get("delta") or {}
            seen["text"] += (delta.get("content") or "") + (choice.get("text") or "")
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                seen["tool"] += (function.get("name") or "") + (function.get("arguments") or "")
            for key, rows in (choice.get("logprobs") or {}).items():
                if isinstance(rows, list):
                    seen["logprobs"].setdefault(key, []).extend(rows)
            seen["finish"] = choice.get("finish_reason") or seen["finish"]
        kind = event.get("type", "")
        if kind.endswith(".delta"):
            out["delta"] = out.get("delta", "") + str(event.get("delta", ""))
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            out["final"] = event.get("response")
    return out


def compare(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    differing = 0
    for name in sorted(a.keys() | b.keys()):
        if name not in a or name not in b:
            print(f"{name:24s} only in {'after' if name not in a else 'before'}")
            differing += 1
            continue
        same_body = a[name]["status"] == b[name]["status"] and a[name]["body"] == b[name]["body"]
        same_stream = streamed(a[name]["events"]) == streamed(b[name]["events"])
        differing += not (same_body and same_stream)
        print(f"{name:24s} body {'same' if same_body else 'DIFFERS'}  stream "
              f"{'same' if same_stream else 'DIFFERS'}  events {len(a[name]['events'])} -> "
              f"{len(b[name]['events'])}")
    return 1 if differing else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    dumping = commands.add_parser("dump", help="serve this checkout and write its answers")
    dumping.add_argument("out", type=Path)
    dumping.add_argument("--draft", default="auto", help="the server's --draft (default auto)")
    comparing = commands.add_parser("compare", help="hold two dumps against each other")
    comparing.add_argument("before", type=Path)
    comparing.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    if args.command == "dump":
        dump(args.out, args.draft)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    raise SystemExit(main())
