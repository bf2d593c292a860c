"""What the engine adds per token at one stream: the same greedy requests decoded by
``decode()`` in the calling thread, by the engine's model thread, and the bare
one-token target step, interleaved prompt by prompt (machine noise hits all alike).

    python -m specbench.engine_overhead --json bench-results/engine-overhead.json

Prints a table (ms per token: median inter-token time after the first token) and
writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from decoding.engine import Engine
from decoding.factory import load_drafter, load_target
from decoding.prompting import encode_chat
from decoding.sequence import decode
from decoding.target import BatchItem, Target
from decoding.types import GenerationRequest, RoundEvent, SamplingParams, SpeculationParams
from specbench.compare import load_prompts

MS = 1000.0


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


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, args.dtype, quantize=args.quantize)
    drafter = load_drafter(args.draft, target) if args.draft != "none" else None
    engine = Engine(target, {"d": drafter} if drafter else {}, "d" if drafter else None)
    engine.warmup()
    engine.start()
    rows: dict[str, list[float]] = {"step": [], "decode": [], "engine": []}
    try:
        for prompt in load_prompts(args.prompt_set, args.prompts):
            ids = tuple(encode_chat(target.tokenizer, prompt.messages))
            request = GenerationRequest(
                prompt_ids=ids, max_new_tokens=args.max_tokens,
                sampling=SamplingParams(temperature=0.0),
                speculation=SpeculationParams(enabled=drafter is not None))
            rows["step"].append(_step_ms(target, ids, 16))
            rows["decode"].extend(g * MS for g in _gaps(decode(target, drafter, request)))
            rows["engine"].extend(g * MS for g in _gaps(engine.submit(request)))
    finally:
        engine.shutdown()
    medians = {name: round(statistics.median(values), 3) for name, values in rows.items()}
    return {"target": args.target, "dtype": args.dtype, "quantize": args.quantize,
            "draft": args.draft,
            "threads": torch.get_num_threads(), "ms_per_token": medians,
            "engine_over_step": round(medians["engine"] / medians["step"], 3),
            "decode_over_step": round(medians["decode"] / medians["step"], 3),
            "engine_over_decode": round(medians["engine"] / medians["decode"], 3)}


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
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    result = run(args)
    ms = result["ms_per_token"]
    print(f"{'path':<10} {'ms/token':>9}", file=sys.stdout)
    for name in ("step", "decode", "engine"):
        print(f"{name:<10} {ms[name]:>9.2f}")
    print(f"engine / step {result['engine_over_step']:.3f}   "
          f"decode / step {result['decode_over_step']:.3f}   "
          f"engine / decode {result['engine_over_decode']:.3f}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
