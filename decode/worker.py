"""Verifier worker (the decode role): message dispatch and the continuous-batching loop.

One ``step()`` (docs/architecture.md, 'The verify step'): ingest (requests, aborts, KV arrivals,
draft tails), admit
waiting requests into free KV, wait briefly for tails in flight, plan each running request's
drafts, run ONE batched verify forward and commit. The policies live elsewhere: admission,
plans and waits in :mod:`decode.scheduler`, the forward and the rules in
:mod:`decode.verify_step` / :mod:`decode.verification`, state changes in
:mod:`decode.lifecycle`. The verifier alone decides every committed token.
"""

from __future__ import annotations

import logging
import time

from specmesh.decode.config import VerifierConfig
from specmesh.decode.core_sharing import CoreSharing
from specmesh.decode.corpus_relay import CorpusRelay
from specmesh.decode.drafter_loss import DrafterLoss
from specmesh.decode.grammar import VerifierGrammars
from specmesh.decode.kv_receiver import KVReceiver
from specmesh.decode.lifecycle import RequestLifecycle
from specmesh.decode.prefill_loss import PrefillLoss
from specmesh.decode.prefill_pause import PrefillPause
from specmesh.decode.request import Request, RequestStatus, sampling_with_eos
from specmesh.decode.scheduler import BlockAllocator, Scheduler
from specmesh.decode.stats import VerifierStats
from specmesh.decode.verify_step import VerifyStep
from specmesh.engine.grammar import GrammarCompiler
from specmesh.engine.hidden_layers import seed_state_width
from specmesh.engine.runner import ModelRunner
from specmesh.protocol.enums import FinishReason
from specmesh.protocol.errors import ProtocolError
from specmesh.protocol.messages import (
    Abort,
    DraftBranches,
    DraftClose,
    DrafterCorpus,
    DrafterCorpusResult,
    DraftNeedSync,
    DraftSync,
    DraftTailStream,
    GenerateRequest,
    KVFrame,
    PrefillCancelAck,
    PrefillDone,
    PrefillRequest,
    TokenStream,
    VerifyCommit,
)
from specmesh.protocol.step_profile import StepProfile
from specmesh.protocol.transport import Envelope, Mailbox, MailboxWorker

log = logging.getLogger(__name__)

