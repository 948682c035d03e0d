"""The drafter worker hands seed states (target hidden states) to a "hidden" proposer with the
positions of docs/architecture.md, 'Messages', after the commit is applied; a seed state that does
not fit (rows
!= committed tokens, no rows, another hidden size, not a matrix) is a protocol error for that
request (DraftNeedSync) and the worker keeps serving. A method that needs none ignores them."""

from __future__ import annotations

import torch

import specmesh.drafter.proposers  # noqa: F401
from specmesh.drafter.config import DrafterConfig
from specmesh.drafter.proposer import Proposer
from specmesh.drafter.worker import DrafterWorker
from specmesh.engine.frames import tensor_to_buffer
from specmesh.protocol.messages import (
    Buffer,
    DraftNeedSync,
    DraftSync,
    DraftTailStream,
    SamplingParams,
    VerifyCommit,
)
from specmesh.protocol.transport import InProcHub

HIDDEN = 8
PROMPT = [1, 2, 3, 4]


class SeedLog(Proposer):
    """Records (event, request id, ...) in call order; drafts nothing."""

    name = "seed-log-test"  # not registered: handed to the worker directly
    seed_state = "hidden"
    seed_hidden_size = HIDDEN

    def __init__(self):
        self.log = []

    def open(self, request_id, context_token_ids):
        self.log.append(("open", request_id, len(context_token_ids)))

    def propose(self, request_id, context_token_ids, num_tokens):
        return [7] * num_tokens

    def rollback(self, request_id, num_context_tokens):
        self.log.append(("rollback", request_id, num_context_tokens))

    def close(self, request_id):
        self.log.append(("close", request_id))

    def observe_seed_state(self, request_id, start_position, hidden):
        self.log.append(("seed", request_id, start_position, hidden.clone()))


def _setup(proposer=None):
    hub = InProcHub()
    v = hub.mailbox("verifier-0")
    p = proposer or SeedLog()
    d = DrafterWorker(DrafterConfig(window=2, max_segment=2), hub.mailbox("drafter-0"), p)
    return v, d, p


def _rows(n, hidden=HIDDEN, start=0.0):
    return torch.arange(start, start + n * hidden, dtype=torch.float64).reshape(n, hidden)


def _sync(v, rid="r", committed=(9,), seed=None):
    v.send("drafter-0", DraftSync(request_id=rid, prompt_token_ids=PROMPT,
                                  committed_token_ids=list(committed), sampling=SamplingParams(),
                                  seed_state=seed))


def _need_syncs(v):
    return [e.msg for e in v.drain() if isinstance(e.msg, DraftNeedSync)]


def test_seed_states_reach_the_proposer_with_their_positions():
    v, d, p = _setup()
    _sync(v, committed=[9], seed=tensor_to_buffer(_rows(1)))
    d.step()  # path [7, 7] drafted at output positions 1, 2
    # commit 7 (accepted) + 5 (bonus): positions 1, 2 of the output; rows predict them
    v.send("drafter-0", VerifyCommit(request_id="r", pre_commit_len=1,
                                     committed_token_ids=[7, 5],
                                     seed_state=tensor_to_buffer(_rows(2, start=100.0))))
    d.step()
    assert _need_syncs(v) == []
    seeds = [e for e in p.log if e[0] == "seed"]
    # DraftSync: context of 5 tokens, one row ending at position 5 - 2 = 3
    assert seeds[0][1:3] == ("r", 3) and torch.equal(seeds[0][3], _rows(1))
    # VerifyCommit: start = prompt_len + pre_commit_len - 1 = 4
    assert seeds[1][1:3] == ("r", 4) and torch.equal(seeds[1][3], _rows(2, start=100.0))
    # the path disagreed (5 != 7): the proposer rolled back before it saw the new states
    assert [e[0] for e in p.log] == ["open", "seed", "rollback", "seed"]


def test_replayed_overlap_passes_only_the_new_rows():
    v, d, p = _setup()
    _sync(v, committed=[9, 8], seed=tensor_to_buffer(_rows(2)))
    d.step()
    # positions 1.. : token 8 at 1 is known already; only the row of the new token 6 is new
    v.send("drafter-0", VerifyCommit(request_id="r", pre_commit_len=1,
                                     committed_token_ids=[8, 6],
                                     seed_state=tensor_to_buffer(_rows(2, start=50.0))))
    d.step()
    assert _need_syncs(v) == []
    last = [e for e in p.log if e[0] == "seed"][-1]
    assert last[2] == len(PROMPT) + 2 - 1
    assert torch.equal(last[3], _rows(2, start=50.0)[1:])


def test_malformed_seed_state_asks_for_a_sync_and_the_worker_goes_on():
    v, d, p = _setup()
    _sync(v, seed=tensor_to_buffer(_rows(1)))
    d.step()
    v.drain()
    # two committed tokens, three rows
    v.send("drafter-0", VerifyCommit(request_id="r", pre_commit_len=1, committed_token_ids=[7, 7],
                                     seed_state=tensor_to_buffer(_rows(3))))
    d.step()
    (ns,) = _need_syncs(v)
    assert ns.request_id == "r" and "seed state" in ns.reason
    assert "r" not in d.requests and d.stats.num_need_sync == 1
    # the verifier re-syncs: the request is back and drafts again
    _sync(v, committed=[9, 7, 7], seed=tensor_to_buffer(_rows(3)))
    d.step()
    assert "r" in d.requests
    assert any(isinstance(e.msg, DraftTailStream) for e in v.drain())


def test_bad_sync_seed_states_are_refused():
    bad = {
        "no rows": tensor_to_buffer(_rows(0)),
        "hidden size": tensor_to_buffer(_rows(1, hidden=HIDDEN + 1)),
        "not a matrix": tensor_to_buffer(torch.zeros(HIDDEN, dtype=torch.float64)),
        "integers": tensor_to_buffer(torch.zeros(1, HIDDEN, dtype=torch.int64)),
    }
    v, d, p = _setup()
    for i, buf in enumerate(bad.values()):
        _sync(v, rid=f"r{i}", seed=buf)
    d.step()
    assert sorted(m.request_id for m in _need_syncs(v)) == [f"r{i}" for i in range(len(bad))]
    assert d.requests == {} and not any(e[0] == "seed" for e in p.log)
    # a good one still works
    _sync(v, rid="ok", seed=tensor_to_buffer(_rows(1)))
    d.step()
    assert "ok" in d.requests and _need_syncs(v) == []


def test_commit_without_seed_state_is_accepted():
    """A verifier that ships none (it does not know the method needs one): nothing to observe."""
    v, d, p = _setup()
    _sync(v)
    d.step()
    v.send("drafter-0", VerifyCommit(request_id="r", pre_commit_len=1, committed_token_ids=[7]))
    d.step()
    assert _need_syncs(v) == [] and d.requests["r"].committed == [9, 7]
    assert not any(e[0] == "seed" for e in p.log)


def test_a_method_without_seed_state_ignores_them():
    hub = InProcHub()
    v = hub.mailbox("verifier-0")
    d = DrafterWorker(DrafterConfig(window=2, max_segment=2), hub.mailbox("drafter-0"))
    assert d.proposer.seed_state == ""
    # not even looked at: a seed state that fits nothing passes
    v.send("drafter-0", DraftSync(request_id="r", prompt_token_ids=PROMPT,
                                  committed_token_ids=[9], sampling=SamplingParams(),
                                  seed_state=Buffer("float32", (0, 3), b"")))
    d.step()
    assert "r" in d.requests and _need_syncs(v) == []
