"""Prefill worker: runs the target over prompts, ships the first token and the KV
(docs/architecture.md, 'Life of a request').

Each step takes the next batch off its queue (prefill/batching.py: several whole prompts in
one forward when that shortens their times to first token, or one prompt, in chunks of
``chunk_size`` tokens when long), claims their blocks in its own KV cache (prefill/claims.py),
runs them and samples each request's output position 0 (prefill/forward.py,
prefill/first_token.py), and the first draft step of methods that have a seeder
(prefill/draft_seed.py). Then, per request, PrefillDone first (the first token, the frame count
and byte total of the transfer, the seed state of the request's draft method and its draft
seed), so the
verifier can stream the first token while the KV is still on its way; then each request's KV
as KVFrames (prefill/kv_frames.py). KV frames and PrefillDone go on the same ordered channel.
A PrefillCancel is acknowledged once no frame of that transfer can follow.

With ``enable_prefix_caching`` a prompt reuses the cached KV of its leading full blocks
(prefill/prefix_cache.py) and ships the KV of all its blocks as usual. A batch whose verifier
shares these cores and idles meanwhile (``PrefillRequest.verifier_idle``) runs on the
verifier's threads too (``idle_threads``), as far as no other process keeps those cores busy
(``free_cpus``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specmesh.engine.block_manager import BlockManager, KVCacheExhausted
from specmesh.engine.grammar import GrammarCompiler
from specmesh.engine.lora_runtime import RuntimeAdapters
from specmesh.engine.runner import ModelRunner
from specmesh.prefill.batching import PrefillCost, batch_length
from specmesh.prefill.claims import can_allocate, claim_blocks, tokens_to_compute, unclaim
from specmesh.prefill.config import PrefillConfig
from specmesh.prefill.draft_seed import DraftSeeder, draft_seeds
from specmesh.prefill.forward import prefill_forward
from specmesh.prefill.kv_frames import kv_frames, send_frames
from specmesh.prefill.lora_ops import PrefillLora
from specmesh.prefill.prefill_stats import PrefillStats
from specmesh.prefill.prefix_cache import PrefixCache
from specmesh.prefill.validation import invalid_reason
from specmesh.protocol.errors import ProtocolError
from specmesh.protocol.messages import (
    Abort,
    KVFrame,
    LoraAdapterOp,
    PrefillCancel,
    PrefillCancelAck,
    PrefillDone,
    PrefillRequest,
)
from specmesh.protocol.step_profile import StepProfile
from specmesh.protocol.transport import Envelope, Mailbox, MailboxWorker

log = logging.getLogger(__name__)


@dataclass
class Queued:
    """A PrefillRequest waiting in the queue: who sent it and when it arrived (monotonic)."""

    peer: str
    req: PrefillRequest
    received: float


class PrefillWorker(MailboxWorker):
    """Plain-class prefill role; drive it with ``step()`` or ``run(stop)``."""

    name = "prefill"

    def __init__(self, config: PrefillConfig, mailbox: Mailbox, runner: ModelRunner,
                 block_manager: BlockManager) -> None:
        self.config = config
        self.mailbox = mailbox
        self.runner = runner
        self.block_manager = block_manager
        self.model_config = runner.config
        self.queue: deque[Queued] = deque()
        self.stats = PrefillStats()
        self.profile = StepProfile()
        self._generators: dict[torch.device, torch.Generator] = {}
        #: the forward's cost per torch thread count (0: threads not set by the worker), fit
        #: from this worker's forwards; decides the batches (prefill/batching.py)
        self.cost_models: dict[int, PrefillCost] = {}
        #: (threads, idle threads, setter): a prompt whose verifier waits idle on the same
        #: cores (PrefillRequest.verifier_idle) runs on ``idle threads``, then back to
        #: ``threads`` (set by cluster/hosts/prefill.py on a CPU node; None: never)
        self.idle_threads: tuple[int, int, Callable[[int], None]] | None = None
        #: CPUs no other process uses now (engine/cpu_load.py; None: unknown): a batch takes
        #: the idle threads only as far as they are free, since a team of threads beside a busy
        #: process stalls at every barrier (set by the role host with ``idle_threads``)
        self.free_cpus: Callable[[], int | None] | None = None
        self._free_reading: tuple[float, int | None] = (-1.0, None)
        #: the KV blocks of past prompts (None: prefix caching off)
        self.prefix_cache = (PrefixCache(block_manager.block_size)
                             if config.enable_prefix_caching else None)
        #: structured output: compiles a constrained request's grammar to mask its first
        #: token (engine/grammar.py; set by the role host from the target's tokenizer; None:
        #: constrained requests are refused)
        self.grammars: GrammarCompiler | None = None
        #: LoRA adapters loaded / unloaded at run time (prefill/lora_ops.py); an unloaded one
        #: is freed once no queued request uses it
        runtime = RuntimeAdapters(runner.model, lambda name: sum(
            q.req.lora_name == name for q in self.queue))
        runtime.on_freed = self._drop_cached_blocks
        self.lora = PrefillLora(runtime, self.send, config.instance_id)
        #: draft method -> its seeder: the method's first draft step run after the forward,
        #: shipped as PrefillDone.draft_seed (prefill/draft_seed.py; set by the cluster from
        #: the drafter registry, ``--prefill-draft-seed``; empty: none)
        self.draft_seeders: dict[str, DraftSeeder] = {}

    @property
    def num_unused_blocks(self) -> int:
        """KV blocks no prompt holds: the free ones plus the cached ones no prompt uses (handed
        back on demand), so a leak check reads the same with prefix caching on or off."""
        evictable = 0 if self.prefix_cache is None else self.prefix_cache.num_evictable_blocks
        return self.block_manager.num_free_blocks + evictable

    def _generator(self, device: torch.device) -> torch.Generator:
        """This worker's randomness for unseeded sampled first tokens (freshly seeded)."""
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
            gen.seed()
        return gen

    # -- ingest ----------------------------------------------------------------------------

    def handle(self, env: Envelope) -> None:
        """PrefillRequest: queued (refused with a failed PrefillDone when the queue is full).
        PrefillCancel: the transfer is dropped if still queued, then acknowledged (nothing of it
        follows the ack). LoraAdapterOp: applied to the model's LoRA adapters and answered
        (prefill/lora_ops.py). Abort: the request is dropped if still queued. ProtocolError:
        counted; a named request is dropped. An Abort for no queued request and anything else are
        dropped and counted (``num_dropped_messages``). Every match is by sender: a
        transfer is keyed by (verifier, transfer id), so one verifier's cancel or abort never
        drops another verifier's transfer that happens to have the same id."""
        msg = env.msg
        if isinstance(msg, ProtocolError):
            self.stats.num_protocol_errors += 1
            if msg.request_id is not None:  # fail only the named request
                self._drop_queued(env.peer, lambda r: r.request_id == msg.request_id)
            return
        if isinstance(msg, PrefillRequest):
            if len(self.queue) >= self.config.max_queue_len:
                self._fail(env.peer, msg, "prefill queue full")
            else:
                self.queue.append(Queued(env.peer, msg, time.monotonic()))
        elif isinstance(msg, PrefillCancel):
            self._drop_queued(env.peer, lambda r: r.transfer_id == msg.transfer_id)
            self.stats.num_cancelled += 1
            self.send(env.peer, PrefillCancelAck(request_id=msg.request_id,
                                                  transfer_id=msg.transfer_id))
        elif isinstance(msg, LoraAdapterOp):
            self.lora.on_op(env.peer, msg)
        elif isinstance(msg, Abort):
            if not self._drop_queued(env.peer, lambda r: r.request_id == msg.request_id):
                self.stats.num_dropped_messages += 1  # not queued (unknown, running or done)
        else:
            self.stats.num_dropped_messages += 1
            log.debug("prefill ignores %s from %s", type(msg).__name__, env.peer)

    def _drop_cached_blocks(self, lora_name: str) -> None:
        """An adapter was freed: the prefix cache's unused blocks go (they may hold its KV,
        which a later adapter of the same name must not reuse)."""
        if self.prefix_cache is not None:
            self.block_manager.free(self.prefix_cache.evict(
                self.prefix_cache.num_evictable_blocks))

    def _drop_queued(self, peer: str, match) -> int:
        """Drop the queued requests of ``peer`` that ``match``; returns how many."""
        before = len(self.queue)
        self.queue = deque(q for q in self.queue if q.peer != peer or not match(q.req))
        return before - len(self.queue)

    def drop_peer(self, peer: str) -> int:
        """``peer`` (a verifier) is gone or restarted (a new incarnation): drop its backlog,
        which nobody will receive (its frames would reach the new incarnation under transfer
        ids it never issued). Returns the requests dropped."""
        n = self._drop_queued(peer, lambda r: True)
        self.stats.num_dropped_backlog += n
        if n:
            log.info("dropped %d queued prefill requests of %s (gone or restarted)", n, peer)
        return n

    # -- work ------------------------------------------------------------------------------

    def _validate(self, req: PrefillRequest) -> str:
        """Why ``req`` cannot be prefilled here ("" when it can; prefill/validation.py)."""
        bank = self.runner.model.lora
        return invalid_reason(req, self.model_config, self.block_manager, self.grammars,
                              set(bank.names) if bank is not None else frozenset())

    def _fail(self, peer: str, req: PrefillRequest, error: str) -> None:
        self.stats.num_failed += 1
        self.send(peer, PrefillDone(request_id=req.request_id, transfer_id=req.transfer_id,
                                     first_token_id=-1, num_frames=0, num_bytes=0, error=error))

    def _next_batch(self) -> list[Queued]:
        """Pop the next batch off the queue (failing invalid requests at its head on the way):
        one prompt longer than ``chunk_size`` (run alone, chunked), or the prompts of the
        queue's head that :func:`prefill.batching.batch_length` takes into one forward (each
        at most ``chunk_size`` tokens, within ``max_batch_tokens``) and whose blocks this
        worker can allocate. Empty when nothing can run now."""
        while self.queue and (error := self._validate(self.queue[0].req)):
            item = self.queue.popleft()
            self._fail(item.peer, item.req, error)
        if not self.queue:
            return []
        bm, chunk = self.block_manager, self.config.chunk_size
        sizes: list[int] = []
        for item in self.queue:  # the head's run of valid prompts that fit in one chunk
            if len(item.req.prompt_token_ids) > chunk or self._validate(item.req):
                break
            # sized by the tokens it computes: a cached prefix costs the forward nothing
            sizes.append(tokens_to_compute(self.prefix_cache, item.req, bm.block_size))
        take = 1
        if len(sizes) > 1:
            cost = self.cost_models.get(self._threads_for(self.queue[0].req))
            take = batch_length(sizes, self.config.max_batch_tokens,
                                cost.fit() if cost is not None else None)
        blocks = 0
        batch: list[Queued] = []
        for item in list(self.queue)[:take]:
            blocks += bm.blocks_for(len(item.req.prompt_token_ids))
            if not can_allocate(bm, self.prefix_cache, blocks):
                break  # (single-threaded, the worker's blocks are free between batches)
            batch.append(item)
        for _ in batch:
            self.queue.popleft()
        return batch

    def _threads_for(self, req: PrefillRequest) -> int:
        """Torch threads a batch led by ``req`` runs on (0: the worker does not set them)."""
        if self.idle_threads is None:
            return 0
        threads, idle, _ = self.idle_threads
        if not (req.verifier_idle and idle > threads):
            return threads
        free = self._free_now()
        return idle if free is None else max(threads, min(idle, free))

    def _free_now(self) -> int | None:
        """:attr:`free_cpus`, read at most once per batch (a reading serves 5 ms)."""
        if self.free_cpus is None:
            return None
        now = time.monotonic()
        if now - self._free_reading[0] > 0.005:
            self._free_reading = (now, self.free_cpus())
        return self._free_reading[1]

    def _run_batch(self, batch: list[Queued]) -> None:
        """Prefill ``batch`` (one prompt, chunked, or several whole prompts in one forward),
        then per request PrefillDone with its first token, all of them first, then each
        request's KV frames (docs/architecture.md, 'KV transfer')."""
        reqs = [item.req for item in batch]
        sizes = [len(r.prompt_token_ids) for r in reqs]
        now = time.monotonic()
        for item in batch:
            self.profile.observe("queue_wait", max(now - item.received, 0.0))
        claims = claim_blocks(self.block_manager, self.prefix_cache, reqs)
        tables = [c.table for c in claims]
        starts = [len(c.held) * self.block_manager.block_size for c in claims]
        computed = [n - s for n, s in zip(sizes, starts)]
        done = False
        # a verifier on the same cores pauses its verify steps for this prompt (or has nothing
        # to do): the batch runs on its threads too
        threads = max(self._threads_for(r) for r in reqs)
        boost = self.idle_threads is not None and threads > self.idle_threads[0]
        if boost:
            self.idle_threads[2](threads)
            self.profile.count("num_prefills_on_idle_verifier_cores", len(reqs))
        elif self.idle_threads is not None and any(r.verifier_idle for r in reqs):
            # the verifier idles but another process keeps its cores busy (free_cpus)
            self.profile.count("num_prefills_idle_cores_busy", len(reqs))
        try:
            t0 = time.monotonic()
            with self.profile.phase("forward"):
                firsts, seeds, logprobs, siblings = prefill_forward(
                    self.runner, self.config, self.prefix_cache is not None, self.grammars,
                    self._generator, reqs, tables, starts)
            if self.draft_seeders:
                with self.profile.phase("draft_seed"):
                    dseeds = draft_seeds(self.draft_seeders, reqs, firsts, seeds, self.stats)
            else:
                dseeds = [None] * len(reqs)
            if len(reqs) > 1 or computed[0] <= self.config.chunk_size:  # one forward: a point
                self.cost_models.setdefault(threads, PrefillCost()).observe(
                    sum(computed), time.monotonic() - t0)
            self.profile.count("num_batches")
            self.profile.count("num_batch_prompts", len(reqs))
            with self.profile.phase("send_kv"):
                frames = [kv_frames(self.runner.kv_cache, self.model_config.num_layers,
                                    self.config, r, t, n)
                          for r, t, n in zip(reqs, tables, sizes)]
                for item, first, seed, dseed, fs, (lp, prompt_lp), (sib, sib_lps), cached in zip(
                        batch, firsts, seeds, dseeds, frames, logprobs, siblings, starts):
                    req = item.req
                    self.send(item.peer, PrefillDone(
                        request_id=req.request_id, transfer_id=req.transfer_id,
                        first_token_id=first, num_frames=len(fs),
                        num_bytes=sum(f.kv.nbytes for f in fs), seed_state=seed,
                        logprobs=lp, prompt_logprobs=prompt_lp,
                        sibling_first_token_ids=sib, sibling_logprobs=sib_lps,
                        num_cached_tokens=cached, draft_seed=dseed))
                for item, fs in zip(batch, frames):
                    self._send_frames(item.peer, fs)
            done = True
        finally:
            if boost:
                self.idle_threads[2](self.idle_threads[0])
            # computed KV stays cached, if on
            unclaim(self.block_manager, self.prefix_cache, claims, keep=done)
        self.stats.num_requests += len(reqs)
        self.stats.num_prompt_tokens += sum(sizes)
        self.stats.num_computed_tokens += sum(computed)
        if self.prefix_cache is not None:
            self.stats.prefix_cache_queries += sum(sizes)
            self.stats.prefix_cache_hits += sum(starts)
            self.profile.count("prefix_cache_hit_tokens", sum(starts))

    def _send_frames(self, peer: str, frames: list[KVFrame]) -> None:
        """Send one request's frames, paced by ``max_kv_send_mb_s`` (prefill/kv_frames.py)."""
        self.stats.num_bytes_sent += send_frames(self.send, peer, frames,
                                                 self.config.max_kv_send_mb_s)
        self.stats.num_frames_sent += len(frames)

    def step(self, timeout_s: float = 0.0) -> int:
        """Ingest messages, then prefill the next batch of queued requests (one forward, or
        one long prompt in chunks); returns the requests done."""
        self.ingest(0.0 if self.queue else timeout_s)
        self.lora.reap()
        batch = self._next_batch()
        if not batch:
            return 0
        try:
            self._run_batch(batch)
        except KVCacheExhausted as err:
            for item in batch:
                self._fail(item.peer, item.req, str(err))
        except Exception as err:  # a bad prompt must not kill the role
            log.exception("prefill of %s failed", [item.req.request_id for item in batch])
            for item in batch:
                self._fail(item.peer, item.req, f"prefill failed: {err}")
        return len(batch)

