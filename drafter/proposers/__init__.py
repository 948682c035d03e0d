"""Built-in draft methods; importing this package registers them."""

from drafter.proposers.draft_model import DraftModelProposer
from drafter.proposers.eagle import EagleProposer
from drafter.proposers.ngram import NgramProposer

__all__ = ["DraftModelProposer", "EagleProposer", "NgramProposer"]
