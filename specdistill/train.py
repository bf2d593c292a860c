"""Knowledge distillation of a small draft from the target's own answers.

Each training sequence is a prompt and the target's greedy answer; at every
answer position the draft's distribution over its head's tokens is pulled
towards the target's top-k distribution there (cross-entropy to the target's
renormalised top-k, i.e. forward KL up to a constant). Only the draft runs:
the target's distributions were recorded when the data was generated.

Held-out acceptance is the share of held-out answer positions where the
draft's greedy token equals the target's (teacher forcing), which is what
greedy speculative decoding accepts per drafted token.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from runtime.drafts import draft_format as draft_format
from specdistill.data import HELD_OUT_NAME, Example, existing_shards, load_shard, save_atomic

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"
WARMUP_STEPS = 20
MIN_LR_SHARE = 0.1  # cosine decay ends at this share of the peak learning rate
GRAD_CLIP = 1.0
ADAM_BETAS = (0.9, 0.95)


@dataclass(frozen=True)
class TrainSettings:
    layers: int = 2
    from_layers: tuple[int, ...] | None = None  # target layers to start from (default: first)
    vocab_top_k: int | None = 8192
    steps: int = 600
    batch_tokens: int = 4096  # padded tokens per step
    lr: float = 3e-3
    seed: int = 0
    max_len: int = 512
    eval_every: int = 50
    init_from: str | None = None  # a draft directory to continue from, instead of the target


@dataclass(frozen=True)
class Progress:
    step: int
    steps: int
    loss: float
    acceptance: float | None  # held-out, when just measured


def source_layers(target_layers: int, layers: int, chosen: Sequence[int] | None = None
                  ) -> list[int]:
    """The target layers the draft's layers start from: ``chosen``, else the first ``layers``.

    Measured on the default model (2 layers, 30 steps, same data): starting from layers 0
    and 1 reached 19.6% held-out acceptance, from 0 and 29 (first and last) 14.8%; the
    last layer's output scale makes the first steps spend themselves on shrinking logits.
    """
    if chosen:
        if len(chosen) != layers or not all(0 <= i < target_layers for i in chosen):
            raise ValueError(
                f"--from-layers needs {layers} layer indexes in 0..{target_layers - 1}")
        return list(chosen)
    if layers < 1 or layers > target_layers:
        raise ValueError(f"--layers must be 1..{target_layers}")
    return list(range(layers))


def starting_draft(settings: TrainSettings) -> tuple[Path, draft_format.DraftInfo]:
    """The directory and description of the draft ``settings.init_from`` names; refused
    unless it has the run's number of layers and head size."""
    directory = draft_format.resolve_draft_dir(str(settings.init_from))
    if directory is None:
        raise ValueError(f"--init-from {settings.init_from}: not a draft directory "
                         f"(no {draft_format.CONFIG_NAME})")
    info = draft_format.DraftInfo.load(directory)
    if len(info.source_layers) != settings.layers or info.vocab_top_k != settings.vocab_top_k:
        raise ValueError(
            f"--init-from {settings.init_from} has {len(info.source_layers)} layers and a head "
            f"over {info.vocab_top_k or 'all'} tokens; pass --layers "
            f"{len(info.source_layers)} --vocab-top {info.vocab_top_k or 0}")
    return directory, info


