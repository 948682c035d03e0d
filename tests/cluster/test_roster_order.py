"""Roster pushes reach a role's threaded Ray actor concurrently and in any order: a late,
older push must not undo a newer roster (seen in CI: a gateway left with a roster that had no
verifier, so the cluster never became ready)."""

from __future__ import annotations

import threading

from specmesh.cluster.controller import Controller
from helpers.hosts import BareRoleHost


class _InlineMailbox:
    def call_soon(self, fn):
        fn()


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
