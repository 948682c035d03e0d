"""Built-in draft methods; importing this package registers them."""

from specmesh.drafter.proposers.draft_model import DraftModelProposer
from specmesh.drafter.proposers.eagle import EagleProposer
from specmesh.drafter.proposers.ngram import NgramProposer

__all__ = ["DraftModelProposer", "EagleProposer", "NgramProposer"]
