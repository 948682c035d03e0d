"""Host of the gateway role: tokenizer, a ZMQ mailbox to the verifiers, the OpenAI-compatible
HTTP server (uvicorn), and the list of corpora the drafters draft from (``--corpus`` files
loaded at start, gateway/corpora.py). Its mailbox is driven by the gateway backend, not by a
worker loop."""

from __future__ import annotations

import os

from specmesh.cluster.corpus_files import corpus_specs, read_corpus_file
from specmesh.cluster.hosts.base import RoleHost, peers_of
from specmesh.decode.rules import outputs_exact
from specmesh.drafter.registry import supports_corpus
from specmesh.engine.lora_modules import parse_lora_modules
from specmesh.gateway.backend import MailboxBackend
from specmesh.gateway.corpora import CorpusControl
from specmesh.gateway.lora_control import LoraControl
from specmesh.protocol.enums import Role
from specmesh.protocol.messages import MAX_CORPUS_TOKENS, ModelIdentity


class GatewayHost(RoleHost):
    """``port`` overrides ``cfg.port`` (0 = any free port)."""

    role = Role.GATEWAY

    def __init__(self, instance_id: str, cfg, port: int | None = None) -> None:
        self._port = cfg.port if port is None else port
        self.verifiers: list[str] = []
        self.prefills: list[str] = []
        self.loads: dict[str, dict] = {}  # instance id -> load, from the controller's heartbeats
        super().__init__(instance_id, cfg)

    def model_identity(self) -> ModelIdentity:
        # The gateway holds no KV, but it announces the whole identity, as every role does (an
        # empty field is not a wildcard): read from the model's config files, so the vocabulary
        # size is the embedding rows of config.json, which a padded vocabulary makes larger
        # than the tokenizer (Qwen2: 151,936 rows for 151,665 tokens).
        # the engine's loader (triton kernels; transformers when it loads the tokenizer)
        from specmesh.engine.loader import load_tokenizer, model_identity, model_name

        self.tokenizer = load_tokenizer(self.cfg.model)
        self.model_name = model_name(self.cfg.model)
        identity = ModelIdentity(**model_identity(self.cfg.model, self.cfg.dtype,
                                                  self.cfg.block_size, self.cfg.kv_cache_dtype))
        self.vocab_size = identity.vocab_size
        return identity

    def build_worker(self):
        self.backend = MailboxBackend(self.mailbox, self._pick_verifier,
                                      stream_timeout_s=self.cfg.stream_idle_timeout_s)
        # a verifier whose connection drops fails its requests unless it is soon back
        self.mailbox.on_disconnect = self.backend.verifier_disconnected
        method = self.cfg.drafter.method
        self.corpus = CorpusControl(self.backend.send, self._ready_verifiers,
                                    supported=supports_corpus(method),
                                    method=method).attach(self.backend)
        self._load_corpus_files()
        # the LoRA adapters served, changed at run time (gateway/lora_admin.py)
        self.lora = LoraControl(self.backend.send, self._ready_verifiers,
                                parse_lora_modules(self.cfg.lora_modules)).attach(self.backend)
        return None

    def _load_corpus_files(self) -> None:
        """Tokenize the ``--corpus`` files and put them on the list (the verifiers get them
        as they connect).

        Raises:
            ValueError: a corpus that is empty or longer than MAX_CORPUS_TOKENS.
            OSError: a file that cannot be read.
        """
        from specmesh.gateway.corpus_api import corpus_token_ids  # fastapi, pydantic

        for name, path in corpus_specs(self.cfg.corpus_files):
            ids = corpus_token_ids(self.tokenizer, read_corpus_file(path))
            if not 0 < len(ids) <= MAX_CORPUS_TOKENS:
                raise ValueError(f"--corpus {name}: {path} holds {len(ids)} tokens (1 to "
                                 f"{MAX_CORPUS_TOKENS} allowed)")
            self.corpus.keep(name, ids)

    def _ready_verifiers(self) -> list[str]:
        return [v for v in self.verifiers if self.mailbox.ready(v)]

    def start(self) -> None:
        # the HTTP stack (fastapi, starlette, pydantic, httpx, uvicorn) only in the gateway role
        from specmesh.gateway.app import create_app
        from specmesh.gateway.server import serve_gateway

        self.app = create_app(self.backend, self.tokenizer, self.model_name,
                              self.cfg.max_model_len, default_temperature=0.0,
                              vocab_size=self.vocab_size, readiness=self.not_ready_reason,
                              synthetic_acceptance=synthetic_outputs(self.cfg),
                              corpus=self.corpus, api_key=self.cfg.api_key,
                              protect_metrics=self.cfg.protect_metrics,
                              max_requests_per_client=self.cfg.max_requests_per_client,
                              lora=self.lora)
        self.server, self._server_thread, self.port = serve_gateway(self.app, self.bind_host,
                                                                    self._port)

    def not_ready_reason(self) -> str:
        """Why a request cannot be served end to end now ("" when it can): the roster has
        no prefill worker or no verifier, or no verifier has acknowledged our Hello yet.
        ``/health`` is 503 with this reason until it is ""."""
        if not self.prefills:
            return "no prefill worker in the roster"
        if not self.verifiers:
            return "no verifier in the roster"
        if not any(self.mailbox.ready(v) for v in self.verifiers):
            return "no verifier is connected yet"
        return ""

    def _pick_verifier(self) -> str:
        ready = self._ready_verifiers()
        if not ready:
            raise ConnectionError("no verifier is connected yet")
        return least_loaded_verifier(ready, self.backend.in_flight_by_verifier(), self.loads)

    def on_loads(self, loads: dict[str, dict]) -> None:
        self.loads = loads

    def progress(self) -> int:
        """The backend reader's turns (it delivers every token), while the HTTP server runs;
        a dead server thread freezes the counter, so the controller sees the gateway hung."""
        if not self._server_thread.is_alive():
            return -1
        return self.backend.num_reader_turns

    def on_hello(self, peer, is_new: bool) -> None:
        # a verifier's new incarnation (restarted) fails the requests its old one held; a
        # new one (started, restarted) gets the corpora; any Hello, the LoRA adapters served now
        if peer.role == Role.VERIFIER.value:
            self.backend.verifier_hello(peer.name, peer.incarnation)
            corpus = getattr(self, "corpus", None)  # (built with the worker)
            if is_new and corpus is not None:
                corpus.verifier_joined(peer.name)
            lora = getattr(self, "lora", None)
            if lora is not None:  # (also after a reconnect: an operation may have missed it)
                lora.verifier_joined(peer.name)

    def describe(self) -> dict:
        return {"instance_id": self.instance_id, "role": self.role.value,
                "endpoint": self.mailbox.endpoint, "incarnation": self.incarnation,
                "pid": os.getpid(), "port": self.port,
                "url": f"http://{self.advertise_host}:{self.port}",
                **self.mailbox.security_entry()}

    def apply_roster(self, roster: list[dict]) -> None:
        verifiers = peers_of(roster, Role.VERIFIER)
        for r in verifiers:
            self.mailbox.connect(r["instance_id"], r["endpoint"], r["role"])
        self.verifiers = [r["instance_id"] for r in verifiers]
        # requests of a verifier that left the roster or restarted fail at once
        self.backend.set_verifiers({r["instance_id"]: r.get("incarnation") for r in verifiers})
        self.prefills = [r["instance_id"] for r in peers_of(roster, Role.PREFILL)]
        app = getattr(self, "app", None)
        if app is not None:  # one scrape of our /metrics carries every role's series
            from specmesh.gateway.roster_metrics import targets_from_roster  # httpx

            app.state.metrics.roster.set_targets(targets_from_roster(roster, self.instance_id))

    def stats(self) -> dict:
        self.num_calls += 1
        return {"num_in_flight": self.backend.num_in_flight, "pid": os.getpid(),
                "num_protocol_errors": self.backend.num_protocol_errors,
                "num_refused_peers": self.mailbox.num_refused_peers,
                "num_failed_handshakes": self.mailbox.num_failed_handshakes,
                "curve": self.mailbox.curve,
                "num_ray_calls": self.num_calls,
                "ready_verifiers": [v for v in self.verifiers if self.mailbox.ready(v)],
                "verifier_loads": {v: self.loads.get(v, {}) for v in self.verifiers},
                "profile": self.app.state.metrics.profile.as_dict()}

    def health(self) -> dict:
        self.num_calls += 1
        reason = self.not_ready_reason()
        return {"alive": self._server_thread.is_alive(), "ready": not reason,
                "reason": reason, "last_error": ""}

    def stop(self) -> None:
        self._beating.set()
        self.server.stop()
        self.backend.close()
        self.mailbox.close()


def synthetic_outputs(cfg) -> bool:  # noqa: ANN001
    """Whether the verifiers of ``cfg`` (a ClusterConfig) commit tokens by a verification rule
    that is not exact (the synthetic-acceptance ablation, decode/rules.py): the gateway then
    flags every response, from this configuration, not from any message."""
    return not outputs_exact(cfg.verifier.verify_rule)


def least_loaded_verifier(ready: list[str], in_flight: dict[str, int],
                          loads: dict[str, dict]) -> str:
    """The verifier of ``ready`` to route a new request to
    (docs/architecture.md, 'Life of a request' step 1): one with no queue of
    waiting requests before one with a queue, then the fewest requests this gateway has in
    flight on it (live), then the most free KV blocks, then the roster order. ``loads``: each
    verifier's ``num_waiting`` / ``num_free_blocks`` as its last heartbeat reported (about a
    second old; missing: unknown, treated as no queue and no room known)."""
    def key(item: tuple[int, str]) -> tuple:
        i, v = item
        load = loads.get(v) or {}
        return (load.get("num_waiting", 0) > 0, in_flight.get(v, 0),
                -load.get("num_free_blocks", 0), i)

    return min(enumerate(ready), key=key)[1]
