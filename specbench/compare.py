"""``specserve bench``: our decoding methods against transformers' generate().

Every method runs greedily on the same prompts, in one process, on the same
loaded model, per dtype. Each method gets one warm-up generation first; then
the prompts are taken one at a time and every method generates for that
prompt before the next one, so that load from other processes spreads over
all methods alike. Each generation is timed as one whole call.

The output is a table on stdout and, with ``--json``, a JSON report; progress
goes to the log (stderr).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from decoding.drafter import Drafter
from decoding.prompting import encode_chat
from drafters.model import ModelDrafter
from runtime.drafts import feature_draft
from runtime.loaders.loading import PRECISIONS, load_target, torch_draft_dtype
from runtime.runner.causal_lm import CausalLM
from specbench.methods import (
    ALL_METHODS,
    DRAFT_METHODS,
    FEATURE_METHODS,
    HF_METHODS,
    PLAIN,
    Generation,
    Runner,
    build_runners,
    method_settings,
)
from specbench.plots import write_plots
from specbench.progress import progress
from specbench.report import load_average, machine_info, summarise, write_table
from wiring.drafts import NGRAM, NO_DRAFT, load_drafter

log = logging.getLogger(__name__)

PROMPT_SETS = ("chat", "grounded")  # what a benchmark runs unless told otherwise
CODE_PROMPT_SETS = ("code_edit", "code_chat", "long_code")  # held out, like the two above
TUNING_PROMPT_SETS = ("code_edit_tune", "code_chat_tune")  # for tuning drafters, not measured
SHIPPED_PROMPT_SETS = (*PROMPT_SETS, *CODE_PROMPT_SETS, *TUNING_PROMPT_SETS)
CHAT_ROLES = ("system", "user", "assistant")
QUICK_PROMPTS = 4  # per prompt set
QUICK_MAX_TOKENS = 64
FULL_MAX_TOKENS = 192
WARMUP_TOKENS = 16


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: an id and its chat messages."""

    id: str
    messages: tuple[dict[str, str], ...]


@dataclass(frozen=True)
class BenchConfig:
    """What one ``bench`` invocation measures, as recorded in the report."""

    target: str
    draft: str | None  # a draft model's path, or None
    dtypes: tuple[str, ...]
    prompt_sets: tuple[str, ...]
    prompts_per_set: int | None  # None: every prompt
    max_new_tokens: int
    methods: tuple[str, ...]
    quick: bool
    draft_dtype: str = "auto"  # of a PyTorch draft model; see wiring.drafts.torch_draft_dtype
    kernels: str = "auto"  # the target's elementwise work and attention (runtime.native.kernels)
    int8_activations: bool = True  # 4-bit/Q8_0 matrices with int8 activations (BlockMatrix)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchConfig:
        draft = args.draft if args.draft not in (None, NO_DRAFT, NGRAM) else None
        prompts = args.prompts if args.prompts is not None else (
            QUICK_PROMPTS if args.quick else None)
        max_tokens = args.max_tokens or (QUICK_MAX_TOKENS if args.quick else FULL_MAX_TOKENS)
        dtypes = split_list(args.dtypes)
        unknown = [d for d in dtypes if d not in PRECISIONS]
        if unknown or not dtypes:
            raise ValueError(f"unknown dtype(s) {unknown}; choose from {sorted(PRECISIONS)}")
        return cls(
            target=args.target,
            draft=draft,
            dtypes=dtypes,
            prompt_sets=split_list(args.prompt_sets),
            prompts_per_set=prompts,
            max_new_tokens=max_tokens,
            methods=select_methods(args.methods, has_draft=draft is not None, hf=not args.no_hf,
                                   has_feature=feature_draft.is_feature_draft_dir(
                                       feature_draft.DEFAULT_FEATURE_DRAFT_DIR)),
            quick=args.quick,
            draft_dtype=getattr(args, "draft_dtype", "auto"),
            kernels=getattr(args, "kernels", "auto"),
            int8_activations=getattr(args, "int8_activations", True),
        )


