"""Busy-loop processes beside a command, as a loaded CI machine has them: the suite, or a
few named tests run again and again, must pass with the cores contended.

    python -m tests.busy --loops 2 -- pytest -q                    (make test-stress)
    python -m tests.busy --loops 2 --repeat 10 -- pytest -q tests/test_prefix_cache.py

Each run's exit status and wall time are printed as a table, and written as JSON with
``--json``; the exit status is the first failing run's, else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

# a loop that never sleeps, at the scheduler's normal priority
LOOP = "while True:\n    pass\n"


@contextmanager
def busy_loops(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` processes that each keep a core busy until the block ends."""
    loops = [subprocess.Popen([sys.executable, "-c", LOOP], stdin=subprocess.DEVNULL)
             for _ in range(count)]
    try:
        yield loops
    finally:
        for loop in loops:
            loop.kill()
        for loop in loops:
            loop.wait()


def run(command: Sequence[str], loops: int, repeat: int) -> list[dict[str, float | int]]:
    runs: list[dict[str, float | int]] = []
    with busy_loops(loops):
        for i in range(repeat):
            began = time.monotonic()
            # its own process group, so that an interrupted run takes its children with it
            process = subprocess.Popen(command, start_new_session=True)
            try:
                code = process.wait()
            except KeyboardInterrupt:
                os.killpg(process.pid, signal.SIGTERM)
                raise
            runs.append({"run": i + 1, "exit": code,
                         "seconds": round(time.monotonic() - began, 1)})
            print(f"[busy x{loops}] run {i + 1}/{repeat}: exit {code}, "
                  f"{runs[-1]['seconds']} s", flush=True)
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", type=int, default=2, help="busy-loop processes beside")
    parser.add_argument("--repeat", type=int, default=1, help="runs of the command, in a row")
    parser.add_argument("--json", type=Path)
    parser.add_argument("command", nargs="+", help="the command (after --)")
    args = parser.parse_args()
    runs = run(args.command, args.loops, args.repeat)
    print(f"| run | exit | seconds |  ({args.loops} busy loops beside: "
          f"{' '.join(args.command)})\n|---:|---:|---:|")
    for r in runs:
        print(f"| {r['run']} | {r['exit']} | {r['seconds']} |")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"loops": args.loops, "command": args.command,
                                         "runs": runs}, indent=1) + "\n")
    return next((int(r["exit"]) for r in runs if r["exit"] != 0), 0)


if __name__ == "__main__":
    sys.exit(main())
