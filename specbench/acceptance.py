"""``specserve acceptance``: how often drafters agree with the target, without timing.

Greedy speculative decoding commits exactly the target's plain greedy output, so
every round it would run is known once that output is: from the tokens committed
so far the drafter proposes ``k`` tokens, the target keeps the longest prefix that
matches its own output plus one token of its own, and the next round starts
after them. This command decodes each prompt plainly once, then replays those
rounds for each drafter and each fixed draft length, calling only the drafter.
The figures (acceptance rate, tokens per round, acceptance by draft position)
are those a fixed-length run of our engine reports, with no timing noise: a
drafter's quality on a prompt set, measured in minutes on any machine.

What a length is worth in time also depends on the costs of a draft token and of
a verify pass; ``specserve bench`` measures those, side by side. In bfloat16 a
verify pass may round differently from a one-token step, so there the figures
are those against plain output, close to but not exactly what the engine sees.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import torch

from decoding.drafter import DraftContext, Drafter
from decoding.features import FeatureRows
from decoding.prompting import encode_chat
from decoding.round import with_layers
from decoding.types import SamplingParams
from runtime.drafts import draft_format as distilled
from runtime.drafts import feature_draft
from runtime.loaders.loading import load_target
from runtime.models.checkpoints import DTYPES
from runtime.runner.causal_lm import CausalLM
from runtime.runner.passes import BatchItem
from specbench.compare import (
    QUICK_MAX_TOKENS,
    QUICK_PROMPTS,
    DraftLoader,
    each_dtype,
    json_output,
    load_prompts,
    split_list,
)
from specbench.methods import engine_runner
from specbench.plots import write_plots
from wiring.drafts import draft_parts

log = logging.getLogger(__name__)

DEFAULT_DRAFTS = "ngram,default-draft,ngram+default-draft"
DEFAULT_KS = "1,2,3,4,6,8"
FULL_MAX_TOKENS = 128
GREEDY = SamplingParams(temperature=0.0)


@dataclass
class Replay:
    """What the rounds of one drafter at one draft length did (the prefill round,
    which drafts nothing, is not counted)."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    committed: int = 0
    offered: list[int] = field(default_factory=list)  # [i]: rounds that reached position i
    kept: list[int] = field(default_factory=list)  # [i]: of those, accepted at position i

    def add(self, other: Replay) -> None:
        self.rounds += other.rounds
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.committed += other.committed
        for mine, theirs in ((self.offered, other.offered), (self.kept, other.kept)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_round(self) -> float | None:
        return self.committed / self.rounds if self.rounds else None

    def position_rates(self) -> list[float]:
        """The share of draft tokens accepted at each position of a round, among the
        rounds whose earlier drafts were all accepted."""
        return [k / o for k, o in zip(self.kept, self.offered, strict=True) if o]


def target_features(target: CausalLM, tokens: Sequence[int]) -> FeatureRows | None:
    """The target's final hidden states over ``tokens`` from one pass (as the verify passes
    of a run would have given them, one round at a time), or None where it gives none."""
    if not target.capabilities.features:
        return None
    state = target.new_state()
    try:
        prepared = target.prepare_pass([BatchItem(state, tokens, 1, features=True)])
        target.run_pass(prepared)
    finally:
        target.release(state)
    rows = FeatureRows()
    given = with_layers(prepared)  # a target capturing layers: theirs after the states
    if given and given[0] is not None:
        rows.add(0, given[0])
    return rows


def replay(drafter: Drafter, prompt_ids: Sequence[int], output: Sequence[int], k: int,
           max_new_tokens: int, features: FeatureRows | None = None) -> Replay:
    """The rounds of a greedy run of ``drafter`` drafting ``k`` tokens a round, whose
    target output is ``output`` (its plain greedy output for ``prompt_ids`` within
    ``max_new_tokens``); ``features``: the target's states over the whole of it, for a
    drafter that reads them (it reads only those of committed tokens). The drafter's
    state is begun and released here."""
    result = Replay(offered=[0] * k, kept=[0] * k)
    state = drafter.begin(prompt_ids)
    try:
        done = 1 if output else 0  # the prefill round commits the first token
        while done < len(output):
            context = DraftContext([*prompt_ids, *output[:done]], GREEDY, None,
                                   features=features)
            want = max(0, min(k, max_new_tokens - done - 1))  # as the engine caps it
            draft = drafter.propose(state, context, want).tokens[:want] if want else ()
            accepted = 0
            while (accepted < len(draft) and done + accepted < len(output)
                   and draft[accepted] == output[done + accepted]):
                accepted += 1
            for i in range(min(len(draft), accepted + 1)):
                result.offered[i] += 1
                result.kept[i] += i < accepted
            committed = min(accepted + 1, len(output) - done)
            result.rounds += 1
            result.drafted += len(draft)
            result.accepted += accepted
            result.committed += committed
            done += committed
            drafter.rollback(state, len(prompt_ids) + done)
    finally:
        drafter.release(state)
    return result


@dataclass(frozen=True)
class AcceptanceConfig:
    target: str
    drafts: tuple[str, ...]
    dtypes: tuple[str, ...]
    ks: tuple[int, ...]
    prompt_sets: tuple[str, ...]
    prompts_per_set: int | None
    max_new_tokens: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AcceptanceConfig:
        dtypes = split_list(args.dtypes)
        unknown = [d for d in dtypes if d not in DTYPES]
        if unknown or not dtypes:
            raise ValueError(f"unknown dtype(s) {unknown}; choose from {sorted(DTYPES)}")
        try:
            ks = tuple(int(k) for k in split_list(args.k))
        except ValueError:
            raise ValueError(f"--k takes comma-separated draft lengths, not {args.k!r}") from None
        if not ks or min(ks) < 1:
            raise ValueError("--k takes draft lengths of at least 1")
        drafts = split_list(args.drafts)
        if not drafts:
            raise ValueError("--drafts names no drafter")
        sets = split_list(args.prompt_sets)  # each read (and checked) before the run
        if not sets:
            raise ValueError("--prompt-sets names no prompt set")
        prompts = args.prompts if args.prompts is not None else (
            QUICK_PROMPTS if args.quick else None)
        if prompts is not None and prompts < 1:
            raise ValueError("--prompts must be at least 1")
        max_tokens = args.max_tokens or (QUICK_MAX_TOKENS if args.quick else FULL_MAX_TOKENS)
        if max_tokens < 2:
            raise ValueError("--max-tokens must be at least 2 (the first token drafts nothing)")
        return cls(target=args.target, drafts=drafts, dtypes=dtypes, ks=ks, prompt_sets=sets,
                   prompts_per_set=prompts, max_new_tokens=max_tokens)


def run_acceptance(args: argparse.Namespace, draft_loader: DraftLoader) -> int:
    """The ``acceptance`` command: replay, print the table, write the JSON."""
    log.setLevel(logging.INFO)  # progress is part of this command's output
    try:
        config = AcceptanceConfig.from_args(args)
        prompt_sets = {name: load_prompts(name, config.prompts_per_set)
                       for name in config.prompt_sets}
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    json_path = json_output(args.json)
    machine, rows = each_dtype(
        config.dtypes, lambda dtype: _run_dtype(config, dtype, prompt_sets, draft_loader))
    write_table(rows, sys.stdout)
    if json_path is not None:
        record = asdict(config)
        record["prompts"] = {name: [p.id for p in ps] for name, ps in prompt_sets.items()}
        report = {"machine": machine, "config": record, "rows": rows}
        json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        log.info("wrote %s", json_path)
        write_plots("acceptance", report, json_path)
    return 0


def _run_dtype(config: AcceptanceConfig, dtype: str, prompt_sets: dict[str, list[Any]],
               draft_loader: DraftLoader) -> list[dict[str, Any]]:
    log.info("loading %s in %s", config.target, dtype)
    target = load_target(config.target, dtype)
    # every drafter loads before the target decodes anything: a bad spec fails at once
    loaded = {spec: draft_loader(spec, target, dtype) for spec in config.drafts}
    plain = engine_runner(target, None)
    rows = []
    for name, prompts in prompt_sets.items():
        cases = []
        for index, prompt in enumerate(prompts, start=1):
            ids = encode_chat(target.tokenizer, prompt.messages)
            cases.append((ids, plain(ids, config.max_new_tokens).token_ids))
            log.info("%s %s %d/%d: %d target tokens", dtype, name, index, len(prompts),
                     len(cases[-1][1]))
        drafted = [t for _, output in cases for t in output[1:]]  # the prefill drafts none
        for spec in config.drafts:
            coverage = head_coverage(spec, drafted)
            for k in config.ks:
                # a fresh drafter per length: what a drafter learns across requests (a
                # combined drafter's choice of source) must not carry from one length over
                drafter = loaded.pop(spec, None) or draft_loader(spec, target, dtype)
                total = Replay(offered=[0] * k, kept=[0] * k)
                for ids, output in cases:
                    features = (target_features(target, [*ids, *output])
                                if drafter.reads_features else None)
                    total.add(replay(drafter, ids, output, k, config.max_new_tokens,
                                     features))
                rows.append(_row(name, dtype, spec, k, len(cases), total, coverage))
                log.info("%s %s %s k=%d: acceptance %s, %.2f tokens/round", dtype, name, spec,
                         k, _percent(total.acceptance_rate), total.tokens_per_round or 0.0)
    return rows


def head_coverage(spec: str, tokens: Sequence[int]) -> float | None:
    """The share of ``tokens`` (the target's) that the draft model in ``spec`` can propose
    at all, when its output head covers only part of the vocabulary (a distilled draft's
    ``--vocab-top``); None when it covers all of it, or ``spec`` has no draft directory.
    No draft reaches a higher acceptance than this on those tokens: a low figure calls for
    a larger head, or a token set chosen from text more like these prompts' answers."""
    ids = None
    for part in draft_parts(spec):
        directory = (feature_draft.resolve_feature_draft_dir(part)
                     or distilled.resolve_draft_dir(part))
        if directory is not None:
            ids = distilled.head_ids(directory)
            break
    if ids is None or not tokens:
        return None
    inside = torch.zeros(max(int(ids.max()), max(tokens)) + 1, dtype=torch.bool)
    inside[ids] = True
    return float(inside[torch.tensor(tokens)].float().mean())


def _row(prompt_set: str, dtype: str, spec: str, k: int, prompts: int,
         result: Replay, coverage: float | None = None) -> dict[str, Any]:
    return {
        "prompt_set": prompt_set, "dtype": dtype, "draft": spec, "k": k, "prompts": prompts,
        "rounds": result.rounds, "drafted": result.drafted, "accepted": result.accepted,
        "committed": result.committed, "acceptance_rate": result.acceptance_rate,
        "tokens_per_round": result.tokens_per_round,
        "position_rates": result.position_rates(), "head_coverage": coverage,
    }


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    header = ["dtype", "set", "draft", "k", "rounds", "drafted", "acceptance", "first",
              "tokens/round", "head"]
    lines = [[r["dtype"], r["prompt_set"], r["draft"], str(r["k"]), str(r["rounds"]),
              str(r["drafted"]),
              _percent(r["acceptance_rate"]),
              _percent(r["position_rates"][0] if r["position_rates"] else None),
              f"{r['tokens_per_round']:.2f}" if r["tokens_per_round"] else "-",
              _percent(r.get("head_coverage"))]
             for r in rows]
    widths = [max(len(c) for c in column) for column in zip(header, *lines, strict=True)]
    out = [header, ["-" * w for w in widths], *lines]
    return "".join("  ".join(f"{c:<{w}}" if i < 3 else f"{c:>{w}}"
                             for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()
                   + "\n" for row in out)


def write_table(rows: Sequence[dict[str, Any]], stream: TextIO) -> None:
    stream.write(format_table(rows))
    stream.flush()
