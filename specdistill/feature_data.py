"""Data for a feature draft: chat-like prompts, the target's answers, and its features.

Prompts come in two kinds, mixed in every round:

- Magpie: the target writes the user's message itself, given only its chat template up
  to the user turn (the default system prompt included), sampled at temperature 1
  among its 40 most likely tokens (``data.answer_all``) and stopped at the end of its
  turn; empty, unfinished and repeated messages are dropped.
- Grounded tasks: a rewrite, an extraction, a summary or a question over a given text,
  a Python standard-library docstring paragraph or a list of Debian package one-liners
  (``prompts.py``'s pools).

No prompt of the benchmark's evaluation sets (``specbench/prompts/chat.json`` and
``grounded.json``) is ever trained on: a prompt equal to one of theirs, or whose text
occurs in theirs, is dropped. The target answers most prompts greedily and some by
sampling at temperature 0.7 (one seed per answer); then one more pass over each
prompt and answer gives the target's final-normed hidden state at every position
(``BatchItem.features``), kept in float16. Rounds are written as shards and rebuilt
identically from the seed, so an interrupted run resumes at the first missing shard.
About 5% of the prompts (by a hash of their text) are held out.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from decoding.prompting import encode_chat
from runtime.causal_lm import BatchItem
from specdistill import prompts as prompt_source
from specdistill.data import CPU_STREAMS, answer_all

log = logging.getLogger(__name__)

ROUND_MAGPIE = 80  # magpie messages sampled per round (some are dropped)
ROUND_GROUNDED = 56  # grounded prompts per round
MAGPIE_MAX_TOKENS = 96
SAMPLED_SHARE = 0.2  # answers sampled (temperature SAMPLED_TEMPERATURE) rather than greedy
SAMPLED_TEMPERATURE = 0.7
HELD_OUT_SHARE = 0.05
FEATURE_CHUNK = 512  # longest piece of a sequence one pass takes
FEATURE_BATCH = 8  # sequences per feature pass
EVAL_MAX_TOKENS = 128
BENCH_SETS = ("chat", "grounded")
BENCH_DIR = Path(__file__).resolve().parent.parent / "specbench" / "prompts"

PASSAGE_TASKS = (
    ("rewrite", "Rewrite the following text in plain, simple English for a beginner.\n\n{t}"),
    ("rewrite", "Rewrite this paragraph so that it is shorter, keeping every fact.\n\n{t}"),
    ("rewrite", "Rewrite the text below as a short bulleted list.\n\n{t}"),
    ("extract", "List every function, class, argument or value named in this text, one per "
                "line.\n\n{t}"),
    ("extract", "Extract the key facts from this documentation as a short list.\n\n{t}"),
    ("summarise", "Summarize the following documentation in two sentences.\n\n{t}"),
    ("summarise", "Give a one-sentence summary of this text.\n\n{t}"),
    ("question", "Read the text and answer: what does it describe, and when would someone "
                 "use it?\n\n{t}"),
    ("question", "{t}\n\nAccording to the text above, what happens in the special cases or "
                 "errors it mentions?"),
    ("question", "Here is a piece of documentation:\n\n{t}\n\nWhat is the main point a "
                 "programmer should remember from it?"),
)
PACKAGE_TASKS = (
    ("rewrite", "Rewrite each of these software package descriptions as a full sentence:\n\n{t}"),
    ("extract", "From these package descriptions, extract every programming language, file "
                "format or protocol mentioned:\n\n{t}"),
    ("summarise", "Summarize in two sentences what this list of software packages offers:"
                  "\n\n{t}"),
    ("question", "Here are some software package descriptions:\n\n{t}\n\nWhich of them would "
                 "be most useful to a system administrator, and why?"),
    ("question", "{t}\n\nGroup the packages described above into a few categories."),
)
PACKAGES_PER_TEXT = 5


@dataclass(frozen=True)
class FeatureDataSettings:
    seed: int = 0
    tokens: int = 150_000  # answer tokens to generate (training and held-out together)
    max_new_tokens: int = 160
    streams: int = CPU_STREAMS


def shard_path(data_dir: Path, index: int) -> Path:
    return data_dir / f"feature-shard-{index:05d}.pt"


def existing_shards(data_dir: Path) -> list[Path]:
    return sorted(data_dir.glob("feature-shard-*.pt"))


def save_atomic(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_rows(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = torch.load(path, weights_only=True)
    return rows


def held_out(text: str) -> bool:
    digest = hashlib.sha256(("held-out:" + text).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < HELD_OUT_SHARE


def bench_prompts(name: str) -> list[str]:
    """The user messages of one of the benchmark's evaluation sets."""
    data = json.loads((BENCH_DIR / f"{name}.json").read_text(encoding="utf-8"))
    return [p["messages"][-1]["content"] for p in data["prompts"]]


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


