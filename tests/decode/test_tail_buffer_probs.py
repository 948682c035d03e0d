"""The tail buffer keeps each draft's probability row (DraftTailStream.draft_probs) aligned with
its token through add / duplicate / replace / commit / stale / reset (issue 8: full draft
probabilities end to end).

Rows are tagged with their token and position (``row(tok, pos)``), so a misaligned row shows
which token it belonged to."""

from specmesh.decode.tail_buffer import TailBuffer


def row(tok: int, pos: int) -> tuple[int, int]:
    return (tok, pos)


def rows(start: int, toks: list[int]) -> list[tuple[int, int]]:
    return [row(t, start + i) for i, t in enumerate(toks)]


def check_aligned(tb: TailBuffer) -> None:
    probs = tb.usable_probs(len(tb))
    assert len(probs) == len(tb.tokens)
    for i, (tok, p) in enumerate(zip(tb.tokens, probs)):
        if p is not None:
            assert p == (tok, tb.start + i), (i, tok, p)


def test_rows_follow_tokens_through_add_commit_and_truncate():
    committed = [10, 11]
    tb = TailBuffer(committed_len=2)
    assert tb.add(2, [1, 2], committed, base_committed_len=2, draft_probs=rows(2, [1, 2])) == 2
    assert tb.add(4, [3, 4], committed, base_committed_len=2, draft_probs=rows(4, [3, 4])) == 2
    check_aligned(tb)
    assert tb.usable_probs(3) == rows(2, [1, 2, 3])
    # an overlapping segment that changes position 4 replaces the rows from there on
    assert tb.add(3, [2, 9, 8], committed, base_committed_len=2,
                  draft_probs=rows(3, [2, 9, 8])) == 2
    assert tb.tokens == [1, 2, 9, 8]
    check_aligned(tb)
    assert tb.usable_probs(4) == [row(1, 2), row(2, 3), row(9, 4), row(8, 5)]
    # a commit that agrees drops the committed rows with their tokens
    committed += [1, 2]
    tb.on_commit(committed)
    assert tb.tokens == [9, 8] and tb.usable_probs(8) == rows(4, [9, 8])
    # a commit that disagrees drops everything
    committed += [7]
    tb.on_commit(committed)
    assert tb.tokens == [] and tb.usable_probs(8) == []


def test_partly_committed_segment_keeps_the_rows_of_its_fresh_part():
    committed = [10, 11, 12]
    tb = TailBuffer(committed_len=3)
    assert tb.add(2, [12, 7, 8], committed, base_committed_len=2,
                  draft_probs=rows(2, [12, 7, 8])) == 2
    assert tb.usable_probs(8) == rows(3, [7, 8])
    check_aligned(tb)


def test_stale_and_gap_segments_leave_no_rows():
    committed = [10, 11, 12]
    tb = TailBuffer(committed_len=3)
    assert tb.add(1, [11, 99, 5], committed, base_committed_len=1,
                  draft_probs=rows(1, [11, 99, 5])) == 0
    assert tb.add(5, [5], committed, base_committed_len=3, draft_probs=rows(5, [5])) == 0
    assert tb.usable_probs(8) == [] and tb.tokens == []
    tb.add(3, [4], committed, base_committed_len=3, draft_probs=rows(3, [4]))
    tb.reset(3)
    assert tb.usable_probs(8) == [] and tb.tokens == []


def test_segments_without_rows_mix_with_segments_with_rows():
    committed = [10]
    tb = TailBuffer(committed_len=1)
    tb.add(1, [1, 2], committed, base_committed_len=1)  # one-hot drafts (no rows)
    tb.add(3, [3], committed, base_committed_len=1, draft_probs=rows(3, [3]))
    assert tb.usable_probs(8) == [None, None, row(3, 3)]
    # a duplicate that now brings a row fills the missing one
    tb.add(1, [1], committed, base_committed_len=1, draft_probs=rows(1, [1]))
    assert tb.usable_probs(8) == [row(1, 1), None, row(3, 3)]
    check_aligned(tb)
    assert tb.usable_probs(2) == [row(1, 1), None]


def test_rows_of_the_wrong_count_are_refused():
    tb = TailBuffer(committed_len=0)
    try:
        tb.add(0, [1, 2], [], base_committed_len=0, draft_probs=rows(0, [1]))
    except ValueError as err:
        assert "draft_probs" in str(err)
    else:
        raise AssertionError("a row count that is not the token count must raise")
    assert tb.tokens == []



def test_only_the_answer_to_the_latest_commit_ends_the_tail_wait():
    """A segment drafted on an older committed prefix (run-ahead sent before the drafter saw
    the last commit, or stale) does not end the verifier's wait for a tail: the drafter still
    owes the answer to that commit (``base_committed_len`` = the committed length)."""
    from specmesh.decode.config import VerifierConfig
    from specmesh.decode.lifecycle import RequestLifecycle
    from specmesh.decode.request import Request, RequestStatus
    from specmesh.decode.scheduler import Scheduler
    from specmesh.decode.stats import VerifierStats
    from specmesh.engine.block_manager import BlockManager
    from specmesh.protocol.messages import DraftTailStream, SamplingParams

    lc = RequestLifecycle(Scheduler(VerifierConfig(), BlockManager(8, 4)), None,
                          VerifierStats(), 50, frozenset(), lambda peer, msg: True)
    req = Request("r", "gw", [1, 2], SamplingParams(max_tokens=8), 4)
    req.status, req.drafter = RequestStatus.RUNNING, "d"
    req.output_token_ids = [3, 4, 5]
    req.tail.reset(3)
    lc.requests["r"] = req
    req.tail_in_flight = True  # a VerifyCommit up to 3 tokens went out
    lc.add_tail("d", DraftTailStream(request_id="r", base_committed_len=2, start_pos=2,
                                     draft_token_ids=[9, 9]))
    assert req.tail_in_flight  # stale run-ahead: still waiting
    lc.add_tail("d", DraftTailStream(request_id="r", base_committed_len=3, start_pos=3,
                                     draft_token_ids=[7]))
    assert not req.tail_in_flight and req.tail.usable(4) == [7]
