"""Medusa heads (Cai et al., arXiv 2401.10774, Medusa-1: the target frozen): K small heads on
the target's last hidden state, each drafting one position further ahead, drafted as a static
token tree from each head's top-k and verified by the tree rule (docs/drafters.md, 'Medusa')."""
