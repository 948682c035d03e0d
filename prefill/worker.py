"""Prefill worker: runs the target over prompts, ships the first token and the KV
(docs/architecture.md, 'Life of a request').

Each step takes the next batch off its queue (prefill/batching.py: several whole prompts in
one forward when that shortens their times to first token, or one prompt, in chunks of
``chunk_size`` tokens when long), allocates their blocks in its own KV cache, runs them, and
samples each request's output position 0 with its sampling mode (engine/sampling.py: greedy,
seeded = the coupled rule at position 0, or random). Then, per request, PrefillDone first (the
first token, the frame count and byte total of the transfer, and the seed state of the
request's draft method: ``PrefillConfig.seed_states``; "hidden": the target's final hidden
state at the last prompt position; "hidden:L1,L2,...": those decoder layers' outputs there,
side by side), so the verifier can stream the first token while the KV is still on its way;
then each request's KV as KVFrames stamped (request id, transfer id, layer range, chunk index).
KV frames and PrefillDone go on the same ordered channel. A PrefillCancel is acknowledged once
no frame of that transfer can follow.

With ``enable_prefix_caching`` the full KV blocks of the prompts prefilled stay in this worker's
cache (prefill/prefix_cache.py): a prompt whose leading full blocks were prefilled before
reuses them and computes only the rest (always its last token, whose logits give the first
token), then ships the KV of all its blocks as usual.

A batch whose verifier shares this worker's cores and computes nothing meanwhile
(``PrefillRequest.verifier_idle``) runs on the verifier's thread count too (``idle_threads``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specmesh.engine.block_manager import BlockManager, KVCacheExhausted
from specmesh.engine.frames import tensor_to_buffer
from specmesh.engine.grammar import GrammarCompiler, apply_masks, first_token_masks
from specmesh.engine.hidden_layers import is_hidden_seed, seed_state_layers
from specmesh.engine.logprobs import token_logprobs
from specmesh.engine.logits_processors import RowsHistory, apply_logits_processors
from specmesh.engine.runner import ModelRunner
from specmesh.engine.sampling import sample_tokens
from specmesh.prefill.batching import PrefillCost, batch_length
from specmesh.prefill.config import PrefillConfig
from specmesh.prefill.prefix_cache import PrefixCache, block_keys
from specmesh.protocol.errors import ProtocolError
from specmesh.protocol.messages import (
    Abort,
    Buffer,
    KVFrame,
    PrefillCancel,
    PrefillCancelAck,
    PrefillDone,
    PrefillRequest,
    TokenLogprobs,
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


@dataclass
class Claim:
    """One request's blocks in this worker during its prefill: ``held``, the cached prefix
    blocks it reuses (acquired from the prefix cache), then ``new``, the blocks it computes into;
    ``keys``: its full blocks' chained keys (empty with prefix caching off)."""

    held: list[int]
    new: list[int]
    keys: list[bytes]

    @property
    def table(self) -> list[int]:
        """The request's block table in this worker."""
        return self.held + self.new


