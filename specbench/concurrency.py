"""``specserve bench --concurrency 1,4,8,16``: throughput and latency under load.

For each dtype, prompt set, number of concurrent streams N and speculation mode,
N client threads each send requests (greedy, the shipped prompts in turn) to one
in-process engine and consume the streamed events; requests start together and
each thread sends its next request when the last one ends. Measured per run:
aggregate generated tokens per second over the run's wall time, each stream's
inter-token latency (time from its first to its last token over the tokens in
between), time to first token, and how many outputs equal the same prompt's
output with speculation off (greedy: they must all be equal in float32).

Modes: ``off`` (no drafter), ``on`` (every sequence drafts as its own policy
says, whatever the batch size) and ``adaptive`` (draft lengths chosen for the
batch by expected goodput, down to none for large batches). All modes of one
(dtype, set, N) run back to back, so they see the same machine load.

The report also places one target step against the machine's memory bandwidth:
a decoding step has to read every weight once, so weights bytes / bandwidth is
the floor of a one-token step.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from decoding.drafter import Drafter
from decoding.engine import Engine
from decoding.prompting import encode_chat
from decoding.types import GenerationRequest, SamplingParams, SpeculationParams
from runtime.loaders.loading import load_target
from runtime.models.causal_model import CausalModel
from runtime.models.checkpoints import DTYPES
from runtime.runner.causal_lm import CausalLM
from specbench.plots import write_plots
from specbench.report import load_average, machine_info
from wiring.drafts import NGRAM, load_drafter

log = logging.getLogger(__name__)

MODES = ("off", "on", "adaptive")
DEFAULT_CONCURRENCY = (1, 4, 8, 16)
MAX_TOKENS = 128
MIN_REQUESTS = 4  # per run, so one stream's run is not a single request
REQUESTS_PER_STREAM = 2
BANDWIDTH_BYTES = 1 << 29  # the buffer read to measure memory bandwidth
MS = 1000.0


@dataclass
class _Result:
    prompt_index: int
    tokens: list[int] = field(default_factory=list)
    submitted: float = 0.0
    first: float | None = None
    last: float = 0.0
    drafted: int = 0
    accepted: int = 0


def parse_concurrency(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(",") if v.strip())
    if not values or min(values) < 1:
        raise ValueError(f"--concurrency takes positive integers, got {text!r}")
    return values


def run_concurrency_bench(args: argparse.Namespace) -> int:
    from specbench.compare import load_prompts

    log.setLevel(logging.INFO)
    try:
        levels = parse_concurrency(args.concurrency)
        modes = tuple(m.strip() for m in (args.modes or ",".join(MODES)).split(",") if m.strip())
        unknown = [m for m in modes if m not in MODES]
        dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
        if unknown or [d for d in dtypes if d not in DTYPES]:
            raise ValueError(f"choose modes from {list(MODES)} and dtypes from {sorted(DTYPES)}")
        sets = [s.strip() for s in args.prompt_sets.split(",") if s.strip()]
        prompt_sets = {name: load_prompts(name, args.prompts) for name in sets}
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    max_tokens = args.max_tokens or MAX_TOKENS
    draft = args.draft or NGRAM
    machine = machine_info()
    bandwidth = measure_bandwidth()
    machine["memory_read_gb_per_s"] = round(bandwidth / 1e9, 2)
    runs: list[dict[str, Any]] = []
    floors: list[dict[str, Any]] = []
    for dtype in dtypes:
        target = load_target(args.target, dtype)
        drafter = load_drafter(draft, target, dtype,
                               draft_dtype=getattr(args, "draft_dtype", "auto"))
        floors.append(step_floor(target, bandwidth, dtype))
        for name, prompts in prompt_sets.items():
            encoded = [encode_chat(target.tokenizer, p.messages) for p in prompts]
            reference: dict[int, list[int]] = {}
            for n in levels:
                for mode in modes:
                    run = _run(target, drafter, encoded, n, mode, max_tokens, reference)
                    run.update(dtype=dtype, prompt_set=name)
                    runs.append(run)
                    log.info("%s %s N=%-2d %-8s %6.1f tok/s, %5.1f ms/token per stream",
                             dtype, name, n, mode, run["tokens_per_s"], run["itl_ms_mean"])
        del target, drafter
        gc.collect()
    machine["load_average_1m_end"] = load_average()
    report = {"machine": machine, "config": {
        "concurrency": levels, "modes": modes, "dtypes": dtypes, "prompt_sets": sets,
        "max_new_tokens": max_tokens, "draft": draft, "greedy": True,
        "requests_per_run": f"max({MIN_REQUESTS}, {REQUESTS_PER_STREAM} x N)"},
        "step_floor": floors, "runs": runs}
    write_concurrency_table(report, sys.stdout)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        log.info("wrote %s", path)
        write_plots("concurrency", report, path)
    return 0


def _run(target: CausalLM, drafter: Drafter | None, prompts: Sequence[Sequence[int]], n: int,
         mode: str, max_tokens: int, reference: dict[int, list[int]]) -> dict[str, Any]:
    drafters = {NGRAM: drafter} if drafter is not None and mode != "off" else {}
    engine = Engine(target, drafters, default_drafter=NGRAM if drafters else None,
                    max_active=n, max_queue=max(64, 4 * n), batch_planning=mode == "adaptive")
    engine.start()
    try:
        _warm(engine, prompts[0])
        per_stream = max(REQUESTS_PER_STREAM, -(-MIN_REQUESTS // n))
        results: list[_Result] = []
        lock = threading.Lock()
        counter = iter(range(n * per_stream))

        def client() -> None:
            while True:
                with lock:
                    index = next(counter, None)
                if index is None:
                    return
                result = _one(engine, prompts, index % len(prompts), max_tokens, mode)
                with lock:
                    results.append(result)

        start = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - start
        passes = engine.forward_passes
        fixed, per_token = engine.scheduler.step_cost.line()
    finally:
        engine.shutdown()
    return _summary(results, wall, n, mode, reference, passes, fixed, per_token)


def _warm(engine: Engine, prompt: Sequence[int]) -> None:
    request = GenerationRequest(prompt_ids=tuple(prompt), max_new_tokens=8,
                                sampling=SamplingParams(temperature=0.0))
    for _ in engine.submit(request):
        pass


def _one(engine: Engine, prompts: Sequence[Sequence[int]], index: int, max_tokens: int,
         mode: str) -> _Result:
    result = _Result(prompt_index=index, submitted=time.perf_counter())
    request = GenerationRequest(
        prompt_ids=tuple(prompts[index]), max_new_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0), request_id=f"bench-{index}",
        speculation=SpeculationParams(enabled=mode != "off"))
    for event in engine.submit(request):
        now = time.perf_counter()
        if event.token_ids:
            if result.first is None:
                result.first = now
            result.last = now
            result.tokens.extend(event.token_ids)
        result.drafted += event.draft_tokens
        result.accepted += event.accepted_tokens
    return result


def _summary(results: list[_Result], wall: float, n: int, mode: str,
             reference: dict[int, list[int]], passes: int, fixed: float,
             per_token: float) -> dict[str, Any]:
    tokens = sum(len(r.tokens) for r in results)
    itl = [(r.last - r.first) / (len(r.tokens) - 1) for r in results
           if r.first is not None and len(r.tokens) > 1]
    ttft = [r.first - r.submitted for r in results if r.first is not None]
    identical = 0
    for r in results:
        if mode == "off":
            reference.setdefault(r.prompt_index, r.tokens)
        identical += reference.get(r.prompt_index) == r.tokens
    drafted = sum(r.drafted for r in results)
    accepted = sum(r.accepted for r in results)
    return {
        "concurrency": n, "mode": mode, "requests": len(results), "tokens": tokens,
        "seconds": round(wall, 3), "tokens_per_s": round(tokens / wall, 2),
        "itl_ms_mean": round(statistics.fmean(itl) * MS, 2) if itl else None,
        "itl_ms_p90": round(_quantile(itl, 0.9) * MS, 2) if itl else None,
        "ttft_ms_mean": round(statistics.fmean(ttft) * MS, 1) if ttft else None,
        "drafted": drafted, "accepted": accepted,
        "acceptance": round(accepted / drafted, 3) if drafted else None,
        "forward_passes": passes,
        "identical_to_off": f"{identical}/{len(results)}",
        "step_cost_fit_ms": {"fixed": round(fixed * MS, 2), "per_token": round(per_token * MS, 3)},
    }


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure_bandwidth(repeats: int = 7) -> float:
    """Bytes per second this process reads from memory (best of ``repeats`` sums over a
    buffer far larger than the caches), with PyTorch's current thread count."""
    buffer = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)
    buffer.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return BANDWIDTH_BYTES / best


