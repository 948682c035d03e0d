"""The ``medusa`` drafting method (drafter/proposers/medusa.py) without a cluster: which
head drafts which position from the newest target state, the tree and its cuts, batching of
the heads over requests, rollback, bad seed rows, its options, and the drafter worker sending
its tree as one DraftTailStream at the committed prefix."""

import pytest
import torch

from specmesh.drafter.config import DrafterConfig
from specmesh.drafter.medusa.heads import MedusaConfig, MedusaHeads
from specmesh.drafter.medusa.tree import build_tree
from specmesh.drafter.proposer import ProposeCall
from specmesh.drafter.proposers.medusa import MedusaProposer
from specmesh.drafter.registry import get_method, seed_state_of
from specmesh.drafter.worker import DrafterWorker
from specmesh.engine.frames import tensor_to_buffer
from specmesh.engine.token_tree import first_branch
from specmesh.protocol.messages import DraftSync, DraftTailStream, SamplingParams
from specmesh.protocol.transport import InProcHub

D, V, K = 8, 30, 3
TREE = ((0,), (0, 0), (1,), (0, 0, 0), (0, 1))


def _heads() -> MedusaHeads:
    torch.manual_seed(0)
    h = MedusaHeads(MedusaConfig(hidden_size=D, vocab_size=V, num_heads=K, tree=TREE))
    with torch.no_grad():
        h.weight.normal_(0, 0.5)
    h.set_target_weights(torch.randn(V, D))
    return h.eval().requires_grad_(False)


def _top(h, row):  # each head's candidates for one state
    return h.top_tokens(row[None], 2)[0].tolist()


def test_heads_draft_the_positions_after_the_context_from_the_newest_state():
    h = _heads()
    p = MedusaProposer(heads_module=h)
    rows = torch.randn(4, D)
    ctx = list(range(10))
    p.open("r", ctx)
    assert p.propose_tree("r", ctx, 3) == ([], [])  # no state yet
    p.observe_seed_state("r", 4, rows)  # rows at 4..7: the newest predicted ctx[8]
    top = _top(h, rows[-1])
    # the state at 7 is one position behind len(ctx) - 2 = 8: heads 1.. draft
    assert p.propose("r", ctx, 5) == [top[1][0], top[2][0]]
    p.observe_seed_state("r", 8, rows[:1])  # now at 8: heads 0.. draft ctx[10], [11], [12]
    top = _top(h, rows[0])
    assert p.propose("r", ctx, 5) == [row[0] for row in top]
    tokens, parents = p.propose_tree("r", ctx, 3)
    assert (tokens, parents) == build_tree(top, TREE, 3)
    assert first_branch(tokens, parents) == p.propose("r", ctx, 3)
    assert p.propose_tree("r", ctx, 1) == ([top[0][0], top[0][1]], [-1, -1])
    # run-ahead past the heads: nothing until a new state
    assert p.propose("r", ctx + [1, 2, 3], 2) == []
    assert p.propose("r", ctx + [1], 2) == [top[1][0], top[2][0]]


def test_heads_run_once_per_new_state_batched_over_requests():
    h = _heads()
    p = MedusaProposer(heads_module=h)
    rows = torch.randn(2, D)
    for i in range(2):
        p.open(f"r{i}", [1, 2, 3])
        p.observe_seed_state(f"r{i}", 1, rows[i:i + 1])
    out = p.propose_many([ProposeCall(f"r{i}", [1, 2, 3], 2) for i in range(2)])
    assert p.num_head_rows == 2
    assert [o[0] for o in out] == [[r[0] for r in _top(h, rows[i])[:2]] for i in range(2)]
    assert all(o[1] == [None, None] for o in out)
    p.propose_tree("r0", [1, 2, 3], 3)
    assert p.num_head_rows == 2  # nothing new to run


def test_rollback_drops_a_state_that_read_rejected_tokens():
    p = MedusaProposer(heads_module=_heads())
    p.open("r", list(range(10)))
    p.observe_seed_state("r", 8, torch.randn(1, D))
    p.rollback("r", 9)  # keeps positions 0..8: the state at 8 stays
    assert p.propose("r", list(range(10)), 1)
    p.rollback("r", 8)
    assert p.propose("r", list(range(10)), 1) == []
    p.close("r")
    assert "r" not in p.states


def test_bad_seed_rows_are_a_value_error():
    p = MedusaProposer(heads_module=_heads())
    p.open("r", [1, 2])
    with pytest.raises(ValueError, match="Medusa heads read"):
        p.observe_seed_state("r", 0, torch.randn(1, D + 1))


def test_options_cut_the_tree_or_draft_the_chain():
    h = _heads()
    row = torch.randn(1, D)
    ctx = [5, 6, 7]
    cut = MedusaProposer(heads_module=h, tree_nodes=2)
    chain = MedusaProposer(heads_module=h, chain=True)
    for p in (cut, chain):
        p.open("r", ctx)
        p.observe_seed_state("r", 1, row)
    top = _top(h, row[0])
    assert cut.propose_tree("r", ctx, 3) == ([top[0][0], top[1][0]], [-1, 0])
    assert chain.propose_tree("r", ctx, 3) == ([r[0] for r in top], [-1, 0, 1])
    with pytest.raises(ValueError):
        MedusaProposer(heads_module=h, tree_nodes=0)
    method = get_method("medusa")
    assert method.options.parse("/some/dir+nodes=4+chain=true") == {
        "heads": "/some/dir", "tree_nodes": 4, "chain": True}
    assert seed_state_of("medusa") == "hidden" and method.draft_shape == "tree"
    assert method.trainer is not None and method.runs_a_model


def test_worker_sends_the_tree_at_the_committed_prefix():
    h = _heads()
    hub = InProcHub()
    v = hub.mailbox("verifier-0")
    d = DrafterWorker(DrafterConfig(method="medusa", window=3, max_segment=3),
                      hub.mailbox("drafter-0"), MedusaProposer(heads_module=h))
    prompt, row = [4, 5, 6, 7], torch.randn(1, D)
    v.send("drafter-0", DraftSync(request_id="r", prompt_token_ids=prompt,
                                  committed_token_ids=[9], sampling=SamplingParams(),
                                  seed_state=tensor_to_buffer(row)))
    d.step()
    tails = [e.msg for e in v.drain() if isinstance(e.msg, DraftTailStream)]
    assert tails, "no draft sent"
    seg = tails[0]
    assert (list(seg.draft_token_ids), list(seg.parents)) == build_tree(_top(h, row[0]), TREE, 3)
    assert seg.start_pos == seg.base_committed_len == 1 and seg.draft_probs is None
