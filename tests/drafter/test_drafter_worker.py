"""Drafter worker run-ahead, commit alignment, need-sync, garbage tolerance (in-process hub)."""

import specmesh.drafter.proposers  # noqa: F401
from specmesh.drafter.config import DrafterConfig
from specmesh.drafter.worker import DrafterWorker
from specmesh.protocol.messages import (
    DraftClose,
    DraftNeedSync,
    DraftSync,
    DraftTailStream,
    SamplingParams,
    VerifyCommit,
)
from specmesh.protocol.transport import InProcHub


def _setup(window=4):
    hub = InProcHub()
    v = hub.mailbox("verifier-0")
    d = DrafterWorker(DrafterConfig(window=window, max_segment=window), hub.mailbox("drafter-0"))
    return v, d


def _tails(v):
    return [e.msg for e in v.drain() if isinstance(e.msg, (DraftTailStream, DraftNeedSync))]


def test_runs_ahead_and_keeps_path_on_agreeing_commit():
    v, d = _setup(window=4)
    prompt = [1, 2, 3, 4, 5, 6, 1, 2]
    v.send("drafter-0", DraftSync(request_id="r", prompt_token_ids=prompt,
                                  committed_token_ids=[3], sampling=SamplingParams()))
    d.step()
    (seg,) = _tails(v)
    assert seg.start_pos == 1 and seg.draft_token_ids == [4, 5, 6, 1]
    # the verifier accepted 2 drafts and the bonus equals the third draft
    v.send("drafter-0", VerifyCommit(request_id="r", pre_commit_len=1,
                                     committed_token_ids=[4, 5, 6]))
    d.step()
    (seg2,) = _tails(v)
    # path [1] kept (position 4), new tokens drafted after it, sent as a delta from position 5
    assert seg2.start_pos == 5
    assert d.requests["r"].path[0] == 1


def test_disagreeing_commit_truncates_and_redrafts_from_commit():
    v, d = _setup(window=3)
    v.send("drafter-0", DraftSync(request_id="r", prompt_token_ids=[1, 2, 3, 1, 2],
                                  committed_token_ids=[3], sampling=SamplingParams()))
    d.step()
    _tails(v)
    v.send("drafter-0", VerifyCommit(request_id="r", pre_commit_len=1, committed_token_ids=[9]))
    d.step()
    segs = _tails(v)
    assert d.stats.num_path_truncations == 1
    assert all(s.start_pos == 2 for s in segs)


def test_misaligned_commit_asks_for_sync():
    v, d = _setup()
    v.send("drafter-0", DraftSync(request_id="r", prompt_token_ids=[1, 2], committed_token_ids=[3],
                                  sampling=SamplingParams()))
    d.step()
    _tails(v)
    v.send("drafter-0", VerifyCommit(request_id="r", pre_commit_len=5, committed_token_ids=[1]))
    d.step()
    msgs = _tails(v)
    assert any(isinstance(m, DraftNeedSync) for m in msgs)
    assert "r" not in d.requests


def test_garbage_and_unknown_requests_do_not_kill_the_drafter():
    v, d = _setup()
    v.send_frames("drafter-0", [b"\xc1garbage"])
    v.send("drafter-0", VerifyCommit(request_id="nope", pre_commit_len=0, committed_token_ids=[1]))
    v.send("drafter-0", DraftClose(request_id="nope"))
    d.step()
    assert d.stats.num_protocol_errors == 1
    assert d.stats.num_dropped_messages == 2
    v.send("drafter-0", DraftSync(request_id="r", prompt_token_ids=[1, 2, 1], committed_token_ids=[2],
                                  sampling=SamplingParams()))
    d.step()
    assert _tails(v)


def test_close_drops_state():
    v, d = _setup()
    v.send("drafter-0", DraftSync(request_id="r", prompt_token_ids=[1], committed_token_ids=[1],
                                  sampling=SamplingParams()))
    d.step()
    v.send("drafter-0", DraftClose(request_id="r"))
    d.step()
    assert d.requests == {}


