"""Settings of the drafter worker."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Verify steps of drafts the default window holds: one tail in flight, one being verified.
RUN_AHEAD_STEPS = 2


@dataclass(frozen=True)
class DrafterConfig:
    """``window``: tokens drafted past the committed prefix (W >= kappa); ``max_segment``: most
    tokens proposed per request per step, so one long request cannot starve the others.
    ``draft_probs``: send the rows of drafts a model drafter samples for unseeded sampled
    requests (DraftTailStream.draft_probs; the rejection and block rules use them; off for a
    rule that does not, e.g. synthetic acceptance). ``seed``: seeds the drafter's generator for
    those samples (None: a fresh one)."""

    method: str = "ngram"
    window: int = 8
    max_segment: int = 8
    max_requests: int = 4096
    method_kwargs: dict = field(default_factory=dict)
    draft_probs: bool = True
    seed: int | None = None

    @staticmethod
    def default_window(num_speculative_tokens: int) -> int:
        """Run-ahead for a verifier with kappa ``num_speculative_tokens``: two steps' worth of
        drafts (one tail in flight, one being verified), at least 1."""
        return max(RUN_AHEAD_STEPS * num_speculative_tokens, 1)
