"""Speculation statistics: the one place their arithmetic lives
(docs/architecture.md, 'Observability').

Terms as in vLLM's spec-decode metrics: ``num_draft_tokens`` drafts the verifier checked,
``num_accepted_tokens`` of which accepted, ``num_verify_steps`` verify steps that carried at
least one draft (vLLM's ``num_drafts``). ``acceptance_rate`` = accepted / drafted;
``mean_accept_len`` = accepted / verify steps (an accept length counts accepted drafts only,
not the bonus or recovered token).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecStats:
    """Counters of one request, one run or one role; all counts are tokens or steps."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    #: drafts were accepted by the synthetic-acceptance ablation harness, not verified
    synthetic_acceptance: bool = False

    def observe(self, num_draft_tokens: int, accept_len: int) -> None:
        """Record one verify step of one request that carried ``num_draft_tokens`` drafts."""
        if num_draft_tokens <= 0:
            return
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += accept_len
        self.num_verify_steps += 1

    @staticmethod
    def cut_step(num_draft_tokens: int, accept_len: int, num_kept: int) -> tuple[int, int]:
        """``(drafts, accepted)`` of a verify step whose output ends after ``num_kept`` of the
        tokens it committed (EOS, stop token, max_tokens or a stop string inside it): a draft
        past the end of the output is neither drafted nor accepted
        (docs/architecture.md, 'The verify step')."""
        kept = max(num_kept, 0)
        return min(num_draft_tokens, kept), min(accept_len, kept)

    def add(self, other: SpecStats) -> None:
        """Add ``other``'s counters to these."""
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_verify_steps += other.num_verify_steps
        self.synthetic_acceptance = self.synthetic_acceptance or other.synthetic_acceptance

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafts checked (0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accept_len(self) -> float:
        """Accepted drafts per verify step that carried drafts (0 when none did)."""
        return self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else 0.0

    def as_dict(self) -> dict:
        """The counters and both ratios, as every response's ``spec_stats`` carries them, and
        ``synthetic_acceptance`` (true when the ablation harness accepted the drafts)."""
        return {"num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_verify_steps": self.num_verify_steps,
                "acceptance_rate": self.acceptance_rate,
                "mean_accept_len": self.mean_accept_len,
                "synthetic_acceptance": self.synthetic_acceptance}
