"""The drafter worker drafts from a request's prediction first (drafter/worker.py,
drafter/prediction.py): prediction segments flagged ``from_prediction`` and never carrying
draft_probs, the method once the prediction has nothing, re-alignment after a commit that
leaves the prediction."""

from __future__ import annotations

import torch

import specmesh.drafter.proposers  # noqa: F401
from specmesh.drafter.config import DrafterConfig
from specmesh.drafter.proposer import Proposer
from specmesh.drafter.drafting import _runs
from specmesh.drafter.worker import DrafterWorker
from specmesh.protocol.messages import DraftSync, DraftTailStream, SamplingParams, VerifyCommit
from specmesh.protocol.transport import InProcHub

VOCAB = 32


class RowsProposer(Proposer):
    """Drafts token 5 again and again with a (uniform) row for sampled requests: a model
    drafter's shape without a model."""

    name = "rows-test"
    returns_draft_probs = True

    def open(self, request_id, context_token_ids):
        pass

    def propose(self, request_id, context_token_ids, num_tokens):
        return [5] * num_tokens

    def propose_sampled(self, request_id, context_token_ids, num_tokens, how):
        return [5] * num_tokens, [torch.full((VOCAB,), 1.0 / VOCAB)] * num_tokens

    def rollback(self, request_id, num_context_tokens):
        pass

    def close(self, request_id):
        pass


def _setup(window=4, proposer=None):
    hub = InProcHub()
    v = hub.mailbox("verifier-0")
    d = DrafterWorker(DrafterConfig(window=window, max_segment=window, num_branches=0),
                      hub.mailbox("drafter-0"), proposer)
    return v, d


def _segments(v):
    return [e.msg for e in v.drain() if isinstance(e.msg, DraftTailStream)]


def test_prediction_drafts_come_first_then_the_method():
    v, d = _setup(window=4)
    # ngram would draft [4, 5, 6, 1] after [.., 3]; the prediction says 20 1 2
    prompt = [1, 2, 3, 4, 5, 6, 1, 2]
    v.send("drafter-0", DraftSync(request_id="r", prompt_token_ids=prompt,
                                  committed_token_ids=[3], sampling=SamplingParams(),
                                  prediction_token_ids=[3, 20, 1, 2]))
    d.step()
    (seg,) = _segments(v)
    assert seg.from_prediction and seg.draft_token_ids == [20, 1, 2] and seg.start_pos == 1
    assert seg.draft_probs is None
    d.step()  # the prediction ended: the method fills the window (ngram: [1, 2] -> 3)
    (seg,) = _segments(v)
    assert not seg.from_prediction and seg.start_pos == 4 and seg.draft_token_ids == [3]
    assert d.stats.num_prediction_tokens_sent == 3


def test_a_request_without_prediction_drafts_as_before():
    v, d = _setup(window=4)
    v.send("drafter-0", DraftSync(request_id="r", prompt_token_ids=[1, 2, 3, 4, 5, 6, 1, 2],
                                  committed_token_ids=[3], sampling=SamplingParams()))
    d.step()
    (seg,) = _segments(v)
    assert not seg.from_prediction and seg.draft_token_ids == [4, 5, 6, 1]


def test_a_rejected_prediction_draft_realigns_by_suffix():
    v, d = _setup(window=4)
    pred = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    v.send("drafter-0", DraftSync(request_id="r", prompt_token_ids=[1, 2],
                                  committed_token_ids=[10], sampling=SamplingParams(),
                                  prediction_token_ids=pred))
    d.step()
    (seg,) = _segments(v)
    assert seg.draft_token_ids == [11, 12, 13, 14]
    # the verifier accepted 11 and committed 30 instead of 12 (an inserted token)
    v.send("drafter-0", VerifyCommit(request_id="r", pre_commit_len=1,
                                     committed_token_ids=[11, 30]))
    d.step()
    segs = _segments(v)
    assert d.stats.num_path_truncations == 1
    # [11, 30] is not in the prediction: the method (ngram on [1, 2, 10, 11, 30]) has nothing
    assert all(not s.draft_token_ids for s in segs)
    # then the output returns to the prediction: "12 13" re-aligns after 13, not at a count
    v.send("drafter-0", VerifyCommit(request_id="r", pre_commit_len=3,
                                     committed_token_ids=[12, 13]))
    d.step()
    (seg,) = _segments(v)
    assert seg.from_prediction and seg.start_pos == 5 and seg.draft_token_ids == [14, 15, 16, 17]