def test_commits_for_endless_unknown_requests_leave_bounded_state():
    """A peer that sends commits for ever new unknown request ids gets a DraftNeedSync for
    each (the drafter does not hold them) but grows no state past MAX_ASKED_SYNC entries."""
    from specmesh.drafter.worker import MAX_ASKED_SYNC

    v, d = _setup()
    n = MAX_ASKED_SYNC + 500
    for i in range(n):
        v.send("drafter-0", VerifyCommit(request_id=f"u{i}", pre_commit_len=0,
                                         committed_token_ids=[1]))
    d.step()
    assert d.stats.num_dropped_messages == n and d.stats.num_need_sync == n
    assert len(d._asked_sync) <= MAX_ASKED_SYNC
    need = 0
    while got := _tails(v):  # a drain returns at most 4096 messages
        need += sum(isinstance(m, DraftNeedSync) for m in got)
    assert need == n


def _synced_garbage_drafter(runs_a_model: bool = True):
    """(verifier mailbox, drafter with window 8 that drafts token 999 only) after one DraftSync
    of request "r" and one step; its proposer declares ``runs_a_model`` (a model drafter's
    run-ahead follows the verifier's cap)."""
    from helpers.proposers import GarbageProposer

    hub = InProcHub()
    v = hub.mailbox("verifier-0")
    proposer = GarbageProposer(999)
    proposer.runs_a_model = runs_a_model
    d = DrafterWorker(DrafterConfig(window=8, max_segment=8), hub.mailbox("drafter-0"),
                      proposer)
    v.send("drafter-0", DraftSync(request_id="r", prompt_token_ids=[1, 2, 3],
                                  committed_token_ids=[2], sampling=SamplingParams()))
    d.step()
    return v, d


def test_run_ahead_follows_the_drafts_the_verifier_wants():
    """VerifyCommit.num_drafts_wanted: the path runs ahead by twice the verifier's cap (at
    least one draft), not by the whole window; None: the window."""
    v, d = _synced_garbage_drafter()
    assert len(d.requests["r"].path) == 8  # no cap yet: the window
    pre = 1
    for wanted, run_ahead in ((1, 2), (0, 2), (3, 6), (None, 8)):
        # a commit that disagrees with the path (token 999 is never drafted): a new path
        v.send("drafter-0", VerifyCommit(request_id="r", pre_commit_len=pre,
                                         committed_token_ids=[999],
                                         num_drafts_wanted=wanted))
        pre += 1
        d.step()
        assert len(d.requests["r"].path) == run_ahead, wanted
    _tails(v)


def test_a_drafter_that_runs_no_model_keeps_its_whole_window():
    """Drafts that cost no forward (n-gram, suffix) run ahead by the whole window whatever
    the verifier's cap: its caps can only take the drafts they are offered."""
    v, d = _synced_garbage_drafter(runs_a_model=False)
    v.send("drafter-0", VerifyCommit(request_id="r", pre_commit_len=1,
                                     committed_token_ids=[999], num_drafts_wanted=1))
    d.step()
    assert len(d.requests["r"].path) == 8
    _tails(v)


def test_a_paused_request_is_not_drafted_until_a_commit_resumes_it():
    """VerifyCommit.drafting_paused (the verifier's speculation gate has drafting off): the
    drafter drafts nothing for the request, not even a probe's draft, prepares no branches
    and waits for messages; the next commit without the flag resumes it."""
    v, d = _synced_garbage_drafter()
    v.send("drafter-0", VerifyCommit(request_id="r", pre_commit_len=1,
                                     committed_token_ids=[999], num_drafts_wanted=0,
                                     drafting_paused=True))
    d.step()
    st = d.requests["r"]
    assert st.path == [] and not d._has_work()
    assert d.prepare_branches() == 0 and st.branches == {}
    v.send("drafter-0", VerifyCommit(request_id="r", pre_commit_len=2,
                                     committed_token_ids=[998], num_drafts_wanted=2))
    d.step()
    assert len(d.requests["r"].path) == 4  # resumed: twice the drafts wanted
    _tails(v)


