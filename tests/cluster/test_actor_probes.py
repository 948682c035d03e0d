"""The controller actor's probes through a real Ray (docs/architecture.md, 'Cluster and health'): a
role that
stops heartbeating while its actor lives stays in the roster (a starved role is not dead); once
its actor is killed the probe finds it gone and deregisters it, before MAX_MISSED_BEATS would.
Which check removed it shows in the reason the controller records, not in how long it took (a
busy machine makes everything later); the timing itself is Controller's, on a fake clock, in
tests/cluster/test_health.py."""

from __future__ import annotations

import time

import pytest
import ray

from specmesh.cluster.actors import ControllerActor
from specmesh.cluster.health import HEARTBEAT_INTERVAL_S, MAX_MISSED_BEATS, SUSPECT_MISSED_BEATS

pytestmark = pytest.mark.ray

#: seconds after which a wait for something that must happen fails as hung (well past
#: MAX_MISSED_BEATS intervals, so a probe that failed shows as the wrong reason, not a hang)
HANG_S = 3 * MAX_MISSED_BEATS * HEARTBEAT_INTERVAL_S


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
        ray.kill(role, no_restart=True)  # its last heartbeat was just sent: silent from here
        deadline = time.monotonic() + HANG_S
        while "drafter-9" in _roster(controller):
            assert time.monotonic() < deadline, "a killed role stayed in the roster"
            time.sleep(0.1)
        report = ray.get(controller.health_report.remote())
        assert report["num_deregistered"] == 1
        # removed by the probe (3 missed beats, then its actor found gone), not by the
        # MAX_MISSED_BEATS bound ("... missed, limit 10): dead")
        reason = report["removed"]["drafter-9"]
        assert "its actor is gone" in reason and "limit" not in reason, reason
    finally:
        ray.kill(controller)
