"""The n-gram drafter's corpora (drafter/corpus_index.py, drafter/proposers/ngram.py): a loaded
corpus supplies drafts for a context that does not contain the passage, matches are checked
against a brute-force search, a query looks at a bounded number of occurrences whatever the
corpus size, drop forgets the corpus, and drafts without corpora are the same as before."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import specmesh.drafter.proposers  # noqa: F401
from helpers.proposers import NullProposer
from specmesh.drafter import corpus_index
from specmesh.drafter.corpus_index import MAX_CANDIDATES, CorpusIndex
from specmesh.drafter.proposer import CorpusUnsupported
from specmesh.drafter.proposers.ngram import LONG_KEY, NgramProposer

rng = random.Random(11)
#: a passage of distinct tokens (no n-gram of it repeats) inside random text
PASSAGE = list(range(1000, 1040))
CORPUS = [rng.randrange(500) for _ in range(300)] + PASSAGE + [rng.randrange(500)
                                                               for _ in range(300)]
#: a context that ends with the first tokens of the passage and does not contain the rest
PROMPT = [3000 + i for i in range(20)]


def test_a_corpus_passage_becomes_the_draft():
    p = NgramProposer()
    ctx = PROMPT + PASSAGE[:3]
    assert p.propose("r", ctx, 8) == []  # nothing in the context to copy
    p.load_corpus("docs", CORPUS)
    assert p.propose("r", ctx, 8) == PASSAGE[3:11]
    assert p.propose("r", PROMPT + PASSAGE[:30], 20) == CORPUS[330:350]  # on past it
    assert p.propose("r", PROMPT + CORPUS[-3:], 5) == []  # the corpus's end: nothing follows
    assert p.corpora() == {"docs": len(CORPUS)}
    assert p.num_corpus_draft_tokens == 8 + 20 and p.num_draft_tokens_proposed == 28


def test_drop_forgets_the_corpus_and_unknown_names_say_so():
    p = NgramProposer()
    p.load_corpus("docs", CORPUS)
    p.load_corpus("more", [7, 8, 9, 10])
    assert p.drop_corpus("docs") is True
    assert p.propose("r", PROMPT + PASSAGE[:3], 8) == []
    assert p.propose("r", [1, 7, 8], 4) == [9, 10]  # the other corpus stays
    assert p.drop_corpus("docs") is False
    assert p.drop_corpus("more") is True and p.corpora() == {}
    assert p.propose("r", [1, 7, 8], 4) == []


def test_load_under_a_name_replaces_it():
    p = NgramProposer()
    p.load_corpus("docs", [1, 2, 3, 4])
    p.load_corpus("docs", [1, 2, 5, 6])
    assert p.propose("r", [9, 1, 2], 2) == [5, 6] and p.corpora() == {"docs": 4}


def test_the_context_comes_first_at_one_length_and_longer_matches_first():
    p = NgramProposer(min_ngram=2, max_ngram=3, tree_width=1)
    p.load_corpus("docs", [5, 6, 7, 8, 9])
    # [6, 7] is in the context (followed by 1) and in the corpus (followed by 8): the context
    assert p.propose("r", [6, 7, 1, 2, 6, 7], 2) == [1, 2]
    # [5, 6, 7] matches only in the corpus: a longer suffix wins over the context's [6, 7]
    assert p.propose("r", [6, 7, 1, 2, 5, 6, 7], 2) == [8, 9]


def test_a_long_match_picks_the_passage_among_many_short_ones():
    """The key ``[1, 2, 3, 4]`` occurs many times; the context's last LONG_KEY tokens occur
    once, and that occurrence's continuation is the draft."""
    filler = []
    for i in range(50):
        filler += [1, 2, 3, 4, 500 + i]
    head = list(range(2000, 2000 + LONG_KEY - 4))
    passage = head + [1, 2, 3, 4, 77, 78, 79]
    p = NgramProposer()
    p.load_corpus("docs", filler + passage + filler)
    assert p.propose("r", [9] + head + [1, 2, 3, 4], 3) == [77, 78, 79]


def test_corpora_never_join_and_trees_take_corpus_branches():
    p = NgramProposer(min_ngram=2, max_ngram=2, tree_width=3)
    p.load_corpus("a", [1, 2, 3])
    p.load_corpus("b", [4, 5, 6])
    assert p.propose("r", [9, 2, 3], 4) == []  # [2, 3] ends corpus a: nothing follows it
    p.load_corpus("c", [7, 1, 2, 8, 8])
    tokens, parents = p.propose_tree("r", [0, 1, 2, 9, 0, 1, 2], 2)
    # the context's own match ([1, 2] -> 9, 0) first, then the corpora's, earliest first
    assert tokens == [9, 0, 3, 8, 8] and parents == [-1, 0, -1, -1, 3]


