"""Settings of the prefill worker."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PrefillConfig:
    """``chunk_size``: prompt tokens per forward (chunked prefill); ``frame_tokens`` and
    ``frame_layers``: the KV of at most that many tokens x layers per KVFrame.
    ``seed_states``: draft method -> the seed state PrefillDone carries for a request of that
    method (``"hidden"``: the target hidden state at the last prompt position); a method not
    listed gets none. The cluster fills it from the drafter's registry (prefill/ may not
    import drafter/)."""

    instance_id: str = "prefill-0"
    chunk_size: int = 512
    frame_tokens: int = 256
    frame_layers: int = 8
    max_queue_len: int = 1024
    seed_states: dict[str, str] = field(default_factory=dict)
