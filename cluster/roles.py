"""Role hosts: one worker, its ZMQ mailbox and its loop thread, built from a ClusterConfig.

A :class:`RoleHost` is a plain class (Ray wraps it in cluster/actors.py). Its public methods
are what the controller calls: ``info``, ``update_roster``, ``stats``, ``health``, ``stop``.
Roster changes run inside the loop thread (``ZmqMailbox.call_soon``), so sockets are only ever
touched by the thread that owns them. Nothing here is on the per-token path.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from cluster.config import ClusterConfig
from protocol.messages import ModelIdentity
from protocol.zmq_transport import PeerInfo, ZmqMailbox

log = logging.getLogger(__name__)


def _load(cfg: ClusterConfig):
    from engine.loader import load_model, model_identity_fields

    loaded = load_model(cfg.model, dtype=cfg.dtype)
    return loaded, ModelIdentity(**model_identity_fields(loaded, cfg.block_size))


def _kv(cfg: ClusterConfig, loaded):
    from engine.block_manager import BlockManager
    from engine.kv_cache import KVCache, num_blocks_for_memory
    from engine.runner import ModelRunner

    n = num_blocks_for_memory(loaded.config, cfg.block_size, cfg.dtype, cfg.kv_cache_mb << 20)
    if n < 1:
        raise ValueError(f"kv_cache_mb={cfg.kv_cache_mb} holds no block of {cfg.block_size} tokens")
    cache = KVCache(loaded.config, n, cfg.block_size, loaded.model.dtype, loaded.model.device)
    return ModelRunner(loaded.model, loaded.config, cache), BlockManager(n, cfg.block_size)


class RoleHost:
    """Hosts the worker of ``role`` (prefill | verifier | drafter) as ``instance_id``."""

    def __init__(self, role: str, instance_id: str, cfg: ClusterConfig) -> None:
        import torch

        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        torch.set_num_threads(cfg.threads.get(role, 1))  # Ray sets OMP_NUM_THREADS=1
        self.role, self.instance_id, self.cfg = role, instance_id, cfg
        self.incarnation = time.time_ns()
        self.num_calls = 0  # Ray method calls served: must not grow with generated tokens
        loaded, identity = _load(cfg)
        self.mailbox = ZmqMailbox(instance_id, "decode" if role == "verifier" else role,
                                  host=cfg.host, model=identity, draft_method=cfg.draft_method,
                                  incarnation=self.incarnation, on_hello=self._on_hello)
        self.worker = self._build(loaded)
        from cluster.metrics import serve_role_metrics

        self.metrics_port = serve_role_metrics(self, cfg.host)
        self._stop = threading.Event()
        self._error = ""
        self._thread = threading.Thread(target=self._loop, name=f"{instance_id}-loop",
                                        daemon=True)
        self._thread.start()

    def _build(self, loaded):
        cfg = self.cfg
        if self.role == "prefill":
            from prefill.worker import PrefillConfig, PrefillWorker

            runner, bm = _kv(cfg, loaded)
            return PrefillWorker(PrefillConfig(instance_id=self.instance_id,
                                               chunk_size=cfg.prefill_chunk_size),
                                 self.mailbox, runner, bm)
        if self.role == "verifier":
            from decode.worker import VerifierConfig, VerifierWorker

            runner, bm = _kv(cfg, loaded)
            return VerifierWorker(VerifierConfig(
                instance_id=self.instance_id, num_draft_tokens=cfg.num_draft_tokens,
                max_num_seqs=cfg.max_num_seqs, max_queue_len=cfg.max_queue_len,
                max_model_len=min(cfg.max_model_len, loaded.config.max_position_embeddings),
                tail_wait_fraction=cfg.tail_wait_fraction, draft_method=cfg.draft_method,
                eos_token_ids=tuple(loaded.config.eos_token_ids)), self.mailbox, runner, bm)
        if self.role == "drafter":
            import drafter.proposers  # noqa: F401
            from drafter.worker import DrafterConfig, DrafterWorker

            w = cfg.drafter_window
            return DrafterWorker(DrafterConfig(method=cfg.draft_method, window=w, max_segment=w),
                                 self.mailbox)
        raise ValueError(f"unknown role {self.role!r}")

    def _loop(self) -> None:
        self.worker.run(self._stop, 0.02, on_error=self._on_error)

    def _on_error(self, err: BaseException) -> None:
        self._error = repr(err)  # reported by health(); the role keeps serving

    def _on_hello(self, peer: PeerInfo, is_new: bool) -> None:
        # A drafter that restarted (new incarnation) gets DraftSync for its requests.
        if self.role == "verifier" and peer.role == "drafter" and is_new:
            self.worker.resync_drafter(peer.name)

    # -- called by the controller (Ray method calls; never per token) -----------------------

    def describe(self) -> dict:
        """Roster entry of this role (not a Ray call: used when registering)."""
        return {"instance_id": self.instance_id, "role": self.role,
                "endpoint": self.mailbox.endpoint, "incarnation": self.incarnation,
                "pid": os.getpid(),
                "metrics_url": f"http://{self.cfg.host}:{self.metrics_port}/metrics"}

    def info(self) -> dict:
        self.num_calls += 1
        return self.describe()

    def set_num_draft_tokens(self, num_draft_tokens: int) -> None:
        """Controller knob: kappa for requests that do not set their own (verifier only)."""
        self.num_calls += 1
        if self.role != "verifier":
            return
        if not 0 <= num_draft_tokens <= self.worker.config.max_num_draft_tokens:
            raise ValueError(f"num_draft_tokens {num_draft_tokens} out of range")

        def apply() -> None:
            self.worker.num_draft_tokens = num_draft_tokens

        self.mailbox.call_soon(apply)

    def update_roster(self, roster: list[dict]) -> None:
        """Connect to the peers this role talks to first (verifier -> prefill and drafters)."""
        self.num_calls += 1
        if self.role != "verifier":
            return
        prefill = [r for r in roster if r["role"] == "prefill"]
        drafters = [r for r in roster if r["role"] == "drafter"]

        def apply() -> None:
            known = {r["instance_id"] for r in prefill + drafters}
            for peer in list(self.mailbox.dealers):
                if peer not in known:
                    self.mailbox.disconnect(peer)
            for r in prefill + drafters:
                self.mailbox.connect(r["instance_id"], r["endpoint"])
            self.worker.set_roster([r["instance_id"] for r in prefill],
                                   [r["instance_id"] for r in drafters])

        self.mailbox.call_soon(apply)

    def stats(self) -> dict:
        self.num_calls += 1
        s = self.worker.stats
        out = {k: v for k, v in vars(s).items() if isinstance(v, (int, float, list))}
        out["num_protocol_errors_transport"] = self.mailbox.num_protocol_errors
        out["num_ray_calls"] = self.num_calls
        out["ready_peers"] = [p for p in list(self.mailbox.dealers) if self.mailbox.ready(p)]
        out["peer_incarnations"] = {p: i.incarnation for p, i in
                                       list(self.mailbox.dealer_peers.items()) if i.acked}
        out["pid"] = os.getpid()
        if self.role == "verifier":
            out.update(self.worker.load)
            out["num_draft_tokens_config"] = self.worker.num_draft_tokens
        return out

    def health(self) -> dict:
        self.num_calls += 1
        return {"alive": self._thread.is_alive(), "last_error": self._error}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.mailbox.close()


class GatewayHost:
    """Hosts the HTTP gateway: tokenizer, a ZMQ mailbox to the verifiers, uvicorn."""

    def __init__(self, instance_id: str, cfg: ClusterConfig, port: int | None = None) -> None:
        import torch

        from cluster.gateway import MailboxBackend, create_app, serve_gateway
        from engine.loader import load_tokenizer, model_name

        torch.set_num_threads(cfg.threads.get("gateway", 1))
        self.role, self.instance_id, self.cfg = "gateway", instance_id, cfg
        self.incarnation = time.time_ns()
        self.num_calls = 0
        tokenizer = load_tokenizer(cfg.model)
        loaded_name = model_name(cfg.model)
        identity = ModelIdentity(name=loaded_name, vocab_size=len(tokenizer), dtype="",
                                 num_layers=0, num_kv_heads=0, head_dim=0, block_size=0)
        self.mailbox = ZmqMailbox(instance_id, "gateway", host=cfg.host, model=identity,
                                  incarnation=self.incarnation)
        self.verifiers: list[str] = []
        self.backend = MailboxBackend(self.mailbox, self._pick_verifier)
        app = create_app(self.backend, tokenizer, loaded_name, cfg.max_model_len,
                         default_temperature=0.0)
        self.server, _, self.port = serve_gateway(app, cfg.host, cfg.port if port is None else port)

    def _pick_verifier(self) -> str:
        ready = [v for v in self.verifiers if self.mailbox.ready(v)]
        if not ready:
            raise ConnectionError("no verifier is connected yet")
        load = self.backend.in_flight_by_verifier()
        return min(ready, key=lambda v: load.get(v, 0))

    def info(self) -> dict:
        self.num_calls += 1
        return self.describe()

    def describe(self) -> dict:
        return {"instance_id": self.instance_id, "role": "gateway",
                "endpoint": self.mailbox.endpoint, "incarnation": self.incarnation,
                "pid": os.getpid(), "port": self.port,
                "url": f"http://{self.cfg.host}:{self.port}"}

    def update_roster(self, roster: list[dict]) -> None:
        self.num_calls += 1
        verifiers = [r for r in roster if r["role"] == "verifier"]

        def apply() -> None:
            for r in verifiers:
                self.mailbox.connect(r["instance_id"], r["endpoint"])
            self.verifiers = [r["instance_id"] for r in verifiers]

        self.mailbox.call_soon(apply)

    def stats(self) -> dict:
        self.num_calls += 1
        return {"num_in_flight": self.backend.num_in_flight, "pid": os.getpid(),
                "num_protocol_errors": self.backend.num_protocol_errors,
                "num_ray_calls": self.num_calls,
                "ready_verifiers": [v for v in self.verifiers if self.mailbox.ready(v)]}

    def health(self) -> dict:
        self.num_calls += 1
        return {"alive": True, "last_error": ""}

    def stop(self) -> None:
        self.server.stop()
        self.backend.close()
        self.mailbox.close()

