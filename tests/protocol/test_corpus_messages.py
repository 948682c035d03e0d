"""The corpus control messages (DrafterCorpus, DrafterCorpusRelayed, DrafterCorpusResult):
round trips of valid operations and a ProtocolError, naming the rule broken, for each malformed
one (the generic checks of tests/protocol/test_codec.py cover them too: types, bounds, missing
fields, fuzzing)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specmesh.protocol.codec import decode, encode
from specmesh.protocol.cross_checks import MAX_CORPUS_CHUNKS, corpus_name_error
from specmesh.protocol.errors import ProtocolError
from specmesh.protocol.messages import (
    CORPUS_CHUNK_TOKENS,
    MAX_CORPUS_NAME_LEN,
    DrafterCorpus,
    DrafterCorpusRelayed,
    DrafterCorpusResult,
)

_names = st.text(alphabet="abcXYZ019._-", min_size=1, max_size=MAX_CORPUS_NAME_LEN)


@st.composite
def _operations(draw: st.DrawFn) -> DrafterCorpus:
    op = draw(st.sampled_from(["load", "drop", "clear_history"]))
    op_id = draw(st.integers(0, 2**63 - 1))
    if op == "clear_history":
        return DrafterCorpus(op=op, op_id=op_id, name="", token_ids=[])
    if op == "drop":
        return DrafterCorpus(op=op, op_id=op_id, name=draw(_names), token_ids=[])
    num_chunks = draw(st.integers(1, MAX_CORPUS_CHUNKS))
    return DrafterCorpus(op=op, op_id=op_id, name=draw(_names),
                         token_ids=draw(st.lists(st.integers(0, 2**31 - 1), min_size=1,
                                                 max_size=64)),
                         chunk_index=draw(st.integers(0, num_chunks - 1)),
                         num_chunks=num_chunks)


@settings(max_examples=200, deadline=None)
@given(_operations())
def test_valid_operations_round_trip(msg: DrafterCorpus) -> None:
    assert decode(encode(msg)) == msg


def test_a_full_chunk_round_trips() -> None:
    msg = DrafterCorpus(op="load", op_id=1, name="big", token_ids=list(range(
        CORPUS_CHUNK_TOKENS)), chunk_index=3, num_chunks=4)
    assert decode(encode(msg)) == msg


def _header(msg: object) -> dict:
    return msgspec.msgpack.decode(encode(msg)[0])


def _rejects(body: dict) -> str:
    with pytest.raises(ProtocolError) as info:
        decode([msgspec.msgpack.encode(body)])
    return str(info.value)


LOAD = _header(DrafterCorpus.example())


@pytest.mark.parametrize("change,why", [
    ({"op": "append"}, "unknown corpus op 'append'"),
    ({"name": ""}, "non-empty"),
    ({"name": "a/b"}, "may only hold"),
    ({"name": "x" * (MAX_CORPUS_NAME_LEN + 1)}, f"at most {MAX_CORPUS_NAME_LEN}"),
    ({"chunk_index": 2, "num_chunks": 2}, "chunk_index 2 >= num_chunks 2"),
    ({"num_chunks": 0}, "DrafterCorpus.num_chunks"),
    ({"num_chunks": MAX_CORPUS_CHUNKS + 1}, "chunks: a corpus has at most"),
    ({"token_ids": []}, "an empty load chunk"),
    ({"token_ids": [0] * (CORPUS_CHUNK_TOKENS + 1)}, "CORPUS_CHUNK_TOKENS"),
    ({"token_ids": [1, -1]}, "DrafterCorpus.token_ids"),
    ({"op_id": -1}, "DrafterCorpus.op_id"),
    ({"op": "drop"}, "a drop carries no token ids"),
    ({"op": "drop", "token_ids": [], "num_chunks": 2}, "a drop carries no token ids"),
    ({"op": "clear_history", "token_ids": []}, "clear_history names no corpus"),
    ({"op": "clear_history", "name": "", "token_ids": [5]}, "a clear_history carries no"),
    ({"op": 3}, "DrafterCorpus.op"),
], ids=lambda v: None if isinstance(v, dict) else v)
def test_malformed_operations_are_protocol_errors(change: dict, why: str) -> None:
    assert why in _rejects({**LOAD, **change})


def test_malformed_results_and_relays_are_protocol_errors() -> None:
    result = _header(DrafterCorpusResult.example())
    assert "unknown corpus status 'done'" in _rejects({**result, "status": "done"})
    assert "unknown corpus op" in _rejects({**result, "op": "fetch"})
    assert "DrafterCorpusResult.num_tokens" in _rejects({**result, "num_tokens": -4})
    assert "DrafterCorpusResult.drafter" in _rejects({**result, "drafter": None})
    relay = _header(DrafterCorpusRelayed.example())
    assert "may only hold" in _rejects({**relay, "name": "docs v2"})
    assert "DrafterCorpusRelayed.drafters" in _rejects({**relay, "drafters": [1]})
    assert decode([msgspec.msgpack.encode({**relay, "op": "clear_history", "name": ""})]).op \
        == "clear_history"


def test_corpus_name_rule() -> None:
    assert corpus_name_error("docs-v2.1_x") == ""
    for bad in ("", "docs v2", "é", "a" * (MAX_CORPUS_NAME_LEN + 1), None, 3):
        assert corpus_name_error(bad), bad