@dataclass
class PrefillStats:
    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_frames_sent: int = 0
    num_bytes_sent: int = 0
    num_cancelled: int = 0
    num_failed: int = 0
    num_protocol_errors: int = 0
    num_dropped_backlog: int = 0  # queued requests of a verifier that went away or restarted
    num_dropped_messages: int = 0  # an Abort for no queued request, a kind prefill does not take
    num_computed_tokens: int = 0  # prompt tokens run through a forward (cache hits are not)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (vLLM's name)
    prefix_cache_hits: int = 0  # of those, tokens whose KV was cached (not computed)


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
        #: the KV blocks of past prompts (None: prefix caching off)
        self.prefix_cache = (PrefixCache(block_manager.block_size)
                             if config.enable_prefix_caching else None)
        #: structured output: compiles a constrained request's grammar to mask its first
        #: token (engine/grammar.py; set by the role host from the target's tokenizer; None:
        #: constrained requests are refused)
        self.grammars: GrammarCompiler | None = None

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
        follows the ack). Abort: the request is dropped if still queued. ProtocolError: counted;
        a named request is dropped. An Abort for no queued request and anything else are
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
        elif isinstance(msg, Abort):
            if not self._drop_queued(env.peer, lambda r: r.request_id == msg.request_id):
                self.stats.num_dropped_messages += 1  # not queued (unknown, running or done)
        else:
            self.stats.num_dropped_messages += 1
            log.debug("prefill ignores %s from %s", type(msg).__name__, env.peer)

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
        n = len(req.prompt_token_ids)
        cfg = self.model_config
        if n == 0:
            return "empty prompt"
        if n > cfg.max_position_embeddings:
            return f"prompt of {n} tokens exceeds max_position_embeddings {cfg.max_position_embeddings}"
        if any(t < 0 or t >= cfg.vocab_size for t in req.prompt_token_ids):
            return f"prompt token id outside [0, {cfg.vocab_size})"
        for sampling in [req.sampling] + list(req.sibling_sampling or []):
            why = sampling.invalid_reason() or sampling.vocab_reason(cfg.vocab_size)
            if why:
                return why
        why = self._grammar_reason(req)
        if why:
            return why
        if not req.block_table:
            return "no destination blocks"
        if self.block_manager.blocks_for(n) > self.block_manager.num_blocks:
            return f"prompt of {n} tokens does not fit this prefill worker's KV cache"
        return ""

    def _grammar_reason(self, req: PrefillRequest) -> str:
        """Why ``req``'s grammar cannot mask its first token ("" when it can, or it has
        none); compiling it here caches it for :meth:`_forward`."""
        spec = req.sampling.grammar
        if spec is None:
            return ""
        if self.grammars is None:
            return "structured output needs the model's tokenizer on the prefill worker"
        try:
            self.grammars.matcher(spec)
        except ValueError as err:
            return f"grammar: {err}"
        return ""

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
            n = len(item.req.prompt_token_ids)
            if n > chunk or self._validate(item.req):
                break
            sizes.append(n)
        take = 1
        if len(sizes) > 1:
            cost = self.cost_models.get(self._threads_for(self.queue[0].req))
            take = batch_length(sizes, self.config.max_batch_tokens,
                                cost.fit() if cost is not None else None)
        blocks = 0
        batch: list[Queued] = []
        for item in list(self.queue)[:take]:
            blocks += bm.blocks_for(len(item.req.prompt_token_ids))
            if not self._can_allocate(blocks):
                break  # (single-threaded, the worker's blocks are free between batches)
            batch.append(item)
        for _ in batch:
            self.queue.popleft()
        return batch

    def _can_allocate(self, num_blocks: int) -> bool:
        """``num_blocks`` blocks are free or can be freed by evicting unused cached ones."""
        evictable = self.prefix_cache.num_evictable_blocks if self.prefix_cache else 0
        return 0 <= num_blocks <= self.block_manager.num_free_blocks + evictable

    def _allocate(self, num_blocks: int) -> list[int]:
        """``num_blocks`` free blocks, evicting least recently used cached ones for room."""
        bm = self.block_manager
        short = num_blocks - bm.num_free_blocks
        if short > 0 and self.prefix_cache is not None:
            bm.free(self.prefix_cache.evict(short))
        return bm.allocate(num_blocks)

    def _claim_blocks(self, reqs: list[PrefillRequest]) -> list[Claim]:
        """Per request its blocks: with prefix caching, the longest cached run of its
        leading full blocks that leaves its last token to compute (whose logits give the first
        token), then new blocks for the rest. On failure nothing stays claimed.

        Raises:
            KVCacheExhausted: not enough blocks, even after evicting every unused cached one.
        """
        cache, bm = self.prefix_cache, self.block_manager
        claims: list[Claim] = []
        try:
            for req in reqs:
                n = len(req.prompt_token_ids)
                claim = Claim([], [], [])
                claims.append(claim)
                if cache is not None:
                    claim.keys = block_keys(req.prompt_token_ids, bm.block_size)
                    # prompt logprobs need every prompt row's logits: nothing reused
                    if req.sampling.prompt_logprobs is None:
                        claim.held = cache.match(claim.keys, (n - 1) // bm.block_size)
                claim.new = self._allocate(bm.blocks_for(n) - len(claim.held))
        except BaseException:
            self._unclaim(claims, keep=False)
            raise
        return claims

    def _unclaim(self, claims: list[Claim], keep: bool) -> None:
        """Hand back a batch's blocks; with ``keep`` (their KV computed) each request's new
        full blocks go to the prefix cache first, where it has none under their keys yet."""
        cache = self.prefix_cache
        for claim in claims:
            taken: list[int] = []
            if cache is not None:
                if keep:
                    n_held = len(claim.held)
                    taken = cache.insert(claim.keys[n_held:],
                                         claim.new[:len(claim.keys) - n_held])
                cache.release(claim.held + taken)
            kept = set(taken)
            self.block_manager.free([b for b in claim.new if b not in kept])

    def _threads_for(self, req: PrefillRequest) -> int:
        """Torch threads a batch led by ``req`` runs on (0: the worker does not set them)."""
        if self.idle_threads is None:
            return 0
        threads, idle, _ = self.idle_threads
        return idle if req.verifier_idle and idle > threads else threads

    def _run_batch(self, batch: list[Queued]) -> None:
        """Prefill ``batch`` (one prompt, chunked, or several whole prompts in one forward),
        then per request PrefillDone with its first token, all of them first, then each
        request's KV frames (docs/architecture.md, 'KV transfer')."""
        reqs = [item.req for item in batch]
        sizes = [len(r.prompt_token_ids) for r in reqs]
        now = time.monotonic()
        for item in batch:
            self.profile.observe("queue_wait", max(now - item.received, 0.0))
        claims = self._claim_blocks(reqs)
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
        try:
            t0 = time.monotonic()
            with self.profile.phase("forward"):
                firsts, seeds, logprobs, siblings = self._forward(reqs, tables, starts)
            if len(reqs) > 1 or computed[0] <= self.config.chunk_size:  # one forward: a point
                self.cost_models.setdefault(threads, PrefillCost()).observe(
                    sum(computed), time.monotonic() - t0)
            self.profile.count("num_batches")
            self.profile.count("num_batch_prompts", len(reqs))
            with self.profile.phase("send_kv"):
                frames = [self._kv_frames(r, t, n) for r, t, n in zip(reqs, tables, sizes)]
                for item, first, seed, fs, (lp, prompt_lp), (sib, sib_lps) in zip(
                        batch, firsts, seeds, frames, logprobs, siblings):
                    req = item.req
                    self.send(item.peer, PrefillDone(
                        request_id=req.request_id, transfer_id=req.transfer_id,
                        first_token_id=first, num_frames=len(fs),
                        num_bytes=sum(f.kv.nbytes for f in fs), seed_state=seed,
                        logprobs=lp, prompt_logprobs=prompt_lp,
                        sibling_first_token_ids=sib, sibling_logprobs=sib_lps))
                for item, fs in zip(batch, frames):
                    self._send_frames(item.peer, fs)
            done = True
        finally:
            if boost:
                self.idle_threads[2](self.idle_threads[0])
            self._unclaim(claims, keep=done)  # computed KV stays cached, if on
        self.stats.num_requests += len(reqs)
        self.stats.num_prompt_tokens += sum(sizes)
        self.stats.num_computed_tokens += sum(computed)
        if self.prefix_cache is not None:
            self.stats.prefix_cache_queries += sum(sizes)
            self.stats.prefix_cache_hits += sum(starts)
            self.profile.count("prefix_cache_hit_tokens", sum(starts))

    def _forward(self, reqs: list[PrefillRequest], tables: list[list[int]], starts: list[int]
                 ) -> tuple[list[int], list[Buffer | None], list[tuple[TokenLogprobs | None, ...]],
                            list[tuple[list[int] | None, list[TokenLogprobs] | None]]]:
        """Run the prompts, each from ``starts[i]`` (its KV before that is cached); returns
        per request its first token (output position 0, by its sampling mode), the seed
        state PrefillDone carries (None: its method has none), its (first token, prompt)
        logprobs when asked (SamplingParams.logprobs / prompt_logprobs) and its siblings'
        first tokens with their logprobs when asked (PrefillRequest.sibling_sampling, each by
        its own sampling from the same row; None: it has none)."""
        kinds = [self.config.seed_states.get(r.draft_method, "") for r in reqs]
        # hidden states once per batch: the widest layer set any request's method asks for
        hidden_kinds = sorted({k for k in kinds if is_hidden_seed(k)})
        layers = None
        if hidden_kinds:
            wanted = {seed_state_layers(k) for k in hidden_kinds}
            layers = wanted.pop() if len(wanted) == 1 else ()
        if layers == ():  # methods of one batch that want different layers: one at a time
            out = [self._forward(reqs[i:i + 1], tables[i:i + 1], starts[i:i + 1])
                   for i in range(len(reqs))]
            return ([f for o in out for f in o[0]], [s for o in out for s in o[1]],
                    [x for o in out for x in o[2]], [x for o in out for x in o[3]])
        want_hidden = bool(hidden_kinds)
        prompts = [r.prompt_token_ids[s:] for r, s in zip(reqs, starts)]
        paged = self.prefix_cache is not None  # chunk invariant: cached or not, the same bits
        prompt_lps: list[TokenLogprobs | None] = [None] * len(reqs)
        if len(reqs) == 1 and reqs[0].sampling.prompt_logprobs is not None:
            out, prompt_lps[0] = self._prefill_with_prompt_logprobs(
                reqs[0], tables[0], want_hidden, layers, paged)
            logits, hidden = (([out[0]], [out[1]]) if want_hidden else ([out], None))
        elif len(reqs) == 1:
            out = self.runner.prefill(prompts[0], tables[0], chunk_size=self.config.chunk_size,
                                      start_pos=starts[0], return_hidden=want_hidden,
                                      hidden_layers=layers, paged=paged)
            logits, hidden = (([out[0]], [out[1]]) if want_hidden else ([out], None))
        else:  # whole prompts (bounded by the batch's token budget): every row's logits only
            # when a request asks for prompt logprobs (whose prompt then starts at 0: no cache)
            rows = "all" if any(r.sampling.prompt_logprobs is not None for r in reqs) else "last"
            out = self.runner.prefill_batch(prompts, tables, return_hidden=want_hidden,
                                            hidden_layers=layers, start_positions=starts,
                                            paged=paged, logits=rows)
            logits, hidden = out if want_hidden else (out, None)
            for i, r in enumerate(reqs):
                k = r.sampling.prompt_logprobs
                if k is not None:
                    ids = r.prompt_token_ids
                    prompt_lps[i] = token_logprobs(logits[i][:len(ids) - 1], ids[1:],
                                                   min(k, logits[i].shape[-1]))
        last = torch.cat([x.reshape(-1, x.shape[-1])[-1:] for x in logits])
        # penalties and token constraints at output position 0: history = the prompt
        apply_logits_processors(last, [RowsHistory(r.sampling, r.prompt_token_ids, (), i)
                                       for i, r in enumerate(reqs)])
        # structured output: output position 0 under the grammar's initial mask
        rows, allowed = first_token_masks(self.grammars, [r.sampling.grammar for r in reqs],
                                          last.device)
        for j, i in enumerate(rows):
            apply_masks(last[i:i + 1], allowed[j:j + 1])
        # output position 0, by each request's mode (engine/sampling.py): greedy argmax,
        # coupled Gumbel-max keyed by (seed, 0), or a draw from this worker's generator
        firsts = sample_tokens(last, [r.sampling for r in reqs], [0] * len(reqs),
                               self._generator(last.device))
        siblings: list[list[int] | None] = []
        for i, r in enumerate(reqs):
            m = len(r.sibling_sampling or [])
            rows = last[i:i + 1].expand(m, -1).contiguous()
            siblings.append(sample_tokens(rows, r.sibling_sampling, [0] * m,
                                          self._generator(last.device)) if m else None)
        seeds: list[Buffer | None] = []
        for i, kind in enumerate(kinds):  # EAGLE family: f_{p-1}, the state that predicted 0
            seeds.append(tensor_to_buffer(hidden[i][-1:].clone()) if is_hidden_seed(kind)
                         else None)
        firsts = list(firsts)
        first_lps = [None if r.sampling.logprobs is None else
                     token_logprobs(last[i:i + 1], [firsts[i]],
                                    min(r.sampling.logprobs, last.shape[-1]))
                     for i, r in enumerate(reqs)]
        sibling_parts = []
        for i, (r, toks) in enumerate(zip(reqs, siblings)):
            lps = None
            if toks is not None and any(sp.logprobs is not None for sp in r.sibling_sampling):
                lps = [token_logprobs(last[i:i + 1], [t], min(sp.logprobs or 0, last.shape[-1]))
                       for sp, t in zip(r.sibling_sampling, toks)]
            sibling_parts.append((toks, lps))
        return firsts, seeds, list(zip(first_lps, prompt_lps)), sibling_parts

    def _prefill_with_prompt_logprobs(self, req: PrefillRequest, table: list[int],
                                      want_hidden: bool, layers, paged: bool):  # noqa: ANN001
        """Run ``req``'s whole prompt chunk by chunk as ``runner.prefill`` does, taking each
        chunk's logprobs from its logits before the next (a long prompt never holds every
        row's logits at once). Returns what ``runner.prefill`` returns (the last row's logits,
        with the hidden states when asked) and the prompt's logprobs: row i predicts prompt
        token i + 1, the float32 log_softmax of the raw logits (engine/logprobs.py), as the
        verifier reports the output's; position 0 has none (OpenAI and vLLM report None)."""
        ids = req.prompt_token_ids
        step = self.config.chunk_size or len(ids)
        parts: list[TokenLogprobs] = []
        hiddens: list[torch.Tensor] = []
        last = None
        for lo in range(0, len(ids), step):
            out = self.runner.prefill(ids[lo:lo + step], table, start_pos=lo,
                                      return_hidden=want_hidden, hidden_layers=layers,
                                      paged=paged, logits="all")
            rows, hidden = out if want_hidden else (out, None)
            if hidden is not None:
                hiddens.append(hidden)
            targets = ids[lo + 1:lo + 1 + rows.shape[0]]  # the last row predicts the output
            parts.append(token_logprobs(rows[:len(targets)], targets,
                                        min(req.sampling.prompt_logprobs, rows.shape[-1])))
            last = rows[-1:]
        prompt_lp = TokenLogprobs.concat(parts)
        return ((last, torch.cat(hiddens)) if want_hidden else last), prompt_lp

    def _kv_frames(self, req: PrefillRequest, block_table: list[int], n: int) -> list[KVFrame]:
        """The KVFrames of ``req``'s prompt KV: at most ``frame_tokens`` tokens x
        ``frame_layers`` layers each, in chunk order."""
        cache = self.runner.kv_cache
        num_layers = self.model_config.num_layers
        frames: list[KVFrame] = []
        for token_start in range(0, n, self.config.frame_tokens):
            num_tokens = min(self.config.frame_tokens, n - token_start)
            for layer_start in range(0, num_layers, self.config.frame_layers):
                layer_end = min(layer_start + self.config.frame_layers, num_layers)
                kv = cache.read_chunk(layer_start, layer_end, block_table, token_start, num_tokens)
                frames.append(KVFrame(
                    request_id=req.request_id, transfer_id=req.transfer_id,
                    layer_start=layer_start, layer_end=layer_end, chunk_index=len(frames),
                    token_start=token_start, num_tokens=num_tokens, kv=tensor_to_buffer(kv)))
        return frames

    def _send_frames(self, peer: str, frames: list[KVFrame]) -> None:
        """Send one request's frames, paced by ``max_kv_send_mb_s`` (its first frame at once)."""
        rate = self.config.max_kv_send_mb_s * (1 << 20)  # bytes/s; 0: no cap
        t0 = time.monotonic()
        num_bytes = 0
        for frame in frames:
            if rate:  # the bytes sent so far may not have left faster than the cap
                time.sleep(max(0.0, t0 + num_bytes / rate - time.monotonic()))
            self.send(peer, frame)
            num_bytes += frame.kv.nbytes
        self.stats.num_frames_sent += len(frames)
        self.stats.num_bytes_sent += num_bytes

    def step(self, timeout_s: float = 0.0) -> int:
        """Ingest messages, then prefill the next batch of queued requests (one forward, or
        one long prompt in chunks); returns the requests done."""
        self.ingest(0.0 if self.queue else timeout_s)
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

