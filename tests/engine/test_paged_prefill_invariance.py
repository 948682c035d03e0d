"""``paged=True`` prefill (the prefill's prefix caching asks for it): a prompt's KV and
last-token logits are the same bits however it is split into chunks and whatever computed the
KV before its first chunk, in float32 and bfloat16 (without it, a whole prompt attends through
SDPA and a chunk over cached KV through the paged kernel, which round differently)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.models import tiny_llama

from specmesh.engine.kv_cache import KVCache
from specmesh.engine.runner import ModelRunner

BLOCK = 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_split_anywhere_equals_the_whole_prompt(dtype):
    _, model, cfg = tiny_llama(seed=5, dtype=dtype, vocab_size=96, num_layers=3)
    rng = random.Random(0)
    prompt = [rng.randrange(96) for _ in range(45)]
    table = list(range(12))

    def run(pieces):
        runner = ModelRunner(model, cfg, KVCache(cfg, 16, BLOCK, dtype))
        start = 0
        for i, (n, chunk) in enumerate(pieces):
            if i == 0 and n < len(prompt):  # the prefix computed within a longer prompt
                other = prompt[:n] + [1, 2, 3]
                runner.prefill(other, table, chunk_size=chunk, paged=True)
            elif i == 0:
                logits = runner.prefill(prompt, table, chunk_size=chunk, paged=True)
            else:
                logits = runner.prefill(prompt[start:start + n], table, chunk_size=chunk,
                                        start_pos=start, paged=True)
            start += n
        return logits, runner.kv_cache.read_chunk(0, cfg.num_layers, table, 0, len(prompt))

    want_logits, want_kv = run([(45, None)])
    for pieces in ([(45, 8)], [(16, None), (29, None)], [(36, 5), (9, 4)]):
        logits, kv = run(pieces)
        assert torch.equal(logits, want_logits), pieces
        assert torch.equal(kv, want_kv), pieces
