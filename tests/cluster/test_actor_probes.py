"""The controller actor's probes through a real Ray (docs/architecture.md, 'Cluster and health'): a
role that
stops heartbeating while its actor lives stays in the roster (a starved role is not dead); once
its actor is killed it leaves within a few heartbeat intervals, long before MAX_MISSED_BEATS."""

from __future__ import annotations

import time

import pytest
import ray

from specmesh.cluster.actors import ControllerActor
from specmesh.cluster.health import HEARTBEAT_INTERVAL_S, MAX_MISSED_BEATS, SUSPECT_MISSED_BEATS

pytestmark = pytest.mark.ray


@ray.remote(num_cpus=0)
class SilentRole:
    """A role actor that registered and never sends a heartbeat, but answers calls."""

    def health(self) -> dict:
        return {"alive": True}

    def update_roster(self, roster, version=None) -> None:  # noqa: ANN001
        pass


def _roster(controller) -> list[str]:  # noqa: ANN001
    return [r["instance_id"] for r in ray.get(controller.get_roster.remote())]


def _beat_for(controller, seconds: float, progress: list[int]) -> None:  # noqa: ANN001
    """Heartbeats of drafter-9 every half interval for ``seconds`` (its loop moving)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        progress[0] += 1
        ray.get(controller.heartbeat.remote({"instance_id": "drafter-9", "incarnation": 7,
                                             "progress": progress[0], "load": {}}))
        time.sleep(HEARTBEAT_INTERVAL_S / 2)


def test_a_killed_role_leaves_after_three_missed_beats_a_live_silent_one_stays(ray_session):
    controller = ControllerActor.options(num_cpus=0).remote()
    role = SilentRole.remote()
    info = {"instance_id": "drafter-9", "role": "drafter", "endpoint": "tcp://127.0.0.1:1",
            "incarnation": 7}
    ray.get(controller.register.remote(info, role))
    progress = [0]
    try:
        _beat_for(controller, 2 * HEARTBEAT_INTERVAL_S, progress)
        # silent past the suspect bound, but its actor answers the probes: it stays
        time.sleep((SUSPECT_MISSED_BEATS + 2) * HEARTBEAT_INTERVAL_S)
        assert _roster(controller) == ["drafter-9"]
        _beat_for(controller, 2 * HEARTBEAT_INTERVAL_S, progress)
        killed_at = time.monotonic()  # its last heartbeat: silent from here
        ray.kill(role, no_restart=True)
        deadline = killed_at + (MAX_MISSED_BEATS + 3) * HEARTBEAT_INTERVAL_S
        while "drafter-9" in _roster(controller) and time.monotonic() < deadline:
            time.sleep(0.1)
        took = time.monotonic() - killed_at
        assert _roster(controller) == [], "a killed role stayed in the roster"
        # 3 missed beats, then the first probe finds the actor gone (without probes: 10)
        assert took < (MAX_MISSED_BEATS - 3) * HEARTBEAT_INTERVAL_S, took
        report = ray.get(controller.health_report.remote())
        assert report["num_deregistered"] == 1
    finally:
        ray.kill(controller)
