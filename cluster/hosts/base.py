"""The common base of the role hosts: identity, mailbox, loop thread, controller calls.

Public methods are what the controller calls (Ray method calls, never per token): ``info``,
``update_roster``, ``stats``, ``health``, ``stop``. Roster changes run inside the loop thread
(``ZmqMailbox.call_soon``), so sockets are only ever touched by the thread that owns them.

Health (docs/architecture.md, 'Cluster and health'): the loop thread bumps ``loop_turns`` on every
turn (an idle loop turns
at least once a second); :meth:`RoleHost.start_heartbeat` sends :meth:`RoleHost.heartbeat`
(that counter, the role's load) about once a second through a callable the Ray edge supplies,
so the controller sees both that the actor is alive and that its loop makes progress.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.health import HEARTBEAT_INTERVAL_S
from specmesh.cluster.loopback import role_address
from specmesh.cluster.metrics import serve_role_metrics
from specmesh.engine.backend import cpu_backend
from specmesh.engine.block_manager import BlockManager
from specmesh.engine.devices import resolve_device
from specmesh.engine.dtypes import resolve_kv_cache_dtype
from specmesh.engine.kv_cache import KVCache, num_blocks_for_memory
from specmesh.engine.shared_kv import SharedKVFile
from specmesh.engine.lora_modules import adapter_set_identity, parse_lora_modules
from specmesh.engine.openmp import run_in_released_thread
from specmesh.protocol.curve import CurveKeys, curve_enabled, roster_keys
from specmesh.protocol.enums import Role
from specmesh.protocol.messages import ModelIdentity
from specmesh.protocol.socket_caps import max_message_bytes
from specmesh.protocol.transport import IDLE_TIMEOUT_S, run_loop
from specmesh.protocol.zmq_transport import PeerInfo, ZmqMailbox

log = logging.getLogger(__name__)

#: Seconds ``stop`` waits for the loop thread to finish its step.
STOP_JOIN_TIMEOUT_S = 10


class RoleHost(ABC):
    """Hosts one worker of ``role`` as ``instance_id``. Subclasses set ``role`` and implement
    :meth:`build_worker` (and, for roles that dial peers, :meth:`apply_roster`)."""

    role: Role
    #: (controller epoch, roster version) of the roster whose keys this role admits
    _keys_version: tuple[int, int] | None = None

    def __init__(self, instance_id: str, cfg: ClusterConfig) -> None:
        self.instance_id, self.cfg = instance_id, cfg
        self.incarnation = time.time_ns()
        self.num_calls = 0  # Ray method calls served: must not grow with generated tokens
        self._error = ""
        self._roster_version: tuple[int, int] | None = None
        self._roster_lock = threading.Lock()
        self.loop_turns = 0  # bumped by the loop thread every turn: the heartbeat's progress
        self._beating = threading.Event()  # set: heartbeats stop
        self.set_threads()
        identity = self.model_identity()
        # resolved here, where the role runs (Ray may restart it on another node)
        self.bind_host, self.advertise_host = role_address(cfg.host)
        # a key pair of this incarnation (protocol/curve.py), its public key in the roster;
        # needed to dial a Curve peer even when this role's own ROUTER takes plain TCP
        curve = curve_enabled(cfg.transport, self.bind_host)
        self.curve_keys = CurveKeys.generate() if curve or CurveKeys.available() else None
        cap = max_message_bytes(identity, cfg.prefill.frame_tokens, cfg.prefill.frame_layers,
                                max(cfg.drafter.window, cfg.drafter.max_segment))
        self.mailbox = ZmqMailbox(instance_id, self.role.value, host=self.bind_host,
                                  advertise_host=self.advertise_host, model=identity,
                                  draft_method=cfg.verifier.draft_method,
                                  incarnation=self.incarnation, on_hello=self.on_hello,
                                  keys=self.curve_keys, curve=curve, max_message_bytes=cap)
        log.info("%s: role-to-role transport %s", instance_id,
                 "CurveZMQ (roster keys only)" if curve else "plain TCP (--insecure-transport "
                 "or the loopback)")
        # model loading's torch ops run in a thread that exits, so the loop thread's OpenMP
        # team is the process's only one (engine/openmp.py: a second halves forward speed)
        self.worker = run_in_released_thread(self.build_worker, f"{instance_id}-init")
        self.start()

    # -- for subclasses --------------------------------------------------------------------

    def set_threads(self) -> None:
        """Ray sets OMP_NUM_THREADS=1 in an actor without CPUs: apply the thread plan."""
        torch.set_num_threads(self.cfg.threads.get(self.role.value, 1))

    def model_identity(self) -> ModelIdentity:
        """What this role announces in Hello; from the model's config files by default."""
        from specmesh.engine.loader import model_identity  # the engine's model: triton kernels

        lora = ""
        if self.role in (Role.PREFILL, Role.VERIFIER):  # drafters draft from the base
            lora = adapter_set_identity(parse_lora_modules(self.cfg.lora_modules))
        return ModelIdentity(**model_identity(self.cfg.model, self.cfg.dtype,
                                              self.cfg.block_size, self.cfg.kv_cache_dtype),
                             lora_adapters=lora)

    @abstractmethod
    def build_worker(self) -> Any:
        """The plain worker this host drives (its ``step`` runs in the loop thread)."""

    def start(self) -> None:
        """Serve metrics and start the worker's loop thread."""
        self.metrics_port = serve_role_metrics(self, self.bind_host)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"{self.instance_id}-loop",
                                        daemon=True)
        self._thread.start()

    def on_hello(self, peer: PeerInfo, is_new: bool) -> None:
        """A peer said Hello (``is_new``: a new incarnation); nothing by default."""

    def apply_roster(self, roster: list[dict]) -> None:
        """Apply a roster change in the loop thread; this role dials nobody by default."""

    def _loop(self) -> None:
        run_loop(self._turn, self._stop, IDLE_TIMEOUT_S, self.instance_id,
                 on_error=self._on_error)

    def _turn(self, timeout_s: float) -> None:
        self.loop_turns += 1
        self.worker.step(timeout_s)

    # -- health ----------------------------------------------------------------------------

    def progress(self) -> int:
        """The loop counter the heartbeat carries: it must keep moving while the role can
        serve (a role whose counter stands still is hung and leaves the roster). Loop turns
        plus the model layers run in this process (:func:`watch_model`), so one long forward
        (a long prompt's prefill on a CPU) is progress, and a loop stuck elsewhere is not."""
        return self.loop_turns + _layers_run[0]

    def load(self) -> dict:
        """What routing needs to know of this role's load (sent with each heartbeat)."""
        return {}

    def heartbeat(self) -> dict:
        """One heartbeat (not a Ray call: sent by the heartbeat thread)."""
        return {"instance_id": self.instance_id, "incarnation": self.incarnation,
                "progress": self.progress(), "load": self.load()}

    def on_loads(self, loads: dict[str, dict]) -> None:
        """The loads of every role in the roster, as the controller's heartbeat reply says;
        unused by default."""

    def start_heartbeat(self, send: Callable[[dict], dict | None],
                        interval_s: float = HEARTBEAT_INTERVAL_S) -> threading.Thread:
        """Call ``send(self.heartbeat())`` every ``interval_s`` until :meth:`stop`, in a
        thread of its own; a reply (the controller's) goes to :meth:`on_loads`. A failing
        send is logged and retried at the next beat."""

        def beat() -> None:
            failing = False
            while not self._beating.wait(interval_s):
                try:
                    reply = send(self.heartbeat())
                    if reply:
                        self.on_loads(reply.get("loads") or {})
                    failing = False
                except Exception as err:  # noqa: BLE001 - the next beat tries again
                    (log.debug if failing else log.warning)(
                        "%s: heartbeat failed: %s", self.instance_id, err)
                    failing = True

        thread = threading.Thread(target=beat, name=f"{self.instance_id}-heartbeat",
                                  daemon=True)
        thread.start()
        return thread

    def _on_error(self, err: BaseException) -> None:
        self._error = repr(err)  # reported by health(); the role keeps serving

    # -- called by the controller ----------------------------------------------------------

    def describe(self) -> dict:
        """Roster entry of this role (not a Ray call: used when registering)."""
        return {"instance_id": self.instance_id, "role": self.role.value,
                "endpoint": self.mailbox.endpoint, "incarnation": self.incarnation,
                "pid": os.getpid(),
                "metrics_url": f"http://{self.advertise_host}:{self.metrics_port}/metrics",
                **self.mailbox.security_entry()}

    def info(self) -> dict:
        self.num_calls += 1
        return self.describe()

    def update_roster(self, roster: list[dict],
                      version: tuple[int, int] | None = None) -> None:
        """Hand the new roster to the loop thread. Ray runs the calls of this threaded actor
        concurrently and in any order: a roster older than the newest one applied from the same
        controller (``version`` = (controller epoch, roster version)) is dropped, else a late
        push would undo a newer one (seen: a gateway left with a roster without its verifier)."""
        self.num_calls += 1
        self._allow_roster_keys(roster, version)

        def apply() -> None:
            with self._roster_lock:
                last = self._roster_version
                if version is not None and last is not None and version[0] == last[0] \
                        and version[1] <= last[1]:
                    return
                if version is not None:
                    self._roster_version = version
                self.mailbox.set_peer_keys({r["instance_id"]: r["curve_key"].encode()
                                            for r in roster if r.get("curve")})
                self.apply_roster(roster)

        self.mailbox.call_soon(apply)

    def _allow_roster_keys(self, roster: list[dict],
                           version: tuple[int, int] | None) -> None:
        """Admit exactly the roster's public keys at this role's ROUTER (CurveZMQ), at once
        (not in the loop thread: a peer of the new roster may dial before the loop turns);
        an older roster than the newest applied is dropped, as in :meth:`update_roster`."""
        with self._roster_lock:
            last = self._keys_version
            if version is not None and last is not None and version[0] == last[0] \
                    and version[1] <= last[1]:
                return
            if version is not None:
                self._keys_version = version
            self.mailbox.allow(roster_keys(roster))

    def connect_only(self, peers: list[dict]) -> None:
        """Keep dealer connections to exactly ``peers`` (loop thread only)."""
        known = {r["instance_id"] for r in peers}
        for peer in list(self.mailbox.dealers):
            if peer not in known:
                self.mailbox.disconnect(peer)
        for r in peers:
            self.mailbox.connect(r["instance_id"], r["endpoint"], r.get("role", ""))

    def stats(self) -> dict:
        self.num_calls += 1
        out = {k: v for k, v in vars(self.worker.stats).items()
               if isinstance(v, (int, float, list))}
        out["num_protocol_errors_transport"] = self.mailbox.num_protocol_errors
        out["num_refused_peers"] = self.mailbox.num_refused_peers
        out["num_failed_handshakes"] = self.mailbox.num_failed_handshakes
        out["curve"] = self.mailbox.curve
        out["num_ray_calls"] = self.num_calls
        out["ready_peers"] = [p for p in list(self.mailbox.dealers) if self.mailbox.ready(p)]
        out["peer_incarnations"] = {p: i.incarnation for p, i in
                                    list(self.mailbox.dealer_peers.items()) if i.acked}
        out["pid"] = os.getpid()
        out["profile"] = self.worker.profile.as_dict()
        return out

    def health(self) -> dict:
        self.num_calls += 1
        return {"alive": self._thread.is_alive(), "last_error": self._error,
                "loop_turns": self.loop_turns}

    def stop(self) -> None:
        self._beating.set()  # silent from now on: the controller deregisters it
        self._stop.set()
        self.mailbox.wake()
        self._thread.join(timeout=STOP_JOIN_TIMEOUT_S)
        self.mailbox.close()


