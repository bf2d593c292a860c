"""How well a feature draft drafts: teacher-forced and chained acceptance.

Teacher-forced: at every answer row, with real features, whether the draft's greedy token
(over its head's tokens) is the target's greedy token (over the whole vocabulary).

Chained: from every answer row, the draft drafts ``CHAIN`` tokens greedily, feeding its
own outputs back (``FeatureDraft.unroll``: step s at row j is the s-th token drafted
after the real context ending at row j - s + 1), and the target's greedy continuation
accepts the longest matching prefix. Only greedy answers count (their next tokens are the
target's greedy continuation); a chain only goes on past a position whose next token is
the target's argmax there. tau_k = 1 + the mean accepted length when drafting k tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from specdistill.feature import FeatureDraft
from specdistill.feature_data import make_batch

CHAIN = 5
EVAL_TOKENS = 4096  # padded tokens per evaluation batch


def greedy_ids(draft: FeatureDraft, row: dict[str, Any], max_len: int) -> torch.Tensor:
    """The target's argmax after each position p >= 1 (from f_p), full vocabulary."""
    f = row["features"][1:max_len].float()
    return (f @ draft.head_table.T).argmax(-1)


@torch.no_grad()
def evaluate(draft: FeatureDraft, rows: Sequence[dict[str, Any]], max_len: int,
             chain: int = CHAIN) -> dict[str, Any]:

    hits = total = 0
    accepted: list[torch.Tensor] = []  # per chain start: tokens accepted of ``chain``
    order = sorted(range(len(rows)), key=lambda i: int(rows[i]["features"].shape[0]))
    groups: list[list[int]] = []
    for i in order:
        width = min(max_len, int(rows[i]["features"].shape[0]))
        if groups and width * (len(groups[-1]) + 1) <= EVAL_TOKENS:
            groups[-1].append(i)
        else:
            groups.append([i])
    for group in groups:
        picked = [rows[i] for i in group]
        greedy = [greedy_ids(draft, r, max_len) for r in picked]
        batch = make_batch(picked, max_len, greedy, layers=bool(draft.layers))
        n = batch.tokens.shape[1]
        target = torch.full((len(group), n), -1, dtype=torch.long)
        for b, g in enumerate(greedy):
            target[b, :len(g)] = g
        outs = draft.unroll(batch.tokens, batch.feats, chain)
        drafted = [draft.head_ids[draft.logits(y).argmax(-1)] for y in outs]  # [B, N] each
        match = torch.stack([d == target for d in drafted])  # [chain, B, N]
        hits += int(match[0][batch.answer].sum())
        total += int(batch.answer.sum())
        for b, row in enumerate(picked):
            if not row.get("greedy", True):
                continue
            m = int(min(max_len, row["features"].shape[0])) - 1  # rows
            starts = [c for c in range(n) if batch.answer[b, c] and c + chain - 1 < m]
            if not starts:
                continue
            c = torch.tensor(starts)
            ok = torch.ones(len(starts), dtype=torch.bool)
            count = torch.zeros(len(starts), dtype=torch.long)
            for s in range(chain):
                ok = ok & match[s, b, c + s]
                count += ok.long()
                if s + 1 < chain:
                    ok = ok & batch.ok[b, c + s]
            accepted.append(count)
    counts = torch.cat(accepted) if accepted else torch.zeros(0, dtype=torch.long)
    reach = [int((counts >= s).sum()) for s in range(chain + 1)]
    return {
        "teacher_forced": hits / max(1, total),
        "answer_rows": total,
        "chains": int(counts.numel()),
        "per_position": [round(reach[s] / max(1, reach[s - 1]), 4) for s in range(1, chain + 1)],
        "tau": [round(1 + float(counts.clamp(max=k).float().mean()) if counts.numel() else 1.0,
                      4) for k in range(1, chain + 1)],
    }


@torch.no_grad()
def draft_step_ms(draft: FeatureDraft, context: int = 256, steps: int = 32) -> float:
    """Milliseconds of one fed-back drafting step (with the head's logits) after
    ``context`` rows, in PyTorch float32 on this machine's threads."""
    h = draft.config["hidden_size"] * max(1, len(draft.layers))
    tokens = torch.randint(0, int(draft.embedding.shape[0]), (context,)).tolist()
    feats = torch.randn(context, h)
    draft.draft_sequential(tokens, feats, 2)  # warm up
    started = time.perf_counter()
    draft.draft_sequential(tokens, feats, steps + 1)
    with_steps = time.perf_counter() - started
    started = time.perf_counter()
    draft.draft_sequential(tokens, feats, 1)
    prefill = time.perf_counter() - started
    return round(1000 * max(0.0, with_steps - prefill) / steps, 3)


def full_evaluation(draft: FeatureDraft, held: Sequence[dict[str, Any]],
                    bench: Sequence[Sequence[dict[str, Any]]], max_len: int
                    ) -> dict[str, Any]:
    """Held-out rows, their later turns of a conversation alone (``multi_turn``: the
    target wrote the user's message after its own answer; where there are any), and the
    benchmark's chat and grounded answers."""
    out: dict[str, Any] = {"held_out": evaluate(draft, held, max_len)}
    later = [r for r in held if int(r.get("turn", 1)) > 1]
    if later:
        out["multi_turn"] = evaluate(draft, later, max_len)
    for name, rows in zip(("chat", "grounded"), bench, strict=True):
        out[name] = evaluate(draft, rows, max_len)
    out["draft_step_ms"] = draft_step_ms(draft)
    return out

