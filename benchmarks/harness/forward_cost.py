"""What a verify step costs against a plain decode step, measured on the machine at hand
(docs/architecture.md, 'Running on CPU': the ratio decides what speculation can gain; it differs by
dtype and CPU).

:func:`forward_cost_ratio` times our engine's forward of ``kappa + 1`` tokens and of one token
per request after the same cached context, for a batch of requests, interleaved, and returns
the medians and their ratio. The bench measures it at each concurrency it runs (a batch that
size) and prints it next to the measured time of verify steps with and without drafts: at
batch 16 the ratio is that of 80 rows to 16, not of 5 to 1.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardCost:
    """Median milliseconds of a forward of 1 token and of (kappa+1) tokens per request, for
    ``batch`` requests each after ``context_len`` cached tokens; ``ratio`` = multi / single."""

    context_len: int
    num_tokens: int
    single_ms: float
    multi_ms: float
    batch: int = 1

    @property
    def ratio(self) -> float:
        return self.multi_ms / self.single_ms if self.single_ms else 0.0

    def as_dict(self) -> dict:
        return {"context_len": self.context_len, "num_tokens": self.num_tokens,
                "batch": self.batch, "single_ms": self.single_ms, "multi_ms": self.multi_ms,
                "ratio": self.ratio}


def forward_cost_ratio(model, config, num_speculative_tokens: int, context_len: int = 200,
                       repeats: int = 15, block_size: int = 16, batch: int = 1,
                       kv_cache_dtype: str = "auto") -> ForwardCost:
    """Time forwards of 1 vs ``num_speculative_tokens + 1`` tokens per request of ``model``
    (an ``engine.model.LlamaForCausalLM``) for ``batch`` requests, each after its own
    ``context_len``-token prefix, interleaved, ``repeats`` times each after one warm-up, over
    a KV cache of ``kv_cache_dtype`` (``--kv-cache-dtype``; ``auto``: the model's).

    Raises:
        ValueError: ``num_speculative_tokens < 1``, ``batch < 1``, a context longer than
            the model allows, or a KV cache dtype the model cannot have.
    """
    # torch and the engine's runner: this module is imported by the bench before a model loads
    import torch

    from specmesh.engine.dtypes import resolve_kv_cache_dtype
    from specmesh.engine.kv_cache import KVCache
    from specmesh.engine.runner import ModelRunner, SeqChunk

    if num_speculative_tokens < 1:
        raise ValueError("num_speculative_tokens must be >= 1")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    k1 = num_speculative_tokens + 1
    if context_len + k1 > config.max_position_embeddings:
        raise ValueError(f"context {context_len} + {k1} exceeds the model's positions")
    num_blocks = -(-(context_len + k1) // block_size)
    runner = ModelRunner(model, config, KVCache(
        config, num_blocks * batch, block_size,
        resolve_kv_cache_dtype(kv_cache_dtype, model.dtype), model.device))
    tables = [list(range(b * num_blocks, (b + 1) * num_blocks)) for b in range(batch)]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (context_len + k1,), generator=gen).tolist()
               for _ in range(batch)]
    for prompt, table in zip(prompts, tables):
        runner.prefill(prompt[:context_len], table)
    single, multi = [], []

    def timed(n: int) -> float:
        chunks = [SeqChunk(p[context_len:context_len + n], context_len, t)
                  for p, t in zip(prompts, tables)]
        t0 = time.perf_counter()
        runner.forward(chunks, logits="all")
        return (time.perf_counter() - t0) * 1e3

    timed(1)
    timed(k1)
    for _ in range(repeats):
        single.append(timed(1))
        multi.append(timed(k1))
    return ForwardCost(context_len, k1, statistics.median(single), statistics.median(multi),
                       batch)
