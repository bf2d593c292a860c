"""``python -m specbench.codex_task``: OpenAI's Codex CLI does a small coding task end to end
against a ``specserve serve`` this command starts, and a table of what the server did on
each of Codex's turns.

    python -m specbench.codex_task --json bench-results/codex-task.json

The server serves ``--target`` (Qwen2.5-Coder-1.5B-Instruct by default) with its own
defaults, the model's sampling values included (Codex's config sets none), and logs one
JSON line per request. Codex (the pinned ``@openai/codex`` of tests/codex, ``make
node-deps``) runs ``codex exec`` in an empty temporary folder with the workspace-write
sandbox and no approvals, so it may write files and run commands there, on the task of
``TASK``. Then the folder is checked: ``fizz.py`` and ``test_fizz.py`` exist and ``python -m
pytest -q`` passes there. Each /v1/responses request of the server's log is one row:
prompt tokens, how many of them came from the prefix cache, time to first token, decode
tokens/s (the tokens after the first over the time after the first), output tokens and
finish reason. With ``--keep DIR`` the server's log, Codex's events and its folder stay in
DIR, and Codex talks to the server through a recorder that writes each request's body and
the stream that answered it (``exchanges/``), so what the model wrote can be read turn by
turn. The server is stopped however the command ends; the exit status is 0 when Codex
exited 0 and the checks passed.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
CODEX = REPO / "tests" / "codex" / "node_modules" / ".bin" / "codex"
TARGET = "qwen2.5-coder-1.5b"
TASK = ("Create fizz.py with a function fizzbuzz(n) that returns the list of strings for "
        "1..n: \"Fizz\" for multiples of 3, \"Buzz\" for multiples of 5, \"FizzBuzz\" for "
        "multiples of both, else the number itself. Create test_fizz.py with a pytest test "
        "for it. Then run the test with `python -m pytest -q`.")
FILES = ("fizz.py", "test_fizz.py")
START_TIMEOUT_S = 900.0
CODEX_TIMEOUT_S = 3600.0
CONFIG = """\
model = "{model}"
model_provider = "specserve"
approval_policy = "never"
sandbox_mode = "workspace-write"

[model_providers.specserve]
name = "specserve"
base_url = "{url}/v1"
wire_api = "responses"
"""


@dataclass(frozen=True)
class Turn:
    """One /v1/responses request as the server logged it."""

    turn: int
    status: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float | None
    decode_tokens_per_s: float | None
    output_tokens: int
    finish: str
    latency_s: float


@dataclass(frozen=True)
class Outcome:
    codex_exit: int | None  # None: killed after CODEX_TIMEOUT_S
    files: dict[str, bool]
    pytest_exit: int | None
    pytest_output: str
    turns: list[Turn]
    items: list[str]  # what Codex did, item by item (its --json events)
    errors: list[str]  # Codex's error events

    @property
    def passed(self) -> bool:
        return self.codex_exit == 0 and all(self.files.values()) and self.pytest_exit == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, server: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while server.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/ready did not answer 200 within {timeout:.0f} s")
        time.sleep(1.0)
    raise RuntimeError(f"the server exited with {server.returncode}")


def turns(log_lines: list[str]) -> list[Turn]:
    """The /v1/responses requests of the server's JSON log, in the order they finished."""
    rows: list[Turn] = []
    for line in log_lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("message") != "request finished" or \
                record.get("endpoint") != "/v1/responses":
            continue
        ttft, latency = record.get("ttft_s"), float(record["latency_s"])
        out = int(record.get("completion_tokens") or 0)
        decode = None
        if ttft is not None and out > 1 and latency > ttft:
            decode = round((out - 1) / (latency - ttft), 2)
        rows.append(Turn(
            turn=len(rows) + 1, status=int(record["status"]),
            prompt_tokens=int(record.get("prompt_tokens") or 0),
            cached_tokens=int(record.get("cached_tokens") or 0), ttft_s=ttft,
            decode_tokens_per_s=decode, output_tokens=out,
            finish=",".join(record.get("finish_reasons") or []) or
            str(record.get("error_type") or "-"),
            latency_s=latency))
    return rows


def table(rows: list[Turn]) -> str:
    head = ("turn", "prompt tokens", "cached tokens", "TTFT s", "decode tok/s",
            "output tokens", "finish")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = (r.turn, r.prompt_tokens, r.cached_tokens,
                 "-" if r.ttft_s is None else f"{r.ttft_s:.1f}",
                 "-" if r.decode_tokens_per_s is None else f"{r.decode_tokens_per_s:.1f}",
                 r.output_tokens, r.finish)
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def describe(event: dict[str, Any]) -> str | None:
    """A line for one of Codex's completed items."""
    if event.get("type") != "item.completed":
        return None
    item = event["item"]
    kind = item.get("type")
    if kind == "command_execution":
        return f"command: {item.get('command')!r} -> exit {item.get('exit_code')}"
    if kind == "file_change":
        return "file_change: " + ", ".join(
            f"{c.get('kind')} {c.get('path')}" for c in item.get("changes", []))
    if kind == "agent_message":
        return f"message: {str(item.get('text'))[:300]!r}"
    return f"{kind}: {json.dumps(item)[:300]}"


