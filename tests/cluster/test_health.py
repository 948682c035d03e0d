"""Controller health checks (docs/architecture.md, 'Cluster and health'), in process: a fake clock
and fake roles for the
bookkeeping, and real role-host threads (loop and heartbeat) at a short interval for the
edge. A role that stops heartbeating, or heartbeats while its loop stands still, leaves the
roster after 3 missed beats and its peers get the new roster; a restarted role (new
incarnation) replaces its entry."""

from __future__ import annotations

import threading
import time

import pytest

from specmesh.cluster.controller import Controller
from specmesh.cluster.health import HealthMonitor
from specmesh.cluster.hosts.base import RoleHost, watch_model
from specmesh.cluster.hosts.drafter import _watch_models
from specmesh.cluster.hosts.gateway import least_loaded_verifier
from helpers.hosts import BareRoleHost


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


class Peer:
    """A fake role handle: records the rosters pushed to it."""

    def __init__(self) -> None:
        self.rosters: list[tuple[tuple[int, int], list[str]]] = []

    def update_roster(self, roster, version):
        self.rosters.append((version, sorted(r["instance_id"] for r in roster)))

    @property
    def last(self) -> list[str]:
        return self.rosters[-1][1]


def _info(iid: str, role: str, incarnation: int = 1) -> dict:
    return {"instance_id": iid, "role": role, "endpoint": f"tcp://127.0.0.1:1/{iid}",
            "incarnation": incarnation}


@pytest.fixture
def mesh():
    clock = Clock()
    c = Controller(interval_s=1.0, max_missed=3, clock=clock, hung_after_s=3.0)
    peers = {iid: Peer() for iid in ("prefill-0", "verifier-0", "drafter-0", "gateway-0")}
    for iid, peer in peers.items():
        c.register(_info(iid, iid.split("-")[0]), peer)
    return c, clock, peers


def _beat(c: Controller, iid: str, progress: int, incarnation: int = 1, load=None) -> dict:
    return c.heartbeat({"instance_id": iid, "incarnation": incarnation, "progress": progress,
                        "load": load or {}})


def _tick(c, clock, progress: dict[str, int], seconds: int, skip=()) -> None:
    """``seconds`` heartbeat intervals: every role but ``skip`` beats (its loop counter
    moving unless its progress is frozen with a negative step) and the controller checks."""
    for _ in range(seconds):
        clock.advance(1.0)
        for iid in list(progress):
            if iid in skip:
                continue
            if progress[iid] >= 0:
                progress[iid] += 1
            _beat(c, iid, abs(progress[iid]))
        c.check_health()


def test_monitor_dead_after_three_missed_beats_and_hung_when_progress_stops():
    clock = Clock()
    m = HealthMonitor(1.0, 3, clock)
    m.watch("a", 7)
    for i in range(5):
        clock.advance(1.0)
        assert m.beat("a", 7, i)
        assert m.status("a") == ""
    clock.advance(2.9)
    assert m.status("a") == ""  # 2 beats missed
    clock.advance(0.2)
    assert "dead" in m.status("a") and "3 missed" in m.status("a")
    assert m.check() == {"a": m.status("a")}
    # beating again, but the loop counter stands still
    m.watch("a", 7)
    for _ in range(2):
        clock.advance(1.0)
        m.beat("a", 7, 42)
    assert m.status("a") == ""
    for _ in range(3):
        clock.advance(1.0)
        m.beat("a", 7, 42)
    assert "hung" in m.status("a")
    clock.advance(1.0)
    m.beat("a", 7, 43)
    assert m.status("a") == ""
    # a beat of another incarnation is not one of this role's
    assert not m.beat("a", 6, 44) and not m.beat("nobody", 1, 0)
    with pytest.raises(ValueError):
        HealthMonitor(0, 3)


def test_a_role_that_stops_heartbeating_is_deregistered_and_its_peers_get_the_roster(mesh):
    c, clock, peers = mesh
    progress = dict.fromkeys(peers, 0)
    _tick(c, clock, progress, 5)
    assert len(c.get_roster()) == 4 and c.num_deregistered == 0
    version, pushed = c.version, len(peers["drafter-0"].rosters)
    _tick(c, clock, progress, 2, skip={"drafter-0"})  # 2 missed: still there
    assert "drafter-0" in {r["instance_id"] for r in c.get_roster()}
    _tick(c, clock, progress, 1, skip={"drafter-0"})  # the 3rd
    assert "drafter-0" not in {r["instance_id"] for r in c.get_roster()}
    assert c.version == version + 1 and c.num_deregistered == 1
    for iid in ("prefill-0", "verifier-0", "gateway-0"):  # the peers got the new roster
        assert peers[iid].rosters[-1] == ((c.epoch, c.version),
                                          ["gateway-0", "prefill-0", "verifier-0"])
    assert len(peers["drafter-0"].rosters) == pushed  # the dead role gets no pushes
    assert "dead" in c.health_report()["removed"]["drafter-0"]
    _tick(c, clock, progress, 3, skip={"drafter-0"})
    assert c.version == version + 1  # removed once


