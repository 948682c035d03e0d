"""Shared steps of the compiled-kernel tests (kernels/cpu_build.py)."""

from __future__ import annotations

import logging


def loads_with_a_failing_compiler(kernel, monkeypatch, tmp_path, caplog) -> bool:  # noqa: ANN001
    """Load ``kernel`` (a :class:`kernels.cpu_build.CpuKernel`) afresh with a compiler that
    always fails (``CXX=false``) and its build cache in ``tmp_path``; returns whether it
    loaded. The warning it logs lands in ``caplog``."""
    monkeypatch.setenv("SPECMESH_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setattr(kernel, "lib", None)
    monkeypatch.setattr(kernel, "failed", None)
    with caplog.at_level(logging.WARNING, logger="specmesh.kernels.cpu_build"):
        return kernel.library() is not None