def choose_vocab(examples: Sequence[Example], k: int, vocab_size: int,
                 always: Sequence[int]) -> torch.Tensor:  # [k]
    """The ``k`` tokens the target produces most often (ties: lower id), ``always`` included."""
    counts: Counter[int] = Counter()
    for e in examples:
        counts.update(e.answer_ids.tolist())
        counts.update({t: 0 for t in e.top_ids[:, 1].tolist() if t not in counts})
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    chosen = list(dict.fromkeys([*always, *ranked]))[:k]
    if len(chosen) < k:  # too little data: fill with the lowest remaining ids
        taken = set(chosen)
        chosen.extend(i for i in range(vocab_size) if i not in taken)
        chosen = chosen[:k]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def plan_batches(count: int, length: Callable[[int], int], batch_tokens: int, seed: int,
                 window: int) -> list[list[int]]:
    """One epoch's batches of the indexes below ``count``: shuffled by ``seed``, sorted by
    ``length`` within windows of ``window`` (little padding, still shuffled), each under
    ``batch_tokens`` padded tokens, the batches shuffled too."""
    rng = random.Random(seed)
    order = list(range(count))
    rng.shuffle(order)
    plan: list[list[int]] = []
    for start in range(0, len(order), window):
        batch: list[int] = []
        for i in sorted(order[start:start + window], key=length):
            if batch and max(length(j) for j in [*batch, i]) * (len(batch) + 1) > batch_tokens:
                plan.append(batch)
                batch = []
            batch.append(i)
        if batch:
            plan.append(batch)
    rng.shuffle(plan)
    return plan


class Batches:
    """Deterministic epochs of length-bucketed batches, resumable by (epoch, cursor)."""

    def __init__(self, examples: Sequence[Example], batch_tokens: int, max_len: int,
                 seed: int) -> None:
        self.examples = examples
        self.batch_tokens = batch_tokens
        self.max_len = max_len
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self._plan = self._make_plan(0)

    def _make_plan(self, epoch: int) -> list[list[int]]:
        return plan_batches(len(self.examples), self._length, self.batch_tokens,
                            self.seed * 7919 + epoch, window=256)

    def _length(self, i: int) -> int:
        e = self.examples[i]
        return min(self.max_len, int(e.prompt_ids.numel() + e.answer_ids.numel()))

    def next(self) -> list[Example]:
        if self.cursor >= len(self._plan):
            self.epoch += 1
            self.cursor = 0
            self._plan = self._make_plan(self.epoch)
        batch = self._plan[self.cursor]
        self.cursor += 1
        return [self.examples[i] for i in batch]

    def seek(self, epoch: int, cursor: int) -> None:
        self.epoch, self.cursor = epoch, cursor
        self._plan = self._make_plan(epoch)


@dataclass(frozen=True)
class Tensors:
    input_ids: torch.Tensor  # [b, width]
    attention_mask: torch.Tensor  # [b, width]
    rows: torch.Tensor  # [m] batch row of each answer position
    cols: torch.Tensor  # [m] position whose output predicts the answer token
    answer: torch.Tensor  # [m] the target's greedy token
    top_ids: torch.Tensor  # [m, top_k]
    top_logprobs: torch.Tensor  # [m, top_k]

    def to(self, device: torch.device) -> Tensors:
        if self.input_ids.device == device:
            return self
        return Tensors(*(getattr(self, f.name).to(device, non_blocking=True)
                         for f in fields(self)))


def collate(batch: Sequence[Example], max_len: int, pad: int) -> Tensors:
    seqs, rows, cols, answers, tops, lps = [], [], [], [], [], []
    for row, e in enumerate(batch):
        p = int(e.prompt_ids.numel())
        n = min(int(e.answer_ids.numel()), max_len - p)
        seqs.append(torch.cat([e.prompt_ids, e.answer_ids[:n]]))
        rows.append(torch.full((n,), row))
        cols.append(torch.arange(p - 1, p - 1 + n))
        answers.append(e.answer_ids[:n])
        tops.append(e.top_ids[:n])
        lps.append(e.top_logprobs[:n])
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(seqs):
        ids[row, :len(s)] = s
        mask[row, :len(s)] = 1
    return Tensors(ids, mask, torch.cat(rows), torch.cat(cols), torch.cat(answers),
                   torch.cat(tops), torch.cat(lps).float())


