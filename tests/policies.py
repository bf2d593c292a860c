"""Draft-length policies for tests whose assertions must not depend on the machine's load."""

from __future__ import annotations

from collections.abc import Sequence

from decoding.policy import AdaptiveSpeculation


class SteadyTimingPolicy(AdaptiveSpeculation):
    """The adaptive policy told fixed timings (a draft step a tenth of a target step, a
    verified token a twentieth more), not the measured ones: the lengths it picks then
    depend on the drafter's confidences alone, not on how fast or loaded the machine is."""

    STEP_S = 0.01

    def update(self, drafted: int, accepted: int, draft_s: float = 0.0, verify_s: float = 0.0,
               confidences: Sequence[float] = (), alternative: float | None = None,
               alternative_taken: bool = False) -> None:
        verified = drafted + (alternative is not None)
        steps = max(drafted, len(confidences))
        super().update(drafted, accepted, steps * self.STEP_S / 10,
                       self.STEP_S * (1 + verified / 20), confidences, alternative,
                       alternative_taken)
