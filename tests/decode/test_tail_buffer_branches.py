"""DraftBranches at the verifier's tail buffer: a commit that takes a prepared outcome gets its
continuation as the tail at once; every other change of the path drops the branches past it."""

import pytest

from specmesh.decode.tail_buffer import TailBuffer


def _buffer_with_path():
    """Committed [10, 11]; the drafter's path 1, 2, 3 at positions 2, 3, 4."""
    tb = TailBuffer(committed_len=2)
    committed = [10, 11]
    tb.add(2, [1, 2, 3], committed, base_committed_len=2)
    return tb, committed


def test_rejected_first_draft_takes_the_branch_of_the_bonus_token():
    tb, committed = _buffer_with_path()
    # outcomes at position 2 other than the path's 1: bonus 7 -> drafts 70, 71; bonus 8 -> 80
    assert tb.add_branches(2, [7, 8], [[70, 71], [80]], committed, base_committed_len=2) == 2
    committed = committed + [7]  # the verifier rejected draft 1 and committed its bonus 7
    tb.on_commit(committed)
    assert tb.usable(8) == [70, 71]
    assert tb.stats.num_branch_hits == 1 and tb.branches == {}
    # the drafter's fresh segment on the new prefix continues the same path: duplicates kept
    assert tb.add(3, [70, 71, 72], committed, base_committed_len=3) == 1
    assert tb.usable(8) == [70, 71, 72]
    # a segment continuing the drafter's old path (sent before the commit reached it) is stale
    assert tb.add(5, [4], committed, base_committed_len=2) == 0
    assert tb.usable(8) == [70, 71, 72]


def test_accepted_draft_then_branch_at_the_second_position():
    tb, committed = _buffer_with_path()
    tb.add_branches(3, [9], [[90]], committed, base_committed_len=2)
    tb.on_commit(committed + [1, 9])  # draft 1 accepted, bonus 9 instead of draft 2
    assert tb.usable(8) == [90]
    # a commit running past the branch candidate is compared with its continuation
    tb2, c2 = _buffer_with_path()
    tb2.add_branches(2, [7], [[70, 71]], c2, base_committed_len=2)
    tb2.on_commit(c2 + [7, 70])
    assert tb2.usable(8) == [71]


def test_other_outcomes_drop_the_branches():
    tb, committed = _buffer_with_path()
    tb.add_branches(2, [7], [[70]], committed, base_committed_len=2)
    tb.add_branches(4, [5], [[50]], committed, base_committed_len=2)
    tb.on_commit(committed + [6])  # a bonus no branch prepared: the tail is gone
    assert tb.usable(8) == [] and tb.branches == {}
    assert tb.stats.num_branch_hits == 0
    # a commit that follows the path keeps the branches still ahead of it
    tb, committed = _buffer_with_path()
    tb.add_branches(2, [7], [[70]], committed, base_committed_len=2)
    tb.add_branches(4, [5], [[50]], committed, base_committed_len=2)
    tb.on_commit(committed + [1, 2])
    assert set(tb.branches) == {4} and tb.usable(8) == [3]
    # the drafter replacing its path at position 3 drops the branches hung after it
    tb, committed = _buffer_with_path()
    tb.add_branches(3, [7], [[70]], committed, base_committed_len=2)
    tb.add_branches(4, [5], [[50]], committed, base_committed_len=2)
    tb.add(2, [1, 9], committed, base_committed_len=2)
    assert tb.usable(8) == [1, 9] and set(tb.branches) == {3}


def test_stale_or_misplaced_branches_are_dropped_and_bad_ones_refused():
    tb, committed = _buffer_with_path()
    assert tb.add_branches(6, [7], [[70]], committed, base_committed_len=2) == 0  # past path
    assert tb.add_branches(2, [1, 7], [[5], [70]], committed, base_committed_len=2) == 0
    tb.on_commit(committed + [1])
    committed = committed + [1]
    # made on a path older than the one the buffer holds
    tb.add(3, [8], committed, base_committed_len=3)  # fresh path from the new prefix
    assert tb.add_branches(3, [7], [[70]], committed, base_committed_len=2) == 0
    assert tb.branches == {}
    with pytest.raises(ValueError):
        tb.add_branches(3, [7, 8], [[70]], committed, base_committed_len=3)
    with pytest.raises(ValueError):
        tb.add_branches(3, [7], [[]], committed, base_committed_len=3)
    with pytest.raises(ValueError):
        tb.add_branches(2, [7], [[1]], committed, base_committed_len=3)
    tb.reset(3)
    assert tb.branches == {}


def test_branches_that_arrive_after_their_commit_are_stale():
    """Made at the drafter's committed prefix (position == base) but reaching the verifier
    after it committed past that position: dropped, whatever the buffer holds."""
    tb, committed = _buffer_with_path()
    committed = committed + [1, 2, 3]
    tb.on_commit(committed)
    tb.add(5, [4, 5], committed, base_committed_len=5)
    for pos in (2, 3, 4):
        assert tb.add_branches(pos, [9], [[90]], committed, base_committed_len=pos) == 0
    assert tb.branches == {} and tb.usable(8) == [4, 5]
