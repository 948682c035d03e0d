"""CPU backends for tests (engine/backend.py): this machine's, with given overrides."""

from __future__ import annotations

from specmesh.engine.backend import BackendOverrides, CpuBackend, cpu_backend


def backend(**overrides: bool) -> CpuBackend:
    """This machine's CPU backend with ``overrides`` (``compiled_stack=False``...), the
    environment's ``SPECMESH_*`` switches ignored, so a test gets the choices it asks for."""
    return cpu_backend(BackendOverrides(**overrides))