def test_a_hung_role_is_deregistered_and_readmitted_when_its_loop_turns_again(mesh):
    c, clock, peers = mesh
    progress = dict.fromkeys(peers, 0)
    _tick(c, clock, progress, 3)
    progress["verifier-0"] = -progress["verifier-0"]  # alive, loop stuck
    _tick(c, clock, progress, 2)
    assert "verifier-0" in {r["instance_id"] for r in c.get_roster()}
    _tick(c, clock, progress, 1)
    assert "verifier-0" not in {r["instance_id"] for r in c.get_roster()}
    assert "hung" in c.health_report()["removed"]["verifier-0"]
    assert peers["gateway-0"].last == ["drafter-0", "gateway-0", "prefill-0"]
    _tick(c, clock, progress, 3)  # still stuck: stays out
    assert "verifier-0" not in {r["instance_id"] for r in c.get_roster()}
    progress["verifier-0"] = -progress["verifier-0"]  # the loop turns again
    _tick(c, clock, progress, 1)
    assert "verifier-0" in {r["instance_id"] for r in c.get_roster()}
    assert peers["gateway-0"].last == ["drafter-0", "gateway-0", "prefill-0", "verifier-0"]
    assert peers["verifier-0"].last == peers["gateway-0"].last  # its handle is back too


def test_a_restarted_role_replaces_its_entry(mesh):
    c, clock, peers = mesh
    progress = dict.fromkeys(peers, 0)
    _tick(c, clock, progress, 2)
    new = Peer()
    c.register(_info("drafter-0", "drafter", incarnation=2), new)
    drafters = [r for r in c.get_roster() if r["role"] == "drafter"]
    assert [r["incarnation"] for r in drafters] == [2]
    assert peers["verifier-0"].rosters[-1][0] == (c.epoch, c.version)
    assert c.register(_info("drafter-0", "drafter", incarnation=2), new) == c.version
    # only the new incarnation's beats keep the entry: the old life's late beats do not
    for _ in range(3):
        clock.advance(1.0)
        for iid in ("prefill-0", "verifier-0", "gateway-0"):
            progress[iid] += 1
            _beat(c, iid, progress[iid])
        _beat(c, "drafter-0", clock.t, incarnation=1)
        c.check_health()
    assert "drafter-0" not in {r["instance_id"] for r in c.get_roster()}
    c.register(_info("drafter-0", "drafter", incarnation=3), new)  # restarted once more
    for _ in range(5):
        clock.advance(1.0)
        _beat(c, "drafter-0", clock.t, incarnation=3)
        c.check_health()
    assert [r["incarnation"] for r in c.get_roster() if r["role"] == "drafter"] == [3]
    assert c.health_report()["roles"]["drafter-0"]["status"] == ""


def test_unknown_roles_are_asked_to_register_and_loads_come_back(mesh):
    c, _, _ = mesh
    reply = _beat(c, "verifier-0", 1, load={"num_free_blocks": 9, "num_waiting": 0})
    assert reply["register"] is False
    assert reply["loads"]["verifier-0"] == {"num_free_blocks": 9, "num_waiting": 0}
    assert set(reply["loads"]) == {"prefill-0", "verifier-0", "drafter-0", "gateway-0"}
    # a restarted controller does not know the roles: they register again
    assert Controller().heartbeat({"instance_id": "x", "incarnation": 1})["register"] is True
    # a role deregistered on purpose is not asked back
    c.deregister("prefill-0")
    assert _beat(c, "prefill-0", 5)["register"] is False


def test_least_loaded_verifier_prefers_no_queue_then_fewest_in_flight_then_kv_room():
    ready = ["v0", "v1", "v2"]
    assert least_loaded_verifier(ready, {}, {}) == "v0"
    assert least_loaded_verifier(ready, {"v0": 2, "v1": 1, "v2": 1}, {}) == "v1"
    loads = {"v1": {"num_free_blocks": 10, "num_waiting": 0},
             "v2": {"num_free_blocks": 50, "num_waiting": 0}}
    assert least_loaded_verifier(ready, {"v0": 2, "v1": 1, "v2": 1}, loads) == "v2"
    loads["v2"]["num_waiting"] = 3  # a queue: avoided while another has none
    assert least_loaded_verifier(ready, {"v0": 2, "v1": 1, "v2": 1}, loads) == "v1"
    assert least_loaded_verifier(["v2"], {}, loads) == "v2"


