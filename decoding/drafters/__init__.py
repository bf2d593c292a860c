"""Drafters: cheap proposers of the next few tokens."""

from decoding.drafters.base import DraftContext, Drafter, DraftProposal
from decoding.drafters.model import ModelDrafter
from decoding.drafters.ngram import NgramDrafter

__all__ = ["DraftContext", "DraftProposal", "Drafter", "ModelDrafter", "NgramDrafter"]