def split_list(text: str) -> tuple[str, ...]:
    """The items of a comma-separated flag, blanks dropped."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def json_output(path: str | None) -> Path | None:
    """Where ``--json`` goes, its folder made now: a bad path fails before the run, not
    after it."""
    if path is None:
        return None
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def write_json(path: Path | None, report: Any) -> None:
    """Write ``report`` to ``path`` (from ``json_output``), where one was given."""
    if path is not None:
        path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


def select_methods(wanted: str | None, has_draft: bool, hf: bool,
                   has_feature: bool = False) -> tuple[str, ...]:
    """The methods to run, in canonical order; ``plain`` always, as the reference."""
    chosen = set(split_list(wanted)) if wanted else set(ALL_METHODS)
    unknown = chosen - set(ALL_METHODS)
    if unknown:
        raise ValueError(f"unknown method(s) {sorted(unknown)}; choose from {list(ALL_METHODS)}")
    if not has_draft:
        chosen -= DRAFT_METHODS
    if not has_feature:
        chosen -= FEATURE_METHODS
    if not hf:
        chosen -= HF_METHODS
    chosen.add(PLAIN)
    return tuple(m for m in ALL_METHODS if m in chosen)


def load_prompts(name: str, limit: int | None = None) -> list[Prompt]:
    """The first ``limit`` prompts of a shipped prompt set (``specbench/prompts/<name>.json``)
    or of a prompt file of one's own (a path; see ``read_prompt_file``)."""
    if name in SHIPPED_PROMPT_SETS:
        text = resources.files("specbench").joinpath("prompts", f"{name}.json").read_text("utf-8")
        data = json.loads(text)
        prompts = [Prompt(id=p["id"], messages=tuple(p["messages"])) for p in data["prompts"]]
    elif Path(name).expanduser().is_file():
        prompts = read_prompt_file(Path(name).expanduser())
    else:
        raise ValueError(f"unknown prompt set {name!r}: neither a shipped set "
                         f"({', '.join(SHIPPED_PROMPT_SETS)}) nor a prompt file")
    return prompts[:limit] if limit is not None else prompts


def read_prompt_file(path: Path) -> list[Prompt]:
    """Prompts from a file: JSON, either ``{"prompts": [...]}`` (the shipped sets' format)
    or a bare list, or JSON Lines, one prompt a line. A prompt is a string (one user
    message), a list of chat messages, or an object with ``messages`` (and an optional
    ``id``); a message is ``{"role": "system"|"user"|"assistant", "content": str}``."""
    try:
        text = path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read prompt file {path}: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        items: list[Any] = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                items.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}, line {number}: not JSON ({exc.msg})") from None
    else:
        listed = data.get("prompts") if isinstance(data, dict) else data
        if not isinstance(listed, list):
            raise ValueError(f"{path}: expected a list of prompts or an object with "
                             f"\"prompts\"")
        items = listed
    prompts = [_file_prompt(path, index, item) for index, item in enumerate(items, start=1)]
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def _file_prompt(path: Path, index: int, item: Any) -> Prompt:
    where = f"{path}, prompt {index}"
    name = f"{path.stem}-{index}"
    if isinstance(item, dict):
        name = str(item.get("id", name))
        item = item.get("messages")
    if isinstance(item, str):
        item = [{"role": "user", "content": item}]
    if not isinstance(item, list) or not item:
        raise ValueError(f"{where}: expected a string, a list of messages or an object with "
                         f"\"messages\"")
    for message in item:
        if (not isinstance(message, dict) or message.get("role") not in CHAT_ROLES
                or not isinstance(message.get("content"), str)):
            raise ValueError(f"{where}: each message needs a role ({', '.join(CHAT_ROLES)}) "
                             f"and a string content, not {message!r}")
    if item[-1]["role"] == "assistant":
        raise ValueError(f"{where}: the last message is the assistant's; nothing to answer")
    return Prompt(id=name, messages=tuple({"role": m["role"], "content": m["content"]}
                                          for m in item))


DraftLoader = Callable[[str, CausalLM, str], Drafter]


def run_bench(args: argparse.Namespace, draft_loader: DraftLoader | None = None) -> int:
    """The ``bench`` command: run, print the table, write the JSON. ``draft_loader``
    builds the drafter that spec:draft uses (on another backend, say); the
    transformers baseline always gets the PyTorch draft."""
    log.setLevel(logging.INFO)  # progress is part of this command's output
    try:
        config = BenchConfig.from_args(args)
        prompt_sets = {name: load_prompts(name, config.prompts_per_set)
                       for name in config.prompt_sets}
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    json_path = json_output(args.json)
    report = run_all(config, prompt_sets, draft_loader,
                     show_progress=not getattr(args, "no_progress", False))
    write_table(report["runs"], sys.stdout)
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        log.info("wrote %s", json_path)
        write_plots("bench", report, json_path)
    return 0


def run_all(config: BenchConfig, prompt_sets: dict[str, list[Prompt]],
            draft_loader: DraftLoader | None = None, show_progress: bool = True
            ) -> dict[str, Any]:
    """Every dtype, prompt set and method; returns the JSON report."""
    machine, runs = each_dtype(
        config.dtypes,
        lambda dtype: _run_dtype(config, dtype, prompt_sets, draft_loader, show_progress))
    return {"machine": machine, "config": _config_record(config, prompt_sets), "runs": runs}


