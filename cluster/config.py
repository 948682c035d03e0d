"""Cluster configuration: the workers' own configs composed with the deployment's settings.

A :class:`ClusterConfig` is one frozen value shared by every role of a deployment. The worker
settings live in the workers' config classes (``VerifierConfig``, ``PrefillConfig``,
``DrafterConfig``), so a knob is defined once; the cluster adds what only a deployment has
(model, dtype, KV layout and memory, addresses, the thread plan, the CPU backend overrides)
and keeps the settings two workers share consistent (the draft method, the drafter's run-ahead
window from kappa).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace

from specmesh.decode.config import VerifierConfig
from specmesh.drafter.config import DrafterConfig
from specmesh.drafter.registry import runs_a_model
from specmesh.engine.backend import BackendOverrides
from specmesh.engine.devices import check_device
from specmesh.engine.dtypes import MODEL_DTYPES, model_dtype, resolve_kv_cache_dtype
from specmesh.engine.lora_modules import parse_lora_modules
from specmesh.prefill.config import PrefillConfig
from specmesh.protocol.enums import Role

ROLES = tuple(r.value for r in Role)
#: ``ClusterConfig.transport`` values (protocol/curve.py resolves ``auto`` where a role runs)
TRANSPORTS = ("auto", "curve", "insecure")
#: ``ClusterConfig.speculation_gate_mode`` values ("": the verifier's ``speculation_gate`` as set)
SPECULATION_GATE_MODES = ("", "auto", "on", "off")
#: Ray namespace of a cluster's named actors (controller, roles) unless its config names another.
DEFAULT_NAMESPACE = "specmesh"


def default_threads(num_cores: int | None = None,
                    model_drafter: bool = False) -> dict[str, int]:
    """Thread plan (docs/architecture.md, 'Running on CPU'). The verifier runs a forward every step
    and gets every core; prefill gets one thread: on shared cores it runs while the verifier steps,
    and two OpenMP teams of n threads on n cores stall each other at every barrier (libgomp's
    default wait policy, spin then sleep; ``OMP_WAIT_POLICY=PASSIVE`` halves the forward's speed,
    engine/openmp.py). A prompt the verifier waits on while it computes nothing
    (``PrefillRequest.verifier_idle``: the verifier pauses its verify steps for prefills in
    flight, decode/prefill_pause.py, or has nothing to do) runs on the verifier's thread count
    instead. The n-gram drafter and the gateway are pure Python and get one.

    A model drafter (EAGLE head, draft model) computes while the verifier does, so with
    ``model_drafter`` the verifier leaves it a core: n - 1 threads. The measurements behind
    this plan: docs/benchmarks.md, 'Threads and OpenMP'."""
    n = num_cores or os.cpu_count() or 2
    verifier = max(1, n - 1) if model_drafter else n
    return {Role.VERIFIER.value: verifier, Role.PREFILL.value: 1,
            Role.DRAFTER.value: 1, Role.GATEWAY.value: 1}


@dataclass(frozen=True)
class ClusterConfig:
    """Everything a role needs to build its worker.

    ``verifier`` / ``prefill`` / ``drafter``: the workers' configs (their ``instance_id`` is
    set per role instance). ``kv_cache_mb``: KV memory per role (verifier and prefill each),
    MiB. ``block_size``: tokens per KV block. ``host``: the address roles bind and advertise
    (ZMQ, metrics, HTTP), resolved by each role where it runs (``cluster.loopback.role_address``):
    ``auto`` is the IP of the node Ray placed it on, so again the right one after Ray restarts it
    elsewhere (127.0.0.1 on the embedded loopback Ray); ``0.0.0.0`` listens on every interface
    and advertises the node IP; another address is used as given. ``port``: the gateway's HTTP
    port (0 = any free one). ``threads``: torch threads per
    role. ``device``: where prefill and verifier put model and KV (``auto``: the role's GPU
    when Ray gave it one, else CPU; ``cpu``; ``cuda[:N]``). ``kv_cache_dtype``: the KV cache's
    dtype in prefill and verifier alike (vLLM's ``--kv-cache-dtype``; ``auto``: the model
    dtype; ``bfloat16`` / ``float16``: a 16-bit cache for a float32 model on the CPU,
    engine/kv_cache.py); every role announces it in its Hello (ModelIdentity). A drafter
    ``window`` of 0 means "two verify steps of drafts" (2 x kappa), a ``prediction_window`` of
    0 two steps of prediction drafts (2 x the verifier's ``num_prediction_tokens``, at least
    the window).
    ``namespace``: the Ray namespace of the cluster's named actors (controller
    ``specmesh-controller``, roles ``specmesh-<instance id>``); clusters sharing one Ray
    session need distinct ones (``specmesh bench --drafters`` runs one per method).
    ``backend``: the CPU backend overrides (engine/backend.py; ``--cpu-backend``, a
    :class:`~engine.backend.BackendOverrides` or its ``NAME=on|off,...`` text): every role
    builds its backend from what its own machine has plus these, so the roles of a cluster
    make the same asks wherever they run (no role reads the ``SPECMESH_*`` switches itself).
    ``corpus_files``: ``--corpus [NAME=]FILE`` items (cluster/corpus_files.py): text files the
    gateway tokenizes at start and loads into every drafter as corpora (docs/drafters.md,
    'Corpora'); read where the gateway runs.
    ``api_key``: the key the gateway requires on every route but ``/health`` / ``/metrics``
    (gateway/auth.py; None: open); kept out of the repr so no log or dump shows it.
    ``protect_metrics``: those two need the key as well.
    ``transport``: role-to-role ZMQ security (protocol/curve.py): ``curve`` (CurveZMQ, only
    roster keys admitted), ``insecure`` (plain TCP, a trusted single host), ``auto`` (curve
    for a role bound to an address other hosts can reach, plain on the loopback).
    ``max_requests_per_client``: generation requests one client address may have in flight at
    the gateway (429 past it; 0: no limit; gateway/limits.py).
    ``lora_modules``: ``--lora-modules`` items (``NAME=PATH`` or vLLM's JSON form,
    engine/lora_modules.py): PEFT LoRA adapters every prefill worker and verifier loads, a
    request selecting one with ``model: NAME`` (docs/operations.md, 'LoRA adapters').

    Raises:
        ValueError: an unsupported dtype, a KV cache dtype the model dtype cannot have (or a
            16-bit one on a CUDA device), an empty KV layout, a drafter whose method is not
            the one the verifier announces, or malformed backend overrides.
    """

    model: str | None = None
    dtype: str = "float32"
    device: str = "auto"
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    kv_cache_mb: int = 512
    host: str = "auto"
    port: int = 8000
    #: the gateway's stream idle timeout, seconds: a request that gets no TokenStream for this
    #: long (its verifier alive but silent) fails with an error (None: never)
    stream_idle_timeout_s: float | None = 120.0
    threads: dict[str, int] = field(default_factory=default_threads)
    namespace: str = DEFAULT_NAMESPACE
    backend: BackendOverrides = BackendOverrides()
    corpus_files: tuple[str, ...] = ()
    api_key: str | None = field(default=None, repr=False)
    protect_metrics: bool = False
    transport: str = "auto"
    max_requests_per_client: int = 256
    #: how many times Ray restarts a crashed role over the cluster's life (-1: always; Ray's
    #: ``max_restarts``); the soak (benchmarks/soak.py) kills roles more often than that
    max_restarts: int = 3
    lora_modules: tuple[str, ...] = ()
    #: the command line's ``--speculation-gate``: ``on`` / ``off`` set the verifier's
    #: ``speculation_gate``; ``auto`` turns it on for a drafter that runs a model (its forwards
    #: compete with the verifier's for the cores, a cost only measuring sees,
    #: decode/speculation_gate.py) and off for one that runs none (n-gram, suffix: nothing to
    #: gain); resolved again whenever the draft method changes. "": as the verifier's is set.
    speculation_gate_mode: str = ""
    #: the command line's ``--prefill-draft-seed``: the prefill runs the draft method's first
    #: step after the prompt and ships it (PrefillDone.draft_seed), for a method that
    #: declares it (EAGLE: ``makes_prefill_seed``; cluster/prefill_seeder.py); off: the drafter
    #: runs it (docs/drafters.md, 'The seed across P/D')
    prefill_draft_seed: bool = True
    verifier: VerifierConfig = field(default_factory=lambda: VerifierConfig(
        max_num_seqs=32, goodput_drafts=True))
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    drafter: DrafterConfig = field(default_factory=lambda: DrafterConfig(
        window=0, max_segment=0, prediction_window=0))

    def __post_init__(self) -> None:
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; use one of {MODEL_DTYPES}")
        check_device(self.device)
        if isinstance(self.backend, str):  # "NAME=on|off,..." (frozen: set through object)
            object.__setattr__(self, "backend", BackendOverrides.parse(self.backend))
        if not isinstance(self.backend, BackendOverrides):
            raise ValueError(f"backend must be BackendOverrides or NAME=on|off text, got "
                             f"{type(self.backend).__name__}")
        kv = resolve_kv_cache_dtype(self.kv_cache_dtype, self.dtype)  # ValueError if it can't
        if kv != model_dtype(self.dtype) and self.device.startswith("cuda"):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} runs on the CPU only (the "
                             f"Triton attention reads the model's dtype), got device "
                             f"{self.device}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.max_restarts < -1:
            raise ValueError("max_restarts must be >= -1 (-1: restart always)")
        if self.max_requests_per_client < 0:
            raise ValueError("max_requests_per_client must be >= 0 (0: no limit)")
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        parse_lora_modules(self.lora_modules)  # ValueError: a malformed item
        if self.block_size < 1 or self.kv_cache_mb < 1:
            raise ValueError("block_size and kv_cache_mb must be >= 1")
        if self.stream_idle_timeout_s is not None and not self.stream_idle_timeout_s > 0:
            raise ValueError("stream_idle_timeout_s must be > 0 (None: no timeout)")
        if self.speculation_gate_mode not in SPECULATION_GATE_MODES:
            raise ValueError(f"speculation_gate_mode must be one of {SPECULATION_GATE_MODES}, "
                             f"got {self.speculation_gate_mode!r}")
        if self.speculation_gate_mode:
            gate = self.speculation_gate_mode == "on" or (
                self.speculation_gate_mode == "auto" and runs_a_model(self.verifier.draft_method))
            object.__setattr__(self, "verifier", replace(self.verifier, speculation_gate=gate))
        if self.drafter.method != self.verifier.draft_method:
            raise ValueError(f"drafter method {self.drafter.method!r} != the verifier's "
                             f"draft_method {self.verifier.draft_method!r}")
        if self.drafter.window <= 0:  # derived from kappa (frozen: set through object)
            # (under the schedule policy, from the schedule's largest kappa)
            w = DrafterConfig.default_window(self.verifier.widest_kappa)
            object.__setattr__(self, "drafter", replace(self.drafter, window=w, max_segment=w))
        if self.drafter.prediction_window <= 0:  # derived from num_prediction_tokens
            w = max(DrafterConfig.default_window(self.verifier.num_prediction_tokens),
                    self.drafter.window)
            object.__setattr__(self, "drafter", replace(self.drafter, prediction_window=w))

    @classmethod
    def create(cls, **settings) -> ClusterConfig:
        """A ClusterConfig from flat settings: top-level fields as they are, any worker
        setting by its own name (``num_speculative_tokens=3`` -> ``verifier``) or, where two
        workers share a name, with the worker as prefix (``prefill_max_queue_len``).
        ``draft_method`` sets the verifier's and the drafter's method together.

        Raises:
            ValueError: an unknown or ambiguous setting.
        """
        workers = {"verifier": VerifierConfig, "prefill": PrefillConfig,
                   "drafter": DrafterConfig}
        top = {f.name for f in fields(cls)}
        parts: dict[str, dict] = {w: {} for w in workers}
        kw: dict = {}
        if "draft_method" in settings:
            method = settings.pop("draft_method")
            parts["verifier"]["draft_method"] = method
            parts["drafter"]["method"] = method
        for key, value in settings.items():
            if key in top:
                kw[key] = value
                continue
            prefix, _, rest = key.partition("_")
            if prefix in workers and rest in {f.name for f in fields(workers[prefix])}:
                parts[prefix][rest] = value
                continue
            owners = [w for w, c in workers.items() if key in {f.name for f in fields(c)}]
            if len(owners) != 1:
                why = "unknown" if not owners else f"ambiguous ({', '.join(owners)})"
                raise ValueError(f"{why} cluster setting {key!r}")
            parts[owners[0]][key] = value
        for w, over in parts.items():
            if over and w not in kw:  # over the field's default (a window of 0 = derived)
                kw[w] = replace(cls.__dataclass_fields__[w].default_factory(), **over)
        return cls(**kw)

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output a request may have (tokens)."""
        return self.verifier.max_model_len

    def with_kappa(self, num_speculative_tokens: int) -> ClusterConfig:
        """The same deployment with another kappa (and the drafter window that follows)."""
        v = replace(self.verifier, num_speculative_tokens=num_speculative_tokens)
        return replace(self, verifier=v, drafter=replace(self.drafter, window=0, max_segment=0,
                                                         prediction_window=0))
