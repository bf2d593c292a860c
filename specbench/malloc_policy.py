"""Decode speed under glibc's own allocation policy against a fixed mapping threshold
(``runtime.runner.memory.map_large_allocations``, which ``specserve serve`` sets), each run in a
fresh process, the policies alternated:

    python -m specbench.malloc_policy --target qwen2.5-coder-1.5b --rounds 3 \\
        --json bench-results/malloc_policy.json

Each process loads the target, decodes ``--tokens`` greedy tokens from a code prompt
plainly and with n-gram drafts, ``--repeats`` times, and reports the median tokens/s of
all but the first repeat. The table gives each policy's median over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from specbench.report import machine_info

PROMPT = 'def quicksort(items):\n    """Sort a list."""\n'
POLICIES = {"glibc": None, "1 MiB": 1 << 20, "4 MiB": 4 << 20}


def one_process(target: str, tokens: int, repeats: int, threshold: int | None) -> dict[str, float]:
    """Run in this process: the threshold first, then the target and its decodes."""
    if threshold is not None:
        from runtime.runner.memory import map_large_allocations

        assert map_large_allocations(threshold)
    import torch

    from decoding.round import decode
    from decoding.types import GenerationRequest, SamplingParams
    from drafters.ngram import NgramDrafter
    from runtime.loaders.loading import load_target

    torch.set_num_threads(os.cpu_count() or 1)
    model = load_target(target, quantize="auto")
    prompt = tuple(model.tokenizer.encode(PROMPT))
    out = {}
    for name, drafter in (("plain", None), ("ngram", NgramDrafter())):
        rates = []
        for _ in range(repeats):
            request = GenerationRequest(prompt_ids=prompt, max_new_tokens=tokens,
                                        sampling=SamplingParams(temperature=0.0))
            began = time.perf_counter()
            made = sum(len(e.token_ids) for e in decode(model, drafter, request))
            rates.append(made / (time.perf_counter() - began))
        out[name] = statistics.median(rates[1:] or rates)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3, help="processes per policy")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # (a child process's policy)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one_process(args.target, args.tokens, args.repeats,
                                     POLICIES[args.one])))
        return
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in POLICIES}
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    for i in range(args.rounds):
        order = list(POLICIES) if i % 2 == 0 else list(reversed(POLICIES))
        for policy in order:
            child = subprocess.run(
                [sys.executable, "-m", "specbench.malloc_policy", "--one", policy, "--target",
                 args.target, "--tokens", str(args.tokens), "--repeats", str(args.repeats)],
                check=True, capture_output=True, text=True, env=env)
            runs[policy].append(json.loads(child.stdout.strip().splitlines()[-1]))
    report = {"target": args.target, "tokens": args.tokens, "rounds": args.rounds,
              "machine": machine_info(),
              "median_tokens_per_s": {p: {k: round(statistics.median(r[k] for r in rs), 2)
                                          for k in ("plain", "ngram")}
                                      for p, rs in runs.items()},
              "runs": runs}
    base = report["median_tokens_per_s"]["glibc"]
    print(f"| policy | plain tok/s | x glibc | ngram tok/s | x glibc |  ({args.target})\n"
          "|---|---:|---:|---:|---:|")
    for policy, m in report["median_tokens_per_s"].items():
        print(f"| {policy} | {m['plain']} | {m['plain'] / base['plain']:.3f} | {m['ngram']} "
              f"| {m['ngram'] / base['ngram']:.3f} |")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