def test_sampled_requests_get_rows_for_method_drafts_only():
    v, d = _setup(window=4, proposer=RowsProposer())
    sampled = SamplingParams(temperature=0.8, max_tokens=32)
    v.send("drafter-0", DraftSync(request_id="r", prompt_token_ids=[1, 2],
                                  committed_token_ids=[7], sampling=sampled,
                                  prediction_token_ids=[7, 8, 9]))
    d.step()
    d.step()
    pred, method = _segments(v)
    assert pred.from_prediction and pred.draft_token_ids == [8, 9] and pred.draft_probs is None
    assert not method.from_prediction and method.draft_token_ids == [5, 5]
    assert method.draft_probs is not None and method.draft_probs.shape == (2, VOCAB)


def test_runs_split_a_path_where_the_source_changes():
    flags = [True, True, False, False, True]
    assert _runs(flags, 0, 5) == [(0, 2, True), (2, 4, False), (4, 5, True)]
    assert _runs(flags, 1, 3) == [(1, 2, True), (2, 3, False)]
    assert _runs(flags, 5, 5) == [(5, 5, False)]


def test_prediction_drafts_run_ahead_to_the_prediction_window():
    """Copying costs no forward: a prediction path runs ``prediction_window`` ahead, past the
    method's window, ``max_segment`` and a verifier's ``num_drafts_wanted``; once the
    prediction has nothing and the method's window is full the drafter rests until a commit."""
    hub = InProcHub()
    v = hub.mailbox("verifier-0")
    d = DrafterWorker(DrafterConfig(window=4, max_segment=4, num_branches=0,
                                    prediction_window=12),
                      hub.mailbox("drafter-0"))
    pred = list(range(10, 40))
    v.send("drafter-0", DraftSync(request_id="r", prompt_token_ids=[1, 2],
                                  committed_token_ids=[10], sampling=SamplingParams(),
                                  prediction_token_ids=pred))
    d.step()
    (seg,) = _segments(v)
    assert seg.from_prediction and seg.draft_token_ids == pred[1:13]
    assert not d._has_work()
    # the verifier accepted 11 and wants 1 method draft: the prediction still runs 12 ahead
    v.send("drafter-0", VerifyCommit(request_id="r", pre_commit_len=1,
                                     committed_token_ids=[11], num_drafts_wanted=1))
    d.step()
    (seg,) = _segments(v)
    assert seg.from_prediction and seg.draft_token_ids == [pred[13]]
    # the output leaves the prediction for good: the method fills its own window only
    v.send("drafter-0", VerifyCommit(request_id="r", pre_commit_len=2,
                                     committed_token_ids=[12, 99], num_drafts_wanted=2))
    for _ in range(3):
        d.step()
    assert all(not s.from_prediction and len(s.draft_token_ids) <= 4 for s in _segments(v))
    assert len(d.requests["r"].path) <= 4 and not d._has_work()


def test_without_a_prediction_window_the_prediction_keeps_the_method_window():
    v, d = _setup(window=4)
    v.send("drafter-0", DraftSync(request_id="r", prompt_token_ids=[1, 2],
                                  committed_token_ids=[10], sampling=SamplingParams(),
                                  prediction_token_ids=list(range(10, 40))))
    d.step()
    (seg,) = _segments(v)
    assert seg.draft_token_ids == [11, 12, 13, 14]
