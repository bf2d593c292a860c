"""Which drafter mix ``--draft auto`` serves, chosen by measurement.

    python -m specbench.draft_choice --threads 2 --json bench-results/draft-choice.json \
        --write

Loads the target as the server does (its default precision) and each candidate mix of
drafters the target has (lookup alone, each shipped or ``--drafts`` draft alone and after
lookup), and decodes the shipped ``chat`` and ``grounded`` sets (or ``--sets``) greedily
with each, every mix on a
prompt before the next prompt, so that a machine's changing load falls on all alike.
A mix's score is the geometric mean of its speed-ups over plain decoding on the two
sets; every output must equal plain decoding's. Of mixes within 2.5% of the best score,
the one faster on chat wins (``choose``). ``--write`` stores the table and the
winner beside the draft shipped for the default model (``choice.json``), or for another
target beside its own file (``runtime.drafts.draft_choice.choice_path_for``), where
``wiring.drafts.auto_choice`` reads it:

    python -m specbench.draft_choice --target qwen2.5-coder-1.5b \
        --drafts qwen2.5-coder-0.5b --sets code_edit_tune,code_chat_tune --write

The continuation cache is not a candidate: it drafts only what a prefix cache holds,
which distinct benchmark prompts never hit, so ``auto`` adds it wherever a prefix cache
runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from decoding.prompting import encode_chat
from runtime.drafts import draft_format, feature_draft
from runtime.drafts.draft_choice import CHOICE_FORMAT, CHOICE_VERSION, choice_path, choice_path_for
from runtime.loaders.loading import load_target
from runtime.runner.causal_lm import CausalLM
from specbench.compare import load_prompts
from specbench.methods import Generation, engine_runner
from specbench.report import load_average, machine_info
from wiring.drafts import load_drafter

log = logging.getLogger("specbench.draft_choice")

NONE = "none"
SETS = ("chat", "grounded")
TIE = 0.025  # scores this close are a tie: two runs of one mix differed by up to 2%


def candidates(target: CausalLM, drafts: Sequence[str] = ()) -> list[str]:
    """The mixes worth measuring for ``target``: lookup, and each draft shipped for it
    or named in ``drafts`` (a catalogue name, a GGUF file, a draft directory), alone and
    after lookup."""
    models = list(drafts)
    if draft_format.default_draft_fits(target):
        models.append(draft_format.DEFAULT_DRAFT)
    if feature_draft.default_fits(target):
        models.append(feature_draft.DEFAULT_FEATURE_DRAFT)
    return ["ngram", *models, *(f"ngram+{m}" for m in models)]


def measure(target: CausalLM, specs: Sequence[str], sets: Sequence[str],
            max_tokens: int, prompts: int | None, dtype: str, repeats: int = 1
            ) -> dict[str, Any]:
    """Each set's tokens and seconds per mix (and plain decoding), interleaved by prompt,
    summed over ``repeats`` passes over the sets."""
    runners = {NONE: engine_runner(target, None)}
    for spec in specs:
        runners[spec] = engine_runner(target, load_drafter(spec, target, dtype))
    prompt_sets = {name: load_prompts(name, prompts) for name in sets}
    warm = encode_chat(target.tokenizer, next(iter(prompt_sets.values()))[0].messages)
    for runner in runners.values():  # first-call costs stay out of the figures
        runner(warm, 16)
    results: dict[str, dict[str, dict[str, Any]]] = {spec: {} for spec in runners}
    for name, prompt_list in prompt_sets.items():
        outputs: dict[str, list[Generation]] = {spec: [] for spec in runners}
        for repeat in range(1, repeats + 1):
            for index, prompt in enumerate(prompt_list, start=1):
                ids = encode_chat(target.tokenizer, prompt.messages)
                for spec, runner in runners.items():
                    outputs[spec].append(runner(ids, max_tokens))
                log.info("%s %d/%d (pass %d of %d)", name, index, len(prompt_list), repeat,
                         repeats)
        plain = [g.token_ids for g in outputs[NONE]]
        for spec, generations in outputs.items():
            tokens = sum(len(g.token_ids) for g in generations)
            seconds = sum(g.seconds for g in generations)
            results[spec][name] = {
                "tokens": tokens, "seconds": round(seconds, 3),
                "tokens_per_s": round(tokens / seconds, 2) if seconds > 0 else 0.0,
                "identical_to_plain": [g.token_ids for g in generations] == plain}
    return results


def score(results: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each mix's speed-up per set and their geometric mean, best first (plain last)."""
    rows = []
    for spec, per_set in results.items():
        ratios = {name: per_set[name]["tokens_per_s"] / results[NONE][name]["tokens_per_s"]
                  for name in per_set}
        rows.append({"spec": spec,
                     "tokens_per_s": {n: per_set[n]["tokens_per_s"] for n in per_set},
                     "speedup": {n: round(r, 3) for n, r in ratios.items()},
                     "score": round(math.prod(ratios.values()) ** (1 / len(ratios)), 3),
                     "identical_to_plain": all(s["identical_to_plain"]
                                               for s in per_set.values())})
    rows.sort(key=lambda row: (row["spec"] == NONE, -row["score"]))
    return rows


