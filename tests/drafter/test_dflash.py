"""The DFlash draft (drafter/dflash_model.py), its context KV (drafter/dflash_kv.py) and its
proposer (drafter/proposers/dflash.py) on a tiny random float64 draft: block shapes (one
forward, k mask rows, drafts at the mask rows), non-causal attention over context + block, the
training forward equal to serving's, the context KV written from the target's rows only (a
propose never grows or changes it), the proposer's limits, greedy drafts with their
probabilities, sampled drafts whose rows do not depend on the other drafts."""

from __future__ import annotations

import pytest
import torch

from specmesh.drafter.dflash_kv import ContextKV
from specmesh.drafter.dflash_config import DFlashConfig
from specmesh.drafter.dflash_model import MASK, DFlashDraft
from specmesh.drafter.draft_sampling import DraftSampling
from specmesh.drafter.proposer import ProposeCall
from specmesh.drafter.proposers.dflash import DFlashProposer
from specmesh.protocol.messages import SamplingParams

VOCAB, D, BLOCK = 40, 16, 3


def _draft(seed: int = 0, num_layers: int = 2, feature_layers=(1, 0),
           draft_vocab: list[int] | None = None, anchor: bool = False,
           norms: bool = False, max_run_ahead: int | None = None) -> DFlashDraft:
    cfg = DFlashConfig(hidden_size=D, num_heads=4, num_kv_heads=2, head_dim=4,
                       intermediate_size=32, vocab_size=VOCAB, num_layers=num_layers,
                       block=BLOCK, feature_layers=feature_layers,
                       draft_vocab_size=len(draft_vocab or []), anchor_input=anchor,
                       feature_norms=norms, max_run_ahead=max_run_ahead)
    torch.manual_seed(seed)
    draft = DFlashDraft(cfg).double()
    if draft_vocab:
        draft.set_draft_vocabulary(torch.tensor(draft_vocab))
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.4)
    g = torch.Generator().manual_seed(seed + 1)
    embed = torch.randn(VOCAB, D, generator=g, dtype=torch.float64)
    draft.set_target_weights(embed, torch.randn(VOCAB, D, generator=g, dtype=torch.float64))
    return draft.eval().requires_grad_(False)


