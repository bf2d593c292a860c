"""Training of a feature draft (see ``feature.py``) on the target's answers and features.

Loss, per unrolled drafting step s (weights 0.8^(s-1)), over answer rows: ``reg_weight``
times the smooth L1 of the draft's output toward the target's final state there, plus
``ce_weight`` times the
cross-entropy of the draft's head logits against the target's distribution over the
head's tokens (softmax of the target's own logits restricted to them, computed from its
feature: soft labels). AdamW with a linear warmup and a cosine decay over ``steps``, or
over ``minutes`` when given; a checkpoint with the optimizer's state at every
evaluation (``eval_every`` steps, or ``CHECKPOINT_SECONDS``), after which the draft
directory and its report are rewritten.

Training rows stream from the shards a few at a time (``TrainStream``); only the held-out
rows stay in memory. With ``layers`` the draft reads EAGLE-3's fused feature of those
target layers (the shards keep their outputs) in place of the final state.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from runtime.drafts.draft_format import VOCAB_IDS
from runtime.drafts.feature_draft import FUSE
from specdistill import feature_target
from specdistill.feature import (
    FeatureDraft,
    layer_config,
    load_feature_draft_weights,
    save_draft,
)
from specdistill.feature_data import (
    Batch,
    TrainStream,
    load_rows,
    make_batch,
    save_atomic,
    scan,
)
from specdistill.feature_eval import evaluate, full_evaluation
from specdistill.train import plan_batches

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "feature-checkpoint.pt"
REPORT_NAME = "report.json"
CHECKPOINT_SECONDS = 300.0
PERIODIC_EVAL_ROWS = 24  # held-out sequences measured at each checkpoint (all at the end)
WARMUP_STEPS = 20
MIN_LR_SHARE = 0.1
GRAD_CLIP = 1.0
STEP_DECAY = 0.8  # weight of each further unrolled step's loss


@dataclass(frozen=True)
class FeatureTrainSettings:
    steps: int = 600
    minutes: float | None = None  # a time budget: the schedule spans it instead of ``steps``
    lr: float = 1e-3
    batch_tokens: int = 2048  # padded tokens per step
    vocab_top_k: int = 8192
    vocab_coverage: float = 0.0  # >0: the head's tokens are the fewest that cover this share
    # of the held-out answer tokens (vocab_top_k then unused)
    seed: int = 0
    ttt_steps: int = 5  # drafting steps unrolled in training (training-time test)
    max_len: int = 512
    ce_weight: float = 0.1  # cross-entropy beside the feature regression
    eval_every: int = 50
    layers: tuple[int, ...] = ()  # the target layers fused into the feature (none: final)
    reg_weight: float = 1.0  # the feature regression's weight
    max_train_tokens: int = 0  # >0: only the first shards, up to this many answer tokens
    shard_window: int = 4  # shards in memory at once
    init_from: str = ""  # a feature draft directory to start from (its head's tokens aside)


@dataclass(frozen=True)
class Progress:
    step: int
    steps: int
    loss: float
    acceptance: float | None  # held-out teacher-forced, when just measured


def loss_of(draft: FeatureDraft, batch: Batch, steps: int, ce_weight: float,
            reg_weight: float = 1.0) -> tuple[torch.Tensor, list[float]]:
    """The training loss, and each step's head accuracy (argmax within the head's tokens)."""
    outs = draft.unroll(batch.tokens, batch.feats, steps)
    rows = torch.arange(batch.tokens.shape[1])[None, :]
    with torch.no_grad():
        teacher_all = torch.softmax(draft.logits(batch.targets[batch.answer]), dim=-1)
    total = batch.targets.new_zeros(())
    weights = 0.0
    accuracy = []
    for s, y in enumerate(outs, start=1):
        valid = batch.answer & (rows >= s - 1)
        keep = valid[batch.answer]
        teacher = teacher_all[keep]
        yv = y[valid]
        reg = F.smooth_l1_loss(yv, batch.targets[valid])
        log_q = torch.log_softmax(draft.logits(yv), dim=-1)
        ce = -(teacher * log_q).sum(-1).mean()
        w = STEP_DECAY ** (s - 1)
        total = total + w * (reg_weight * reg + ce_weight * ce)
        weights += w
        accuracy.append(float((log_q.argmax(-1) == teacher.argmax(-1)).float().mean()))
    return total / weights, accuracy


def batches(rows: Sequence[dict[str, Any]], batch_tokens: int, max_len: int, seed: int,
            epoch: int) -> list[list[int]]:
    """One epoch's batches: shuffled, sorted by length within windows, under
    ``batch_tokens`` padded tokens each."""
    def length(i: int) -> int:
        return min(max_len, int(rows[i]["prompt_ids"].numel() + rows[i]["answer_ids"].numel()))

    return plan_batches(len(rows), length, batch_tokens, seed * 7919 + epoch, window=128)


Answers = Sequence[dict[str, Any]] | Mapping[int, int]  # rows, or their answers' counts


def answer_counts(rows: Answers) -> Mapping[int, int]:
    """How often each token occurs in the answers of ``rows`` (counts pass through)."""
    if isinstance(rows, Mapping):
        return rows
    counts: Counter[int] = Counter()
    for r in rows:
        counts.update(r["answer_ids"].tolist())
    return counts


def choose_vocab(rows: Answers, k: int, vocab_size: int,
                 always: Sequence[int]) -> torch.Tensor:
    """The ``k`` tokens most frequent in the answers (ties: lower id), ``always`` first."""
    counts = answer_counts(rows)
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    chosen = list(dict.fromkeys([*always, *ranked]))[:k]
    taken = set(chosen)
    chosen += [i for i in range(vocab_size) if i not in taken][:k - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def coverage(head_ids: torch.Tensor, rows: Sequence[dict[str, Any]]) -> float:
    """The share of ``rows``' answer tokens among ``head_ids``."""
    answers = torch.cat([r["answer_ids"].long() for r in rows]) if rows else torch.zeros(0)
    if answers.numel() == 0:
        return 0.0
    return float(torch.isin(answers, head_ids).float().mean())


