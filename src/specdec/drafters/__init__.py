"""Drafters: cheap guesses of the next tokens, behind one small protocol (see `base.Drafter`).

One drafter a file:
- `ngram.NgramDrafter`: prompt lookup within the current request.
- `suffix.SuffixDrafter`: n-gram frequency cache that also learns from earlier requests.
- `draft_model.DraftModelDrafter`: a small model with the target's vocabulary, on its own KV cache.
"""

from specdec.drafters.base import AdaptiveDraftLength, Drafter, Proposal
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.suffix import SuffixDrafter

__all__ = [
    "AdaptiveDraftLength",
    "DraftModelDrafter",
    "Drafter",
    "NgramDrafter",
    "Proposal",
    "SuffixDrafter",
]
