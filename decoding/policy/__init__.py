"""Speculation policies: how far one sequence drafts (``speculation``) and how a batch
of sequences shares one forward pass (``batch``)."""

from decoding.policy.batch import (
    BATCH_MIN_GAIN,
    CALIBRATION_EVIDENCE,
    MIN_CALIBRATION,
    SpeculationPrior,
    StepCost,
    plan_batch,
)
from decoding.policy.speculation import (
    CONFIDENCE_BINS,
    EXPLORE_EVIDENCE,
    HISTORY_DECAY,
    INITIAL_ALPHA,
    INITIAL_WEIGHT,
    MAX_DRAFT_TOKENS,
    MIN_DRAFT_TOKENS,
    MIN_GAIN,
    PROBE_INTERVAL,
    VERIFY_COST_PER_TOKEN,
    AdaptiveSpeculation,
    FixedSpeculation,
    confidence_bin,
)

__all__ = [
    "BATCH_MIN_GAIN", "CALIBRATION_EVIDENCE", "CONFIDENCE_BINS", "EXPLORE_EVIDENCE",
    "HISTORY_DECAY", "INITIAL_ALPHA", "INITIAL_WEIGHT", "MAX_DRAFT_TOKENS",
    "MIN_CALIBRATION", "MIN_DRAFT_TOKENS", "MIN_GAIN", "PROBE_INTERVAL",
    "VERIFY_COST_PER_TOKEN", "AdaptiveSpeculation", "FixedSpeculation", "SpeculationPrior",
    "StepCost", "confidence_bin", "plan_batch",
]
