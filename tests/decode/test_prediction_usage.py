"""The verifier's side of Predicted Outputs: the tail buffer keeps a prediction flag per draft,
the plan hands the verified drafts' flags to the commit, and PredictionUsage counts accepted +
rejected = the prediction drafts verified, cut at the end of the output. Pure Python."""

from __future__ import annotations

import pytest

from specmesh.decode.config import VerifierConfig
from specmesh.decode.prediction_usage import PredictionUsage
from specmesh.decode.request import Request, RequestStatus
from specmesh.decode.scheduler import Scheduler
from specmesh.decode.tail_buffer import TailBuffer
from specmesh.engine.block_manager import BlockManager
from specmesh.protocol.messages import SamplingParams

# -- tail buffer ------------------------------------------------------------------------------


def test_flags_follow_tokens_through_add_replace_and_commit():
    committed = [10, 11]
    tb = TailBuffer(2)
    tb.add(2, [1, 2, 3], committed, base_committed_len=2, from_prediction=True)
    tb.add(5, [4, 5], committed, base_committed_len=2)  # the method continues the path
    assert tb.usable(8) == [1, 2, 3, 4, 5]
    assert tb.usable_predicted(8) == [True, True, True, False, False]
    assert tb.usable_predicted(2) == [True, True]
    # an overlapping segment that changes position 4 replaces the tail (and flags) from there
    tb.add(3, [2, 9], committed, base_committed_len=2)
    assert tb.usable(8) == [1, 2, 9] and tb.usable_predicted(8) == [True, True, False]
    committed += [1]
    tb.on_commit(committed)  # agrees: the committed token's flag goes with it
    assert tb.usable_predicted(8) == [True, False]
    committed += [7]
    tb.on_commit(committed)  # disagrees: all gone
    assert tb.usable(8) == [] and tb.usable_predicted(8) == []
    tb.add(4, [6], committed, base_committed_len=4, from_prediction=True)
    tb.reset(4)
    assert tb.usable_predicted(8) == []


def test_a_prediction_draft_never_takes_a_row_and_refuses_one():
    committed = [10]
    tb = TailBuffer(1)
    tb.add(1, [1, 2], committed, base_committed_len=1, from_prediction=True)
    # the same tokens again, drafted by a sampling method with rows: duplicates keep theirs
    tb.add(1, [1, 2, 3], committed, base_committed_len=1, draft_probs=["r1", "r2", "r3"])
    assert tb.usable_probs(3) == [None, None, "r3"]
    assert tb.usable_predicted(3) == [True, True, False]
    with pytest.raises(ValueError, match="prediction drafts with draft_probs"):
        tb.add(4, [4], committed, base_committed_len=1, draft_probs=["r4"],
               from_prediction=True)


def test_a_branch_taken_is_not_from_the_prediction():
    committed = [10]
    tb = TailBuffer(1)
    tb.add(1, [1, 2, 3], committed, base_committed_len=1, from_prediction=True)
    tb.add_branches(2, [8], [[9, 9]], committed, base_committed_len=1)
    committed += [1, 8]  # the verifier committed the branch's candidate at position 2
    tb.on_commit(committed)
    assert tb.usable(8) == [9, 9] and tb.usable_predicted(8) == [False, False]


# -- plan ------------------------------------------------------------------------------------


def _running(drafts_from: list[tuple[list[int], bool]]) -> tuple[Scheduler, Request]:
    sched = Scheduler(VerifierConfig(adaptive_drafts=False), BlockManager(64, 4))
    req = Request(request_id="r", gateway="gw", prompt_token_ids=[0, 1, 2],
                  sampling=SamplingParams(max_tokens=20), num_speculative_tokens=6,
                  prediction_token_ids=[1])
    sched.enqueue(req)
    assert sched.admit([req], ["p0"], lambda p: 0) == [req]
    req.status = RequestStatus.RUNNING
    req.output_token_ids = [7]
    req.drafter = "d0"
    req.tail.reset(1)
    pos = 1
    for toks, flag in drafts_from:
        req.tail.add(pos, toks, req.output_token_ids, base_committed_len=1,
                     from_prediction=flag)
        pos += len(toks)
    return sched, req


def test_plan_carries_the_flags_of_the_drafts_it_verifies():
    sched, req = _running([([4, 5], True), ([6, 7, 8], False)])
    (p,) = sched.plan([req])
    assert p.draft_token_ids == [4, 5, 6, 7, 8]
    assert p.from_prediction == [True, True, False, False, False]
    sched, req = _running([([4, 5], False)])
    (p,) = sched.plan([req])
    assert p.from_prediction is None  # no prediction draft: nothing to count


def test_plan_of_a_tree_flags_its_chain_nodes_only():
    sched, req = _running([])
    committed = req.output_token_ids
    req.tail.add_tree(1, [4, 5, 9], [-1, 0, -1], committed, base_committed_len=1)
    req.tail.add(3, [6, 7], committed, base_committed_len=1, from_prediction=True)
    (p,) = sched.plan([req])
    assert p.parents is not None and p.draft_token_ids[:4] == [4, 5, 6, 7]
    assert p.from_prediction == [False, False, True, True]


# -- counting ----------------------------------------------------------------------------------


def test_accepted_plus_rejected_is_the_prediction_drafts_verified():
    u = PredictionUsage()
    u.observe(1, 3, [True, True, True, True], 2, ended=False)  # 2 accepted, 2 rejected
    u.observe(4, 2, [False, True, True], 1, ended=False)  # the method's draft accepted
    u.observe(6, 1, [False, False], 0, ended=False)  # nothing from the prediction
    assert (u.num_accepted, u.num_rejected) == (2, 2 + 2)
    assert len(u.steps) == 2


def test_the_end_of_the_output_cuts_the_count():
    u = PredictionUsage()
    # EOS committed as the 2nd token of the step: drafts past it are not counted
    u.observe(1, 2, [True, True, True, True], 3, ended=True)
    assert (u.num_accepted, u.num_rejected) == (2, 0)
    # a stop string found later by the gateway, inside the second step
    u = PredictionUsage()
    u.observe(1, 4, [True, True, True, True], 3, ended=False)  # positions 1..4
    u.observe(5, 1, [True, True], 0, ended=False)  # positions 5.. (2 rejected)
    assert (u.num_accepted, u.num_rejected) == (3, 3)
    u.cut(7)  # after position 6: nothing committed past it, nothing changes
    assert (u.num_accepted, u.num_rejected) == (3, 3)
    u.cut(3)  # the output is positions 0..2: drafts at 1 and 2 only, both accepted
    assert (u.num_accepted, u.num_rejected) == (2, 0)
    assert len(u.steps) == 1


def test_request_cut_output_cuts_the_prediction_count_too():
    req = Request(request_id="r", gateway="gw", prompt_token_ids=[0], num_speculative_tokens=4,
                  sampling=SamplingParams(max_tokens=20), prediction_token_ids=[1, 2])
    req.output_token_ids = [9, 1, 2, 3, 4, 5]
    req.prediction.observe(1, 5, [True] * 4, 4, ended=False)
    req.cut_output(3)
    assert (req.prediction.num_accepted, req.prediction.num_rejected) == (2, 0)
