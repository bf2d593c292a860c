"""Distillation data: the target's own greedy answers, with its next-token distributions.

The target answers prompts from ``prompts.py``, many at once through its batched
runner (a finished answer's place goes to the next prompt). For every answer token
we keep the target's top-``k`` log-probabilities at that position,
so training needs no target forward pass at all (forward KL on the top logits).
Data is written in shards of a fixed number of prompts; shard ``i`` always holds
the same prompts for a given seed, so an interrupted run resumes at the first
missing shard and produces the same data. The subject pools are read once and
kept in the data directory, so a run resumed later, or on another machine whose
apt lists or Python differ, continues the same prompt stream.

Asks (see ``prompts.py``) are answered first, by sampling (each with a seed made
from its place in the stream); the question read out of each reply is then
answered greedily like any other prompt. Only greedy answers become training data.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from decoding.prompting import encode_chat
from runtime.models.families import kv_position_bytes
from runtime.runner.causal_lm import CausalLM
from runtime.runner.passes import BatchItem
from specdistill import prompts as prompt_source

log = logging.getLogger(__name__)

SHARD_PROMPTS = 64
SHARDS_PER_PASS = 4  # at least this many shards' prompts are answered in one go
HELD_OUT_NAME = "heldout.pt"
POOLS_NAME = "pools.json"
ASK_MAX_NEW_TOKENS = 64  # a written question is short; longer replies rarely hold one
ASK_TEMPERATURE = 0.8
ASK_TOP_K = 40  # the question is sampled among the target's 40 most likely tokens
HELD_OUT_FIRST = 1 << 40  # seeds the held-out asks apart from the training stream's
CPU_STREAMS = 32  # answers grown together on a CPU, where more only lengthen each pass
MAX_GPU_STREAMS = 2048
PROMPT_POSITIONS = 384  # room for a prompt in each answer's KV rows (the longest: ~360 tokens)


@dataclass(frozen=True)
class DataSettings:
    seed: int = 0
    tokens: int = 200_000  # answer tokens to generate for training
    held_out_prompts: int = 48
    batch_size: int = CPU_STREAMS  # answers generated together
    max_new_tokens: int = 128
    top_k: int = 8  # teacher log-probabilities kept per position
    questions: float = 0.3  # share of prompts the target writes itself (asks)
    chat: float = 0.0  # share of everyday chat requests (prompts.CHAT_TEMPLATES)


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
               top_k: int, streams: int, temperature: float = 0.0,
               seeds: Sequence[int] | None = None) -> list[Example]:
    """The target's answers to ``prompts`` (token ids), in order: greedy, or, when
    ``temperature`` > 0, sampled among the ``ASK_TOP_K`` most likely tokens with one
    random stream per answer (``seeds``), so an answer does not depend on its batch.

    Up to ``streams`` answers grow together, one forward pass per step: a new prompt
    joins (its whole prefill in the same pass) as soon as an answer ends, so no pass
    is spent on padding or on answers that have already finished."""
    if temperature > 0 and (seeds is None or len(seeds) != len(prompts)):
        raise ValueError("sampled answers need one seed per prompt")
    stop = target.eos_token_ids
    results: list[Example | None] = [None] * len(prompts)
    queue = list(range(len(prompts)))[::-1]
    running: list[_Answer] = []
    keep = max(top_k, ASK_TOP_K if temperature > 0 else 1)
    try:
        while queue or running:
            while queue and len(running) < streams:
                i = queue.pop()
                generator = (torch.Generator().manual_seed(seeds[i])
                             if temperature > 0 and seeds is not None else None)
                running.append(_Answer(i, target.new_state(), list(prompts[i]),
                                       generator=generator))
            items = [BatchItem(a.state, a.feed, 1) for a in running]
            logits = torch.cat(target.forward_batch(items)).float()  # [n, vocab]
            top = torch.log_softmax(logits, dim=-1).topk(keep, dim=-1)
            # one copy to the host per pass (not a device sync per answer)
            top_ids, top_values = top.indices.cpu(), top.values.cpu()
            if temperature > 0:
                probs = torch.softmax(top_values / temperature, dim=-1)
                tokens = [int(top_ids[row, torch.multinomial(probs[row], 1, generator=a.generator)])
                          for row, a in enumerate(running)]
            else:
                tokens = top_ids[:, 0].tolist()  # greedy: the most likely token
            # as Python lists, once per pass: with hundreds of answers a tensor per
            # answer and step costs more host time than the pass itself on a GPU
            kept_ids, kept_values = top_ids[:, :top_k].tolist(), top_values[:, :top_k].tolist()
            still: list[_Answer] = []
            for row, a in enumerate(running):
                token = tokens[row]
                a.tokens.append(token)
                a.top_ids.append(kept_ids[row])
                a.top_logprobs.append(kept_values[row])
                a.feed = [token]
                if token in stop or len(a.tokens) >= max_new_tokens:
                    results[a.index] = Example(
                        torch.tensor(prompts[a.index]), torch.tensor(a.tokens),
                        torch.tensor(a.top_ids),
                        torch.tensor(a.top_logprobs).to(torch.float16))
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
    top_ids: list[list[int]] = field(default_factory=list)  # per step: the top-k ids
    top_logprobs: list[list[float]] = field(default_factory=list)  # and their log-probs
    generator: torch.Generator | None = None  # sampled answers: this answer's random stream


def default_streams(device: str, target_dir: str, max_new_tokens: int) -> int:
    """How many answers grow together when the run does not say: ``CPU_STREAMS`` on a
    CPU; on a GPU, where a pass costs far less per answer with more of them (the default
    model on an H200: 36 ms for 512, 82 ms for 2,048), as many as ``gpu_streams`` allows."""
    if device == "cpu":
        return CPU_STREAMS
    from transformers import AutoConfig

    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return gpu_streams(free, AutoConfig.from_pretrained(target_dir), max_new_tokens)


def gpu_streams(free_bytes: int, config: Any, max_new_tokens: int) -> int:
    """The largest power of two of answers (at most ``MAX_GPU_STREAMS``) whose float32 KV
    rows fit in 60% of ``free_bytes``, with room for a growing buffer and its copy (they
    double as they grow); at least one."""
    per_answer = kv_position_bytes(config, torch.float32) * (PROMPT_POSITIONS + max_new_tokens)
    fits = int(0.6 * free_bytes / (1.5 * per_answer))
    return min(MAX_GPU_STREAMS, 1 << max(0, fits.bit_length() - 1))


def load_or_make_pools(data_dir: Path, seed: int) -> prompt_source.Pools:
    """The run's subject pools: read from the data directory, else built and kept there.
    Pools kept by earlier versions chose their held-out subjects by the seed's order, and a
    run resumed on them goes on doing so (its held-out answers were made that way)."""
    path = data_dir / POOLS_NAME
    if path.exists():
        kept = json.loads(path.read_text(encoding="utf-8"))
        kept.setdefault("held_out_by", prompt_source.BY_ORDER)
        return prompt_source.Pools(**kept)
    pools = prompt_source.load_pools(seed)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(pools), ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)
    return pools


def generate(target_dir: str, data_dir: Path, settings: DataSettings,
             on_progress: Callable[[int, int], None] | None = None,
             device: str = "cpu") -> int:
    """Fill ``data_dir`` with shards until ``settings.tokens`` answer tokens exist
    (resuming after the last complete shard); returns the answer tokens on disk."""
    data_dir.mkdir(parents=True, exist_ok=True)
    done = existing_shards(data_dir)
    have = sum(answer_tokens(load_shard(p)) for p in done)
    if have >= settings.tokens and (data_dir / HELD_OUT_NAME).exists():
        return have
    from runtime.runner.batched import BatchedLM

    target = BatchedLM.load(target_dir, dtype="float32", device=device)
    pools = load_or_make_pools(data_dir, settings.seed)
    asked = [0, 0]  # asks answered, questions read out of the replies

    def encode(text: str) -> list[int]:
        return encode_chat(target.tokenizer, [{"role": "user", "content": text}])

    def batches(stream: Iterator[prompt_source.Prompt], count: int, first: int
                ) -> list[Example]:
        """Answers to the stream's next ``count`` prompts, the first being the stream's
        ``first``-th (each ask samples with a seed made from its place in the stream)."""
        items = list(itertools.islice(stream, count))
        texts = [p.text for p in items]
        asks = [i for i, p in enumerate(items) if p.ask]
        if asks:  # the target writes these users' messages first
            seeds = [settings.seed * 1_000_003 + first + i for i in asks]
            replies = answer_all(target, [encode(texts[i]) for i in asks], ASK_MAX_NEW_TOKENS,
                                 1, settings.batch_size, ASK_TEMPERATURE, seeds)
            for i, reply in zip(asks, replies, strict=True):
                text = cast(str, target.tokenizer.decode(reply.answer_ids.tolist(),
                                                         skip_special_tokens=True))
                question = prompt_source.extract_question(text)
                if question is not None:
                    texts[i] = question
                    asked[1] += 1
            asked[0] += len(asks)
        return answer_all(target, [encode(t) for t in texts], settings.max_new_tokens,
                          settings.top_k, settings.batch_size)

    held = data_dir / HELD_OUT_NAME
    if not held.exists():
        examples = batches(prompt_source.prompts(pools, settings.seed, held_out=True,
                                                 questions=settings.questions,
                                                 chat=settings.chat),
                           settings.held_out_prompts, first=HELD_OUT_FIRST)
        save_atomic([e.as_dict() for e in examples], held)
    stream = prompt_source.prompts(pools, settings.seed, questions=settings.questions,
                                   chat=settings.chat)
    index = len(done)
    for _ in itertools.islice(stream, index * SHARD_PROMPTS):  # skip the prompts already done
        pass
    # a pass holds several times the streams, so few of its steps run with idle streams
    per_pass = max(SHARDS_PER_PASS, -(-4 * settings.batch_size // SHARD_PROMPTS))
    while have < settings.tokens:
        answers = batches(stream, SHARD_PROMPTS * per_pass, first=index * SHARD_PROMPTS)
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
    if asked[0]:
        log.info("asks: %d answered, %d questions read out of them", asked[0], asked[1])
    return have
