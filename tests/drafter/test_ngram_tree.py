"""N-gram draft trees (drafter/proposers/ngram.py) and how the drafter worker streams them."""

import pytest

import specmesh.drafter.proposers  # noqa: F401
from specmesh.drafter.config import DrafterConfig
from specmesh.drafter.registry import register_proposer
from specmesh.drafter.proposers.ngram import NgramProposer
from specmesh.drafter.worker import DrafterWorker
from specmesh.protocol.messages import DraftSync, DraftTailStream, SamplingParams, VerifyCommit
from specmesh.protocol.transport import InProcHub

# suffix [1, 2]: matched at 8 (-> 7 8), at 4 (-> 9 1) and at 0 (-> 3 4); [2] alone adds 5
CTX = [1, 2, 3, 4, 1, 2, 9, 1, 1, 2, 7, 8, 2, 5, 1, 2]


def test_tree_branches_are_distinct_continuations_most_recent_first():
    p = NgramProposer(min_ngram=1, max_ngram=2, tree_width=3)
    tokens, parents = p.propose_tree("r", CTX, 2)
    assert tokens == [7, 8, 9, 1, 3, 4] and parents == [-1, 0, -1, 2, -1, 4]
    assert tokens[:2] == p.propose("r", CTX, 2)  # branch 0 is the chain
    # longer suffixes first, then shorter ones; shared prefixes share nodes
    wide = NgramProposer(min_ngram=1, max_ngram=2, tree_width=5)
    tokens, parents = wide.propose_tree("r", CTX, 1)
    assert tokens == [7, 9, 3, 5] and parents == [-1, -1, -1, -1]
    tokens, parents = wide.propose_tree("r", [1, 2, 3, 1, 2, 3, 1, 2], 3)
    assert tokens == [3, 1, 2] and parents == [-1, 0, 1]  # the same continuation twice: a chain


def test_tree_width_one_is_a_chain_and_bad_widths_are_refused():
    p = NgramProposer(min_ngram=1, max_ngram=2, tree_width=1)
    assert p.propose_tree("r", CTX, 2) == ([7, 8], [-1, 0])
    assert p.propose_tree("r", CTX, 0) == ([], [])
    with pytest.raises(ValueError, match="tree_width"):
        NgramProposer(tree_width=0)


def test_unknown_draft_shape_is_refused_at_registration():
    class Bushy(NgramProposer):
        name = "bushy-test"
        draft_shape = "forest"

    with pytest.raises(TypeError, match="draft_shape"):
        register_proposer(Bushy)


def _tails(v):
    return [e.msg for e in v.drain() if isinstance(e.msg, DraftTailStream)]


def test_worker_sends_a_tree_at_the_committed_prefix_then_chains():
    hub = InProcHub()
    v = hub.mailbox("verifier-0")
    d = DrafterWorker(DrafterConfig(window=4, max_segment=4, method_kwargs={
        "min_ngram": 1, "max_ngram": 2, "tree_width": 3}), hub.mailbox("drafter-0"))
    v.send("drafter-0", DraftSync(request_id="r", prompt_token_ids=CTX[:-1],
                                  committed_token_ids=[2], sampling=SamplingParams()))
    d.step()
    (seg,) = _tails(v)
    assert seg.start_pos == seg.base_committed_len == 1
    assert seg.parents is not None and seg.parents[0] == -1
    branch0 = d.requests["r"].path
    assert seg.draft_token_ids[:len(branch0)] == branch0 and len(seg.draft_token_ids) > 4
    # a commit along branch 0 keeps the path: the run-ahead continues it as a chain
    v.send("drafter-0", VerifyCommit(request_id="r", pre_commit_len=1,
                                     committed_token_ids=branch0[:1]))
    d.step()
    segs = _tails(v)
    assert segs and all(s.parents is None and s.start_pos > s.base_committed_len for s in segs)
    # a commit off branch 0 truncates the path: the next segment at the prefix is a tree again
    v.send("drafter-0", VerifyCommit(request_id="r", pre_commit_len=2,
                                     committed_token_ids=[1, 2]))
    d.step()
    (seg,) = _tails(v)
    assert seg.start_pos == seg.base_committed_len == 4 and seg.parents is not None
