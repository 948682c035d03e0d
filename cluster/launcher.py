"""Start a specmesh cluster on Ray: an embedded local Ray for ``specmesh serve`` / tests, or
one role joining an existing cluster (``specmesh launch``)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import ray

from specmesh.cluster.actors import ACTORS, CONTROLLER_NAME, NAMESPACE, ControllerActor, role_options
from specmesh.cluster.auto_resolve import config_settings
from specmesh.cluster.config import ROLES, ClusterConfig
from specmesh.cluster.loopback import loopback_enabled
from specmesh.protocol.enums import Role

log = logging.getLogger(__name__)

#: Ray's setting of its workers' niceness (Ray's default: 15), read when Ray starts its node.
WORKER_NICENESS_ENV = "RAY_worker_niceness"


def init_local_ray(num_cpus: int | None = None) -> None:
    """Start (or join the already started) embedded Ray on 127.0.0.1, without the dashboard.
    Role resources are plentiful so that several clusters can share one Ray session.

    Raises:
        RuntimeError: :func:`cluster.loopback.use_loopback` did not run before ``import ray``.
    """
    if ray.is_initialized():
        return
    if not loopback_enabled():
        raise RuntimeError("an embedded Ray needs cluster.loopback.use_loopback() before the "
                           "first `import ray` of the process; it was not called")
    # Only what specmesh needs: no dashboard (below), no usage-stats reporting.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray starts its workers at nice 15, below everything else on the host: the roles are the
    # server here, and a benchmark client or any other process beside them would take their
    # cores first (docs/benchmarks.md, 'Time to first token'). An operator's value wins.
    os.environ.setdefault(WORKER_NICENESS_ENV, "0")
    ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 2,
             resources={r: 1000 for r in ROLES}, include_dashboard=False,
             _node_ip_address="127.0.0.1", namespace=NAMESPACE, log_to_driver=True,
             configure_logging=True, logging_level=logging.WARNING)


def get_controller(lifetime: str | None = None, namespace: str = NAMESPACE):
    """The named controller of ``namespace``, created if missing (``lifetime="detached"``:
    outlives this driver, as ``specmesh launch`` needs)."""
    return ControllerActor.options(name=CONTROLLER_NAME, namespace=namespace,
                                   get_if_exists=True, num_cpus=0, lifetime=lifetime).remote()


def start_role(role: Role | str, instance_id: str, cfg: ClusterConfig, num_gpus: float = 0,
               lifetime: str | None = None):
    """Create the actor of one role; it registers itself with the controller, which must
    exist already (:func:`get_controller`).

    Raises:
        ValueError: an unknown role name.
    """
    role = Role(role)
    opts = role_options(role, cfg, num_gpus)
    opts["name"] = f"specmesh-{instance_id}"
    opts["lifetime"] = lifetime
    return ACTORS[role].options(**opts).remote(instance_id, cfg)


@dataclass
class ClusterHandle:
    """A running cluster: the controller, role actors by instance id, the gateway URL."""

    cfg: ClusterConfig
    controller: object
    actors: dict[str, object] = field(default_factory=dict)
    url: str = ""

    @property
    def api_key(self) -> str | None:
        """The key its gateway requires (``--api-key``; None: open): what a client of this
        cluster sends."""
        return self.cfg.api_key

    def verifiers(self) -> list:
        return [a for iid, a in self.actors.items() if iid.startswith(Role.VERIFIER.value)]

    def drafters(self) -> list:
        return [a for iid, a in self.actors.items() if iid.startswith(Role.DRAFTER.value)]

    def stats(self) -> dict[str, dict]:
        return {iid: ray.get(a.stats.remote()) for iid, a in self.actors.items()}

    def set_num_speculative_tokens(self, k: int) -> None:
        ray.get([a.set_num_speculative_tokens.remote(k) for a in self.verifiers()])

    def stop(self) -> None:
        for a in self.actors.values():
            try:
                ray.get(a.stop.remote(), timeout=20)
            except Exception:  # noqa: BLE001 - killing follows anyway
                pass
            ray.kill(a, no_restart=True)
        ray.kill(self.controller, no_restart=True)
        self.actors.clear()


def model_role_gpus(cfg: ClusterConfig, num_gpus: float, num_model_roles: int) -> float:
    """GPUs per model-running role (prefill, verifier) on a single-machine cluster: a whole GPU
    each while they last, else an equal share (Ray hides GPUs from actors that ask for none).
    0 when ``cfg.device`` is ``cpu`` or no GPU exists."""
    if cfg.device == "cpu" or num_gpus < 1 or num_model_roles < 1:
        return 0.0
    return min(1.0, num_gpus / num_model_roles)


def start_cluster(cfg: ClusterConfig, num_prefill: int = 1, num_verifiers: int = 1,
                  num_drafters: int = 1, timeout_s: float = 600.0,
                  num_clusters: int = 1) -> ClusterHandle:
    """Start controller, prefill, verifier, drafter and gateway actors and wait until the
    gateway can route a request (every verifier connected to a prefill worker and a drafter).
    The actors are named in ``cfg.namespace``: clusters with distinct namespaces run side by
    side in one Ray session (ports are picked free; rosters are per controller);
    ``num_clusters``: how many such clusters share this node's GPUs (each model role gets an
    equal share of the GPUs of all of them).

    Raises:
        TimeoutError: the roles did not connect within ``timeout_s``.
    """
    from specmesh.engine.loader import model_files  # the engine's model: triton kernels

    # Dequantize a GGUF once here, not concurrently in every role process on first start.
    model_files(cfg.model, cfg.dtype)
    init_local_ray()
    controller = get_controller(namespace=cfg.namespace)
    controller.settle.remote(config_settings(cfg))  # decided once: the controller keeps them
    handle = ClusterHandle(cfg, controller)
    plan = ([(Role.PREFILL, f"prefill-{i}") for i in range(num_prefill)]
            + [(Role.DRAFTER, f"drafter-{i}") for i in range(num_drafters)]
            + [(Role.VERIFIER, f"verifier-{i}") for i in range(num_verifiers)]
            + [(Role.GATEWAY, "gateway-0")])
    gpus = model_role_gpus(cfg, ray.cluster_resources().get("GPU", 0),
                           (num_prefill + num_verifiers) * max(num_clusters, 1))
    for role, iid in plan:
        handle.actors[iid] = start_role(role, iid, cfg,
                                        gpus if role in (Role.PREFILL, Role.VERIFIER) else 0)
    infos = ray.get([a.info.remote() for a in handle.actors.values()], timeout=timeout_s)
    handle.url = next(i["url"] for i in infos if i["role"] == Role.GATEWAY)
    deadline = time.monotonic() + timeout_s
    want = num_prefill + num_drafters
    while True:
        st = handle.stats()
        ok = all(len(st[f"verifier-{i}"]["ready_peers"]) >= want for i in range(num_verifiers))
        ok = ok and len(st["gateway-0"]["ready_verifiers"]) == num_verifiers
        if ok:
            return handle
        if time.monotonic() > deadline:
            handle.stop()
            raise TimeoutError(f"cluster roles did not connect: {st}")
        time.sleep(0.2)
