"""The M:N cluster run shared by test_m_to_n.py and test_m_to_n_faults.py (one cluster per
kind of hosts), and the namespace hosts (cluster/netns_hosts.py) shared by every test that runs
across them: one set per session."""

from __future__ import annotations

import subprocess

import pytest
from _mn_setup import run_driver

#: the hosts a multi-node run is spread over: every Ray node on 127.0.0.1 (the fast check), or
#: each on its own namespace host with its own address, over veth links (issue 39)
HOSTS = ["loopback", "netns"]


@pytest.fixture(scope="session")
def netns_hosts():
    """Three namespace hosts (h0, h1, h2) with sshd and the run's keys; removed at the end of
    the session (also when a test fails). Needs root, iproute2 and openssh-server (.ci/run
    installs them): without them this fails, it does not skip."""
    from specmesh.cluster.netns_hosts import NetnsHosts

    hosts = NetnsHosts(count=3)
    try:
        hosts.up()
    except RuntimeError as err:
        pytest.fail(f"namespace hosts: {err}")
    names = [h.netns for h in hosts.hosts]
    try:
        yield hosts
    finally:
        hosts.down()
    # nothing of the hosts is left: no namespace, no veth, no bridge
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not [n for n in names if n in listed], listed
    assert f"smb{hosts.tag}" not in links and f"smv{hosts.tag}" not in links, links


@pytest.fixture(scope="session", params=HOSTS)
def m_to_n(request, tiny_model_dir, cpu_kernels):
    """(driver report, reference): see tests/multinode/_mn_setup.py (the kernel cache warm
    before its roles start), on the hosts of the parameter."""
    hosts = request.getfixturevalue("netns_hosts") if request.param == "netns" else None
    yield from run_driver(tiny_model_dir, hosts)