# -- the role host's threads against a real controller (short interval, real time) ----------

INTERVAL_S = 0.2


class _Worker:
    """A worker whose step blocks while ``hang`` is set (a step that never returns)."""

    def __init__(self) -> None:
        self.hang = threading.Event()
        self.release = threading.Event()

    def step(self, timeout_s: float) -> None:
        if self.hang.is_set():
            self.release.wait()
        time.sleep(min(timeout_s, INTERVAL_S / 5))


def _role_host(iid: str, incarnation: int) -> RoleHost:
    host = object.__new__(BareRoleHost)  # the loop and heartbeat threads only
    host.instance_id, host.incarnation = iid, incarnation
    host.loop_turns, host._error = 0, ""
    host._beating, host._stop = threading.Event(), threading.Event()
    host.worker = _Worker()
    host.loads_seen = []
    host.on_loads = host.loads_seen.append
    host._thread = threading.Thread(target=host._loop, daemon=True)
    host._thread.start()
    return host


#: seconds after which a wait for something that must happen fails as hung (never a bound on
#: how fast: a busy machine only makes it later)
HANG_S = 60.0


def _wait(cond, timeout: float = HANG_S) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(INTERVAL_S / 5)
    return time.monotonic() - t0


def test_role_host_heartbeats_show_progress_and_a_hung_loop_leaves_the_roster():
    c = Controller(interval_s=INTERVAL_S, max_missed=3, hung_after_s=None)
    stop = threading.Event()

    def checker():
        while not stop.wait(INTERVAL_S):
            c.check_health()

    hosts = {iid: _role_host(iid, 1) for iid in ("prefill-0", "verifier-0")}
    watcher = Peer()
    for iid, host in hosts.items():
        c.register(_info(iid, iid.split("-")[0]), watcher if iid == "prefill-0" else None)
        host.start_heartbeat(c.heartbeat, INTERVAL_S)
    threading.Thread(target=checker, daemon=True).start()
    try:
        time.sleep(INTERVAL_S * 5)
        assert len(c.get_roster()) == 2 and c.num_deregistered == 0
        assert hosts["verifier-0"].heartbeat()["progress"] > 0
        assert hosts["verifier-0"].loads_seen  # the controller's reply reached the host
        hosts["verifier-0"].worker.hang.set()
        took = _wait(lambda: len(c.get_roster()) == 1)
        assert took >= INTERVAL_S  # not at once: after missed intervals
        assert "hung" in c.health_report()["removed"]["verifier-0"]
        assert watcher.last == ["prefill-0"]
        hosts["verifier-0"].worker.hang.clear()
        hosts["verifier-0"].worker.release.set()
        _wait(lambda: len(c.get_roster()) == 2)  # re-admitted
        hosts["prefill-0"]._beating.set()  # stop() silences the heartbeats: dead
        _wait(lambda: len(c.get_roster()) == 1)
        assert "dead" in c.health_report()["removed"]["prefill-0"]
    finally:
        stop.set()
        for host in hosts.values():
            host._beating.set()
            host.worker.release.set()
            host._stop.set()


def test_defaults_tolerate_slow_heartbeats_and_long_steps():
    """A loaded 2-core machine delayed a live prefill's heartbeats by 3.4 s, and one prefill
    chunk or verify step may take seconds: neither may deregister a live role by default."""
    from specmesh.cluster.health import HUNG_AFTER_S, MAX_MISSED_BEATS

    clock = Clock()
    c = Controller(clock=clock)
    m = c.health
    assert m.bound_s >= 10 and m.hung_after_s == HUNG_AFTER_S >= 60
    m.watch("p", 1)
    clock.advance(5.0)  # heartbeats 5 s late
    assert m.beat("p", 1, 1) and m.status("p") == ""
    for _ in range(59):  # beating, but one step runs for a minute
        clock.advance(1.0)
        m.beat("p", 1, 1)
    assert m.status("p") == ""
    clock.advance(MAX_MISSED_BEATS * 1.0)
    assert "dead" in m.status("p")


