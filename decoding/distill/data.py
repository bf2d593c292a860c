"""Distillation data: the target's own greedy answers, with its next-token distributions.

The target answers prompts from ``prompts.py``, many at once through its batched
runner (a finished answer's place goes to the next prompt). For every answer token
we keep the target's top-``k`` log-probabilities at that position,
so training needs no target forward pass at all (forward KL on the top logits).
Data is written in shards of a fixed number of prompts; shard ``i`` always holds
the same prompts for a given seed, so an interrupted run resumes at the first
missing shard and produces the same data.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from decoding.distill import prompts as prompt_source
from decoding.prompting import encode_chat
from decoding.target import BatchItem, CausalLM

log = logging.getLogger(__name__)

SHARD_PROMPTS = 64
SHARDS_PER_PASS = 4  # prompts answered in one go: few passes run with idle streams
HELD_OUT_NAME = "heldout.pt"


@dataclass(frozen=True)
class DataSettings:
    seed: int = 0
    tokens: int = 200_000  # answer tokens to generate for training
    held_out_prompts: int = 48
    batch_size: int = 32  # answers generated together
    max_new_tokens: int = 128
    top_k: int = 8  # teacher log-probabilities kept per position


@dataclass(frozen=True)
class Example:
    prompt_ids: torch.Tensor  # [p] int64
    answer_ids: torch.Tensor  # [n] int64, the target's greedy answer (ends with EOS if it ended)
    top_ids: torch.Tensor  # [n, top_k] int64, the target's most likely tokens at each position
    top_logprobs: torch.Tensor  # [n, top_k] float16, their log-probabilities

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {"prompt_ids": self.prompt_ids, "answer_ids": self.answer_ids,
                "top_ids": self.top_ids.to(torch.int32), "top_logprobs": self.top_logprobs}

    @staticmethod
    def from_dict(d: dict[str, torch.Tensor]) -> Example:
        return Example(d["prompt_ids"].long(), d["answer_ids"].long(), d["top_ids"].long(),
                       d["top_logprobs"])


def shard_path(data_dir: Path, index: int) -> Path:
    return data_dir / f"shard-{index:05d}.pt"


def load_shard(path: Path) -> list[Example]:
    rows = torch.load(path, weights_only=True)
    return [Example.from_dict(r) for r in rows]


def save_atomic(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def answer_tokens(shard: list[Example]) -> int:
    return sum(int(e.answer_ids.numel()) for e in shard)


def existing_shards(data_dir: Path) -> list[Path]:
    return sorted(data_dir.glob("shard-*.pt"))


@torch.inference_mode()
def answer_all(target: CausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int,
               top_k: int, streams: int) -> list[Example]:
    """The target's greedy answers to ``prompts`` (token ids), in order.

    Up to ``streams`` answers grow together, one forward pass per step: a new prompt
    joins (its whole prefill in the same pass) as soon as an answer ends, so no pass
    is spent on padding or on answers that have already finished."""
    stop = target.eos_token_ids
    results: list[Example | None] = [None] * len(prompts)
    queue = list(range(len(prompts)))[::-1]
    running: list[_Answer] = []
    try:
        while queue or running:
            while queue and len(running) < streams:
                i = queue.pop()
                running.append(_Answer(i, target.new_state(), list(prompts[i])))
            items = [BatchItem(a.state, a.feed, 1) for a in running]
            logits = torch.cat(target.forward_batch(items)).float()  # [n, vocab]
            top = torch.log_softmax(logits, dim=-1).topk(top_k, dim=-1)
            still: list[_Answer] = []
            for row, a in enumerate(running):
                token = int(top.indices[row, 0])  # greedy: the most likely token
                a.tokens.append(token)
                a.top_ids.append(top.indices[row])
                a.top_logprobs.append(top.values[row])
                a.feed = [token]
                if token in stop or len(a.tokens) >= max_new_tokens:
                    results[a.index] = Example(
                        torch.tensor(prompts[a.index]), torch.tensor(a.tokens),
                        torch.stack(a.top_ids), torch.stack(a.top_logprobs).to(torch.float16))
                    target.release(a.state)
                else:
                    still.append(a)
            running = still
    finally:
        for a in running:
            target.release(a.state)
    return [r for r in results if r is not None]


@dataclass
class _Answer:
    index: int
    state: Any
    feed: list[int]  # tokens the next pass appends
    tokens: list[int] = field(default_factory=list)
    top_ids: list[torch.Tensor] = field(default_factory=list)
    top_logprobs: list[torch.Tensor] = field(default_factory=list)


def generate(target_dir: str, data_dir: Path, settings: DataSettings,
             on_progress: Callable[[int, int], None] | None = None) -> int:
    """Fill ``data_dir`` with shards until ``settings.tokens`` answer tokens exist
    (resuming after the last complete shard); returns the answer tokens on disk."""
    data_dir.mkdir(parents=True, exist_ok=True)
    done = existing_shards(data_dir)
    have = sum(answer_tokens(load_shard(p)) for p in done)
    if have >= settings.tokens and (data_dir / HELD_OUT_NAME).exists():
        return have
    from decoding.batched import BatchedLM

    target = BatchedLM.load(target_dir, dtype="float32")
    pools = prompt_source.load_pools(settings.seed)

    def batches(stream: Iterator[str], count: int) -> list[Example]:
        texts = list(itertools.islice(stream, count))
        ids = [encode_chat(target.tokenizer, [{"role": "user", "content": t}]) for t in texts]
        return answer_all(target, ids, settings.max_new_tokens, settings.top_k,
                          settings.batch_size)

    held = data_dir / HELD_OUT_NAME
    if not held.exists():
        examples = batches(prompt_source.prompts(pools, settings.seed, held_out=True),
                           settings.held_out_prompts)
        save_atomic([e.as_dict() for e in examples], held)
    stream = prompt_source.prompts(pools, settings.seed)
    index = len(done)
    for _ in itertools.islice(stream, index * SHARD_PROMPTS):  # skip the prompts already done
        pass
    while have < settings.tokens:
        answers = batches(stream, SHARD_PROMPTS * SHARDS_PER_PASS)
        if not answers:
            log.warning("the prompt source ran out at %d answer tokens", have)
            break
        for start in range(0, len(answers), SHARD_PROMPTS):
            shard = answers[start : start + SHARD_PROMPTS]
            save_atomic([e.as_dict() for e in shard], shard_path(data_dir, index))
            have += answer_tokens(shard)
            index += 1
            if on_progress is not None:
                on_progress(have, settings.tokens)
    return have
