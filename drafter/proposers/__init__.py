"""Built-in draft methods; importing this package registers them."""

from drafter.proposers.ngram import NgramProposer

__all__ = ["NgramProposer"]
