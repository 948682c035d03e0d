"""Role hosts for tests that exercise one piece of the host (roster plumbing, loop and
heartbeat threads) without its mailbox, model or worker."""

from __future__ import annotations

from specmesh.cluster.hosts.base import RoleHost


class BareRoleHost(RoleHost):
    """A concrete RoleHost (RoleHost is abstract) for ``object.__new__``: no ``__init__`` runs,
    so a test sets only the attributes the piece under test reads."""

    def build_worker(self) -> None:
        return None
