"""Medusa heads (drafter/medusa/heads.py, train.py, checkpoint.py): the residual-block math
against a plain per-head loop, the draft vocabulary, training that learns a rule, the
held-out measures and the checkpoint round trip (a target mismatch refused)."""

import pytest
import torch
import torch.nn.functional as F

from specmesh.drafter.eagle.checkpoint import HeadMismatch
from specmesh.drafter.medusa.checkpoint import load_heads, read_config, save_heads
from specmesh.drafter.medusa.heads import MedusaConfig, MedusaHeads
from specmesh.drafter.medusa.train import (
    IGNORE,
    chain_acceptance,
    evaluate,
    label_ranks,
    rank_accuracy,
    train_heads,
)

D, V, K = 16, 40, 3
TARGET = {"name": "toy", "vocab_size": V, "hidden_size": D, "num_layers": 2,
          "fingerprint": [1.0, 0.5]}


def _heads(seed=0, draft_ids=None, **kw) -> MedusaHeads:
    torch.manual_seed(seed)
    cfg = MedusaConfig(hidden_size=D, vocab_size=V, num_heads=K, target=TARGET,
                       draft_vocab_size=0 if draft_ids is None else len(draft_ids), **kw)
    h = MedusaHeads(cfg)
    with torch.no_grad():
        h.weight.normal_(0, 0.3)
    h.set_target_weights(torch.randn(V, D), draft_ids)
    return h


def test_heads_are_residual_blocks_feeding_the_target_lm_head():
    h = _heads()
    x = torch.randn(5, D)
    with torch.no_grad():
        got = h(x)
        for i in range(K):
            r = x + F.silu(x @ h.weight[i].T + h.bias[i])
            torch.testing.assert_close(got[i], r @ h.lm_head.T)


def test_an_untrained_head_with_zero_bias_is_the_target_lm_head():
    cfg = MedusaConfig(hidden_size=D, vocab_size=V, num_heads=K)
    h = MedusaHeads(cfg)
    assert torch.count_nonzero(h.weight) == 0  # Medusa's zero initialisation
    lm = torch.randn(V, D)
    h.set_target_weights(lm)
    with torch.no_grad():
        h.bias.zero_()
        x = torch.randn(4, D)
        for i in range(K):
            torch.testing.assert_close(h(x)[i], x @ lm.T)


def test_top_tokens_are_target_ids_of_the_draft_vocabulary_best_first():
    ids = torch.tensor([3, 7, 11, 20, 39])
    h = _heads(draft_ids=ids)
    assert h.lm_head.shape == (5, D)
    x = torch.randn(2, D)
    top = h.top_tokens(x, 3)
    assert top.shape == (2, K, 3)
    with torch.no_grad():
        logits = h(x)  # [K, 2, 5]
    for n in range(2):
        for i in range(K):
            want = ids[logits[i, n].argsort(descending=True)[:3]]
            assert top[n, i].tolist() == want.tolist()
    assert h.top_tokens(x, 50).shape == (2, K, 5)  # k capped by the draft vocabulary


def test_bad_target_weights_are_refused():
    h = MedusaHeads(MedusaConfig(hidden_size=D, vocab_size=V, num_heads=K))
    with pytest.raises(ValueError, match="does not fit"):
        h.set_target_weights(torch.randn(V + 1, D))
    with pytest.raises(ValueError, match="draft vocabulary"):
        h.set_target_weights(torch.randn(V, D), torch.tensor([0, V]))
    with pytest.raises(ValueError, match="num_heads"):
        MedusaConfig(hidden_size=D, vocab_size=V, num_heads=0)


def test_training_learns_each_heads_rule_and_the_measures_agree():
    """Head i's label is what a teacher head of the same shape (random blocks over the same
    frozen LM head) picks: the trained heads get most of them right; untrained ones do not."""
    teacher = _heads(seed=1)
    torch.manual_seed(1)
    x = torch.randn(2048, D)
    with torch.no_grad():
        teacher.weight.mul_(3.0)
        y = teacher(x).argmax(-1).T.contiguous()  # [N, K]
    y[:7, 2] = IGNORE
    h = _heads(seed=2)
    h.set_target_weights(teacher.lm_head)
    before = rank_accuracy(label_ranks(h, x, y, 1), 1)
    summary = train_heads(h, x, y, epochs=30, batch_rows=256, lr=3e-2, progress=False)
    ranks = label_ranks(h, x, y, 5)
    acc = rank_accuracy(ranks, 5)
    assert summary["steps"] == 240 and summary["last_loss"] > 0
    for i in range(K):
        assert acc[i][0] > 0.8 > before[i][0] + 0.5
    assert (ranks[:7, 2] == -1).all()  # no label: never a hit
    chain = chain_acceptance(ranks)
    assert chain[0] == pytest.approx(acc[0][0], abs=1e-3)
    assert chain[0] >= chain[1] >= chain[2]
    ev = evaluate(h, x, y, ((0,), (0, 0), (1,)), 5)
    assert ev["rows"] == 2048
    assert ev["tree_acceptance_per_depth"][0] == pytest.approx(acc[0][0] + acc[0][1], abs=1e-3)
    assert ev["tree_acceptance_per_depth"][1] == pytest.approx(chain[1], abs=1e-3)
    assert ev["tree_mean_accepted"] > ev["chain_mean_accepted"] - chain[2]


def test_checkpoint_round_trip_and_another_target_refused(tmp_path):
    ids = torch.tensor([0, 5, 9, 30])
    h = _heads(draft_ids=ids, tree=((0,), (0, 0), (1,)))
    lm = torch.randn(V, D)
    h.set_target_weights(lm, ids)
    save_heads(h, tmp_path, {"note": "test"}, dtype=torch.bfloat16)
    cfg = read_config(tmp_path)
    assert cfg.tree == ((0,), (0, 0), (1,)) and cfg.num_heads == K
    back = load_heads(tmp_path, lm, TARGET)
    assert back.draft_to_target.tolist() == ids.tolist()
    torch.testing.assert_close(back.weight, h.weight.detach().to(torch.bfloat16).float())
    torch.testing.assert_close(back.lm_head, lm[ids])
    with pytest.raises(HeadMismatch):
        load_heads(tmp_path, lm, {**TARGET, "hidden_size": D + 1})
    with pytest.raises(FileNotFoundError):
        read_config(tmp_path / "nowhere")