def weight_bytes(model: CausalModel) -> int:
    """Bytes of the weights one decoding step reads (a tied matrix counts once)."""
    seen: set[int] = set()
    total = 0
    for parameter in model.parameters():
        if parameter.data_ptr() in seen:
            continue
        seen.add(parameter.data_ptr())
        total += parameter.numel() * parameter.element_size()
    return total


@torch.inference_mode()
def step_floor(target: CausalLM, bandwidth: float, dtype: str, steps: int = 20) -> dict[str, Any]:
    """A one-token decoding step's time (median of ``steps`` after a 256-token
    prompt) against weights bytes / memory bandwidth."""
    state = target.new_state()
    target.prefill(state, list(range(1000, 1256)))
    times = []
    for _ in range(steps + 3):
        start = time.perf_counter()
        target.score(state, [1234])
        times.append(time.perf_counter() - start)
        target.rollback(state, 256)
    target.release(state)
    step = statistics.median(times[3:])
    size = weight_bytes(target.model)
    floor = size / bandwidth
    return {"dtype": dtype, "weights_mb": round(size / 1e6, 1), "step_ms": round(step * MS, 2),
            "floor_ms": round(floor * MS, 2), "step_over_floor": round(step / floor, 2)}


def write_concurrency_table(report: dict[str, Any], out: TextIO) -> None:
    bandwidth = report["machine"]["memory_read_gb_per_s"]
    out.write(f"memory read bandwidth: {bandwidth} GB/s\n")
    for floor in report["step_floor"]:
        out.write(f"{floor['dtype']}: weights {floor['weights_mb']} MB, one-token step "
                  f"{floor['step_ms']} ms, floor {floor['floor_ms']} ms "
                  f"({floor['step_over_floor']}x the floor)\n")
    header = ("dtype", "set", "N", "mode", "tok/s", "x N=1", "ITL ms", "ITL p90", "TTFT ms",
              "accept", "passes", "same")
    rows = []
    base: dict[tuple[str, str, str], float] = {}
    for run in report["runs"]:
        key = (run["dtype"], run["prompt_set"], run["mode"])
        if run["concurrency"] == min(report["config"]["concurrency"]):
            base.setdefault(key, run["tokens_per_s"])
        scale = run["tokens_per_s"] / base[key] if base.get(key) else float("nan")
        rows.append((run["dtype"], run["prompt_set"], str(run["concurrency"]), run["mode"],
                     f"{run['tokens_per_s']:.1f}", f"{scale:.2f}", _fmt(run["itl_ms_mean"]),
                     _fmt(run["itl_ms_p90"]), _fmt(run["ttft_ms_mean"]),
                     _fmt(run["acceptance"], 2), str(run["forward_passes"]),
                     run["identical_to_off"]))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    out.write("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + "\n")
    for row in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + "\n")


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
