"""JSON-schema output under speculation vs constrained plain decoding.

Each method decodes every prompt greedily under the same schema-heavy grammar on the
same loaded target; the table gives tokens/s, the speed-up over constrained plain
decoding, whether the output is token-identical to it, the grammar-forced drafts
and how many were kept, and the mask cost (seconds on masks and matching) as a share
of the round time. Prints a table and writes JSON:

    python -m specbench.structured --json structured.json [--drafts ngram,default-draft]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from decoding.drafter import Drafter
from decoding.prompting import encode_chat
from decoding.round import decode
from decoding.types import GenerationRequest, SamplingParams, SpeculationParams
from grammars.guidance import GrammarCompiler
from runtime.runner.causal_lm import CausalLM
from specbench.report import machine_info
from wiring.drafts import load_drafter

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "address": {"type": "object", "properties": {
            "street": {"type": "string", "maxLength": 40},
            "city": {"type": "string", "maxLength": 30},
            "country": {"type": "string", "maxLength": 30}},
            "required": ["street", "city", "country"], "additionalProperties": False},
        "status": {"enum": ["active", "inactive", "pending"]},
        "skills": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "skill_name": {"type": "string", "maxLength": 20},
            "skill_level": {"enum": ["beginner", "intermediate", "expert"]}},
            "required": ["skill_name", "skill_level"], "additionalProperties": False}},
    },
    "required": ["name", "email", "age", "address", "status", "skills"],
    "additionalProperties": False,
}
PROMPTS = [
    "Ada Lovelace (ada@example.com), 36, lives at 12 St James's Square, London, United "
    "Kingdom. Active. Expert in mathematics, intermediate in poetry. Give her record as JSON.",
    "Record for Alan Turing, alan@example.org, aged 41, of 43 Adlington Road, Wilmslow, "
    "England; inactive; skills: cryptanalysis (expert), running (intermediate). JSON only.",
    "Grace Hopper, grace@navy.mil, 85, 1 Navy Way, Arlington, USA, pending, skills COBOL "
    "expert and teaching expert. Reply with the JSON record.",
]


def run_method(target: CausalLM, drafter: Drafter | None, grammar: Any, prompts: Sequence[
        tuple[int, ...]], max_new: int, enabled: bool) -> dict[str, Any]:
    outputs, tokens, seconds, rounds = [], 0, 0.0, 0
    forced = kept = 0
    mask_s = round_s = 0.0
    for ids in prompts:
        request = GenerationRequest(prompt_ids=ids, max_new_tokens=max_new, grammar=grammar,
                                    sampling=SamplingParams(temperature=0.0),
                                    speculation=SpeculationParams(enabled=enabled))
        start = time.perf_counter()
        events = list(decode(target, drafter, request))
        seconds += time.perf_counter() - start
        out = [t for e in events for t in e.token_ids]
        outputs.append(out)
        tokens += len(out)
        rounds += len(events)
        for e in events[1:]:
            forced += e.forced_tokens
            kept += e.forced_accepted
            mask_s += e.constraint_s
            round_s += e.timing.draft_s + e.timing.verify_s + e.timing.bookkeeping_s
    return {"outputs": outputs, "tokens": tokens, "seconds": seconds, "rounds": rounds,
            "tokens_per_s": tokens / seconds if seconds else 0.0, "forced_drafts": forced,
            "forced_kept": kept, "mask_share": mask_s / round_s if round_s else 0.0,
            "mask_ms_per_token": 1e3 * mask_s / max(1, tokens)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--drafts", default="ngram,default-draft,ngram+default-draft")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from runtime.files import model_store
    from runtime.runner.batched import BatchedLM

    target = BatchedLM.load(model_store.resolve(args.target), dtype="float32")
    compiler = GrammarCompiler(target.tokenizer, target.vocab_size)
    grammar = compiler.json_schema(SCHEMA)
    prompts = [tuple(encode_chat(target.tokenizer, [{"role": "user", "content": p}]))
               for p in PROMPTS[: args.prompts]]
    methods: list[tuple[str, Drafter | None, bool]] = [
        ("constrained plain", None, False), ("grammar drafts only", None, True)]
    for spec in filter(None, args.drafts.split(",")):
        methods.append((f"grammar+{spec}", load_drafter(spec, target), True))
    decode(target, None, GenerationRequest(prompt_ids=prompts[0], max_new_tokens=2))  # warm
    runs = []
    for name, drafter, enabled in methods:
        result = run_method(target, drafter, grammar, prompts, args.max_tokens, enabled)
        runs.append({"method": name, **result})
    base = runs[0]
    lines = [f"{'method':<28} {'tok/s':>7} {'speedup':>8} {'identical':>9} {'rounds':>6} "
             f"{'forced':>6} {'kept':>5} {'mask%':>6}"]
    for run in runs:
        run["speedup"] = run["tokens_per_s"] / base["tokens_per_s"]
        run["identical"] = run["outputs"] == base["outputs"]
        lines.append(f"{run['method']:<28} {run['tokens_per_s']:7.1f} {run['speedup']:7.2f}x "
                     f"{run['identical']!s:>9} {run['rounds']:6d} {run['forced_drafts']:6d} "
                     f"{run['forced_kept']:5d} {100 * run['mask_share']:5.1f}%")
    sys.stdout.write("\n".join(lines) + "\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": machine_info(), "max_tokens": args.max_tokens,
                       "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs]},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
