"""Cluster configuration: one frozen dataclass shared by every role of a deployment."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

ROLES = ("prefill", "verifier", "drafter", "gateway")


def default_threads(num_cores: int | None = None) -> dict[str, int]:
    """Thread plan (DESIGN.md §11). The verifier runs a forward every step and gets every core;
    prefill runs only when a request arrives and gets half; the n-gram drafter and the gateway
    are pure Python and get one. Roles overlap in time, so the plan oversubscribes on purpose
    only where work is rare (prefill)."""
    n = num_cores or os.cpu_count() or 2
    return {"verifier": n, "prefill": max(n // 2, 1), "drafter": 1, "gateway": 1}


@dataclass(frozen=True)
class ClusterConfig:
    """Everything a role needs to build its worker.

    ``kv_cache_mb``: KV memory per role (verifier and prefill each), MiB.
    ``num_draft_tokens``: kappa (0 = speculation off). ``window``: drafter run-ahead (tokens),
    default 2*kappa. ``tail_wait_fraction``: fraction of a verify step the verifier may wait
    for a draft tail in flight.
    """

    model: str | None = None
    dtype: str = "float32"
    num_draft_tokens: int = 4
    draft_method: str = "ngram"
    window: int | None = None
    block_size: int = 16
    kv_cache_mb: int = 512
    max_model_len: int = 2048
    max_num_seqs: int = 32
    max_queue_len: int = 256
    tail_wait_fraction: float = 0.25
    prefill_chunk_size: int = 512
    host: str = "127.0.0.1"
    port: int = 8000
    threads: dict[str, int] = field(default_factory=default_threads)

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 0:
            raise ValueError("num_draft_tokens must be >= 0")
        if self.dtype not in ("float32", "bfloat16", "float64", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if self.block_size < 1 or self.kv_cache_mb < 1:
            raise ValueError("block_size and kv_cache_mb must be >= 1")

    @property
    def drafter_window(self) -> int:
        return self.window or max(2 * self.num_draft_tokens, 1)

    def to_dict(self) -> dict:
        return asdict(self)
