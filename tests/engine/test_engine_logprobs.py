"""engine/logprobs.py: the float32 log_softmax of each row at its token, and the row's top k,
over more rows than one block (ROWS_PER_BLOCK), from float64 and bfloat16 logits too."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine.logprobs import ROWS_PER_BLOCK, token_logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_token_logprobs_against_log_softmax(dtype):
    g = torch.Generator().manual_seed(0)
    n, vocab = ROWS_PER_BLOCK + 37, 64
    logits = (torch.randn(n, vocab, generator=g) * 3).to(dtype)
    ids = torch.randint(0, vocab, (n,), generator=g).tolist()
    ref = torch.log_softmax(logits.float(), dim=-1)
    out = token_logprobs(logits, ids, 4)
    torch.testing.assert_close(torch.tensor(out.token_logprobs),
                               ref[torch.arange(n), torch.tensor(ids)], atol=1e-6, rtol=0)
    top = ref.topk(4, dim=-1)
    assert out.top_token_ids == top.indices.tolist()
    torch.testing.assert_close(torch.tensor(out.top_logprobs), top.values, atol=1e-6, rtol=0)
    chosen = ref[torch.arange(n), torch.tensor(ids)]
    assert out.ranks == ((ref > chosen[:, None]).sum(-1) + 1).tolist()
    assert all(r == 1 for r, t, top in zip(out.ranks, ids, out.top_token_ids) if t == top[0])
    none = token_logprobs(logits, ids, 0)
    assert none.token_logprobs == out.token_logprobs and none.top_token_ids == [[]] * n


def test_token_logprobs_refuses_mismatched_input():
    with pytest.raises(ValueError):
        token_logprobs(torch.zeros(2, 8), [1], 1)
    with pytest.raises(ValueError):
        token_logprobs(torch.zeros(1, 8), [1], 9)
    assert token_logprobs(torch.zeros(0, 8), [], 2).token_logprobs == []
