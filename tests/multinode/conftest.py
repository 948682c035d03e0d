"""The M:N cluster run shared by test_m_to_n.py and test_m_to_n_faults.py (one cluster per
kind of hosts), and the namespace hosts (cluster/netns_hosts.py) shared by every test that runs
across them: one set per session."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from _mn_faults import MODEL_CONTEXT
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


@pytest.fixture(scope="session")
def mn_model_dir(tiny_model_dir, tmp_path_factory):
    """The session's tiny model with ``MODEL_CONTEXT`` positions instead of 2,048 (the same
    weights and outputs: nothing but the bound reads ``max_position_embeddings``, RoPE has no
    scaling), so that the drafter-restart requests can outlive a Ray restart
    (tests/multinode/_mn_faults.py, ``RESTART_MAX_TOKENS``)."""
    path = tmp_path_factory.mktemp("tiny-llama-long") / "model"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    assert rope.get("rope_type", "default") == "default", config  # scaled: outputs would change
    config["max_position_embeddings"] = MODEL_CONTEXT
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return str(path)


@pytest.fixture(scope="session", params=HOSTS)
def m_to_n(request, mn_model_dir, cpu_kernels):
    """(driver report, reference): see tests/multinode/_mn_setup.py (the kernel cache warm
    before its roles start), on the hosts of the parameter, with ``mn_model_dir``'s model."""
    hosts = request.getfixturevalue("netns_hosts") if request.param == "netns" else None
    yield from run_driver(mn_model_dir, hosts)
