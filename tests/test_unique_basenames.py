"""Test modules are collected by basename (rootdir-relative, no package __init__): two files with
the same name in different folders abort the whole collection. Catch that here with a clear
message instead of an import-file-mismatch error in CI."""

from __future__ import annotations

import collections
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_test_module_basenames_are_unique():
    seen = collections.defaultdict(list)
    for p in TESTS.rglob("*.py"):
        if p.name in ("conftest.py", "__init__.py") or "helpers" in p.parts:
            continue
        seen[p.name].append(str(p.relative_to(TESTS)))
    dups = {k: v for k, v in seen.items() if len(v) > 1}
    assert not dups, f"test modules share a basename: {dups}"
