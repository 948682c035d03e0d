"""Suffix decoding (drafter/proposers/suffix.py) on token lists: prompt lookup as a special
case, frequency scoring, the draft length adapted to the match, trees, rollback and close
leaving no trace, the history across requests under its token budget (oldest evicted first),
corpora loaded and dropped at run time, and the method's options."""

from __future__ import annotations

import itertools
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specmesh.cluster.drafter_option import drafter_help, parse_drafter
from specmesh.drafter.proposers.ngram import NgramProposer
from specmesh.drafter.proposers.suffix import SuffixProposer
from specmesh.drafter.registry import create_proposer, get_method


def suffix(**kw) -> SuffixProposer:
    return SuffixProposer(**kw)


def occurs(ctx: list[int], part: list[int]) -> bool:
    m = len(part)
    return any(ctx[j:j + m] == part for j in range(len(ctx) - m + 1))


# -- drafting ------------------------------------------------------------------------------


def test_a_suffix_seen_once_drafts_what_followed_it_as_prompt_lookup_does():
    ctx = [10, 11, 12, 13, 14, 15, 16, 17, 10, 11, 12]
    p = suffix(max_global_tokens=0, max_spec_factor=4.0)
    ngram = NgramProposer(min_ngram=1, max_ngram=4)
    assert p.propose("r", ctx, 5) == ngram.propose("r", ctx, 5) == [13, 14, 15, 16, 17]
    assert p.propose_tree("r", ctx, 5) == ([13, 14, 15, 16, 17], [-1, 0, 1, 2, 3])
    assert p.propose("q", [1, 2, 3, 4], 5) == []  # nothing repeats: no draft


@settings(max_examples=200, deadline=None)
@given(ctx=st.lists(st.integers(0, 4), min_size=2, max_size=60), n=st.integers(1, 8))
def test_with_no_history_a_prompt_lookup_match_always_gets_a_draft_copied_from_the_context(
        ctx, n):
    """Empty history and corpus, no probability floor and a wide length cap: wherever prompt
    lookup (min 1) drafts, suffix decoding drafts too, and its draft is a continuation found
    in the context (the last token followed by the draft occurs in it)."""
    p = suffix(max_global_tokens=0, min_token_prob=0.0, max_spec_factor=8.0, max_match=8,
               depth=17)
    got = p.propose("r", ctx, n)
    want = NgramProposer(min_ngram=1, max_ngram=8).propose("r", ctx, n)
    assert bool(got) == bool(want)
    assert len(got) <= n
    if got:
        assert occurs(ctx, [ctx[-1], *got])
    tokens, parents = p.propose_tree("r", ctx, n)
    assert tokens[:len(got)] == got  # branch 0 is the chain
    assert all(-1 <= q < j for j, q in enumerate(parents))


def test_the_most_frequent_continuation_wins_where_prompt_lookup_takes_the_latest():
    ctx = [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2]
    assert suffix(max_global_tokens=0).propose("r", ctx, 1) == [3]  # followed "1 2" twice
    assert NgramProposer(min_ngram=1).propose("r", ctx, 1) == [4]  # the latest match
    # equal counts: the latest continuation, as prompt lookup
    assert suffix(max_global_tokens=0).propose("r", [1, 2, 3, 1, 2, 4, 1, 2], 1) == [4]


def test_the_draft_length_follows_the_match_length_and_the_probability_floor():
    ctx = list(range(20, 30)) + [20, 21]  # a match of 2 tokens, seen once before
    assert suffix().propose("a", ctx, 8) == [22, 23]  # factor 1: 2 drafts for 2 matched
    assert suffix(max_spec_factor=2.0).propose("b", ctx, 8) == [22, 23, 24, 25]
    assert suffix(max_spec_offset=1.0).propose("c", ctx, 8) == [22, 23, 24]
    assert suffix(max_spec_factor=4.0).propose("d", ctx, 3) == [22, 23, 24]  # num_tokens
    assert suffix(max_spec_factor=0.0).propose("e", ctx, 8) == []
    # "5" was followed by 6, 7, 8 and 9 once each: probability 1/4 per continuation
    spread = [5, 6, 1, 5, 7, 2, 5, 8, 3, 5, 9, 4, 5]
    assert suffix(min_token_prob=0.3).propose("f", spread, 1) == []
    assert suffix(min_token_prob=0.25).propose("g", spread, 1) == [9]


