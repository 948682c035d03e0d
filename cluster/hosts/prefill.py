"""Host of the prefill role: the target model, its KV cache and a PrefillWorker."""

from __future__ import annotations

from dataclasses import replace

from cluster.hosts.base import RoleHost, loaded_runner
from protocol.enums import Role


class PrefillHost(RoleHost):
    """Answers the verifiers that dial it; dials nobody."""

    role = Role.PREFILL

    def build_worker(self):
        from prefill.worker import PrefillWorker

        _, runner, bm = loaded_runner(self.cfg)
        config = replace(self.cfg.prefill, instance_id=self.instance_id)
        return PrefillWorker(config, self.mailbox, runner, bm)
