"""DSpark's Markov and confidence heads (drafter/dspark_markov.py): each shape's walk biases
position j by the token drafted at position j - 1 (the last context token at j = 0), the walk
equals a position-by-position reference, a zero head leaves the base logits alone, the
confidences are one per draft in [0, 1], and a rank below 1 or an unknown shape is refused
(also as ``--drafter dspark:markov_rank=0``)."""

from __future__ import annotations

import pytest
import torch

from specmesh.cluster.drafter_option import parse_drafter
from specmesh.drafter.dspark_markov import MARKOV_KINDS, MarkovHead, check_markov, markov_walk

V = 16  # vocabulary = hidden size, so an identity embedding is one-hot


def _shift_head(kind: str) -> MarkovHead:
    """A head whose bias is ~+10 on token (prev + 1) % V: P = I, W = 10 x the shift."""
    head = MarkovHead(kind, V, V, V).double()
    with torch.no_grad():
        head.token_proj.weight.copy_(torch.eye(V))
        head.to_vocab.weight.copy_(10 * torch.roll(torch.eye(V), 1, dims=0))
        if kind == "gated":  # gate open
            head.gate.weight.zero_()
            head.gate.bias.fill_(20.0)
        if kind == "rnn":  # update gate open, candidate = 20 e, output gate open
            head.cell.weight.zero_()
            head.cell.weight[V:2 * V, V:2 * V] = 20 * torch.eye(V)
            head.cell.bias.zero_()
            head.cell.bias[:V] = 20.0
            head.cell.bias[2 * V:] = 20.0
    return head


@pytest.mark.parametrize("kind", MARKOV_KINDS)
def test_each_shape_biases_a_position_by_the_token_drafted_before_it(kind):
    head = _shift_head(kind)
    B, n = 3, 5
    base = torch.zeros(B, n, V, dtype=torch.float64)
    base[:, :, 0] = 0.5  # a mild preference the bias must beat
    hidden = torch.randn(B, n, V, dtype=torch.float64)
    first = torch.tensor([3, 7, 15])
    walk = markov_walk(head, base, hidden, torch.eye(V, dtype=torch.float64), first)
    for b in range(B):  # a chain: each draft is its predecessor + 1
        want = [(int(first[b]) + 1 + j) % V for j in range(n)]
        assert walk.tokens[b].tolist() == want
    assert walk.logits.shape == (B, n, V)
    assert walk.confidences.shape == (B, n)
    assert bool(((walk.confidences >= 0) & (walk.confidences <= 1)).all())


def test_the_bias_follows_the_picked_token_not_the_argmax():
    """A sampler that picks another token than the argmax moves the next position's bias."""
    head = _shift_head("vanilla")
    base = torch.zeros(1, 3, V, dtype=torch.float64)
    picked = iter([9, 2, 5])

    def pick(j, logits):
        return torch.tensor([next(picked)])

    walk = markov_walk(head, base, torch.zeros(1, 3, V, dtype=torch.float64),
                       torch.eye(V, dtype=torch.float64), torch.tensor([0]), pick)
    assert walk.tokens[0].tolist() == [9, 2, 5]
    # position 1 was biased towards 9 + 1, position 2 towards 2 + 1
    assert int(walk.logits[0, 1].argmax()) == 10 and int(walk.logits[0, 2].argmax()) == 3


def test_a_closed_gate_and_an_untrained_head_leave_the_base_logits():
    head = _shift_head("gated")
    with torch.no_grad():
        head.gate.bias.fill_(-50.0)
    base = torch.randn(2, 4, V, dtype=torch.float64)
    hidden = torch.randn(2, 4, V, dtype=torch.float64)
    emb = torch.eye(V, dtype=torch.float64)
    walk = markov_walk(head, base, hidden, emb, torch.tensor([1, 2]))
    assert torch.allclose(walk.logits, base, atol=1e-9)
    fresh = MarkovHead("rnn", V, 4, V).double()  # W starts at zero
    assert torch.equal(markov_walk(fresh, base, hidden, emb, torch.tensor([1, 2])).logits,
                       base)


@pytest.mark.parametrize("kind", MARKOV_KINDS)
def test_the_walk_equals_a_position_by_position_reference(kind):
    torch.manual_seed(0)
    head = MarkovHead(kind, 8, 4, V).double()
    with torch.no_grad():
        head.to_vocab.weight.normal_(0, 2.0)
    emb = torch.randn(V, 8, dtype=torch.float64)
    base = torch.randn(2, 4, V, dtype=torch.float64)
    hidden = torch.randn(2, 4, 8, dtype=torch.float64)
    first = torch.tensor([4, 11])
    walk = markov_walk(head, base, hidden, emb, first)
    for b in range(2):
        prev, state = int(first[b]), None
        for j in range(4):
            z, state = head.step(hidden[b:b + 1, j], emb[prev][None], state)
            logits = base[b, j] + head.to_vocab(z)[0]
            assert torch.allclose(walk.logits[b, j], logits)
            conf = torch.sigmoid(head.confidence(torch.cat([hidden[b, j], z[0]]))).detach()
            assert float(walk.confidences[b, j].detach()) == pytest.approx(float(conf))
            prev = int(logits.argmax())
            assert int(walk.tokens[b, j]) == prev


def test_the_rnn_state_carries_along_the_block():
    torch.manual_seed(1)
    head = MarkovHead("rnn", 8, 4, V).double()
    h, e = torch.randn(1, 8, dtype=torch.float64), torch.randn(1, 8, dtype=torch.float64)
    z0, s0 = head.step(h, e)
    z1, _ = head.step(h, e, s0)
    assert s0.shape == (1, 4) and not torch.allclose(z0, z1)


@pytest.mark.parametrize("rank", [0, -3])
def test_a_rank_below_one_is_refused(rank):
    with pytest.raises(ValueError, match="markov_rank must be a positive"):
        MarkovHead("gated", 8, rank, V)
    with pytest.raises(ValueError, match="markov_rank"):
        check_markov("vanilla", rank)


def test_an_unknown_shape_is_refused():
    with pytest.raises(ValueError, match="markov must be one of vanilla, gated, rnn"):
        MarkovHead("lstm", 8, 4, V)


def test_drafter_option_refuses_rank_zero_and_unknown_shapes():
    with pytest.raises(SystemExit, match="markov_rank must be integer >= 1"):
        parse_drafter("dspark:markov_rank=0")
    with pytest.raises(SystemExit, match="markov must be one of vanilla, gated, rnn"):
        parse_drafter("dspark:markov=lstm")
    method, kwargs = parse_drafter("dspark:/ckpt+markov=gated+markov_rank=64+confidence=false")
    assert method == "dspark"
    assert kwargs == {"model": "/ckpt", "markov": "gated", "markov_rank": 64,
                      "confidence": False}
