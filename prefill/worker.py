"""Prefill worker: runs the target over prompts, ships the KV and the first token
(docs/architecture.md, 'Life of a request').

For each PrefillRequest it allocates blocks in its own KV cache, runs the prompt (in chunks of
``chunk_size`` tokens when long), samples output position 0 with the request's sampling mode
(engine/sampling.py: greedy, seeded = the coupled rule at position 0, or random), streams the
prompt's KV to the verifier as KVFrames stamped (request id, transfer id, layer range, chunk
index) and finishes with PrefillDone carrying the frame count and byte total, and the seed
state of the request's draft method (``PrefillConfig.seed_states``; "hidden": the target's
final hidden state at the last prompt position; "hidden:L1,L2,...": those decoder layers' outputs
there, side by side). KV frames and PrefillDone go on the same
ordered channel. A PrefillCancel is acknowledged once no frame of that transfer can follow.
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
from specmesh.engine.hidden_layers import is_hidden_seed, seed_state_layers
from specmesh.engine.runner import ModelRunner
from specmesh.engine.sampling import sample_tokens
from specmesh.prefill.config import PrefillConfig
from specmesh.protocol.errors import ProtocolError
from specmesh.protocol.messages import (
    Abort,
    KVFrame,
    PrefillCancel,
    PrefillCancelAck,
    PrefillDone,
    PrefillRequest,
)
from specmesh.protocol.step_profile import StepProfile
from specmesh.protocol.transport import Envelope, Mailbox, MailboxWorker

log = logging.getLogger(__name__)


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
        self.queue: deque[tuple[str, PrefillRequest]] = deque()
        self.stats = PrefillStats()
        self.profile = StepProfile()
        self._generators: dict[torch.device, torch.Generator] = {}
        #: (threads, idle threads, setter): a prompt whose verifier waits idle on the same
        #: cores (PrefillRequest.verifier_idle) runs on ``idle threads``, then back to
        #: ``threads`` (set by cluster/hosts/prefill.py on a CPU node; None: never)
        self.idle_threads: tuple[int, int, Callable[[int], None]] | None = None

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
                self.queue.append((env.peer, msg))
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
        self.queue = deque((p, r) for p, r in self.queue if p != peer or not match(r))
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
        why = req.sampling.invalid_reason()
        if why:
            return why
        if not req.block_table:
            return "no destination blocks"
        if self.block_manager.blocks_for(n) > self.block_manager.num_blocks:
            return f"prompt of {n} tokens does not fit this prefill worker's KV cache"
        return ""

    def _fail(self, peer: str, req: PrefillRequest, error: str) -> None:
        self.stats.num_failed += 1
        self.send(peer, PrefillDone(request_id=req.request_id, transfer_id=req.transfer_id,
                                     first_token_id=-1, num_frames=0, num_bytes=0, error=error))

    def _run_one(self, peer: str, req: PrefillRequest) -> None:
        n = len(req.prompt_token_ids)
        kind = self.config.seed_states.get(req.draft_method, "")
        want_hidden = is_hidden_seed(kind)
        seed_state = None
        block_table = self.block_manager.allocate(self.block_manager.blocks_for(n))
        boost = self.idle_threads is not None and req.verifier_idle \
            and self.idle_threads[1] > self.idle_threads[0]
        if boost:
            self.idle_threads[2](self.idle_threads[1])
            self.profile.count("num_prefills_on_idle_verifier_cores")
        try:
            with self.profile.phase("forward"):
                out = self.runner.prefill(req.prompt_token_ids, block_table,
                                          chunk_size=self.config.chunk_size,
                                          return_hidden=want_hidden,
                                          hidden_layers=seed_state_layers(kind)
                                          if want_hidden else None)
                logits = out[0] if want_hidden else out
                if want_hidden:  # EAGLE family: f_{p-1}, the state that predicted position 0
                    seed_state = tensor_to_buffer(out[1][-1:].clone())
                last = logits.reshape(-1, logits.shape[-1])[-1:]
                # output position 0, by the request's mode (engine/sampling.py): greedy argmax,
                # coupled Gumbel-max keyed by (seed, 0), or a draw from this worker's generator
                (first,) = sample_tokens(last, [req.sampling], [0], self._generator(last.device))
            with self.profile.phase("send_kv"):
                num_frames, num_bytes = self._send_kv(peer, req, block_table, n)
        finally:
            if boost:
                self.idle_threads[2](self.idle_threads[0])
            self.block_manager.free(block_table)
        self.stats.num_requests += 1
        self.stats.num_prompt_tokens += n
        self.send(peer, PrefillDone(request_id=req.request_id, transfer_id=req.transfer_id,
                                     first_token_id=first, num_frames=num_frames,
                                     num_bytes=num_bytes, seed_state=seed_state))

    def _send_kv(self, peer: str, req: PrefillRequest, block_table: list[int],
                 n: int) -> tuple[int, int]:
        cache = self.runner.kv_cache
        num_layers = self.model_config.num_layers
        num_frames = num_bytes = 0
        rate = self.config.max_kv_send_mb_s * (1 << 20)  # bytes/s; 0: no cap
        t0 = time.monotonic()
        for token_start in range(0, n, self.config.frame_tokens):
            num_tokens = min(self.config.frame_tokens, n - token_start)
            for layer_start in range(0, num_layers, self.config.frame_layers):
                if rate:  # the bytes sent so far may not have left faster than the cap
                    time.sleep(max(0.0, t0 + num_bytes / rate - time.monotonic()))
                layer_end = min(layer_start + self.config.frame_layers, num_layers)
                kv = cache.read_chunk(layer_start, layer_end, block_table, token_start, num_tokens)
                buf = tensor_to_buffer(kv)
                self.send(peer, KVFrame(
                    request_id=req.request_id, transfer_id=req.transfer_id,
                    layer_start=layer_start, layer_end=layer_end, chunk_index=num_frames,
                    token_start=token_start, num_tokens=num_tokens, kv=buf))
                num_frames += 1
                num_bytes += buf.nbytes
        self.stats.num_frames_sent += num_frames
        self.stats.num_bytes_sent += num_bytes
        return num_frames, num_bytes

    def step(self, timeout_s: float = 0.0) -> int:
        """Ingest messages, then prefill at most one queued request; returns requests done."""
        self.ingest(0.0 if self.queue else timeout_s)
        if not self.queue:
            return 0
        peer, req = self.queue[0]
        error = self._validate(req)
        if error:
            self.queue.popleft()
            self._fail(peer, req, error)
            return 0
        if not self.block_manager.can_allocate(self.block_manager.blocks_for(len(req.prompt_token_ids))):
            return 0  # wait for blocks of an earlier request (cannot happen single-threaded)
        self.queue.popleft()
        try:
            self._run_one(peer, req)
        except KVCacheExhausted as err:
            self._fail(peer, req, str(err))
        except Exception as err:  # a bad prompt must not kill the role
            log.exception("prefill of %s failed", req.request_id)
            self._fail(peer, req, f"prefill failed: {err}")
        return 1
