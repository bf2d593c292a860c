"""``python -m specbench.peer_run``: specserve against llama.cpp's ``llama-server`` on one
target and its draft, every server started here, in one prompt-major peer benchmark.

    python -m specbench.peer_run --llama-server ~/llama.cpp/build/bin/llama-server \\
        --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \\
        --prompt-sets code_edit,code_chat,long_code --json bench-results/peer-qwen.json

The servers, by their names in the table (``--servers`` picks some):

- ``llama-server``: plain decoding, the reference every ratio is to;
- ``llama-server-ngram-simple``, ``llama-server-ngram-mod``: ``--spec-type ngram-simple`` and
  ``ngram-mod`` (each only where the build lists that type);
- ``llama-server-draft``: ``-md DRAFT --spec-type draft-simple``;
- ``specserve-none``: ``--draft none``; ``specserve``: the default drafter (``--draft auto``);
  ``specserve-draft``: ``--draft DRAFT``.

Every server gets ``--threads`` threads (llama-server ``-t N -tb N``, one slot, ``-c``
tokens of context) and its own port from ``--base-port`` up. They are started one after
another, each waited on until it is ready, and all stay up while the prompts go through
them prompt by prompt (``specbench.peer``): an idle server costs no CPU, so load drifts
alike for all. Where the machine's free memory cannot hold them all, or with
``--one-at-a-time``, each server instead runs every prompt alone, up while it runs. Every
server this command starts is stopped when it ends, however it ends.

The JSON holds the peer report (``specbench.peer``), the machine (``lscpu``, memory read
bandwidth measured before and after, load average), each server's command line and start-up
time, and the servers that failed to start, with the end of their log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from specbench.peer import DEFAULT_MAX_TOKENS, Peer, PeerError, run_peers, write_table

log = logging.getLogger(__name__)

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
DEFAULT_SETS = "code_edit,code_chat,long_code"
DEFAULT_MAX_NEW = 256
DEFAULT_JSON = "bench-results/peer-qwen.json"
BASE_PORT = 18080  # API ports from here up; specserve's metrics ports after them
THREADS = 2
CONTEXT = 8192
START_TIMEOUT_S = 900.0
POLL_S = 1.0
STOP_TIMEOUT_S = 30.0
LOG_TAIL_LINES = 20
# a server's memory beyond its model files (Python and its tables, KV cache, buffers)
OVERHEAD_BYTES = {"llama-server": 1 << 30, "specserve": 3 << 29}
LLAMA_SPEC_TYPES = ("ngram-simple", "ngram-mod")
SERVERS = ("llama-server", *(f"llama-server-{t}" for t in LLAMA_SPEC_TYPES),
           "llama-server-draft", "specserve-none", "specserve", "specserve-draft")


@dataclass
class Server:
    """One server to start: its name in the table, command line and readiness probe."""

    name: str
    argv: list[str]
    port: int
    ready_path: str  # 200 once the model is loaded
    models: tuple[Path, ...]  # the model files it loads
    started_s: float | None = None  # seconds from start to ready
    failure: str | None = None
    log_path: Path | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def kind(self) -> str:
        return "llama-server" if self.name.startswith("llama-server") else "specserve"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "command": shlex.join(self.argv), "url": self.url,
                "ready_s": None if self.started_s is None else round(self.started_s, 1),
                "failure": self.failure, "log": str(self.log_path) if self.log_path else None}


def locate(name_or_path: str) -> Path:
    """Where a model is: a path as given, else what specserve resolves a name to."""
    local = Path(name_or_path).expanduser()
    if local.exists():
        return local
    from runtime.files import model_store

    return Path(model_store.resolve(name_or_path))


def gguf_file(model: Path) -> Path:
    """The GGUF file of a model: the file itself, or the one in its directory."""
    if model.is_dir():
        found = sorted(model.glob("*.gguf"))
        if len(found) != 1:
            raise ValueError(f"{model} holds {len(found)} GGUF files; name one")
        model = found[0]
    if model.suffix != ".gguf" or not model.is_file():
        raise ValueError(f"{model}: not a GGUF file (llama-server needs one)")
    return model


def size_of(model: Path) -> int:
    """Bytes of a model's files (a GGUF file, or a directory's files)."""
    if model.is_file():
        return model.stat().st_size
    return sum(p.stat().st_size for p in model.rglob("*") if p.is_file())


def llama_spec_types(binary: str) -> set[str]:
    """The ``--spec-type`` values this llama-server build lists in its help."""
    result = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60,
                            check=False)
    text = result.stdout + result.stderr
    return {t for t in (*LLAMA_SPEC_TYPES, "draft-simple") if t in text}


def llama_command(binary: str, model: Path, threads: int, context: int) -> list[str]:
    """llama-server on ``model`` with one slot of ``context`` tokens, ``threads`` threads for
    both its token steps and its prompt batches, on the loopback interface (no port yet)."""
    return [binary, "-m", str(model), "--host", "127.0.0.1", "-t", str(threads),
            "-tb", str(threads), "-c", str(context), "-np", "1"]


def specserve_command(target: str, threads: int) -> list[str]:
    """specserve serving ``target`` as it was given (a catalogue name or a path) on
    ``threads`` threads, on the loopback interface, its log as text (no drafter, no port
    yet)."""
    return [sys.executable, "-m", "specserve.cli", "serve", "--host", "127.0.0.1",
            "--target", target, "--threads", str(threads), "--log-format", "text"]


def plan_servers(args: argparse.Namespace, target: Path, draft: Path | None,
                 spec_types: set[str]) -> list[Server]:
    """The servers asked for, with their command lines and ports; llama-server is given
    the target's and the draft's GGUF files, specserve the names as they were given."""
    threads = str(args.threads)
    llama = llama_command(args.llama_server, target, args.threads, args.context)
    specserve = specserve_command(args.target, args.threads)
    alone, both = (target,), (target, *([draft] if draft else []))
    plans: dict[str, tuple[list[str], str, tuple[Path, ...]]] = {
        "llama-server": (llama, "/health", alone),
        **{f"llama-server-{t}": ([*llama, "--spec-type", t], "/health", alone)
           for t in LLAMA_SPEC_TYPES if t in spec_types},
        "specserve-none": ([*specserve, "--draft", "none"], "/ready", alone),
        "specserve": ([*specserve, "--draft", "auto"], "/ready", alone),
    }
    if draft is not None:
        # builds that infer the draft's type from its file list no "draft-simple"
        named = ["--spec-type", "draft-simple"] if "draft-simple" in spec_types else []
        plans["llama-server-draft"] = (
            [*llama, "-md", str(draft), *named, "-td", threads, "-tbd", threads], "/health",
            both)
        plans["specserve-draft"] = ([*specserve, "--draft", args.draft], "/ready", both)
    wanted = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [w for w in wanted if w not in SERVERS]
    if unknown:
        raise ValueError(f"unknown server(s) {unknown}; choose from {', '.join(SERVERS)}")
    extra = parse_extra(args.extra)
    servers: list[Server] = []
    metrics_port = args.base_port + len(SERVERS)
    for name in [n for n in SERVERS if n in wanted]:
        if name not in plans:
            log.warning("%s skipped: %s", name, "no --draft" if "draft" in name
                        else "this llama-server build has no such --spec-type")
            continue
        argv, ready, models = plans[name]
        port = args.base_port + len(servers)
        argv = [*argv, "--port", str(port), *extra.get(name, [])]
        if not name.startswith("llama-server"):
            argv += ["--metrics-port", str(metrics_port)]
            metrics_port += 1
        servers.append(Server(name, argv, port, ready, models))
    return servers


def parse_extra(items: Sequence[str]) -> dict[str, list[str]]:
    """``NAME=ARGS`` items: more arguments for one server's command line."""
    extra: dict[str, list[str]] = {}
    for item in items:
        name, sep, rest = item.partition("=")
        if not sep or name.strip() not in SERVERS:
            raise ValueError(f"--extra takes NAME=ARGS with NAME one of {', '.join(SERVERS)}, "
                             f"not {item!r}")
        extra.setdefault(name.strip(), []).extend(shlex.split(rest))
    return extra