def test_a_tree_holds_the_likely_other_continuations_best_first():
    # after "1 2": 3 twice, 4 once; after "1 2 3": 5 once, then 6 once (the latest)
    ctx = [1, 2, 3, 5, 0, 1, 2, 4, 7, 8, 1, 2, 3, 6, 9, 1, 2]
    p = suffix(max_global_tokens=0, tree_width=3, max_spec_factor=2.0)
    chain = p.propose("r", ctx, 3)
    assert chain == [3, 6, 9]  # p = 2/3, 1/3, 1/3
    # branches: 4 after "1 2" (p 1/3), then 5 after "1 2 3" (p 1/3), each grown to depth 3
    tokens, parents = p.propose_tree("r", ctx, 3)
    assert tokens == [3, 6, 9, 4, 7, 8, 5, 0]
    assert parents == [-1, 0, 1, -1, 3, 4, 0, 6]
    assert p.propose_tree("r", ctx, 2) == ([3, 6, 4, 7, 5], [-1, 0, -1, 2, 0])
    two = suffix(max_global_tokens=0, tree_width=2, max_spec_factor=2.0)
    assert two.propose_tree("r", ctx, 3) == ([3, 6, 9, 4, 7, 8], [-1, 0, 1, -1, 3, 4])
    floor = suffix(max_global_tokens=0, tree_width=3, max_spec_factor=2.0, min_token_prob=0.5)
    assert floor.propose_tree("r", ctx, 3) == ([3], [-1])  # 1/3 is below the floor
    narrow = suffix(max_global_tokens=0, tree_width=1, max_spec_factor=2.0)
    assert narrow.propose_tree("r", ctx, 3) == (chain, [-1, 0, 1])
    assert p.propose_tree("r", ctx, 0) == ([], [])


def _depths(parents):
    d = []
    for q in parents:
        d.append(1 if q < 0 else d[q] + 1)
    return d


# -- a request's own index -----------------------------------------------------------------


def test_rollback_and_close_leave_no_trace():
    prompt = [7, 1, 2, 3, 4, 9, 1, 2]
    p = suffix(max_global_tokens=0)
    p.open("r", prompt)
    assert p.propose("r", prompt, 2) == [3, 4]
    # the worker runs ahead on drafts, then a commit disagrees: rolled back to the prompt
    p.propose("r", prompt + [3, 4, 9, 1], 2)
    p.rollback("r", len(prompt))
    fresh = suffix(max_global_tokens=0)
    fresh.open("r", prompt)
    for ctx in (prompt, prompt + [5], prompt + [5, 1, 2]):
        assert p.propose("r", ctx, 4) == fresh.propose("r", ctx, 4)
    held = p._requests["r"].trie
    assert list(held.tokens(0)) == prompt + [5, 1, 2]
    p.close("r")
    p.close("r")  # twice: no-op
    assert p._requests == {} and p.index_stats()["history_tokens"] == 0


@settings(max_examples=60, deadline=None)
@given(prompt=st.lists(st.integers(0, 3), max_size=20),
       steps=st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=5), st.integers(0, 5)),
                      max_size=8))
def test_the_request_index_always_equals_one_built_from_its_context(prompt, steps):
    """Contexts that grow by drafts and shrink by rollbacks, as the worker drives them: every
    draft equals a fresh proposer's for the same context."""
    p = suffix(max_global_tokens=0, depth=6, max_match=4)
    p.open("r", prompt)
    ctx = list(prompt)
    for grow, cut in steps:
        ctx += grow
        fresh = suffix(max_global_tokens=0, depth=6, max_match=4)
        assert p.propose("r", ctx, 3) == fresh.propose("x", ctx, 3)
        keep = max(len(ctx) - cut, 0)
        p.rollback("r", keep)
        del ctx[keep:]
        assert list(p._requests["r"].trie.tokens(0)) == ctx


