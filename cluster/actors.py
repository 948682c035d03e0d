"""Ray shells around the role hosts and the controller (the only place, with launcher.py and
the CLI, that imports ray). Actors ask for ``num_cpus=0`` plus a role resource, so placement
never starves on a 2-core machine; each registers itself with the named controller when it
starts, so a restarted actor (new incarnation, new endpoint) rejoins the roster by itself."""

from __future__ import annotations

import ray

from cluster.config import ClusterConfig
from cluster.controller import Controller
from cluster.roles import GatewayHost, RoleHost

CONTROLLER_NAME = "specmesh-controller"
NAMESPACE = "specmesh"


def _register(host) -> None:
    controller = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    me = ray.get_runtime_context().current_actor
    controller.register.remote(host.describe(), me)


@ray.remote
class ControllerActor(Controller):
    pass


@ray.remote
class RoleActor(RoleHost):
    def __init__(self, role: str, instance_id: str, cfg: ClusterConfig) -> None:
        super().__init__(role, instance_id, cfg)
        _register(self)


@ray.remote
class GatewayActor(GatewayHost):
    def __init__(self, instance_id: str, cfg: ClusterConfig, port: int | None = None) -> None:
        super().__init__(instance_id, cfg, port)
        _register(self)


def role_options(role: str, cfg: ClusterConfig, num_gpus: float = 0) -> dict:
    """Ray options for a role actor: its resource, restart policy and CPU env plan."""
    env = {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(cfg.threads.get(role, 1)),
           "TOKENIZERS_PARALLELISM": "false"}
    return {"num_cpus": 0, "num_gpus": num_gpus, "resources": {role: 0.001},
            "max_restarts": 3, "max_concurrency": 4, "runtime_env": {"env_vars": env},
            "namespace": NAMESPACE}
