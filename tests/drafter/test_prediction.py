"""Drafting from a prediction (drafter/prediction.py): alignment by suffix match, re-alignment
after a rejected draft (edits that insert, delete or replace lines), tie-breaking between
repeated lines, and the index against a brute-force search."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specmesh.drafter.prediction import (
    START, PredictionDrafter, PredictionIndex, _nearest, output_tail,
)


def lines(*rows: str) -> list[int]:
    """Token ids of text lines: one token per character, 10 = newline (a line is ~tokens)."""
    out: list[int] = []
    for row in rows:
        out += [ord(c) for c in row] + [10]
    return out


@dataclass
class Run:
    """What :func:`simulate` saw: drafts made and accepted, the committed lengths of the steps
    that had no draft, the steps, and the output positions where a draft was rejected."""

    drafted: int = 0
    accepted: int = 0
    no_draft: list[int] = field(default_factory=list)
    steps: int = 0
    rejected_at: list[int] = field(default_factory=list)


def simulate(prediction: list[int], target: list[int], k: int = 8) -> Run:
    """Greedy speculative decoding of ``target`` with drafts from ``prediction`` only: each
    step drafts up to ``k`` tokens after the committed output, accepts the longest prefix the
    target agrees with and commits it plus the target's next token."""
    drafter = PredictionDrafter(PredictionIndex(prediction))
    committed = target[:1]
    run = Run()
    while len(committed) < len(target):
        n = len(committed)
        draft = drafter.draft(output_tail(committed, [], 8), n, k)
        if not draft:
            run.no_draft.append(n)
        a = 0
        while a < len(draft) and n + a < len(target) and draft[a] == target[n + a]:
            a += 1
        run.drafted += len(draft)
        run.accepted += a
        if a < len(draft):
            run.rejected_at.append(n + a)
        run.steps += 1
        committed = target[:n + a + 1]
    assert committed == target  # drafts never change the output (greedy verification)
    return run


ORIGINAL = lines("def area(w, h):", "    return w * h", "", "def perimeter(w, h):",
                 "    return 2 * (w + h)", "", "print(area(2, 3))")