def _rows(n: int, seed: int = 5) -> torch.Tensor:
    return torch.randn(n, 2 * D, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def _serve(draft: DFlashDraft, rows: torch.Tensor, rows_start: int, block: list[int],
           start: int) -> torch.Tensor:
    """Serving's hidden states of one block after the rows at positions < start."""
    n = start - rows_start
    kv = draft.context_kv(rows[:n], torch.arange(rows_start, start))
    return draft.block_hidden([(kv, block, start)])


def test_config_names_the_seed_state_and_width():
    cfg = _draft().config
    assert cfg.seed_state == "hidden:1,0" and cfg.seed_width == 2 * D
    assert DFlashConfig.from_dict(cfg.to_dict()) == cfg
    assert _draft(feature_layers=()).config.seed_state == "hidden"
    with pytest.raises(ValueError, match="block >= 1"):
        DFlashConfig(hidden_size=D, num_heads=4, num_kv_heads=2, head_dim=4,
                     intermediate_size=32, vocab_size=VOCAB, block=0)


def test_one_block_forward_gives_one_row_per_block_token():
    draft = _draft()
    kv = draft.context_kv(_rows(6), torch.arange(4, 10))
    assert [tuple(k.shape) for k, _ in kv] == [(2, 6, 4)] * 2
    h = draft.block_hidden([(kv, [7] + [MASK] * BLOCK, 10)])
    assert h.shape == (1 + BLOCK, D)
    assert draft.logits(h).shape == (1 + BLOCK, VOCAB)
    with pytest.raises(ValueError, match="wide"):
        draft.context_kv(torch.zeros(2, D, dtype=torch.float64), torch.arange(2))


def test_attention_is_non_causal_and_reads_the_context():
    draft = _draft()
    rows = _rows(6)
    base = _serve(draft, rows, 0, [7, 8] + [MASK] * BLOCK, 6)
    # a later block token changes an earlier row: every block row sees the whole block
    other = _serve(draft, rows, 0, [7, 9] + [MASK] * BLOCK, 6)
    assert not torch.allclose(base[0], other[0])
    # the context rows reach the block
    moved = _serve(draft, rows + 1.0, 0, [7, 8] + [MASK] * BLOCK, 6)
    assert not torch.allclose(base[-1], moved[-1])


@pytest.mark.parametrize("anchor", [False, True])
@pytest.mark.parametrize("norms", [False, True])
def test_training_forward_equals_serving_for_every_anchor(anchor, norms):
    draft = _draft(3, anchor=anchor, norms=norms)
    rows, rows_start = _rows(10, 7), 2  # rows at positions 2 .. 11
    blocks = torch.tensor([[5, MASK, MASK, MASK], [9, MASK, MASK, MASK], [3, MASK, MASK, MASK]])
    starts = torch.tensor([4, 8, 12])
    select = torch.zeros(3, 4, dtype=torch.bool)
    select[:, 1:] = True
    got = draft.training_logits(rows, rows_start, blocks, starts, select).view(3, 3, VOCAB)
    for i in range(3):
        want = draft.logits(_serve(draft, rows, rows_start, blocks[i].tolist(),
                                   int(starts[i])))[1:]
        torch.testing.assert_close(got[i], want)
    # real run-ahead tokens in the block (r = 1): the same agreement
    blocks2 = torch.tensor([[5, 6, MASK, MASK, MASK]])
    sel2 = torch.tensor([[False, False, True, True, True]])
    got2 = draft.training_logits(rows, rows_start, blocks2, torch.tensor([6]), sel2)
    want2 = draft.logits(_serve(draft, rows, rows_start, blocks2[0].tolist(), 6))[2:]
    torch.testing.assert_close(got2, want2)


def test_context_kv_appends_overwrites_restarts_and_truncates():
    draft = _draft()
    kv = ContextKV()
    assert kv.length == 0 and kv.nbytes == 0

    def rows_kv(start, n, seed):  # noqa: ANN001, ANN202
        return draft.context_kv(_rows(n, seed), torch.arange(start, start + n))

    kv.write(5, rows_kv(5, 3, 1))
    assert (kv.start, kv.end) == (5, 8)
    kv.write(8, rows_kv(8, 20, 2))  # contiguous: grows past the first capacity
    assert (kv.start, kv.end) == (5, 28)
    whole = draft.context_kv(torch.cat([_rows(3, 1), _rows(20, 2)]), torch.arange(5, 28))
    for (k, v), (wk, wv) in zip(kv.layers(), whole):
        torch.testing.assert_close(k, wk)
        torch.testing.assert_close(v, wv)
    kv.write(10, rows_kv(10, 2, 3))  # overlap: rows from 10 replaced, later ones dropped
    assert kv.end == 12
    assert kv.layers(11)[0][0].shape[1] == 6  # views of the rows before position 11
    kv.truncate(7)
    assert kv.end == 7
    kv.write(40, rows_kv(40, 2, 4))  # a gap: restart there
    assert (kv.start, kv.end) == (40, 42)
    assert kv.nbytes > 0


def _proposer(draft: DFlashDraft | None = None, **kw) -> DFlashProposer:
    return DFlashProposer(draft or _draft(), **kw)


def _open(p: DFlashProposer, rid: str, ctx: list[int], rows: torch.Tensor) -> None:
    """Open ``rid`` on ``ctx`` with rows ending at position len(ctx) - 2 (as a DraftSync)."""
    p.open(rid, ctx)
    p.observe_seed_state(rid, len(ctx) - 1 - rows.shape[0], rows)


def test_the_context_kv_is_written_from_target_rows_never_by_draft_forwards():
    p = _proposer()
    ctx = [1, 2, 3, 4, 5, 6, 7]
    rows = _rows(4)  # positions 2 .. 5
    _open(p, "r", ctx, rows)
    assert p.num_context_rows("r") == 4 and p.stats.num_context_rows == 4
    want = p.draft.context_kv(rows, torch.arange(2, 6))
    held = [(k.clone(), v.clone()) for k, v in p._ctx["r"].layers()]
    for (k, v), (wk, wv) in zip(held, want):
        torch.testing.assert_close(k, wk)
        torch.testing.assert_close(v, wv)
    first = p.propose("r", ctx, BLOCK)
    again = p.propose("r", ctx, BLOCK)
    assert len(first) == BLOCK and first == again
    assert p.stats.num_block_forwards == 2
    # the block forwards left the context KV as it was: no row added, none changed
    assert p.num_context_rows("r") == 4
    for (k, v), (hk, hv) in zip(p._ctx["r"].layers(), held):
        assert torch.equal(k, hk) and torch.equal(v, hv)
    # a commit of two tokens brings two rows (positions 6, 7): the KV grows by exactly those
    p.observe_seed_state("r", 6, _rows(2, 9))
    assert p.num_context_rows("r") == 6 and p.stats.num_context_rows == 6
    assert p.draft_kv_pool_bytes > 0 and p.draft_weights_bytes == sum(
        x.numel() * 8 for x in p.draft.parameters())


def test_drafts_are_the_mask_rows_of_one_block_forward():
    draft = _draft(2)
    p = _proposer(draft)
    ctx = [4, 5, 6, 7, 8, 9]
    rows = _rows(5)
    _open(p, "r", ctx, rows)
    want = draft.logits(_serve(draft, rows, 0, [9] + [MASK] * BLOCK, 5))[1:].argmax(-1)
    assert p.propose("r", ctx, BLOCK) == want.tolist()
    assert p.propose("r", ctx, 2) == want.tolist()[:2]  # fewer asked: the same block
    assert p.propose("r", ctx, 10) == want.tolist()  # more asked: the block
    assert p.stats.num_block_rows == 3 * (1 + BLOCK)
    # run-ahead: the path's tokens join the block after the bonus token
    ahead = ctx + [11, 12]
    want2 = draft.logits(_serve(draft, rows, 0, [9, 11, 12] + [MASK] * BLOCK, 5))[3:]
    assert p.propose("r", ahead, BLOCK) == want2.argmax(-1).tolist()


@pytest.mark.parametrize("anchor", [False, True])
def test_batched_proposes_equal_single_ones(anchor):
    draft = _draft(4, anchor=anchor)
    p = _proposer(draft)
    ctxs = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12, 13]]
    for i, c in enumerate(ctxs):
        _open(p, f"r{i}", c, _rows(len(c) - 1, i))
    many = p.propose_many([ProposeCall(f"r{i}", c, BLOCK) for i, c in enumerate(ctxs)])
    assert p.stats.num_block_forwards == 1
    for i, c in enumerate(ctxs):
        assert many[i][0] == p.propose(f"r{i}", c, BLOCK)