class VerifierWorker(PrefillLoss, DrafterLoss, MailboxWorker):
    """Plain-class verifier; ``prefill_peers`` / ``drafter_peers`` come from the roster."""

    name = "verifier"

    def __init__(self, config: VerifierConfig, mailbox: Mailbox, runner: ModelRunner,
                 block_manager: BlockAllocator, prefill_peers: list[str] | None = None,
                 drafter_peers: list[str] | None = None) -> None:
        self.config = config
        self.mailbox = mailbox
        self.block_manager = block_manager
        self.vocab_size = runner.config.vocab_size
        self.kv = KVReceiver(runner.kv_cache)
        self.scheduler = Scheduler(config, block_manager)
        self.profile = StepProfile()
        #: envelopes received between a forward and its commit that wait for the next ingest
        self._deferred: list[Envelope] = []
        self.verify_step = VerifyStep(runner, self.profile, seed_state=config.seed_state,
                                      config=config)
        # a draft tree is planned only where the rules would verify it as one (never for a
        # request with structured output: its masks follow one chain, decode/grammar.py)
        judges_trees = self.verify_step.rules.judges_trees
        self.scheduler.tree_verifiable = lambda s: s.grammar is None and judges_trees(s)
        self.stats = VerifierStats(max_num_speculative_tokens=config.max_num_speculative_tokens)
        self.lifecycle = RequestLifecycle(self.scheduler, self.kv, self.stats, self.vocab_size,
                                          frozenset(config.eos_token_ids), self.send,
                                          seed_state=config.seed_state,
                                          hidden_size=seed_state_width(
                                              config.seed_state, runner.config.hidden_size),
                                          dtype=runner.model.dtype, profile=self.profile,
                                          on_prefill_time=self._observe_prefill)
        self.prefill_peers: list[str] = list(prefill_peers or [])
        self.lifecycle.drafter_peers = list(drafter_peers or [])
        # Transfers are keyed by (this verifier, its incarnation, a counter): the ids of one
        # incarnation start past its time_ns() stamp, so a restart (a later stamp, by at least
        # the restart time in ns) never reuses an id a prefill worker may still send frames for.
        self._next_transfer_id = config.incarnation + 1
        #: transfer id -> why its prefill peer can send no more frames for it (gone, restarted,
        #: unreachable); ended after the next ingest, so frames already received are handled
        self._orphans: dict[int, str] = {}
        #: drafter -> monotonic time since when it owes an answer (a DraftSync / VerifyCommit
        #: sent, nothing heard since)
        self._drafter_owes: dict[str, float] = {}
        #: drafter -> monotonic time its connection dropped (see :meth:`peer_disconnected`)
        self._drafters_down: dict[str, float] = {}
        #: prefill peers a send failed to (refused our Hello, no channel) -> the error; not
        #: given new transfers until the roster drops them or they restart
        self.unreachable_prefill: dict[str, str] = {}
        #: the forward's threads while a prefill on the same cores runs (decode/core_sharing.py;
        #: set by the role host; None: left as they are)
        self.core_sharing: CoreSharing | None = None
        #: pauses verify steps for a prefill in flight on shared cores (decode/prefill_pause.py)
        self.prefill_pause = PrefillPause(config.max_prefill_pause_s)
        #: structured output (decode/grammar.py): one object for the plan's draft cut, the
        #: verify step's masks and the commits; its compiler is set by the role host
        #: (:meth:`set_grammar_compiler`)
        self.grammars = VerifierGrammars()
        self.lifecycle.grammars = self.verify_step.grammars = self.grammars
        self.scheduler.draft_limit = self.grammars.valid_drafts
        #: relays corpus operations from gateways to the drafters (decode/corpus_relay.py)
        self.corpus_relay = CorpusRelay(self.send, lambda: list(self.lifecycle.drafter_peers))
        self.siblings = self.lifecycle.siblings  # the n choices of a prompt (decode/siblings.py)
        self.lifecycle.fork_siblings = self._fork_siblings

    def set_grammar_compiler(self, compiler: GrammarCompiler | None) -> None:
        """Serve structured output with ``compiler`` (engine/grammar.py, the target's
        tokenizer); None: constrained requests are refused."""
        self.grammars.compiler = compiler

    @property
    def requests(self) -> dict[str, Request]:
        return self.lifecycle.requests

    @property
    def num_dropped_messages(self) -> int:
        """Messages dropped unapplied (for unknown or finished requests or transfers, or of a
        kind the verifier does not take): ignored + dropped tails + late KV frames."""
        return (self.stats.num_ignored_messages + self.stats.num_dropped_tails
                + self.kv.stats.num_late_frames)

    # -- roster (called in the loop thread) ------------------------------------------------

    def set_roster(self, prefill_peers: list[str], drafter_peers: list[str]) -> None:
        """Replace the known peers. Requests on a vanished drafter are re-opened on another
        (or run without drafts); transfers from a vanished prefill worker end as
        :meth:`prefill_gone` says."""
        self.prefill_peers = list(prefill_peers)
        self.lifecycle.set_drafters(drafter_peers)
        for peer in set(self._drafters_down) - set(drafter_peers):
            del self._drafters_down[peer]  # (its requests moved with the roster)
        for peer in {t.prefill_peer for t in self.kv.transfers.values()} - set(prefill_peers):
            self.prefill_gone(peer, f"prefill worker {peer} left the cluster")
        for peer in set(self.unreachable_prefill) - set(prefill_peers):
            del self.unreachable_prefill[peer]

    def on_send_failed(self, peer: str, err: ConnectionError) -> None:
        """A send to ``peer`` failed (it refused our Hello, or there is no channel to it): a
        prefill worker gets no new transfer until the roster changes and its transfers end
        as :meth:`prefill_gone` says."""
        if peer in self.prefill_peers or any(t.prefill_peer == peer
                                             for t in self.kv.transfers.values()):
            self.unreachable_prefill[peer] = str(err)
            self.prefill_gone(peer, f"cannot reach prefill worker {peer}: {err}")
        elif peer in self.lifecycle.drafter_peers or any(r.drafter == peer
                                                         for r in self.requests.values()):
            # drafter-bound messages are dropped, never the loop: plain decode, re-sync later
            self.stats.num_drafters_lost += 1
            self._drafter_owes.pop(peer, None)
            self.lifecycle.lose_drafter(peer)

    def peer_disconnected(self, peer: str) -> None:
        """The transport's connection to ``peer`` dropped (closed, reset, heartbeat timeout;
        called in the loop thread). A prefill worker's frames in flight are lost with the
        connection: its transfers end as :meth:`prefill_gone` says (retried on another worker,
        or a clear error) at once, and it gets no new transfer until it acknowledges our Hello
        again (:meth:`prefill_back`). A drafter that is not back (:meth:`drafter_back`, or a
        restart: :meth:`resync_drafter`) within ``drafter_lost_grace_s`` is lost
        (:meth:`lose_drafter` of the lifecycle): its requests move to another drafter or
        to plain decode without waiting for the health check."""
        if peer in self.prefill_peers or any(t.prefill_peer == peer
                                             for t in self.kv.transfers.values()):
            reason = f"lost the connection to prefill worker {peer}"
            self.unreachable_prefill[peer] = reason
            self.prefill_gone(peer, reason)
        elif peer in self.lifecycle.drafter_peers:
            self._drafters_down.setdefault(peer, time.monotonic())

    def send(self, peer: str | None, msg: object) -> bool:
        """Send (never blocks: a peer that is not draining fails the send, see
        :meth:`on_send_failed`); a DraftSync or VerifyCommit that left makes its drafter owe
        an answer (see :meth:`silent_drafters`)."""
        ok = super().send(peer, msg)
        if ok and isinstance(msg, (DraftSync, VerifyCommit)):
            self._drafter_owes.setdefault(peer, time.monotonic())
        return ok

    @property
    def num_speculative_tokens(self) -> int:
        """Kappa for requests that do not set their own; the controller may change it."""
        return self.scheduler.num_speculative_tokens

    @num_speculative_tokens.setter
    def num_speculative_tokens(self, value: int) -> None:
        if not 0 <= value <= self.config.max_num_speculative_tokens:
            raise ValueError(f"num_speculative_tokens must be in "
                             f"[0, {self.config.max_num_speculative_tokens}], got {value}")
        self.scheduler.num_speculative_tokens = value

    @property
    def load(self) -> dict:
        reqs = list(self.requests.values())  # may be read from a metrics thread
        return {"num_running": sum(r.status is RequestStatus.RUNNING for r in reqs),
                "num_waiting": len(self.scheduler.waiting),
                "num_free_blocks": self.scheduler.num_free_blocks(reqs)}

    # -- ingest ----------------------------------------------------------------------------

    def handle(self, env: Envelope) -> None:
        """Apply one message; never raises for anything a peer sent.

        - GenerateRequest (gateway): validated, then queued (WAITING); refused with a finished
          TokenStream (``invalid`` / ``queue_full``) when it cannot run or the queue is full.
        - Abort (gateway): the request ends with ``abort`` (its transfer is cancelled); with
          ``num_output_tokens`` (a stop string ended the output) its spec stats are cut there.
        - KVFrame / PrefillDone (prefill): written into the request's blocks; PrefillDone's
          first token is committed and streamed when it arrives (before the frames, as the
          prefill worker sends it), and a complete transfer makes the request RUNNING.
        - PrefillCancelAck (prefill): a CANCELLING request's blocks are freed.
        - DraftTailStream (drafter): merged into the request's tail buffer.
        - DraftBranches (drafter): kept with the request's tail buffer.
        - DraftNeedSync (drafter): the request is re-opened with DraftSync.
        - DraftClose (drafter: it dropped the request, e.g. full): the request runs as plain
          decode; no tail is waited for.
        - DrafterCorpus (gateway): relayed to every drafter (decode/corpus_relay.py);
          DrafterCorpusResult (drafter): forwarded to the gateway that sent the operation.
          Either from a peer of another role is ignored.
        - ProtocolError (any peer): counted; the named request fails (during transfer) or is
          quarantined (bad drafter message).
        A message for an unknown or finished request (or transfer) is dropped and counted:
        ``num_dropped_tails`` (tails), ``kv.stats.num_late_frames`` (KV frames), else
        ``num_ignored_messages``; so is anything else (:attr:`num_dropped_messages`).
        """
        msg, peer = env.msg, env.peer
        if isinstance(msg, (DraftTailStream, DraftBranches, DraftNeedSync, DraftClose,
                            DrafterCorpusResult)):
            self._heard_from_drafter(peer)
        try:
            if isinstance(msg, ProtocolError):
                self._on_protocol_error(msg)
            elif isinstance(msg, DraftTailStream):
                self.lifecycle.add_tail(peer, msg)
            elif isinstance(msg, DraftBranches):
                self.lifecycle.add_branches(peer, msg)
            elif isinstance(msg, KVFrame):
                self.lifecycle.on_transfer(self.kv.on_frame(peer, msg))
            elif isinstance(msg, PrefillDone):
                t = self.kv.transfers.get(msg.transfer_id)
                if t is None or t.cancelled:  # an unknown, finished or cancelled transfer
                    self.stats.num_ignored_messages += 1
                elif (ended := self.kv.on_done(peer, msg)) is not None:
                    self.lifecycle.on_transfer(ended)
                else:  # the KV is still on its way: the first token goes out now
                    self.lifecycle.on_prefill_done(t)
            elif isinstance(msg, GenerateRequest):
                self._on_generate(peer, msg)
            elif isinstance(msg, Abort):
                if (req := self.requests.get(msg.request_id)) is not None:
                    self.lifecycle.finish(req, FinishReason.ABORT, msg.reason,
                                          num_output_tokens=msg.num_output_tokens)
                else:  # unknown or finished
                    self.stats.num_ignored_messages += 1
            elif isinstance(msg, PrefillCancelAck):
                t = self.kv.on_cancel_ack(peer, msg.transfer_id)
                req = self.lifecycle.get(t.request_id if t else None)
                if req is not None and req.status is RequestStatus.CANCELLING:
                    self.lifecycle.release(req)
                elif t is None:  # no cancelled transfer of this peer has this id
                    self.stats.num_ignored_messages += 1
            elif isinstance(msg, DraftNeedSync):
                req = self.requests.get(msg.request_id)
                if req is not None and req.drafter == peer and req.status is RequestStatus.RUNNING:
                    self.lifecycle.sync_draft(req)
                else:  # unknown, finished or not this drafter's
                    self.stats.num_ignored_messages += 1
            elif isinstance(msg, DraftClose):
                req = self.requests.get(msg.request_id)
                if req is not None and req.drafter == peer:
                    log.info("drafter %s closed %s (%s): plain decode", peer, msg.request_id,
                             msg.reason)
                    self.stats.num_drafter_closes += 1
                    self.lifecycle.drop_draft(req)
                else:
                    self.stats.num_ignored_messages += 1
            elif isinstance(msg, DrafterCorpus):
                if peer in self.lifecycle.drafter_peers or peer in self.prefill_peers:
                    self.stats.num_ignored_messages += 1  # only a gateway sends these
                else:
                    self.corpus_relay.on_operation(peer, msg)
            elif isinstance(msg, DrafterCorpusResult):
                if peer not in self.lifecycle.drafter_peers \
                        or not self.corpus_relay.on_result(peer, msg):
                    self.stats.num_ignored_messages += 1
            else:
                self.stats.num_ignored_messages += 1
        except ProtocolError as err:
            err.peer = peer
            self._on_protocol_error(err)

    def _on_protocol_error(self, err: ProtocolError) -> None:
        self.stats.num_protocol_errors += 1
        log.warning("protocol error from %s: %s", err.peer, err)
        req = self.lifecycle.get(err.request_id)
        if req is None:
            return
        if req.status in (RequestStatus.PREFILLING, RequestStatus.WAITING):
            self.lifecycle.finish(req, FinishReason.ERROR, f"KV transfer failed: {err}")
        elif req.drafter is not None and err.peer == req.drafter:
            self.lifecycle.quarantine(req)

    def _on_generate(self, peer: str, msg: GenerateRequest) -> None:
        """Queue a new request, or refuse it with a finished TokenStream. An id that is live
        here is refused (``invalid``, "duplicate request id") and the live request is not
        touched; when the duplicate comes from the live request's own gateway no answer is
        sent (it would end the live request's stream there): it is counted as a protocol
        error."""
        live = self.requests.get(msg.request_id)
        if live is not None and live.gateway == peer:
            self._on_protocol_error(ProtocolError(
                f"GenerateRequest for request {msg.request_id!r}, which is live", peer=peer))
            return
        error = self.scheduler.validate(msg.prompt_token_ids, msg.sampling,
                                        msg.num_speculative_tokens, self.vocab_size,
                                        msg.prediction_token_ids)
        if not error:
            error = self.grammars.refuse_reason(msg.sampling)
        if not error and live is not None:
            error = (f"duplicate request id {msg.request_id!r}: a request with this id is "
                     "live on this verifier")
        reason = FinishReason.INVALID if error else None
        if not error and self.scheduler.queue_full():
            self.stats.num_rejected_queue_full += 1
            reason, error = FinishReason.QUEUE_FULL, "verifier queue is full"
        if reason is not None:
            self.send(peer, TokenStream(request_id=msg.request_id, token_ids=[], finished=True,
                                        finish_reason=reason.value, error=error))
            return
        kappa = self.scheduler.speculative_tokens_for(msg.num_speculative_tokens)
        sampling = sampling_with_eos(msg.sampling, self.lifecycle.eos_token_ids)
        req = Request(msg.request_id, peer, list(msg.prompt_token_ids), sampling, kappa,
                      prediction_token_ids=list(msg.prediction_token_ids or []) or None)
        self.requests[req.request_id] = req
        if msg.group and req.leader is None:
            self.siblings.join(req, msg.group, msg.group_size)
            if req.leader is not None and req.leader.prompt_token_ids != req.prompt_token_ids:
                self.siblings.unlink(req)  # a group is one prompt: this one runs on its own
        self.grammars.open(req)  # its grammar compiles while it waits and prefills
        self.scheduler.enqueue(req)

    # -- the loop --------------------------------------------------------------------------

    def _admit(self) -> None:
        for req in self.scheduler.admit(self.requests.values(), self._reachable_prefill(),
                                        self._prefill_load, hold=self.siblings.holds):
            self._start_transfer(req)

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
            self.lifecycle.start(sib, tokens[i], 0, done.seed_state)
        self.siblings.unlink(leader)

    def _start_transfer(self, req: Request) -> None:
        """A new transfer (a fresh id) of ``req``'s prompt KV from ``req.prefill_peer``."""
        req.transfer_id = self._next_transfer_id
        self._next_transfer_id += 1
        if req.admitted_time is None:  # (a re-issued transfer was admitted before)
            req.admitted_time = time.monotonic()
            self.profile.observe("ttft_admission_wait", req.admitted_time - req.arrival_time)
            self.siblings.admitted(req)  # its transfers sample its waiting siblings' first tokens
        self.kv.start(req.request_id, req.transfer_id, req.prefill_peer, req.block_table,
                      req.prompt_len)
        req.prefill_alone = self._prefill_alone(req)
        req.prefill_paused = self._idle_without(req)
        if self.core_sharing is not None and self.core_sharing.shared:
            self.profile.count("num_prefills_paused_for" if req.prefill_paused
                               else "num_prefills_side_by_side")
        self.send(req.prefill_peer, PrefillRequest(
            request_id=req.request_id, transfer_id=req.transfer_id,
            prompt_token_ids=req.prompt_token_ids, sampling=req.sampling,
            block_table=req.block_table, draft_method=self.config.draft_method,
            verifier_idle=req.prefill_paused,
            sibling_sampling=[f.sampling for f in req.fork_targets] or None))

    def _idle_without(self, req: Request) -> bool:
        """Whether this verifier shares its cores with prefill (decode/core_sharing.py) and
        computes nothing while ``req``'s prompt is prefilled: nothing runs and no other
        prefill is in flight, or it will pause its verify steps for this prompt
        (``max_prefill_pause_s``, decode/prefill_pause.py, while its figures say pausing
        pays). Its prefill may then take every core (docs/benchmarks.md, 'Time to first
        token')."""
        if self.core_sharing is None or not self.core_sharing.shared:
            return False
        running = any(r.status is RequestStatus.RUNNING for r in self.requests.values())
        if not running and self._prefill_alone(req):
            return True
        return self.prefill_pause.choose()

    def _prefill_alone(self, req: Request) -> bool:
        """No other transfer of this verifier is in flight on ``req``'s prefill worker (so its
        time to first token is its prefill's, without waiting behind another prompt)."""
        return not any(t.request_id != req.request_id and t.prefill_peer == req.prefill_peer
                       for t in self.kv.transfers.values())

    def _num_prefilling(self) -> int:
        """Prompts in flight that this verifier pauses for (their PrefillRequest said so)."""
        return sum(r.status is RequestStatus.PREFILLING and r.prefill_paused
                   for r in self.requests.values())

    def _observe_prefill(self, req: Request, seconds: float) -> None:
        """``req``'s first token came ``seconds`` after its PrefillRequest: a figure of the way
        its prompt ran (paused for or side by side) when prefill shares the cores, if it did
        not wait behind another prompt (queueing is not the way's doing)."""
        if self.core_sharing is not None and self.core_sharing.shared and req.prefill_alone:
            self.prefill_pause.observe(req.prefill_paused, req.prompt_len, seconds)

    def _pause_for_prefill(self, timeout_s: float) -> bool:
        """On cores shared with prefill, wait (up to ``timeout_s`` and the pause window) for the
        prefills in flight instead of running a verify step (decode/prefill_pause.py); KV
        frames, PrefillDone and new requests are handled meanwhile. Returns whether it
        paused (the step then ends without a forward)."""
        if self.core_sharing is None or not self.core_sharing.shared:
            return False
        if not self.prefill_pause.should_pause(self._num_prefilling()):
            return False
        with self.profile.phase("prefill_pause"):
            self.ingest(min(timeout_s, self.prefill_pause.remaining_s()))
        return True

    def ingest(self, timeout_s: float = 0.0) -> int:
        """Handle the envelopes :meth:`_ingest_drafts_before_commit` deferred, in their order,
        then every queued one (waiting up to ``timeout_s`` for the first when none was)."""
        n = 0
        if self._deferred:
            deferred, self._deferred = self._deferred, []
            t0 = time.perf_counter()
            for env in deferred:
                self.handle(env)
            n = len(deferred)
            self.profile.observe("ingest", time.perf_counter() - t0)
            timeout_s = 0.0
        return n + super().ingest(timeout_s)

    def _ingest_drafts_before_commit(self) -> None:
        """Tails and branches that arrived during the forward, applied before its commit: a
        branch the drafter prepared for this very commit must be in place when it lands. The
        first other envelope, and everything after it, waits for the next ingest (handled in
        the order received; nothing else changes a request between forward and commit)."""
        while (env := self.mailbox.recv(0.0)) is not None:
            if not self._deferred and isinstance(env.msg, (DraftTailStream, DraftBranches)):
                try:
                    self.handle(env)
                except Exception:  # noqa: BLE001 - a draft hint must never cost the commit
                    log.exception("verifier: %s from %s failed before a commit",
                                  type(env.msg).__name__, env.peer)
            else:
                self._deferred.append(env)

    def _wait_for_tails(self, running: list[Request]) -> None:
        """Give tails in flight the scheduler's budget (at most a fraction of one step, and
        what the next draft is worth: re-read as drafts arrive) to arrive."""
        start = time.monotonic()
        silent = self.silent_drafters()
        waiting = [r for r in running if r.drafter not in silent]
        if self.scheduler.awaiting_tail(waiting) and self.scheduler.tail_wait_budget_s(running, waiting) > 0:
            self.stats.num_tail_waits += 1
        while self.scheduler.awaiting_tail(waiting):
            left = start + self.scheduler.tail_wait_budget_s(running, waiting) - time.monotonic()
            env = self.mailbox.recv(left) if left > 0 else None
            if env is None:
                return
            self.handle(env)

    def _check_timeouts(self) -> None:
        """A transfer not complete within ``prefill_timeout_s`` fails its request (and is
        cancelled); a cancel not acknowledged within ``prefill_timeout_s`` ends as if its peer
        were gone (frames that come later carry an id no transfer has: they are dropped)."""
        timeout = self.config.prefill_timeout_s
        for t in self.kv.timed_out(timeout):
            if (req := self.requests.get(t.request_id)) is not None:
                self.lifecycle.finish(req, FinishReason.ERROR, "KV transfer timed out")
        for t in self.kv.cancel_unacked(timeout):
            self._orphans.setdefault(t.transfer_id, f"no cancel acknowledgement from "
                                     f"{t.prefill_peer} within {timeout:g} s")

    def step(self, timeout_s: float = 0.0) -> int:
        """One iteration; waits up to ``timeout_s`` for input only when idle.
        Returns the number of requests in the verify forward. Phases go to ``self.profile``:
        ingest, admit, prefill_pause (a step that waited for a prefill on shared cores instead
        of running a forward), tail_wait, plan, forward, verify, commit (commit includes its
        sends); and per request the parts of its time to first token: ttft_admission_wait
        (arrival to PrefillRequest), ttft_prefill (PrefillRequest to the first token), ttft
        (arrival to the first token streamed), kv_transfer (PrefillRequest to the last KV
        frame) and kv_ingest (time writing its frames)."""
        prof = self.profile
        busy = bool(self.lifecycle.running() or self.scheduler.waiting or self._orphans)
        self.ingest(0.0 if busy else timeout_s)
        t0 = time.monotonic()
        self._check_timeouts()
        self._check_drafters_down()
        self._end_orphans()
        with prof.phase("admit"):
            self._admit()
        running = self.lifecycle.running()
        if running and self._pause_for_prefill(timeout_s):
            return 0
        if running:
            self.scheduler.begin_step(running)  # the schedule policy's kappa of this step
            with prof.phase("tail_wait"):
                self._wait_for_tails(running)
            running = self.lifecycle.running()
        if not running:
            return 0
        with prof.phase("plan"):
            plan = self.scheduler.plan(running)
            # before the commit: a request that finishes in this step was still eligible
            eligible = sum(self.scheduler.num_drafts(p.request) > 0 for p in plan)
            with_tail = self.scheduler.last_plan_with_tail
        hidden = any(self.lifecycle.wants_hidden(p.request) for p in plan)
        if self.core_sharing is not None:
            self.core_sharing.before_forward(sum(r.status is RequestStatus.PREFILLING
                                                 for r in self.lifecycle.requests.values()))
        outputs = self.verify_step.run(plan, return_hidden=hidden)
        self.scheduler.observe_forward(sum(1 + len(p.draft_token_ids) for p in plan),
                                       self.verify_step.last_forward_s)
        with prof.phase("commit"):
            self._ingest_drafts_before_commit()
            for p, out in zip(plan, outputs):
                self.lifecycle.apply(p.request, out, p.from_prediction)
        self.scheduler.end_step()  # the schedule policy sees the step's accepted drafts
        self._count_step(plan, eligible, with_tail)
        self.scheduler.observe_step_time(time.monotonic() - t0)
        self.stats.num_steps += 1
        return len(plan)

    def _count_step(self, plan: list, eligible: int, with_tail: int) -> None:
        """Counters of the draft supply: requests that could have used drafts this step
        (``eligible``, counted when the step was planned), those whose tail had usable drafts
        when it was planned (``with_tail``: the supply, the drafter's side of the decoupling)
        and those that verified drafts (after the goodput caps chose among the supply)."""
        prof = self.profile
        prof.count("num_steps")
        prof.count("num_request_steps_with_tail", with_tail)
        if with_tail:
            prof.count("num_steps_with_tail")
        with_drafts = sum(bool(p.draft_token_ids) for p in plan)
        prof.count("num_request_steps", len(plan))
        prof.count("num_request_steps_spec_eligible", eligible)
        prof.count("num_request_steps_with_drafts", with_drafts)
        if with_drafts:
            prof.count("num_steps_with_drafts")