def test_a_path_at_its_run_ahead_cap_leaves_the_drafter_waiting_not_spinning():
    """Seen served at 16 concurrent requests: with the verifier's cap (num_drafts_wanted)
    below the window, every path stopped at its run-ahead while ``_has_work`` still measured
    against the window, so each step polled with timeout 0 and the n-gram drafter burned a
    core beside the verifier. Once every path is at its cap, a step waits for a message."""
    v, d = _synced_garbage_drafter()
    v.send("drafter-0", VerifyCommit(request_id="r", pre_commit_len=1,
                                     committed_token_ids=[999], num_drafts_wanted=1))
    d.step()
    assert len(d.requests["r"].path) == 2  # at its cap (two steps of one draft)
    assert not d._has_work()
    waits = []
    d.ingest = lambda timeout_s=0.0: waits.append(timeout_s) or 0
    d.step(0.25)
    assert waits == [0.25]  # the caller's wait, not a zero-timeout poll


def test_one_propose_many_call_drafts_for_every_request():
    """The worker hands every request that wants drafts to the proposer in one call (a model
    drafter batches them), and each request's segment carries that call's drafts."""
    from specmesh.drafter.proposer import ProposeCall, Proposer

    class Counting(Proposer):
        name = "counting-test"

        def __init__(self):
            self.batches = []

        def open(self, request_id, context_token_ids):
            pass

        def propose(self, request_id, context_token_ids, num_tokens):
            raise AssertionError("the worker should call propose_many")

        def propose_many(self, calls: list[ProposeCall]):
            self.batches.append([c.request_id for c in calls])
            return [([len(c.context_token_ids)] * c.num_tokens, [None] * c.num_tokens)
                    for c in calls]

        def rollback(self, request_id, num_context_tokens):
            pass

        def close(self, request_id):
            pass

    hub = InProcHub()
    v = hub.mailbox("verifier-0")
    prop = Counting()
    d = DrafterWorker(DrafterConfig(window=2, max_segment=2), hub.mailbox("drafter-0"), prop)
    for i in range(3):
        v.send("drafter-0", DraftSync(request_id=f"r{i}", prompt_token_ids=[1] * (i + 2),
                                      committed_token_ids=[3], sampling=SamplingParams()))
    d.step()
    assert prop.batches == [["r0", "r1", "r2"]]
    segs = {s.request_id: s.draft_token_ids for s in _tails(v)}
    assert segs == {f"r{i}": [i + 3, i + 3] for i in range(3)}


def _branch_oracle_drafter():
    """(verifier mailbox, drafter, proposer) with request "r" open on a BranchOracleProposer
    whose path is one wrong draft (22 after 20; the target's next token is 21) and one step
    run."""
    from tests.helpers.proposers import BranchOracleProposer

    prompt, ref = [5, 6, 7], [20, 21, 22, 23, 24, 25]
    hub = InProcHub()
    v = hub.mailbox("verifier-0")
    prop = BranchOracleProposer([prompt], [ref], vocab_size=100)
    d = DrafterWorker(DrafterConfig(window=2, max_segment=2), hub.mailbox("drafter-0"), prop)
    v.send("drafter-0", DraftSync(request_id="r", prompt_token_ids=prompt,
                                  committed_token_ids=[ref[0]], sampling=SamplingParams()))
    d.step()
    return v, d, prop


