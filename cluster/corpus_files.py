"""``--corpus [NAME=]FILE ...``: text files the gateway tokenizes at start and loads into every
drafter as corpora (docs/drafters.md, 'Corpora'). A corpus is named ``NAME``, or after its
file (the file name with every character outside ``[A-Za-z0-9._-]`` turned into ``-``)."""

from __future__ import annotations

import os
import re

from specmesh.protocol.cross_checks import corpus_name_error


def corpus_specs(values: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    """``[NAME=]FILE`` items as (name, path) pairs.

    Raises:
        ValueError: a name that cannot name a corpus, or two corpora of one name.
    """
    out: list[tuple[str, str]] = []
    for item in values:
        name, sep, path = item.partition("=")
        if not sep or os.path.exists(item):  # a file whose name holds "=" is a file
            name, path = re.sub(r"[^A-Za-z0-9._-]", "-", os.path.basename(item)), item
        why = corpus_name_error(name)
        if why:
            raise ValueError(f"--corpus {item!r}: {why}")
        if any(n == name for n, _ in out):
            raise ValueError(f"--corpus: two corpora are named {name!r} (name them: NAME=FILE)")
        out.append((name, path))
    return out


def check_corpus_option(values: list[str] | tuple[str, ...], method: str,
                        supported: bool) -> list[tuple[str, str]]:
    """``--corpus`` as (name, path) pairs after checking what can be checked before anything
    starts: names, files that exist and are readable, and a drafting method (``method``,
    whose ``supported`` says whether it drafts from corpora) that can use them.

    Raises:
        SystemExit: with the reason.
    """
    if not values:
        return []
    if not supported:
        raise SystemExit(f"--corpus: the {method!r} drafting method keeps no cross-request "
                         "memory and cannot draft from a corpus (use --drafter ngram or suffix)")
    try:
        specs = corpus_specs(values)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    for name, path in specs:
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise SystemExit(f"--corpus {name}: {path!r} is not a readable file")
    return specs


def read_corpus_file(path: str) -> str:
    """The text of a corpus file (UTF-8; undecodable bytes replaced, so that a stray byte in a
    large file does not keep the gateway from starting).

    Raises:
        OSError: the file cannot be read.
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()
