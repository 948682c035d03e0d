"""No import cycles between the project's modules, read from the source (tests/helpers/imports.py):
every import counts, at module level or inside a function (a function-local import that
closes a loop only hides it until the function runs), relative ones resolved."""

from __future__ import annotations

import pytest

from helpers.imports import (
    cycle_through,
    import_graph,
    project_import_graph,
    strongly_connected,
)

#: cycles known today, each a strongly connected component (sorted) -> the work that removes
#: it; none now (the verify-rule registry, decode/rules.py, took the last one apart)
KNOWN_CYCLES: dict[tuple[str, ...], str] = {}


def _describe(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    cycle = cycle_through(graph, component)
    steps = [f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join([*steps, cycle[-1]])


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, int]]:
    return project_import_graph()


def test_no_import_cycles(graph: dict[str, dict[str, int]]) -> None:
    assert {"protocol.codec", "decode.worker", "cluster.cli",
            "benchmarks.harness.bench"} <= set(graph)
    assert "decode.scheduler" in graph["decode.worker"]  # the graph has edges
    found = strongly_connected(graph)
    new = [c for c in found if tuple(c) not in KNOWN_CYCLES]
    assert not new, "import cycles (break each by moving the shared piece where it belongs):\n" + \
        "\n".join(_describe(graph, c) for c in new)


def test_known_cycles_are_still_there(graph: dict[str, dict[str, int]]) -> None:
    """A known cycle that is gone leaves KNOWN_CYCLES, so it cannot come back unnoticed."""
    found = {tuple(c) for c in strongly_connected(graph)}
    gone = [c for c in KNOWN_CYCLES if c not in found]
    assert not gone, f"no longer cycles, remove them from KNOWN_CYCLES: {gone}"


# --------------------------------------------------------------------------------------------
# The graph and the cycle finder themselves
# --------------------------------------------------------------------------------------------


def _graph(sources: dict[str, str]) -> dict[str, dict[str, int]]:
    return import_graph({name.removesuffix(".__init__"): (src, name.endswith(".__init__"))
                         for name, src in sources.items()})


@pytest.mark.parametrize("sources,cycle", [
    # module level both ways
    ({"a.x": "from a.y import f\n", "a.y": "import specmesh.a.x\n"}, ["a.x", "a.y"]),
    # one side inside a function, relative
    ({"a.x": "def f():\n    from .y import g\n", "a.y": "from a import x\n"}, ["a.x", "a.y"]),
    # under TYPE_CHECKING, three modules, a name imported from a module
    ({"a.x": "if TYPE_CHECKING:\n    from a.y import Y\n", "a.y": "from a.z import Z\n",
      "a.z": "from .x import X\n"}, ["a.x", "a.y", "a.z"]),
    # a package's __init__ importing its submodule, which imports the package
    ({"a.p.__init__": "from . import m\n", "a.p.m": "from a.p import thing\n"},
     ["a.p", "a.p.m"]),
])
def test_cycles_are_found(sources: dict[str, str], cycle: list[str]) -> None:
    graph = _graph(sources)
    assert strongly_connected(graph) == [cycle]
    path = cycle_through(graph, cycle)
    assert path[0] == path[-1] == cycle[0] and set(path) == set(cycle)
    assert all(b in graph[a] for a, b in zip(path, path[1:]))


@pytest.mark.parametrize("sources", [
    {"a.x": "from a.y import f\n", "a.y": "import os\nfrom b import z\n"},  # b is not ours
    {"a.x": "from a.y import f\nfrom a.z import g\n", "a.y": "from a.z import h\n",
     "a.z": "import json\n"},  # a diamond is no cycle
    {"a.x": "from . import x\nimport a.x\n"},  # a module naming itself is no edge
])
def test_acyclic_graphs_pass(sources: dict[str, str]) -> None:
    assert strongly_connected(_graph(sources)) == []


def test_two_cycles_are_two_components() -> None:
    graph = {"a": ["b"], "b": ["a", "c"], "c": ["d"], "d": ["c"], "e": ["a"]}
    assert strongly_connected(graph) == [["a", "b"], ["c", "d"]]
    assert cycle_through(graph, ["c", "d"]) == ["c", "d", "c"]


def test_a_long_chain_needs_no_recursion() -> None:
    n = 5000
    graph = {str(i): [str(i + 1)] for i in range(n)}
    graph[str(n)] = ["0"]
    assert strongly_connected(graph) == [sorted(str(i) for i in range(n + 1))]
