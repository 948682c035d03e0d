"""The CPU compute switches are read in one place (engine/backend.py ``read_overrides``) and
reach every module through the frozen backend it builds, checked on the source (ast):

- a ``SPECMESH_*`` name other than the two cache locations and the settings that are no compute
  switch (the API key) appears nowhere in the project's code but inside ``read_overrides`` (no
  module reads a switch, at import time or per call); a setting only in its one module;
- each cache location is read (``os.environ.get`` / ``os.getenv`` / ``os.environ[...]``) in its
  one module only: ``SPECMESH_CACHE_DIR`` in engine/weights_cache.py, ``SPECMESH_KERNEL_CACHE``
  in kernels/cpu_build.py;
- the engine, kernels and worker packages read no other environment variable than those, the
  compiler (``CXX``, ``XDG_CACHE_HOME``: kernels/cpu_build.py) and ``read_overrides``'s.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("protocol", "kernels", "engine", "prefill", "decode", "drafter", "cluster", "gateway",
           "data", "benchmarks")
#: cache location -> the one module that reads it
CACHE_VARS = {"SPECMESH_CACHE_DIR": "engine/weights_cache.py",
              "SPECMESH_KERNEL_CACHE": "kernels/cpu_build.py"}
#: settings that are no compute switch -> the one module that names them
SETTING_VARS = {"SPECMESH_API_KEY": "cluster/security_options.py"}
SWITCH_HOME = ("engine/backend.py", "read_overrides")
#: packages whose environment reads are all listed here: module -> what it may read
ENV_PACKAGES = ("engine", "kernels", "prefill", "decode", "drafter", "protocol")
ENV_READS = {"engine/weights_cache.py": {"SPECMESH_CACHE_DIR"},
             "kernels/cpu_build.py": {"SPECMESH_KERNEL_CACHE", "XDG_CACHE_HOME", "CXX"}}
NAME = re.compile(r"SPECMESH_[A-Z0-9_]+")


def _sources() -> list[Path]:
    return [path for pkg in PROJECT if (REPO_ROOT / pkg).is_dir()
            for path in sorted((REPO_ROOT / pkg).rglob("*.py"))
            if "__pycache__" not in path.parts]


def _function_spans(tree: ast.AST) -> dict[str, tuple[int, int]]:
    return {node.name: (node.lineno, node.end_lineno) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def switch_violations(relpath: str, source: str) -> list[str]:
    """Where ``source`` (the file ``relpath``) names a ``SPECMESH_*`` compute switch outside
    ``read_overrides``, or reads a cache location outside its module."""
    bad = []
    spans = _function_spans(ast.parse(source))
    home = spans.get(SWITCH_HOME[1]) if relpath == SWITCH_HOME[0] else None
    for lineno, line in enumerate(source.splitlines(), 1):
        for name in NAME.findall(line):
            if name in CACHE_VARS or SETTING_VARS.get(name) == relpath:
                continue
            if home is None or not home[0] <= lineno <= home[1]:
                bad.append(f"{relpath}:{lineno}: names {name} (read it through the CPU "
                           f"backend, engine/backend.py)")
    for var, lineno in environment_reads(source):
        if var in CACHE_VARS and CACHE_VARS[var] != relpath:
            bad.append(f"{relpath}:{lineno}: reads {var} (only {CACHE_VARS[var]} does)")
    return bad


def environment_reads(source: str) -> list[tuple[str, int]]:
    """(variable, line) of each ``os.environ.get(X)``, ``os.getenv(X)``, ``environ[X]`` read
    and ``X in os.environ`` in ``source``; X is the literal, or ``?`` when not a literal."""
    found = []

    def literal(node: ast.AST) -> str:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) \
            else "?"

    def is_environ(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
            (isinstance(node, ast.Name) and node.id == "environ")

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            f = node.func
            if (f.attr == "get" and is_environ(f.value)) or f.attr == "getenv":
                found.append((literal(node.args[0]), node.lineno))
        elif isinstance(node, ast.Subscript) and is_environ(node.value) \
                and isinstance(node.ctx, ast.Load):
            found.append((literal(node.slice), node.lineno))
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            found.append((literal(node.left), node.lineno))
    return found


def test_compute_switches_are_read_only_by_the_backend():
    sources = _sources()
    assert any(p.relative_to(REPO_ROOT).as_posix() == SWITCH_HOME[0] for p in sources)
    bad = []
    for path in sources:
        bad += switch_violations(path.relative_to(REPO_ROOT).as_posix(), path.read_text())
    assert not bad, "CPU compute switches read outside the backend:\n" + "\n".join(bad)


def test_the_backend_reads_every_switch_it_names():
    """read_overrides really is where the switches are read: each choice has its variable."""
    from specmesh.engine.backend import CHOICES, read_overrides

    for name in CHOICES:
        assert getattr(read_overrides({f"SPECMESH_{name.upper()}": "0"}), name) is False


def test_the_runtime_packages_read_only_the_listed_environment_variables():
    bad = []
    for path in _sources():
        rel = path.relative_to(REPO_ROOT).as_posix()
        if rel.split("/")[0] not in ENV_PACKAGES or rel == SWITCH_HOME[0]:
            continue
        for var, lineno in environment_reads(path.read_text()):
            if var not in ENV_READS.get(rel, set()):
                bad.append(f"{rel}:{lineno}: reads the environment ({var})")
    assert not bad, "environment reads outside the backend and the cache modules:\n" + \
        "\n".join(bad)


# --------------------------------------------------------------------------------------------
# The checker itself
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("relpath,source", [
    ("engine/onednn.py", '_on = os.environ.get("SPECMESH_PREPACKED_LINEAR", "1") != "0"\n'),
    ("kernels/layer_ops.py", 'SWITCH = "SPECMESH_LAYER_OPS"\n'),
    ("drafter/eagle/quantize.py", '"""``SPECMESH_EAGLE_Q8_0=0`` keeps float32."""\n'),
    ("engine/backend.py", 'def other():\n    return "SPECMESH_COMPILED_STACK"\n'),
    ("engine/loader.py", 'import os\nroot = os.getenv("SPECMESH_CACHE_DIR")\n'),
    ("kernels/x.py", 'from os import environ\nroot = environ["SPECMESH_KERNEL_CACHE"]\n'),
])
def test_checker_flags_switch_reads(relpath, source):
    assert switch_violations(relpath, source)


@pytest.mark.parametrize("relpath,source", [
    ("engine/backend.py", 'def read_overrides():\n    return {"x": "SPECMESH_LAYER_OPS"}\n'),
    ("engine/weights_cache.py", 'import os\nr = os.environ.get("SPECMESH_CACHE_DIR")\n'),
    ("benchmarks/prefill_cost.py", 'import os\nos.environ["SPECMESH_CACHE_DIR"] = "/tmp/x"\n'),
    ("cluster/options.py", '"""the ``SPECMESH_*`` switches"""\n'),
])
def test_checker_accepts_the_backend_and_the_cache_modules(relpath, source):
    assert switch_violations(relpath, source) == []


def test_environment_reads_are_found():
    src = ('import os\nfrom os import environ\na = os.environ.get("A")\nb = os.getenv("B")\n'
           'c = environ["C"]\nd = "D" in os.environ\nos.environ["E"] = "1"\n'
           'f = os.environ.get(name)\n')
    assert environment_reads(src) == [("A", 3), ("B", 4), ("C", 5), ("D", 6), ("?", 8)]
