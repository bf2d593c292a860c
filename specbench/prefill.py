"""``python -m specbench.prefill``: how fast specserve reads a long prompt (prefill) beside
llama.cpp's ``llama-server``, at about 1,500, 4,000 and 8,000 prompt tokens, both servers
started here.

    python -m specbench.prefill --llama-server ~/llama.cpp/build/bin/llama-server \\
        --target qwen2.5-coder-1.5b

The servers (``--servers`` picks some), each on ``--threads`` threads, started one after
another and up together (``specbench.peer_run``):

- ``llama-server``: ``-t N -tb N -c CONTEXT -np 1``, the reference of the ratio;
- ``specserve-none``: ``--draft none`` (a drafter plays no part in reading a prompt).

CONTEXT is the longest prompt and ``CONTEXT_MARGIN`` tokens more. A length the model's
own context cannot hold with that margin to spare is cut to what it can hold; the JSON
records the lengths asked for and those measured.

Prompts: source code from the shipped prompt sets, repeated as needed and cut to exactly
each length of ``--lengths`` in tokens of the target's own tokenizer, as specserve encodes
a ``/v1/completions`` prompt (no special tokens; llama-server may add a BOS token, which
its count shows). Each prompt begins with a line of its own (its round, its length and
random hex), so that no server finds any of it cached from an earlier request (specserve
keeps prompts' KV blocks, llama-server its slot's last prompt); llama-server is also asked
not to keep it (``cache_prompt: false``).

Requests: ``/v1/completions`` with the raw prompt, so a base model without a chat template
is measured like any other; ``max_tokens: 1``, ``temperature: 0``, not streamed. The
seconds are from sending the request to its whole answer: the prefill and one token.
Each server first answers one short warm-up request. Then ``--repeats`` rounds: in each,
every length in turn, and for each length every server in turn on the same prompt (the
servers' order reversed every other round, so that none always goes first). Prefill
tokens/s is the prompt tokens the server counted (``usage.prompt_tokens``) over the
seconds; the table shows, per length, each server's median over the rounds and the ratio
of each server's median to llama-server's.

The JSON holds the machine (CPU, memory read bandwidth before and after, load), the
llama-server build and the specserve commit, each server's command line, the
configuration, a row per length and server, and every request with its timing.
"""

from __future__ import annotations