def test_no_corpus_no_change():
    """Without corpora the n-gram drafts are exactly those of prompt lookup."""
    p, q = NgramProposer(min_ngram=1, max_ngram=3, tree_width=3), NgramProposer(
        min_ngram=1, max_ngram=3, tree_width=3)
    q.load_corpus("x", [1])
    assert q.drop_corpus("x")
    for _ in range(200):
        ctx = [rng.randrange(6) for _ in range(rng.randrange(1, 30))]
        assert p.propose("r", ctx, 4) == q.propose("r", ctx, 4) == _reference(ctx, 1, 3, 4)
        assert p.propose_tree("r", ctx, 3) == q.propose_tree("r", ctx, 3)


def _reference(ctx, lo, hi, k):
    """Prompt lookup by brute force: the longest suffix's most recent earlier occurrence."""
    for n in range(min(hi, len(ctx) - 1), lo - 1, -1):
        for s in range(len(ctx) - n - 1, -1, -1):
            if ctx[s:s + n] == ctx[-n:] and ctx[s + n:s + n + k]:
                return ctx[s + n:s + n + k]
    return []


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=40), min_size=1, max_size=3),
       st.lists(st.integers(0, 4), min_size=1, max_size=12), st.integers(1, 4),
       st.integers(1, 5))
def test_index_matches_a_brute_force_search(corpora, ctx, n, k):
    """Every continuation the index returns follows a real occurrence of the key in one corpus
    and never crosses into another; with few occurrences (at most MAX_CANDIDATES) it finds
    one exactly when the brute force does, the longest agreement with the context first."""
    index = CorpusIndex({f"c{i}": c for i, c in enumerate(corpora)}, [n])
    got = index.continuations(ctx, n, k, limit=1)
    want = []  # (agreement, corpus, start) of every occurrence with a continuation
    if len(ctx) >= n:
        for ci, c in enumerate(corpora):
            for s in range(len(c) - n):
                if c[s:s + n] == ctx[-n:]:
                    agree = 0
                    while agree < index.max_extend and s - 1 - agree >= 0 and \
                            len(ctx) - n - 1 - agree >= 0 and \
                            c[s - 1 - agree] == ctx[len(ctx) - n - 1 - agree]:
                        agree += 1
                    want.append((agree, ci, s))
    conts = {tuple(corpora[ci][s + n:s + n + k]) for _, ci, s in want}
    assert all(tuple(g) in conts for g in got)
    if len(want) <= MAX_CANDIDATES:
        assert bool(got) == bool(want)
        if want:
            best = max(a for a, _, _ in want)
            assert tuple(got[0]) in {tuple(corpora[ci][s + n:s + n + k])
                                     for a, ci, s in want if a == best}


def test_a_query_checks_a_bounded_number_of_occurrences(monkeypatch):
    """A key that occurs 20,000 times costs MAX_CANDIDATES checks, not a scan."""
    checked = []
    real = CorpusIndex._agreement
    monkeypatch.setattr(CorpusIndex, "_agreement",
                        lambda self, ctx, n, s: checked.append(s) or real(self, ctx, n, s))
    index = CorpusIndex({"big": [1, 2, 3] * 20_000}, [2])
    assert index.continuations([5, 1, 2], 2, 3, limit=4) == [[3, 1, 2]]
    assert len(checked) == MAX_CANDIDATES


def test_bad_token_ids_are_refused_and_leave_the_corpora_alone():
    p = NgramProposer()
    p.load_corpus("docs", [1, 2, 3])
    for bad in ([1, -2], [1, 2**31], [1, "x"]):
        with pytest.raises(ValueError):
            p.load_corpus("docs", bad)
    assert p.corpora() == {"docs": 3} and p.propose("r", [1, 2], 1) == [3]
    with pytest.raises(ValueError):
        CorpusIndex({"a": [1, 2]}, [0])


class _Plain(NullProposer):
    name = "plain-corpus-test"


def test_a_method_without_memory_refuses_corpora_and_has_no_history():
    p = _Plain()
    assert not p.supports_corpus and NgramProposer.supports_corpus
    with pytest.raises(CorpusUnsupported, match="plain-corpus-test"):
        p.load_corpus("docs", [1, 2])
    with pytest.raises(CorpusUnsupported):
        p.drop_corpus("docs")
    p.clear_history()  # nothing to forget


def test_drafting_goes_on_while_a_corpus_is_indexed():
    """load_corpus on another thread while propose runs: every draft is either the one
    without the corpus or the one with it, never a half-built index's."""
    p = NgramProposer()
    big = [rng.randrange(40_000) for _ in range(200_000)] + PASSAGE
    ctx = PROMPT + PASSAGE[:3]
    seen = set()
    t = threading.Thread(target=p.load_corpus, args=("big", big))
    t.start()
    while t.is_alive():
        seen.add(tuple(p.propose("r", ctx, 4)))
    t.join()
    seen.add(tuple(p.propose("r", ctx, 4)))
    assert seen <= {(), tuple(PASSAGE[3:7])} and tuple(PASSAGE[3:7]) in seen


def test_key_hash_is_the_tables_hash():
    index = CorpusIndex({"a": [0, 5, 9, 0, 5]}, [2])
    hashes, starts = index._tables[2]
    for h, s in zip(hashes.tolist(), starts.tolist()):
        assert h == corpus_index._key_hash(index.tokens[s:s + 2])
