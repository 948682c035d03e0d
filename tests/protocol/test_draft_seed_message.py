"""DraftSeed (protocol 21): it round-trips nested in PrefillDone and DraftSync beside the
target seed state (three buffers in one message), its byte count, and the receivers' check
``draft_seed_error`` (never the codec's: a bad seed must not fail the message carrying it)."""

from __future__ import annotations

import math

import msgspec
import pytest

from specmesh.protocol.codec import decode, encode
from specmesh.protocol.cross_checks import draft_seed_error
from specmesh.protocol.messages import (
    MAX_DRAFT_SEED_TOPK,
    PROTOCOL_VERSION,
    Buffer,
    DraftSeed,
    DraftSync,
    PrefillDone,
)

replace = msgspec.structs.replace


def test_protocol_version_is_21():
    assert PROTOCOL_VERSION >= 21


def _seed(**kw) -> DraftSeed:
    base = dict(position=4, token_id=9, topk_ids=[9, 3, 5], topk_probs=[0.5, 0.25, 0.125],
                draft_hidden=Buffer("float32", (1, 8), bytes(range(32))),
                draft_kv=Buffer("float32", (2, 2, 1, 1, 4), bytes(64)))
    return DraftSeed(**{**base, **kw})


@pytest.mark.parametrize("cls", [PrefillDone, DraftSync])
def test_draft_seed_round_trips_nested_beside_the_seed_state(cls):
    msg = replace(cls.example(), draft_seed=_seed(),
                  seed_state=Buffer("float32", (1, 8), bytes(32)))
    frames = encode(msg)
    assert len(frames) == 4  # header + seed_state + draft_hidden + draft_kv
    back = decode([bytes(f) for f in frames])
    assert back == msg
    assert back.draft_seed.draft_hidden == msg.draft_seed.draft_hidden


def test_nbytes_counts_buffers_and_topk():
    s = _seed()
    assert s.nbytes == 32 + 64 + 8 * 6


def test_a_malformed_seed_still_decodes():
    # the codec passes it on: the receiver drops the seed, not the message
    bad = _seed(topk_ids=[-1] * 20, topk_probs=[math.nan])
    back = decode([bytes(f) for f in encode(replace(PrefillDone.example(), seed_state=None,
                                                    draft_seed=bad))])
    assert back.draft_seed.topk_ids == bad.topk_ids and math.isnan(back.draft_seed.topk_probs[0])
    assert draft_seed_error(back.draft_seed)


@pytest.mark.parametrize("kw, why", [
    ({"topk_probs": [0.5, 0.25]}, "probabilities"),
    ({"topk_ids": list(range(MAX_DRAFT_SEED_TOPK + 1)),
      "topk_probs": [0.01] * (MAX_DRAFT_SEED_TOPK + 1)}, "top-k entries"),
    ({"topk_ids": [], "topk_probs": []}, "top-k entries"),
    ({"topk_ids": [9, 3, 50]}, "outside"),
    ({"token_id": 50}, "outside"),
    ({"topk_ids": [9, 9, 5]}, "repeated"),
    ({"topk_probs": [0.5, math.nan, 0.1]}, "[0, 1]"),
    ({"topk_probs": [0.5, 1.5, 0.1]}, "[0, 1]"),
    ({"topk_probs": [0.1, 0.25, 0.125]}, "likeliest"),
    ({"draft_hidden": Buffer("int32", (1, 8), bytes(32))}, "draft_hidden"),
    ({"draft_hidden": Buffer("float32", (2, 4), bytes(32))}, "draft_hidden"),
    ({"draft_kv": Buffer("float16", (2, 2, 1, 1, 4), bytes(32))}, "draft_kv"),
    ({"draft_kv": Buffer("float32", (2, 3, 1, 1, 4), bytes(96))}, "draft_kv"),
    ({"draft_kv": Buffer("float32", (2, 2, 1, 4), bytes(64))}, "draft_kv"),
])
def test_draft_seed_error_names_the_fault(kw, why):
    assert why in draft_seed_error(_seed(**kw), vocab_size=20)


def test_draft_seed_error_position_and_token():
    s = _seed()
    assert draft_seed_error(s, 20, position=4, token_id=9) == ""
    assert "position" in draft_seed_error(s, 20, position=5)
    assert "token" in draft_seed_error(s, 20, token_id=8)