import argparse
import logging
import math
import re
import secrets
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from decoding.prompting import encode_text
from specbench.peer import Peer, PeerError, error_message, served_model
from specbench.peer_run import (
    START_TIMEOUT_S,
    THREADS,
    Server,
    add_peer_arguments,
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

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

SERVERS = ("llama-server", "specserve-none")
REFERENCE = "llama-server"
DEFAULT_LENGTHS = "1500,4000,8000"
REPEATS = 2
WARMUP_TOKENS = 64
BASE_PORT = 18400  # API ports from here up; specserve's metrics port after them
CONTEXT_MARGIN = 64  # context beyond the longest prompt: a BOS token, the answer's token
REQUEST_TIMEOUT_S = 3600.0  # a slow machine may take minutes over 8,000 tokens
TEXT_SETS = ("long_code", "code_edit", "code_chat")  # where the prompts' text comes from
CUT_TRIES = 16  # starts of the body tried, a line apart
CUT_SLACK = 2  # cuts tried either side of the length, in tokens


@dataclass(frozen=True)
class LongPrompt:
    """One prompt of the run: sent to every server in one round at one length."""

    round: int
    length: int  # its tokens, as specserve counts a completions prompt
    text: str

    @property
    def first_line(self) -> str:
        return self.text.split("\n", 1)[0]


@dataclass(frozen=True)
class Answer:
    """One timed request: what the server counted and the seconds until its whole answer."""

    prompt_tokens: int | None  # usage.prompt_tokens, where the server reports it
    seconds: float
    finish_reason: str | None
    timings: dict[str, Any] | None = None  # the server's own (llama-server sends them)


# -- the prompts ----------------------------------------------------------------------------


def source_text(sets: Sequence[str] = TEXT_SETS) -> str:
    """Every message of the shipped prompt sets named, one after another: code and the
    words around it, the matter of a coding assistant's long prompts."""
    from specbench.compare import load_prompts

    return "\n\n".join(str(message["content"]) for name in sets
                       for prompt in load_prompts(name) for message in prompt.messages)


def first_line(round_: int, length: int, nonce: str) -> str:
    """The line a prompt begins with: no two prompts of a run share it."""
    return f"# run {round_} of length {length}: {nonce}\n"


def cut_to_tokens(tokenizer: PreTrainedTokenizerBase, text: str, length: int) -> str | None:
    """The start of ``text`` that encodes to exactly ``length`` tokens, or None where none
    does near there: the text up to a cut between two tokens can encode as one token less
    (a newline and a tab that end it are one token), so cuts a token or two either side
    are tried too."""
    ids = encode_text(tokenizer, text)
    if len(ids) < length:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {length}")
    for keep in sorted(range(length - CUT_SLACK, length + CUT_SLACK + 1),
                       key=lambda k: abs(k - length)):
        cut = str(tokenizer.decode(ids[:max(0, keep)], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False))
        if len(encode_text(tokenizer, cut)) == length:
            return cut
    return None


def build_prompt(tokenizer: PreTrainedTokenizerBase, head: str, body: str, length: int,
                 body_tokens: int) -> str:
    """``head`` and then ``body`` as many times as needed (``body_tokens`` is its count),
    cut to exactly ``length`` tokens; where no cut near the end comes out exact, the
    body starts a line later, which moves the end to other tokens."""
    copies = math.ceil(length / max(1, body_tokens)) + 1
    lines = "\n\n".join([body] * copies).split("\n")
    for skip in range(CUT_TRIES):
        cut = cut_to_tokens(tokenizer, head + "\n".join(lines[skip:]), length)
        if cut is not None:
            return cut
    raise ValueError(f"no start of the text encodes to exactly {length} tokens")


def plan_prompts(tokenizer: PreTrainedTokenizerBase, body: str, lengths: Sequence[int],
                 rounds: int, nonce: Callable[[], str] = lambda: secrets.token_hex(8)
                 ) -> list[LongPrompt]:
    """One prompt per round and length, round by round, each with a first line of its own."""
    body_tokens = len(encode_text(tokenizer, body))
    return [LongPrompt(r, length, build_prompt(tokenizer, first_line(r, length, nonce()), body,
                                               length, body_tokens))
            for r in range(rounds) for length in lengths]


def usable_lengths(lengths: Sequence[int], model_context: int) -> list[int]:
    """The lengths the model's context holds with ``CONTEXT_MARGIN`` tokens to spare, a
    longer one cut to that; each once, in the order given."""
    most = model_context - CONTEXT_MARGIN
    if most < 1:
        raise ValueError(f"a context of {model_context} tokens leaves no room for a prompt")
    return list(dict.fromkeys(min(length, most) for length in lengths))


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise ValueError(f"--lengths takes token counts such as 1500,4000,8000, not {text!r}"
                         ) from None
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths takes positive token counts, not {text!r}")
    return lengths


# -- the servers ----------------------------------------------------------------------------


def plan(args: argparse.Namespace, target_gguf: Path, context: int) -> list[Server]:
    """The servers asked for, in the order of ``SERVERS``, with their ports."""
    wanted = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [w for w in wanted if w not in SERVERS]
    if unknown or not wanted:
        raise ValueError(f"--servers takes some of {', '.join(SERVERS)}, not {args.servers!r}")
    servers: list[Server] = []
    metrics_port = args.base_port + len(SERVERS)
    for name in (n for n in SERVERS if n in wanted):
        port = args.base_port + len(servers)
        if name == REFERENCE:
            argv = [*llama_command(args.llama_server, target_gguf, args.threads, context),
                    "--port", str(port)]
            servers.append(Server(name, argv, port, "/health", (target_gguf,)))
            continue
        # a request's time may pass the default limit where a long prompt is read slowly
        argv = [*specserve_command(args.target, args.threads), "--draft", "none",
                "--request-timeout", f"{REQUEST_TIMEOUT_S:.0f}", "--port", str(port),
                "--metrics-port", str(metrics_port)]
        metrics_port += 1
        servers.append(Server(name, argv, port, "/ready", ()))
    return servers


def extras_for(server: Server) -> dict[str, Any]:
    """What a server is sent besides the prompt: llama-server is asked to keep none of it."""
    return {"cache_prompt": False} if server.kind == "llama-server" else {}


def complete(client: httpx.Client, peer: Peer, prompt: str) -> Answer:
    """One non-streamed completion of one token, timed from sending to the whole answer."""
    payload = {"model": peer.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
               **peer.extras}
    start = time.perf_counter()
    try:
        response = client.post(f"{peer.url}/v1/completions", json=payload)
    except httpx.HTTPError as exc:
        raise PeerError(f"{peer.name} at {peer.url}: {type(exc).__name__}: {exc}") from None
    seconds = time.perf_counter() - start
    if response.status_code != 200:
        raise PeerError(f"{peer.name} answered {response.status_code}: "
                        f"{error_message(response)}", response.status_code)
    answer = response.json()
    usage = answer.get("usage") or {}
    choices = answer.get("choices") or [{}]
    counted = usage.get("prompt_tokens")
    return Answer(prompt_tokens=int(counted) if counted is not None else None,
                  seconds=round(seconds, 4),
                  finish_reason=choices[0].get("finish_reason"), timings=answer.get("timings"))


def measure(client: httpx.Client, up: Sequence[Server], prompts: Sequence[LongPrompt],
            warmups: dict[str, str]) -> list[dict[str, Any]]:
    """Every prompt through every server, the servers' order reversed every other round;
    each server first gets its own warm-up prompt (``warmups``, by server name)."""
    peers = [Peer(name=s.name, url=s.url, extras=extras_for(s)) for s in up]
    for peer in peers:
        peer.model = served_model(client, peer)
        complete(client, peer, warmups[peer.name])
    requests: list[dict[str, Any]] = []
    for prompt in prompts:
        for peer in peers if prompt.round % 2 == 0 else peers[::-1]:
            answer = complete(client, peer, prompt.text)
            log.info("round %d, %d tokens: %s counted %s in %.2f s", prompt.round,
                     prompt.length, peer.name, answer.prompt_tokens, answer.seconds)
            requests.append({"server": peer.name, "round": prompt.round,
                             "length": prompt.length, "first_line": prompt.first_line,
                             **asdict(answer)})
    return requests


# -- the report -----------------------------------------------------------------------------


def summarise(names: Sequence[str], requests: Sequence[dict[str, Any]]
              ) -> list[dict[str, Any]]:
    """A row per length and server, in the order measured: the median over the rounds of
    the seconds and of the prefill rate (prompt tokens the server counted over seconds),
    and the ratio of the rate to llama-server's at that length."""
    rows = []
    for length in dict.fromkeys(r["length"] for r in requests):
        rates: dict[str, float | None] = {}
        for name in names:
            mine = [r for r in requests if r["server"] == name and r["length"] == length]
            if not mine:
                continue
            counted = [r["prompt_tokens"] for r in mine if r["prompt_tokens"] is not None]
            per_request = [r["prompt_tokens"] / r["seconds"] for r in mine
                           if r["prompt_tokens"] is not None and r["seconds"] > 0]
            rates[name] = statistics.median(per_request) if per_request else None
            rows.append({
                "length": length, "server": name, "requests": len(mine),
                "prompt_tokens": statistics.median_low(counted) if counted else None,
                "seconds_median": round(statistics.median(r["seconds"] for r in mine), 3),
                "prefill_tokens_per_s": _round(rates[name], 1),
                "prefill_tokens_per_s_each": [round(rate, 1) for rate in per_request],
                "server_prefill_tokens_per_s": _round(own_rate(mine), 1),
            })
        reference = rates.get(REFERENCE)
        for row in rows:
            if row["length"] == length:
                rate = rates[row["server"]]
                row["x_llama_server"] = (round(rate / reference, 3)
                                         if rate is not None and reference else None)
    return rows


def own_rate(requests: Sequence[dict[str, Any]]) -> float | None:
    """The median prompt rate a server reports itself (llama-server's
    ``timings.prompt_per_second``), beside which the client's rate shows what the HTTP
    round trip and the one answer token add; None where it reports none."""
    rates = [float(t["prompt_per_second"]) for r in requests
             if (t := r.get("timings")) and t.get("prompt_per_second")]
    return statistics.median(rates) if rates else None


def format_table(rows: Sequence[dict[str, Any]], names: Sequence[str]) -> str:
    """One line per length: each server's prompt tokens, median seconds and median prefill
    tokens/s side by side, then each other server's ratio to llama-server."""
    others = [n for n in names if n != REFERENCE]
    header = ["length", *(f"{n} {col}" for n in names for col in ("tokens", "s", "tok/s")),
              *(f"{n} / {REFERENCE}" for n in others)]
    lines = []
    for length in dict.fromkeys(r["length"] for r in rows):
        mine = {r["server"]: r for r in rows if r["length"] == length}
        cells = [str(length)]
        for name in names:
            row = mine.get(name)
            cells += (["-", "-", "-"] if row is None else [
                _cell(row["prompt_tokens"], "{}"), f"{row['seconds_median']:.2f}",
                _cell(row["prefill_tokens_per_s"], "{:.1f}")])
        cells += [_cell((mine.get(n) or {}).get("x_llama_server"), "{:.2f}x") for n in others]
        lines.append(cells)
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True))
                     for line in (header, ["-" * w for w in widths], *lines)) + "\n"