class Exclusion:
    """The evaluation sets' prompts: a training prompt equal to one, or whose text (a
    passage or a message) occurs in one, is dropped."""

    def __init__(self) -> None:
        self.texts = [_norm(t) for name in BENCH_SETS for t in bench_prompts(name)]
        self.dropped = 0

    def excludes(self, prompt: str, text: str | None = None) -> bool:
        p, t = _norm(prompt), _norm(text) if text else None
        hit = any(p == e or p in e or e in p or (t is not None and (t in e or e in t))
                  for e in self.texts)
        self.dropped += hit
        return hit


def magpie_prefix(tokenizer: Any) -> list[int]:
    """The chat template rendered up to and including the user turn's header (with the
    default system prompt the template inserts)."""
    text = tokenizer.decode(encode_chat(tokenizer, [{"role": "user", "content": ""}]))
    header = "<|im_start|>user\n"
    if header not in text:
        raise ValueError("magpie prompts need a ChatML template (<|im_start|>user)")
    cut = text.index(header) + len(header)
    return [int(i) for i in tokenizer(text[:cut], add_special_tokens=False)["input_ids"]]


def grounded_prompts(pools: prompt_source.Pools, rng: random.Random, count: int
                     ) -> list[tuple[str, str, str]]:
    """``count`` grounded prompts: (kind, prompt, the text it is about)."""
    out = []
    for _ in range(count):
        if pools.passages and (not pools.topics or rng.random() < 0.7):
            text = rng.choice(pools.passages)
            kind, template = rng.choice(PASSAGE_TASKS)
        else:
            chosen = rng.sample(pools.topics, min(PACKAGES_PER_TEXT, len(pools.topics)))
            text = "\n".join(f"- {d}" for d in chosen)
            kind, template = rng.choice(PACKAGE_TASKS)
        out.append((kind, template.format(t=text), text))
    return out


