"""The PARD proposer (drafter/proposers/pard.py) on a tiny float64 Llama: each propose is one
forward whose drafts equal the argmax rows of a plain causal forward over [context, MASK x
(k-1)]; the KV is extended by the new context tokens only (mask K/V are overwritten), and a
context that left the cached path, or one longer than the catch-up limit, drafts the same as
a fresh request; batched proposes equal single ones; the mask id is never drafted."""

from __future__ import annotations

import pytest
import torch

from specmesh.drafter.draft_sampling import DraftSampling
from specmesh.drafter.proposer import ProposeCall
from specmesh.drafter.proposers.pard import CATCH_UP_LIMIT, PardProposer
from specmesh.protocol.messages import SamplingParams
from helpers.models import tiny_llama

MASK = 126
BLOCK = 4


@pytest.fixture(scope="module")
def models():
    hf, ours, cfg = tiny_llama(seed=4, dtype=torch.float64, vocab_size=128)
    return hf, ours, cfg


def _proposer(models, **kw) -> PardProposer:
    _, ours, cfg = models
    return PardProposer(ours, cfg, MASK, BLOCK, num_blocks=64, block_size=4, **kw)


def _reference(models, ctx: list[int], n: int) -> list[int]:
    """Argmax of the last n rows of a causal forward over [ctx, MASK x (n-1)], never MASK."""
    hf = models[0]
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ctx + [MASK] * (n - 1)])).logits[0, -n:]
    logits[:, MASK] = float("-inf")
    return logits.argmax(-1).tolist()


def _ctx(seed: int, n: int) -> list[int]:
    return torch.randint(0, 120, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_one_forward_drafts_the_block(models):
    p = _proposer(models)
    ctx = _ctx(0, 9)
    drafts = p.propose("r", ctx, 3)
    assert drafts == _reference(models, ctx, 3)
    assert p.stats.num_forwards == 1 and p.stats.num_tokens_computed == 9 + 2
    assert p.num_cached_tokens("r") == 9
    # asked for more than the block: the block
    assert len(p.propose("r", ctx, 10)) == BLOCK


def test_kv_is_extended_by_the_new_tokens_only(models):
    p = _proposer(models)
    ctx = _ctx(1, 7)
    p.propose("r", ctx, BLOCK)
    before = p.stats.num_tokens_computed
    ext = ctx + [3, 44, 5]  # three committed tokens since
    drafts = p.propose("r", ext, BLOCK)
    # the forward fed the 3 new tokens and BLOCK-1 masks, reading the cached 7 (the mask
    # rows of the first call were overwritten)
    assert p.stats.num_tokens_computed - before == 3 + BLOCK - 1
    assert drafts == _reference(models, ext, BLOCK)
    assert drafts == _proposer(models).propose("fresh", ext, BLOCK)


def test_a_context_that_left_the_cached_path_recomputes_from_the_common_prefix(models):
    p = _proposer(models)
    ctx = _ctx(2, 8)
    p.propose("r", ctx + [9, 10, 11], BLOCK)
    other = ctx + [12]  # the verifier rejected 9: the context diverges after ctx
    before = p.stats.num_tokens_computed
    assert p.propose("r", other, BLOCK) == _reference(models, other, BLOCK)
    assert p.stats.num_tokens_computed - before == 1 + BLOCK - 1
    p.rollback("r", 3)
    assert p.num_cached_tokens("r") == 3
    assert p.propose("r", other, 2) == _reference(models, other, 2)


def test_a_long_context_is_caught_up_in_chunks_first(models):
    p = _proposer(models, prefill_chunk_size=8)
    ctx = _ctx(3, CATCH_UP_LIMIT + 20)
    assert p.propose("r", ctx, BLOCK) == _reference(models, ctx, BLOCK)
    assert p.stats.num_block_forwards == 1 and p.stats.num_forwards > 1


def test_batched_proposes_equal_single_ones_and_close_frees_blocks(models):
    p = _proposer(models)
    ctxs = [_ctx(10 + i, 5 + 3 * i) for i in range(3)]
    out = p.propose_many([ProposeCall(f"r{i}", c, 2 + i) for i, c in enumerate(ctxs)])
    assert p.stats.num_block_forwards == 1
    for i, c in enumerate(ctxs):
        assert out[i][0] == _reference(models, c, 2 + i)
        assert out[i][1] == [None] * (2 + i)
    free = p.block_manager.num_free_blocks
    p.close("r1")
    assert p.block_manager.num_free_blocks > free


def test_no_drafts_for_empty_or_out_of_vocab_contexts(models):
    p = _proposer(models)
    assert p.propose("r", [], 3) == []
    assert p.propose("r", [1, 500], 3) == [] and p.stats.num_out_of_vocab == 1
    assert p.propose("r", [1, 2], 0) == []


def test_the_mask_id_is_never_drafted(models):
    p = _proposer(models)
    logits = torch.zeros(3, 128, dtype=torch.float64)
    logits[:, MASK] = 10.0
    logits[:, 7] = 1.0
    assert p._pick_block(logits, None)[0] == [7, 7, 7]


def test_sampled_requests_get_a_row_per_draft(models):
    p = _proposer(models)
    how = DraftSampling(SamplingParams(temperature=0.8, max_tokens=8), first_position=0,
                        with_probs=True)
    drafts, rows = p.propose_sampled("r", _ctx(5, 6), 3, how)
    assert len(drafts) == len(rows) == 3
    for d, row in zip(drafts, rows):
        assert row.shape == (128,) and row[d] > 0 and row[MASK] == 0
        assert float(row.sum()) == pytest.approx(1.0, abs=1e-5)


def test_constructor_refuses_a_mask_outside_the_vocabulary(models):
    _, ours, cfg = models
    with pytest.raises(ValueError, match="mask token"):
        PardProposer(ours, cfg, 128, BLOCK, num_blocks=4)