def subset_index(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [vocab]
    """Position of each vocabulary token in the head's id list, -1 outside it."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[ids] = torch.arange(ids.numel())
    return index


def loss_and_hits(draft: Any, t: Tensors, index: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Mean cross-entropy to the target's top-k (restricted to the head's set), and how
    many answer positions the draft's greedy choice matches."""
    t = t.to(index.device)
    hidden = draft.model(input_ids=t.input_ids, attention_mask=t.attention_mask).last_hidden_state
    picked = hidden[t.rows, t.cols]  # [m, hidden]
    head = draft.lm_head
    log_q = torch.log_softmax(head.subset_logits(picked).float(), dim=-1)  # [m, K]
    where = index[t.top_ids]  # [m, top_k]
    teacher = t.top_logprobs.exp() * (where >= 0)  # [m, top_k]
    mass = teacher.sum(-1, keepdim=True)
    keep = mass.squeeze(-1) > 0
    teacher = teacher / mass.clamp_min(1e-9)
    ce = -(teacher * log_q.gather(-1, where.clamp_min(0))).sum(-1)  # [m]
    loss = ce[keep].mean() if bool(keep.any()) else log_q.sum() * 0.0
    hits = int((head.ids[log_q.argmax(-1)] == t.answer).sum())
    return loss, hits, int(t.answer.numel())


@torch.no_grad()
def held_out_acceptance(draft: Any, examples: Sequence[Example], index: torch.Tensor,
                        pad: int, batch_tokens: int, max_len: int) -> float:
    draft.eval()
    hits = total = 0
    batches = Batches(examples, batch_tokens, max_len, seed=0)
    for batch_ids in batches._plan:
        t = collate([examples[i] for i in batch_ids], max_len, pad)
        _, h, n = loss_and_hits(draft, t, index)
        hits, total = hits + h, total + n
    draft.train()
    return hits / max(total, 1)


def lr_at(step: int, settings: TrainSettings) -> float:
    if step < WARMUP_STEPS:
        return settings.lr * (step + 1) / WARMUP_STEPS
    done = (step - WARMUP_STEPS) / max(1, settings.steps - WARMUP_STEPS)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, done)))
    return settings.lr * (MIN_LR_SHARE + (1 - MIN_LR_SHARE) * cosine)


