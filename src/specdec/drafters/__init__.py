"""Drafters: cheap guesses of the next tokens, behind one small protocol (see `base.Drafter`).

One drafter a file:
- `ngram.NgramDrafter`: prompt lookup within the current request.
- `suffix.SuffixDrafter`: n-gram frequency cache that also learns from earlier requests.
"""

from specdec.drafters.base import AdaptiveDraftLength, Drafter, Proposal
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.suffix import SuffixDrafter

__all__ = [
    "AdaptiveDraftLength",
    "Drafter",
    "NgramDrafter",
    "Proposal",
    "SuffixDrafter",
]