def vocab_for_coverage(train_rows: Answers, held: Sequence[dict[str, Any]],
                       share: float, vocab_size: int, always: Sequence[int]
                       ) -> tuple[torch.Tensor, float]:
    """The fewest of the training answers' most frequent tokens (``always`` first) that
    cover ``share`` of the held-out answer tokens, and the coverage they reach (all the
    training answers' tokens where even they fall short)."""
    counts = answer_counts(train_rows)
    ranked = list(dict.fromkeys([*always, *(t for t, _ in sorted(
        counts.items(), key=lambda kv: (-kv[1], kv[0])))]))
    held_counts: Counter[int] = Counter()
    for r in held:
        held_counts.update(r["answer_ids"].tolist())
    total = max(1, sum(held_counts.values()))
    covered, k = 0, len(ranked)
    for i, token in enumerate(ranked):
        covered += held_counts.get(token, 0)
        if covered >= share * total:
            k = i + 1
            break
    ids = torch.tensor(sorted(ranked[:max(k, 1)]), dtype=torch.long)
    return ids, coverage(ids, held)


def lr_share(progress: float, step: int) -> float:
    if step < WARMUP_STEPS:
        return (step + 1) / WARMUP_STEPS
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return MIN_LR_SHARE + (1 - MIN_LR_SHARE) * cosine


