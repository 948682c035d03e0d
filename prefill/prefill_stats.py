"""The counters of a prefill worker (prefill/worker.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefillStats:
    """What a prefill worker did since it started (the role's metrics, cluster/metrics.py):
    requests, tokens, KV frames and bytes sent, failures and drops, and the prefix cache's
    queries and hits in tokens (vLLM's names), the draft seeds made."""

    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_frames_sent: int = 0
    num_bytes_sent: int = 0
    num_cancelled: int = 0
    num_failed: int = 0
    num_protocol_errors: int = 0
    num_dropped_backlog: int = 0  # queued requests of a verifier that went away or restarted
    num_dropped_messages: int = 0  # an Abort for no queued request, a kind prefill does not take
    num_computed_tokens: int = 0  # prompt tokens run through a forward (cache hits are not)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (vLLM's name)
    prefix_cache_hits: int = 0  # of those, tokens whose KV was cached (not computed)
    #: draft seeds made after the forward (prefill/draft_seed.py), their bytes, seeders failed
    num_draft_seeds: int = 0
    draft_seed_bytes: int = 0
    num_draft_seed_errors: int = 0
