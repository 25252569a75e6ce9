"""Drafters: cheap guesses of the next tokens, behind one small protocol (see `base.Drafter`).

One drafter a file:
- `ngram.NgramDrafter`: prompt lookup within the current request (chains, or trees of the
  distinct continuations of several earlier occurrences).
- `suffix.SuffixDrafter`: n-gram frequency cache that also learns from earlier requests.
- `draft_model.DraftModelDrafter`: a small model with the target's vocabulary, on its own KV cache.
- `eagle.EagleDrafter`: a one-layer head over the target's own features (chains or trees).
"""

from specdec.drafters.base import (
    Drafter,
    Proposal,
    DrafterBase,
    DrafterNeeds,
    TreeShape,
)
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.suffix import SuffixDrafter

__all__ = [
    "DraftModelDrafter",
    "Drafter",
    "NgramDrafter",
    "Proposal",
    "SuffixDrafter",
    "DrafterBase",
    "DrafterNeeds",
    "TreeShape",
]
