"""forward_cost_ratio runs real forwards of both sizes (timings themselves live in the bench)."""

import pytest
import torch

from specmesh.benchmarks.harness.method_table import forward_cost_ratio
from helpers.models import tiny_llama


def test_forward_cost_measures_both_sizes():
    _, model, cfg = tiny_llama(seed=0, dtype=torch.float32)
    cost = forward_cost_ratio(model, cfg, 4, context_len=20, repeats=2, block_size=4)
    assert cost.num_tokens == 5 and cost.context_len == 20
    assert cost.single_ms > 0 and cost.multi_ms > 0
    assert cost.ratio == pytest.approx(cost.multi_ms / cost.single_ms)
    assert set(cost.as_dict()) == {"context_len", "num_tokens", "batch", "single_ms",
                                   "multi_ms", "ratio"}
    assert cost.batch == 1
    batched = forward_cost_ratio(model, cfg, 4, context_len=20, repeats=2, block_size=4, batch=3)
    assert batched.batch == 3 and batched.as_dict()["batch"] == 3 and batched.ratio > 0
    with pytest.raises(ValueError):
        forward_cost_ratio(model, cfg, 0)
    with pytest.raises(ValueError, match="batch"):
        forward_cost_ratio(model, cfg, 4, batch=0)
    with pytest.raises(ValueError, match="exceeds"):
        forward_cost_ratio(model, cfg, 4, context_len=cfg.max_position_embeddings)
