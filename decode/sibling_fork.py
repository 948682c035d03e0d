"""Forking a group's waiting siblings from its leader once the leader's prompt KV is complete
(decode/siblings.py): each shares the leader's full prompt blocks and gets its own copy of the
partial one, then starts with the first token the prefill worker sampled for it. A mixin of
:class:`decode.worker.VerifierWorker` (its ``siblings``, ``scheduler``, ``verify_step``,
``lifecycle``, ``requests``, ``stats`` and ``profile``)."""

from __future__ import annotations

import time

from specmesh.decode.request import Request, RequestStatus
from specmesh.protocol.messages import PrefillDone


class SiblingFork:
    """Starts a leader's siblings on its KV (see the module docstring)."""

    def _fork_siblings(self, leader: Request, done: PrefillDone) -> None:
        """``leader``'s prompt KV is complete: start each sibling its prefill sampled a first
        token for on that KV (shared full blocks, its own copy of the partial one; decode/
        siblings.py). One that cannot be forked stays waiting as an ordinary request."""
        tokens = list(done.sibling_first_token_ids or [])
        shared = self.siblings.num_shared_blocks(leader.prompt_len,
                                                 self.verify_step.runner.kv_cache.block_size)
        now = time.monotonic()
        for i, sib in enumerate(leader.fork_targets):
            if sib.status is not RequestStatus.WAITING or sib.leader is not leader:
                continue
            self.siblings.unlink(sib)
            if i >= len(tokens) or not 0 <= tokens[i] < self.vocab_size:
                continue
            copy = self.scheduler.fork(leader, sib, self.requests.values(), shared)
            if copy is None:
                continue
            if copy:
                self.verify_step.runner.kv_cache.copy_blocks(copy[:1], copy[1:])
            sib.admitted_time = now
            self.profile.observe("ttft_admission_wait", now - sib.arrival_time)
            self.stats.num_sibling_forks += 1
            if i < len(done.sibling_logprobs or []):  # its first token's, when it asked
                sib.add_logprobs(done.sibling_logprobs[i], 1)
            if sib.sampling.prompt_logprobs is not None:
                sib.prompt_logprobs = done.prompt_logprobs
            # the leader's draft seed too: kept for a sibling whose first token is the seed's
            self.lifecycle.start(sib, tokens[i], 0, done.seed_state, draft_seed=done.draft_seed)
        self.siblings.unlink(leader)