@contextmanager
def recorder(upstream: str, folder: Path) -> Iterator[str]:
    """A loopback proxy to ``upstream`` that writes every request's body and the bytes
    that answered it into ``folder`` (``001-request.json``, ``001-response.txt``, ...)."""
    folder.mkdir(parents=True, exist_ok=True)
    host, port = upstream.removeprefix("http://").split(":")
    count = iter(range(1, 1 << 30))
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.forward(b"")

        def do_POST(self) -> None:
            self.forward(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

        def forward(self, body: bytes) -> None:
            with lock:
                n = next(count)
            (folder / f"{n:03d}-request.json").write_bytes(body)
            headers = {k: v for k, v in self.headers.items()
                       if k.lower() not in ("host", "connection", "accept-encoding")}
            conn = http.client.HTTPConnection(host, int(port), timeout=3600)
            conn.request(self.command, self.path, body=body or None, headers=headers)
            reply = conn.getresponse()
            self.send_response(reply.status)
            for k, v in reply.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(k, v)
            self.send_header("Connection", "close")
            self.end_headers()
            with (folder / f"{n:03d}-response.txt").open("wb") as out:
                while piece := reply.read1(65536):
                    out.write(piece)
                    out.flush()
                    self.wfile.write(piece)
                    self.wfile.flush()
            conn.close()
            self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def run_codex(url: str, model: str, home: Path, work: Path, codex_log: IO[str]) -> tuple[
        int | None, list[str], list[str]]:
    (home / "config.toml").write_text(CONFIG.format(model=model, url=url))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    command = [str(CODEX), "exec", "--skip-git-repo-check", "--ephemeral", "--json",
               "--sandbox", "workspace-write", "--cd", str(work), TASK]
    codex = subprocess.Popen(command, cwd=work, env={**env, "CODEX_HOME": str(home)},
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=codex_log, text=True, start_new_session=True)
    items: list[str] = []
    errors: list[str] = []
    deadline = time.monotonic() + CODEX_TIMEOUT_S
    try:
        assert codex.stdout is not None
        for line in codex.stdout:
            codex_log.write(line)
            codex_log.flush()
            if not line.startswith("{"):
                continue
            event = json.loads(line)
            if event.get("type") in ("error", "turn.failed"):
                errors.append(json.dumps(event)[:1000])
            said = describe(event)
            if said:
                items.append(said)
                print(f"codex {said}", flush=True)
            if time.monotonic() > deadline:
                break
        codex.wait(timeout=max(1.0, deadline - time.monotonic()))
        return codex.returncode, items, errors
    except subprocess.TimeoutExpired:
        return None, items, errors
    finally:
        if codex.poll() is None:
            os.killpg(codex.pid, signal.SIGTERM)
            codex.wait()


def check(work: Path) -> tuple[dict[str, bool], int | None, str]:
    files = {name: (work / name).is_file() for name in FILES}
    if not all(files.values()):
        return files, None, ""
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
                         cwd=work, capture_output=True, text=True, timeout=300)
    return files, run.returncode, (run.stdout + run.stderr)[-3000:]


def run_task(target: str, threads: int | None, log_dir: Path, record: bool = False
             ) -> Outcome:
    """Start the server, let Codex work, check its folder; the server is stopped at the
    end however it comes."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server_log = (log_dir / "server.log").open("w+")
    command = [str(Path(sys.executable).with_name("specserve")), "serve", "--target", target,
               "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(free_port()),
               "--log-format", "json"]
    if threads:
        command += ["--threads", str(threads)]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SPECSERVE_") or k == "SPECSERVE_HOME"}
    print(f"starting {' '.join(command)}", flush=True)
    server = subprocess.Popen(command, env=env, stdout=server_log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        wait_ready(url, server, START_TIMEOUT_S)
        print(f"ready at {url}; Codex works in {log_dir / 'work'}", flush=True)
        home, work = log_dir / "codex-home", log_dir / "work"
        home.mkdir()
        work.mkdir()
        with (log_dir / "codex.jsonl").open("w") as codex_log, ExitStack() as stack:
            codex_url = url if not record else stack.enter_context(
                recorder(url, log_dir / "exchanges"))
            status, items, errors = run_codex(codex_url, target, home, work, codex_log)
        files, pytest_exit, pytest_output = check(work)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        server_log.flush()
    server_log.seek(0)
    return Outcome(status, files, pytest_exit, pytest_output,
                   turns(server_log.read().splitlines()), items, errors)


def machine() -> dict[str, Any]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                  if line.startswith("Model name")), "")
    return {"cpu": model, "cores": os.cpu_count(), "load_average": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=TARGET, help="the model to serve (default %(default)s)")
    parser.add_argument("--threads", type=int, help="the server's --threads (default: its own)")
    parser.add_argument("--json", type=Path, help="write the outcome and the table here")
    parser.add_argument("--keep", type=Path,
                        help="a folder for the server's log, Codex's events and its work "
                        "(default: a temporary folder, removed at the end)")
    args = parser.parse_args(argv)
    if not CODEX.exists():
        parser.error(f"Codex CLI is not installed: run `make node-deps` (npm ci in {CODEX.parent})")

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    before = machine()
    log_dir = args.keep or Path(tempfile.mkdtemp(prefix="codex-task-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        started = time.monotonic()
        outcome = run_task(args.target, args.threads, log_dir, record=args.keep is not None)
        elapsed = time.monotonic() - started
    finally:
        if args.keep is None:
            shutil.rmtree(log_dir, ignore_errors=True)
    print(table(outcome.turns))
    print(f"codex exit {outcome.codex_exit}; files {outcome.files}; "
          f"pytest exit {outcome.pytest_exit}; {elapsed:.0f} s")
    if outcome.pytest_output:
        print(outcome.pytest_output)
    for error in outcome.errors:
        print(f"codex error: {error}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "target": args.target, "task": TASK, "machine": before,
            "load_average_after": os.getloadavg(), "seconds": round(elapsed, 1),
            "passed": outcome.passed, **asdict(outcome)}, indent=2) + "\n")
    return 0 if outcome.passed else 1


if __name__ == "__main__":
    sys.exit(main())
