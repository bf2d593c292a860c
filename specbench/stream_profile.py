"""Where a streamed token's milliseconds go: one stream through a real server, greedy.

    python -m specbench.stream_profile --json bench-results/stream-profile.json \
        -- --draft none --threads 2

Starts ``specserve serve`` (the arguments after ``--``; draft models on PyTorch) in a
child process whose model
thread and event loop are timed with ``time.perf_counter`` around a few functions, streams
the prompts one at a time from this process (the openai-style chat endpoint, greedy), stops
the server, and prints per token:

- the model thread: the layers (the native stack's one call), the head (a draft model's
  steps included), a draft model's greedy steps in one native call, handing events to
  the event loop, the rest of the round (drafting, layout, verify, commit, detokenizing,
  stop strings), and its time between rounds;
- the event loop: building each chunk and its JSON, the request's metrics, and the rest of
  its busy time (SSE framing, the ASGI server, asyncio's wake-ups); and its idle time;
- the client's median gap between streamed tokens.

Function times are wall times, so they include waiting for the GIL held by the other
thread. Writes JSON with every figure.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import selectors
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import httpx

from specbench.compare import json_output, load_prompts, write_json
from specbench.http import wait_ready
from specbench.peer import Peer, connect, stream_chat

MS = 1000.0
ENV = "SPECSERVE_STREAM_PROFILE"  # the child's JSON path


# -- in the server (the child) -----------------------------------------------------------

class _Clock:
    """Seconds and calls per name, from the threads that call timed functions."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.first: float | None = None
        self.last = 0.0
        self.prefill = False  # within a round holding prompt chunks

    def reset(self, *_: Any) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.first = None

    def wrap(self, owner: Any, attr: str, name: str, window: bool = False) -> None:
        inner = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                end = time.perf_counter()
                key = f"{name}_prefill" if self.prefill else name
                self.seconds[key] += end - start
                self.calls[key] += 1
                if window:
                    self.first = start if self.first is None else self.first
                    self.last = end

        setattr(owner, attr, timed)


def _instrument(clock: _Clock) -> None:
    from decoding import engine as engine_module
    from decoding.engine import Engine
    from decoding.handoff import Outbox
    from gateway.encode import formats
    from gateway.encode.formats import ChatFormat
    from gateway.predict import run
    from runtime.runner import fused
    from runtime.runner.batched import BatchedLM

    clock.wrap(Engine, "_iteration", "round", window=True)
    round_ = engine_module.speculative_round

    def classified(target: Any, prompts: Any, *args: Any, **kwargs: Any) -> Any:
        clock.prefill = bool(prompts)
        start = time.perf_counter()
        try:
            return round_(target, prompts, *args, **kwargs)
        finally:
            if clock.prefill:
                clock.seconds["prefill_round"] += time.perf_counter() - start
            clock.prefill = False

    engine_module.speculative_round = classified
    clock.wrap(fused, "forward", "layers")
    clock.wrap(BatchedLM, "_logits", "head")
    clock.wrap(BatchedLM, "draft_chain", "draft_chain")
    clock.wrap(Outbox, "hand_over", "hand_over")
    clock.wrap(formats, "chunk_json", "chunk_json")
    clock.wrap(ChatFormat, "chunk", "chunk")
    clock.wrap(run.ResponseRun, "_observe", "metrics")
    main = threading.main_thread()
    for kind in (selectors.EpollSelector, selectors.SelectSelector):
        select = kind.select

        def idle(self: Any, timeout: float | None = None, _select: Any = select) -> Any:
            if threading.current_thread() is not main:
                return _select(self, timeout)
            start = time.perf_counter()
            try:
                return _select(self, timeout)
            finally:
                end = time.perf_counter()
                if clock.first is not None and start >= clock.first:
                    clock.seconds["loop_idle"] += end - start
                    clock.last_idle = end  # type: ignore[attr-defined]

        kind.select = idle  # type: ignore[method-assign]


