"""Verifier worker (the decode role): continuous batching with speculative verification.

One ``step()`` (DESIGN.md §4): ingest (requests, aborts, KV arrivals, draft tails), admit
waiting requests into free KV, plan each running request's drafts (min of its usable tail and
kappa), run ONE batched ragged target forward over ``[last committed token] + drafts`` of every
running request, verify greedily, and commit (cut at EOS / stop token / max_tokens), sending
VerifyCommit to the drafter and TokenStream to the gateway. The verifier alone decides every
committed token; the drafter only proposes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from decode.kv_receiver import KVReceiver
from decode.request import Request, Status
from decode.stats import VerifierStats
from engine.block_manager import BlockManager
from engine.runner import ModelRunner, SeqChunk
from kernels import greedy_verify
from protocol.errors import ProtocolError
from protocol.messages import (
    Abort,
    DraftClose,
    DraftNeedSync,
    DraftSync,
    DraftTailStream,
    GenerateRequest,
    KVFrame,
    PrefillCancel,
    PrefillCancelAck,
    PrefillDone,
    PrefillRequest,
    TokenStream,
    VerifyCommit,
)
from protocol.transport import Envelope, Mailbox, run_loop

log = logging.getLogger(__name__)

# Weight of the newest verify step in a request's accept-length EMA (SGLang-style adaptive
# speculation keeps a similar moving average per batch-size slot).
ACCEPT_EMA_WEIGHT = 0.5


@dataclass(frozen=True)
class VerifierConfig:
    """Knobs of the verifier.

    ``num_draft_tokens`` is kappa (0 = speculation off). ``tail_wait_fraction`` bounds how long
    a step may wait for a draft tail in flight, as a fraction of the measured step time.
    ``prefill_timeout_s``: a KV transfer not complete by then is cancelled and the request
    fails. ``adaptive_drafts``: cap each request's drafts at one more than its recent mean
    accept length (never changes the output, only the cost). ``draft_method`` is told to prefill so it ships the right seed state.
    """

    instance_id: str = "decode-0"
    num_draft_tokens: int = 4
    max_num_seqs: int = 64
    max_queue_len: int = 256
    max_model_len: int = 2048
    tail_wait_fraction: float = 0.25
    prefill_timeout_s: float = 120.0
    draft_method: str = "ngram"
    eos_token_ids: tuple[int, ...] = ()
    max_num_draft_tokens: int = 16
    adaptive_drafts: bool = True


class VerifierWorker:
    """Plain-class verifier; ``prefill_peers`` / ``drafter_peers`` come from the roster."""

    def __init__(self, config: VerifierConfig, mailbox: Mailbox, runner: ModelRunner,
                 block_manager: BlockManager, prefill_peers: list[str] | None = None,
                 drafter_peers: list[str] | None = None) -> None:
        if not 0 <= config.num_draft_tokens <= config.max_num_draft_tokens:
            raise ValueError(f"num_draft_tokens must be in [0, {config.max_num_draft_tokens}]")
        self.config = config
        self.mailbox = mailbox
        self.runner = runner
        self.block_manager = block_manager
        self.vocab_size = runner.config.vocab_size
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.kv = KVReceiver(runner.kv_cache)
        self.num_draft_tokens = config.num_draft_tokens  # kappa; the controller may change it
        self.prefill_peers: list[str] = list(prefill_peers or [])
        self.drafter_peers: list[str] = list(drafter_peers or [])
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self._next_transfer_id = 1
        self._step_time_ema = 0.0
        self.stats = VerifierStats(config.max_num_draft_tokens)

    # -- roster ----------------------------------------------------------------------------

    def set_roster(self, prefill_peers: list[str], drafter_peers: list[str]) -> None:
        """Replace the known peers. Requests on a vanished drafter continue without drafts
        until re-synced with another; transfers from a vanished prefill worker fail."""
        self.prefill_peers = list(prefill_peers)
        self.drafter_peers = list(drafter_peers)
        for req in self.requests.values():
            if req.drafter is not None and req.drafter not in self.drafter_peers:
                req.drafter = None
                req.tail.reset(req.committed_len)
                if req.status is Status.RUNNING:
                    self._open_draft(req)
        for peer in {t.prefill_peer for t in self.kv.transfers.values()}:
            if peer not in self.prefill_peers:
                for t in self.kv.drop_peer(peer):
                    req = self.requests.get(t.request_id)
                    if req is None:
                        continue
                    if req.status is Status.CANCELLING:  # no ack will ever come
                        self._release(req)
                    else:
                        self._finish(req, "error", f"prefill worker {peer} went away")

    def resync_drafter(self, peer: str) -> None:
        """``peer`` restarted (new incarnation): re-open its requests with DraftSync."""
        for req in self.requests.values():
            if req.drafter == peer and req.status is Status.RUNNING:
                req.tail.reset(req.committed_len)
                self._send_draft_sync(req)

    @property
    def load(self) -> dict:
        reqs = list(self.requests.values())  # may be read from a metrics thread
        return {"num_running": sum(r.status is Status.RUNNING for r in reqs),
                "num_waiting": len(self.waiting),
                "num_free_blocks": self.block_manager.num_free_blocks - self._outstanding()}

    # -- ingest ----------------------------------------------------------------------------

    def handle(self, env: Envelope) -> None:
        msg = env.msg
        try:
            if isinstance(msg, ProtocolError):
                self._on_protocol_error(msg)
            elif isinstance(msg, DraftTailStream):
                self._on_tail(env.peer, msg)
            elif isinstance(msg, KVFrame):
                self._on_transfer_event(self.kv.on_frame(env.peer, msg))
            elif isinstance(msg, PrefillDone):
                self._on_transfer_event(self.kv.on_done(env.peer, msg))
            elif isinstance(msg, GenerateRequest):
                self._on_generate(env.peer, msg)
            elif isinstance(msg, Abort):
                req = self.requests.get(msg.request_id)
                if req is not None:
                    self._finish(req, "abort", msg.reason)
            elif isinstance(msg, PrefillCancelAck):
                t = self.kv.on_cancel_ack(msg.transfer_id)
                req = self.requests.get(t.request_id) if t else None
                if req is not None and req.status is Status.CANCELLING:
                    self._release(req)
            elif isinstance(msg, DraftNeedSync):
                req = self.requests.get(msg.request_id)
                if req is not None and req.drafter == env.peer and req.status is Status.RUNNING:
                    req.tail.reset(req.committed_len)
                    self._send_draft_sync(req)
            else:
                self.stats.num_ignored_messages += 1
        except ProtocolError as err:
            err.peer = env.peer
            self._on_protocol_error(err)

    def _on_protocol_error(self, err: ProtocolError) -> None:
        self.stats.num_protocol_errors += 1
        log.warning("protocol error from %s: %s", err.peer, err)
        req = self.requests.get(err.request_id) if err.request_id else None
        if req is None:
            return
        if req.status in (Status.PREFILLING, Status.WAITING):
            self._finish(req, "error", f"KV transfer failed: {err}")
        elif req.drafter is not None and err.peer == req.drafter:
            # Quarantine: drop the request's drafter state, continue with plain decode.
            self._send(req.drafter, DraftClose(request_id=req.request_id, reason="abort"))
            req.drafter = None
            req.spec_enabled = False
            req.tail.reset(req.committed_len)

    def _on_generate(self, peer: str, msg: GenerateRequest) -> None:
        error = self._validate(msg)
        if msg.request_id in self.requests:
            error = f"duplicate request id {msg.request_id!r}"
        if error:
            self._send(peer, TokenStream(request_id=msg.request_id, token_ids=[], finished=True,
                                         finish_reason="invalid", error=error))
            return
        if len(self.waiting) >= self.config.max_queue_len:
            self.stats.num_rejected_queue_full += 1
            self._send(peer, TokenStream(request_id=msg.request_id, token_ids=[], finished=True,
                                         finish_reason="queue_full",
                                         error="verifier queue is full"))
            return
        kappa = self.num_draft_tokens if msg.num_draft_tokens is None else msg.num_draft_tokens
        req = Request(msg.request_id, peer, list(msg.prompt_token_ids), msg.sampling,
                      min(kappa, self.config.max_num_draft_tokens))
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def _validate(self, msg: GenerateRequest) -> str:
        sp, n = msg.sampling, len(msg.prompt_token_ids)
        if n == 0:
            return "prompt is empty"
        if any(t < 0 or t >= self.vocab_size for t in msg.prompt_token_ids):
            return f"prompt token ids must lie in [0, {self.vocab_size})"
        if sp.max_tokens < 1:
            return "max_tokens must be >= 1"
        if n + sp.max_tokens > self.config.max_model_len:
            return (f"prompt ({n} tokens) + max_tokens ({sp.max_tokens}) exceeds the maximum "
                    f"model length {self.config.max_model_len}")
        if sp.temperature != 0:
            return "only greedy decoding (temperature 0) is supported by this verifier"
        if msg.num_draft_tokens is not None and msg.num_draft_tokens < 0:
            return "num_draft_tokens must be >= 0"
        need = self.block_manager.blocks_for(n + sp.max_tokens)
        if need > self.block_manager.num_blocks:
            return f"request needs {need} KV blocks, the verifier has {self.block_manager.num_blocks}"
        return ""

    def _on_tail(self, peer: str, msg: DraftTailStream) -> None:
        req = self.requests.get(msg.request_id)
        if req is None or req.status is not Status.RUNNING or req.drafter != peer:
            self.stats.num_dropped_tails += 1
            return
        if msg.parents is not None:
            raise ProtocolError("tree drafts are not verified by this verifier",
                                request_id=req.request_id)
        if any(t < 0 or t >= self.vocab_size for t in msg.draft_token_ids):
            raise ProtocolError("draft token id out of vocabulary", request_id=req.request_id)
        before = req.tail.stats.num_stale_tokens
        req.tail.add(msg.start_pos, list(msg.draft_token_ids), req.output_token_ids)
        self.stats.num_stale_tail_tokens += req.tail.stats.num_stale_tokens - before
        req.tail_in_flight = False

    def _on_transfer_event(self, t) -> None:
        if t is None:
            return
        req = self.requests.get(t.request_id)
        if req is None or req.status is not Status.PREFILLING:
            return
        done = t.done
        if done.error:
            self._finish(req, "error", f"prefill failed: {done.error}")
            return
        if not 0 <= done.first_token_id < self.vocab_size:
            self._finish(req, "error", "prefill returned an invalid first token")
            return
        self.stats.kv_transfer_bytes += done.num_bytes
        req.status = Status.RUNNING
        req.first_token_time = time.monotonic()
        self.stats.observe_ttft(req.first_token_time - req.arrival_time)
        req.commit([done.first_token_id], self.eos_token_ids)
        req.tail.reset(req.committed_len)
        if req.finish_reason is None:
            self._open_draft(req)  # DraftSync carries the first token: no VerifyCommit for it
        self._after_commit(req, [done.first_token_id], notify_drafter=False)

    # -- admission and KV ------------------------------------------------------------------

    def _outstanding(self) -> int:
        """Blocks promised to admitted requests but not allocated yet."""
        return sum(max(r.num_reserved_blocks - len(r.block_ids), 0)
                   for r in list(self.requests.values()) if r.status is not Status.WAITING)

    def _admit(self) -> None:
        bm = self.block_manager
        running = sum(r.status is not Status.WAITING for r in self.requests.values())
        while self.waiting and running < self.config.max_num_seqs and self.prefill_peers:
            req = self.waiting[0]
            reserve = bm.blocks_for(req.prompt_len + req.sampling.max_tokens)
            if bm.num_free_blocks - self._outstanding() < reserve:
                break
            self.waiting.popleft()
            first = bm.blocks_for(req.prompt_len + req.num_draft_tokens + 1)
            req.block_ids = bm.allocate(min(first, reserve))
            req.num_reserved_blocks = reserve
            req.transfer_id = self._next_transfer_id
            self._next_transfer_id += 1
            req.prefill_peer = min(self.prefill_peers, key=self._prefill_load)
            req.status = Status.PREFILLING
            self.kv.start(req.request_id, req.transfer_id, req.prefill_peer, req.block_ids,
                          req.prompt_len)
            self._send(req.prefill_peer, PrefillRequest(
                request_id=req.request_id, transfer_id=req.transfer_id,
                prompt_token_ids=req.prompt_token_ids, sampling=req.sampling,
                block_ids=req.block_ids, draft_method=self.config.draft_method))
            running += 1

    def _prefill_load(self, peer: str) -> int:
        return sum(t.prefill_peer == peer for t in self.kv.transfers.values())

    def _ensure_blocks(self, req: Request, num_tokens: int) -> None:
        need = self.block_manager.blocks_for(num_tokens) - len(req.block_ids)
        if need > 0:  # covered by the reservation made at admission
            req.block_ids.extend(self.block_manager.allocate(need))

    def _release(self, req: Request) -> None:
        if req.block_ids:
            self.block_manager.free(req.block_ids)
        req.block_ids = []
        req.num_reserved_blocks = 0
        self.requests.pop(req.request_id, None)

    # -- drafter ---------------------------------------------------------------------------

    def _open_draft(self, req: Request) -> None:
        if not (req.spec_enabled and req.num_draft_tokens > 0 and self.drafter_peers):
            return
        load = {p: 0 for p in self.drafter_peers}
        for r in self.requests.values():
            if r.drafter in load:
                load[r.drafter] += 1
        req.drafter = min(self.drafter_peers, key=lambda p: load[p])
        self._send_draft_sync(req)

    def _send_draft_sync(self, req: Request) -> None:
        self._send(req.drafter, DraftSync(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            committed_token_ids=list(req.output_token_ids), sampling=req.sampling))
        req.tail_in_flight = True

    # -- finishing -------------------------------------------------------------------------

    def _finish(self, req: Request, reason: str, error: str = "") -> None:
        """End ``req`` now (abort, error, or after its last commit) and tell everybody."""
        if req.status is Status.FINISHED:
            return
        prev = req.status
        req.finish_reason = req.finish_reason or reason
        req.error = error
        if req in self.waiting:
            self.waiting.remove(req)
        if req.drafter is not None:
            self._send(req.drafter, DraftClose(request_id=req.request_id,
                                               reason="finished" if reason in ("stop", "length")
                                               else "abort"))
        self._stream(req, finished=True)
        req.status = Status.FINISHED
        if prev is Status.PREFILLING and req.transfer_id in self.kv.transfers:
            self.kv.cancel(req.transfer_id)
            req.status = Status.CANCELLING  # blocks wait for the cancel ack
            self._send(req.prefill_peer, PrefillCancel(request_id=req.request_id,
                                                       transfer_id=req.transfer_id))
            return
        self._release(req)
        self.stats.num_finished += 1

    def _stream(self, req: Request, finished: bool = False) -> None:
        delta = req.output_token_ids[req.num_streamed:]
        req.num_streamed = req.committed_len
        self._send(req.gateway, TokenStream(
            request_id=req.request_id, token_ids=delta, finished=finished,
            finish_reason=req.finish_reason if finished else None,
            num_prompt_tokens=req.prompt_len, num_draft_tokens=req.num_draft_tokens_verified,
            num_accepted_tokens=req.num_accepted_tokens, num_verify_steps=req.num_verify_steps,
            error=req.error))

    def _after_commit(self, req: Request, committed: list[int],
                      notify_drafter: bool = True) -> None:
        self.stats.num_generated_tokens += len(committed)
        if req.finish_reason is not None:
            self._finish(req, req.finish_reason)
            return
        req.tail.on_commit(req.output_token_ids)
        if req.drafter is not None and committed and notify_drafter:
            self._send(req.drafter, VerifyCommit(
                request_id=req.request_id, pre_commit_len=req.committed_len - len(committed),
                committed_token_ids=committed))
            req.tail_in_flight = True
        self._stream(req)

    def _send(self, peer: str | None, msg: object) -> None:
        if peer is None:
            return
        try:
            self.mailbox.send(peer, msg)
        except ConnectionError as err:
            log.warning("verifier cannot reach %s: %s", peer, err)

    # -- the verify step -------------------------------------------------------------------

    def _plan(self, running: list[Request]) -> list[list[int]]:
        drafts = []
        for req in running:
            d = req.tail.usable(self._num_drafts(req)) if req.spec_enabled and req.drafter else []
            drafts.append(d)
        return drafts

    def _num_drafts(self, req: Request) -> int:
        """Drafts to verify for ``req`` this step: kappa, never past max_tokens, and with
        ``adaptive_drafts`` at most one more than the request's recent accept length (an EMA),
        so a request whose drafts keep failing costs about a plain decode step."""
        k = min(req.num_draft_tokens, req.num_remaining - 1)
        if self.config.adaptive_drafts:
            k = min(k, int(req.accept_len_ema + 0.5) + 1)  # all accepted -> may grow
        return max(k, 0)

    def _wait_for_tails(self, running: list[Request]) -> None:
        """Give tails in flight a small budget (a fraction of one step) to arrive."""
        budget = self.config.tail_wait_fraction * self._step_time_ema
        if budget <= 0:
            return
        deadline = time.monotonic() + budget
        while True:
            waiting = [r for r in running if r.tail_in_flight and r.drafter is not None
                       and len(r.tail) < self._num_drafts(r)]
            left = deadline - time.monotonic()
            if not waiting or left <= 0:
                return
            env = self.mailbox.recv(left)
            if env is None:
                return
            self.handle(env)

    def _verify(self, running: list[Request], drafts: list[list[int]]) -> None:
        chunks = []
        for req, d in zip(running, drafts):
            self._ensure_blocks(req, req.kv_len + 1 + len(d))
            chunks.append(SeqChunk(token_ids=[req.output_token_ids[-1]] + d,
                                   start_pos=req.kv_len, block_table=req.block_ids))
        logits = self.runner.forward(chunks, logits="all")
        target = torch.cat([torch.argmax(lg, dim=-1) for lg in logits])
        flat = [t for d in drafts for t in d]
        cu = torch.tensor([len(d) for d in drafts], dtype=torch.long).cumsum(0)
        out, accept_len = greedy_verify(torch.tensor(flat, dtype=torch.long), cu, target)
        out, accept_len = out.tolist(), accept_len.tolist()
        for req, d, row, a in zip(running, drafts, out, accept_len):
            tokens = row[: a + 1]
            if d:
                req.num_verify_steps += 1
                req.num_draft_tokens_verified += len(d)
                req.num_accepted_tokens += a
                req.accept_len_ema += ACCEPT_EMA_WEIGHT * (a - req.accept_len_ema)
                self.stats.observe_verify(len(d), a)
            committed = req.commit(tokens, self.eos_token_ids)
            self._after_commit(req, committed)

    def step(self, timeout_s: float = 0.0) -> int:
        """One iteration; waits up to ``timeout_s`` for input only when idle.
        Returns the number of requests in the verify forward."""
        t0 = time.monotonic()
        busy = any(r.status is Status.RUNNING for r in self.requests.values())
        env = self.mailbox.recv(0.0 if busy or self.waiting else timeout_s)
        while env is not None:
            self.handle(env)
            env = self.mailbox.recv(0.0)
        self._check_timeouts()
        self._admit()
        running = [r for r in self.requests.values() if r.status is Status.RUNNING]
        if not running:
            return 0
        self._wait_for_tails(running)
        running = [r for r in running if r.status is Status.RUNNING]
        if not running:
            return 0
        self._verify(running, self._plan(running))
        dt = time.monotonic() - t0
        self._step_time_ema = dt if self._step_time_ema == 0 else 0.8 * self._step_time_ema + 0.2 * dt
        self.stats.num_steps += 1
        return len(running)

    def _check_timeouts(self) -> None:
        for t in self.kv.timed_out(self.config.prefill_timeout_s):
            req = self.requests.get(t.request_id)
            if req is not None:
                self._finish(req, "error", "KV transfer timed out")

    def run(self, stop: threading.Event, idle_timeout_s: float = 0.05,
            on_error: Callable[[BaseException], None] | None = None) -> None:
        """Step until ``stop`` is set, blocking on the mailbox while idle."""
        run_loop(self.step, stop, idle_timeout_s, 'verifier', on_error)
