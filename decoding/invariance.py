"""The run-time batch-invariance check (a debugging mode, off by default).

Greedy speculation gives exactly plain decoding's tokens because a pass that verifies
several tokens, alone or beside other sequences, gives each position bitwise the
logits of a one-token step (tests/test_invariance.py). With ``--check-invariance RATE``
the engine checks that on a sample of its rounds: after a sequence's round commits,
the last position it cached is recomputed as a one-token step of that sequence alone
and compared, bitwise, with the logits the round's pass gave there (the ones that chose
the next token). The recompute rewrites that position's keys and values with the
one-token step's, so the sequence goes on as plain decoding would. Counts are
exported as ``specserve_invariance_checks_total`` and
``specserve_invariance_mismatches_total``; each mismatch is logged.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import torch

from decoding.target import StateT, Target
from runtime.runner.passes import BatchItem

log = logging.getLogger(__name__)


@dataclass
class InvarianceStats:
    checks: int = 0
    mismatches: int = 0

    def counts(self) -> dict[str, int]:
        return {"checks": self.checks, "mismatches": self.mismatches}


class InvarianceCheck:
    """Checks a ``rate`` fraction of rounds (0 to 1)."""

    def __init__(self, rate: float, seed: int | None = None) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"the invariance check rate must be within 0..1, not {rate}")
        self.rate = rate
        self.stats = InvarianceStats()
        self._rng = random.Random(seed)

    def sample(self) -> bool:
        return self.rate > 0.0 and self._rng.random() < self.rate

    def check(self, target: Target[StateT], state: StateT, token: int, logits: torch.Tensor,
              request_id: str = "") -> bool:
        """Recompute the logits after ``token``, the last position ``state`` caches, as a
        one-token step, and compare them with ``logits`` (what the pass gave there)."""
        target.rollback(state, state.length - 1)
        alone = target.forward_batch([BatchItem(state, [token], 1)])[0][0]
        same = torch.equal(alone, logits)
        self.stats.checks += 1
        if not same:
            self.stats.mismatches += 1
            log.warning("batch invariance: request %s position %d: the pass's logits differ "
                        "from a one-token step's (max |difference| %.3g)", request_id,
                        state.length - 1, (alone.float() - logits.float()).abs().max().item())
        return same
