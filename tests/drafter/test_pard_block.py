"""PARD's mask block (drafter/pard_block.py): the serving forward's input (tail + masks), and
the COD training layout, whose mask rows compute exactly what a serving block forward
computes (same logits in float64 on a tiny transformers Llama)."""

from __future__ import annotations

import pytest
import torch

from specmesh.drafter.pard_block import (
    IGNORE,
    block_input,
    cod_layout,
    collate_layouts,
    common_prefix,
    keep_schedule,
)
from helpers.models import tiny_llama

MASK = 127


def test_block_input_feeds_the_uncached_tail_then_k_minus_1_masks():
    ctx = [5, 6, 7, 8]
    b = block_input(ctx, 2, 3, MASK)
    assert (b.token_ids, b.start_pos, b.num_drafts, b.num_context) == (
        [7, 8, MASK, MASK], 2, 3, 2)
    b = block_input(ctx, 0, 1, MASK)  # nothing cached, one draft: no mask
    assert (b.token_ids, b.start_pos) == (ctx, 0)
    # a fully cached context still recomputes its last token: its logits give draft 1
    b = block_input(ctx, 4, 4, MASK)
    assert (b.token_ids, b.start_pos, b.num_context) == ([8, MASK, MASK, MASK], 3, 1)


@pytest.mark.parametrize("args", [([], 0, 2), ([1, 2], 0, 0), ([1, 2], 3, 2), ([1], -1, 1)])
def test_block_input_refuses_bad_arguments(args):
    ctx, cached, n = args
    with pytest.raises(ValueError):
        block_input(ctx, cached, n, MASK)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2


def test_keep_schedule_is_non_increasing_with_a_floor():
    assert keep_schedule(1) == []
    ks = keep_schedule(6, 0.7, 0.2)
    assert ks[0] == 1.0 and ks == sorted(ks, reverse=True) and min(ks) == pytest.approx(0.2401)
    assert keep_schedule(8, 0.5, 0.2)[-1] == 0.2
    with pytest.raises(ValueError):
        keep_schedule(0)


def test_cod_layout_rows_positions_labels_and_attention():
    x = [10, 11, 12, 13, 14, 15]
    lay = cod_layout(x, x, first_anchor=1, block=3, mask_token_id=MASK, keep=[1.0, 1.0])
    n = len(x)
    # real rows: next-token labels from the first anchor on
    assert lay.labels[:n].tolist() == [IGNORE, 12, 13, 14, 15, IGNORE]
    # mask rows: anchors 1..3 (a + 1 + i <= n - 1), copies 1 and 2 (anchor 3: copy 1 only)
    rows = [(int(p), int(lab)) for p, lab in zip(lay.position_ids[n:], lay.labels[n:])]
    assert rows == [(2, 13), (3, 14), (3, 14), (4, 15), (4, 15)]
    assert (lay.input_ids[n:] == MASK).all()
    a = lay.allowed
    # copy 2 of anchor 1 (row n+1): real tokens 0..1, its copies 1 and 2
    assert a[n + 1].nonzero().flatten().tolist() == [0, 1, n, n + 1]
    # copy 1 of anchor 3 (row n+4): real 0..3 and itself
    assert a[n + 4].nonzero().flatten().tolist() == [0, 1, 2, 3, n + 4]
    assert torch.equal(a[:n, :n], torch.tril(torch.ones(n, n, dtype=torch.bool)))
    assert not a[:n, n:].any()  # real rows never see masks


def test_cod_drops_nested_copies():
    x = list(range(40))
    keep = keep_schedule(5, 0.5, 0.2)
    lay = cod_layout(x, x, 0, 5, MASK, keep, torch.Generator().manual_seed(0))
    n = len(x)
    by_anchor: dict[int, list[int]] = {}
    for r, p in enumerate(lay.position_ids[n:].tolist()):
        anchor = int(lay.allowed[n + r, :n].sum()) - 1  # it sees real rows 0..anchor
        by_anchor.setdefault(anchor, []).append(p - anchor)  # copy i sits at anchor + i
    kept = [sorted(v) for v in by_anchor.values()]
    assert all(v == list(range(1, len(v) + 1)) for v in kept)  # always copies 1..m
    full = sum(min(4, n - 2 - a) for a in range(n - 2))
    assert sum(map(len, kept)) < full  # something was dropped


def test_collate_pads_rows_without_loss():
    a = cod_layout([1, 2, 3, 4], [1, 2, 3, 4], 0, 2, MASK, [1.0])
    b = cod_layout([1, 2, 3], [1, 2, 3], 0, 2, MASK, [1.0])
    ids, pos, labels, mask = collate_layouts([a, b])
    L = a.input_ids.numel()
    assert ids.shape == (2, L) and mask.shape == (2, 1, L, L)
    nb = b.input_ids.numel()
    assert (labels[1, nb:] == IGNORE).all()
    assert mask[1, 0, nb:, :].sum(-1).eq(1).all()  # padding attends to itself only


def test_cod_mask_rows_equal_serving_block_forwards():
    """Every mask row of the training layout computes the logits that the serving forward
    [x_0 .. x_a, MASK x (K-1)] (plain causal attention, consecutive positions) gives at the
    same block position: training and serving agree."""
    hf, _, _ = tiny_llama(seed=1, dtype=torch.float64, vocab_size=128)
    x = torch.randint(0, 120, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    K = 4
    lay = cod_layout(x, x, 2, K, MASK, [1.0] * (K - 1))
    ids, pos, labels, mask = collate_layouts([lay])
    with torch.no_grad():
        out = hf(input_ids=ids, position_ids=pos, attention_mask=mask).logits[0]
        n = len(x)
        r = n
        for a in range(2, n - 2):
            copies = min(K - 1, n - 2 - a)
            serve = hf(input_ids=torch.tensor([x[:a + 1] + [MASK] * (K - 1)])).logits[0]
            torch.testing.assert_close(out[a], serve[a])  # draft 1: the real row
            for i in range(1, copies + 1):
                torch.testing.assert_close(out[r], serve[a + i])
                assert labels[0, r] == x[a + 1 + i]
                r += 1
        assert r == ids.shape[1]