#: model layers run in this process, counted by the hooks of :func:`watch_model`
_layers_run = [0]


def watch_model(model: Any) -> None:
    """Count every forward of ``model``'s layers (the elements of its ModuleLists) as progress
    of this process's role (:meth:`RoleHost.progress`): a pre-hook per layer, no per-module
    cost elsewhere."""
    def bump(*_: object) -> None:
        _layers_run[0] += 1

    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            for layer in module:
                layer.register_forward_pre_hook(bump)


def peers_of(roster: list[dict], role: Role) -> list[dict]:
    """The roster entries of ``role``."""
    return [r for r in roster if r["role"] == role.value]


def role_backend(cfg: ClusterConfig):  # noqa: ANN201 - an engine.backend.CpuBackend
    """The CPU backend of this role: what this machine has, with the cluster's overrides
    (``cfg.backend``; the environment's ``SPECMESH_*`` switches are not read here, so every
    role of the cluster applies the same ones). Logged: the role's log says what it ran."""
    backend = cpu_backend(cfg.backend)
    log.info("cpu backend: %s", backend.summary())
    return backend


def loaded_runner(cfg: ClusterConfig, shared_kv_owner: str = ""):
    """Load the target with the role's CPU backend (:func:`role_backend`) and build
    (LoadedModel, ModelRunner, BlockManager) with ``cfg.kv_cache_mb`` of KV in blocks of
    ``cfg.block_size``, in ``cfg.kv_cache_dtype``.

    Loads ``cfg.lora_modules`` into the model (engine/lora.py). ``shared_kv_owner``: keep the
    KV pool in a shared-memory file named after it (engine/shared_kv.py; the cache's
    ``shared_file``), for a frozen-KV drafter on this node; "": an ordinary tensor.

    Raises:
        ValueError: the KV memory holds no block, or a KV cache dtype the model (or its
            device) cannot have, or a LoRA adapter that cannot be served.
    """
    # the engine's model and runner: triton kernels, only in a role that runs a model
    from specmesh.engine.loader import load_model
    from specmesh.engine.lora import load_lora_modules
    from specmesh.engine.runner import ModelRunner

    loaded = load_model(cfg.model, dtype=cfg.dtype, device=resolve_device(cfg.device),
                        backend=role_backend(cfg))
    kv_dtype = resolve_kv_cache_dtype(cfg.kv_cache_dtype, loaded.model.dtype)
    n = num_blocks_for_memory(loaded.config, cfg.block_size, kv_dtype, cfg.kv_cache_mb << 20)
    if n < 1:
        raise ValueError(f"kv_cache_mb={cfg.kv_cache_mb} holds no block of {cfg.block_size} tokens")
    shared = None
    if shared_kv_owner:  # the pool in /dev/shm, mapped read-only by a co-located drafter
        shape = (loaded.config.num_layers, 2, n * cfg.block_size, loaded.config.num_kv_heads,
                 loaded.config.head_dim)
        shared = SharedKVFile(shared_kv_owner, shape, kv_dtype, cfg.block_size)
    cache = KVCache(loaded.config, n, cfg.block_size, kv_dtype, loaded.model.device,
                    storage=shared.tensor if shared is not None else None)
    cache.shared_file = shared
    if cfg.lora_modules:  # the adapters requests select with model: NAME
        load_lora_modules(loaded.model, parse_lora_modules(cfg.lora_modules))
    watch_model(loaded.model)  # a long forward is progress for the health check
    return loaded, ModelRunner(loaded.model, loaded.config, cache), BlockManager(n, cfg.block_size)
