"""The namespace hosts of cluster/netns_hosts.py (issue 39), without Ray: each host has its own
address on the bridge, loopback, PID namespace, root home and an sshd that admits the run's
key; everything is gone after ``down()``, after a set-up that failed half-way, and after a run
whose process was killed (the next run removes it). Needs root, iproute2 and openssh-server
(.ci/run installs them)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from specmesh.cluster import netns_hosts
from specmesh.cluster.netns_config import render_config
from specmesh.cluster.netns_hosts import NetnsHosts, remove_stale

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _left(tag: str) -> list[str]:
    """Namespaces and links of run ``tag`` that still exist."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    out += subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if tag in line]


@pytest.fixture
def two_hosts():
    hosts = NetnsHosts(count=2)
    try:
        yield hosts.up()
    finally:
        hosts.down()


def test_each_host_has_its_address_sshd_pid_namespace_and_home(two_hosts):
    hosts = two_hosts
    a, b = hosts.hosts
    assert hosts.in_subnet(a.ip) and hosts.in_subnet(b.ip) and a.ip != b.ip
    got = subprocess.run(hosts.ssh_argv(a, "hostname -I; echo ~; ps -e -o pid= | wc -l; "
                                           f"exec 3<>/dev/tcp/{b.ip}/22 && echo reached"),
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    addresses, home, nprocs, reached = got.stdout.split("\n")[:4]
    assert addresses.split() == [a.ip]  # eth0 only (loopback is not listed)
    assert home == hosts.home(a)
    assert int(nprocs) < 10  # the host's own PID namespace: sshd and this session
    assert reached == "reached"  # the other host, over the bridge
    inside = subprocess.run(hosts.argv(b, ["cat", "/sys/class/net/lo/operstate",
                                           "/sys/class/net/eth0/address"]),
                            capture_output=True, text=True)
    assert inside.returncode == 0 and inside.stdout.split()[0] == "unknown", inside  # lo up
    tag, dir_ = hosts.tag, hosts.dir
    hosts.down()
    assert _left(tag) == [] and not Path(dir_).exists()
    assert hosts.pids(a) == []


def test_a_set_up_failing_half_way_leaves_nothing(monkeypatch):
    hosts = NetnsHosts(count=2)

    def broken_sshd(self, h):
        raise RuntimeError("sshd broke")

    monkeypatch.setattr(NetnsHosts, "_sshd", broken_sshd)
    with pytest.raises(RuntimeError, match="sshd broke"):
        hosts.up()
    assert hosts.tag and _left(hosts.tag) == [] and not Path(hosts.dir).exists()


def test_the_next_run_removes_the_hosts_of_a_killed_one():
    killed = NetnsHosts(count=2).up()
    try:
        dead = subprocess.Popen(["true"])  # a process that has exited
        dead.wait()
        killed.owner_pid = dead.pid
        killed._save()
        assert killed.dir in remove_stale()
        assert _left(killed.tag) == [] and not Path(killed.dir).exists()
    finally:
        killed.down()


def test_the_rendered_deploy_config_names_only_the_run(two_hosts):
    """deploy/cluster-local.yaml rendered for a run: its hosts, key, checkout and token, and
    still valid for Ray (the checks of test_deploy_configs.py)."""
    from test_deploy_configs import _validated

    hosts = two_hosts
    hosts.subnet = "10.77.9.0/24"  # as if the default subnet were taken
    text = render_config((DEPLOY / "cluster-local.yaml").read_text(), hosts, "/src/x",
                         "/src/x/.venv", "/tmp/tok", cluster_name="c1", launch_args="--a b")
    cfg = _validated(yaml.safe_load(text))
    assert cfg["provider"]["head_ip"] == "10.77.9.2"
    assert cfg["provider"]["worker_ips"] == ["10.77.9.3", "10.77.9.4"]
    assert cfg["auth"]["ssh_private_key"] == hosts.key and cfg["cluster_name"] == "c1"
    assert cfg["file_mounts"] == {"~/.ray/auth_token": "/tmp/tok"}
    assert "10.77.0." not in text and "/opt/specmesh" not in text
    assert 'LAUNCH_ARGS="--a b"' in text and "/src/x/.venv/bin/activate" in text


def test_no_free_subnet_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(netns_hosts, "SUBNETS", ["127.0.0.0/24"])  # overlaps the loopback
    hosts = NetnsHosts(count=2)
    with pytest.raises(RuntimeError, match="no free subnet"):
        hosts.up()
    assert not Path(hosts.dir).exists()