def test_a_long_forward_counts_as_progress_a_stuck_loop_does_not():
    """Model layers run by a watched model move the heartbeat's counter (a long prefill on a
    CPU is not a hang); nothing else does."""
    import torch

    host = object.__new__(BareRoleHost)
    host.loop_turns = 0
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)]))
    watch_model(model)
    before = host.progress()
    for layer in model[0]:
        layer(torch.zeros(1, 4))
    assert host.progress() == before + 3
    assert host.progress() == before + 3  # nothing ran: no progress

    class Proposer:  # a model-based drafter's proposer: its model, or a runner holding one
        def __init__(self):
            self.runner = type("Runner", (), {"model": torch.nn.Sequential(
                torch.nn.ModuleList([torch.nn.Linear(4, 4)]))})()

    proposer = Proposer()
    _watch_models(proposer)
    proposer.runner.model[0][0](torch.zeros(1, 4))
    assert host.progress() == before + 4


def test_gateway_health_turns_503_when_the_only_prefill_worker_is_deregistered(mesh):
    """The roster the health check pushes is what the gateway's /health reads: with its only
    prefill worker gone, the reason names it; back when a prefill worker registers again."""
    from types import SimpleNamespace

    from specmesh.cluster.hosts.gateway import GatewayHost

    c, clock, peers = mesh
    gw = object.__new__(GatewayHost)
    gw.num_calls, gw.verifiers, gw.prefills = 0, [], []
    gw._roster_version, gw._roster_lock = None, threading.Lock()
    gw.mailbox = SimpleNamespace(call_soon=lambda fn: fn(), connect=lambda *a: None,
                                 ready=lambda peer: True, allow=lambda keys: None,
                                 set_peer_keys=lambda keys: None)
    gw.backend = SimpleNamespace(set_verifiers=lambda verifiers: None)
    c.register(_info("gateway-1", "gateway"), gw)
    assert gw.not_ready_reason() == ""
    progress = dict.fromkeys(peers, 0)
    progress["gateway-1"] = 0
    _tick(c, clock, progress, 3, skip={"prefill-0"})
    assert gw.not_ready_reason() == "no prefill worker in the roster"
    c.register(_info("prefill-0", "prefill", incarnation=2), peers["prefill-0"])
    assert gw.not_ready_reason() == ""


def test_a_silent_role_whose_actor_is_gone_leaves_after_three_missed_beats(mesh):
    """docs/architecture.md, 'Cluster and health': dead after 3 missed heartbeats when Ray says the
    actor is gone (the Ray
    edge's ActorProbes asks it about every role in silent_roles); a silent role whose actor
    still answers stays until MAX_MISSED_BEATS; a report for another incarnation is ignored."""
    from specmesh.cluster.health import MAX_MISSED_BEATS

    clock = Clock()
    c = Controller(clock=clock)  # the defaults: dead after 10 missed unless Ray confirms
    peers = {iid: Peer() for iid in ("prefill-0", "drafter-0")}
    for iid, peer in peers.items():
        c.register(_info(iid, iid.split("-")[0]), peer)
    progress = {"prefill-0": 0, "drafter-0": 0}
    _tick(c, clock, progress, 2, skip=("drafter-0",))
    assert c.silent_roles() == {}  # 2 missed: not suspect yet
    _tick(c, clock, progress, 1, skip=("drafter-0",))
    assert set(c.silent_roles()) == {"drafter-0"}
    handle, incarnation = c.silent_roles()["drafter-0"]
    assert handle is peers["drafter-0"] and incarnation == 1
    _tick(c, clock, progress, 3, skip=("drafter-0",))
    assert len(c.get_roster()) == 2  # its actor may be alive (a starved role): not dead yet
    assert not c.actor_gone("drafter-0", 2, "ActorDiedError")  # another incarnation's news
    assert c.actor_gone("drafter-0", 1, "ActorDiedError")
    assert [r["instance_id"] for r in c.get_roster()] == ["prefill-0"]
    assert peers["prefill-0"].last == ["prefill-0"]  # its peers get the new roster
    assert c.num_deregistered == 1 and not c.actor_gone("drafter-0", 1, "again")
    assert "actor is gone" in c.health_report()["removed"]["drafter-0"]
    assert "dead" in c.health_report()["removed"]["drafter-0"]
    # a dead actor does not come back as the same incarnation: not asked to register again
    assert _beat(c, "drafter-0", 99)["register"] is False
    # while a silent role whose actor lives is dead only after MAX_MISSED_BEATS
    _tick(c, clock, progress, MAX_MISSED_BEATS - 1, skip=("prefill-0",))
    assert len(c.get_roster()) == 1
    _tick(c, clock, progress, 1, skip=("prefill-0",))
    assert c.get_roster() == []
