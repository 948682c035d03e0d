"""Test-only plugin distributions: a package and its ``NAME-VERSION.dist-info`` (METADATA,
entry_points.txt) written into a directory, which ``importlib.metadata`` finds like an
installed distribution once the directory is on ``sys.path`` (and, for Ray role processes,
on their PYTHONPATH)."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

#: a real drafting method, for plugin tests: it drafts what followed the latest earlier
#: occurrence of the context's last ``span`` tokens (prompt lookup of one fixed length)
COPYCAT_SOURCE = '''
from specmesh.drafter.options import Option, OptionSchema
from specmesh.drafter.proposer import Proposer


class CopycatProposer(Proposer):
    """Drafts by copying: the tokens that followed the latest earlier occurrence of the
    context's last ``span`` tokens."""

    summary = "copies what followed the latest earlier occurrence of the context's tail"
    options = OptionSchema((Option("span", int, "tail tokens to match", 1, minimum=1),))

    def __init__(self, span=1):
        self.span = span
        self.num_proposals = 0

    def open(self, request_id, context_token_ids):
        pass

    def propose(self, request_id, context_token_ids, num_tokens):
        self.num_proposals += 1
        ctx, n = list(context_token_ids), self.span
        if num_tokens <= 0 or len(ctx) <= n:
            return []
        tail = ctx[-n:]
        for start in range(len(ctx) - n - 1, -1, -1):
            if ctx[start:start + n] == tail:
                return ctx[start + n:start + n + num_tokens]
        return []

    def rollback(self, request_id, num_context_tokens):
        pass

    def close(self, request_id):
        pass
'''

#: a drafting method that forgot ``rollback`` and ``close``
HALF_SOURCE = '''
from specmesh.drafter.proposer import Proposer


class HalfProposer(Proposer):
    def open(self, request_id, context_token_ids):
        pass

    def propose(self, request_id, context_token_ids, num_tokens):
        return []
'''


def write_dist(root: Path, dist: str, modules: dict[str, str],
               entry_points: dict[str, dict[str, str]]) -> Path:
    """Write a distribution called ``dist`` (version 0.1) into ``root``: each module of
    ``modules`` (dotted name -> source; packages get their ``__init__.py``) and a dist-info
    with ``entry_points`` (group -> name -> ``module:attr``). Returns ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    for name, source in modules.items():
        parts = name.split(".")
        folder = root.joinpath(*parts[:-1])
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(1, len(parts)):
            init = root.joinpath(*parts[:i], "__init__.py")
            if not init.exists():
                init.write_text("")
        (folder / f"{parts[-1]}.py").write_text(textwrap.dedent(source))
    # the folder's name as wheels write it (PEP 427: the name's '-' as '_'), so that a lookup
    # of another distribution whose name is a prefix ("specmesh") never takes this one
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in eps.items()]
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))
    return root


def forget_modules(prefixes: tuple[str, ...]) -> None:
    """Drop the modules under ``prefixes`` from ``sys.modules`` (a test's plugin packages) and
    the import system's caches."""
    for name in list(sys.modules):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            del sys.modules[name]
    importlib.invalidate_caches()
