"""Proposer registry interface check and the n-gram proposer."""

import pytest

from specmesh.drafter.proposer import Proposer
from specmesh.drafter.registry import get_proposer, register_proposer, registered_methods
from specmesh.drafter.proposers.ngram import NgramProposer


def test_ngram_registered():
    assert "ngram" in registered_methods()
    assert get_proposer("ngram") is NgramProposer


def test_unknown_method_lists_known():
    with pytest.raises(KeyError, match="ngram"):
        get_proposer("nope")


def test_missing_method_is_type_error_at_registration():
    class Half(Proposer):
        name = "half"

        def open(self, request_id, context_token_ids):
            pass

        def propose(self, request_id, context_token_ids, num_tokens):
            return []

    with pytest.raises(TypeError, match="does not implement close, rollback"):
        register_proposer(Half)
    assert "half" not in registered_methods()


def test_wrong_arity_and_bad_declarations_are_type_errors():
    class Bad(NgramProposer):
        name = "bad-arity"

        def propose(self, request_id):  # noqa: D401
            return []

    with pytest.raises(TypeError, match="propose"):
        register_proposer(Bad)

    class Nameless(NgramProposer):
        name = ""

    with pytest.raises(TypeError, match="name"):
        register_proposer(Nameless)
    with pytest.raises(TypeError):
        register_proposer(int)


def test_duplicate_name_rejected():
    class Other(NgramProposer):
        name = "ngram"

    with pytest.raises(ValueError, match="'ngram' is built in .*cannot shadow"):
        register_proposer(Other)


def test_ngram_proposes_continuation_of_latest_match():
    p = NgramProposer(min_ngram=1, max_ngram=3)
    ctx = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert p.propose("r", ctx, 2) == [7, 8]  # most recent earlier match of [1,2,3]
    assert p.propose("r", [5, 6, 7], 3) == []
    assert p.propose("r", [5, 6, 5], 3) == [6, 5]
    assert p.propose("r", ctx, 0) == []
