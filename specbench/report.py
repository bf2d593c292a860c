"""What ``specserve bench`` reports: one summary per run, a table, the machine.

A run is one (prompt set, method, dtype). Its throughput is total generated
tokens over total seconds across the set's prompts; its round statistics
count only the rounds after the prefill round.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import torch
import transformers

from runtime.native import kernels
from specbench.methods import PLAIN, Generation

MS = 1000.0


def summarise(
    prompt_set: str,
    method: str,
    dtype: str,
    prompt_ids: Sequence[str],
    generations: Sequence[Generation],
    reference: Sequence[Generation] | None,
) -> dict[str, Any]:
    """One run's JSON record; ``reference`` is our plain run of the same set and dtype."""
    tokens = sum(len(g.token_ids) for g in generations)
    seconds = sum(g.seconds for g in generations)
    identical = _identical(generations, reference)
    per_prompt = [
        {"id": pid, "tokens": len(g.token_ids), "seconds": round(g.seconds, 4),
         "tokens_per_s": round(_rate(g), 2), "identical_to_plain": same}
        for pid, g, same in zip(prompt_ids, generations, identical, strict=True)
    ]
    record: dict[str, Any] = {
        "prompt_set": prompt_set,
        "method": method,
        "dtype": dtype,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "tokens": tokens,
        "seconds": seconds,
        "median_prompt_tokens_per_s": statistics.median(_rate(g) for g in generations)
        if generations else 0.0,
        "identical_to_plain": None if None in identical else all(identical),
        "identical_prompts": sum(1 for same in identical if same),
        "prompts": len(generations),
    }
    record.update(_round_stats(generations))
    record["per_prompt"] = per_prompt
    return record


def _rate(generation: Generation) -> float:
    return len(generation.token_ids) / generation.seconds if generation.seconds > 0 else 0.0


def _identical(
    generations: Sequence[Generation], reference: Sequence[Generation] | None
) -> list[bool | None]:
    if reference is None:
        return [None for _ in generations]
    return [g.token_ids == r.token_ids for g, r in zip(generations, reference, strict=True)]


def _round_stats(generations: Sequence[Generation]) -> dict[str, Any]:
    """Acceptance and per-round time split; None where the method reports no rounds."""
    keys = ("acceptance_rate", "mean_acceptance_length", "draft_ms_per_round",
            "verify_ms_per_round", "bookkeeping_ms_per_round", "prefill_ms_per_prompt", "rounds",
            "draft_rounds")
    if not generations or not all(g.has_rounds for g in generations):
        return dict.fromkeys(keys)
    rounds = sum(g.rounds for g in generations)
    drafted = sum(g.drafted for g in generations)
    per_round = MS / rounds if rounds else 0.0
    return {
        "acceptance_rate": sum(g.accepted for g in generations) / drafted if drafted else None,
        "mean_acceptance_length": sum(g.committed for g in generations) / rounds
        if rounds else None,
        "draft_ms_per_round": sum(g.draft_s for g in generations) * per_round,
        "verify_ms_per_round": sum(g.verify_s for g in generations) * per_round,
        "bookkeeping_ms_per_round": sum(g.bookkeeping_s for g in generations) * per_round,
        "prefill_ms_per_prompt": sum(g.prefill_s for g in generations) * MS / len(generations),
        "rounds": rounds,
        "draft_rounds": sum(g.draft_rounds for g in generations),
    }


def speedups(runs: Sequence[dict[str, Any]]) -> list[float | None]:
    """Each run's tokens/s over our plain run's, same prompt set and dtype."""
    plain = {(r["prompt_set"], r["dtype"]): r["tokens_per_s"] for r in runs
             if r["method"] == PLAIN}
    result: list[float | None] = []
    for run in runs:
        base = plain.get((run["prompt_set"], run["dtype"]))
        result.append(run["tokens_per_s"] / base if base else None)
    return result


COLUMNS = (
    ("prompt_set", "set", "<"), ("method", "method", "<"), ("dtype", "dtype", "<"),
    ("tokens_per_s", "tok/s", ">"), ("speedup", "speed-up", ">"),
    ("acceptance_rate", "accept", ">"), ("mean_acceptance_length", "acc.len", ">"),
    ("identical", "identical", "<"), ("draft_ms_per_round", "draft ms", ">"),
    ("verify_ms_per_round", "verify ms", ">"), ("bookkeeping_ms_per_round", "book ms", ">"),
    ("rounds", "rounds", ">"), ("tokens", "tokens", ">"),
)


def format_table(runs: Sequence[dict[str, Any]]) -> str:
    """A fixed-width text table of the runs, one row each."""
    rows = [[_cell(key, run, speedup) for key, _, _ in COLUMNS]
            for run, speedup in zip(runs, speedups(runs), strict=True)]
    header = [title for _, title, _ in COLUMNS]
    widths = [max(len(c) for c in column) for column in zip(header, *rows, strict=True)]
    lines = [_line(header, widths), _line(["-" * w for w in widths], widths)]
    lines.extend(_line(row, widths) for row in rows)
    return "\n".join(lines) + "\n"


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    parts = [f"{c:{align}{w}}" for c, w, (_, _, align) in zip(cells, widths, COLUMNS, strict=True)]
    return "  ".join(parts).rstrip()


def _cell(key: str, run: dict[str, Any], speedup: float | None) -> str:
    if key == "speedup":
        return "-" if speedup is None else f"{speedup:.2f}x"
    if key == "identical":
        return _identical_cell(run)
    value = run.get(key)
    if value is None:
        return "-"
    if key == "acceptance_rate":
        return f"{value:.0%}"
    if isinstance(value, float):
        return f"{value:.2f}" if key == "mean_acceptance_length" or key.endswith("_ms_per_round") \
            else f"{value:.1f}"
    return str(value)


def _identical_cell(run: dict[str, Any]) -> str:
    if run["identical_to_plain"] is None:
        return "-"
    same, total = run["identical_prompts"], run["prompts"]
    return "yes" if same == total else f"no ({same}/{total})"


def write_table(runs: Sequence[dict[str, Any]], stream: TextIO) -> None:
    """The command's output: the table, on ``stream``."""
    stream.write(format_table(runs))
    stream.flush()


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        "cpu": kernels.cpu_name(),
        "logical_cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "load_average_1m_start": load_average(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.is_available(),
    }


def load_average() -> float | None:
    """The 1-minute load average, where the platform has one."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None