def test_output_equal_to_the_prediction_is_drafted_whole_from_the_first_token():
    d = PredictionDrafter(PredictionIndex(ORIGINAL))
    assert d.draft(ORIGINAL[:1], 1, 5) == ORIGINAL[1:6]  # the start marker aligns token 0
    run = simulate(ORIGINAL, ORIGINAL)
    assert run.no_draft == [] and run.drafted == run.accepted  # nothing rejected
    assert run.steps == -(-(len(ORIGINAL) - 1) // 9)  # 8 drafts + 1 bonus token per step


def test_no_match_and_the_end_of_the_prediction_draft_nothing():
    d = PredictionDrafter(PredictionIndex([5, 6, 7, 8]))
    assert d.draft([1, 2], 2, 4) == []  # not in the prediction
    assert d.draft([6, 7, 8], 3, 4) == []  # aligned at the end: nothing follows
    assert d.draft([5, 6], 2, 0) == []
    assert d.draft([5, 6], 2, 9) == [7, 8]


def test_realigns_after_a_rejected_draft_when_lines_are_inserted():
    # the edit adds a docstring line inside area(): the output runs ahead of the prediction
    edited = lines("def area(w, h):", '    """Area."""', "    return w * h", "",
                   "def perimeter(w, h):", "    return 2 * (w + h)", "",
                   "print(area(2, 3))")
    drafter = PredictionDrafter(PredictionIndex(ORIGINAL))
    first = len(lines("def area(w, h):"))
    # drafted past the first line from the prediction; the target inserts a line instead
    assert drafter.draft(edited[:first], first, 4) == ORIGINAL[first:first + 4]
    inserted_end = len(lines("def area(w, h):", '    """Area."""'))
    # two tokens into the original's second line: re-found there, not at a position counter
    n = inserted_end + 2
    draft = drafter.draft(output_tail(edited[:n], [], 8), n, 6)
    assert draft == edited[n:n + 6]
    run = simulate(ORIGINAL, edited)
    # the only steps without drafts are inside the inserted line (and its first tokens)
    assert run.no_draft and all(first < m <= inserted_end + 2 for m in run.no_draft)
    # rejections: where the insertion starts, and inside it (its indentation and letters
    # occur in the prediction); none once the output is back on the original
    assert run.rejected_at[0] == first + len("    ")  # both lines start with 4 spaces
    assert all(first <= m < inserted_end for m in run.rejected_at), run.rejected_at


def test_realigns_when_lines_are_deleted():
    # the edit removes perimeter(): the output skips a part of the prediction
    edited = lines("def area(w, h):", "    return w * h", "", "print(area(2, 3))")
    run = simulate(ORIGINAL, edited)
    skip = len(lines("def area(w, h):", "    return w * h", ""))
    # after the blank line the prediction says "def perimeter": rejected at its first token;
    # the output's "\n\np" is then found further down in the prediction
    d = PredictionDrafter(PredictionIndex(ORIGINAL))
    assert d.draft(edited[:skip], skip, 3) == ORIGINAL[skip:skip + 3]  # (rejected)
    n = skip + 2
    assert d.draft(output_tail(edited[:n], [], 8), n, 5) == edited[n:n + 5]
    assert run.no_draft == [] and run.rejected_at == [skip]  # re-found at the next step


def test_realigns_after_a_replacement_of_the_same_length_at_the_next_token():
    original = lines("x = compute(a, b)")
    edited = lines("x = compute(c, b)")  # one token for one
    d = PredictionDrafter(PredictionIndex(original))
    at = len("x = compute(")
    assert d.draft(edited[:at], at, 3) == list(b"a, ")  # rejected at 'c'
    # 'c' is nowhere: nothing to draft; the next token alone re-aligns where it was expected
    assert d.draft(output_tail(edited[:at + 1], [], 8), at + 1, 3) == []
    assert d.draft(output_tail(edited[:at + 2], [], 8), at + 2, 3) == list(b" b)")
    run = simulate(original, edited)
    assert run.no_draft == [at + 1] and run.rejected_at == [at]  # one step without a draft
    # a longer replacement: re-found by a two-token suffix right after it
    original = lines("x = compute(alpha, beta)")
    edited = lines("x = compute(gamma, beta)")
    run = simulate(original, edited)
    assert run.no_draft and all(at < m <= at + len("gamma,") for m in run.no_draft)
    assert run.rejected_at == [at]


def test_a_single_token_aligns_only_where_it_was_expected():
    idx = PredictionIndex([7, 1, 2, 3, 9, 4, 5], min_match=2)
    assert idx.align([8, 3], whole=False) is None  # [8, 3] nowhere, [3] alone is not enough
    assert idx.align([8, 3], whole=False, expected=4) == 4  # ... unless it sits where expected
    assert idx.align([8, 3], whole=False, expected=5) is None


def test_repeated_lines_resolve_to_the_occurrence_nearest_the_expected_place():
    block = lines("    x += 1")
    pred = lines("a()") + block + lines("b()") + block + lines("c()")
    idx = PredictionIndex(pred)
    first = len(lines("a()")) + len(block)  # after the first copy
    second = first + len(lines("b()")) + len(block)
    tail = block[-8:]
    assert idx.align(tail, whole=False) == first  # no history: the earliest
    assert idx.align(tail, whole=False, expected=second - 1) == second
    assert idx.align(tail, whole=False, expected=first + 2) == first
    # a drafter remembers where it was: after the second "b()" the second copy is expected
    d = PredictionDrafter(idx)
    out = lines("a()") + block + lines("b()")
    assert d.draft(output_tail(out, [], 8), len(out), 2) == block[:2]
    out += block
    assert d.draft(output_tail(out, [], 8), len(out), 3) == lines("c()")[:3]


def test_nearest_prefers_the_later_on_ties():
    assert _nearest([2, 6], 4) == 6 and _nearest([2, 6], 3) == 2 and _nearest([2, 6], 9) == 6
    assert _nearest([2, 6], None) == 2 and _nearest([2, 6], 0) == 2


def test_output_tail_reads_only_the_end():
    assert output_tail([1, 2, 3], [4, 5], 3) == [3, 4, 5]
    assert output_tail([1, 2, 3], [4, 5, 6, 7], 3) == [5, 6, 7]
    assert output_tail([1], [], 4) == [1]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="min_match"):
        PredictionIndex([1], max_match=2, min_match=3)
    with pytest.raises(ValueError, match=">= 0"):
        PredictionIndex([1, -2])


def _brute_force(pred: list[int], tail: list[int], whole: bool, expected, max_match: int,
                 min_match: int):
    """The alignment by scanning every position (the index's reference)."""
    seq = [START, *pred]
    t = tail[-max_match:]
    if whole and len(t) < max_match:
        t = [START, *t]
    for n in range(len(t), min_match - 1, -1):
        key = t[-n:]
        ends = [a + n - 1 for a in range(len(seq) - n + 1) if seq[a:a + n] == key]
        if ends:
            if expected is None:
                return ends[0]
            return min(ends, key=lambda e: (abs(e - expected), -e))
    if expected is not None and 0 < expected <= len(pred) and t and pred[expected - 1] == t[-1]:
        return expected
    return None


@settings(max_examples=300, deadline=None)
@given(pred=st.lists(st.integers(0, 3), max_size=40),
       out=st.lists(st.integers(0, 3), min_size=1, max_size=12),
       expected=st.none() | st.integers(0, 40), max_match=st.integers(1, 5),
       min_match=st.integers(1, 5))
def test_index_equals_a_brute_force_search(pred, out, expected, max_match, min_match):
    if min_match > max_match:
        min_match, max_match = max_match, min_match
    idx = PredictionIndex(pred, max_match=max_match, min_match=min_match)
    expected = None if expected is None else min(expected, len(pred))
    for whole in (False, True):
        want = _brute_force(pred, out, whole, expected, max_match, min_match)
        assert idx.align(out, whole, expected) == want