def test_a_context_off_the_contract_is_reindexed():
    p = suffix(max_global_tokens=0)
    p.open("r", [1, 2, 3, 1, 2])
    assert p.propose("r", [1, 2, 3, 1, 2], 1) == [3]
    # another context of another length, no rollback in between
    assert p.propose("r", [4, 5, 6, 4, 5], 1) == [6]
    assert list(p._requests["r"].trie.tokens(0)) == [4, 5, 6, 4, 5]


# -- history across requests ---------------------------------------------------------------


def _serve(p: SuffixProposer, rid: str, prompt: list[int], output: list[int]) -> None:
    """A request as the worker drives it: opened with the prompt and its first token,
    drafted for at each committed token, closed."""
    p.open(rid, prompt + output[:1])
    for i in range(1, len(output) + 1):
        p.propose(rid, prompt + output[:i], 2)
    p.close(rid)


def test_a_second_request_drafts_from_the_first_ones_output():
    out = [40, 41, 42, 43, 44, 45, 46, 47]
    p = suffix()
    _serve(p, "a", [1, 2, 3], out)
    assert p.index_stats()["history_tokens"] == len(out) - 1  # what came after the open
    ctx = [9, 9, 9] + out[:4]  # another prompt, the same output so far
    assert p.propose("b", ctx, 4) == out[4:7]  # matched 41 42 43 (40 came with the open)
    assert p.index_stats()["num_draft_tokens"]["history"] == 3
    off = suffix(max_global_tokens=0)
    _serve(off, "a", [1, 2, 3], out)
    assert off.propose("b", ctx, 4) == []
    p.clear_history()
    assert p.propose("c", ctx, 4) == [] and p.index_stats()["history_tokens"] == 0
    # a request open at the clear stays out of the history; one opened after joins it
    p.open("d", [1, 2, 3])
    p.clear_history()
    _serve(p, "e", [4], out)
    p.propose("d", [1, 2, 3] + out, 1)
    p.close("d")
    assert p.index_stats()["history_requests"] == 1


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(1, 30),
       outputs=st.lists(st.lists(st.integers(0, 5), min_size=2, max_size=16), max_size=10))
def test_the_history_keeps_its_token_budget_evicting_the_oldest_first(budget, outputs):
    p = suffix(max_global_tokens=budget, depth=4, max_match=2)
    kept: list[list[int]] = []
    for i, out in enumerate(outputs):
        _serve(p, f"r{i}", [99], out)
        new = out[1:][:budget]  # after the open; an output above the budget keeps its start
        while kept and sum(map(len, kept)) + len(new) > budget:
            kept.pop(0)
        kept.append(new)
        history = p._history
        assert history.num_tokens <= budget
        assert [list(history.tokens(k)) for k in history.keys()] == kept
        assert p._requests == {}


# -- corpora --------------------------------------------------------------------------------


def test_a_loaded_corpus_is_drafted_from_until_dropped():
    passage = list(range(100, 140))
    p = suffix(max_spec_factor=2.0)
    ctx = [5, 6] + passage[10:14]
    assert p.propose("r", ctx, 6) == []
    p.load_corpus("docs", passage)
    assert p.corpora() == {"docs": 40}
    assert p.propose("r", ctx, 6) == passage[14:20]
    assert p.index_stats()["num_draft_tokens"]["corpus"] == 6
    p.clear_history()  # corpora stay
    assert p.propose("r", ctx, 6) == passage[14:20]
    assert p.drop_corpus("docs") is True
    assert p.drop_corpus("docs") is False
    assert p.propose("r", ctx, 6) == [] and p.index_stats()["corpus_tokens"] == 0


