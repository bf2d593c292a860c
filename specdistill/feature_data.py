"""Data for a feature draft: chat-like prompts, the target's answers, and its features.

The target answers on its served runtime (the batched runner, its native kernels and the
weights it serves), up to ``streams`` answers growing together, and every pass keeps the
hidden states of the positions it adds (``feature_gen.grow``): no second pass. Each
prompt is run once and answered three ways (``ANSWER_TEMPERATURES``: greedy, and sampled
at the default model's recommended 0.2 and at 0.7, each with its own seed).

Prompts come in two kinds, mixed in every round:

- Magpie conversations: the target writes the user's message itself, given only its chat
  template up to the user turn (the default system prompt included), sampled at
  temperature 1 among its 40 most likely tokens; a share of the conversations go on for
  more turns, the target writing the user's next message after its own greedy answer.
  Unfinished, empty and (within a round) repeated messages are dropped.
- Grounded tasks over a given text: rewrite, extract, summarise, answer a question about a
  Python standard-library docstring paragraph or a list of Debian package one-liners, and
  edit or explain a short standard-library function (``prompts.py``'s pools), taken in a
  seeded order without repeats.

No prompt of the benchmark's evaluation sets (``specbench/prompts/chat.json`` and
``grounded.json``) is trained on: a prompt equal to one of theirs, a prompt or grounded
passage that occurs in one of theirs (or the other way round) is dropped and counted.
About 5% of the data is held out by a hash of its text (the passage of a grounded task,
the first message of a conversation), whatever the seed.

A round's records go to one shard (float16 features; with ``layers``, those layers'
outputs too, for EAGLE-3's fused features) when its last conversation ends. A round is a
function of the seed and its index alone, so an interrupted run resumes with the rounds
that have no shard, and deletes the partial files it left. Shards stop at a stated disk
budget. ``feature-data.json`` in the data directory is the report: sizes, the rate in
answer tokens a second, and the passes' own rate beside it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from decoding.prompting import encode_chat
from specdistill import prompts as prompt_source
from specdistill.data import CPU_STREAMS
from specdistill.feature_gen import Done, GrowStats, Job, grow

log = logging.getLogger(__name__)

ROUND_MAGPIE = 16  # conversations the target starts per round (some are dropped)
ROUND_GROUNDED = 16  # grounded prompts per round
TURNS = ((1, 0.6), (2, 0.25), (3, 0.15))  # a conversation's user turns, and their shares
MAGPIE_TEMPERATURE = 1.0
MAGPIE_MAX_TOKENS = 96
ANSWER_TEMPERATURES = (0.0, 0.2, 0.7)
MAX_PROMPT_TOKENS = 768  # a conversation ends before a turn whose prompt passes this
HELD_OUT_SHARE = 0.05
EVAL_MAX_TOKENS = 128
ROUNDS_IN_FLIGHT = 4  # rounds whose records are held in memory at once (a 3-turn
# conversation runs through about three rounds of single answers)
DEFAULT_DISK_GB = 40.0
FORMAT_VERSION = 2
BENCH_SETS = ("chat", "grounded")
BENCH_DIR = Path(__file__).resolve().parent.parent / "specbench" / "prompts"
REPORT_NAME = "feature-data.json"

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
CODE_TASKS = (
    ("edit", "Add type hints to this Python function and give back the whole function."
             "\n\n```python\n{t}\n```"),
    ("edit", "Rewrite this function so that it is easier to read, keeping what it does."
             "\n\n```python\n{t}\n```"),
    ("edit", "Add a docstring to this function.\n\n```python\n{t}\n```"),
    ("edit", "```python\n{t}\n```\n\nRename the variables in this code to clearer names."),
    ("question", "Explain what this Python function does, step by step.\n\n```python\n{t}"
                 "\n```"),
    ("extract", "List the arguments of this function and every function it calls."
                "\n\n```python\n{t}\n```"),
    ("summarise", "In one sentence, what does this function do?\n\n```python\n{t}\n```"),
)


@dataclass(frozen=True)
class FeatureDataSettings:
    seed: int = 0
    tokens: int = 150_000  # answer tokens to generate (training and held-out together)
    max_new_tokens: int = 160
    streams: int = CPU_STREAMS
    layers: tuple[int, ...] = ()  # layers whose outputs are kept too (EAGLE-3's)
    disk_gb: float = DEFAULT_DISK_GB  # the shards' budget


def default_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers (2, 15 and 27 of 30); none below 6 layers."""
    if num_layers < 6:
        return ()
    return (2, num_layers // 2, num_layers - 3)


def shard_path(data_dir: Path, index: int) -> Path:
    return data_dir / f"features-{index:05d}.pt"


def existing_shards(data_dir: Path) -> list[Path]:
    """Every shard on disk: this version's, and rows of the first version's."""
    return sorted(data_dir.glob("features-*.pt")) + sorted(data_dir.glob("feature-shard-*.pt"))


def save_atomic(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_rows(path: Path, layers: bool = False) -> list[dict[str, Any]]:
    """A shard's rows, one per answer (records of several answers are flattened); the
    captured layers' outputs only with ``layers`` (they are three times the rest)."""
    rows: list[dict[str, Any]] = torch.load(path, weights_only=True)
    return [r for row in rows for r in (flatten(row, layers) if "answers" in row else [row])]


def flatten(record: dict[str, Any], layers: bool = False) -> list[dict[str, Any]]:
    """One row per answer of a record: its prompt and answer ids, and the features of
    every position of both (and with ``layers`` the captured layers', when kept)."""
    out = []
    for a in record["answers"]:
        row = {"kind": record["kind"], "text": record["text"], "held_out": record["held_out"],
               "turn": int(record.get("turn", 1)), "greedy": a["temperature"] == 0,
               "temperature": a["temperature"],
               "prompt_ids": record["prompt_ids"].long(), "answer_ids": a["answer_ids"].long(),
               "features": torch.cat([record["features"], a["features"]])}
        if layers and "layers" in record:
            row["layers"] = torch.cat([record["layers"], a["layers"]])
        out.append(row)
    return out


def held_out(text: str) -> bool:
    """Whether ``text`` (a grounded task's passage, a conversation's first message) is held
    out: a hash of the text alone, the same for every seed."""
    digest = hashlib.sha256(("held-out:" + text).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < HELD_OUT_SHARE


def bench_prompts(name: str) -> list[str]:
    """The user messages of one of the benchmark's evaluation sets."""
    data = json.loads((BENCH_DIR / f"{name}.json").read_text(encoding="utf-8"))
    return [p["messages"][-1]["content"] for p in data["prompts"]]


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


class Exclusion:
    """The evaluation sets' prompts: a training prompt equal to one, or a prompt or
    grounded passage that occurs in one (or one in it), is dropped and counted."""

    def __init__(self) -> None:
        self.texts = [_norm(t) for name in BENCH_SETS for t in bench_prompts(name)]
        self.dropped = 0

    def excludes(self, prompt: str, text: str | None = None) -> bool:
        p, t = _norm(prompt), _norm(text) if text else None
        hit = any(p == e or p in e or e in p or (t is not None and (t in e or e in t))
                  for e in self.texts)
        self.dropped += hit
        return hit


def magpie_prefix(tokenizer: Any, messages: Sequence[dict[str, str]] = ()) -> list[int]:
    """The chat template rendered over ``messages`` (none: the default system prompt the
    template inserts) up to and including the next user turn's header."""
    text = tokenizer.decode(encode_chat(tokenizer, [*messages, {"role": "user", "content": ""}]))
    header = "<|im_start|>user\n"
    if header not in text:
        raise ValueError("magpie prompts need a ChatML template (<|im_start|>user)")
    cut = text.rindex(header) + len(header)
    return [int(i) for i in tokenizer(text[:cut], add_special_tokens=False)["input_ids"]]


def grounded_items(pools: prompt_source.Pools, seed: int) -> list[tuple[str, str, str]]:
    """Every grounded task the pools give, (kind, prompt, the text it is about), in a
    seeded order: each passage and function under every task, each group of
    ``PACKAGES_PER_TEXT`` package one-liners under one."""
    items = [(kind, template.format(t=text), text) for text in pools.passages
             for kind, template in PASSAGE_TASKS]
    items += [(kind, template.format(t=text), text) for text in pools.code
              for kind, template in CODE_TASKS]
    for g in range(len(pools.topics) // PACKAGES_PER_TEXT):
        text = "\n".join(f"- {d}" for d in pools.topics[g * PACKAGES_PER_TEXT:
                                                         (g + 1) * PACKAGES_PER_TEXT])
        kind, template = PACKAGE_TASKS[g % len(PACKAGE_TASKS)]
        items.append((kind, template.format(t=text), text))
    random.Random(seed).shuffle(items)
    return items


def grounded_round(items: Sequence[tuple[str, str, str]], index: int, exclusion: Exclusion
                   ) -> list[tuple[int, tuple[str, str, str]]]:
    """Round ``index``'s grounded tasks (``ROUND_GROUNDED`` of ``items`` in turn), with
    their places; those the exclusion drops (it counts them) and repeats left out."""
    out, seen = [], set()
    for j in range(ROUND_GROUNDED):
        kind, prompt, text = items[(index * ROUND_GROUNDED + j) % len(items)]
        if _norm(prompt) in seen or exclusion.excludes(prompt, text):
            continue
        seen.add(_norm(prompt))
        out.append((j, (kind, prompt, text)))
    return out


def split_key(prompt: str, text: str | None) -> str:
    """The text a task's split follows: its grounded passage, else its (first) message."""
    return text if text else prompt


@dataclass
class _Conversation:
    round: int
    id: int  # its place in the round (the records' order in the shard)
    kind: str
    key: str  # the text its split follows
    turns: int  # user turns to write (magpie) or 1
    messages: list[dict[str, str]] = field(default_factory=list)


@dataclass
class _Round:
    index: int
    live: int = 0  # conversations not ended
    records: list[tuple[int, int, dict[str, Any]]] = field(default_factory=list)
    answer_tokens: int = 0
    seen: set[str] = field(default_factory=set)  # first messages the target wrote


class _Rounds:
    """The rounds of one run: their jobs, their follow-ups, and their shards."""

    def __init__(self, target: Any, data_dir: Path, settings: FeatureDataSettings,
                 stats: dict[str, Any], done_rounds: set[int], tokens_on_disk: int,
                 bytes_on_disk: int, pools: prompt_source.Pools) -> None:
        self.target, self.tokenizer = target, target.tokenizer
        self.data_dir, self.settings, self.stats = data_dir, settings, stats
        todo = sorted(set(range(max(done_rounds, default=-1) + 1)) - done_rounds)
        self.todo = todo  # round indices below ``next`` still to run, in order
        self.next = max(done_rounds, default=-1) + 1
        self.tokens, self.bytes = tokens_on_disk, bytes_on_disk
        self.grounded = grounded_items(pools, settings.seed)
        self.exclusion = Exclusion()
        self.prefix = magpie_prefix(self.tokenizer)
        self.flight: dict[int, _Round] = {}
        self.stopped = ""
        self.started_with = tokens_on_disk
        self.grown: GrowStats | None = None  # this run's passes so far

    def _seed(self, conv: _Conversation, k: int) -> int:
        return ((self.settings.seed * 1_000_003 + conv.round) * 4096 + conv.id) * 64 + k

    def refill(self) -> list[Job]:
        if len(self.flight) >= ROUNDS_IN_FLIGHT:
            return []
        pending = self.tokens + sum(r.answer_tokens for r in self.flight.values())
        if pending >= self.settings.tokens:
            return []
        if self.bytes >= self.settings.disk_gb * 1e9:
            if not self.stopped:
                self.stopped = "disk budget"
                log.warning("the shards reached the disk budget of %.1f GB", self.settings.disk_gb)
            return []
        if self.todo:
            index = self.todo.pop(0)
        else:
            index, self.next = self.next, self.next + 1
        rnd = _Round(index)
        self.flight[index] = rnd
        jobs = self._round_jobs(rnd)
        if rnd.live == 0:  # everything excluded: an empty shard all the same
            self._write(rnd)
        return jobs

    def _round_jobs(self, rnd: _Round) -> list[Job]:
        rng = random.Random(self.settings.seed * 1_000_003 + rnd.index)
        jobs = []
        for c in range(ROUND_MAGPIE):  # conversations first: their follow-ups run longest
            turns = rng.choices([t for t, _ in TURNS], weights=[w for _, w in TURNS])[0]
            conv = _Conversation(rnd.index, c, "magpie", "", turns)
            jobs.append(Job(self.prefix, (MAGPIE_TEMPERATURE,), (self._seed(conv, 0),),
                            MAGPIE_MAX_TOKENS, features=False, tag=conv))
        for j, (kind, prompt, text) in grounded_round(self.grounded, rnd.index,
                                                      self.exclusion):
            conv = _Conversation(rnd.index, ROUND_MAGPIE + j, kind, split_key(prompt, text), 1,
                                 [{"role": "user", "content": prompt}])
            jobs.append(self._answer_job(conv))
        rnd.live = len(jobs)
        return jobs

    def _answer_job(self, conv: _Conversation) -> Job:
        turn = sum(m["role"] == "user" for m in conv.messages)
        return Job(encode_chat(self.tokenizer, conv.messages), ANSWER_TEMPERATURES,
                   [self._seed(conv, 4 * turn + k) for k in range(len(ANSWER_TEMPERATURES))],
                   self.settings.max_new_tokens, tag=conv)

    def on_done(self, done: Done) -> list[Job]:
        conv: _Conversation = done.job.tag
        rnd = self.flight[conv.round]
        if not done.job.features:  # a user message the target wrote
            follow = self._user_message(conv, rnd, done)
        else:
            follow = self._answered(conv, rnd, done)
        if follow is None:
            rnd.live -= 1
            if rnd.live == 0:
                self._write(rnd)
            return []
        return [follow]

    def _user_message(self, conv: _Conversation, rnd: _Round, done: Done) -> Job | None:
        ids = done.answers[0].tokens
        self.stats["magpie_sampled"] += 1
        if not ids or ids[-1] not in self.target.eos_token_ids:  # unfinished
            return None
        text = self.tokenizer.decode(ids, skip_special_tokens=True).strip()
        if not text or any(_norm(text) == _norm(m["content"]) for m in conv.messages):
            return None
        if not conv.messages:  # a first message: once a round
            if _norm(text) in rnd.seen:
                return None
            rnd.seen.add(_norm(text))
        if self.exclusion.excludes(text):
            return None
        self.stats["magpie_kept"] += 1
        conv.messages.append({"role": "user", "content": text})
        conv.key = conv.key or split_key(text, None)
        job = self._answer_job(conv)
        return job if len(job.prompt) <= MAX_PROMPT_TOKENS else None

    def _answered(self, conv: _Conversation, rnd: _Round, done: Done) -> Job | None:
        turn = sum(m["role"] == "user" for m in conv.messages)
        record: dict[str, Any] = {
            "version": FORMAT_VERSION, "kind": conv.kind if turn == 1 else f"{conv.kind}-turn",
            "text": conv.messages[-1]["content"], "turn": turn, "held_out": held_out(conv.key),
            "prompt_ids": torch.tensor(done.job.prompt, dtype=torch.int32),
            "features": done.prompt_features, "answers": []}
        if done.prompt_layers is not None:
            record["layers"] = done.prompt_layers
        for a in done.answers:
            answer: dict[str, Any] = {"temperature": a.temperature,
                                      "answer_ids": torch.tensor(a.tokens, dtype=torch.int32),
                                      "features": torch.cat(a.features)}
            if "layers" in record:
                answer["layers"] = torch.cat(a.layers)
            record["answers"].append(answer)
            rnd.answer_tokens += len(a.tokens)
        rnd.records.append((conv.id, turn, record))
        greedy = done.answers[0].tokens
        if turn >= conv.turns or not done.answers[0].ended:
            return None
        conv.messages.append({"role": "assistant", "content": self.tokenizer.decode(
            greedy, skip_special_tokens=True).strip()})
        prefix = magpie_prefix(self.tokenizer, conv.messages)
        if len(prefix) + MAGPIE_MAX_TOKENS > MAX_PROMPT_TOKENS:
            return None
        return Job(prefix, (MAGPIE_TEMPERATURE,), (self._seed(conv, 4 * turn + 3),),
                   MAGPIE_MAX_TOKENS, features=False, tag=conv)

    def _write(self, rnd: _Round) -> None:
        records = [r for _, _, r in sorted(rnd.records, key=lambda x: (x[0], x[1]))]
        path = shard_path(self.data_dir, rnd.index)
        save_atomic(records, path)
        size = path.stat().st_size
        self.tokens += rnd.answer_tokens
        self.bytes += size
        shards = self.stats["shards"]
        shards[str(rnd.index)] = {"answer_tokens": rnd.answer_tokens, "bytes": size,
                                  "records": len(records)}
        self.stats["excluded"] += self.exclusion.dropped
        self.exclusion.dropped = 0
        del self.flight[rnd.index]
        self.write_report()

    def write_report(self) -> None:
        self.stats["answer_tokens"] = self.tokens
        self.stats["bytes"] = self.bytes
        if self.grown is not None:  # this run so far (its entry in "runs" when it ends)
            made, g = self.tokens - self.started_with, self.grown
            self.stats["this_run"] = {
                "answer_tokens": made, "seconds": round(g.seconds, 1),
                "answer_tokens_per_second": round(made / max(g.seconds, 1e-9), 1),
                **_pass_report(g)}
        path = self.data_dir / REPORT_NAME
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.stats, indent=2) + "\n")
        os.replace(tmp, path)


def _on_disk(data_dir: Path, stats: dict[str, Any]) -> tuple[set[int], int, int]:
    """The rounds with a shard, and their answer tokens and bytes (from the report, or
    read where a shard was written after the report was last)."""
    shards: dict[str, Any] = stats["shards"]
    present = {p.name: p for p in existing_shards(data_dir)}
    for key in list(shards):
        if shard_path(data_dir, int(key)).name not in present:
            del shards[key]
    rounds, tokens, size = set(), 0, 0
    for name, path in present.items():
        if name.startswith("feature-shard-"):  # the first version's rows: read on
            tokens += sum(int(r["answer_ids"].numel()) for r in load_rows(path))
            size += path.stat().st_size
            continue
        index = int(name.removeprefix("features-").removesuffix(".pt"))
        if str(index) not in shards:
            records = torch.load(path, weights_only=True)
            shards[str(index)] = {"answer_tokens": sum(int(a["answer_ids"].numel())
                                                       for r in records for a in r["answers"]),
                                  "bytes": path.stat().st_size, "records": len(records)}
        rounds.add(index)
        tokens += shards[str(index)]["answer_tokens"]
        size += shards[str(index)]["bytes"]
    return rounds, tokens, size


def generate(target: Any, data_dir: Path, settings: FeatureDataSettings,
             on_progress: Callable[[int, GrowStats | None], None] | None = None
             ) -> dict[str, Any]:
    """Fill ``data_dir`` until ``settings.tokens`` answer tokens exist or the shards reach
    the disk budget (resuming with the rounds that have no shard), and answer the
    evaluation sets once; returns the report (also written to ``REPORT_NAME``)."""
    from specdistill.data import load_or_make_pools

    data_dir.mkdir(parents=True, exist_ok=True)
    for partial in data_dir.glob("*.tmp"):  # an interrupted run's half-written files
        partial.unlink()
    report_path = data_dir / REPORT_NAME
    stats: dict[str, Any] = (json.loads(report_path.read_text()) if report_path.exists()
                             else {"format": FORMAT_VERSION, "seconds": 0.0,
                                   "magpie_sampled": 0, "magpie_kept": 0, "excluded": 0,
                                   "shards": {}, "runs": []})
    if "this_run" in stats:  # an interrupted run: its figures up to its last shard
        interrupted = stats.pop("this_run")
        stats["runs"].append({**interrupted, "stopped": "interrupted"})
        stats["seconds"] += interrupted["seconds"]
    rounds_done, have, size = _on_disk(data_dir, stats)
    if on_progress is not None:
        on_progress(have, None)
    if settings.layers:
        target.capture_layers(settings.layers)
    rounds = _Rounds(target, data_dir, settings, stats, rounds_done, have, size,
                     load_or_make_pools(data_dir, settings.seed))

    write_report = rounds.write_report
    def progress(g: GrowStats) -> None:
        rounds.grown = g
        if on_progress is not None:
            on_progress(rounds.tokens + sum(r.answer_tokens for r in rounds.flight.values()), g)

    started, cpu = time.time(), time.process_time()
    grown = grow(target, [], settings.streams, rounds.on_done, rounds.refill, progress)
    stats["excluded"] += rounds.exclusion.dropped
    made = rounds.tokens - have
    stats["seconds"] += grown.seconds
    run = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
           "threads": torch.get_num_threads(), **asdict(settings),
           "answer_tokens": made, "seconds": round(grown.seconds, 1),
           "answer_tokens_per_second": round(made / max(grown.seconds, 1e-9), 1),
           "cpu_seconds": round(time.process_time() - cpu, 1),  # all threads'
           "answer_tokens_per_cpu_second": round(made / max(time.process_time() - cpu, 1e-9), 1),
           **_pass_report(grown), "stopped": rounds.stopped or "tokens"}
    stats["runs"].append(run)
    rounds.grown = None
    stats.pop("this_run", None)
    write_report()
    for name in BENCH_SETS:
        path = data_dir / f"eval-{name}.pt"
        if not path.exists():
            t0 = time.perf_counter()
            save_atomic(answer_set(target, bench_prompts(name), name, settings.streams), path)
            stats[f"eval_{name}_seconds"] = round(time.perf_counter() - t0, 1)
            write_report()
    if settings.layers:
        target.capture_layers(())
    return {**stats, "run": run}


def _pass_report(g: GrowStats) -> dict[str, Any]:
    """How the run's time went: its passes (rows, positions, ms) and the rest."""
    passes = max(g.passes, 1)
    return {"passes": g.passes, "mean_rows_per_pass": round(g.rows / passes, 1),
            "mean_positions_per_pass": round(g.positions / passes, 1),
            "ms_per_pass": round(1000 * g.pass_seconds / passes, 2),
            "positions_per_pass_second": round(g.positions / max(g.pass_seconds, 1e-9), 1),
            "share_in_passes": round(g.pass_seconds / max(g.seconds, 1e-9), 3),
            "sampled_tokens": g.answer_tokens, "prompt_tokens": g.prompt_tokens,
            "feature_positions": g.feature_positions}


def answer_set(target: Any, texts: Sequence[str], kind: str, streams: int
               ) -> list[dict[str, Any]]:
    """Greedy answers with features to ``texts`` (single user messages), as rows."""
    records: dict[int, dict[str, Any]] = {}

    def on_done(done: Done) -> list[Job]:
        a = done.answers[0]
        answer = {"temperature": 0.0, "features": torch.cat(a.features),
                  "answer_ids": torch.tensor(a.tokens, dtype=torch.int32)}
        record = {"kind": kind, "text": texts[done.job.tag], "held_out": True,
                  "prompt_ids": torch.tensor(done.job.prompt, dtype=torch.int32),
                  "features": done.prompt_features, "answers": [answer]}
        if done.prompt_layers is not None:  # the captured layers' too
            record["layers"] = done.prompt_layers
            answer["layers"] = torch.cat(a.layers)
        records[done.job.tag] = record
        return []

    jobs = [Job(encode_chat(target.tokenizer, [{"role": "user", "content": t}]), (0.0,), (0,),
                EVAL_MAX_TOKENS, tag=i) for i, t in enumerate(texts)]
    grow(target, jobs, streams, on_done)
    return [row for i in sorted(records) for row in flatten(records[i], layers=True)]


@dataclass
class Scan:
    """What one pass over the shards keeps in memory: the held-out rows, the training
    answers' token counts, and the shards with training rows (read again as they are
    trained on: ``TrainStream``)."""

    train_shards: list[Path]
    held: list[dict[str, Any]]
    train_counts: dict[int, int]
    train_sequences: int = 0
    train_answer_tokens: int = 0


def scan(data_dir: Path, layers: bool = False, max_train_tokens: int = 0) -> Scan:
    """Read every shard once (in order): keep the held-out rows of all (with ``layers``,
    their captured layers' outputs too) and count the training answers' tokens (with
    ``max_train_tokens``, of the first shards only whose training answers reach it)."""
    out = Scan([], [], {})
    counts: Counter[int] = Counter()
    for path in existing_shards(data_dir):
        full = bool(max_train_tokens) and out.train_answer_tokens >= max_train_tokens
        has_train = False
        for row in load_rows(path, layers):
            if row["held_out"]:
                out.held.append(row)
                continue
            if full:
                continue
            has_train = True
            counts.update(row["answer_ids"].tolist())
            out.train_sequences += 1
            out.train_answer_tokens += int(row["answer_ids"].numel())
        if has_train:
            out.train_shards.append(path)
    if not out.held and out.train_shards:  # a tiny run: hold out the last shard's last row
        last = load_rows(out.train_shards[-1], layers)
        rows = [r for r in last if not r["held_out"]]
        out.held.append(rows[-1])
        counts.subtract(rows[-1]["answer_ids"].tolist())
        out.train_sequences -= 1
        out.train_answer_tokens -= int(rows[-1]["answer_ids"].numel())
        if len(rows) == 1:
            out.train_shards.pop()
    out.train_counts = {int(t): int(c) for t, c in counts.items() if c > 0}
    return out


class TrainStream:
    """Training rows a few shards at a time, never all in memory: each epoch takes the
    shards in a seeded order, ``window`` at once, and plans batches over their rows
    (``plan``); a position (epoch, group, batch) resumes exactly where it was."""

    def __init__(self, shards: Sequence[Path], window: int, seed: int, layers: bool,
                 plan: Callable[[Sequence[dict[str, Any]], int], list[list[int]]],
                 position: tuple[int, int, int] = (0, 0, 0)) -> None:
        if not shards:
            raise ValueError("no training shards")
        self.shards, self.window, self.seed, self.layers = list(shards), window, seed, layers
        self.plan = plan
        self.epoch, self.group, self.cursor = position
        self._rows: list[dict[str, Any]] = []
        self._batches: list[list[int]] = []
        self._loaded: tuple[int, int] | None = None

    @property
    def groups(self) -> int:
        return -(-len(self.shards) // self.window)

    @property
    def position(self) -> tuple[int, int, int]:
        return self.epoch, self.group, self.cursor

    @property
    def epochs(self) -> float:
        """Epochs done, counting groups."""
        return self.epoch + self.group / self.groups

    def _load(self) -> None:
        order = list(range(len(self.shards)))
        random.Random(self.seed * 7919 + self.epoch).shuffle(order)
        picked = order[self.group * self.window:(self.group + 1) * self.window]
        self._rows = [r for i in sorted(picked) for r in load_rows(self.shards[i], self.layers)
                      if not r["held_out"]]
        self._batches = self.plan(self._rows, self.epoch * 1009 + self.group)
        self._loaded = (self.epoch, self.group)

    def next(self) -> list[dict[str, Any]]:
        """The next batch's rows (the position then is the batch after it)."""
        while True:
            if self._loaded != (self.epoch, self.group):
                self._load()
            if self.cursor < len(self._batches):
                rows = [self._rows[i] for i in self._batches[self.cursor]]
                self.cursor += 1
                if self.cursor >= len(self._batches):
                    self._advance()
                return rows
            self._advance()

    def _advance(self) -> None:
        self.group, self.cursor = self.group + 1, 0
        if self.group >= self.groups:
            self.epoch, self.group = self.epoch + 1, 0


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
               greedy_ids: Sequence[torch.Tensor] | None = None, layers: bool = False
               ) -> Batch:
    """Rows p = 0..L-2 of each sequence (token t_{p+1}, feature f_p, target f_{p+1}),
    right-padded; ``greedy_ids``: the target's argmax after each position, for ``ok``;
    ``layers``: the feature read is the captured layers' outputs at p (``feats`` is then
    [B, N, L*H]), the target stays f_{p+1}."""
    seqs = [torch.cat([r["prompt_ids"], r["answer_ids"]])[:max_len] for r in rows]
    n = max(len(s) for s in seqs) - 1
    h = int(rows[0]["features"].shape[1])
    b = len(rows)
    tokens = torch.zeros(b, n, dtype=torch.long)
    width = int(rows[0]["layers"].shape[1]) if layers else h
    feats = torch.zeros(b, n, width)
    targets = torch.zeros(b, n, h)
    answer = torch.zeros(b, n, dtype=torch.bool)
    ok = torch.zeros(b, n, dtype=torch.bool)
    for i, (r, s) in enumerate(zip(rows, seqs, strict=True)):
        m = len(s) - 1
        f = r["features"][:len(s)].float()
        tokens[i, :m] = s[1:]
        feats[i, :m] = r["layers"][:m].float() if layers else f[:-1]
        targets[i, :m] = f[1:]
        answer[i, max(0, len(r["prompt_ids"]) - 2):m] = True
        if greedy_ids is not None:
            g = greedy_ids[i][:m]  # argmax of f_{p+1}
            ok[i, :m - 1] = s[2:] == g[:m - 1]
    return Batch(tokens, feats, targets, answer, ok)