def features(target: Any, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """The target's final-normed hidden state at every position of each sequence
    (``[len, hidden]`` float32), a few sequences per pass, in chunks of at most 512."""
    out: list[torch.Tensor] = []
    for start in range(0, len(sequences), FEATURE_BATCH):
        group = [list(s) for s in sequences[start:start + FEATURE_BATCH]]
        states = [target.new_state() for _ in group]
        parts: list[list[torch.Tensor]] = [[] for _ in group]
        try:
            for offset in range(0, max(len(s) for s in group), FEATURE_CHUNK):
                items, where = [], []
                for i, s in enumerate(group):
                    piece = s[offset:offset + FEATURE_CHUNK]
                    if piece:
                        items.append(BatchItem(states[i], piece, 1, features=True))
                        where.append(i)
                prepared = target.prepare_pass(items)
                target.run_pass(prepared)
                for i, f in zip(where, prepared.features, strict=True):
                    assert f is not None
                    parts[i].append(f.float().cpu())
        finally:
            for state in states:
                target.release(state)
        out.extend(torch.cat(p) for p in parts)
    return out


def _rows(target: Any, prompts: list[list[int]], meta: list[dict[str, Any]],
          answers: Sequence[Any]) -> list[dict[str, Any]]:
    seqs = [torch.cat([a.prompt_ids, a.answer_ids]) for a in answers]
    feats = features(target, [s.tolist() for s in seqs])
    return [{**m, "prompt_ids": a.prompt_ids.long(), "answer_ids": a.answer_ids.long(),
             "features": f.to(torch.float16)}
            for m, a, f in zip(meta, answers, feats, strict=True)]


def answer_with_features(target: Any, prompts: list[list[int]], meta: list[dict[str, Any]],
                         max_new_tokens: int, streams: int, rng: random.Random,
                         seed_base: int) -> list[dict[str, Any]]:
    """Answers (mostly greedy, some sampled) to ``prompts`` with the target's features."""
    sampled = [rng.random() < SAMPLED_SHARE for _ in prompts]
    rows: list[dict[str, Any]] = []
    for temperature in (0.0, SAMPLED_TEMPERATURE):
        pick = [i for i, s in enumerate(sampled) if s == (temperature > 0)]
        if not pick:
            continue
        seeds = [seed_base + i for i in pick] if temperature > 0 else None
        answers = answer_all(target, [prompts[i] for i in pick], max_new_tokens, 1, streams,
                             temperature, seeds)
        rows += _rows(target, [prompts[i] for i in pick],
                      [{**meta[i], "greedy": temperature == 0} for i in pick], answers)
    return rows


def generate(target: Any, data_dir: Path, settings: FeatureDataSettings,
             on_progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Fill ``data_dir`` until ``settings.tokens`` answer tokens exist (resuming at the
    first missing shard), and answer the evaluation sets once; returns sizes and timings."""
    import time

    from specdistill.data import load_or_make_pools

    data_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = target.tokenizer
    stats_path = data_dir / "feature-data.json"
    stats: dict[str, Any] = (json.loads(stats_path.read_text()) if stats_path.exists()
                             else {"seconds": 0.0, "magpie_sampled": 0, "magpie_kept": 0,
                                   "excluded": 0})
    seen: set[str] = set()
    have = 0
    shards = existing_shards(data_dir)
    for path in shards:
        for row in load_rows(path):
            seen.add(_norm(row["text"]))
            have += int(row["answer_ids"].numel())
    if on_progress is not None:
        on_progress(have)
    pools = load_or_make_pools(data_dir, settings.seed)
    exclusion = Exclusion()
    prefix = magpie_prefix(tokenizer)
    index = len(shards)
    while have < settings.tokens:
        started = time.perf_counter()
        rng = random.Random(settings.seed * 1_000_003 + index)
        base = (settings.seed * 1_000_003 + index) * 10_000
        replies = answer_all(target, [prefix] * ROUND_MAGPIE, MAGPIE_MAX_TOKENS, 1,
                             settings.streams, 1.0, [base + i for i in range(ROUND_MAGPIE)])
        items: list[tuple[str, str, str | None]] = []
        for reply in replies:
            ids = reply.answer_ids.tolist()
            if not ids or ids[-1] not in target.eos_token_ids:  # unfinished
                continue
            text = tokenizer.decode(ids, skip_special_tokens=True).strip()
            if not text or _norm(text) in seen or exclusion.excludes(text):
                continue
            seen.add(_norm(text))
            items.append(("magpie", text, None))
        stats["magpie_sampled"] += len(replies)
        stats["magpie_kept"] += len(items)
        for kind, prompt, text in grounded_prompts(pools, rng, ROUND_GROUNDED):
            if _norm(prompt) in seen or exclusion.excludes(prompt, text):
                continue
            seen.add(_norm(prompt))
            items.append((kind, prompt, text))
        prompts = [encode_chat(tokenizer, [{"role": "user", "content": p}]) for _, p, _ in items]
        meta = [{"kind": k, "text": p, "held_out": held_out(p)} for k, p, _ in items]
        rows = answer_with_features(target, prompts, meta, settings.max_new_tokens,
                                    settings.streams, rng, base + 5_000)
        save_atomic(rows, shard_path(data_dir, index))
        have += sum(int(r["answer_ids"].numel()) for r in rows)
        stats["seconds"] += time.perf_counter() - started
        stats["excluded"] += exclusion.dropped
        exclusion.dropped = 0
        stats["answer_tokens"] = have
        stats["shards"] = index + 1
        stats_path.write_text(json.dumps(stats, indent=2) + "\n")
        index += 1
        if on_progress is not None:
            on_progress(have)
    for name in BENCH_SETS:
        path = data_dir / f"eval-{name}.pt"
        if path.exists():
            continue
        started = time.perf_counter()
        texts = bench_prompts(name)
        prompts = [encode_chat(tokenizer, [{"role": "user", "content": t}]) for t in texts]
        answers = answer_all(target, prompts, EVAL_MAX_TOKENS, 1, settings.streams)
        meta = [{"kind": name, "text": t, "held_out": True, "greedy": True} for t in texts]
        save_atomic(_rows(target, prompts, meta, answers), path)
        stats[f"eval_{name}_seconds"] = round(time.perf_counter() - started, 1)
        stats_path.write_text(json.dumps(stats, indent=2) + "\n")
    stats["answer_tokens"] = have
    return stats


def load_split(data_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training rows, held-out rows) of every shard on disk; at least one held out."""
    train: list[dict[str, Any]] = []
    held: list[dict[str, Any]] = []
    for path in existing_shards(data_dir):
        for row in load_rows(path):
            (held if row["held_out"] else train).append(row)
    if not held and len(train) > 1:  # a tiny run: hold out its last prompt
        held.append(train.pop())
    return train, held


@dataclass(frozen=True)
class Batch:
    tokens: torch.Tensor  # [B, N] row j's token t_j (row p here: t_{p+1})
    feats: torch.Tensor  # [B, N, H] the real feature before it
    targets: torch.Tensor  # [B, N, H] the feature the row's output should match
    answer: torch.Tensor  # [B, N] bool: the row predicts an answer token (or follows one)
    ok: torch.Tensor  # [B, N] bool: the next row's token is the target's greedy one


def make_batch(rows: Sequence[dict[str, Any]], max_len: int,
               greedy_ids: Sequence[torch.Tensor] | None = None) -> Batch:
    """Rows p = 0..L-2 of each sequence (token t_{p+1}, feature f_p, target f_{p+1}),
    right-padded; ``greedy_ids``: the target's argmax after each position, for ``ok``."""
    seqs = [torch.cat([r["prompt_ids"], r["answer_ids"]])[:max_len] for r in rows]
    n = max(len(s) for s in seqs) - 1
    h = int(rows[0]["features"].shape[1])
    b = len(rows)
    tokens = torch.zeros(b, n, dtype=torch.long)
    feats = torch.zeros(b, n, h)
    targets = torch.zeros(b, n, h)
    answer = torch.zeros(b, n, dtype=torch.bool)
    ok = torch.zeros(b, n, dtype=torch.bool)
    for i, (r, s) in enumerate(zip(rows, seqs, strict=True)):
        m = len(s) - 1
        f = r["features"][:len(s)].float()
        tokens[i, :m] = s[1:]
        feats[i, :m] = f[:-1]
        targets[i, :m] = f[1:]
        answer[i, max(0, len(r["prompt_ids"]) - 2):m] = True
        if greedy_ids is not None:
            g = greedy_ids[i][:m]  # argmax of f_{p+1}
            ok[i, :m - 1] = s[2:] == g[:m - 1]
    return Batch(tokens, feats, targets, answer, ok)