def available_memory() -> int | None:
    """Bytes the kernel counts as available (``MemAvailable``), where it says."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def fits_together(servers: Sequence[Server]) -> bool:
    """Whether the servers' memory fits what is available: llama-server maps its files, so
    servers of one file share its pages; specserve reads its models into its own memory."""
    mapped = {m for s in servers if s.kind == "llama-server" for m in s.models}
    read = [m for s in servers if s.kind == "specserve" for m in s.models]
    need = (sum(OVERHEAD_BYTES[s.kind] for s in servers) + sum(map(size_of, mapped))
            + sum(map(size_of, read)))
    free = available_memory()
    return free is None or need < free


def start(server: Server, logs: Path, timeout_s: float) -> bool:
    """Start ``server`` and wait until it is ready; False (with the reason) if it is not."""
    server.log_path = logs / f"{server.name}.log"
    log.info("starting %s: %s", server.name, shlex.join(server.argv))
    began = time.perf_counter()
    with server.log_path.open("wb") as out:
        server.process = subprocess.Popen(server.argv, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = began + timeout_s
    with httpx.Client(timeout=5) as client:
        while time.perf_counter() < deadline:
            if server.process.poll() is not None:
                server.failure = f"exited with {server.process.returncode} while loading"
                break
            try:
                if client.get(server.url + server.ready_path).status_code == 200:
                    server.started_s = time.perf_counter() - began
                    log.info("%s ready in %.0f s", server.name, server.started_s)
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(POLL_S)
        else:
            server.failure = f"not ready after {timeout_s:.0f} s"
    log.error("%s failed to start (%s); its log ends:\n%s", server.name, server.failure,
              log_tail(server.log_path))
    stop(server)
    return False


def stop(*servers: Server) -> None:
    """Stop servers this command started (each one's process group), all at once: politely,
    then, for any still up after ``STOP_TIMEOUT_S``, not."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [s.process for s in servers if s.process and s.process.poll() is None]
        for process in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.0, deadline - time.monotonic()))