def each_dtype(dtypes: Sequence[str], run: Callable[[str], list[dict[str, Any]]]
               ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The rows ``run`` makes for each dtype in turn (one model in memory at a time), and
    the machine they were measured on, with its load before and after."""
    machine = machine_info()
    rows: list[dict[str, Any]] = []
    for dtype in dtypes:
        rows.extend(run(dtype))
        gc.collect()
    machine["load_average_1m_end"] = load_average()
    return machine, rows


def _config_record(config: BenchConfig, prompt_sets: dict[str, list[Prompt]]) -> dict[str, Any]:
    record = asdict(config)
    record.update(
        greedy=True,
        warmup_tokens=WARMUP_TOKENS,
        prompts={name: [p.id for p in prompts] for name, prompts in prompt_sets.items()},
        method_settings={m: s for m, s in method_settings().items() if m in config.methods},
        # what --draft-dtype meant here for each target dtype, where the draft runs on PyTorch
        draft_dtype_on_torch={d: torch_draft_dtype(d, "cpu", config.draft_dtype)
                              for d in config.dtypes},
        order="per prompt, every method in turn, after one warm-up per method",
    )
    return record


def _run_dtype(
    config: BenchConfig, dtype: str, prompt_sets: dict[str, list[Prompt]],
    draft_loader: DraftLoader | None = None, show_progress: bool = True,
) -> list[dict[str, Any]]:
    log.info("loading %s in %s", config.target, dtype)
    torch_dtype, quantize = PRECISIONS[dtype]  # gguf: the file's own; int8/int4: at load
    target = load_target(config.target, torch_dtype, quantize=quantize, kernels=config.kernels,
                         int8_activations=config.int8_activations)
    draft = _load_draft(config, target, dtype)
    spec_draft: Drafter | None = draft
    if draft is not None and draft_loader is not None and config.draft is not None:
        spec_draft = draft_loader(config.draft, target, dtype)
    # transformers' generate runs the model's own modules, which a quantized target lacks
    methods = [m for m in config.methods if quantize == "none" or m not in HF_METHODS]
    feature = None
    if FEATURE_METHODS & set(methods):
        if feature_draft.default_fits(target):
            feature = load_drafter(feature_draft.DEFAULT_FEATURE_DRAFT, target, dtype,
                                   draft_dtype=config.draft_dtype)
        else:
            log.info("no feature draft was made for %s: its methods are skipped", config.target)
            methods = [m for m in methods if m not in FEATURE_METHODS]
    runners = build_runners(methods, target, draft, spec_draft, feature)
    first = next(p for prompts in prompt_sets.values() for p in prompts)
    _warm_up(runners, _encode(target, first))
    runs: list[dict[str, Any]] = []
    for name, prompts in prompt_sets.items():
        outputs = _run_set(runners, target, name, dtype, prompts, config.max_new_tokens,
                           show_progress)
        reference = outputs.get(PLAIN)
        ids = [p.id for p in prompts]
        runs.extend(summarise(name, method, dtype, ids, generations, reference)
                    for method, generations in outputs.items())
    return runs


def _load_draft(config: BenchConfig, target: CausalLM, dtype: str) -> ModelDrafter | None:
    if config.draft is None or not DRAFT_METHODS & set(config.methods):
        return None
    drafter = load_drafter(config.draft, target, dtype, draft_dtype=config.draft_dtype)
    if not isinstance(drafter, ModelDrafter):
        raise ValueError(f"--draft {config.draft!r} is not a draft model")
    return drafter


def _encode(target: CausalLM, prompt: Prompt) -> list[int]:
    return encode_chat(target.tokenizer, prompt.messages)


def _warm_up(runners: dict[str, Runner], prompt_ids: Sequence[int]) -> None:
    """One short generation per method, untimed: first-call costs stay out of the numbers."""
    for method, runner in runners.items():
        log.info("warm-up %s", method)
        runner(prompt_ids, WARMUP_TOKENS)


def _run_set(
    runners: dict[str, Runner],
    target: CausalLM,
    name: str,
    dtype: str,
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    show_progress: bool = True,
) -> dict[str, list[Generation]]:
    """Each prompt in turn, every method on it; the generations per method."""
    outputs: dict[str, list[Generation]] = {method: [] for method in runners}
    with progress(len(prompts) * len(runners), f"{dtype} {name}", show_progress) as bar:
        for index, prompt in enumerate(prompts, start=1):
            prompt_ids = _encode(target, prompt)
            for method, runner in runners.items():
                bar.set_postfix_str(f"{prompt.id} {method}")
                generation = runner(prompt_ids, max_new_tokens)
                outputs[method].append(generation)
                bar.update()
                # the bar shows progress where there is one; else, a log line a generation
                log.log(logging.DEBUG if not bar.disable else logging.INFO,
                        "%s %s %d/%d %-17s %4d tokens in %6.2fs (%.1f tok/s)", dtype, name,
                        index, len(prompts), method, len(generation.token_ids),
                        generation.seconds,
                        len(generation.token_ids) / max(generation.seconds, 1e-9))
    return outputs