def test_no_drafts_without_context_rows_too_far_ahead_or_out_of_vocab():
    p = _proposer(max_run_ahead=2)
    ctx = [1, 2, 3, 4]
    p.open("r", ctx)
    assert p.propose("r", ctx, BLOCK) == []  # no rows yet
    assert p.propose("unknown", ctx, BLOCK) == []
    p.observe_seed_state("r", 0, _rows(3))
    assert len(p.propose("r", ctx + [5, 6], BLOCK)) == BLOCK  # 2 run-ahead tokens
    assert p.propose("r", ctx + [5, 6, 7], BLOCK) == []  # 3: too far
    assert p.propose("r", ctx[:-1] + [VOCAB], BLOCK) == []
    assert p.propose("r", ctx, 0) == []
    assert p.stats.num_no_context == 3
    p.rollback("r", 2)  # rows of positions >= 2 depend on dropped tokens
    assert p.num_context_rows("r") == 2
    held = p.draft_kv_pool_bytes
    p.close("r")
    # the KV reported is the most the requests held at once (drafter/draft_memory.py)
    assert p.num_context_rows("r") == 0 and p.draft_kv_pool_bytes == held > 0


def test_the_proposer_keeps_to_the_run_ahead_the_draft_was_trained_for():
    assert _proposer().max_run_ahead == BLOCK  # a checkpoint that does not say
    p = _proposer(_draft(max_run_ahead=0))
    ctx = [1, 2, 3, 4]
    p.open("r", ctx)
    p.observe_seed_state("r", 0, _rows(3))
    assert len(p.propose("r", ctx, BLOCK)) == BLOCK  # the bonus token alone: committed
    assert p.propose("r", ctx + [5], BLOCK) == []  # one drafted token ahead: never trained
    with pytest.raises(ValueError, match="max_run_ahead"):
        _draft(max_run_ahead=-1)


