"""Verifier worker (the decode role): the continuous-batching loop.

One ``step()`` (docs/architecture.md, 'The verify step'): ingest (requests, aborts, KV arrivals,
draft tails), admit waiting requests into free KV, wait briefly for tails in flight, plan each
running request's drafts, run ONE batched verify forward and commit. The policies live
elsewhere: the message dispatch in :mod:`decode.dispatch`, admission, plans and waits in
:mod:`decode.scheduler` and :mod:`decode.draft_waits`, prefill starts in
:mod:`decode.prefill_start` and :mod:`decode.sibling_fork`, the forward and the rules in
:mod:`decode.verify_step` / :mod:`decode.verification`, state changes in
:mod:`decode.lifecycle`. The verifier alone decides every committed token.
"""

from __future__ import annotations

import time

from specmesh.decode.admission import BlockAllocator
from specmesh.decode.config import VerifierConfig
from specmesh.decode.core_sharing import CoreSharing
from specmesh.decode.corpus_relay import CorpusRelay
from specmesh.decode.dispatch import VerifierDispatch
from specmesh.decode.draft_waits import DraftWaits
from specmesh.decode.drafter_loss import DrafterLoss
from specmesh.decode.grammar import VerifierGrammars
from specmesh.decode.kv_receiver import KVReceiver
from specmesh.decode.lifecycle import RequestLifecycle
from specmesh.decode.lora_relay import VerifierLora
from specmesh.decode.peer_roster import PeerRoster
from specmesh.decode.prefill_loss import PrefillLoss
from specmesh.decode.prefill_pause import PrefillPause
from specmesh.decode.prefill_start import PrefillStart
from specmesh.decode.request import Request, RequestStatus
from specmesh.decode.scheduler import Scheduler
from specmesh.decode.sibling_fork import SiblingFork
from specmesh.decode.stats import VerifierStats
from specmesh.decode.verify_step import VerifyStep
from specmesh.engine.grammar import GrammarCompiler
from specmesh.engine.hidden_layers import seed_state_width
from specmesh.engine.lora_runtime import RuntimeAdapters
from specmesh.engine.runner import ModelRunner
from specmesh.protocol.enums import FinishReason
from specmesh.protocol.messages import DraftSync, VerifyCommit
from specmesh.protocol.step_profile import StepProfile
from specmesh.protocol.transport import Envelope, Mailbox, MailboxWorker


class VerifierWorker(VerifierDispatch, PeerRoster, PrefillStart, SiblingFork, DraftWaits,
                     PrefillLoss, DrafterLoss, MailboxWorker):
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
        #: LoRA adapters loaded / unloaded at run time, relayed to the prefill workers
        #: (decode/lora_relay.py); an unloaded one is freed once no request here uses it
        self.lora = VerifierLora(RuntimeAdapters(runner.model, lambda name: sum(
            r.lora_name == name for r in self.requests.values())), self.send,
            lambda: list(self.prefill_peers), config.instance_id)
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

    # -- the loop --------------------------------------------------------------------------

    def _admit(self) -> None:
        for req in self.scheduler.admit(self.requests.values(), self._reachable_prefill(),
                                        self._prefill_load, hold=self.siblings.holds):
            self._start_transfer(req)

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
        t_in = time.monotonic()
        self.ingest(0.0 if busy else timeout_s)
        self.lora.reap()
        t0 = time.monotonic()
        waited = 0.0
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
            w0 = time.monotonic()
            with prof.phase("tail_wait"):
                self._wait_for_tails(running)
            waited = time.monotonic() - w0
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
                                       self.verify_step.last_forward_s, len(plan))
        with prof.phase("commit"):
            self._ingest_drafts_before_commit()
            for p, out in zip(plan, outputs):
                self.lifecycle.apply(p.request, out, p.from_prediction)
        self.scheduler.end_step()  # the schedule policy sees the step's accepted drafts
        self._count_step(plan, eligible, with_tail)
        end = time.monotonic()
        self.scheduler.observe_step_time(end - t0)
        if busy:  # (an idle ingest may have blocked for input)
            self.scheduler.observe_step_overhead(
                len(plan), end - t_in - waited - self.verify_step.last_forward_s)
            self.scheduler.observe_step_tokens(
                len(plan), sum(len(out.token_ids) for out in outputs), end - t_in)
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
        # beside the step count, so a snapshot of the two stays consistent (the bench's kappa
        # timeline: drafts verified per request step)
        prof.count("num_request_step_drafts", sum(len(p.draft_token_ids) for p in plan))
        prof.count("num_request_steps_spec_eligible", eligible)
        prof.count("num_request_steps_with_drafts", with_drafts)
        if with_drafts:
            prof.count("num_steps_with_drafts")
