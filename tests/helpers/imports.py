"""The project's imports read from the source with ``ast`` (nothing is imported): every import
statement of a module, at module level, inside functions and under ``if`` / ``try`` /
``TYPE_CHECKING`` alike, relative imports resolved; and the graph of which project module
imports which, with its strongly connected components (Tarjan, "Depth-first search and linear
graph algorithms", SIAM J. Comput. 1972). Used by tests/test_import_direction.py and
tests/test_import_cycles.py.

Modules are named as their folders, without the ``specmesh.`` prefix the installed package
puts in front of them: ``decode/worker.py`` is ``decode.worker``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
#: the top-level folders that install as ``specmesh.<folder>`` (setup.py)
PROJECT = ("protocol", "kernels", "engine", "prefill", "decode", "drafter", "cluster", "gateway",
           "data", "benchmarks")


def module_name(package: str, relpath: str) -> tuple[str, bool]:
    """``("decode.worker", False)`` for ``decode/worker.py``; ``("decode", True)`` for its
    ``__init__.py`` (the bool says whether the module is a package)."""
    parts = [package, *Path(relpath).with_suffix("").parts]
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """Every module ``source`` imports, anywhere (functions and ``if`` blocks included), as
    ``(line, absolute dotted name)``; relative imports are resolved against ``module``.
    ``importlib.import_module("x")`` / ``__import__("x")`` with a literal name count too.

    Raises:
        SyntaxError: ``source`` does not parse.
    """
    found: list[tuple[int, str]] = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                found.append((node.lineno, node.module or ""))
                # `from pkg import mod` imports pkg.mod when mod is a module
                found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
                continue
            base = package.split(".") if package else []
            if node.level - 1 > len(base) - 1:
                found.append((node.lineno, "<relative import beyond the top-level package>"))
                continue
            base = base[: len(base) - (node.level - 1)]
            target = ".".join([*base, node.module] if node.module else base)
            if node.module:
                found.append((node.lineno, target))
            else:  # from . import a, b
                found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = (func.attr if isinstance(func, ast.Attribute)
                    else func.id if isinstance(func, ast.Name) else "")
            arg = node.args[0]
            if (name in ("import_module", "__import__") and isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str)):
                found.append((node.lineno, arg.value))
    return found


def project_sources(root: Path = REPO_ROOT) -> list[tuple[str, Path]]:
    """``(package, path)`` of every ``.py`` file of the project's packages under ``root``."""
    return [(pkg, path) for pkg in PROJECT if (root / pkg).is_dir()
            for path in sorted((root / pkg).rglob("*.py")) if "__pycache__" not in path.parts]


def import_graph(modules: Mapping[str, tuple[str, bool]]) -> dict[str, dict[str, int]]:
    """Which project module imports which: ``modules`` maps a module name to ``(source,
    is_package)``; the result maps each to ``{imported project module: first line}``.

    An imported name resolves to the longest of ``modules`` that is it or a prefix of it
    (``from decode.config import VERIFY_RULES`` imports ``decode.config``); ``specmesh.`` is
    dropped first; names outside the project and a module's imports of itself are left out.
    A package's ``__init__`` that Python runs before a submodule is not an edge: only what the
    source names is.

    Raises:
        SyntaxError: a source does not parse.
    """
    graph: dict[str, dict[str, int]] = {}
    for module, (source, is_package) in modules.items():
        edges: dict[str, int] = {}
        for line, name in imported_modules(source, module, is_package):
            name = name.removeprefix("specmesh.")
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                edges.setdefault(name, line)
        graph[module] = edges
    return graph


def project_import_graph(root: Path = REPO_ROOT) -> dict[str, dict[str, int]]:
    """:func:`import_graph` of every module of the project's packages under ``root``."""
    modules = {}
    for package, path in project_sources(root):
        name, is_package = module_name(package, path.relative_to(root / package).as_posix())
        modules[name] = (path.read_text(encoding="utf-8"), is_package)
    return import_graph(modules)


def strongly_connected(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` (node -> successors) with more than one
    node or a self-loop: each a sorted list, the list sorted. Iterative Tarjan, linear in
    nodes + edges; successors that are not nodes of ``graph`` are ignored."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        work = [(start, iter([w for w in graph[start] if w in graph]))]
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter([w for w in graph[nxt] if w in graph])))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph[node]:
                        out.append(sorted(component))
    return sorted(out)


def cycle_through(graph: Mapping[str, Iterable[str]], component: Iterable[str]) -> list[str]:
    """One shortest cycle inside ``component`` (a strongly connected component of ``graph``)
    through its first node in sorted order: ``[a, b, ..., a]``."""
    members = set(component)
    start = min(members)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(set(graph[node]) & members):
                if nxt == start:
                    path = [node]  # node, its parent, ..., start
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if nxt not in parents:
                    parents[nxt] = node
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise ValueError(f"{sorted(members)} is not a strongly connected component of the graph")
