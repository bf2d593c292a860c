"""Benchmark one draft on PyTorch against ONNX Runtime, with the real target.

    python -m specbench.draft_engines [--draft default-truncated:4] [--prompts 3] [--max-tokens 48]
                              [--json bench-results/draft-backends.json]

Two measurements per backend, same draft, same prompts, greedy decoding:

* draft latency: the draft's time per proposed token, decoding one token per
  step after a chat prompt (a short and a long context), median of repeats;
* end to end: tokens/s of speculative decoding against the target (the adaptive
  policy, and a fixed k to expose the cost of drafting), with the target alone
  as the baseline; every speculative output is checked token-identical to it.

Prints a table and writes JSON. The numbers are one run on whatever else the
machine is doing; compare backends within a run, not across machines.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from decoding.drafter import DraftContext, Drafter
from decoding.policy import FixedSpeculation
from decoding.prompting import encode_chat
from decoding.round import decode
from decoding.types import GenerationRequest, SamplingParams
from runtime.loaders.loading import load_target
from runtime.runner.causal_lm import CausalLM
from trt.backends import load_draft

log = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0)
BACKENDS = ("torch", "onnx")
LATENCY_K = 4  # tokens per proposal in the latency measurement
LATENCY_REPEATS = 15
LONG_CONTEXT = 512  # tokens of context for the long-context latency row


@dataclass(frozen=True)
class LatencyRow:
    backend: str
    context: int  # tokens before the measured steps
    ms_per_token: float  # median over repeats
    load_s: float  # building the drafter (including any export)


@dataclass(frozen=True)
class DecodeRow:
    method: str  # "target only" or "<backend> draft, <policy>"
    tokens: int
    seconds: float
    tokens_per_s: float
    drafted: int
    accepted: int
    draft_ms_per_token: float  # in-loop draft time per proposed token
    identical: bool  # output equals the target-only output


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, "float32")
    prompts = _prompts(target, args.prompts)
    drafters: dict[str, Drafter] = {}
    latency: list[LatencyRow] = []
    for backend in BACKENDS:
        start = time.perf_counter()
        drafter, chosen = load_draft(args.draft, target, backend, "float32")
        load_s = time.perf_counter() - start
        if drafter is None or chosen != backend:
            raise SystemExit(f"{args.draft!r} is not a draft model that runs on {backend}")
        drafters[backend] = drafter
        for context in (prompts[0], _long_context(target, LONG_CONTEXT)):
            ms = _draft_latency_ms(drafter, context)
            latency.append(LatencyRow(backend, len(context), ms, load_s))
    decoding = _end_to_end(target, drafters, prompts, args.max_tokens, args.k)
    _print(latency, decoding, args)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({
            "draft": args.draft, "target": args.target, "prompts": len(prompts),
            "max_tokens": args.max_tokens, "fixed_k": args.k,
            "threads": torch.get_num_threads(),
            "latency": [asdict(r) for r in latency],
            "end_to_end": [asdict(r) for r in decoding],
        }, indent=2) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    return 0 if all(r.identical for r in decoding) else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specbench.draft_engines", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", default="default-truncated:4")
    p.add_argument("--target", default="default")
    p.add_argument("--prompts", type=int, default=3, help="chat prompts from the shipped set")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=4, help="draft length of the fixed policy")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (both backends)")
    p.add_argument("--json", default="bench-results/draft-backends.json")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def _prompts(target: CausalLM, count: int) -> list[list[int]]:
    raw = json.loads(resources.files("specbench").joinpath("prompts/chat.json").read_text())
    return [encode_chat(target.tokenizer, p["messages"]) for p in raw["prompts"][:count]]


def _long_context(target: CausalLM, length: int) -> list[int]:
    text = " ".join(f"Item {i} is on shelf {i % 7}." for i in range(length))
    return target.tokenizer.encode(text)[:length]


@torch.inference_mode()
def _draft_latency_ms(drafter: Drafter, context: list[int]) -> float:
    """Median time per proposed token: each proposal re-feeds the last committed token and
    drafts LATENCY_K tokens one step at a time, exactly as a rejected round does."""
    state = drafter.begin(context)
    ctx = DraftContext(context, GREEDY, None)
    drafter.propose(state, ctx, LATENCY_K)  # prefill and warm-up
    samples = []
    for _ in range(LATENCY_REPEATS):
        start = time.perf_counter()
        drafter.propose(state, ctx, LATENCY_K)
        samples.append((time.perf_counter() - start) / LATENCY_K)
    drafter.release(state)
    return 1000 * statistics.median(samples)


def _end_to_end(target: CausalLM, drafters: dict[str, Drafter], prompts: list[list[int]],
                max_tokens: int, k: int) -> list[DecodeRow]:
    requests = [GenerationRequest(prompt_ids=tuple(p), max_new_tokens=max_tokens,
                                  sampling=GREEDY) for p in prompts]
    plain, row = _run(target, None, requests, None, "target only", None)
    rows = [row]
    for backend, drafter in drafters.items():
        for policy in ("adaptive", f"fixed k={k}"):
            fixed = k if policy != "adaptive" else None
            _, row = _run(target, drafter, requests, fixed, f"{backend} draft, {policy}", plain)
            rows.append(row)
    return rows


def _run(target: CausalLM, drafter: Drafter | None, requests: list[GenerationRequest],
         fixed_k: int | None, method: str, reference: list[list[int]] | None
         ) -> tuple[list[list[int]], DecodeRow]:
    outputs: list[list[int]] = []
    drafted = accepted = 0
    draft_s = 0.0
    start = time.perf_counter()
    for request in requests:
        policy = FixedSpeculation(fixed_k) if fixed_k else None
        ids: list[int] = []
        for event in decode(target, drafter, request, policy):
            ids.extend(event.token_ids)
            drafted += event.draft_tokens
            accepted += event.accepted_tokens
            draft_s += event.timing.draft_s
        outputs.append(ids)
    seconds = time.perf_counter() - start
    tokens = sum(len(o) for o in outputs)
    log.info("%s: %d tokens in %.2fs", method, tokens, seconds)
    return outputs, DecodeRow(
        method=method, tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds,
        drafted=drafted, accepted=accepted,
        draft_ms_per_token=1000 * draft_s / drafted if drafted else 0.0,
        identical=reference is None or outputs == reference,
    )


def _print(latency: list[LatencyRow], decoding: list[DecodeRow], args: Any) -> None:
    print(f"draft {args.draft}, target {args.target}, greedy, {torch.get_num_threads()} "
          "threads")
    print(f"\n{'backend':<10}{'context':>9}{'ms/token':>10}{'load s':>9}")
    for r in latency:
        print(f"{r.backend:<10}{r.context:>9}{r.ms_per_token:>10.2f}{r.load_s:>9.1f}")
    print(f"\n{'method':<28}{'tokens':>7}{'tok/s':>8}{'drafted':>9}{'accepted':>9}"
          f"{'draft ms/tok':>13}{'identical':>10}")
    for d in decoding:
        print(f"{d.method:<28}{d.tokens:>7}{d.tokens_per_s:>8.2f}{d.drafted:>9}"
              f"{d.accepted:>9}{d.draft_ms_per_token:>13.2f}{d.identical!s:>10}")


if __name__ == "__main__":
    raise SystemExit(main())
