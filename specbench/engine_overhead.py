"""What the engine adds per token at one stream: the same greedy requests decoded by
``decode()`` in the calling thread, by the engine's model thread, and the bare
one-token target step, interleaved (machine noise hits all alike).

    python -m specbench.engine_overhead --json bench-results/engine-overhead.json

Each trial is one prompt measured once by each path, in an order that rotates from
trial to trial; a trial's ratios pair its own paths, so noise that moves a whole trial
cancels. Prints a table (ms per token: median inter-token time after the first token;
the ratios: medians over trials, with their range) and writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from decoding.drafter import Drafter
from decoding.engine import Engine
from decoding.prompting import encode_chat
from decoding.round import decode
from decoding.target import Target
from decoding.types import GenerationRequest, RoundEvent, SamplingParams, SpeculationParams
from runtime.loaders.loading import load_target
from runtime.runner.passes import BatchItem
from specbench.compare import load_prompts
from wiring.drafts import load_drafter

MS = 1000.0
PATHS = ("step", "decode", "engine")


def _gaps(events: Iterable[RoundEvent]) -> list[float]:
    """Seconds between the rounds that committed tokens, per token, after the first."""
    stamps: list[tuple[float, int]] = []
    for event in events:
        if event.token_ids:
            stamps.append((time.perf_counter(), len(event.token_ids)))
    return [(b - a) / n for (a, _), (b, n) in itertools.pairwise(stamps)]


def _step_ms(target: Target, prompt: Sequence[int], steps: int) -> float:
    """Median one-token step after ``prompt``, the target's forward alone."""
    state = target.new_state()
    try:
        target.forward_batch([BatchItem(state, list(prompt), 1)])
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            target.forward_batch([BatchItem(state, [prompt[-1]], 1)])
            times.append(time.perf_counter() - start)
        return statistics.median(times) * MS
    finally:
        target.release(state)


def _measure(path: str, target: Target, drafter: Drafter | None, engine: Engine,
             request: GenerationRequest) -> float:
    """One path's ms per token on ``request``."""
    if path == "step":
        return _step_ms(target, request.prompt_ids, 16)
    events = decode(target, drafter, request) if path == "decode" else engine.submit(request)
    return statistics.median(_gaps(events)) * MS


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, args.dtype, quantize=args.quantize)
    drafter = load_drafter(args.draft, target) if args.draft != "none" else None
    engine = Engine(target, {"d": drafter} if drafter else {}, "d" if drafter else None)
    engine.warmup()
    engine.start()
    trials: list[dict[str, float]] = []
    try:
        prompts = load_prompts(args.prompt_set, args.prompts)
        for trial, prompt in enumerate(p for p in prompts for _ in range(args.repeats)):
            ids = tuple(encode_chat(target.tokenizer, prompt.messages))
            request = GenerationRequest(
                prompt_ids=ids, max_new_tokens=args.max_tokens,
                sampling=SamplingParams(temperature=0.0),
                speculation=SpeculationParams(enabled=drafter is not None))
            order = PATHS[trial % 3:] + PATHS[:trial % 3]
            trials.append({path: _measure(path, target, drafter, engine, request)
                           for path in order})
    finally:
        engine.shutdown()
    ms = {name: round(statistics.median(t[name] for t in trials), 3) for name in PATHS}
    ratios = {}
    for over, under in (("engine", "step"), ("decode", "step"), ("engine", "decode")):
        values = sorted(t[over] / t[under] for t in trials)
        ratios[f"{over}_over_{under}"] = {"median": round(statistics.median(values), 3),
                                          "min": round(values[0], 3),
                                          "max": round(values[-1], 3)}
    return {"target": args.target, "dtype": args.dtype, "quantize": args.quantize,
            "draft": args.draft, "threads": torch.get_num_threads(),
            "prompts": args.prompts, "repeats": args.repeats, "max_tokens": args.max_tokens,
            "ms_per_token": ms, "ratios": ratios, "trials": trials}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantize", default="none", help="auto (a GGUF's own weights), "
                        "none, int8, int4")
    parser.add_argument("--draft", default="none", help="a draft spec, or none (plain)")
    parser.add_argument("--prompt-set", default="chat")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="trials per prompt")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    result = run(args)
    ms = result["ms_per_token"]
    print(f"{'path':<10} {'ms/token':>9}")
    for name in PATHS:
        print(f"{name:<10} {ms[name]:>9.2f}")
    print(f"{'ratio':<16} {'median':>7} {'min':>7} {'max':>7}   "
          f"({len(result['trials'])} paired trials)")
    for name, r in result["ratios"].items():
        print(f"{name.replace('_over_', ' / '):<16} {r['median']:>7.3f} {r['min']:>7.3f} "
              f"{r['max']:>7.3f}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
