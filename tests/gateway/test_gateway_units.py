"""Unit tests of the gateway's text pipeline that need no model files."""

from __future__ import annotations

import random

import pytest

from specmesh.gateway.detokenize import IncrementalDetokenizer, StopStringMatcher


class ByteTokenizer:
    """Toy byte-level tokenizer: token i < 256 is byte i; 256 is a special EOS token."""

    EOS = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = bytes(i for i in ids if i < 256)
        text = data.decode("utf-8", errors="replace")
        if not skip_special_tokens:
            text += "".join("</s>" for i in ids if i == self.EOS)
        return text


TEXT = "naïve café 😀🎉 déjà vu — 中文 ☕ end"


@pytest.mark.parametrize("seed", range(5))
def test_detokenizer_never_splits_characters(seed):
    tok = ByteTokenizer()
    ids = tok.encode(TEXT) + [ByteTokenizer.EOS]
    rng = random.Random(seed)
    det = IncrementalDetokenizer(tok, prompt_token_ids=tok.encode("prompt 😀"))
    deltas, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 3)
        deltas.append(det.add(ids[i:i + k]))
        i += k
    deltas.append(det.flush())
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    assert det.num_output_tokens == len(ids)


def test_detokenizer_flush_releases_incomplete_bytes():
    tok = ByteTokenizer()
    det = IncrementalDetokenizer(tok)
    assert det.add(tok.encode("ab")) == "ab"
    assert det.add(tok.encode("😀")[:2]) == ""  # held back
    assert det.flush() == "\ufffd"  # the stream ended mid-character: show the damage once
    assert det.add([]) == ""


def test_stop_matcher_spanning_deltas():
    m = StopStringMatcher(["STOP"])
    assert m.feed("hello S") == ("hello ", False)
    assert m.feed("T") == ("", False)
    assert m.feed("OP and more") == ("", True)
    assert m.matched == "STOP"
    assert m.feed("late") == ("", True)
    assert m.flush() == ""


def test_stop_matcher_releases_false_prefix_and_flush():
    m = StopStringMatcher(["abc", "xyz"])
    assert m.feed("1a") == ("1", False)
    assert m.feed("b") == ("", False)
    assert m.feed("d") == ("abd", False)  # not a stop after all
    assert m.feed("x") == ("", False)
    assert m.flush() == "x"


def test_stop_matcher_earliest_stop_wins_and_no_stops():
    m = StopStringMatcher(["world", "lo w"])
    assert m.feed("hello world") == ("hel", True)
    m = StopStringMatcher([""])  # empty stop strings are ignored
    assert m.feed("anything") == ("anything", False)
    assert StopStringMatcher(None).feed("x") == ("x", False)


def test_stop_matcher_multichar_overlap():
    m = StopStringMatcher(["aab"])
    out = []
    for ch in "xaaaab!":
        text, stopped = m.feed(ch)
        out.append(text)
        if stopped:
            break
    assert "".join(out) == "xaa"
    assert stopped
