"""The suffix trie of suffix decoding (drafter/suffix_trie.py) against a brute-force count on
random token streams: after any mix of appends, truncations (rolled-back drafts) and whole
removals, every string of at most ``depth`` tokens has the count of its occurrences and the
followers it has in the sequences held, the active points are the cursors of each sequence's
suffixes, and nothing is left behind."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specmesh.drafter.suffix_trie import SuffixTrie

ALPHABET = 3  # few symbols: many repeats, many expansions and merges of counts


def occurrences(seqs: dict, pattern: tuple) -> int:
    m = len(pattern)
    return sum(1 for s in seqs.values() for j in range(len(s) - m + 1)
               if tuple(s[j:j + m]) == pattern)


def followers(seqs: dict, pattern: tuple, depth: int) -> dict[int, int]:
    m = len(pattern)
    out: dict[int, int] = {}
    if m >= depth:
        return out
    for s in seqs.values():
        for j in range(len(s) - m):
            if tuple(s[j:j + m]) == pattern:
                out[s[j + m]] = out.get(s[j + m], 0) + 1
    return out


def check(trie: SuffixTrie, seqs: dict) -> None:
    """Counts and followers of every string over the alphabet, active points, totals and the
    node invariants equal the reference's."""
    depth = trie.depth
    assert trie.num_tokens == sum(len(s) for s in seqs.values())
    assert set(trie._seqs) == set(seqs) and len(trie) == len(seqs)
    for key, s in seqs.items():
        assert list(trie.tokens(key)) == s
    for m in range(1, depth + 1):
        for pattern in itertools.product(range(ALPHABET), repeat=m):
            want = occurrences(seqs, pattern)
            cur = trie.find(pattern)
            assert (0 if cur is None else trie.count(cur)) == want, pattern
            if cur is None:
                continue
            assert trie.depth_of(cur) == m
            got = {tok: n for tok, _, n in trie.children(cur)}
            assert got == followers(seqs, pattern, depth), pattern
            kids = trie.children(cur)
            top = trie.top_child(cur)
            if not kids:
                assert top is None
            else:  # the most frequent follower (children() breaks ties the same way)
                assert top[0] == kids[0][0] and top[2] == max(n for _, _, n in kids)
    for key, s in seqs.items():  # active points: the suffixes' cursors, shortest first
        cursors = trie.suffixes(key)
        assert len(cursors) == min(depth, len(s))
        for m, cur in enumerate(cursors, 1):
            assert trie.depth_of(cur) == m and trie.count(cur) == occurrences(
                seqs, tuple(s[-m:]))
            assert trie.find(s[-m:]) == cur
    _check_nodes(trie)


def _check_nodes(trie: SuffixTrie) -> None:
    """No node without occurrences; counts bound their children's; leaves occur once."""
    stack = [trie._root]
    while stack:
        node = stack.pop()
        if node.kids is None:
            assert node.count == 1 and node.seq is not None
            continue
        assert sum(c.count for c in node.kids.values()) <= node.count or node is trie._root
        for tok, c in node.kids.items():
            assert c.count >= 1 and c.token == tok and c.parent is node
            assert c.depth == node.depth + 1 <= trie.depth
            stack.append(c)


OPS = st.lists(st.one_of(
    st.tuples(st.just("extend"), st.integers(0, 2),
              st.lists(st.integers(0, ALPHABET - 1), max_size=12)),
    st.tuples(st.just("truncate"), st.integers(0, 2), st.integers(0, 12)),
    st.tuples(st.just("discard"), st.integers(0, 2), st.just(0)),
), max_size=14)


@settings(max_examples=150, deadline=None)
@given(depth=st.integers(1, 4), ops=OPS)
def test_counts_followers_and_active_points_match_brute_force(depth, ops):
    trie = SuffixTrie(depth)
    seqs: dict[int, list[int]] = {}
    for op, key, arg in ops:
        if op == "extend":
            trie.extend(key, arg)
            seqs.setdefault(key, []).extend(arg)
        elif op == "truncate" and key in seqs:
            trie.truncate(key, arg)
            del seqs[key][arg:]
        elif op == "discard":
            assert trie.discard(key) == len(seqs.pop(key, []))
        check(trie, seqs)


@settings(max_examples=60, deadline=None)
@given(depth=st.integers(1, 4), stream=st.lists(st.integers(0, ALPHABET - 1), max_size=40),
       cuts=st.lists(st.tuples(st.integers(0, 40), st.lists(st.integers(0, ALPHABET - 1),
                                                            max_size=6)), max_size=6))
def test_rolled_back_drafts_leave_no_trace(depth, stream, cuts):
    """Appending drafts and truncating them away leaves the trie equal to one built from the
    kept tokens alone (what the per-request tree does at every rejected draft)."""
    trie = SuffixTrie(depth, undo=64)
    trie.extend("r", stream)
    for keep, drafts in cuts:
        keep = min(keep, len(trie.tokens("r")))
        trie.truncate("r", keep)
        trie.extend("r", drafts)
    kept = list(trie.tokens("r"))
    fresh = SuffixTrie(depth)
    fresh.extend("r", kept)
    check(trie, {"r": kept})
    assert _shape(trie._root, depth) == _shape(fresh._root, depth)


def _shape(node, depth):
    """The counted trie a root stands for, expanded (leaf compression may differ in where a
    chain is cut, never in what it counts), with each node's followers in tie-break order."""
    out = {}
    stack = [((), node, 0)]
    while stack:
        path, n, k = stack.pop()
        if n.kids is None:
            nxt = n.end + k + 1
            grows = bool(path) and len(path) < depth and nxt < len(n.seq)
            if path:
                out[path] = (1 if k else n.count, (n.seq[nxt],) if grows else ())
            if grows:
                stack.append((path + (n.seq[nxt],), n, k + 1))
            continue
        kids = sorted(n.kids.values(), key=lambda c: (c.count, c.stamp), reverse=True)
        out[path] = (n.count, tuple(c.token for c in kids))
        for c in kids:
            stack.append((path + (c.token,), c, 0))
    return out


def test_removal_in_steps_is_consistent_between_steps():
    trie = SuffixTrie(3)
    trie.extend("a", [0, 1, 2, 0, 1, 2, 0, 1])
    trie.extend("b", [1, 2, 0])
    steps = trie.discard_steps("a", starts_per_step=3)
    assert next(steps) == 5 and "a" not in trie
    # starts 0..2 of "a" are gone; its suffixes from 3 on and "b" remain
    check_partial = {"a3": [0, 1, 2, 0, 1], "b": [1, 2, 0]}
    for m in range(1, 4):
        for pattern in itertools.product(range(ALPHABET), repeat=m):
            cur = trie.find(pattern)
            want = occurrences(check_partial, pattern)
            assert (0 if cur is None else trie.count(cur)) == want
    assert list(steps) == [2, 0]
    check(trie, {"b": [1, 2, 0]})
    for _ in trie.discard_steps("nope"):
        raise AssertionError("nothing to remove")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="depth must be >= 1"):
        SuffixTrie(0)
    with pytest.raises(ValueError, match="undo must be >= 0"):
        SuffixTrie(2, undo=-1)
    trie = SuffixTrie(2)
    trie.extend("a", [1, 2])
    with pytest.raises(ValueError, match="length must be >= 0"):
        trie.truncate("a", -1)
    with pytest.raises(KeyError):
        trie.truncate("b", 0)
    assert trie.find([1, 2, 3]) is None  # longer than the depth
    assert trie.count(trie.find([])) == 2  # the root: every start position
