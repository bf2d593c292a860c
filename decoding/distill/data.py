"""Distillation data: the target's own greedy answers, with its next-token distributions.

The target answers prompts from ``prompts.py`` in left-padded batches. For every
answer token we keep the target's top-``k`` log-probabilities at that position,
so training needs no target forward pass at all (forward KL on the top logits).
Data is written in shards of a fixed number of prompts; shard ``i`` always holds
the same prompts for a given seed, so an interrupted run resumes at the first
missing shard and produces the same data.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from decoding.distill import prompts as prompt_source
from decoding.prompting import encode_chat
from decoding.target import eos_ids

log = logging.getLogger(__name__)

SHARD_PROMPTS = 64
HELD_OUT_NAME = "heldout.pt"


@dataclass(frozen=True)
class DataSettings:
    seed: int = 0
    tokens: int = 200_000  # answer tokens to generate for training
    held_out_prompts: int = 48
    batch_size: int = 24
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
def generate_batch(model: Any, tokenizer: Any, texts: list[str], max_new_tokens: int,
                   top_k: int, eos_ids: list[int]) -> list[Example]:
    """The target's greedy answers to ``texts`` (one batch, left-padded)."""
    encoded = [encode_chat(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    width = max(len(e) for e in encoded)
    ids = torch.full((len(encoded), width), pad, dtype=torch.long)  # [b, width]
    mask = torch.zeros_like(ids)
    for row, e in enumerate(encoded):
        ids[row, width - len(e):] = torch.tensor(e)
        mask[row, width - len(e):] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                         max_new_tokens=max_new_tokens, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=pad, eos_token_id=eos_ids)
    answers = out.sequences[:, width:]  # [b, t]
    examples = []
    for row, e in enumerate(encoded):
        answer = answers[row]
        ends = [i for i, t in enumerate(answer.tolist()) if t in eos_ids]
        n = ends[0] + 1 if ends else int(answer.numel())
        logits = torch.stack([step[row] for step in out.logits[:n]]).float()  # [n, vocab]
        top = torch.log_softmax(logits, dim=-1).topk(top_k, dim=-1)
        examples.append(Example(torch.tensor(e), answer[:n].clone(), top.indices,
                                top.values.to(torch.float16)))
    return examples


def generate(target_dir: str, data_dir: Path, settings: DataSettings,
             on_progress: Callable[[int, int], None] | None = None) -> int:
    """Fill ``data_dir`` with shards until ``settings.tokens`` answer tokens exist
    (resuming after the last complete shard); returns the answer tokens on disk."""
    data_dir.mkdir(parents=True, exist_ok=True)
    done = existing_shards(data_dir)
    have = sum(answer_tokens(load_shard(p)) for p in done)
    if have >= settings.tokens and (data_dir / HELD_OUT_NAME).exists():
        return have
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    stop_ids = sorted(eos_ids(model, tokenizer))
    pools = prompt_source.load_pools(settings.seed)

    def batches(stream: Iterator[str], count: int) -> list[Example]:
        texts = list(itertools.islice(stream, count))
        out: list[Example] = []
        for start in range(0, len(texts), settings.batch_size):
            chunk = sorted(texts[start:start + settings.batch_size], key=len)
            out.extend(generate_batch(model, tokenizer, chunk, settings.max_new_tokens,
                                      settings.top_k, stop_ids))
        return out

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
        shard = batches(stream, SHARD_PROMPTS)
        save_atomic([e.as_dict() for e in shard], shard_path(data_dir, index))
        have += answer_tokens(shard)
        index += 1
        if on_progress is not None:
            on_progress(have, settings.tokens)
    return have
