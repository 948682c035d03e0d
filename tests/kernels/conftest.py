"""Helpers of the kernel tests: run ops under the Triton interpreter in a subprocess. A test
that does (it requests ``run_interpreted``, directly or through a module's fixture) is marked
``slow``: each module's interpreted cases take tens of seconds of CPU, so the fast tier
(``-m "not slow and not ray and not multinode"``) leaves them to CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

_WORKER = Path(__file__).with_name("_interpret_worker.py")
_REPO_ROOT = Path(__file__).resolve().parents[2]


def _run_interpreted(cases: list[dict[str, Any]], tmp_path: Path, timeout: float = 600) -> list:
    """Run ``cases`` (see ``_interpret_worker.py``) in one fresh process with
    ``TRITON_INTERPRET=1``; return one ``{"ok": [...]}`` / ``{"error": str}`` per case.

    The variable is set only in the child's environment: this process (and every other test
    of the session) keeps compiled-mode Triton.
    """
    in_path, out_path = tmp_path / "cases.pt", tmp_path / "results.pt"
    torch.save({"cases": cases}, in_path)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(_WORKER), str(in_path), str(out_path)], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=_REPO_ROOT)
    if proc.returncode != 0:
        pytest.fail(f"interpreter worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return torch.load(out_path, weights_only=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``slow`` every test that runs kernels under the Triton interpreter."""
    for item in items:
        if "run_interpreted" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def run_interpreted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``run_interpreted(cases) -> results``: see :func:`_run_interpreted`."""

    def run(cases: list[dict[str, Any]], timeout: float = 600) -> list:
        return _run_interpreted(cases, tmp_path_factory.mktemp("interpret"), timeout)

    return run
