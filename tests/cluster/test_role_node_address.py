"""Issue 9 scenario 11: a role binds and advertises the IP of the node it runs on, resolved
where it runs (Ray's node IP inside the actor), not the host it was launched with: after Ray
restarts it on another node its roster entry (ZMQ endpoint, metrics URL) names the new node.
Two "nodes" on one machine: 127.0.0.1 and 127.0.0.2 (all of 127/8 is loopback on Linux)."""

from __future__ import annotations

import sys
import threading
import time
import types

from specmesh.cluster.cli import build_parser
from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.hosts.base import RoleHost
from specmesh.cluster.loopback import node_ip_address, role_address
from specmesh.protocol.curve import CurveKeys
from specmesh.protocol.enums import Role
from specmesh.protocol.messages import ModelIdentity
from specmesh.protocol.step_profile import StepProfile
from specmesh.protocol.zmq_transport import ZmqMailbox


class FakeRay(types.ModuleType):
    """Stands for ``ray`` inside a role actor on node ``ip``."""

    def __init__(self, ip: str) -> None:
        super().__init__("ray")
        self.ip = ip
        self.util = types.SimpleNamespace(get_node_ip_address=lambda: self.ip)

    def is_initialized(self) -> bool:
        return True


class _IdleWorker:
    """Serves its mailbox (answers Hello) and nothing else."""

    def __init__(self, mailbox) -> None:
        self.mailbox = mailbox
        self.stats = types.SimpleNamespace()
        self.profile = StepProfile()

    def step(self, timeout_s: float = 0.0) -> int:
        self.mailbox.recv(min(timeout_s, 0.05))
        return 0

    def run(self, stop: threading.Event, idle_timeout_s: float, on_error=None) -> None:
        while not stop.is_set():
            self.mailbox.recv(0.05)


class TinyRoleHost(RoleHost):
    """A role with no model: only identity, mailbox, metrics endpoint and an idle loop."""

    role = Role.DRAFTER

    def set_threads(self) -> None:
        pass

    def model_identity(self) -> ModelIdentity:
        return ModelIdentity(name="m", vocab_size=10, dtype="float32", num_layers=1,
                             num_kv_heads=1, head_dim=4, block_size=16, kv_cache_dtype="float32")

    def build_worker(self):
        return _IdleWorker(self.mailbox)


def _dial(host: RoleHost) -> None:
    """Handshake with ``host`` at its advertised endpoint: it is really bound there. A role
    with CurveZMQ (``curve`` in its entry) is dialled with its key, the probe's admitted."""
    entry = host.describe()
    mb = ZmqMailbox("probe", "verifier", host="127.0.0.1",  # the role's own identity
                    model=TinyRoleHost.model_identity(None),
                    draft_method=ClusterConfig().verifier.draft_method,
                    keys=CurveKeys.generate())
    if entry["curve"]:
        host.mailbox.allow(frozenset({mb.keys.public}))
        mb.set_peer_keys({"drafter-0": entry["curve_key"].encode()})
    try:
        mb.connect("drafter-0", entry["endpoint"])
        deadline = time.monotonic() + 5
        while not mb.ready("drafter-0"):
            assert time.monotonic() < deadline, f"nothing answers at {entry['endpoint']}"
            mb.recv(0.02)
    finally:
        mb.close()


def test_a_role_restarted_on_another_node_advertises_that_node(monkeypatch):
    cfg = build_parser().parse_args(["launch", "drafter"])
    assert cfg.host == "auto"  # `specmesh launch` no longer fixes the address at launch
    cfg = ClusterConfig(host=cfg.host)
    for node_ip in ("127.0.0.1", "127.0.0.2"):  # first start, then a restart elsewhere
        monkeypatch.setitem(sys.modules, "ray", FakeRay(node_ip))
        host = TinyRoleHost("drafter-0", cfg)
        try:
            entry = host.describe()
            assert entry["endpoint"].startswith(f"tcp://{node_ip}:"), entry
            assert entry["metrics_url"].startswith(f"http://{node_ip}:"), entry
            assert not entry["curve"]  # a loopback bind: plain TCP unless asked
            _dial(host)
        finally:
            host.stop()


def test_node_ip_resolution(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", FakeRay("127.0.0.2"))
    assert node_ip_address() == "127.0.0.2"
    assert role_address("auto") == ("127.0.0.2", "127.0.0.2")
    assert role_address("") == ("127.0.0.2", "127.0.0.2")
    assert role_address("0.0.0.0") == ("0.0.0.0", "127.0.0.2")  # every interface
    assert role_address("127.0.0.3") == ("127.0.0.3", "127.0.0.3")  # as given
    monkeypatch.delitem(sys.modules, "ray")
    assert node_ip_address() == "127.0.0.1"  # tests: the loopback setting (conftest)
    assert ClusterConfig().host == "auto"


def test_a_wildcard_bind_advertises_the_node_ip(monkeypatch):
    """The role asks for every interface; the socket really binds loopback only (tests never
    listen beyond 127.0.0.1), and what is advertised is the node IP, never 0.0.0.0."""
    import zmq

    asked = []
    real_bind = zmq.Socket.bind

    def loopback_bind(sock, addr):
        asked.append(addr)
        return real_bind(sock, addr.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:"))

    monkeypatch.setattr(zmq.Socket, "bind", loopback_bind)
    monkeypatch.setitem(sys.modules, "ray", FakeRay("127.0.0.1"))
    host = TinyRoleHost("drafter-0", ClusterConfig(host="0.0.0.0"))
    assert any(a.startswith("tcp://0.0.0.0:") for a in asked)
    try:
        entry = host.describe()
        assert entry["endpoint"].startswith("tcp://127.0.0.1:") and "0.0.0.0" not in str(entry)
        # every interface: other hosts can reach it, so CurveZMQ by default
        assert entry["curve"] and len(entry["curve_key"]) == 40
        _dial(host)
    finally:
        host.stop()

