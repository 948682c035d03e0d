"""Counters of the verifier (exported as Prometheus metrics by cluster/,
docs/architecture.md, 'Observability')."""

from __future__ import annotations

from dataclasses import dataclass, field

from specmesh.protocol.spec_stats import SpecStats


@dataclass
class VerifierStats(SpecStats):
    """Plain counters of one verifier; the spec-decode ones (``num_draft_tokens``,
    ``num_accepted_tokens``, ``num_verify_steps`` = vLLM's ``num_drafts``) come from
    :class:`SpecStats`. ``num_accepted_tokens_per_pos[i]`` counts accepted drafts at draft
    position i (vLLM's ``spec_decode_num_accepted_tokens_per_pos``), for positions below
    ``max_num_speculative_tokens``."""

    max_num_speculative_tokens: int = 0
    num_steps: int = 0
    num_finished: int = 0
    num_generated_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_stale_tail_tokens: int = 0
    num_dropped_tails: int = 0
    num_protocol_errors: int = 0
    num_ignored_messages: int = 0
    num_rejected_queue_full: int = 0
    num_sibling_forks: int = 0  # requests started on a sibling's prompt KV (decode/siblings.py)
    num_tail_waits: int = 0  # steps that waited for a tail in flight
    num_drafter_closes: int = 0  # requests a drafter closed (full): plain decode from then
    num_drafters_lost: int = 0  # sends to a drafter that failed (not draining, unreachable)
    num_tree_verify_steps: int = 0  # request steps verified as a token tree
    num_tree_side_branch_accepts: int = 0  # ... whose accepted path left branch 0
    num_branch_candidates: int = 0  # DraftBranches candidates kept with a tail
    num_branch_hits: int = 0  # commits that took a prepared branch as the next tail
    kv_transfer_bytes: int = 0
    #: draft seed state received with PrefillDone (P/D: the target hidden state(s) at the last
    #: prompt position, decode/seed_state.py), bytes and requests that carried one
    seed_state_bytes: int = 0
    num_seed_states: int = 0
    #: the prefill's draft seeds (PrefillDone.draft_seed: the draft head's first step, SGLang's
    #: P/D EAGLE seed; DraftSeed.nbytes, counted in seed_state_bytes too), requests that carried
    #: a well-formed one, malformed ones ignored, and seeds sent on with a first DraftSync
    draft_seed_bytes: int = 0
    num_draft_seeds: int = 0
    num_bad_draft_seeds: int = 0
    num_draft_seeds_sent: int = 0
    #: draft seed state sent to drafters (target hidden rows of committed tokens with
    #: VerifyCommit, the window with DraftSync: EAGLE family, DFlash), bytes
    seed_state_sent_bytes: int = 0
    #: commits held from paused drafters and sent as one VerifyCommit when drafting resumed
    #: (decode/draft_link.py, DraftLink.notify_commit)
    num_held_commit_flushes: int = 0
    ttft_seconds_total: float = 0.0
    num_ttft: int = 0

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = [0] * self.max_num_speculative_tokens

    def observe_verify(self, num_draft_tokens: int, accept_len: int) -> None:
        """One request's verify step that carried ``num_draft_tokens`` drafts."""
        self.observe(num_draft_tokens, accept_len)
        for i in range(min(accept_len, len(self.num_accepted_tokens_per_pos))):
            self.num_accepted_tokens_per_pos[i] += 1

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_seconds_total += seconds
        self.num_ttft += 1
