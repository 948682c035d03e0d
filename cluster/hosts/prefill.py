"""Host of the prefill role: the target model, its KV cache and a PrefillWorker."""

from __future__ import annotations

from dataclasses import replace

import msgspec

from specmesh.cluster.hosts.base import RoleHost, loaded_runner, peers_of
from specmesh.engine.cpu_load import free_cpus
from specmesh.protocol.enums import Role
from specmesh.protocol.zmq_transport import PeerInfo


class PrefillHost(RoleHost):
    """Answers the verifiers that dial it; dials nobody."""

    role = Role.PREFILL

    def build_worker(self):
        # built in the role process only: the prefill worker brings torch and the triton kernels
        from specmesh.cluster.hosts.drafter import cluster_seed_state
        from specmesh.cluster.prefill_seeder import prefill_seeders
        from specmesh.drafter.registry import seed_state_kinds
        from specmesh.engine.grammar import compiler_for
        from specmesh.prefill.worker import PrefillWorker

        loaded, runner, bm = loaded_runner(self.cfg)
        # which seed state PrefillDone carries per draft method (prefill/ cannot ask drafter/)
        seeds = {**seed_state_kinds(), self.cfg.drafter.method: cluster_seed_state(self.cfg),
                 **self.cfg.prefill.seed_states}
        config = replace(self.cfg.prefill, instance_id=self.instance_id, seed_states=seeds)
        worker = PrefillWorker(config, self.mailbox, runner, bm)
        # the draft method's first step after the prompt (--prefill-draft-seed), computed as
        # the drafter role would (its spec, dtype and backend; its identity: no LoRA)
        worker.draft_seeders = prefill_seeders(
            self.cfg, msgspec.structs.replace(self.model_identity(), lora_adapters=""))
        worker.grammars = compiler_for(loaded.tokenizer, loaded.config.eos_token_ids,
                                       loaded.config.vocab_size)
        if runner.device.type == "cpu":  # the verifier's cores, while it pauses for a prompt
            import torch  # torch: only a role that has loaded its model gets here

            threads = self.cfg.threads
            worker.idle_threads = (threads.get(self.role.value, 1),
                                   max(threads.get(Role.VERIFIER.value, 1),
                                       threads.get(self.role.value, 1)),
                                   torch.set_num_threads)
            worker.free_cpus = free_cpus
        return worker

    def on_hello(self, peer: PeerInfo, is_new: bool) -> None:
        # A verifier's new incarnation: the backlog of its previous life goes nowhere.
        if peer.role == Role.VERIFIER.value and is_new:
            self.worker.drop_peer(peer.name)

    def apply_roster(self, roster: list[dict]) -> None:
        # A verifier that left the roster (deregistered): its backlog goes nowhere.
        now = {r["instance_id"] for r in peers_of(roster, Role.VERIFIER)}
        for gone in getattr(self, "_verifiers", set()) - now:
            self.worker.drop_peer(gone)
        self._verifiers = now
        self.worker.lora.set_verifiers(now)  # an adapter is unloaded once all released it

    def stats(self) -> dict:
        """The base stats plus the KV pool: blocks in all, in use, and held by the prefix
        cache for no prompt (evictable). On an idle prefill every block in use is an evictable
        cached one; any beyond those leaked (benchmarks/soak.py checks it)."""
        out = super().stats()
        bm, cache = self.worker.block_manager, self.worker.prefix_cache
        out["num_kv_blocks"] = bm.num_blocks
        out["num_used_kv_blocks"] = bm.num_used_blocks
        out["num_evictable_kv_blocks"] = 0 if cache is None else cache.num_evictable_blocks
        out["lora_adapters"] = sorted(self.worker.lora.runtime.current())  # served now
        return out
