"""Option schemas of drafting methods (drafter/options.py): ``--drafter NAME:KEY=VALUE+...``
is parsed and checked from the method's schema, and every refusal names the key and what it
accepts (the allowed keys, the choices, the bounds)."""

from __future__ import annotations

import pytest

from specmesh.cluster.drafter_option import parse_drafter
from specmesh.drafter.options import Option, OptionError, OptionSchema


def _check(kwargs):
    if kwargs.get("lo", 0) > kwargs.get("hi", 9):
        raise ValueError(f"lo ({kwargs.get('lo')}) is above hi ({kwargs.get('hi', 9)})")


SCHEMA = OptionSchema((
    Option("path", "path", "a directory", positional=True),
    Option("lo", int, "low", 0, minimum=0, maximum=9),
    Option("hi", int, "high", 9, minimum=0, flag="--demo-hi"),
    Option("rate", float, "a rate", 0.5, minimum=0.0, maximum=1.0),
    Option("kind", str, "a kind", "a", choices=("a", "b")),
    Option("fast", bool, "go fast", False),
), check=_check)


def test_values_are_typed_and_keys_map_to_keyword_arguments():
    assert SCHEMA.parse("lo=1+hi=3+rate=0.25+kind=b+fast=yes") == {
        "lo": 1, "hi": 3, "rate": 0.25, "kind": "b", "fast": True}
    assert SCHEMA.parse("fast=off") == {"fast": False}
    assert SCHEMA.parse("") == {}
    renamed = OptionSchema((Option("min", int, kwarg="min_ngram"),))
    assert renamed.parse("min=2") == {"min_ngram": 2}


def test_the_positional_option_takes_a_value_without_its_key():
    assert SCHEMA.parse("/a/b") == {"path": "/a/b"}
    assert SCHEMA.parse("/a/b+lo=2") == {"path": "/a/b", "lo": 2}
    assert SCHEMA.parse("path=/a/b") == {"path": "/a/b"}
    assert SCHEMA.parse("/a+b/c") == {"path": "/a+b/c"}  # loose pieces join again
    with pytest.raises(OptionError, match="key 'path' is given twice"):
        SCHEMA.parse("/a+path=/b")


@pytest.mark.parametrize("text,match", [
    ("depth=2", r"unknown key 'depth'; keys: path, lo, hi, rate, kind, fast"),
    ("lo=-1", r"lo must be integer in \[0, 9\], got '-1'"),
    ("lo=x", r"lo must be integer in \[0, 9\], got 'x'"),
    ("lo=1.5", r"lo must be integer in \[0, 9\], got '1.5'"),
    ("hi=-3", r"hi must be integer >= 0, got '-3'"),
    ("rate=2", r"rate must be number in \[0.0, 1.0\], got '2'"),
    ("kind=c", r"kind must be one of a, b, got 'c'"),
    ("fast=maybe", r"fast must be true/false, got 'maybe'"),
    ("lo=1+lo=2", r"key 'lo' is given twice"),
    ("lo=5+hi=2", r"lo \(5\) is above hi \(2\)"),
    ("path=", r"path must be a path, got ''"),
])
def test_refusals_name_the_key_and_what_it_accepts(text, match):
    with pytest.raises(OptionError, match=match):
        SCHEMA.parse(text)


def test_without_a_positional_option_a_loose_value_is_refused_with_the_keys():
    schema = OptionSchema((Option("min", int, minimum=1),))
    with pytest.raises(OptionError, match=r"expected KEY=VALUE items joined by '\+', got '3'; "
                                          r"keys: min"):
        schema.parse("3")
    with pytest.raises(OptionError, match="it takes no options"):
        OptionSchema().parse("x=1")


def test_required_keys_and_flags():
    schema = OptionSchema((Option("model", "path", "the model", required=True, positional=True),
                           Option("n", int, "count", 2, minimum=1, flag="--demo-n")))
    with pytest.raises(OptionError, match=r"key 'model' is required: the model \(give "
                                          r"model=VALUE or the value alone\)"):
        schema.parse("n=3")
    assert schema.parse("/m", {"demo_n": 4}) == {"model": "/m", "n": 4}
    assert schema.parse("/m+n=3", {"demo_n": 4}) == {"model": "/m", "n": 3}  # the key wins
    assert schema.parse("/m", {"demo_n": None}) == {"model": "/m"}  # flag not given
    with pytest.raises(OptionError, match=r"--demo-n: n must be integer >= 1, got 0"):
        schema.parse("/m", {"demo_n": 0})


def test_schema_declarations_are_checked():
    with pytest.raises(TypeError, match="at most one option may be positional"):
        OptionSchema((Option("a", "path", positional=True), Option("b", str, positional=True)))
    with pytest.raises(TypeError, match="repeat"):
        OptionSchema((Option("a", int), Option("a", int)))
    with pytest.raises(TypeError, match="type must be one of"):
        Option("a", list)
    with pytest.raises(TypeError, match="only a text or path option is positional"):
        Option("a", int, positional=True)
    with pytest.raises(TypeError, match="is not KEY"):
        Option("a b", int)


@pytest.mark.parametrize("spec,match", [
    ("eagle:dtype=fp8", r"--drafter eagle:dtype=fp8: dtype must be one of float32, bfloat16, "
                        r"float64, got 'fp8'"),
    ("eagle:/h+depth=2", r"unknown key 'depth'; keys: head, dtype"),
    ("draft-model:/m+kv_cache_mb=0", r"kv_cache_mb must be integer >= 1, got '0'"),
    ("draft-model:dtype=float32", r"key 'model' is required"),
    ("ngram:width=0", r"width must be integer >= 1, got '0'"),
    ("ngram:min=3+max=2", r"min \(3\) is above max \(2\)"),
])
def test_builtin_methods_refuse_through_the_cli_naming_the_key(spec, match):
    with pytest.raises(SystemExit, match=match):
        parse_drafter(spec)


def test_builtin_methods_parse_their_keys():
    assert parse_drafter("eagle:/a/b+dtype=bfloat16") == (
        "eagle", {"head": "/a/b", "dtype": "bfloat16"})
    assert parse_drafter("eagle:head=/h") == ("eagle", {"head": "/h"})
    assert parse_drafter("draft-model:/m+kv_cache_mb=64") == (
        "draft_model", {"model": "/m", "kv_cache_mb": 64})
    assert parse_drafter("draft_model:/m") == ("draft_model", {"model": "/m"})
