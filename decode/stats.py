"""Counters of the verifier (exported as Prometheus metrics by cluster/, DESIGN.md §10)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class VerifierStats:
    """Plain counters; ``num_accepted_tokens_per_pos[i]`` counts accepted drafts at draft
    position i (vLLM's ``spec_decode_num_accepted_tokens_per_pos``)."""

    max_num_draft_tokens: int
    num_steps: int = 0
    num_finished: int = 0
    num_generated_tokens: int = 0
    num_drafts: int = 0  # verify steps x requests that carried at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_stale_tail_tokens: int = 0
    num_dropped_tails: int = 0
    num_protocol_errors: int = 0
    num_ignored_messages: int = 0
    num_rejected_queue_full: int = 0
    kv_transfer_bytes: int = 0
    ttft_seconds_total: float = 0.0
    num_ttft: int = 0

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = [0] * self.max_num_draft_tokens

    def observe_verify(self, num_draft_tokens: int, accept_len: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += accept_len
        for i in range(accept_len):
            self.num_accepted_tokens_per_pos[i] += 1

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_seconds_total += seconds
        self.num_ttft += 1

    @property
    def mean_accept_len(self) -> float:
        return self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
