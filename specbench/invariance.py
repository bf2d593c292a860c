"""What batch invariance costs, and what it buys: the same greedy requests through the
engine with invariant attention blocks (the default) and without
(``--no-batch-invariance``), at each stream count, the two interleaved repeat by repeat
so that machine noise hits both alike.

    python -m specbench.invariance --quantize auto --dtype bfloat16 \
        --json bench-results/invariance.json

Per configuration: tokens/s (all prompts submitted at once, at most N decoded together;
completion tokens over wall time, median over the repeats after one unmeasured warm-up
round of every configuration) and how many outputs equal
plain decoding of the prompt alone (no drafts, invariant, one stream). Prints a table
and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from decoding.engine import Engine
from decoding.prompting import encode_chat
from decoding.types import GenerationRequest, SamplingParams, SpeculationParams
from runtime.loaders.loading import load_target
from runtime.runner.batched import BatchedLM
from runtime.runner.causal_lm import CausalLM
from specbench.compare import load_prompts
from wiring.drafts import load_drafter


def _decode(target: CausalLM, drafter: Any, requests: list[GenerationRequest],
            streams: int) -> tuple[list[list[int]], float]:
    engine = Engine(target, {"d": drafter} if drafter else {}, "d" if drafter else None,
                    max_queue=len(requests), max_active=streams)
    engine.start()
    try:
        start = time.perf_counter()
        submitted = [engine.submit(r) for r in requests]
        outputs = [[t for e in s for t in e.token_ids] for s in submitted]
        return outputs, time.perf_counter() - start
    finally:
        engine.shutdown()


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, args.dtype, quantize=args.quantize)
    if not isinstance(target, BatchedLM):
        raise SystemExit(f"{args.target} does not run batched: nothing to compare")
    drafter = load_drafter(args.draft, target)
    prompts = [p for name in args.prompt_sets.split(",") for p in load_prompts(name, args.prompts)]
    requests = [GenerationRequest(prompt_ids=tuple(encode_chat(target.tokenizer, p.messages)),
                                  max_new_tokens=args.max_tokens,
                                  sampling=SamplingParams(temperature=0.0),
                                  speculation=SpeculationParams(enabled=True))
                for p in prompts]
    plain = [_decode(target, None, [r], 1)[0][0] for r in requests]
    streams = [int(n) for n in args.streams.split(",")]
    rates: dict[tuple[int, bool], list[float]] = {}
    same: dict[tuple[int, bool], int] = {}
    for repeat in range(args.repeats + 1):  # the first warms every shape up, unmeasured
        for n in streams:
            for invariant in (True, False):
                target.batch_invariant = invariant
                outputs, seconds = _decode(target, drafter, requests, n)
                if repeat:
                    rates.setdefault((n, invariant), []).append(sum(map(len, outputs)) / seconds)
                same[(n, invariant)] = sum(o == p for o, p in zip(outputs, plain, strict=True))
    target.batch_invariant = True
    rows = []
    for n in streams:
        on, off = (statistics.median(rates[(n, v)]) for v in (True, False))
        rows.append({"streams": n, "invariant_tok_s": round(on, 2), "fast_tok_s": round(off, 2),
                     "cost": round(1 - on / off, 3),
                     "identical_invariant": f"{same[(n, True)]}/{len(requests)}",
                     "identical_fast": f"{same[(n, False)]}/{len(requests)}"})
    return {"target": args.target, "dtype": args.dtype, "quantize": args.quantize,
            "weights": target.weights_format, "draft": args.draft,
            "threads": torch.get_num_threads(), "prompts": len(requests),
            "max_tokens": args.max_tokens, "repeats": args.repeats, "rows": rows}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="default")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantize", default="auto", help="auto, none, int8, int4")
    parser.add_argument("--draft", default="ngram+default-draft")
    parser.add_argument("--prompt-sets", default="chat,grounded")
    parser.add_argument("--prompts", type=int, default=4, help="per set")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    result = run(args)
    print(f"{result['weights']}, draft {result['draft']}, {result['prompts']} prompts, "
          f"{result['max_tokens']} tokens, {result['threads']} threads")
    print(f"{'streams':>7} {'invariant tok/s':>15} {'fast tok/s':>10} {'cost':>6} "
          f"{'same as plain (inv.)':>20} {'same as plain (fast)':>20}")
    for row in result["rows"]:
        print(f"{row['streams']:>7} {row['invariant_tok_s']:>15.2f} {row['fast_tok_s']:>10.2f} "
              f"{row['cost']:>6.1%} {row['identical_invariant']:>20} {row['identical_fast']:>20}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
