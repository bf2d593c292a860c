"""``specserve bench --peer NAME=URL ...``: the same prompts through several
OpenAI-compatible servers, side by side.

    specserve bench --peer specserve=http://127.0.0.1:8000 \\
                    --peer llama.cpp=http://127.0.0.1:8081 --json peer.json

Each prompt of the prompt sets goes to every server's streamed
``/v1/chat/completions`` in turn (greedy: temperature 0, plus
``repeat_penalty: 1.0`` where a server takes it), one request at a time, prompt
by prompt, so that machine noise hits every server alike; each server gets one
short warm-up request first, on a message of no prompt set (so that no measured
prompt is in a server's cache before it is sent). Per server and prompt set:
tokens/s (completion tokens over request time, summed over the prompts), time to
first token and inter-token latency (a request's time from its first to its last
token over the tokens in between), median and p90 over the prompts, with ratios
to the first server; prefill tokens/s (prompt tokens over time to first token,
summed over the prompts, where the server reports prompt tokens); and whether the
servers' greedy outputs are identical, prompt by prompt.
Completion tokens come from the ``usage`` of the stream's last chunk where the
server sends one (``stream_options.include_usage``), else they are the chunks
that carried text (one token each on most servers); a predicted output's rejected
tokens, which OpenAI's usage counts as completion tokens, are not the answer's.
Where a server reports its own ``timings`` (llama.cpp's server does, with the
tokens it drafted and those accepted), the JSON keeps them, and the share of drafted
tokens accepted.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import httpx

from specbench.progress import progress

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 128
WARMUP_TOKENS = 8
WARMUP_MESSAGES = ({"role": "user", "content": "Say hello in one short sentence."},)
GREEDY_EXTRAS: dict[str, Any] = {"repeat_penalty": 1.0}  # llama.cpp penalises repeats otherwise
TIMEOUT_S = 600.0
MS = 1000.0


class PeerError(Exception):
    """A server that cannot be benchmarked: unreachable, or an error answer (``status``)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Peer:
    """One server under test: its name in the table, base URL, model and request extras."""

    name: str
    url: str  # without the /v1 suffix
    model: str = ""
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Reply:
    """One streamed answer and its timing (seconds from the request being sent)."""

    text: str
    tokens: int
    tokens_from: str  # "usage" or "chunks"
    prompt_tokens: int | None  # from usage: tells whether the servers rendered alike
    ttft_s: float
    last_s: float  # the last text
    seconds: float  # the stream's end
    finish_reason: str | None
    timings: dict[str, Any] | None = None  # the server's own, where it sends them
    usage: dict[str, Any] | None = None  # the stream's usage chunk, where it sends one

    @property
    def itl_s(self) -> float | None:
        return (self.last_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else None


def parse_peer(text: str) -> Peer:
    """``NAME=URL`` (``http://host:port``, with or without ``/v1``)."""
    name, sep, url = text.partition("=")
    if not sep or not name.strip() or not url.strip().startswith(("http://", "https://")):
        raise ValueError(f"--peer takes NAME=URL (e.g. llama.cpp=http://127.0.0.1:8081), "
                         f"not {text!r}")
    url = url.strip().rstrip("/")
    return Peer(name=name.strip(), url=url[:-3] if url.endswith("/v1") else url)


def stream_chat(client: httpx.Client, peer: Peer, messages: Sequence[dict[str, str]],
                max_tokens: int) -> Reply:
    """One greedy streamed chat completion from ``peer``."""
    payload = {"model": peer.model, "messages": list(messages), "max_tokens": max_tokens,
               "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
               **peer.extras}
    start = time.perf_counter()
    pieces: list[str] = []
    chunks = 0
    usage: dict[str, Any] = {}
    timings = None
    first = last = None
    finish = None
    try:
        with client.stream("POST", f"{peer.url}/v1/chat/completions", json=payload) as response:
            if response.status_code != 200:
                response.read()
                raise PeerError(f"{peer.name} answered {response.status_code}: "
                                f"{error_message(response)}", response.status_code)
            for line in response.iter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise PeerError(f"{peer.name} failed mid-stream: {chunk['error']}")
                usage = chunk.get("usage") or usage
                timings = chunk.get("timings") or timings
                for choice in chunk.get("choices") or ():
                    finish = choice.get("finish_reason") or finish
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        last = time.perf_counter() - start
                        first = last if first is None else first
                        pieces.append(piece)
                        chunks += 1
    except httpx.HTTPError as exc:
        raise PeerError(f"{peer.name} at {peer.url}: {type(exc).__name__}: {exc}") from None
    end = time.perf_counter() - start
    counted = usage.get("completion_tokens")
    if counted is not None:  # a prediction's rejected tokens are counted apart from the answer
        counted -= (usage.get("completion_tokens_details") or {}).get(
            "rejected_prediction_tokens") or 0
    return Reply(text="".join(pieces), tokens=int(counted) if counted is not None else chunks,
                 tokens_from="usage" if counted is not None else "chunks",
                 prompt_tokens=usage.get("prompt_tokens"),
                 ttft_s=first if first is not None else end,
                 last_s=last if last is not None else end, seconds=end, finish_reason=finish,
                 timings=timings, usage=usage or None)


def error_message(response: httpx.Response) -> str:
    """What an error answer says: OpenAI's ``error.message``, else the start of its body."""
    try:
        error = response.json().get("error")
        return str(error.get("message") if isinstance(error, dict) else error)
    except (ValueError, AttributeError):
        return response.text[:300]


def served_model(client: httpx.Client, peer: Peer) -> str:
    """The id of the first model ``peer`` lists at ``/v1/models``."""
    try:
        response = client.get(f"{peer.url}/v1/models", timeout=10)
    except httpx.HTTPError as exc:
        raise PeerError(f"{peer.name} at {peer.url} is not reachable "
                        f"({type(exc).__name__}: {exc})") from None
    if response.status_code != 200:
        raise PeerError(f"{peer.name} at {peer.url}: GET /v1/models answered "
                        f"{response.status_code}; is it an OpenAI-compatible server?")
    models = response.json().get("data") or []
    if not models:
        raise PeerError(f"{peer.name} at {peer.url} serves no model")
    return str(models[0]["id"])


def connect(client: httpx.Client, peer: Peer, extras: dict[str, Any],
            messages: Sequence[dict[str, str]]) -> None:
    """Find ``peer``'s model and warm it up; extras it refuses (a 400) are dropped."""
    peer.model = served_model(client, peer)
    peer.extras = dict(extras)
    try:
        stream_chat(client, peer, messages, WARMUP_TOKENS)
    except PeerError as exc:
        if not extras or exc.status != 400:
            raise
        log.info("%s refuses %s (%s); sending none", peer.name, sorted(extras), exc)
        peer.extras = {}
        stream_chat(client, peer, messages, WARMUP_TOKENS)


def run_peers(peers: Sequence[Peer], prompt_sets: dict[str, list[Any]], max_tokens: int,
              extras: dict[str, Any] | None = None, show_progress: bool = True
              ) -> dict[str, Any]:
    """Every prompt through every peer, interleaved; the JSON report."""
    extras = GREEDY_EXTRAS if extras is None else extras
    replies: list[dict[str, Any]] = []
    total = len(peers) * sum(len(prompts) for prompts in prompt_sets.values())
    with httpx.Client(timeout=TIMEOUT_S) as client, progress(
            total, "peer bench", show_progress) as bar:
        for peer in peers:
            connect(client, peer, extras, WARMUP_MESSAGES)
        for name, prompts in prompt_sets.items():
            for prompt in prompts:
                for peer in peers:
                    bar.set_postfix_str(f"{name} {prompt.id} {peer.name}")
                    reply = stream_chat(client, peer, prompt.messages, max_tokens)
                    replies.append({"server": peer.name, "prompt_set": name, "id": prompt.id,
                                    **asdict(reply), "itl_s": reply.itl_s})
                    bar.update()
                    # the bar shows progress where there is one; else, a log line a reply
                    log.log(logging.DEBUG if not bar.disable else logging.INFO,
                            "%s %s %s: %d tokens in %.1f s, first after %.1f s", name,
                            prompt.id, peer.name, reply.tokens, reply.seconds, reply.ttft_s)
    return {
        "config": {"max_tokens": max_tokens, "greedy": True, "order": "prompt by prompt, "
                   "every server in turn, after one warm-up request each",
                   "warmup_messages": list(WARMUP_MESSAGES),
                   "prompts": {n: [p.id for p in ps] for n, ps in prompt_sets.items()}},
        "servers": [{"name": p.name, "url": p.url, "model": p.model, "extras": p.extras}
                    for p in peers],
        "runs": summarise(peers, prompt_sets, replies),
        "agreement": agreement([p.name for p in peers], replies),
        "replies": replies,
    }


def summarise(peers: Sequence[Peer], prompt_sets: dict[str, list[Any]],
              replies: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (prompt set, server), the first server's first in each set."""
    rows = []
    for name in prompt_sets:
        reference: dict[str, str] = {}
        base = None
        for peer in peers:
            mine = [r for r in replies if r["server"] == peer.name and r["prompt_set"] == name]
            if peer is peers[0]:
                reference = {r["id"]: r["text"] for r in mine}
            tokens = sum(r["tokens"] for r in mine)
            seconds = sum(r["seconds"] for r in mine)
            rate = tokens / seconds if seconds > 0 else 0.0
            base = rate if base is None else base
            itl = [r["itl_s"] for r in mine if r["itl_s"] is not None]
            ttft = [r["ttft_s"] for r in mine]
            differing = [r["id"] for r in mine if reference.get(r["id"]) != r["text"]]
            prompt_tokens = [r["prompt_tokens"] for r in mine]
            counted = None if None in prompt_tokens else sum(prompt_tokens)
            waited = sum(ttft)
            rows.append({
                "server": peer.name, "prompt_set": name, "prompts": len(mine),
                "tokens": tokens, "seconds": round(seconds, 4),
                "tokens_per_s": round(rate, 2),
                "ratio_to_first": round(rate / base, 3) if base else None,
                "ttft_ms_median": _ms(statistics.median(ttft)) if ttft else None,
                "ttft_ms_p90": _ms(quantile(ttft, 0.9)) if ttft else None,
                "itl_ms_median": _ms(statistics.median(itl)) if itl else None,
                "itl_ms_p90": _ms(quantile(itl, 0.9)) if itl else None,
                "tokens_from": "+".join(sorted({r["tokens_from"] for r in mine})),
                "prompt_tokens": counted,
                "prefill_tokens_per_s": round(counted / waited, 1)
                if counted is not None and waited > 0 else None,
                "draft_acceptance": draft_acceptance(mine),
                "identical_to_first": len(mine) - len(differing),
                "differing_prompts": differing,
            })
    return rows


def draft_acceptance(replies: Sequence[dict[str, Any]]) -> float | None:
    """Drafted tokens accepted over drafted tokens, as the server's timings count them (as
    llama.cpp's server does); None where no reply reports a draft."""
    counts = [(t.get("draft_n_accepted", 0), t["draft_n"]) for r in replies
              if (t := r.get("timings")) and t.get("draft_n")]
    drafted = sum(n for _, n in counts)
    return round(sum(a for a, _ in counts) / drafted, 3) if drafted else None


def agreement(names: Sequence[str], replies: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each pair of servers: on how many prompts their texts are identical, and the
    median length of the text they share before the first difference."""
    texts: dict[tuple[str, str], dict[str, str]] = {}
    for reply in replies:
        texts.setdefault((reply["prompt_set"], reply["id"]), {})[reply["server"]] = reply["text"]
    pairs = []
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            both = [(t[first], t[second]) for t in texts.values() if first in t and second in t]
            shared = [_shared_prefix(a, b) for a, b in both]
            pairs.append({"servers": [first, second], "prompts": len(both),
                          "identical": sum(a == b for a, b in both),
                          "median_shared_prefix_chars": statistics.median(shared)
                          if shared else None})
    return pairs


def _shared_prefix(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _ms(seconds: float) -> float:
    return round(seconds * MS, 2)


HEADER = ("set", "server", "tok/s", "x first", "TTFT ms", "TTFT p90", "prefill tok/s",
          "ITL ms", "ITL p90", "tokens", "same as first")


def format_table(report: dict[str, Any]) -> str:
    """The runs side by side, and one line on whether the greedy outputs agree."""
    rows = [(r["prompt_set"], r["server"], f"{r['tokens_per_s']:.1f}",
             "-" if r["ratio_to_first"] is None else f"{r['ratio_to_first']:.2f}x",
             _cell(r["ttft_ms_median"]), _cell(r["ttft_ms_p90"]),
             _cell(r.get("prefill_tokens_per_s")), _cell(r["itl_ms_median"]),
             _cell(r["itl_ms_p90"]), str(r["tokens"]),
             f"{r['identical_to_first']}/{r['prompts']}") for r in report["runs"]]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(HEADER)]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()
             for row in (HEADER, tuple("-" * w for w in widths), *rows)]
    for pair in report["agreement"]:
        first, second = pair["servers"]
        verdict = "agree on every prompt" if pair["identical"] == pair["prompts"] else (
            f"identical on {pair['identical']}/{pair['prompts']} prompts (median "
            f"{pair['median_shared_prefix_chars']:.0f} characters alike before they part)")
        lines.append(f"greedy outputs of {first} and {second}: {verdict}")
    return "\n".join(lines) + "\n"


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def run_peer_bench(args: argparse.Namespace) -> int:
    """The ``bench --peer`` command: run, print the table, write the JSON and plots."""
    from specbench.compare import QUICK_MAX_TOKENS, QUICK_PROMPTS, json_output, load_prompts
    from specbench.plots import write_plots

    log.setLevel(logging.INFO)
    try:
        peers = [parse_peer(text) for text in args.peer]
        if len({p.name for p in peers}) != len(peers):
            raise ValueError("each --peer needs a name of its own")
        limit = args.prompts if args.prompts is not None else (
            QUICK_PROMPTS if args.quick else None)
        sets = [s.strip() for s in args.prompt_sets.split(",") if s.strip()]
        prompt_sets = {name: load_prompts(name, limit) for name in sets}
        extras = json.loads(args.peer_extras) if args.peer_extras else None
        if extras is not None and not isinstance(extras, dict):
            raise ValueError("--peer-extras takes a JSON object")
    except (ValueError, json.JSONDecodeError) as exc:
        log.error("%s", exc)
        return 2
    json_path = json_output(args.json)
    max_tokens = args.max_tokens or (QUICK_MAX_TOKENS if args.quick else DEFAULT_MAX_TOKENS)
    try:
        report = run_peers(peers, prompt_sets, max_tokens, extras,
                           show_progress=not args.no_progress)
    except PeerError as exc:
        print(f"specserve: {exc}", file=sys.stderr)
        return 1
    write_table(report, sys.stdout)
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        log.info("wrote %s", json_path)
        write_plots("peer", report, json_path)
    return 0


def write_table(report: dict[str, Any], stream: TextIO) -> None:
    stream.write(format_table(report))
    stream.flush()


def add_peer_flags(parser: argparse.ArgumentParser) -> None:
    """The flags ``bench --peer`` adds to ``bench``'s own."""
    parser.add_argument("--peer", action="append", default=[], metavar="NAME=URL",
                        help="an OpenAI-compatible server to benchmark through its streamed "
                             "chat endpoint (repeatable; ratios are to the first)")
    parser.add_argument("--peer-extras", default=None, metavar="JSON",
                        help="extra request fields for --peer runs (default "
                             f"{json.dumps(GREEDY_EXTRAS)}, dropped by a server that refuses "
                             "them)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specbench.peer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_peer_flags(parser)
    parser.add_argument("--prompt-sets", default="chat,grounded")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per set")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"max_tokens per request (default {DEFAULT_MAX_TOKENS})")
    parser.add_argument("--quick", action="store_true", help="4 prompts per set, 64 tokens")
    parser.add_argument("--json", default=None, help="write the results (and plots) here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if not args.peer:
        parser.error("name at least one --peer NAME=URL")
    return run_peer_bench(args)


if __name__ == "__main__":
    raise SystemExit(main())
