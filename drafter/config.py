"""Settings of the drafter worker."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Verify steps of drafts the default window holds: one tail in flight, one being verified.
RUN_AHEAD_STEPS = 2


@dataclass(frozen=True)
class DrafterConfig:
    """``window``: tokens drafted past the committed prefix (W >= kappa); ``max_segment``: most
    tokens proposed per request per step, so one long request cannot starve the others."""

    method: str = "ngram"
    window: int = 8
    max_segment: int = 8
    max_requests: int = 4096
    method_kwargs: dict = field(default_factory=dict)

    @staticmethod
    def default_window(num_speculative_tokens: int) -> int:
        """Run-ahead for a verifier with kappa ``num_speculative_tokens``: two steps' worth of
        drafts (one tail in flight, one being verified), at least 1."""
        return max(RUN_AHEAD_STEPS * num_speculative_tokens, 1)
