"""Tail buffer staleness rule (docs/architecture.md, 'Draft tails and staleness') and the commit cut
(EOS / stop / max_tokens)."""

from specmesh.decode.request import Request
from specmesh.decode.tail_buffer import TailBuffer
from specmesh.protocol.messages import SamplingParams


def test_contiguous_segments_extend_the_tail():
    tb = TailBuffer(committed_len=2)
    committed = [10, 11]
    assert tb.add(2, [1, 2], committed, base_committed_len=2) == 2
    assert tb.add(4, [3], committed, base_committed_len=2) == 1
    assert tb.usable(8) == [1, 2, 3]
    assert tb.usable(2) == [1, 2]


def test_stale_segment_disagreeing_with_committed_is_discarded():
    tb = TailBuffer(committed_len=3)
    committed = [10, 11, 12]
    # starts at position 1: tokens at 1, 2 must equal 11, 12; position 2 disagrees
    assert tb.add(1, [11, 99, 5, 6], committed, base_committed_len=1) == 0
    assert tb.usable(8) == []
    assert tb.stats.num_stale_tokens == 3


def test_partially_committed_segment_keeps_its_fresh_part():
    tb = TailBuffer(committed_len=3)
    committed = [10, 11, 12]
    assert tb.add(2, [12, 7, 8], committed, base_committed_len=2) == 2
    assert tb.usable(8) == [7, 8]
    assert tb.stats.num_duplicate_tokens == 1


def test_gapped_segment_is_dropped():
    tb = TailBuffer(committed_len=1)
    committed = [10]
    tb.add(1, [1, 2], committed, base_committed_len=1)
    assert tb.add(4, [5, 6], committed, base_committed_len=1) == 0  # position 3 missing
    assert tb.usable(8) == [1, 2]
    assert tb.stats.num_gap_segments == 1


def test_duplicate_segment_is_idempotent():
    tb = TailBuffer(committed_len=1)
    committed = [10]
    tb.add(1, [1, 2, 3], committed, base_committed_len=1)
    assert tb.add(1, [1, 2, 3], committed, base_committed_len=1) == 0
    assert tb.add(2, [2, 3, 4], committed, base_committed_len=1) == 1
    assert tb.usable(8) == [1, 2, 3, 4]


def test_out_of_order_segments_later_one_is_a_gap_then_earlier_fills():
    tb = TailBuffer(committed_len=1)
    committed = [10]
    assert tb.add(3, [3, 4], committed, base_committed_len=1) == 0  # arrives first: gap
    assert tb.add(1, [1, 2], committed, base_committed_len=1) == 2
    # re-sent in order: now contiguous
    assert tb.add(3, [3, 4], committed, base_committed_len=1) == 2
    assert tb.usable(8) == [1, 2, 3, 4]


def test_overlapping_different_segment_replaces_the_rest():
    tb = TailBuffer(committed_len=1)
    committed = [10]
    tb.add(1, [1, 2, 3], committed, base_committed_len=1)
    assert tb.add(2, [7, 8], committed, base_committed_len=1) == 2
    assert tb.usable(8) == [1, 7, 8]
    assert tb.stats.num_replaced_tokens == 2


def test_commit_agreeing_with_tail_keeps_the_rest():
    tb = TailBuffer(committed_len=1)
    committed = [10]
    tb.add(1, [1, 2, 3, 4], committed, base_committed_len=1)
    committed += [1, 2]  # accepted 1, bonus 2 happened to equal the tail
    tb.on_commit(committed)
    assert tb.start == 3 and tb.usable(8) == [3, 4]


def test_commit_disagreeing_drops_the_whole_tail():
    tb = TailBuffer(committed_len=1)
    committed = [10]
    tb.add(1, [1, 2, 3, 4], committed, base_committed_len=1)
    committed += [1, 9]  # recovered token 9 != draft 2
    tb.on_commit(committed)
    assert tb.usable(8) == [] and tb.start == 3
    assert tb.stats.num_stale_tokens == 3
    # a segment for the old path (position 3) is now stale, a new one is accepted
    assert tb.add(2, [2, 3], committed, base_committed_len=1) == 0
    assert tb.add(3, [5], committed, base_committed_len=3) == 1


def test_commit_longer_than_tail():
    tb = TailBuffer(committed_len=1)
    committed = [10]
    tb.add(1, [1], committed, base_committed_len=1)
    committed += [1, 2, 3]
    tb.on_commit(committed)
    assert tb.start == 4 and len(tb) == 0


