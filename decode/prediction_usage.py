"""The verifier's count of a request's prediction drafts (OpenAI Predicted Outputs): how many
drafts copied from the client's prediction it accepted and how many it rejected, reported as
``usage.completion_tokens_details.accepted_prediction_tokens`` / ``rejected_prediction_tokens``.

Only the verifier knows which drafts it accepted, and only the drafter knows where a draft came
from: the drafter marks prediction segments (DraftTailStream.from_prediction), the tail buffer
keeps one flag per draft, and each verify step hands this class the flags of the drafts it
verified. Accepted + rejected = the prediction drafts verified, counted like the spec stats:
nothing past the end of the output (EOS, stop token, max_tokens, or a stop string the gateway
found later, :meth:`PredictionUsage.cut`) and nothing never verified (drafts still in the tail
when the request ends, or past the step's kappa). Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def _counted(flags: Sequence[bool], num_accepted: int, num_kept: int | None) -> tuple[int, int]:
    """``(accepted, rejected)`` prediction drafts of one step: ``flags[i]`` tells whether the
    draft at depth ``i + 1`` came from the prediction, the first ``num_accepted`` of them were
    accepted, and only the first ``num_kept`` depths lie inside the output (None: all)."""
    kept = len(flags) if num_kept is None else max(min(num_kept, len(flags)), 0)
    accepted = sum(flags[:min(num_accepted, kept)])
    return accepted, sum(flags[:kept]) - accepted


@dataclass
class PredictionUsage:
    """Accepted and rejected prediction drafts of one request (module docstring); ``steps``
    keeps, per verify step that verified prediction drafts, ``(first output position it
    committed, tokens committed, flags, accepted drafts on the flagged chain, accepted
    prediction drafts, rejected prediction drafts)`` so that a stop string found later can cut
    the counts."""

    num_accepted: int = 0
    num_rejected: int = 0
    steps: list[tuple[int, int, tuple[bool, ...], int, int, int]] = field(default_factory=list)

    def observe(self, start: int, num_committed: int, flags: Sequence[bool],
                num_accepted: int, ended: bool) -> None:
        """Record a verify step: ``flags`` (one per draft along the verified chain, True for
        a prediction draft), of which the first ``num_accepted`` were accepted; it committed
        ``num_committed`` tokens from output position ``start`` and ``ended`` the output
        there (drafts past its end are not counted)."""
        if not any(flags):
            return
        flags = tuple(bool(f) for f in flags)
        a, r = _counted(flags, num_accepted, num_committed if ended else None)
        self.num_accepted += a
        self.num_rejected += r
        self.steps.append((start, num_committed, flags, num_accepted, a, r))

    def cut(self, num_output_tokens: int) -> None:
        """The output ended after ``num_output_tokens`` tokens (a stop string): recount
        without the drafts past there (a no-op when no step committed past it)."""
        accepted = rejected = 0
        steps = []
        for start, n, flags, num_accepted, a, r in self.steps:
            if start >= num_output_tokens:
                break
            if start + n > num_output_tokens:
                n = num_output_tokens - start
                a, r = _counted(flags, num_accepted, n)
            if a or r:
                steps.append((start, n, flags, num_accepted, a, r))
                accepted, rejected = accepted + a, rejected + r
        self.num_accepted, self.num_rejected, self.steps = accepted, rejected, steps
