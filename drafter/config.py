"""Settings of the drafter worker."""

from __future__ import annotations

from dataclasses import dataclass, field

#: The n-gram drafter's shortest and longest suffix match by default (drafter/proposers/ngram.py)
DEFAULT_MIN_NGRAM = 2
DEFAULT_MAX_NGRAM = 4
#: Verify steps of drafts the default window holds: one tail in flight, one being verified.
RUN_AHEAD_STEPS = 2


@dataclass(frozen=True)
class DrafterConfig:
    """``window``: tokens drafted past the committed prefix (W >= kappa); ``max_segment``: most
    tokens proposed per request per step, so one long request cannot starve the others.
    ``draft_probs``: send the rows of drafts a model drafter samples for unseeded sampled
    requests (DraftTailStream.draft_probs; the rejection and block rules use them; off for a
    rule that does not, e.g. synthetic acceptance). ``seed``: seeds the drafter's generator for
    those samples (None: a fresh one). ``num_branches``: candidates per position for which a
    proposer that prepares branches (:meth:`drafter.proposer.Proposer.propose_branches`)
    drafts ahead of the commit, at the first ``branch_positions`` positions of the path, once
    its run-ahead is full (0: none). ``prediction_window``: how far a path may run past the
    committed prefix in tokens copied from the request's prediction (OpenAI Predicted Outputs;
    copying costs no forward, so neither ``max_segment`` nor the verifier's
    ``num_drafts_wanted`` bounds it, only this; 0: the ``window``). A verifier that verifies
    up to ``num_prediction_tokens`` prediction drafts a step needs twice that here (one tail
    in flight, one being verified: :meth:`default_window`)."""

    method: str = "ngram"
    window: int = 8
    max_segment: int = 8
    max_requests: int = 4096
    method_kwargs: dict = field(default_factory=dict)
    draft_probs: bool = True
    seed: int | None = None
    num_branches: int = 4
    branch_positions: int = 2
    prediction_window: int = 0

    def __post_init__(self) -> None:
        if self.num_branches < 0 or self.branch_positions < 0:
            raise ValueError("num_branches and branch_positions must be >= 0")
        if self.prediction_window < 0:
            raise ValueError(f"prediction_window must be >= 0 (0: the window), got "
                             f"{self.prediction_window}")

    @staticmethod
    def default_window(num_speculative_tokens: int) -> int:
        """Run-ahead for a verifier with kappa ``num_speculative_tokens``: two steps' worth of
        drafts (one tail in flight, one being verified), at least 1."""
        return max(RUN_AHEAD_STEPS * num_speculative_tokens, 1)