def test_segment_drafted_after_a_rejected_token_is_stale_at_the_committed_length():
    """Issue 9 scenario 8: the drafter sent [1, 2] (base 1) and ran ahead with [3, 4] after
    its own 2; the verifier accepted 1 and committed 9 instead of 2. The run-ahead segment
    starts exactly at the new committed length 3, yet continues the rejected 2: stale."""
    tb = TailBuffer(committed_len=1)
    committed = [10]
    tb.add(1, [1, 2], committed, base_committed_len=1)
    committed += [1, 9]
    tb.on_commit(committed)
    assert tb.start == 3 and tb.usable(8) == []
    stale = tb.stats.num_stale_tokens
    assert tb.add(3, [3, 4], committed, base_committed_len=1) == 0
    assert tb.usable(8) == []
    assert tb.stats.num_stale_tokens == stale + 2
    # the drafter learns of the commit, truncates its path and drafts fresh from 3
    assert tb.add(3, [5, 6], committed, base_committed_len=3) == 2
    assert tb.add(5, [7], committed, base_committed_len=3) == 1
    assert tb.usable(8) == [5, 6, 7]


def test_run_ahead_after_an_agreeing_commit_stays_usable():
    tb = TailBuffer(committed_len=1)
    committed = [10]
    tb.add(1, [1, 2], committed, base_committed_len=1)
    committed += [1, 2, 3]  # both accepted, bonus 3
    tb.on_commit(committed)
    # run-ahead drafted before the commit, on the (accepted) path [1, 2]: its first token
    # sits at the bonus position and agrees, the rest is usable
    assert tb.add(3, [3, 4, 5], committed, base_committed_len=1) == 2
    assert tb.usable(8) == [4, 5]
    # and continuing segments of the same path too
    assert tb.add(6, [6], committed, base_committed_len=1) == 1
    assert tb.usable(8) == [4, 5, 6]


def test_run_ahead_past_an_unseen_bonus_position_is_a_gap():
    """The path position the bonus token took was never received: a segment continuing the
    path after it depends on a token the verifier cannot check."""
    tb = TailBuffer(committed_len=1)
    committed = [10]
    tb.add(1, [1], committed, base_committed_len=1)
    committed += [1, 2]  # accepted 1, bonus 2 at position 2 (the drafter's token unseen)
    tb.on_commit(committed)
    assert tb.add(3, [3, 4], committed, base_committed_len=1) == 0
    assert tb.stats.num_gap_segments == 1 and tb.usable(8) == []
    # the segment that carries position 2 makes the path known again
    assert tb.add(2, [2], committed, base_committed_len=1) == 0
    assert tb.add(3, [3, 4], committed, base_committed_len=1) == 2


def test_segment_from_before_a_reset_is_stale():
    tb = TailBuffer(committed_len=1)
    committed = [10, 11, 12]
    tb.reset(3)  # DraftSync at 3: only fresh segments from now on
    assert tb.add(4, [5], committed, base_committed_len=1) == 0
    assert tb.add(3, [5], committed, base_committed_len=3) == 1


def test_segment_that_disagrees_with_a_commit_makes_its_continuations_stale():
    tb = TailBuffer(committed_len=3)
    committed = [10, 11, 12]
    # drafted from 1 on the path 11, 99: disagrees at position 2
    assert tb.add(1, [11, 99], committed, base_committed_len=1) == 0
    assert tb.add(3, [7, 8], committed, base_committed_len=1) == 0  # continues the 99
    assert tb.usable(8) == []


def _req(max_tokens, stop_ids=(), ignore_eos=False, committed=(5,)):
    r = Request("r", "gw", [1, 2, 3], SamplingParams(max_tokens=max_tokens,
                stop_token_ids=list(stop_ids), ignore_eos=ignore_eos), 4)
    r.output_token_ids = list(committed)
    return r


def test_commit_cut_at_eos_inside_accepted_block():
    r = _req(max_tokens=10)
    out = r.commit([7, 8, 2, 9, 4], eos_token_ids=frozenset({2}))
    assert out == [7, 8, 2]
    assert r.output_token_ids == [5, 7, 8, 2]
    assert r.finish_reason == "stop"


def test_commit_cut_at_stop_token_and_ignore_eos():
    r = _req(max_tokens=10, stop_ids=[8], ignore_eos=True)
    assert r.commit([2, 8, 9], eos_token_ids=frozenset({2})) == [2, 8]
    assert r.finish_reason == "stop"


def test_commit_cut_at_max_tokens_counts_exactly():
    r = _req(max_tokens=4)
    out = r.commit([7, 8, 9, 10, 11], eos_token_ids=frozenset({2}))
    assert out == [7, 8, 9]
    assert r.committed_len == 4 and r.finish_reason == "length"
    assert r.commit([1], eos_token_ids=frozenset()) == []  # never past the end


def test_commit_not_finished():
    r = _req(max_tokens=10)
    assert r.commit([7, 8], eos_token_ids=frozenset({2})) == [7, 8]
    assert r.finish_reason is None
