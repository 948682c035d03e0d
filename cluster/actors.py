"""Ray shells around the role hosts and the controller (the only place, with launcher.py and
the CLI, that imports ray). Actors ask for ``num_cpus=0`` plus a role resource, so placement
never starves on a 2-core machine; each registers itself with the named controller when it
starts, so a restarted actor (new incarnation, new endpoint) rejoins the roster by itself."""

from __future__ import annotations

import ray

from cluster.config import DEFAULT_NAMESPACE, ClusterConfig
from cluster.controller import Controller
from cluster.hosts import HOSTS
from protocol.enums import Role

CONTROLLER_NAME = "specmesh-controller"
NAMESPACE = DEFAULT_NAMESPACE
#: Ray restarts a crashed role this many times before giving up.
MAX_RESTARTS = 3
#: Concurrent Ray method calls per role actor (controller calls and metrics; never per token).
MAX_CONCURRENCY = 4
#: A role resource request small enough that any number of roles fit a node offering it.
ROLE_RESOURCE_UNIT = 0.001


def _register(host) -> None:
    controller = ray.get_actor(CONTROLLER_NAME, namespace=host.cfg.namespace)
    me = ray.get_runtime_context().current_actor
    controller.register.remote(host.describe(), me)


@ray.remote
class ControllerActor(Controller):
    pass


def _actor_class(host_cls: type) -> type:
    """A Ray actor class that builds ``host_cls`` and registers it with the controller."""

    def __init__(self, instance_id: str, cfg: ClusterConfig, *args) -> None:
        host_cls.__init__(self, instance_id, cfg, *args)
        _register(self)

    cls = type(f"{host_cls.__name__}Actor", (host_cls,), {"__init__": __init__})
    return ray.remote(cls)


#: role -> Ray actor class of its host
ACTORS = {role: _actor_class(host) for role, host in HOSTS.items()}


def role_options(role: Role, cfg: ClusterConfig, num_gpus: float = 0) -> dict:
    """Ray options for a role actor: its resource, restart policy and CPU env plan."""
    env = {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(cfg.threads.get(role.value, 1)),
           "TOKENIZERS_PARALLELISM": "false"}
    return {"num_cpus": 0, "num_gpus": num_gpus, "resources": {role.value: ROLE_RESOURCE_UNIT},
            "max_restarts": MAX_RESTARTS, "max_concurrency": MAX_CONCURRENCY,
            "runtime_env": {"env_vars": env}, "namespace": cfg.namespace}
