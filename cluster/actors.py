"""Ray shells around the role hosts and the controller (the only place, with launcher.py and
the CLI, that imports ray). Actors ask for ``num_cpus=0`` plus a role resource, so placement
never starves on a 2-core machine; each registers itself with the named controller when it
starts, so a restarted actor (new incarnation, new endpoint) rejoins the roster by itself, and
then sends the controller a heartbeat every second (the controller deregisters a role whose
heartbeats stop or whose loop stands still: cluster/health.py)."""

from __future__ import annotations

import logging
import threading
import time

import ray

from specmesh.cluster.config import DEFAULT_NAMESPACE, ClusterConfig
from specmesh.cluster.controller import Controller
from specmesh.cluster.health import HEARTBEAT_INTERVAL_S
from specmesh.cluster.hosts import HOSTS
from specmesh.protocol.enums import Role

CONTROLLER_NAME = "specmesh-controller"
NAMESPACE = DEFAULT_NAMESPACE
#: Ray restarts a crashed role this many times before giving up (ClusterConfig.max_restarts'
#: default).
MAX_RESTARTS = 3
#: Concurrent Ray method calls per role actor (controller calls and metrics; never per token).
MAX_CONCURRENCY = 4
#: A role resource request small enough that any number of roles fit a node offering it.
ROLE_RESOURCE_UNIT = 0.001
#: Heartbeats whose reply is still awaited, at most (older ones are forgotten).
MAX_PENDING_BEATS = 8


#: seconds a starting role waits for its registration and the roster it then reads
REGISTER_TIMEOUT_S = 30


def _register(host, pull: bool = False) -> None:
    """Register ``host`` with the named controller. With ``pull`` (a role starting, or
    restarted by Ray), wait for the registration and apply the roster read right after it
    (Controller.roster_snapshot: the push the registration makes may never reach a role that
    Ray does not yet have alive); a failure there is logged, and the next push applies."""
    controller = ray.get_actor(CONTROLLER_NAME, namespace=host.cfg.namespace)
    me = ray.get_runtime_context().current_actor
    ref = controller.register.remote(host.describe(), me)
    if not pull:
        return
    try:
        ray.get(ref, timeout=REGISTER_TIMEOUT_S)
        roster, version = ray.get(controller.roster_snapshot.remote(),
                                  timeout=REGISTER_TIMEOUT_S)
        host.update_roster(roster, tuple(version))
    except Exception as err:  # noqa: BLE001 - the controller's next push applies then
        logging.getLogger(__name__).warning("%s: roster not read after registering: %s",
                                            host.instance_id, err)


def _heartbeats(host) -> None:
    """Send ``host``'s heartbeats to the named controller, fire and forget (a slow controller
    must not delay the next beat: replies are read as they come, the newest one used). The
    controller is looked up again after a failure: it may have been restarted, and then its
    reply asks the role to register again."""
    state: dict = {"controller": None, "pending": []}

    def send(beat: dict) -> dict | None:
        if state["controller"] is None:
            state["controller"] = ray.get_actor(CONTROLLER_NAME, namespace=host.cfg.namespace)
            state["pending"] = []
        pending = state["pending"]
        done, waiting = ray.wait(pending, num_returns=len(pending), timeout=0) if pending \
            else ([], [])
        reply = None
        try:
            for ref in done:  # in the order sent: the newest reply last
                reply = ray.get(ref)
        except Exception:
            state["controller"] = None
            raise
        waiting = [r for r in pending if r in waiting][-MAX_PENDING_BEATS:]
        state["pending"] = [*waiting, state["controller"].heartbeat.remote(beat)]
        if reply is not None and reply.get("register"):
            _register(host)
        return reply

    host.start_heartbeat(send, HEARTBEAT_INTERVAL_S)


class ActorProbes:
    """Asks Ray whether the actors of silent roles (Controller.silent_roles: 3 heartbeats
    missed) still exist, with a ``health`` call each that is read when it completes, never
    waited for: an actor that died is deregistered at once (Controller.actor_gone); one that
    answers, is restarting or is unreachable for now is left to its heartbeats (dead after
    MAX_MISSED_BEATS)."""

    def __init__(self) -> None:
        self.pending: dict[str, tuple[int | None, object]] = {}  # iid -> (incarnation, ref)

    def run(self, controller: Controller) -> None:
        silent = controller.silent_roles()
        for iid in set(self.pending) - set(silent):
            del self.pending[iid]
        for iid, (handle, incarnation) in silent.items():
            if handle is not None and iid not in self.pending:
                self.pending[iid] = (incarnation, handle.health.remote())
        if not self.pending:
            return
        refs = [ref for _, ref in self.pending.values()]
        done = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        for iid, (incarnation, ref) in list(self.pending.items()):
            if ref not in done:
                continue
            del self.pending[iid]
            try:
                ray.get(ref)
            except ray.exceptions.ActorUnavailableError:
                continue  # unreachable for now, not known dead: its heartbeats decide
            except ray.exceptions.RayActorError as err:
                controller.actor_gone(iid, incarnation, type(err).__name__)


class ControllerActor(Controller):
    """The controller with its health check (and the probes of silent roles' actors) running
    every heartbeat interval in a thread."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._probes = ActorProbes()
        self._checker = threading.Thread(target=self._check_loop, name="health-check",
                                         daemon=True)
        self._checker.start()

    def _check_loop(self) -> None:
        while True:
            time.sleep(self.health.interval_s)
            try:
                self._probes.run(self)
                self.check_health()
            except Exception:  # noqa: BLE001 - the checker must survive anything
                logging.getLogger(__name__).exception("health check failed")


ControllerActor = ray.remote(ControllerActor)


def _actor_class(host_cls: type) -> type:
    """A Ray actor class that builds ``host_cls`` and registers it with the controller."""

    def __init__(self, instance_id: str, cfg: ClusterConfig, *args) -> None:
        host_cls.__init__(self, instance_id, cfg, *args)
        _register(self, pull=True)
        _heartbeats(self)

    cls = type(f"{host_cls.__name__}Actor", (host_cls,), {"__init__": __init__})
    return ray.remote(cls)


#: role -> Ray actor class of its host
ACTORS = {role: _actor_class(host) for role, host in HOSTS.items()}


def role_options(role: Role, cfg: ClusterConfig, num_gpus: float = 0) -> dict:
    """Ray options for a role actor: its resource, restart policy and CPU env plan."""
    env = {"OMP_NUM_THREADS": str(cfg.threads.get(role.value, 1)),
           "TOKENIZERS_PARALLELISM": "false"}
    return {"num_cpus": 0, "num_gpus": num_gpus, "resources": {role.value: ROLE_RESOURCE_UNIT},
            "max_restarts": cfg.max_restarts, "max_concurrency": MAX_CONCURRENCY,
            "runtime_env": {"env_vars": env}, "namespace": cfg.namespace}