def _cell(value: float | None, form: str) -> str:
    return "-" if value is None else form.format(value)


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def default_json(target: str) -> str:
    """``bench-results/prefill-<target>.json``: the target's name, or its file's stem."""
    local = Path(target).expanduser()
    name = local.name.removesuffix(".gguf") if local.exists() else target
    return f"bench-results/prefill-{re.sub(r'[^A-Za-z0-9._-]+', '-', name)}.json"


# -- the command ----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from runtime.loaders.gguf_weights import config_and_tokenizer

    try:
        wants_llama = REFERENCE in [s.strip() for s in args.servers.split(",")]
        if wants_llama and shutil.which(args.llama_server) is None:
            raise ValueError(f"llama-server not found at {args.llama_server!r}: pass "
                             "--llama-server PATH, or leave it out with --servers")
        if args.repeats < 1 or args.warmup_tokens < 1:
            raise ValueError("--repeats and --warmup-tokens take positive counts")
        asked = parse_lengths(args.lengths)
        target_gguf = gguf_file(locate(args.target))
        config, tokenizer = config_and_tokenizer(target_gguf)
        model_context = int(config.max_position_embeddings)
        lengths = usable_lengths(asked, model_context)
        context = max(lengths) + CONTEXT_MARGIN
        servers = plan(args, target_gguf, context)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    if lengths != asked:
        log.warning("the model's context is %d tokens: lengths %s measured as %s",
                    model_context, asked, lengths)
    body = source_text()
    prompts = plan_prompts(tokenizer, body, lengths, args.repeats)
    body_tokens = len(encode_text(tokenizer, body))
    warmups = {s.name: build_prompt(tokenizer, f"# warm-up of {s.name}: {secrets.token_hex(8)}\n",
                                    body, args.warmup_tokens, body_tokens) for s in servers}
    json_path, logs, machine = prepare_run(args.json, default_json(args.target), args.threads)
    try:
        with (running(servers, logs, args.start_timeout) as up,
              httpx.Client(timeout=REQUEST_TIMEOUT_S) as client):
            if not up:
                raise PeerError("no server started")
            requests = measure(client, up, prompts, warmups)
            names = [s.name for s in up]
    except PeerError as exc:
        print(f"specbench: {exc}", file=sys.stderr)
        return 1
    close_machine_record(machine)
    rows = summarise(names, requests)
    report = {
        "machine": machine, **versions(args.llama_server if wants_llama else None),
        "target": {"given": args.target, "file": str(target_gguf),
                   "model_context": model_context},
        "config": {"lengths_asked": asked, "lengths": lengths, "rounds": args.repeats,
                   "threads": args.threads, "llama_server_context": context,
                   "warmup_tokens": args.warmup_tokens, "endpoint": "/v1/completions",
                   "request": {"max_tokens": 1, "temperature": 0.0, "stream": False},
                   "extras": {s.name: extras_for(s) for s in servers},
                   "token_count": "the target's tokenizer, no special tokens (as specserve "
                                  "encodes a completions prompt)",
                   "text_from": list(TEXT_SETS),
                   "order": "round by round, every length in turn, every server in turn on "
                            "the same prompt, the servers' order reversed every other round"},
        "launch": [s.record() for s in servers], "rows": rows, "requests": requests}
    print(format_table(rows, names), end="")
    write_report(json_path, report, servers)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specbench.prefill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_peer_arguments(parser)
    parser.add_argument("--servers", default=",".join(SERVERS),
                        help=f"comma-separated, of {', '.join(SERVERS)} (default both)")
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS,
                        help=f"comma-separated prompt lengths in the target's tokens (default "
                             f"{DEFAULT_LENGTHS}; one past the model's context less "
                             f"{CONTEXT_MARGIN} is cut to that)")
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help=f"rounds over every length and server; the table gives the "
                             f"median (default {REPEATS})")
    parser.add_argument("--warmup-tokens", type=int, default=WARMUP_TOKENS,
                        help=f"the prompt length of each server's warm-up request (default "
                             f"{WARMUP_TOKENS})")
    parser.add_argument("--threads", type=int, default=THREADS,
                        help=f"threads of every server (default {THREADS})")
    parser.add_argument("--base-port", type=int, default=BASE_PORT,
                        help=f"the first port (default {BASE_PORT}); {len(SERVERS) + 1} ports "
                             f"from it may be used")
    parser.add_argument("--start-timeout", type=float, default=START_TIMEOUT_S,
                        help=f"seconds a server may take to load (default {START_TIMEOUT_S:.0f})")
    parser.add_argument("--json", default=None,
                        help="write the results here, the servers' logs beside it (default "
                             "bench-results/prefill-TARGET.json)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per readiness poll
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
