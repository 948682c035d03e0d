"""The verifier's queue and admission (pure Python, no torch): which waiting request may run
here at all, which ones start now and on which prefill worker, and the KV each holds.

Modelled on nano-vllm's and vLLM's schedulers: requests wait in a FIFO queue until the KV they
can ever need (prompt + ``max_tokens``) fits next to what earlier admissions were promised and
fewer than ``max_num_seqs`` are admitted; blocks are then allocated lazily as the request grows,
out of that reservation, so a running request never runs out of KV. A sibling (decode/
siblings.py) is admitted onto its leader's prompt blocks instead (:meth:`Admission.fork`). The
prefill worker and the drafter of a request are the least loaded ones.

A mixin of :class:`decode.scheduler.Scheduler` (its ``config``, ``block_manager``,
``waiting``, ``num_speculative_tokens``, ``kappa_schedule`` and ``_prefill_turn``). The block
manager is any :class:`BlockAllocator` (``engine.block_manager.BlockManager``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from specmesh.decode.request import Request, RequestStatus
from specmesh.protocol.messages import SamplingParams


class BlockAllocator(Protocol):
    num_blocks: int

    @property
    def num_free_blocks(self) -> int: ...

    def blocks_for(self, num_tokens: int) -> int: ...

    def allocate(self, num_blocks: int) -> list[int]: ...

    def free(self, block_ids: list[int]) -> None: ...

    def share(self, block_ids: list[int]) -> list[int]: ...


class Admission:
    """Queue, admission, KV reservation and peer choice (see the module docstring)."""

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams,
                 num_speculative_tokens: int | None, vocab_size: int,
                 prediction_token_ids: list[int] | None = None) -> str:
        """Why a GenerateRequest of this shape can never run here ("" when it can): an empty
        prompt, token ids outside ``[0, vocab_size)`` (prompt or prediction), ``max_tokens <
        1``, sampling no rule verifies (SamplingParams.invalid_reason), a negative kappa, more
        tokens than ``max_model_len`` / the KV cache, or a prediction longer than
        ``max_model_len`` (the gateway's bound too)."""
        n, max_tokens = len(prompt_token_ids), sampling.max_tokens
        if n == 0:
            return "prompt is empty"
        if any(t < 0 or t >= vocab_size for t in prompt_token_ids):
            return f"prompt token ids must lie in [0, {vocab_size})"
        if max_tokens < 1:
            return "max_tokens must be >= 1"
        # greedy, sampled and seeded requests all run
        why = sampling.invalid_reason() or sampling.vocab_reason(vocab_size)
        if why:
            return why
        if num_speculative_tokens is not None and num_speculative_tokens < 0:
            return "num_speculative_tokens must be >= 0"
        if prediction_token_ids is not None:
            if len(prediction_token_ids) > self.config.max_model_len:
                return (f"the prediction has {len(prediction_token_ids)} tokens, more than the "
                        f"maximum model length {self.config.max_model_len}")
            if any(t < 0 or t >= vocab_size for t in prediction_token_ids):
                return f"prediction token ids must lie in [0, {vocab_size})"
        if n + max_tokens > self.config.max_model_len:
            return (f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the "
                    f"maximum model length {self.config.max_model_len}")
        need = self.block_manager.blocks_for(n + max_tokens)
        if need > self.block_manager.num_blocks:
            return f"request needs {need} KV blocks, the verifier has {self.block_manager.num_blocks}"
        return ""

    def queue_full(self) -> bool:
        """True when one more waiting request must be refused (HTTP 429 at the gateway)."""
        return len(self.waiting) >= self.config.max_queue_len

    def enqueue(self, req: Request) -> None:
        self.waiting.append(req)

    def dequeue(self, req: Request) -> None:
        """Forget a waiting request (aborted before admission); no-op if it is not waiting."""
        if req in self.waiting:
            self.waiting.remove(req)

    def speculative_tokens_for(self, requested: int | None) -> int:
        """Kappa of a new request: its own (capped) or the current default; under the
        schedule policy the default is the schedule's largest candidate (while the default
        is not 0: speculation off), so the step's kappa (:meth:`begin_step`) is what caps
        it and a change reaches it at its next step."""
        k = self.num_speculative_tokens if requested is None else requested
        if requested is None and self.kappa_schedule is not None and k > 0:
            k = self.kappa_schedule.config.max_kappa
        return min(k, self.config.max_num_speculative_tokens)

    def admit(self, requests: Iterable[Request], prefill_peers: list[str],
              prefill_load: Callable[[str], int],
              hold: Callable[[Request], bool] = lambda req: False) -> list[Request]:
        """Move waiting requests that fit into PREFILLING, in arrival order, passing over those
        ``hold`` keeps waiting (siblings to be forked from their leader's KV, a leader whose
        group is still arriving: decode/siblings.py).

        ``requests`` are all live requests (to count admitted ones and outstanding KV). An
        admitted request gets the blocks of its prompt plus kappa + 1 look-ahead slots now, the
        rest of its reservation later (:meth:`ensure_blocks`), and a prefill peer (least
        ``prefill_load`` plus the requests this call gave it; ties rotate, so idle workers, one
        that just joined too, share the requests). Nothing is admitted while no prefill worker
        is known.
        """
        live = list(requests)
        admitted_now = sum(r.status is not RequestStatus.WAITING for r in live)
        free = self.block_manager.num_free_blocks - self.outstanding_blocks(live)
        out: list[Request] = []
        bm = self.block_manager
        given = dict.fromkeys(prefill_peers, 0)  # transfers this call starts, per peer
        for req in list(self.waiting):
            if admitted_now >= self.config.max_num_seqs or not prefill_peers:
                break
            if hold(req):
                continue
            reserve = bm.blocks_for(req.prompt_len + req.sampling.max_tokens)
            if free < reserve:
                break
            self.waiting.remove(req)
            first = bm.blocks_for(req.prompt_len + req.num_speculative_tokens + 1)
            req.block_table = bm.allocate(min(first, reserve))
            req.num_reserved_blocks = reserve
            free -= reserve
            turn = self._prefill_turn % len(prefill_peers)
            self._prefill_turn += 1
            order = prefill_peers[turn:] + prefill_peers[:turn]
            req.prefill_peer = min(order, key=lambda p: prefill_load(p) + given[p])
            given[req.prefill_peer] += 1
            req.status = RequestStatus.PREFILLING
            admitted_now += 1
            out.append(req)
        return out

    def outstanding_blocks(self, requests: Iterable[Request]) -> int:
        """Blocks promised to admitted requests but not allocated yet."""
        return sum(max(r.num_reserved_blocks - len(r.block_table), 0)
                   for r in requests if r.status is not RequestStatus.WAITING)

    def num_free_blocks(self, requests: Iterable[Request]) -> int:
        """Blocks neither allocated nor promised: room for new admissions."""
        return self.block_manager.num_free_blocks - self.outstanding_blocks(requests)

    def fork(self, leader: Request, sibling: Request, requests: Iterable[Request],
             num_shared_blocks: int) -> list[int] | None:
        """Admit waiting ``sibling`` onto ``leader``'s prompt KV (decode/siblings.py): its block
        table holds the leader's first ``num_shared_blocks`` blocks (shared) and its own blocks
        for the rest of its prompt plus kappa + 1 look-ahead slots; its reservation is its own
        request's, less the shared blocks. Returns the pairs to copy as ``[leader's partial
        block, sibling's copy]`` (empty: the prompt ends on a block boundary), or None when
        there is no sequence slot or KV room (nothing changes: it stays waiting)."""
        live = list(requests)
        if sum(r.status is not RequestStatus.WAITING for r in live) >= self.config.max_num_seqs:
            return None
        bm = self.block_manager
        reserve = bm.blocks_for(sibling.prompt_len + sibling.sampling.max_tokens)
        first = min(bm.blocks_for(sibling.prompt_len + sibling.num_speculative_tokens + 1),
                    reserve)
        if self.num_free_blocks(live) < reserve - num_shared_blocks:
            return None
        self.dequeue(sibling)
        own = bm.allocate(first - num_shared_blocks)
        sibling.block_table = bm.share(leader.block_table[:num_shared_blocks]) + own
        sibling.num_reserved_blocks = reserve
        sibling.prefill_peer = leader.prefill_peer
        sibling.status = RequestStatus.PREFILLING
        if sibling.prompt_len % bm.block_size:
            return [leader.block_table[num_shared_blocks], own[0]]
        return []

    def ensure_blocks(self, req: Request, num_tokens: int) -> None:
        """Grow ``req.block_table`` to hold ``num_tokens`` positions (out of its reservation)."""
        need = self.block_manager.blocks_for(num_tokens) - len(req.block_table)
        if need > 0:
            req.block_table.extend(self.block_manager.allocate(need))

    def release(self, req: Request) -> None:
        """Free every block of ``req`` and drop its reservation."""
        if req.block_table:
            self.block_manager.free(req.block_table)
        req.block_table = []
        req.num_reserved_blocks = 0

    def pick_drafter(self, req: Request, requests: Iterable[Request],
                     drafter_peers: list[str]) -> str | None:
        """The least loaded drafter for ``req``, or None when it should run without drafts
        (speculation off for it, quarantined, or no drafter known)."""
        if not (req.spec_enabled and req.num_speculative_tokens > 0 and drafter_peers):
            return None
        load = dict.fromkeys(drafter_peers, 0)
        for r in requests:
            if r.drafter in load:
                load[r.drafter] += 1
        return min(drafter_peers, key=lambda p: load[p])