def _child(argv: Sequence[str]) -> int:
    from gateway.server import add_serve_command

    parser = argparse.ArgumentParser(prog="specserve")
    add_serve_command(parser.add_subparsers())  # draft models on PyTorch
    args = parser.parse_args(["serve", *argv])
    clock = _Clock()
    _instrument(clock)

    def dump() -> None:
        with open(os.environ[ENV], "w", encoding="utf-8") as out:
            json.dump({"seconds": clock.seconds, "calls": clock.calls,
                       "window_s": clock.last - (clock.first or clock.last)}, out)

    atexit.register(dump)
    signal.signal(signal.SIGUSR1, clock.reset)  # after the warm-up request
    return int(args.func(args))


# -- in this process ------------------------------------------------------------------

def profile(args: argparse.Namespace) -> dict[str, Any]:
    out = f"/tmp/stream-profile-{os.getpid()}.json"
    url = f"http://127.0.0.1:{args.port}"
    command = [sys.executable, "-m", "specbench.stream_profile", "--child", "--",
               *args.serve, "--port", str(args.port), "--metrics-port", str(args.port + 1)]
    proc = subprocess.Popen(command, env={**os.environ, ENV: out},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url, proc)
        prompts = load_prompts(args.prompt_set, args.prompts)
        peer = Peer("server", url)
        gaps: list[float] = []
        tokens = 0
        with httpx.Client(timeout=300) as client:
            connect(client, peer, {}, prompts[0].messages)
            proc.send_signal(signal.SIGUSR1)
            for prompt in prompts:
                reply = stream_chat(client, peer, prompt.messages, args.max_tokens)
                tokens += reply.tokens
                if reply.itl_s is not None:
                    gaps.append(reply.itl_s)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    with open(out, encoding="utf-8") as f:
        child = json.load(f)
    os.unlink(out)
    return summarise(child, tokens, gaps, args)


def summarise(child: dict[str, Any], tokens: int, gaps: list[float],
              args: argparse.Namespace) -> dict[str, Any]:
    s: dict[str, float] = defaultdict(float, child["seconds"])
    per: dict[str, float] = defaultdict(float, {name: seconds / tokens * MS
                                              for name, seconds in s.items()})
    window = child["window_s"] / tokens * MS
    prefill = per["prefill_round"]
    model = {
        "layers (native stack)": per["layers"],
        "head": per["head"],
        "hand-over to the event loop": per["hand_over"],
        "draft chain (native)": per["draft_chain"],
        "rest of the round (Python)": per["round"] - per["layers"] - per["head"]
        - per["draft_chain"] - per["hand_over"] - prefill,
        "prompt passes (prefill)": prefill,
        "between rounds": window - per["round"],
    }
    loop_busy = window - per["loop_idle"]
    loop = {
        "chunk and its JSON": per["chunk"] + per["chunk_json"],
        "request metrics": per["metrics"],
        "SSE, ASGI server, asyncio": loop_busy - per["chunk"] - per["chunk_json"]
        - per["metrics"],
        "idle": per["loop_idle"],
    }
    return {"serve": args.serve, "prompt_set": args.prompt_set, "prompts": args.prompts,
            "max_tokens": args.max_tokens, "tokens": tokens,
            "median_gap_ms": statistics.median(gaps) * MS if gaps else None,
            "ms_per_token": window, "model_thread": model, "event_loop": loop,
            "calls": child["calls"]}


def format_table(report: dict[str, Any]) -> str:
    lines = [f"{report['tokens']} tokens, {report['ms_per_token']:.2f} ms a token "
             f"(client's median gap {report['median_gap_ms']:.2f} ms)", "",
             "thread | part | ms per token", "---|---|---"]
    for thread in ("model_thread", "event_loop"):
        lines += [f"{thread.replace('_', ' ')} | {part} | {ms:.3f}"
                  for part, ms in report[thread].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return _child(argv[2:] if argv[1:2] == ["--"] else argv[1:])
    parser = argparse.ArgumentParser(prog="python -m specbench.stream_profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-set", default="chat")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--port", type=int, default=8190)
    parser.add_argument("--json", default=None)
    parser.add_argument("serve", nargs="*", help="specserve serve's arguments (after --)")
    args = parser.parse_args(argv)
    path = json_output(args.json)
    report = profile(args)
    sys.stdout.write(format_table(report))
    write_json(path, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
