"""Host of the verifier role: the target model, its KV cache and a VerifierWorker that dials
the prefill workers and drafters of the roster."""

from __future__ import annotations

from dataclasses import replace
from urllib.parse import urlsplit

from specmesh.cluster.hosts.base import RoleHost, loaded_runner, peers_of
from specmesh.protocol.enums import Role
from specmesh.protocol.zmq_transport import PeerInfo


class VerifierHost(RoleHost):
    role = Role.VERIFIER
    _on_cpu = False  # the model's device is the CPU (set when the worker is built)

    def build_worker(self):
        # built in the role process only: torch and the verifier's triton kernels
        import torch

        from specmesh.decode.core_sharing import CoreSharing
        from specmesh.decode.worker import VerifierWorker
        from specmesh.engine.grammar import compiler_for
        from specmesh.cluster.hosts.drafter import cluster_seed_state, reads_target_kv
        from specmesh.cluster.verify_cost import verifier_cost_table

        # a frozen-KV drafter reads the KV pool: keep it in shared memory (engine/shared_kv.py)
        share_kv = reads_target_kv(self.cfg)
        loaded, runner, bm = loaded_runner(self.cfg, self.instance_id if share_kv else "")
        v = self.cfg.verifier
        max_len = min(v.max_model_len, loaded.config.max_position_embeddings)
        # the seed state its draft method needs (decode/ cannot ask drafter/)
        config = replace(v, instance_id=self.instance_id,
                         incarnation=self.incarnation, max_model_len=max_len,
                         eos_token_ids=tuple(loaded.config.eos_token_ids),
                         seed_state=v.seed_state or cluster_seed_state(self.cfg))
        worker = VerifierWorker(config, self.mailbox, runner, bm)
        if share_kv:  # announced in Hello; each request's committed rows go with its commits
            worker.lifecycle.share_kv = True
            self.mailbox.shared_kv = runner.kv_cache.shared_file.describe()
        worker.set_grammar_compiler(compiler_for(loaded.tokenizer, config.eos_token_ids,
                                                 loaded.config.vocab_size))
        self._on_cpu = loaded.model.device.type == "cpu"
        worker.core_sharing = CoreSharing(self.cfg.threads.get(self.role.value, 1),
                                          torch.set_num_threads)
        # the goodput policy's profiled verify cost, before any request (cluster/verify_cost.py)
        worker.scheduler.draft_budget.table = verifier_cost_table(
            config, runner, self.cfg.model, self.cfg.dtype, self.cfg.kv_cache_dtype,
            self.cfg.threads.get(self.role.value, 1))
        self.mailbox.on_disconnect = worker.peer_disconnected  # called in the loop thread
        return worker

    def on_hello(self, peer: PeerInfo, is_new: bool) -> None:
        # A drafter that restarted (new incarnation) gets DraftSync for its requests.
        if peer.role == Role.DRAFTER.value and is_new:
            self.worker.resync_drafter(peer.name)
        elif peer.role == Role.DRAFTER.value:  # the same process is back after a drop
            self.worker.drafter_back(peer.name)
        elif peer.role == Role.PREFILL.value:
            self._prefill_incarnation(peer.name, peer.incarnation)
            self.worker.prefill_back(peer.name)
            # (re)connected or restarted: it serves the LoRA adapters we serve now (a relay
            # sent while it was away is lost; a sync is idempotent)
            self.worker.lora.prefill_joined(peer.name)

    def _prefill_incarnation(self, peer: str, incarnation: int | None) -> None:
        """A prefill worker's incarnation as its HelloAck or the roster says: a new one
        (restarted, maybe on a new port) can send no more frames for the transfers its
        previous life held (the worker frees or re-issues them)."""
        known = self.__dict__.setdefault("_prefill_incarnations", {})
        if incarnation is None or incarnation < 0:
            return
        old = known.get(peer)
        known[peer] = incarnation
        if old is not None and old != incarnation:
            self.worker.prefill_restarted(peer)

    def apply_roster(self, roster: list[dict]) -> None:
        prefill, drafters = peers_of(roster, Role.PREFILL), peers_of(roster, Role.DRAFTER)
        for r in prefill:
            self._prefill_incarnation(r["instance_id"], r.get("incarnation"))
        self.connect_only(prefill + drafters)
        if self.worker.core_sharing is not None:  # a prefill on this node's CPU shares its cores
            self.worker.core_sharing.shared = self._on_cpu and any(
                endpoint_host(r["endpoint"]) == self.advertise_host for r in prefill)
        # a drafter on this node's CPU: its drafts cost the verifier's cores (goodput policy)
        self.worker.scheduler.draft_budget.drafter_shared = self._on_cpu and any(
            endpoint_host(r["endpoint"]) == self.advertise_host for r in drafters)
        self.worker.set_roster([r["instance_id"] for r in prefill],
                               [r["instance_id"] for r in drafters])

    def set_num_speculative_tokens(self, num_speculative_tokens: int) -> None:
        """Controller knob: kappa for requests that do not set their own.

        Raises:
            ValueError: outside ``[0, max_num_speculative_tokens]``.
        """
        self.num_calls += 1
        limit = self.worker.config.max_num_speculative_tokens
        if not 0 <= num_speculative_tokens <= limit:
            raise ValueError(f"num_speculative_tokens {num_speculative_tokens} not in [0, {limit}]")

        def apply() -> None:
            self.worker.num_speculative_tokens = num_speculative_tokens

        self.mailbox.call_soon(apply)

    def load(self) -> dict:
        """KV room and queue, for the gateway's choice of verifier (sent with heartbeats)."""
        return self.worker.load

    def stats(self) -> dict:
        out = super().stats()
        out.update(self.worker.load)
        out["num_speculative_tokens"] = self.worker.num_speculative_tokens
        pause = self.worker.prefill_pause  # its figures per way (decode/prefill_pause.py)
        out["prefill_pause"] = {"paused_s_per_token": pause.per_token_s[True],
                                "side_by_side_s_per_token": pause.per_token_s[False],
                                "num_paused": pause.num_samples[True],
                                "num_side_by_side": pause.num_samples[False]}
        # the policy's kappa now (the schedule's step kappa, else the configured one) and the
        # goodput policy's cost table (decode/cost_table.py): what `specmesh bench` samples
        sched = self.worker.scheduler
        out["current_kappa"] = sched.current_kappa
        out["speculative_policy"] = self.worker.config.speculative_policy
        # drafting on or off, measured (decode/speculation_gate.py; None: not the goodput policy)
        gate = sched.speculation_gate
        out["speculation_gate"] = None if gate is None else gate.snapshot()
        # the confidence policy's predicted vs realised accepted drafts and reliability bins
        budget = getattr(sched, "confidence_budget", None)
        out["confidence_budget"] = None if budget is None else budget.stats.as_dict()
        table = sched.draft_budget.table
        out["verify_cost_table"] = None if table is None else {
            "source": table.source, "num_observed": table.num_observed, **table.as_dict()}
        bm = self.worker.block_manager
        out["num_kv_blocks"] = bm.num_blocks
        out["kv_cache_usage"] = 1 - bm.num_free_blocks / bm.num_blocks  # as the metric
        out["requests"] = self.worker.lifecycle.views()
        # the LoRA adapters served now (those given at start and loaded at run time)
        out["lora_adapters"] = sorted(self.worker.lora.runtime.current())
        return out


def endpoint_host(endpoint: str) -> str:
    """The host of a ZMQ endpoint ``tcp://HOST:PORT`` ("" when it has none)."""
    return urlsplit(endpoint).hostname or ""