def build_draft(target: Any, train_rows: Answers, k: int,
                head_ids: torch.Tensor | None = None, held: Sequence[dict[str, Any]] = (),
                share: float = 0.0, layers: Sequence[int] = ()) -> FeatureDraft:
    """A fresh draft: the target's last layer and final norm, ``fc`` (and with ``layers``
    the fusion) at random; its head's tokens the ``k`` most frequent, or with ``share``
    the fewest covering that share of ``held``'s answer tokens (``vocab_for_coverage``)."""
    embedding = feature_target.embedding_table(target)
    head = feature_target.head_table(target, embedding)
    vocab = int(embedding.shape[0])
    if head_ids is None:
        always = sorted(int(t) for t in target.eos_token_ids)
        head_ids = (vocab_for_coverage(train_rows, held, share, vocab, always)[0] if share > 0
                    else choose_vocab(train_rows, min(k, vocab), vocab, always))
    config = layer_config(feature_target.config_dict(target), vocab)
    draft = FeatureDraft(config, embedding, head_ids, head, layers)
    draft.load_state_dict(feature_target.last_layer_weights(target), strict=False)
    return draft


def train(target: Any, work: Path, out_dir: Path, settings: FeatureTrainSettings,
          made_with: dict[str, Any], on_progress: Callable[[Progress], None] | None = None
          ) -> dict[str, Any]:
    """Train (or resume) and write the draft directory; returns the report."""
    torch.manual_seed(settings.seed)
    fused = bool(settings.layers)
    data = scan(work / "data", fused, settings.max_train_tokens)
    held = data.held
    if not data.train_shards or not held:
        raise RuntimeError(f"no training or held-out data in {work / 'data'}")
    if fused and "layers" not in held[0]:
        raise RuntimeError(f"the data in {work / 'data'} keeps no layers' outputs to fuse "
                           "(made with --feature-layers none, or by an earlier version)")
    ckpt_path = work / CHECKPOINT_NAME
    ckpt = torch.load(ckpt_path, weights_only=False) if ckpt_path.exists() else None
    draft = build_draft(target, data.train_counts, settings.vocab_top_k,
                        ckpt["head_ids"] if ckpt else None, held, settings.vocab_coverage,
                        settings.layers)
    vocabulary = {"tokens": int(draft.head_ids.numel()),
                  "held_out_coverage": round(coverage(draft.head_ids, held), 4)}
    if ckpt is None and settings.init_from:
        start_from(draft, Path(settings.init_from), target)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step, position, seconds, history = 0, (0, 0, 0), 0.0, []
    if ckpt is not None:
        draft.load_state_dict(ckpt["draft"], strict=False)
        optimizer.load_state_dict(ckpt["optimizer"])
        step, position = ckpt["step"], tuple(ckpt["position"])
        seconds, history = ckpt["seconds"], ckpt["history"]
        torch.set_rng_state(ckpt["torch_rng"])
        log.info("resuming at step %d", step)

    def plan(rows: Sequence[dict[str, Any]], salt: int) -> list[list[int]]:
        return batches(rows, settings.batch_tokens, settings.max_len, settings.seed, salt)

    stream = TrainStream(data.train_shards, settings.shard_window, settings.seed, fused, plan,
                         position)
    budget = settings.minutes * 60 if settings.minutes else None

    def progress() -> float:
        done = step / max(1, settings.steps)
        return max(done, seconds / budget) if budget else done

    def report(evaluation: dict[str, Any]) -> dict[str, Any]:
        return {"training": {**asdict(settings), "steps": step,
                             "epochs": round(stream.epochs, 2), "seconds": round(seconds, 1),
                             "train_shards": len(data.train_shards),
                             "train_sequences": data.train_sequences,
                             "train_answer_tokens": data.train_answer_tokens,
                             "held_out_sequences": len(held),
                             "held_out_answer_tokens": sum(int(r["answer_ids"].numel())
                                                           for r in held)},
                "vocabulary": vocabulary, "history": history, "evaluation": evaluation}

    draft.train()
    loss_avg = history[-1]["loss"] if history else None
    last_save = seconds
    while progress() < 1.0:
        started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = settings.lr * lr_share(progress(), step)
        batch = make_batch(stream.next(), settings.max_len, layers=fused)
        loss, accuracy = loss_of(draft, batch, settings.ttt_steps, settings.ce_weight,
                                 settings.reg_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        optimizer.step()
        step += 1
        value = float(loss.detach())
        loss_avg = value if loss_avg is None else 0.95 * loss_avg + 0.05 * value
        seconds += time.perf_counter() - started
        started = time.perf_counter()
        measured = None
        if (step % settings.eval_every == 0 or seconds - last_save >= CHECKPOINT_SECONDS
                or progress() >= 1.0):
            draft.eval()
            result = evaluate(draft, held[:PERIODIC_EVAL_ROWS], settings.max_len)
            draft.train()
            seconds += time.perf_counter() - started  # the budget counts evaluations too
            started = time.perf_counter()
            measured = result["teacher_forced"]
            history.append({"step": step, "seconds": round(seconds, 1),
                            "loss": round(loss_avg, 4),
                            "train_step_accuracy": [round(a, 4) for a in accuracy],
                            "held_out_teacher_forced": round(measured, 4),
                            "held_out_tau": result["tau"]})
            save_atomic({"draft": draft.state_dict(), "optimizer": optimizer.state_dict(),
                         "step": step, "position": list(stream.position), "seconds": seconds,
                         "history": history, "head_ids": draft.head_ids,
                         "torch_rng": torch.get_rng_state()}, ckpt_path)
            write(draft, target, out_dir, settings, made_with, report({"held_out": result}))
            last_save = seconds
        seconds += time.perf_counter() - started
        if on_progress is not None:
            total = step if progress() >= 1.0 else max(step, round(step / max(progress(), 1e-9)))
            on_progress(Progress(step, total, loss_avg, measured))
    draft.eval()
    evaluation = full_evaluation(draft, held, [load_rows(work / "data" / f"eval-{n}.pt")
                                               for n in ("chat", "grounded")],
                                 settings.max_len)
    final = report(evaluation)
    write(draft, target, out_dir, settings, made_with, final)
    return final


def start_from(draft: FeatureDraft, directory: Path, target: Any) -> None:
    """Load a feature draft's ``fc``, layer and final norm into ``draft`` (its head's tokens
    stay ``draft``'s: the rows are the target's). A draft that reads the final state
    starting a fused one: the fusion starts as the RMS-normed highest layer times the
    target's final norm weight, the nearest of the fused layers to the final state."""
    info, tensors = load_feature_draft_weights(directory)
    tensors.pop(VOCAB_IDS)
    if tuple(info.get("layers") or ()) != draft.layers and info.get("layers"):
        raise ValueError(f"{directory} fuses layers {info['layers']}, not {list(draft.layers)}")
    missing = draft.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    if missing.unexpected_keys:
        raise ValueError(f"{directory}: unexpected tensors {missing.unexpected_keys}")
    if draft.layers and FUSE not in tensors:
        h = draft.config["hidden_size"]
        with torch.no_grad():
            draft.fuse.weight.zero_()
            draft.fuse.weight[:, -h:] = torch.eye(h)
            draft.fuse_norm.weight.fill_(1.0)
            final = feature_target.last_layer_weights(target)["model.norm.weight"]
            draft.fuse_norm.weight[-h:] = final


def load_draft(directory: Path, target: Any) -> FeatureDraft:
    """A saved feature draft for ``target``, for evaluation in PyTorch."""
    info, tensors = load_feature_draft_weights(directory)
    draft = build_draft(target, {}, 0, tensors[VOCAB_IDS], layers=info.get("layers") or ())
    start_from(draft, directory, target)
    return draft.eval()


def write(draft: FeatureDraft, target: Any, out_dir: Path, settings: FeatureTrainSettings,
          made_with: dict[str, Any], report: dict[str, Any]) -> None:
    import json

    feature: dict[str, Any] = ({"feature": "layers", "layers": list(draft.layers)}
                               if draft.layers else {"feature": "final_norm"})
    info = {"target": feature_target.identity(target), "model": draft.config,
            "vocab_top_k": int(draft.head_ids.numel()), **feature,
            "made_with": {**made_with, "results": report}}
    save_draft(draft, info, out_dir)
    tmp = out_dir / (REPORT_NAME + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    tmp.replace(out_dir / REPORT_NAME)