def _greedy_with_probs(draft: DFlashDraft):  # noqa: ANN202
    """(proposer, greedy drafts, their probabilities, the mask rows' logits) of one block
    after context [3, 4, 5, 6, 7] with four rows."""
    p = _proposer(draft)
    ctx = [3, 4, 5, 6, 7]
    rows = _rows(4)
    _open(p, "r", ctx, rows)
    how = DraftSampling(SamplingParams(max_tokens=8), 0, token_probs=True)
    drafts, probs = p.propose_sampled("r", ctx, BLOCK, how)
    return p, drafts, probs, draft.logits(_serve(draft, rows, 0, [7] + [MASK] * BLOCK, 4))[1:]


def test_greedy_drafts_come_with_their_probabilities():
    _, drafts, probs, logits = _greedy_with_probs(_draft(6))
    assert drafts == logits.argmax(-1).tolist()
    want = torch.softmax(logits.float(), -1).max(-1).values
    torch.testing.assert_close(torch.tensor(probs), want, rtol=1e-5, atol=1e-6)


def test_sampled_rows_are_each_positions_own_distribution():
    """Two different draws from the same block: different drafts, the same rows (a mask row
    never reads the drafts of its own block), each draft in its row's support."""
    draft = _draft(8)
    p = _proposer(draft)
    ctx = [3, 4, 5, 6, 7]
    _open(p, "r", ctx, _rows(4))
    sp = SamplingParams(max_tokens=8, temperature=1.5)
    outs = []
    for seed in range(6):
        how = DraftSampling(sp, 0, generator=torch.Generator().manual_seed(seed))
        outs.append(p.propose_sampled("r", ctx, BLOCK, how))
    assert len({tuple(d) for d, _ in outs}) > 1
    for drafts, rows in outs:
        assert len(rows) == BLOCK
        for j, (t, row) in enumerate(zip(drafts, rows)):
            torch.testing.assert_close(row, outs[0][1][j])
            assert row.shape == (VOCAB,) and float(row[t]) > 0
            assert abs(float(row.sum()) - 1) < 1e-5


# -- a draft vocabulary (FR-Spec / EAGLE-3: the LM head scores the frequent ids only) --------

SUBSET = [1, 4, 7, 9, 12, 20, 33, 39]


def test_a_draft_vocabulary_scores_its_rows_of_the_target_head_only():
    full, sub = _draft(9), _draft(9, draft_vocab=SUBSET)
    assert sub.lm_head.shape == (len(SUBSET), D)
    torch.testing.assert_close(sub.lm_head, full.lm_head[SUBSET])
    h = _serve(sub, _rows(4), 0, [7] + [MASK] * BLOCK, 4)
    torch.testing.assert_close(sub.logits(h), full.logits(h)[:, SUBSET])
    cols = sub.draft_columns(torch.tensor([4, 5, MASK, 39, -100]), missing=-100)
    assert cols.tolist() == [1, -100, MASK, 7, -100]
    assert sub.target_ids(torch.tensor([0, 7])).tolist() == [1, 39]


