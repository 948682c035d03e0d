"""A few seconds of real verify forwards at a verifier's start: the cost of one forward of
``batch`` requests carrying ``width`` tokens each, for the goodput policy's profiled table
(decode/cost_table.py; cached per model, dtype, KV-cache dtype and CPU by
cluster/verify_cost.py).

The forwards run on the verifier's own runner and KV cache before it admits any request: each
timed request gets its own blocks (the first ones of the cache), a short random context is
prefilled into them, then every ``(batch, width)`` forward is timed, the points taking turns
round by round so that load from other processes falls on all alike; each point's fastest
round is kept (as engine/forward_probe.py does, for the same reason: on shared cores a median
measures the neighbours). The KV written is garbage the first requests overwrite.
"""

from __future__ import annotations

import time

import torch

from specmesh.engine.runner import ModelRunner, SeqChunk

#: cached tokens per timed request before its verify tokens (a short chat turn's prefix)
PROBE_CONTEXT_LEN = 32
#: timed rounds per point, after one untimed warm-up round
PROBE_ROUNDS = 3


def measure_verify_costs(runner: ModelRunner, batch_sizes: tuple[int, ...],
                         widths: tuple[int, ...], rounds: int = PROBE_ROUNDS,
                         context_len: int = PROBE_CONTEXT_LEN,
                         seed: int = 0) -> dict[tuple[int, int], float]:
    """Seconds of a verify forward (logits of every row, as the verifier asks) at each
    ``(batch, width)`` of ``batch_sizes`` x ``widths``: the fastest of ``rounds``.

    Raises:
        ValueError: ``rounds < 1``, a size below 1, or a cache too small for the largest
            batch (it needs ``max(batch_sizes)`` requests of ``context_len + max(widths)``
            tokens).
    """
    if rounds < 1 or min(batch_sizes) < 1 or min(widths) < 1:
        raise ValueError("rounds and every batch size and width must be >= 1")
    cfg, bs = runner.config, runner.block_size
    ctx = max(min(context_len, cfg.max_position_embeddings - max(widths)), 1)
    per_request = -(-(ctx + max(widths)) // bs)
    need = per_request * max(batch_sizes)
    if need > runner.kv_cache.num_blocks:
        raise ValueError(f"the verify cost probe needs {need} KV blocks, the cache has "
                         f"{runner.kv_cache.num_blocks}")
    gen = torch.Generator().manual_seed(seed)
    tables, ids = [], []
    for i in range(max(batch_sizes)):
        table = list(range(i * per_request, (i + 1) * per_request))
        tokens = torch.randint(0, cfg.vocab_size, (ctx + max(widths),), generator=gen).tolist()
        runner.prefill(tokens[:ctx], table)
        tables.append(table)
        ids.append(tokens)

    def timed(batch: int, width: int) -> float:
        chunks = [SeqChunk(ids[i][ctx:ctx + width], ctx, tables[i]) for i in range(batch)]
        t0 = time.perf_counter()
        runner.forward(chunks, logits="all")
        return time.perf_counter() - t0

    best: dict[tuple[int, int], float] = {}
    for r in range(rounds + 1):  # round 0 warms up (first packs, page faults)
        for b in batch_sizes:
            for w in widths:
                t = timed(b, w)
                if r:
                    best[(b, w)] = min(best.get((b, w), t), t)
    return best


__all__ = ["PROBE_CONTEXT_LEN", "PROBE_ROUNDS", "measure_verify_costs"]
