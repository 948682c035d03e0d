"""Settings of the prefill worker."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillConfig:
    """``chunk_size``: prompt tokens per forward (chunked prefill); ``frame_tokens`` and
    ``frame_layers``: the KV of at most that many tokens x layers per KVFrame."""

    instance_id: str = "prefill-0"
    chunk_size: int = 512
    frame_tokens: int = 256
    frame_layers: int = 8
    max_queue_len: int = 1024
