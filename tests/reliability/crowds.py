"""Crowd after crowd of clients that leave mid-stream, against one ``specserve serve``
process on the tiny model, with its settled RSS read after each crowd: whether what the
disconnect test bounds (tests/reliability/test_disconnects.py) levels off or climbs.

    python -m tests.reliability.crowds --crowds 8 --json docs/figures/crowds-quiet.json
    python -m tests.reliability.crowds --crowds 8 --busy 2 --json docs/figures/crowds-busy.json

``--busy N`` runs N busy-loop processes beside the server for the whole run, as a loaded
CI machine would. Each crowd is the test's own (100 clients by default, 24 at a time,
leaving before the headers, after them, after some events, or while waiting for a whole
response, with six streams that stay to the end and must come out right).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from runtime.files import model_store
from specbench.report import machine_info
from tests.busy import busy_loops
from tests.conftest import _tiny_model
from tests.reliability.support import MIB, settled_rss
from tests.reliability.test_disconnects import crowd_once, reference, serve_for_crowds


def run(crowds: int, clients: int, busy: int, seed: int = 7) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch, busy_loops(busy):
        model = _tiny_model(Path(scratch) / "tiny", Path(model_store.resolve("default")),
                            seed=0)
        with serve_for_crowds(model) as server:
            expected = reference(server.url)
            idle = settled_rss(server)
            rows = []
            for i in range(crowds):
                began = time.monotonic()
                settled, peak, idle_after, _ = crowd_once(server, clients, seed + i, expected)
                rows.append({"crowd": i + 1, "settled_mib": round(settled / MIB, 1),
                             "peak_mib": round(peak / MIB, 1),
                             "seconds": round(time.monotonic() - began, 1),
                             "idle_after_s": round(idle_after, 2)})
                print(f"crowd {i + 1:2d}: settled {settled / MIB:7.1f} MiB, peak "
                      f"{peak / MIB:7.1f} MiB, {rows[-1]['seconds']:6.1f} s", flush=True)
            server.assert_clean_log()
    return {"clients": clients, "crowds": crowds, "busy_loops": busy,
            "machine": machine_info(),
            "idle_mib": round(idle / MIB, 1), "rows": rows}


def table(report: dict[str, Any]) -> str:
    idle = report["idle_mib"]
    first = report["rows"][0]["settled_mib"]
    lines = [f"{report['clients']} clients a crowd, {report['busy_loops']} busy loops beside; "
             f"idle server {idle} MiB",
             "| crowd | settled MiB | over idle | over crowd 1 | peak MiB | s |",
             "|---:|---:|---:|---:|---:|---:|"]
    for row in report["rows"]:
        lines.append(f"| {row['crowd']} | {row['settled_mib']} | "
                     f"{row['settled_mib'] - idle:+.1f} | {row['settled_mib'] - first:+.1f} | "
                     f"{row['peak_mib']} | {row['seconds']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crowds", type=int, default=8)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--busy", type=int, default=0, help="busy-loop processes beside")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report = run(args.crowds, args.clients, args.busy)
    print(table(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