def test_greedy_and_sampled_drafts_stay_inside_the_draft_vocabulary():
    p, drafts, probs, logits = _greedy_with_probs(_draft(10, draft_vocab=SUBSET))
    ctx = [3, 4, 5, 6, 7]
    assert drafts == [SUBSET[c] for c in logits.argmax(-1).tolist()]
    torch.testing.assert_close(torch.tensor(probs),
                               torch.softmax(logits.float(), -1).max(-1).values,
                               rtol=1e-5, atol=1e-6)
    sp = SamplingParams(max_tokens=8, temperature=1.5)
    outside = [t for t in range(VOCAB) if t not in SUBSET]
    for seed in range(4):
        how = DraftSampling(sp, 0, generator=torch.Generator().manual_seed(seed))
        drafts, dist = p.propose_sampled("r", ctx, BLOCK, how)
        for t, row in zip(drafts, dist):
            assert t in SUBSET and row.shape == (VOCAB,) and float(row[t]) > 0
            assert float(row[outside].abs().sum()) == 0
            assert abs(float(row.sum()) - 1) < 1e-5


def test_a_draft_vocabulary_survives_save_and_load(tmp_path, monkeypatch):
    from specmesh.drafter import dflash_files

    draft = _draft(11, draft_vocab=SUBSET).float()
    g = torch.Generator().manual_seed(12)
    embed, head = torch.randn(VOCAB, D, generator=g), torch.randn(VOCAB, D, generator=g)
    draft.set_target_weights(embed, head)
    dflash_files.save_dflash(draft, tmp_path, dtype=torch.bfloat16)
    monkeypatch.setattr(dflash_files, "target_embeddings", lambda files: (embed, head))
    monkeypatch.setattr(dflash_files, "check_target", lambda *a: None)
    monkeypatch.setattr(dflash_files.ModelConfig, "from_hf", staticmethod(lambda c: None))
    monkeypatch.setattr(dflash_files, "target_identity", lambda *a: {})
    import transformers
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda f: None)
    back = dflash_files.load_dflash(tmp_path, "unused", "t")
    assert back.draft_to_target.dtype == torch.long
    assert back.draft_to_target.tolist() == SUBSET
    torch.testing.assert_close(back.lm_head, head[SUBSET])


def test_the_anchor_input_reads_the_row_before_the_block_and_its_first_token():
    """With ``anchor_input`` the block's rows carry anchor_fc([c_{a-1}; e(x_a)]): zeroing
    anchor_fc gives the plain draft's hidden states, and a different row a-1 or first token
    changes the drafts' logits; a block with no context row before it gets no drafts."""
    draft, plain = _draft(13, anchor=True), _draft(13)
    draft.load_state_dict(plain.state_dict(), strict=False)  # all but anchor_fc alike
    rows = _rows(6)
    h = _serve(draft, rows, 0, [7] + [MASK] * BLOCK, 4)
    with torch.no_grad():
        weight = draft.anchor_fc.weight.clone()
        draft.anchor_fc.weight.zero_()
        torch.testing.assert_close(_serve(draft, rows, 0, [7] + [MASK] * BLOCK, 4),
                                   _serve(plain, rows, 0, [7] + [MASK] * BLOCK, 4))
        draft.anchor_fc.weight.copy_(weight)
    moved = rows.clone()
    moved[3] += 1.0
    assert not torch.allclose(_serve(draft, moved, 0, [7] + [MASK] * BLOCK, 4), h)
    assert not torch.allclose(_serve(draft, rows, 0, [8] + [MASK] * BLOCK, 4), h)
    p = _proposer(draft)
    p.open("r", [3, 4])
    p.observe_seed_state("r", 1, rows[:1])  # the only row is at the block's own position
    assert p.propose("r", [3, 4], BLOCK) == [] and p.stats.num_no_context == 1


def test_feature_norms_norm_each_layers_part_of_a_row_before_the_fusion():
    draft = _draft(14, norms=True)
    rows = _rows(3)
    scaled = rows.clone()
    scaled[:, D:] *= 50.0  # one feature layer's part 50x larger: normed away
    torch.testing.assert_close(draft.fuse(scaled), draft.fuse(rows), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(_draft(14).fuse(scaled), _draft(14).fuse(rows))
