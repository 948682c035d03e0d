"""Roster pushes reach a role's threaded Ray actor concurrently and in any order: a late,
older push must not undo a newer roster (seen in CI: a gateway left with a roster that had no
verifier, so the cluster never became ready)."""

from __future__ import annotations

import threading

from specmesh.cluster.controller import Controller
from helpers.hosts import BareRoleHost


class _InlineMailbox:
    allowed: frozenset = frozenset()
    peer_keys: dict = {}

    def call_soon(self, fn):
        fn()

    def allow(self, keys):
        self.allowed = keys

    def set_peer_keys(self, keys):
        self.peer_keys = keys


def _host():
    host = object.__new__(BareRoleHost)  # only the roster plumbing, no sockets or model
    host.num_calls = 0
    host.mailbox = _InlineMailbox()
    host._roster_version = None
    host._roster_lock = threading.Lock()
    host.applied = []
    host.apply_roster = lambda roster: host.applied.append([r["instance_id"] for r in roster])
    return host


def test_an_older_roster_arriving_late_is_dropped():
    host = _host()
    host.update_roster([{"instance_id": "p"}, {"instance_id": "v"}], (7, 2))
    host.update_roster([{"instance_id": "p"}], (7, 1))  # late
    assert host.applied == [["p", "v"]]
    host.update_roster([{"instance_id": "v"}], (7, 3))
    # a restarted controller (new epoch) counts from 1 again: taken
    host.update_roster([{"instance_id": "x"}], (9, 1))
    assert host.applied == [["p", "v"], ["v"], ["x"]]
    host.update_roster([{"instance_id": "y"}])  # unversioned (a direct call): taken
    assert host.applied[-1] == ["y"]


def test_the_curve_keys_follow_the_newest_roster_only():
    """The public keys a role admits (CurveZMQ) are the newest roster's, applied at once; a
    late older roster neither adds its keys back nor drops the newer ones."""
    host = _host()
    a = {"instance_id": "a", "curve": True, "curve_key": "A" * 40}
    b = {"instance_id": "b", "curve": False, "curve_key": "B" * 40}
    host.update_roster([a, b], (7, 2))
    assert host.mailbox.allowed == {b"A" * 40, b"B" * 40}
    assert host.mailbox.peer_keys == {"a": b"A" * 40}  # b's ROUTER takes plain TCP
    host.update_roster([a], (7, 1))  # late
    assert host.mailbox.allowed == {b"A" * 40, b"B" * 40}
    host.update_roster([b], (7, 3))
    assert host.mailbox.allowed == {b"B" * 40} and host.mailbox.peer_keys == {}


def test_controller_pushes_increasing_versions_of_one_epoch():
    pushed = []

    class Handle:
        def update_roster(self, roster, version):
            pushed.append((len(roster), version))

    c = Controller()
    c.register({"instance_id": "a", "role": "prefill", "endpoint": "e", "incarnation": 1},
               Handle())
    c.register({"instance_id": "b", "role": "verifier", "endpoint": "e", "incarnation": 1})
    c.deregister("b")
    assert [n for n, _ in pushed] == [1, 2, 1]
    assert [v[1] for _, v in pushed] == [1, 2, 3] and {v[0] for _, v in pushed} == {c.epoch}