def test_branches_prepared_once_the_path_is_full_and_taken_by_the_commit():
    """Once its path is full the worker sends DraftBranches for the path's first positions;
    a commit whose bonus token is a prepared candidate starts the path from its continuation
    (re-sent as a fresh segment), any other commit drops them."""
    from specmesh.protocol.messages import DraftBranches

    v, d, prop = _branch_oracle_drafter()
    d.step()  # the path cannot grow (the proposer has nothing after 22): branches now
    msgs = [e.msg for e in v.drain()]
    seg = next(m for m in msgs if isinstance(m, DraftTailStream))
    assert seg.draft_token_ids == [22]  # the wrong draft (21 + 1); nothing after it
    (br,) = [m for m in msgs if isinstance(m, DraftBranches)]
    assert (br.base_committed_len, br.position, br.token_ids, br.continuations) == \
        (1, 1, [21], [[22]])
    d.step()  # nothing new: branches are prepared once per position
    assert prop.num_branch_calls == 1 and not [e for e in v.drain()]
    # the verifier rejected draft 22 and committed its bonus 21: the branch's continuation
    v.send("drafter-0", VerifyCommit(request_id="r", pre_commit_len=1, committed_token_ids=[21]))
    d.step()
    st = d.requests["r"]
    assert d.stats.num_branch_hits == 1 and st.path[0] == 22
    fresh = [e.msg for e in v.drain() if isinstance(e.msg, DraftTailStream)]
    assert fresh[0].start_pos == fresh[0].base_committed_len == 2
    assert fresh[0].draft_token_ids[0] == 22
    # a bonus no branch was made for: no hit, the branches are gone
    v.send("drafter-0", VerifyCommit(request_id="r", pre_commit_len=2, committed_token_ids=[99]))
    d.step()
    assert d.stats.num_branch_hits == 1 and all(p >= 3 for p in st.branches)


def test_a_branch_hit_is_answered_before_the_next_draft():
    """On a hit the verifier's tail is already the branch; the drafter says so at once, while
    it handles the commit (before catching up and drafting: ~3.7 ms served), so a verifier
    whose tail wait would go on for a second draft stops waiting."""
    v, d, _ = _branch_oracle_drafter()
    d.step()
    v.drain()
    v.send("drafter-0", VerifyCommit(request_id="r", pre_commit_len=1, committed_token_ids=[21]))
    d.ingest()  # the commit only: no draft yet
    (seg,) = [e.msg for e in v.drain()]
    assert isinstance(seg, DraftTailStream)
    assert (seg.base_committed_len, seg.start_pos, seg.draft_token_ids) == (2, 2, [22])
    d.step()  # the next draft follows as a segment of its own
    (nxt,) = [e.msg for e in v.drain() if isinstance(e.msg, DraftTailStream)]
    assert nxt.start_pos == 3 and len(nxt.draft_token_ids) == 1
    # no hit: nothing is sent while the commit is handled
    v.send("drafter-0", VerifyCommit(request_id="r", pre_commit_len=2,
                                     committed_token_ids=[22, 98]))
    d.ingest()
    assert not v.drain()


def test_no_branches_for_a_method_without_them_or_when_off():
    hub = InProcHub()
    v = hub.mailbox("verifier-0")
    d = DrafterWorker(DrafterConfig(window=2, max_segment=2), hub.mailbox("drafter-0"))
    v.send("drafter-0", DraftSync(request_id="r", prompt_token_ids=[1, 2, 3, 1, 2],
                                  committed_token_ids=[3], sampling=SamplingParams()))
    for _ in range(3):
        d.step()
    from specmesh.protocol.messages import DraftBranches

    assert not [e for e in v.drain() if isinstance(e.msg, DraftBranches)]


