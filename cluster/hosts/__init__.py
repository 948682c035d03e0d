"""Role hosts: one class per role (prefill, verifier, drafter, gateway) over :class:`RoleHost`.

A host owns one worker, its ZMQ mailbox and its loop thread; Ray wraps hosts in
cluster/actors.py. Nothing here is on the per-token path.
"""

from __future__ import annotations

from specmesh.cluster.hosts.base import RoleHost
from specmesh.cluster.hosts.drafter import DrafterHost
from specmesh.cluster.hosts.gateway import GatewayHost
from specmesh.cluster.hosts.prefill import PrefillHost
from specmesh.cluster.hosts.verifier import VerifierHost
from specmesh.protocol.enums import Role

#: role -> host class
HOSTS: dict[Role, type[RoleHost]] = {Role.PREFILL: PrefillHost, Role.VERIFIER: VerifierHost,
                                     Role.DRAFTER: DrafterHost, Role.GATEWAY: GatewayHost}

__all__ = ["HOSTS", "DrafterHost", "GatewayHost", "PrefillHost", "RoleHost", "VerifierHost"]