def log_tail(path: Path | None) -> str:
    if path is None or not path.exists():
        return ""
    lines = path.read_text("utf-8", errors="replace").splitlines()
    return "\n".join(lines[-LOG_TAIL_LINES:])


@contextmanager
def running(servers: Sequence[Server], logs: Path, timeout_s: float) -> Iterator[list[Server]]:
    """The servers that started, all up; every one stopped on leaving."""
    try:
        yield [server for server in servers if start(server, logs, timeout_s)]
    finally:
        stop(*servers)


def measure(servers: Sequence[Server], args: argparse.Namespace,
            prompt_sets: dict[str, list[Any]], logs: Path) -> dict[str, Any]:
    """The peer report over the servers that start: all up at once where memory allows,
    else one at a time (each over every prompt, then stopped)."""
    together = not args.one_at_a_time and fits_together(servers)
    if together:
        with running(servers, logs, args.start_timeout) as up:
            report = peer_report(up, prompt_sets, args)
    else:
        log.info("one server at a time (%s)", "asked" if args.one_at_a_time
                 else "the servers' memory exceeds what is available")
        parts = []
        for server in servers:
            with running([server], logs, args.start_timeout) as up:
                if up:
                    parts.append(peer_report(up, prompt_sets, args))
        report = merge(parts, prompt_sets)
    report["config"]["servers_up_together"] = together
    return report


def peer_report(up: Sequence[Server], prompt_sets: dict[str, list[Any]],
                args: argparse.Namespace) -> dict[str, Any]:
    if not up:
        raise PeerError("no server started")
    peers = [Peer(name=s.name, url=s.url) for s in up]
    return run_peers(peers, prompt_sets, args.max_tokens, show_progress=not args.no_progress)


def merge(parts: Sequence[dict[str, Any]], prompt_sets: dict[str, list[Any]]
          ) -> dict[str, Any]:
    """One report from servers measured one at a time."""
    from specbench.peer import agreement, summarise

    if not parts:
        raise PeerError("no server started")
    servers = [entry for part in parts for entry in part["servers"]]
    replies = [reply for part in parts for reply in part["replies"]]
    peers = [Peer(name=s["name"], url=s["url"]) for s in servers]
    config = dict(parts[0]["config"], order="server by server, every prompt in turn, each "
                  "server alone after one warm-up request")
    return {"config": config, "servers": servers,
            "runs": summarise(peers, prompt_sets, replies),
            "agreement": agreement([p.name for p in peers], replies), "replies": replies}


def machine_record(threads: int) -> dict[str, Any]:
    """The CPU (``lscpu``), the load and the memory read bandwidth now."""
    import torch

    from specbench.concurrency import measure_bandwidth
    from specbench.report import machine_info

    torch.set_num_threads(threads)
    record = machine_info()
    record["lscpu"] = lscpu()
    record["memory_read_gb_per_s_start"] = round(measure_bandwidth() / 1e9, 2)
    record["memory_available_bytes_start"] = available_memory()
    return record


def lscpu() -> dict[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30,
                             check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    pairs = (line.split(":", 1) for line in out.splitlines() if ":" in line)
    return {key.strip(): value.strip() for key, value in pairs}


def versions(llama_server: str | None) -> dict[str, str | None]:
    """The llama-server build and the specserve commit measured."""
    found: dict[str, str | None] = {"llama_server": None, "specserve_commit": None}
    if llama_server:
        out = subprocess.run([llama_server, "--version"], capture_output=True, text=True,
                             timeout=60, check=False)
        found["llama_server"] = " ".join((out.stdout + out.stderr).split())[:300] or None
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent, timeout=30, check=False)
    found["specserve_commit"] = git.stdout.strip() or None
    return found


def exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the context that stops the servers