def test_a_load_replaces_a_corpus_of_the_same_name():
    passage = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4] * 40
    whole, replaced = suffix(), suffix()
    whole.load_corpus("pi", passage)
    replaced.load_corpus("pi", [7, 7, 7, 2, 2, 2] * 50)
    replaced.load_corpus("pi", passage)
    assert list(replaced._corpus.tokens("pi")) == passage
    assert replaced.corpora() == {"pi": len(passage)}
    for m in range(1, 5):
        for pattern in itertools.product(range(1, 10), repeat=m):
            w, c = whole._corpus.find(pattern), replaced._corpus.find(pattern)
            assert (w is None) == (c is None)
            if w is not None:
                assert whole._corpus.count(w) == replaced._corpus.count(c)


def test_corpus_loads_are_checked_and_bounded():
    p = suffix(max_corpus_tokens=10)
    p.load_corpus("a", [1] * 6)
    with pytest.raises(ValueError, match=r"corpus 'b': 5 tokens would take the corpora to 11, "
                                         r"above their budget of 10"):
        p.load_corpus("b", [2] * 5)
    assert p.corpora() == {"a": 6}  # nothing of the refused load
    with pytest.raises(ValueError, match="token ids must be >= 0"):
        p.load_corpus("c", [1, -1])
    with pytest.raises(ValueError, match="token ids must be integers"):
        p.load_corpus("c", [1, "x"])
    with pytest.raises(ValueError, match="corpus name is empty"):
        p.load_corpus("", [1])
    with pytest.raises(TypeError, match="corpus name must be a string"):
        p.load_corpus(3, [1])
    with pytest.raises(ValueError, match="budget of 0"):
        suffix(max_corpus_tokens=0).load_corpus("a", [1])


def test_a_corpus_loads_on_another_thread_while_drafting_goes_on():
    passage = [(i * 7919) % 501 for i in range(6000)]
    p = suffix(max_corpus_tokens=10_000)
    errors: list[BaseException] = []

    def load():
        try:
            p.load_corpus("big", passage)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    t = threading.Thread(target=load)
    t.start()
    ctx = [1, 2] + passage[3000:3004]
    while t.is_alive():
        p.propose("r", ctx, 4)
    t.join()
    assert not errors
    assert p.propose("r", ctx, 4) == passage[3004:3008]
    assert p.corpora() == {"big": 6000}


# -- the method ----------------------------------------------------------------------------


def test_the_method_is_registered_with_its_options_and_help():
    assert get_method("suffix") is SuffixProposer
    assert parse_drafter("suffix") == ("suffix", {})
    kwargs = parse_drafter("suffix:depth=32+match=8+factor=2+offset=1+prob=0.2+global=100"
                           "+corpus=50+width=3")[1]
    assert kwargs == {"depth": 32, "max_match": 8, "max_spec_factor": 2.0, "max_spec_offset": 1.0,
                      "min_token_prob": 0.2, "max_global_tokens": 100, "max_corpus_tokens": 50,
                      "tree_width": 3}
    p = create_proposer("suffix", kwargs)
    assert (p.depth, p.max_match, p.tree_width, p.max_global_tokens) == (32, 8, 3, 100)
    text = drafter_help()
    assert "suffix: suffix decoding" in text
    assert "global: tokens of finished requests' outputs" in text


@pytest.mark.parametrize("bad, why", [
    ("suffix:match=24", r"match \(24\) must be below depth \(24\)"),
    ("suffix:depth=8", r"match \(16\) must be below depth \(8\)"),
    ("suffix:prob=1.5", r"prob must be number in \[0.0, 1.0\]"),
    ("suffix:global=-1", "global must be integer >= 0"),
    ("suffix:width=0", "width must be integer >= 1"),
    ("suffix:size=3", "unknown key 'size'"),
])
def test_bad_options_are_refused_naming_the_key(bad, why):
    with pytest.raises(SystemExit, match=why):
        parse_drafter(bad)


def test_the_constructor_refuses_what_the_schema_refuses():
    for kw in ({"depth": 1}, {"max_match": 0}, {"max_match": 24}, {"min_token_prob": -0.1},
               {"max_spec_factor": -1.0}, {"max_global_tokens": -1}, {"tree_width": 0}):
        with pytest.raises(ValueError):
            SuffixProposer(**kw)
