"""Function-local imports say why they are local: an import statement inside a function body
of the runtime packages (every folder of :data:`helpers.imports.PROJECT`) is allowed only to
keep a heavy optional dependency (torch, triton, transformers, ray, the HTTP stack, ...) out
of its module's import time, or to break a layering rule or a cycle, and a comment says which.

The comment goes on the import's line, on the line above, or anywhere in the run of import
statements just before it in the same block (one comment above a group of imports covers the
group; isort's blank lines between its sections do not end a run). A pragma alone (``# noqa``,
``# type: ignore``) is no reason. Everything else goes to the module's top-level imports.
Read from the source with ``ast`` and ``tokenize``; nothing is imported.
"""

from __future__ import annotations

import ast
import fnmatch
import io
import re
import tokenize

import pytest

from helpers.imports import REPO_ROOT, project_sources

#: in progress on other branches: the lead empties this list after merging (paths relative to
#: the checkout's root, fnmatch patterns; ``*`` spans folders)
IN_PROGRESS_ELSEWHERE: tuple[str, ...] = ()

_PRAGMAS = re.compile(r"\bnoqa\b(?::\s*[A-Z]+\d+(?:\s*,\s*[A-Z]+\d+)*)?|\btype:\s*ignore\b"
                      r"(?:\[[^\]]*\])?|\bpragma:\s*no\s*cover\b|\bfmt:\s*(?:on|off|skip)\b")


def _is_reason(comment: str) -> bool:
    """Whether ``comment`` (with its ``#``) says something besides linter pragmas."""
    return re.search(r"[A-Za-z]{2,}", _PRAGMAS.sub("", comment.lstrip("#"))) is not None


def _comments(source: str) -> tuple[dict[int, str], set[int]]:
    """(line -> comment text, the lines that hold nothing but a comment) of ``source``."""
    comments: dict[int, str] = {}
    own_line: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string
            if not tok.line[: tok.start[1]].strip():
                own_line.add(tok.start[0])
    return comments, own_line


def _blocks(node: ast.AST):
    """The statement lists ``node`` holds directly (bodies, else, finally, handlers, cases)."""
    for name in ("body", "orelse", "finalbody"):
        value = getattr(node, name, None)
        if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
            yield value
    for handler in getattr(node, "handlers", ()):
        yield handler.body
    for case in getattr(node, "cases", ()):
        yield case.body


def function_local_imports(tree: ast.Module) -> list[tuple[ast.stmt, int]]:
    """Every import statement inside a function (methods, nested functions and blocks in them
    included) as ``(statement, first line of the run of imports it ends)``."""
    found: list[tuple[ast.stmt, int]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        in_function = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for block in _blocks(node):
            run_start = None
            for stmt in block:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    run_start = stmt.lineno if run_start is None else run_start
                    if in_function:
                        found.append((stmt, run_start))
                else:
                    run_start = None
                visit(stmt, in_function)

    visit(tree, False)
    return found


def unexplained(source: str) -> list[int]:
    """The lines of the function-local imports of ``source`` that no comment explains.

    Raises:
        SyntaxError: ``source`` does not parse.
    """
    comments, own_line = _comments(source)
    bad = []
    for stmt, run_start in function_local_imports(ast.parse(source)):
        lines = range(run_start, stmt.end_lineno + 1)
        explained = any(_is_reason(comments[n]) for n in lines if n in comments)
        above = run_start - 1  # a comment line just above the run (the last of a block)
        explained = explained or (above in own_line and _is_reason(comments[above]))
        if not explained:
            bad.append(stmt.lineno)
    return bad


def _in_progress(relpath: str) -> bool:
    return any(fnmatch.fnmatch(relpath, pattern) for pattern in IN_PROGRESS_ELSEWHERE)


def test_function_local_imports_say_why() -> None:
    sources = project_sources()
    scanned = {path.relative_to(REPO_ROOT).as_posix() for _, path in sources}
    assert {"cluster/cli.py", "engine/loader.py", "drafter/proposers/eagle.py"} <= scanned
    bad = []
    for _, path in sources:
        relpath = path.relative_to(REPO_ROOT).as_posix()
        if _in_progress(relpath):
            continue
        bad += [f"{relpath}:{line}" for line in unexplained(path.read_text(encoding="utf-8"))]
    assert not bad, (
        "function-local imports without a comment saying what they keep out of import time "
        "(torch, ray, ...) or why they cannot move; move the others to the module's "
        "top-level imports:\n" + "\n".join(bad))


def test_in_progress_patterns_name_files() -> None:
    """Every pattern of the temporary skip list still matches a file (no stale entry)."""
    scanned = [path.relative_to(REPO_ROOT).as_posix() for _, path in project_sources()]
    stale = [p for p in IN_PROGRESS_ELSEWHERE if not fnmatch.filter(scanned, p)]
    assert not stale, f"no file matches {stale}: remove them from IN_PROGRESS_ELSEWHERE"


# --------------------------------------------------------------------------------------------
# The checker itself
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source,lines", [
    ("def f():\n    import torch\n", [2]),
    ("def f():\n    import torch  # noqa: F401\n", [2]),
    ("def f():\n    import torch  # type: ignore[import]\n", [2]),
    ("def f():\n    # torch: only here\n\n    import torch\n", [4]),  # a blank line apart
    ("def f():\n    x = 1  # set up\n    import torch\n", [3]),  # another statement's comment
    ("def f():\n    import os  # stdlib, fine\n    x = 1\n    import torch\n", [4]),
    ("class A:\n    def m(self):\n        from torch import nn\n", [3]),
    ("def f():\n    def g():\n        import ray\n", [3]),
    ("async def f():\n    if x:\n        import httpx\n    else:\n        import ray\n", [3, 5]),
    ("def f():\n    try:\n        import gguf\n    except ImportError:\n        import json\n",
     [3, 5]),
    ("def f():\n    from specmesh.engine.loader import (\n        load_model,\n    )\n", [2]),
    ("def f():\n    import torch\n    # a comment after does not count\n", [2]),
])
def test_checker_flags_unexplained_imports(source: str, lines: list[int]) -> None:
    assert unexplained(source) == lines


@pytest.mark.parametrize("source", [
    "import torch\nfrom os import path\n",  # module level
    "class A:\n    import json\n",  # a class body at module level runs at import
    "if True:\n    import ray\ntry:\n    import gguf\nexcept ImportError:\n    pass\n",
    "def f():\n    import torch  # torch: keeps --help fast\n",
    "def f():\n    # ray only when serving\n    import ray\n",
    "def f():\n    # lazy: the model's stack\n    # (a second comment line)\n    import torch\n",
    # one comment covers the run of imports below it, isort's blank lines included
    "def f():\n    # torch and triton only here\n    import torch\n\n"
    "    from specmesh.engine.runner import ModelRunner\n    from x import y\n",
    "def f():\n    import torch  # noqa: F401 - torch only here\n",
    "def f():\n    from specmesh.engine.loader import (  # triton kernels\n        load_model,\n"
    "    )\n",
    "def f():\n    x = 1\n    if x:\n        # httpx only for a roster\n        import httpx\n",
])
def test_checker_accepts_explained_imports(source: str) -> None:
    assert unexplained(source) == []

