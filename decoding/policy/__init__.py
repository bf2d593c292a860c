"""Speculation policies: how far one sequence drafts (``speculation``) and how a batch
of sequences shares one forward pass (``batch``)."""

from decoding.policy.acceptance import (
    CONFIDENCE_BINS,
    EXPLORE_EVIDENCE,
    HISTORY_DECAY,
    INITIAL_ALPHA,
    INITIAL_WEIGHT,
    AlternativeCalibration,
    ConfidenceCalibration,
    PositionAcceptance,
    confidence_bin,
)
from decoding.policy.batch import (
    BATCH_MIN_GAIN,
    CALIBRATION_EVIDENCE,
    MIN_CALIBRATION,
    SpeculationPrior,
    StepCost,
    plan_batch,
)
from decoding.policy.cost import MAX_DRAFT_TOKENS, VERIFY_COST_PER_TOKEN, RoundCost
from decoding.policy.speculation import (
    MIN_DRAFT_TOKENS,
    MIN_GAIN,
    PROBE_INTERVAL,
    AdaptiveSpeculation,
    FixedSpeculation,
)

__all__ = [
    "BATCH_MIN_GAIN", "CALIBRATION_EVIDENCE", "CONFIDENCE_BINS", "EXPLORE_EVIDENCE",
    "HISTORY_DECAY", "INITIAL_ALPHA", "INITIAL_WEIGHT", "MAX_DRAFT_TOKENS",
    "MIN_CALIBRATION", "MIN_DRAFT_TOKENS", "MIN_GAIN", "PROBE_INTERVAL",
    "VERIFY_COST_PER_TOKEN", "AdaptiveSpeculation", "AlternativeCalibration",
    "ConfidenceCalibration", "FixedSpeculation", "PositionAcceptance", "RoundCost",
    "SpeculationPrior", "StepCost", "confidence_bin", "plan_batch",
]