def train(target_dir: str, data_dir: Path, work_dir: Path, out_dir: Path,
          settings: TrainSettings, made_with: dict[str, Any],
          on_progress: Callable[[Progress], None] | None = None,
          device: str = "cpu") -> dict[str, Any]:
    """Train (or resume training) on ``device`` and write the draft directory; returns
    the results. A checkpoint resumes on any device."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target: Any = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    target = target.to(torch.device(device)).eval()
    vocab_size = int(target.get_input_embeddings().weight.shape[0])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    examples = [e for path in existing_shards(data_dir) for e in load_shard(path)]
    held = load_shard(data_dir / HELD_OUT_NAME)
    if not examples:
        raise RuntimeError(f"no training data in {data_dir}")
    ckpt_path = work_dir / CHECKPOINT_NAME
    ckpt = (torch.load(ckpt_path, weights_only=False, map_location="cpu")
            if ckpt_path.exists() else None)
    if settings.init_from:  # an earlier draft: its layers, head and token set
        directory, info = starting_draft(settings)
        draft = draft_format.load_model(directory, target)  # checks that it fits the target
        layers = list(info.source_layers)
        vocab_ids = draft.lm_head.ids.cpu() if settings.vocab_top_k else None
    else:
        if ckpt is not None:
            vocab_ids = ckpt["vocab_ids"]
        elif settings.vocab_top_k:
            always = sorted({int(t) for t in [tokenizer.eos_token_id, pad] if t is not None})
            vocab_ids = choose_vocab(examples, settings.vocab_top_k, vocab_size, always)
        else:
            vocab_ids = None
        layers = source_layers(int(target.config.num_hidden_layers), settings.layers,
                               settings.from_layers)
        draft = draft_format.init_from_target(target, layers, vocab_ids)
    draft = draft.to(device)
    draft.model.embed_tokens.weight.requires_grad_(False)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, betas=ADAM_BETAS, weight_decay=0.0)
    batches = Batches(examples, settings.batch_tokens, settings.max_len, settings.seed)
    step, seconds, history = 0, 0.0, []
    if ckpt is not None:
        draft.load_state_dict(ckpt["draft"], strict=False)
        optimizer.load_state_dict(ckpt["optimizer"])
        batches.seek(ckpt["epoch"], ckpt["cursor"])
        step, seconds, history = ckpt["step"], ckpt["seconds"], ckpt["history"]
        torch.set_rng_state(ckpt["torch_rng"])
        log.info("resuming at step %d of %d", step, settings.steps)
    index = subset_index(draft.lm_head.ids.cpu(), vocab_size)
    coverage = _coverage(held, index)
    index = index.to(device)
    draft.train()
    loss_avg: float | None = None
    acceptance = history[-1]["acceptance"] if history else None
    while step < settings.steps:
        started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, settings)
        t = collate(batches.next(), settings.max_len, pad)
        loss, _, _ = loss_and_hits(draft, t, index)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        optimizer.step()
        step += 1
        value = float(loss.detach())
        loss_avg = value if loss_avg is None else 0.9 * loss_avg + 0.1 * value
        measured = None
        if step % settings.eval_every == 0 or step == settings.steps:
            measured = acceptance = held_out_acceptance(
                draft, held, index, pad, settings.batch_tokens, settings.max_len)
            history.append({"step": step, "loss": round(loss_avg, 4),
                            "acceptance": round(acceptance, 4)})
        seconds += time.perf_counter() - started
        if measured is not None:
            state = {"draft": draft_format.stored_state(draft), "optimizer": optimizer.state_dict(),
                     "epoch": batches.epoch, "cursor": batches.cursor, "step": step,
                     "seconds": seconds, "history": history, "vocab_ids": vocab_ids,
                     "torch_rng": torch.get_rng_state()}
            save_atomic(state, ckpt_path)
            _write(draft, target, target_dir, out_dir, settings, layers, made_with,
                   _results(examples, held, step, seconds, history, coverage, batches.epoch))
        if on_progress is not None:
            on_progress(Progress(step, settings.steps, loss_avg, measured))
    results = _results(examples, held, step, seconds, history, coverage, batches.epoch)
    _write(draft, target, target_dir, out_dir, settings, layers, made_with, results)
    return results


def _coverage(held: Sequence[Example], index: torch.Tensor) -> float:
    answers = torch.cat([e.answer_ids for e in held])
    return float((index[answers] >= 0).float().mean())


def _results(examples: Sequence[Example], held: Sequence[Example], step: int, seconds: float,
             history: list[dict[str, Any]], coverage: float, epoch: int) -> dict[str, Any]:
    return {
        "train_prompts": len(examples),
        "train_answer_tokens": sum(int(e.answer_ids.numel()) for e in examples),
        "held_out_prompts": len(held),
        "held_out_answer_tokens": sum(int(e.answer_ids.numel()) for e in held),
        "held_out_head_coverage": round(coverage, 4),
        "steps": step, "epochs_started": epoch + 1, "train_seconds": round(seconds, 1),
        "history": history,
    }


def _write(draft: Any, target: Any, target_dir: str, out_dir: Path, settings: TrainSettings,
           layers: list[int], made_with: dict[str, Any], results: dict[str, Any]) -> None:
    info = draft_format.DraftInfo(
        target=draft_format.target_identity(target, Path(target_dir).name),
        model=draft.config.to_dict(),
        source_layers=layers,
        vocab_top_k=settings.vocab_top_k,
        seed=settings.seed,
        made_with={**made_with, "training": _settings_dict(settings), "results": results},
    )
    draft_format.save(draft, info, out_dir)


def _settings_dict(settings: TrainSettings) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(settings)
