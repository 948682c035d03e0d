"""The import direction of docs/architecture.md, 'Layering', checked on the source (ast), lazy
imports included.

- protocol: no torch / numpy / triton / ray, no other project package;
- kernels: only torch, triton, the standard library and kernels itself;
- engine: may import kernels and protocol; not ray, prefill, decode, drafter, cluster;
- prefill, decode, drafter: engine / kernels / protocol, never each other, cluster or ray;
- only cluster imports ray;
- of cluster, only the CLI imports the bench harness (benchmarks/), for the bench command;
- no runtime package imports the tests' helpers (test-only models and references);
- module rules (below): the verifier's scheduler and request state are pure Python (no torch),
  the in-process cluster, the configs and the CLI options import no ray (lazily included), and
  nothing imports the CLI (no ``cli`` <-> ``demo`` loop); checked transitively too.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers.imports import PROJECT, REPO_ROOT, imported_modules, module_name, project_sources

WORKERS = ("prefill", "decode", "drafter")

#: package -> top-level modules it must not import
FORBIDDEN: dict[str, frozenset[str]] = {
    "protocol": frozenset({"torch", "numpy", "triton", "ray", *PROJECT} - {"protocol"}),
    "engine": frozenset({"ray", *WORKERS, "cluster", "gateway", "benchmarks"}),
    **{w: frozenset({"ray", "cluster", "gateway", "benchmarks", *WORKERS} - {w}) for w in WORKERS},
    "gateway": frozenset({"ray", "kernels", "benchmarks", *WORKERS}),
    "cluster": frozenset({"benchmarks"}),
    "benchmarks": frozenset(),
}
TEST_ONLY = frozenset({"helpers", "tests", "conftest"})
for _pkg in FORBIDDEN:
    FORBIDDEN[_pkg] = FORBIDDEN[_pkg] | TEST_ONLY
#: module -> modules it must not import, even lazily (a dotted name bans it and its submodules)
MODULE_FORBIDDEN: dict[str, frozenset[str]] = {
    **{m: frozenset({"torch", "triton"}) for m in (
        "decode.scheduler", "decode.request", "decode.config", "decode.tail_buffer",
        "engine.block_manager", "prefill.config", "drafter.config", "cluster.auto")},
    **{m: frozenset({"ray", "cluster.cli", "cluster.launcher", "cluster.actors"}) for m in (
        "cluster.inprocess", "cluster.config", "cluster.options", "cluster.runs",
        "cluster.loopback", "benchmarks.harness.options", "cluster.auto_resolve")},
    **{m: frozenset({"cluster.cli"}) for m in ("cluster.demo", "benchmarks.harness.bench")},
}
#: module -> top-level modules it may import that its package's FORBIDDEN rule bans
ALLOWED: dict[str, frozenset[str]] = {"cluster.cli": frozenset({"benchmarks"})}
#: package -> the only top-level modules it may import (besides the standard library)
ONLY: dict[str, frozenset[str]] = {"kernels": frozenset({"torch", "triton", "kernels"}),
                                   "data": frozenset({"data"})}
STDLIB = frozenset(sys.stdlib_module_names)


def violations(package: str, source: str, relpath: str = "mod.py") -> list[str]:
    """The import-direction violations of one source file of ``package``."""
    module, is_package = module_name(package, relpath)
    bad = []
    for line, name in imported_modules(source, module, is_package):
        name = name.removeprefix("specmesh.")  # the project's packages, named as their folders
        top = name.split(".")[0]
        banned = MODULE_FORBIDDEN.get(module, frozenset())
        if name.startswith("<"):
            ok = False
        elif any(name == b or name.startswith(b + ".") for b in banned):
            ok = False
        elif name == "cluster.cli" and module != "cluster.cli":
            ok = False  # the CLI is the entry point; importing it makes loops
        elif package in ONLY:
            ok = top in ONLY[package] or top in STDLIB
        else:
            ok = top not in FORBIDDEN[package] or top in ALLOWED.get(module, frozenset())
        if not ok:
            bad.append(f"{package}/{relpath}:{line}: imports {name}")
    return bad


def test_project_tree_respects_import_direction() -> None:
    sources = project_sources()
    scanned = {path.relative_to(REPO_ROOT).as_posix() for _, path in sources}
    assert {"protocol/codec.py", "protocol/messages.py", "kernels/greedy_verify.py"} <= scanned
    bad: list[str] = []
    for package, path in sources:
        relpath = path.relative_to(REPO_ROOT / package).as_posix()
        try:
            bad += violations(package, path.read_text(encoding="utf-8"), relpath)
        except SyntaxError as e:
            bad.append(f"{package}/{relpath}: does not parse: {e}")
    assert not bad, ("import direction violated (docs/architecture.md, 'Layering'):\n"
                     + "\n".join(bad))


def test_pure_modules_stay_pure_transitively() -> None:
    """What the module rules promise holds for everything those modules pull in."""
    code = ("import sys\n"
            "import specmesh.decode.scheduler, specmesh.decode.request\n"
            "import specmesh.engine.block_manager\n"
            "assert 'torch' not in sys.modules, 'the scheduler pulled in torch'\n"
            "import specmesh.cluster.inprocess, specmesh.cluster.config\n"
            "import specmesh.cluster.options, specmesh.cluster.runs\n"
            "import specmesh.cluster.demo, specmesh.benchmarks.harness.bench\n"
            "import specmesh.benchmarks.harness.options\n"
            "assert 'ray' not in sys.modules, 'a Ray-free module pulled in ray'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


# --------------------------------------------------------------------------------------------
# The checker itself
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("package,source,relpath", [
    ("protocol", "import torch", "codec.py"),
    ("protocol", "import numpy as np", "codec.py"),
    ("protocol", "from triton import language", "codec.py"),
    ("protocol", "import torch.nn.functional", "codec.py"),
    ("protocol", "def f():\n    import engine.model\n", "x.py"),
    ("protocol", "from ...engine import model", "sub/x.py"),  # beyond the top level
    ("engine", "from ..kernels import greedy_verify", "runner.py"),  # beyond the top level
    ("kernels", "import numpy", "op.py"),
    ("kernels", "import protocol", "op.py"),
    ("kernels", "from engine import sampler", "op.py"),
    ("kernels", "import msgpack", "op.py"),
    ("engine", "import ray", "runner.py"),
    ("engine", "from decode import worker", "runner.py"),
    ("engine", "class A:\n    def f(self):\n        from cluster.config import C\n", "a.py"),
    ("prefill", "from decode.worker import W", "worker.py"),
    ("prefill", "from ..drafter import registry", "worker.py"),
    ("decode", "if True:\n    import prefill\n", "loop.py"),
    ("decode", "from cluster import config", "loop.py"),
    ("drafter", "import importlib\nimportlib.import_module('ray')\n", "x.py"),
    ("drafter", "__import__('decode.worker')", "x.py"),
    ("drafter", "try:\n    import ray.util\nexcept ImportError:\n    pass\n", "x.py"),
    ("decode", "from .... import x", "a/b.py"),
    ("engine", "from helpers.models import tiny_llama", "loader.py"),
    ("cluster", "def f():\n    import helpers\n", "bench.py"),
    ("decode", "import torch", "scheduler.py"),
    ("decode", "def f():\n    from torch import nn\n", "request.py"),
    ("cluster", "def f():\n    import ray\n", "inprocess.py"),
    ("cluster", "from cluster.launcher import start_cluster", "config.py"),
    ("cluster", "from cluster.cli import main", "demo.py"),
    ("cluster", "from cluster import cli", "bench.py"),
    ("cluster", "def f():\n    from benchmarks.harness.bench import bench\n", "options.py"),
    ("cluster", "from specmesh.benchmarks.harness import options", "config.py"),
    ("benchmarks", "def f():\n    import ray\n", "harness/options.py"),
])
def test_checker_flags_violations(package: str, source: str, relpath: str) -> None:
    assert violations(package, source, relpath), f"{package}: {source!r} should be refused"


@pytest.mark.parametrize("package,source,relpath", [
    ("protocol", "from __future__ import annotations\nimport msgpack, zmq, dataclasses",
     "codec.py"),
    ("protocol", "from .messages import Buffer\nfrom . import errors", "codec.py"),
    ("protocol", "from protocol.errors import ProtocolError", "__init__.py"),
    ("kernels", "import os, typing\nimport torch\nimport triton.language as tl", "op.py"),
    ("kernels", "from .constants import PLACEHOLDER_TOKEN_ID\nfrom kernels import x", "op.py"),
    ("engine", "import torch, safetensors\nfrom kernels import greedy_verify\nimport protocol",
     "runner.py"),
    ("protocol", "from ..messages import Buffer", "sub/x.py"),
    ("prefill", "import engine\nfrom protocol import KVFrame\nfrom .worker import W",
     "__init__.py"),
    ("decode", "from engine.model import Llama\nfrom kernels import greedy_verify", "loop.py"),
    ("drafter", "from drafter.proposers import ngram", "registry.py"),
    ("cluster", "import ray\nfrom decode import worker\nfrom prefill import worker", "actors.py"),
    ("decode", "import torch\nfrom decode.scheduler import Scheduler", "verify_step.py"),
    ("cluster", "def f():\n    from cluster.launcher import start_cluster\n", "demo.py"),
    ("cluster", "from specmesh.benchmarks.harness.options import add_bench_options", "cli.py"),
])
def test_checker_accepts_allowed_imports(package: str, source: str, relpath: str) -> None:
    assert violations(package, source, relpath) == []


def test_relative_imports_resolve() -> None:
    found = dict(imported_modules("from . import a\nfrom ..b import c\nfrom .d import e\n",
                                  "pkg.sub.mod", is_package=False))
    assert found == {1: "pkg.sub.a", 2: "pkg.b", 3: "pkg.sub.d"}
    found = dict(imported_modules("from . import a\n", "pkg.sub", is_package=True))
    assert found == {1: "pkg.sub.a"}
