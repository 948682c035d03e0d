"""What a verify step costs against a plain decode step, measured on the machine at hand
(DESIGN.md §11: the ratio decides what speculation can gain; it differs by dtype and CPU).

:func:`forward_cost_ratio` times our engine's forward of ``kappa + 1`` tokens and of one token
after the same cached context, interleaved, and returns the medians and their ratio. The
bench prints it next to the measured time of verify steps with and without drafts.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardCost:
    """Median milliseconds of a 1-token and a (kappa+1)-token forward after ``context_len``
    cached tokens; ``ratio`` = multi / single."""

    context_len: int
    num_tokens: int
    single_ms: float
    multi_ms: float

    @property
    def ratio(self) -> float:
        return self.multi_ms / self.single_ms if self.single_ms else 0.0

    def as_dict(self) -> dict:
        return {"context_len": self.context_len, "num_tokens": self.num_tokens,
                "single_ms": self.single_ms, "multi_ms": self.multi_ms, "ratio": self.ratio}


def forward_cost_ratio(model, config, num_speculative_tokens: int, context_len: int = 200,
                       repeats: int = 15, block_size: int = 16) -> ForwardCost:
    """Time 1-token vs ``num_speculative_tokens + 1``-token forwards of ``model`` (an
    ``engine.model.LlamaForCausalLM``) after a ``context_len``-token prefix, interleaved,
    ``repeats`` times each after one warm-up.

    Raises:
        ValueError: ``num_speculative_tokens < 1`` or a context longer than the model allows.
    """
    import torch

    from engine.kv_cache import KVCache
    from engine.runner import ModelRunner, SeqChunk

    if num_speculative_tokens < 1:
        raise ValueError("num_speculative_tokens must be >= 1")
    k1 = num_speculative_tokens + 1
    if context_len + k1 > config.max_position_embeddings:
        raise ValueError(f"context {context_len} + {k1} exceeds the model's positions")
    num_blocks = -(-(context_len + k1) // block_size)
    runner = ModelRunner(model, config, KVCache(config, num_blocks, block_size, model.dtype,
                                                model.device))
    table = list(range(num_blocks))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (context_len + k1,), generator=gen).tolist()
    runner.prefill(prompt[:context_len], table)
    single, multi = [], []

    def timed(ids: list[int]) -> float:
        t0 = time.perf_counter()
        runner.forward([SeqChunk(ids, context_len, table)], logits="all")
        return (time.perf_counter() - t0) * 1e3

    timed(prompt[context_len:context_len + 1])
    timed(prompt[context_len:])
    for _ in range(repeats):
        single.append(timed(prompt[context_len:context_len + 1]))
        multi.append(timed(prompt[context_len:]))
    return ForwardCost(context_len, k1, statistics.median(single), statistics.median(multi))