def choose(rows: Sequence[dict[str, Any]]) -> str:
    """The mix to serve: of those whose outputs equal plain decoding's and that beat it,
    the best score; among mixes within ``TIE`` of it (closer than two runs of one mix
    agree), the one faster on chat, the common request. None gains: ``none``."""
    valid = [row for row in rows
             if row["spec"] != NONE and row["identical_to_plain"] and row["score"] > 1.0]
    if not valid:
        return NONE
    top = max(row["score"] for row in valid)
    close = [row for row in valid if row["score"] >= top * (1 - TIE)]
    return str(max(close, key=lambda row: row["speedup"].get("chat", 0.0))["spec"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specbench.draft_choice",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="default",
                        help="the default model, a catalogue name or a model path")
    parser.add_argument("--drafts", default="",
                        help="draft models to try beside those shipped for the target, "
                             "comma-separated (e.g. qwen2.5-coder-0.5b)")
    parser.add_argument("--sets", default=",".join(SETS),
                        help=f"prompt sets, comma-separated (default {','.join(SETS)})")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the activations' dtype (the server's default: float32)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=None, help="per set (default: all)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="passes over the sets, summed (default 2)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--write", action="store_true",
                        help="store the choice where --draft auto reads it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, args.dtype, quantize="auto")
    specs = candidates(target, [d for d in args.drafts.split(",") if d])
    sets = [name for name in args.sets.split(",") if name]
    machine = machine_info()
    results = measure(target, specs, sets, args.max_tokens, args.prompts, args.dtype,
                      args.repeats)
    machine["load_average_1m_end"] = load_average()
    rows = score(results)
    best = choose(rows)
    command = "python -m specbench.draft_choice " + " ".join(
        sys.argv[1:] if argv is None else argv)
    report = {"format": CHOICE_FORMAT, "version": CHOICE_VERSION, "target": args.target,
              "dtype": args.dtype, "threads": torch.get_num_threads(),
              "max_tokens": args.max_tokens, "repeats": args.repeats, "sets": sets,
              "command": command,
              "machine": machine, "mixes": rows, "choice": best}
    print("mix | " + " | ".join(f"{n} tok/s | {n} x" for n in sets) + " | score | identical")
    print("---|" + "---|" * (2 * len(sets) + 2))
    for row in rows:
        cells = " | ".join(f"{row['tokens_per_s'][n]:.1f} | {row['speedup'][n]:.2f}x"
                           for n in sets)
        print(f"{row['spec']} | {cells} | {row['score']:.3f} | {row['identical_to_plain']}")
    print(f"choice: {best} ({machine.get('cpu', '?')}, {report['threads']} threads)")
    text = json.dumps(report, indent=2) + "\n"
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text, encoding="utf-8")
    if args.write:  # the default model's beside its draft, another's beside its file
        path = (choice_path() if draft_format.default_draft_fits(target)
                else choice_path_for(target.name))
        path.write_text(text, encoding="utf-8")
        log.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
