"""The ``ray up`` config for a run of namespace hosts (issue 39; the hosts are
cluster/netns_hosts.py): deploy/cluster-local.yaml is written for the example subnet
10.77.0.x, a key under ~/.ssh and a checkout in /opt/specmesh; :func:`render_config` rewrites
it for one run's subnet, key, checkout, venv and token file."""

from __future__ import annotations

import ipaddress
import re
from typing import Protocol


class _Hosts(Protocol):
    """What :func:`render_config` reads of a run (cluster.netns_hosts.NetnsHosts)."""

    subnet: str

    @property
    def key(self) -> str: ...


def render_config(text: str, hosts: _Hosts, repo: str, venv: str, token_path: str,
                  cluster_name: str | None = None, launch_args: str | None = None) -> str:
    """deploy/cluster-local.yaml's text for these hosts: its example subnet (10.77.0.x) is
    replaced by the run's, its key by the run's key, the checkout ``/opt/specmesh`` and its
    venv by ``repo`` and ``venv``, the local token file by ``token_path``; optionally the
    cluster's name and the roles' launch arguments (``LAUNCH_ARGS``)."""
    net = ipaddress.ip_network(hosts.subnet)
    prefix = str(net[0]).rsplit(".", 1)[0] + "."
    out = (text.replace("/opt/specmesh/.venv", venv).replace("/opt/specmesh", repo)
           .replace("~/.ssh/specmesh_netns_key", hosts.key)
           .replace('"~/.ray/auth_token": "~/.ray/auth_token"',
                    f'"~/.ray/auth_token": "{token_path}"')
           .replace("10.77.0.", prefix))
    if cluster_name:
        out = out.replace("cluster_name: specmesh-local", f"cluster_name: {cluster_name}")
    if launch_args is not None:
        out = re.sub(r'LAUNCH_ARGS="[^"]*"', f'LAUNCH_ARGS="{launch_args}"', out)
    return out
