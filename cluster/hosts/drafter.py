"""Host of the drafter role: a DrafterWorker with the configured draft method.

The n-gram drafter needs no weights: its model identity comes from the model's config files.
"""

from __future__ import annotations

from cluster.hosts.base import RoleHost
from protocol.enums import Role


class DrafterHost(RoleHost):
    """Answers the verifiers that dial it; dials nobody."""

    role = Role.DRAFTER

    def build_worker(self):
        import drafter.proposers  # noqa: F401  (registers the built-in methods)
        from drafter.worker import DrafterWorker

        return DrafterWorker(self.cfg.drafter, self.mailbox)
