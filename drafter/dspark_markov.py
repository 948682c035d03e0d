"""DSpark's Markov head and confidence head (DeepSeek, arXiv 2607.05147; DeepSpec
``deepspec/modeling/dspark/markov_head.py``; SGLang's ``dspark_components``): the small
sequential part of a parallel block drafter.

A parallel drafter's one forward gives each block position ``k`` its base logits ``l_k`` and
hidden state ``h_k`` [d] without ever seeing the drafts before it. The Markov head walks the
block once afterwards (:func:`markov_walk`), position by position, and adds to ``l_k`` a bias
that depends on the token ``x_{k-1}`` actually drafted at the position before (for position 0:
the last context token), so drafts see their predecessor at the cost of a rank-``r`` product
per position and no extra transformer forward:

- ``e_k = P E[x_{k-1}]``: the previous token's embedding (the target's, frozen) projected to
  rank ``r`` (``P`` [r, d]; DeepSpec trains a V x r table instead: projecting the shared
  embedding keeps the checkpoint small);
- ``vanilla``: ``z_k = e_k``;
- ``gated``: ``z_k = sigmoid(G [h_k; e_k]) * e_k`` (``G``: Linear(d + r -> r));
- ``rnn``: one Linear(d + 2r -> 3r) over ``[h_k; e_k; s_{k-1}]`` gives gate ``g``, candidate
  ``c`` and output ``o``; ``s_k = (1 - sigmoid(g)) s_{k-1} + sigmoid(g) tanh(c)`` (``s_{-1} =
  0``) and ``z_k = sigmoid(o) * tanh(s_k)``: a small state carried along the block;
- corrected logits ``l_k + W z_k`` (``W`` [V, r], zero at initialisation, so an untrained head
  is the plain parallel block).

The confidence head predicts each draft's survival, the probability that draft ``k`` is
accepted given that drafts ``0 .. k-1`` were: ``sigmoid(c . [h_k; z_k] + b)`` in [0, 1], sent
as DraftTailStream.draft_confidences for the verifier's confidence budget
(decode/confidence_budget.py). It is trained with binary cross-entropy on whether the
corrected argmax equals the target's token when the prefix is the target's (teacher forcing:
exactly the conditional the budget multiplies).

A positive ``markov_rank`` is required (DSpark's rule: rank 0 removes the head, which is the
``pard`` method).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

#: the Markov head shapes (DSpark's ``dspark_config.py``)
MARKOV_KINDS = ("vanilla", "gated", "rnn")


def check_markov(kind: str, rank: int) -> None:
    """ValueError unless ``kind`` is one of :data:`MARKOV_KINDS` and ``rank`` is positive."""
    if kind not in MARKOV_KINDS:
        raise ValueError(f"markov must be one of {', '.join(MARKOV_KINDS)}, got {kind!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"markov_rank must be a positive integer (rank 0 removes the Markov "
                         f"head: that is the pard method), got {rank!r}")


class MarkovHead(nn.Module):
    """The Markov head and the confidence head of one DSpark draft (module docstring).

    Args:
        kind: ``vanilla``, ``gated`` or ``rnn``.
        hidden_size: d, the width of the block's hidden states and of the token embedding.
        rank: r, the rank of the previous-token correction (positive).
        vocab_size: V, the width of the bias (the draft's vocabulary).

    Raises:
        ValueError: an unknown kind or a rank below 1.
    """

    def __init__(self, kind: str, hidden_size: int, rank: int, vocab_size: int) -> None:
        super().__init__()
        check_markov(kind, rank)
        self.kind, self.rank = kind, int(rank)
        self.hidden_size, self.vocab_size = int(hidden_size), int(vocab_size)
        self.token_proj = nn.Linear(hidden_size, rank, bias=False)
        self.to_vocab = nn.Linear(rank, vocab_size, bias=False)
        nn.init.zeros_(self.to_vocab.weight)
        self.gate = nn.Linear(hidden_size + rank, rank) if kind == "gated" else None
        self.cell = nn.Linear(hidden_size + 2 * rank, 3 * rank) if kind == "rnn" else None
        self.confidence = nn.Linear(hidden_size + rank, 1)

    def step(self, hidden: torch.Tensor, prev_embedding: torch.Tensor,
             state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The correction feature of one block position for a batch of rows.

        Args:
            hidden: ``h_k`` [B, d]. prev_embedding: ``E[x_{k-1}]`` [B, d].
            state: ``s_{k-1}`` [B, r] (``rnn`` only; None: zeros, the block's first position).

        Returns:
            (``z_k`` [B, r], the new state ``s_k`` for ``rnn``, else None).
        """
        e = self.token_proj(prev_embedding)
        if self.kind == "vanilla":
            return e, None
        if self.kind == "gated":
            return torch.sigmoid(self.gate(torch.cat([hidden, e], -1))) * e, None
        if state is None:
            state = e.new_zeros(e.shape)
        g, c, o = self.cell(torch.cat([hidden, e, state], -1)).chunk(3, dim=-1)
        g = torch.sigmoid(g)
        state = (1 - g) * state + g * torch.tanh(c)
        return torch.sigmoid(o) * torch.tanh(state), state

    def bias(self, z: torch.Tensor) -> torch.Tensor:
        """The logit bias ``W z`` [B, V] of features ``z`` [B, r]."""
        return self.to_vocab(z)

    def confidence_logit(self, hidden: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The confidence head's logit [B] (its sigmoid is the survival probability)."""
        return self.confidence(torch.cat([hidden, z], -1)).squeeze(-1)

    def num_bytes(self) -> int:
        """Bytes of the head's parameters."""
        return sum(p.numel() * p.element_size() for p in self.parameters())


@dataclass
class MarkovWalk:
    """What one walk of a block gives: ``tokens`` [B, n] (the drafts), ``logits`` [B, n, V']
    (the corrected logits each was picked from, in the base logits' dtype) and
    ``confidences`` [B, n] float32 in [0, 1] (the confidence head's survival predictions)."""

    tokens: torch.Tensor
    logits: torch.Tensor
    confidences: torch.Tensor


#: picks the drafts of block position ``j`` from its corrected logits [B, V']: a LongTensor [B]
Picker = Callable[[int, torch.Tensor], torch.Tensor]


def greedy_pick(_j: int, logits: torch.Tensor) -> torch.Tensor:
    """The :data:`Picker` of greedy drafting: each row's argmax."""
    return logits.argmax(dim=-1)


def markov_walk(head: MarkovHead, base_logits: torch.Tensor, hidden: torch.Tensor,
                embedding: torch.Tensor, first_prev: torch.Tensor,
                pick: Picker = greedy_pick) -> MarkovWalk:
    """Walk a block once (module docstring): for ``j = 0 .. n-1``, bias position ``j``'s base
    logits by the token picked at ``j - 1`` (``first_prev`` for ``j = 0``), pick position
    ``j``'s token from the corrected logits with ``pick``, and score it with the confidence
    head. No transformer forward: one rank-``r`` step per position, batched over the rows.

    Args:
        head: the Markov and confidence heads.
        base_logits: [B, n, V'] the block's logits from the parallel forward (``V' <= V``:
            columns past ``V'`` of the bias are dropped; ``-inf`` columns stay ``-inf``).
        hidden: [B, n, d] the block's final hidden states.
        embedding: [V_e, d] the token embedding the previous tokens are looked up in.
        first_prev: [B] long, each row's last context token.
        pick: chooses the tokens of a position from its corrected logits (default argmax);
            a sampler makes the walk a sample of the sequential draft distribution.

    Raises:
        ValueError: shapes that do not fit each other.
    """
    if base_logits.dim() != 3 or hidden.shape[:2] != base_logits.shape[:2] \
            or first_prev.shape != base_logits.shape[:1]:
        raise ValueError(f"markov_walk needs base_logits [B, n, V], hidden [B, n, d] and "
                         f"first_prev [B]; got {tuple(base_logits.shape)}, "
                         f"{tuple(hidden.shape)}, {tuple(first_prev.shape)}")
    dtype = head.to_vocab.weight.dtype
    width = base_logits.shape[-1]
    prev = first_prev.long()
    state = None
    tokens, logits, conf = [], [], []
    for j in range(base_logits.shape[1]):
        h = hidden[:, j].to(dtype)
        z, state = head.step(h, embedding[prev].to(dtype), state)
        step_logits = base_logits[:, j] + head.bias(z)[:, :width].to(base_logits.dtype)
        prev = pick(j, step_logits).long()
        tokens.append(prev)
        logits.append(step_logits)
        conf.append(torch.sigmoid(head.confidence_logit(h, z).float()))
    return MarkovWalk(torch.stack(tokens, 1), torch.stack(logits, 1),
                      torch.stack(conf, 1).clamp(0.0, 1.0))


__all__ = ["MARKOV_KINDS", "MarkovHead", "MarkovWalk", "check_markov", "greedy_pick",
           "markov_walk"]
