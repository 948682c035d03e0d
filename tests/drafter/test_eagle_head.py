"""EAGLE head: the unrolled training passes see exactly what drafting a chain sees."""

import pytest
import torch

from drafter.eagle.head import EagleHead, EagleHeadConfig, HeadKV


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
