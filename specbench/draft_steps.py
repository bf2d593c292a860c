"""What a drafted token costs beside a one-token step of the target, in one process.

    python -m specbench.draft_steps --threads 2 --json bench-results/draft-steps.json
    python -m specbench.draft_steps --draft feature-draft --threads 2

Loads the default target (its GGUF file) and a draft (``--draft``: the 2-layer one shipped
for it by default, or a feature head, fed the target's states from one pass) as the server
would run it beside it (``wiring.drafts.load_model_drafter``), prefills a
``CONTEXT``-token prompt into both, and times, interleaved so that machine noise hits each
alike: the target's one-token step, and the draft model's round of ``k`` greedy tokens by
each path it has (``python``: one draft step per Python call; ``native``: the k steps in
one native call, ``BatchedLM.draft_chain``), for one sequence and for ``--streams``
sequences at once.
Prints a table (median ms a round, ms a drafted token, that as a share of the target's
step) and writes JSON; the paths' tokens must agree, or it stops.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from decoding.drafter import DraftContext
from decoding.types import SamplingParams
from drafters.feature import FeatureDrafter
from drafters.model import ModelDrafter
from runtime.loaders.loading import load_target
from runtime.runner.batched import BatchedLM
from runtime.runner.passes import BatchItem
from specbench.acceptance import target_features
from specbench.compare import json_output, write_json
from wiring.drafts import load_model_drafter

MS = 1000.0
CONTEXT = 300


def _prompt(stream: int) -> list[int]:
    return [100 + (i * 7 + stream * 13) % 900 for i in range(CONTEXT)]


def _target_step_ms(target: BatchedLM, repeats: int) -> float:
    state = target.new_state()
    try:
        target.forward_batch([BatchItem(state, _prompt(0), 1)])
        times = []
        for _ in range(repeats):
            target.rollback(state, CONTEXT)
            start = time.perf_counter()
            logits = target.forward_batch([BatchItem(state, [123], 1)])
            int(logits[0][-1].argmax())
            times.append(time.perf_counter() - start)
        return statistics.median(times) * MS
    finally:
        target.release(state)


def _round_ms(target: BatchedLM, drafter: ModelDrafter | FeatureDrafter, streams: int, k: int,
              path: str, repeats: int) -> tuple[float, list[tuple[int, ...]]]:
    """Median ms of drafting ``k`` tokens for ``streams`` sequences (each past its
    prompt: one token to catch up), and the tokens drafted."""
    drafter.native_chain = path == "native"
    states: list[Any] = [drafter.begin([]) for _ in range(streams)]
    greedy = SamplingParams(temperature=0.0)
    prompts = [_prompt(s) for s in range(streams)]
    grown_ids = [[*p, 321] for p in prompts]
    rows = ([target_features(target, ids) for ids in grown_ids] if drafter.reads_features
            else [None] * streams)
    contexts = [DraftContext(p, greedy, None, features=r)
                for p, r in zip(prompts, rows, strict=True)]
    try:
        drafter.propose_many(states, contexts, [1] * streams)  # the prompts, fed
        grown = [DraftContext(ids, greedy, None, features=r)
                 for ids, r in zip(grown_ids, rows, strict=True)]
        times = []
        tokens: list[tuple[int, ...]] = []
        for _ in range(repeats):
            for state in states:
                drafter.rollback(state, CONTEXT)
            start = time.perf_counter()
            proposals = drafter.propose_many(states, grown, [k] * streams)
            times.append(time.perf_counter() - start)
            tokens = [p.tokens for p in proposals]
        return statistics.median(times) * MS, tokens
    finally:
        for state in states:
            drafter.release(state)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target("default", "bfloat16", quantize="auto")
    assert isinstance(target, BatchedLM)
    drafter = load_model_drafter(args.draft, target, "bfloat16")
    paths = [p for p in args.paths.split(",") if p != "native" or drafter.can_chain()]
    step: list[float] = []
    rounds: dict[tuple[str, int], list[float]] = {}
    drafted: dict[tuple[str, int], list[tuple[int, ...]]] = {}
    for _ in range(args.rounds):
        step.append(_target_step_ms(target, args.repeats))
        for streams in (1, args.streams):
            for path in paths:
                ms, tokens = _round_ms(target, drafter, streams, args.k, path,
                                       args.repeats)
                rounds.setdefault((path, streams), []).append(ms)
                drafted[(path, streams)] = tokens
    step_ms = statistics.median(step)
    rows = []
    for (path, streams), times in rounds.items():
        if drafted[(path, streams)] != drafted[(paths[0], streams)]:
            raise SystemExit(f"the {path} path drafted other tokens than {paths[0]}")
        ms = statistics.median(times)
        per_token = ms / (args.k * streams)
        rows.append({"path": path, "streams": streams, "k": args.k, "round_ms": round(ms, 3),
                     "ms_per_drafted_token": round(per_token, 3),
                     "share_of_target_step": round(per_token / step_ms, 3)})
    return {"draft": args.draft, "context": CONTEXT, "threads": torch.get_num_threads(),
            "target_step_ms": round(step_ms, 3), "rows": rows}


def format_table(report: dict[str, Any]) -> str:
    lines = ["path | streams | k | ms a round | ms a drafted token | / target step",
             "---|---|---|---|---|---"]
    lines += [f"{r['path']} | {r['streams']} | {r['k']} | {r['round_ms']} | "
              f"{r['ms_per_drafted_token']} | {r['share_of_target_step']:.1%}"
              for r in report["rows"]]
    lines.append(f"{report['draft']}; target one-token step {report['target_step_ms']} ms; context "
                 f"{report['context']} tokens, {report['threads']} threads")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specbench.draft_steps", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default="default-draft",
                        help="the draft: default-draft, feature-draft, or a directory")
    parser.add_argument("--k", type=int, default=5, help="tokens a round drafts")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--paths", default="python,native")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per path")
    parser.add_argument("--repeats", type=int, default=20, help="rounds timed per path")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    path = json_output(args.json)
    report = run(args)
    sys.stdout.write(format_table(report))
    write_json(path, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
