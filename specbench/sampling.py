"""Keyed sampling against rejection sampling: acceptance, tokens/s, and whether a
seeded request's text is the one plain decoding gives with the same seed.

    python -m specbench.sampling [--drafts ngram+default-draft] [--temperatures 0.7,1.0]
                                 [--prompts 6] [--seeds 2] [--max-tokens 64] [--json PATH]

Each prompt and seed is decoded with each sampler in turn (the order alternating),
through the server's own decoding path with the adaptive draft-length policy, so
the two samplers meet the same drift in machine load; compare them only as ratios
within one run. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from decoding.drafter import Drafter
from decoding.prompting import encode_chat
from decoding.round import decode
from decoding.types import GenerationRequest, SamplingParams, SpeculationParams
from runtime.loaders.loading import load_target
from runtime.runner.causal_lm import CausalLM
from specbench.compare import json_output, load_prompts
from wiring.drafts import load_drafter

SAMPLERS = ("rejection", "keyed")


@dataclass
class Tally:
    drafter: str
    temperature: float
    sampler: str
    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    same_as_plain: int = 0  # outputs identical to speculation off with the same seed

    def row(self) -> dict[str, Any]:
        out = asdict(self)
        out["tokens_per_s"] = self.tokens / self.seconds if self.seconds else 0.0
        out["acceptance_rate"] = self.accepted / self.drafted if self.drafted else 0.0
        out["tokens_per_round"] = self.tokens / self.rounds if self.rounds else 0.0
        return out


def _run(target: CausalLM, drafter: Drafter | None, request: GenerationRequest
         ) -> tuple[list[int], float, int, int, int]:
    start = time.perf_counter()
    ids: list[int] = []
    drafted = accepted = rounds = 0
    for event in decode(target, drafter, request):
        ids.extend(event.token_ids)
        drafted += event.draft_tokens
        accepted += event.accepted_tokens
        rounds += 1
    return ids, time.perf_counter() - start, drafted, accepted, rounds


def measure(target: CausalLM, drafter: Drafter, name: str, prompts: list[tuple[int, ...]],
            temperature: float, seeds: int, max_tokens: int) -> list[Tally]:
    tallies = {s: Tally(name, temperature, s) for s in SAMPLERS}
    turn = 0
    for ids in prompts:
        for seed in range(seeds):
            order = SAMPLERS if turn % 2 == 0 else SAMPLERS[::-1]
            turn += 1
            for sampler in order:
                params = SamplingParams(temperature=temperature, seed=seed,
                                        keyed=sampler == "keyed")
                request = GenerationRequest(prompt_ids=ids, max_new_tokens=max_tokens,
                                            sampling=params)
                plain = _run(target, None, GenerationRequest(
                    prompt_ids=ids, max_new_tokens=max_tokens, sampling=params,
                    speculation=SpeculationParams(enabled=False)))[0]
                out, seconds, drafted, accepted, rounds = _run(target, drafter, request)
                tally = tallies[sampler]
                tally.requests += 1
                tally.tokens += len(out)
                tally.seconds += seconds
                tally.drafted += drafted
                tally.accepted += accepted
                tally.rounds += rounds
                tally.same_as_plain += out == plain
    return [tallies[s] for s in SAMPLERS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--drafts", default="ngram+default-draft",
                        help="comma-separated draft specs")
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--prompts", type=int, default=6, help="from the chat prompt set")
    parser.add_argument("--seeds", type=int, default=2, help="seeds per prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    out_path = json_output(args.json)
    target = load_target(args.target)
    prompts = [tuple(encode_chat(target.tokenizer, list(p.messages)))
               for p in load_prompts("chat", args.prompts)]
    rows: list[dict[str, Any]] = []
    for spec in args.drafts.split(","):
        drafter = load_drafter(spec, target)
        if drafter is None:
            raise SystemExit(f"{spec!r} names no drafter")
        warm = GenerationRequest(prompt_ids=prompts[0], max_new_tokens=16,
                                 sampling=SamplingParams(temperature=1.0, seed=0))
        _run(target, drafter, warm)
        for temperature in (float(t) for t in args.temperatures.split(",")):
            tallies = measure(target, drafter, spec, prompts, temperature, args.seeds,
                              args.max_tokens)
            base = tallies[0].row()["tokens_per_s"]
            for tally in tallies:
                row = tally.row()
                row["tokens_per_s_vs_rejection"] = row["tokens_per_s"] / base if base else 0.0
                rows.append(row)
    header = (f"{'drafter':<22}{'temp':>5} {'sampler':<10}{'req':>4}{'tok/s':>8}{'ratio':>7}"
              f"{'accept':>8}{'tok/round':>10}{'=plain':>8}")
    print(header)
    for r in rows:
        print(f"{r['drafter']:<22}{r['temperature']:>5.1f} {r['sampler']:<10}{r['requests']:>4}"
              f"{r['tokens_per_s']:>8.1f}{r['tokens_per_s_vs_rejection']:>7.3f}"
              f"{r['acceptance_rate']:>8.3f}{r['tokens_per_round']:>10.2f}"
              f"{r['same_as_plain']:>5}/{r['requests']:<2}")
    if out_path is not None:
        out_path.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
