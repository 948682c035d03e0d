"""The network of a run of namespace hosts (issue 39; the hosts are cluster/netns_hosts.py):
a bridge in this machine's namespace holding the subnet's first address, and per host a
network namespace whose ``eth0`` (one end of a veth pair, the other end on the bridge) has the
host's address, its loopback up and its default route via the bridge. Commands are iproute2's
``ip``; every step raises RuntimeError with the failed command and its stderr."""

from __future__ import annotations

import ipaddress
import subprocess

from specmesh.cluster.netns_sshd import run


def free_subnet(subnets: list[str]) -> str:
    """The first of ``subnets`` that overlaps no network of this machine's addresses.

    Raises:
        RuntimeError: all of them are in use.
    """
    used = _used_networks()
    subnet = next((s for s in subnets if not any(
        ipaddress.ip_network(s).overlaps(u) for u in used)), "")
    if not subnet:
        raise RuntimeError(f"no free subnet among {subnets[0]}..{subnets[-1]}")
    return subnet


def add_bridge(bridge: str, address: str, prefixlen: int) -> None:
    """Bridge ``bridge``, up, holding ``address/prefixlen``."""
    ip("link", "add", bridge, "type", "bridge")
    ip("addr", "add", f"{address}/{prefixlen}", "dev", bridge)
    ip("link", "set", bridge, "up")


def add_host_link(netns: str, veth: str, peer: str, address: str, prefixlen: int,
                  bridge: str, gateway: str) -> None:
    """Namespace ``netns`` with ``eth0`` (veth ``peer`` renamed) at ``address/prefixlen`` and
    its default route via ``gateway``; the other end ``veth`` joins ``bridge``."""
    ip("netns", "add", netns)
    ip("link", "add", veth, "type", "veth", "peer", "name", peer)
    ip("link", "set", peer, "netns", netns)
    ip("-n", netns, "link", "set", peer, "name", "eth0")
    ip("-n", netns, "addr", "add", f"{address}/{prefixlen}", "dev", "eth0")
    ip("-n", netns, "link", "set", "eth0", "up")
    ip("-n", netns, "link", "set", "lo", "up")
    # as a real host has: the route out goes through the bridge's address (nothing
    # is forwarded further unless this machine forwards)
    ip("-n", netns, "route", "add", "default", "via", gateway)
    ip("link", "set", veth, "master", bridge)
    ip("link", "set", veth, "up")


def ip(*args: str, check: bool = True) -> None:
    """``ip ARGS`` (iproute2); with ``check``, a failure raises RuntimeError."""
    run(["ip", *args], check=check)


def _used_networks() -> list:
    """The networks of every IPv4 address of this machine's namespace."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True,
                         check=True).stdout
    nets = []
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            nets.append(ipaddress.ip_interface(parts[parts.index("inet") + 1]).network)
    return nets
