"""``python -m specdistill.feature_serve_check --draft DIR``: a feature head through the
HTTP server. Starts ``specserve serve`` with ``--draft none`` and then with the head (one
server at a time, same flags), sends each the same greedy chat requests (the first
prompts of the shipped chat and grounded sets), checks the texts are identical, and
prints and writes (``--json``) each set's tokens a second and the ratio."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from specdistill.feature_data import BENCH_DIR


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        out: dict[str, Any] = json.loads(response.read())
        return out


def _serve(draft: str, flags: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = _port()
    process = subprocess.Popen(
        [sys.executable, "-m", "specserve", "serve", "--draft", draft, "--host", "127.0.0.1",
         "--port", str(port), "--metrics-port", str(_port()), *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base + "/ready", timeout=2) as r:
                if r.status == 200:
                    return process, base
        except (urllib.error.URLError, OSError):
            pass
        if process.poll() is not None:
            raise RuntimeError(f"the server with --draft {draft} exited ({process.returncode})")
        time.sleep(1)
    process.kill()
    raise RuntimeError("the server did not get ready in 600 s")


def run(draft: str, prompts: dict[str, list[str]], max_tokens: int, flags: list[str]
        ) -> dict[str, Any]:
    process, base = _serve(draft, flags)
    try:
        with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
            model = json.loads(r.read())["data"][0]["id"]
        _post(base + "/v1/chat/completions", {"model": model, "max_tokens": 8, "temperature": 0,
                                               "messages": [{"role": "user", "content": "Hi"}]})
        out: dict[str, Any] = {}
        for name, texts in prompts.items():
            answers, tokens, started = [], 0, time.perf_counter()
            for text in texts:
                r = _post(base + "/v1/chat/completions",
                          {"model": model, "messages": [{"role": "user", "content": text}],
                           "max_tokens": max_tokens, "temperature": 0})
                answers.append(r["choices"][0]["message"]["content"])
                tokens += int(r["usage"]["completion_tokens"])
            seconds = time.perf_counter() - started
            out[name] = {"answers": answers, "tokens": tokens, "seconds": round(seconds, 2),
                         "tokens_per_second": round(tokens / seconds, 2)}
        return out
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdistill.feature_serve_check")
    p.add_argument("--draft", required=True)
    p.add_argument("--prompts", type=int, default=4, help="first prompts of each set")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("flags", nargs="*", help="further serve flags (after --)")
    args = p.parse_args(argv)
    prompts = {name: [x["messages"][-1]["content"] for x in json.loads(
        (BENCH_DIR / f"{name}.json").read_text())["prompts"][:args.prompts]]
        for name in ("chat", "grounded")}
    plain = run("none", prompts, args.max_tokens, args.flags)
    head = run(args.draft, prompts, args.max_tokens, args.flags)
    report: dict[str, Any] = {"draft": args.draft, "prompts": args.prompts,
                              "max_tokens": args.max_tokens, "flags": args.flags,
                              "load_average": os.getloadavg(), "sets": {}}
    same = True
    for name in prompts:
        identical = plain[name]["answers"] == head[name]["answers"]
        same &= identical
        ratio = head[name]["tokens_per_second"] / plain[name]["tokens_per_second"]
        report["sets"][name] = {"identical": identical, "none": plain[name],
                                "head": head[name], "speedup": round(ratio, 3)}
        print(f"{name}: identical={identical} none {plain[name]['tokens_per_second']} tok/s, "
              f"head {head[name]['tokens_per_second']} tok/s, x{ratio:.2f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
