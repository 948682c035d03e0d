"""Settings of the prefill worker."""

from __future__ import annotations

from dataclasses import dataclass, field

from specmesh.engine.hidden_layers import check_seed_state


@dataclass(frozen=True)
class PrefillConfig:
    """``chunk_size``: prompt tokens per forward (chunked prefill); ``frame_tokens`` and
    ``frame_layers``: the KV of at most that many tokens x layers per KVFrame.
    ``seed_states``: draft method -> the seed state PrefillDone carries for a request of that
    method (``"hidden"``: the target hidden state at the last prompt position); a method not
    listed gets none. The cluster fills it from the drafter's registry (prefill/ may not
    import drafter/). ``max_kv_send_mb_s``: a cap on the KV bandwidth this worker sends at,
    MiB/s (0: no cap): frames are paced so that a transfer never runs ahead of the cap (its
    first frame leaves at once), e.g. to leave a link shared with other traffic room, or to
    make a transfer last long enough to watch; the loop sends one request's frames at a time,
    so a cap also delays the next request's prefill. ``max_batch_tokens``: prompt tokens of one
    batched forward: waiting prompts of at most ``chunk_size`` tokens each run together up to
    it, as far as batching shortens their times to first token (prefill/batching.py); 1 runs
    one prompt per forward. ``enable_prefix_caching``: keep the full KV blocks of prompts
    prefilled in this worker's cache and compute a new prompt's cached prefix no more
    (prefill/prefix_cache.py, docs/operations.md 'Prefix caching'; vLLM's option); every
    prefill forward then attends through the paged kernel, so a prompt's KV and first token are
    the same bits whatever part of it was cached."""

    instance_id: str = "prefill-0"
    chunk_size: int = 512
    frame_tokens: int = 256
    frame_layers: int = 8
    max_queue_len: int = 1024
    seed_states: dict[str, str] = field(default_factory=dict)
    max_kv_send_mb_s: float = 0.0
    max_batch_tokens: int = 512
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for method, kind in self.seed_states.items():
            try:
                check_seed_state(kind)
            except ValueError as err:
                raise ValueError(f"draft method {method!r}: {err}") from None
        if self.chunk_size < 1 or self.max_batch_tokens < 1:
            raise ValueError(f"chunk_size and max_batch_tokens must be >= 1, got "
                             f"{self.chunk_size} and {self.max_batch_tokens}")
        if not self.max_kv_send_mb_s >= 0:
            raise ValueError(f"max_kv_send_mb_s must be >= 0 (0: no cap), got "
                             f"{self.max_kv_send_mb_s}")
