"""A request's draft acceptance, as the goodput caps (decode/goodput.py) and the tail wait
(decode/tail_wait.py) value its drafts: two rates over decayed counts of the verify steps that
carried drafts, ``a1`` for the first draft and ``ac`` for a later one once the drafts before it
held, so the ``j``-th draft is accepted with probability ``a1 * ac^(j-1)``; and the one-rate
geometric fit (Leviathan et al., arXiv 2211.17192) that the confidence budget's fallback
score and the chapter's model use. Why two rates: decode/goodput.py's module doc."""

from __future__ import annotations

from dataclasses import dataclass

#: Weight of the past in a request's acceptance counts, per step that carried drafts.
ACCEPTANCE_DECAY = 0.8
@dataclass
class Acceptance:
    """A request's draft acceptance from the verify steps that carried its drafts, as decayed
    counts: over all drafts (``accepted`` drafts and ``rejected``, a step that accepted fewer
    than it verified; :attr:`rate`), at the first position (``first_*``) and at the later ones
    once the earlier held (``later_*``), for :meth:`gain`. Starts optimistic (one accepted, no
    rejection, everywhere), as the accept-length EMA does, so drafts are tried first and a
    request whose drafts were only ever verified one at a time still tries a second."""

    accepted: float = 1.0
    rejected: float = 0.0
    num_steps: int = 0  # verify steps that carried drafts
    first_accepted: float = 1.0
    first_rejected: float = 0.0
    later_accepted: float = 1.0
    later_rejected: float = 0.0

    def observe(self, accept_len: int, num_drafts: int) -> None:
        """One verify step that carried ``num_drafts`` drafts, ``accept_len`` accepted."""
        d, missed = ACCEPTANCE_DECAY, accept_len < num_drafts
        self.accepted = d * self.accepted + accept_len
        self.rejected = d * self.rejected + missed
        self.first_accepted = d * self.first_accepted + (accept_len > 0)
        self.first_rejected = d * self.first_rejected + (accept_len == 0)
        if num_drafts > 1 and accept_len > 0:  # the second position was judged
            self.later_accepted = d * self.later_accepted + accept_len - 1
            self.later_rejected = d * self.later_rejected + missed
        self.num_steps += 1

    @property
    def rate(self) -> float:
        """The chance a draft is accepted given the ones before it were, in [0, 1], one rate
        for every position (the geometric fit)."""
        return _share(self.accepted, self.rejected)

    def gain(self, j: int) -> float:
        """The chance the ``j``-th draft (``j`` >= 1) is accepted, the ones before it too:
        ``a1 * ac ** (j - 1)``; never increasing in ``j``."""
        return _share(self.first_accepted, self.first_rejected) \
            * _share(self.later_accepted, self.later_rejected) ** (j - 1)

    def expected(self, num_drafts: int) -> float:
        """Mean tokens committed by a step verifying ``num_drafts`` of its drafts."""
        return 1.0 + sum(self.gain(j) for j in range(1, num_drafts + 1))


def _share(accepted: float, rejected: float) -> float:
    total = accepted + rejected
    return accepted / total if total > 0 else 0.0


def draft_gain(acceptance: Acceptance | float, j: int) -> float:
    """The ``j``-th draft's expected gain in tokens for ``acceptance`` (an
    :class:`Acceptance`, or one rate ``a`` for every position: ``a ** j``)."""
    if isinstance(acceptance, Acceptance):
        return acceptance.gain(j)
    return acceptance ** j


def expected_tokens(rate: float, num_drafts: int) -> float:
    """Mean tokens committed by a step verifying ``num_drafts`` drafts whose acceptance is
    ``rate`` (geometric model): ``1 + rate + ... + rate^num_drafts``."""
    return sum(rate ** j for j in range(num_drafts + 1))


__all__ = ["ACCEPTANCE_DECAY", "Acceptance", "draft_gain", "expected_tokens"]