def test_branch_work_is_split_so_a_commit_never_waits_long():
    """At most MAX_BRANCH_ROWS candidates per propose_branches call: four requests at 8
    candidates each take two calls, the second in the next step without waiting."""
    from specmesh.drafter.branches import MAX_BRANCH_ROWS
    from specmesh.protocol.messages import DraftBranches
    from tests.helpers.proposers import BranchOracleProposer

    assert MAX_BRANCH_ROWS == 16
    prompts = [[5, 6, i] for i in range(4)]
    refs = [[20 + i, 30 + i, 40 + i] for i in range(4)]
    hub = InProcHub()
    v = hub.mailbox("verifier-0")
    prop = BranchOracleProposer(prompts, refs, vocab_size=100)
    d = DrafterWorker(DrafterConfig(window=2, max_segment=2, num_branches=8),
                      hub.mailbox("drafter-0"), prop)
    for i, (p, r) in enumerate(zip(prompts, refs)):
        v.send("drafter-0", DraftSync(request_id=f"r{i}", prompt_token_ids=p,
                                      committed_token_ids=[r[0]], sampling=SamplingParams()))
    d.step()
    d.step()  # paths full: the first 2 requests' branches
    assert prop.num_branch_calls == 1 and d._branches_pending
    d.step(timeout_s=5.0)  # does not block: the other 2 requests' branches
    assert prop.num_branch_calls == 2 and not d._branches_pending
    got = {e.msg.request_id for e in v.drain() if isinstance(e.msg, DraftBranches)}
    assert got == {f"r{i}" for i in range(4)}


def test_no_branches_while_the_drafter_holds_many_requests():
    from specmesh.drafter.branches import MAX_BRANCH_REQUESTS
    from specmesh.protocol.messages import DraftBranches
    from tests.helpers.proposers import BranchOracleProposer

    n = MAX_BRANCH_REQUESTS + 1
    prompts = [[5, 6, i] for i in range(n)]
    refs = [[20 + i, 30 + i, 40 + i] for i in range(n)]
    hub = InProcHub()
    v = hub.mailbox("verifier-0")
    prop = BranchOracleProposer(prompts, refs, vocab_size=100)
    d = DrafterWorker(DrafterConfig(window=2, max_segment=2), hub.mailbox("drafter-0"), prop)
    for i, (p, r) in enumerate(zip(prompts, refs)):
        v.send("drafter-0", DraftSync(request_id=f"r{i}", prompt_token_ids=p,
                                      committed_token_ids=[r[0]], sampling=SamplingParams()))
    for _ in range(3):
        d.step()
    assert prop.num_branch_calls == 0
    assert not [e for e in v.drain() if isinstance(e.msg, DraftBranches)]
    v.send("drafter-0", DraftClose(request_id="r0"))  # back to MAX_BRANCH_REQUESTS: branches
    d.step()
    d.step()
    assert prop.num_branch_calls == 1


def test_a_restarted_verifier_s_old_requests_are_dropped():
    """Found by the soak (benchmarks/soak.py): the drafter kept the draft states of a killed
    verifier's requests for good (its new incarnation never closes them, and no send to the old
    one fails). The host drops them on the new incarnation's Hello; other verifiers' stay."""
    from types import SimpleNamespace

    from specmesh.cluster.hosts.drafter import DrafterHost
    from specmesh.protocol.zmq_transport import PeerInfo

    hub = InProcHub()
    v0, v1 = hub.mailbox("verifier-0"), hub.mailbox("verifier-1")
    d = DrafterWorker(DrafterConfig(window=3, max_segment=3), hub.mailbox("drafter-0"))
    for v, rid in ((v0, "a"), (v0, "b"), (v1, "c")):
        v.send("drafter-0", DraftSync(request_id=rid, prompt_token_ids=[1, 2, 1],
                                      committed_token_ids=[2], sampling=SamplingParams()))
    d.step()
    assert set(d.requests) == {"a", "b", "c"}
    host = SimpleNamespace(worker=d)
    DrafterHost.on_hello(host, PeerInfo("verifier-0", "verifier", 7), False)  # same life
    assert set(d.requests) == {"a", "b", "c"}
    DrafterHost.on_hello(host, PeerInfo("verifier-0", "verifier", 8), True)  # restarted
    assert set(d.requests) == {"c"}