def run(args: argparse.Namespace) -> int:
    from specbench.compare import load_prompts
    from specbench.plots import write_plots

    wants_llama = any(s.strip().startswith("llama-server") for s in args.servers.split(","))
    try:
        if wants_llama and shutil.which(args.llama_server) is None:
            raise ValueError(f"llama-server not found at {args.llama_server!r}: build llama.cpp "
                             "and pass --llama-server PATH (or leave llama-server rows out "
                             "with --servers)")
        target = locate(args.target)
        draft = locate(args.draft) if args.draft != "none" else None
        if wants_llama:
            target = gguf_file(target)
            draft = gguf_file(draft) if draft else None
        spec_types = llama_spec_types(args.llama_server) if wants_llama else set()
        servers = plan_servers(args, target, draft, spec_types)
        sets = [s.strip() for s in args.prompt_sets.split(",") if s.strip()]
        prompt_sets = {name: load_prompts(name, args.prompts) for name in sets}
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    json_path, logs, machine = prepare_run(args.json, DEFAULT_JSON, args.threads)
    try:
        report = measure(servers, args, prompt_sets, logs)
    except PeerError as exc:
        print(f"specserve: {exc}", file=sys.stderr)
        return 1
    close_machine_record(machine)
    report = {"machine": machine, **versions(args.llama_server if wants_llama else None),
              "target": {"given": args.target, "file": str(target)},
              "draft": {"given": args.draft, "file": str(draft) if draft else None},
              "launch": [s.record() for s in servers], **report}
    write_table(report, sys.stdout)
    write_report(json_path, report, servers)
    write_plots("peer", report, json_path)
    return 0


def prepare_run(json_arg: str | None, default_json: str, threads: int
                ) -> tuple[Path, Path, dict[str, Any]]:
    """Before servers start: where the JSON goes, the folder for the servers' logs beside
    it, signals that unwind through the servers' stop, and the machine as it is now."""
    from specbench.compare import json_output

    json_path = json_output(json_arg) or Path(default_json)
    logs = json_path.with_name(json_path.stem + "-logs")
    logs.mkdir(parents=True, exist_ok=True)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, exit_on_signal)
    return json_path, logs, machine_record(threads)


def write_report(json_path: Path, report: dict[str, Any], servers: Sequence[Server]) -> None:
    """After the table: each server that did not start, with its log, and the report as
    JSON at ``json_path``."""
    for server in (s for s in servers if s.failure):
        print(f"{server.name} did not start: {server.failure} (log: {server.log_path})")
    json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    log.info("wrote %s", json_path)


def close_machine_record(machine: dict[str, Any]) -> None:
    """The machine's memory bandwidth and load once the run is over, beside those before."""
    from specbench.concurrency import measure_bandwidth

    machine["memory_read_gb_per_s_end"] = round(measure_bandwidth() / 1e9, 2)
    machine["load_average_1m_end"] = os.getloadavg()[0]


def add_peer_arguments(parser: argparse.ArgumentParser) -> None:
    """``--llama-server`` and ``--target``, as every peer benchmark takes them."""
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", "llama-server"),
                        help="llama.cpp's llama-server binary (default $LLAMA_SERVER, else "
                             "llama-server on PATH)")
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"a catalogue name or a GGUF file (default {DEFAULT_TARGET})")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specbench.peer_run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_peer_arguments(parser)
    parser.add_argument("--draft", default=DEFAULT_DRAFT,
                        help=f"the draft model, same tokenizer: a catalogue name, a GGUF file, "
                             f"or none (default {DEFAULT_DRAFT})")
    parser.add_argument("--servers", default=",".join(SERVERS),
                        help=f"comma-separated, of {', '.join(SERVERS)} (default all)")
    parser.add_argument("--extra", action="append", default=[], metavar="NAME=ARGS",
                        help="more arguments for one server's command line (repeatable)")
    parser.add_argument("--prompt-sets", default=DEFAULT_SETS,
                        help=f"comma-separated shipped sets or prompt files (default "
                             f"{DEFAULT_SETS})")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per set (default all)")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_NEW,
                        help=f"max_tokens per request (default {DEFAULT_MAX_NEW}; the peer "
                             f"benchmark alone takes {DEFAULT_MAX_TOKENS})")
    parser.add_argument("--threads", type=int, default=THREADS,
                        help=f"threads of every server (default {THREADS})")
    parser.add_argument("--context", type=int, default=CONTEXT,
                        help=f"llama-server's context, -c (default {CONTEXT})")
    parser.add_argument("--base-port", type=int, default=BASE_PORT,
                        help=f"the first port (default {BASE_PORT}); "
                             f"{len(SERVERS) + 3} ports from it may be used")
    parser.add_argument("--start-timeout", type=float, default=START_TIMEOUT_S,
                        help=f"seconds a server may take to load (default {START_TIMEOUT_S:.0f})")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="each server alone over every prompt (server-major), for a "
                             "machine without memory for all of them")
    parser.add_argument("--json", default=DEFAULT_JSON,
                        help=f"write the results here, the servers' logs beside it (default "
                             f"{DEFAULT_JSON})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per readiness poll
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
