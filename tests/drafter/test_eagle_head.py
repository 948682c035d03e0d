"""EAGLE head: the unrolled training passes see exactly what drafting a chain sees."""

import pytest
import torch

from specmesh.drafter.eagle.head import EagleHead, EagleHeadConfig, HeadKV


def _head(seed=0, draft_vocab=0):
    torch.manual_seed(seed)
    cfg = EagleHeadConfig(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                          intermediate_size=48, vocab_size=50, draft_vocab_size=draft_vocab)
    head = EagleHead(cfg).double()
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.2)
    emb = torch.randn(50, 32, dtype=torch.float64)
    ids = None if not draft_vocab else torch.randperm(50)[:draft_vocab]
    head.set_target_weights(emb, emb.clone(), ids)
    return head


def _chain(head, feats, toks, start, i0, depth):
    """Draft features of a chain from true entries [0, i0], fed the true next tokens."""
    kv = HeadKV()
    g = head.extend(kv, feats[: i0 + 1], toks[: i0 + 1], start)
    out = [g[-1]]
    for k in range(1, depth):
        g = head.extend(kv, out[-1][None], toks[i0 + k : i0 + k + 1], start + i0 + k)
        out.append(g[-1])
    return out


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_unrolled_passes_equal_drafting_chains(depth):
    head = _head()
    S, start = 9, 5
    feats = torch.randn(1, S, 32, dtype=torch.float64)
    toks = torch.randint(0, 50, (1, S))
    pos = torch.arange(start, start + S)[None]
    with torch.no_grad():
        passes = head.forward_passes(feats, toks, pos, depth=depth)
    for i0 in range(S - depth + 1):
        chain = _chain(head, feats[0], toks[0], start, i0, depth)
        for k in range(depth):
            torch.testing.assert_close(passes[k][0, i0 + k], chain[k])


def test_batch_rows_are_independent():
    head = _head(1)
    feats = torch.randn(3, 7, 32, dtype=torch.float64)
    toks = torch.randint(0, 50, (3, 7))
    pos = torch.arange(7)[None].expand(3, 7) + torch.tensor([[0], [4], [9]])
    with torch.no_grad():
        both = head.forward_passes(feats, toks, pos, depth=2)
        one = head.forward_passes(feats[1:2], toks[1:2], pos[1:2], depth=2)
    torch.testing.assert_close(both[1][1], one[1][0])


def test_extend_in_pieces_equals_extend_at_once_and_truncate_rolls_back():
    head = _head(2)
    feats = torch.randn(6, 32, dtype=torch.float64)
    toks = torch.randint(0, 50, (6,))
    kv = HeadKV()
    whole = head.extend(kv, feats, toks, 3)
    kv2 = HeadKV()
    a = head.extend(kv2, feats[:2], toks[:2], 3)
    b = head.extend(kv2, feats[2:], toks[2:], 5)
    torch.testing.assert_close(torch.cat([a, b]), whole)
    kv2.truncate(5)
    assert kv2.end == 5
    torch.testing.assert_close(head.extend(kv2, feats[2:], toks[2:], 5), b)
    with pytest.raises(ValueError, match="ends at"):
        head.extend(kv2, feats[:1], toks[:1], 4)


def test_draft_vocabulary_maps_back_to_target_ids():
    head = _head(3, draft_vocab=10)
    g = torch.randn(4, 32, dtype=torch.float64)
    logits = head.logits(g)
    assert logits.shape == (4, 10)
    full = g @ head.embed.T
    ids = head.target_ids(logits.argmax(-1))
    torch.testing.assert_close(full.gather(1, ids[:, None])[:, 0], logits.max(-1).values)


def test_target_weights_of_the_wrong_shape_are_refused():
    head = _head()
    with pytest.raises(ValueError, match="do not fit"):
        head.set_target_weights(torch.zeros(49, 32), torch.zeros(49, 32))


def test_extend_many_equals_extend_per_request():
    """Several requests' entries in one call (mixed lengths, empty and long KVs) give each
    request what extending it alone gives, and leave each KV as extending alone does."""
    head = _head(4)
    torch.manual_seed(4)
    sizes, starts = [1, 5, 1, 3], [0, 7, 2, 11]
    pre = [0, 2, 90, 0]  # entries already held (90: past the buffer's first capacity)
    one, many, items = [], [], []
    for n, s, p in zip(sizes, starts, pre):
        kv_a, kv_b = HeadKV(), HeadKV()
        if p:
            f, t = torch.randn(p, 32, dtype=torch.float64), torch.randint(0, 50, (p,))
            head.extend(kv_a, f, t, s - p)
            head.extend(kv_b, f, t, s - p)
        f, t = torch.randn(n, 32, dtype=torch.float64), torch.randint(0, 50, (n,))
        one.append((head.extend(kv_a, f, t, s), kv_a))
        items.append((kv_b, f, t, s))
        many.append(kv_b)
    got = head.extend_many(items)
    for (want, kv_a), g, kv_b in zip(one, got, many):
        torch.testing.assert_close(g, want, rtol=0, atol=1e-12)
        assert (kv_b.start, kv_b.end) == (kv_a.start, kv_a.end)
        for ka, kb in zip(kv_a.keys + kv_a.values, kv_b.keys + kv_b.values):
            torch.testing.assert_close(kb, ka, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="listed twice"):
        head.extend_many([items[0], items[0]])


def test_head_kv_grows_and_truncates_without_losing_entries():
    head = _head(5)
    feats = torch.randn(150, 32, dtype=torch.float64)
    toks = torch.randint(0, 50, (150,))
    whole = head.extend(HeadKV(), feats, toks, 0)
    kv = HeadKV()
    parts = [head.extend(kv, feats[i:i + 1], toks[i:i + 1], i) for i in range(150)]
    torch.testing.assert_close(torch.cat(parts), whole)
    kv.truncate(40)
    assert kv.length == 40 and kv.keys[0].shape[1] == 40
    torch.testing.assert_close(head.extend(kv, feats[40:], toks[40:], 40), whole[40:])
