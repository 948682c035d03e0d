"""The life of a request on the verifier: every state change and the messages it sends.

:class:`RequestLifecycle` owns the live requests. It starts a request when its KV transfer
completes (the prefill's first token is output position 0), opens it on a drafter, applies a
verify step's output (commit, cut at EOS / stop token / max_tokens; VerifyCommit to the
drafter; TokenStream to the gateway), and ends it (DraftClose, the last TokenStream, PrefillCancel
when the KV is still in flight, then the blocks go back). Messages leave through the ``send``
callable it is given, so the worker stays the only transport edge.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from specmesh.decode.draft_probs import checked_draft_probs
from specmesh.decode.grammar import VerifierGrammars
from specmesh.decode.kv_receiver import KVReceiver, Transfer
from specmesh.decode.request import Request, RequestStatus
from specmesh.decode.scheduler import Scheduler
from specmesh.decode.seed_state import SeedWindow, commit_buffer, sync_buffer, window_from_prefill
from specmesh.decode.siblings import SiblingGroups
from specmesh.decode.stats import VerifierStats
from specmesh.decode.verify_step import VerifyOutput
from specmesh.protocol.enums import DRAFT_CLOSE_ABORT, DRAFT_CLOSE_FINISHED, FinishReason
from specmesh.protocol.errors import ProtocolError
from specmesh.protocol.step_profile import StepProfile
from specmesh.protocol.messages import (
    Buffer,
    DraftBranches,
    DraftClose,
    DraftSync,
    DraftTailStream,
    PrefillCancel,
    PrefillDone,
    TokenStream,
    VerifyCommit,
)

Send = Callable[[str | None, object], object]


class RequestLifecycle:
    """Live requests by id, and the transitions of docs/architecture.md, 'Life of a request'.

    ``seed_state`` (VerifierConfig.seed_state): "hidden" keeps each request's latest target
    hidden states (decode/seed_state.py; the prefill's ``[1, hidden_size]`` row of ``dtype``,
    then the verify steps') and ships them with DraftSync and VerifyCommit; "" ships none.
    ``profile``: where the parts of each request's time to first token go (``ttft``,
    ``ttft_prefill``, ``kv_transfer``, ``kv_ingest``; see :meth:`first_token`);
    ``on_prefill_time(request, seconds)`` is told each first token's time from its
    PrefillRequest.
    """

    def __init__(self, scheduler: Scheduler, kv: KVReceiver, stats: VerifierStats,
                 vocab_size: int, eos_token_ids: frozenset[int], send: Send,
                 seed_state: str = "", hidden_size: int = 0, dtype: object = None,
                 profile: StepProfile | None = None,
                 on_prefill_time: Callable[[Request, float], None] | None = None) -> None:
        self.profile = profile
        self.on_prefill_time = on_prefill_time
        self.seed_state = seed_state
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.scheduler = scheduler
        self.kv = kv
        self.stats = stats
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.send = send
        self.requests: dict[str, Request] = {}
        self.drafter_peers: list[str] = []
        self.lost_drafters: set[str] = set()  # sends to them failed: no new requests there
        #: the ``n`` choices of a prompt (decode/siblings.py): groups forming, and the fork of a
        #: leader's waiting siblings once its KV is complete (set by the verifier worker)
        self.siblings = SiblingGroups()
        self.fork_siblings: Callable[[Request, PrefillDone], None] | None = None
        #: structured output: commits advance each constrained request's matcher
        self.grammars = VerifierGrammars()

    def get(self, request_id: str | None) -> Request | None:
        return self.requests.get(request_id) if request_id is not None else None

    def running(self) -> list[Request]:
        return [r for r in self.requests.values() if r.status is RequestStatus.RUNNING]

    # -- drafter ---------------------------------------------------------------------------

    def open_draft(self, req: Request) -> None:
        """Assign ``req`` a drafter (least loaded) and open it there with DraftSync; without
        one (speculation off, quarantined, none known) the request runs as plain decode."""
        usable = [p for p in self.drafter_peers if p not in self.lost_drafters]
        req.drafter = self.scheduler.pick_drafter(req, self.requests.values(), usable)
        if req.drafter is not None:
            self.sync_draft(req)

    def sync_draft(self, req: Request) -> None:
        """(Re-)open ``req`` on its drafter: the committed prefix is the truth it aligns to."""
        req.tail.reset(req.committed_len)
        seed = sync_buffer(req.seed_window, req.prompt_len + req.committed_len)
        if self.send(req.drafter, DraftSync(
                request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                committed_token_ids=list(req.output_token_ids), sampling=req.sampling,
                seed_state=seed, prediction_token_ids=req.prediction_token_ids)):
            req.num_draft_syncs += 1
            req.tail_in_flight = True  # (a failed send put the request on plain decode)

    def set_drafters(self, drafter_peers: list[str]) -> None:
        """Replace the known drafters; a running request whose drafter vanished is re-opened
        on another (or runs without drafts), and one that runs without a drafter (none was
        left, or its drafter closed it) is opened on one that joined."""
        joined = set(drafter_peers) - set(self.drafter_peers)
        self.drafter_peers = list(drafter_peers)
        self.lost_drafters &= set(drafter_peers)
        for req in list(self.requests.values()):
            if req.lost_drafter is not None and req.lost_drafter not in drafter_peers:
                req.lost_drafter = None
                if req.status is RequestStatus.RUNNING and req.drafter is None:
                    self.open_draft(req)
            if req.drafter is not None and req.drafter not in drafter_peers:
                req.drafter = None
                req.tail.reset(req.committed_len)
                if req.status is RequestStatus.RUNNING:
                    self.open_draft(req)
            elif joined and req.drafter is None and req.lost_drafter is None \
                    and req.status is RequestStatus.RUNNING:
                self.open_draft(req)  # (pick_drafter keeps quarantined ones plain)

    def add_tail(self, peer: str, msg: DraftTailStream) -> None:
        """Merge a DraftTailStream into its request's tail buffer
        (docs/architecture.md, 'Draft tails and staleness'); a tail for
        an unknown, not running or reassigned request is counted and dropped.

        Raises:
            ProtocolError: a segment no drafter could have sent: a tree with draft_probs
                (trees are kept as in decode/tail_buffer.py), a draft token
                outside the vocabulary, ``draft_probs`` that are not distributions over the
                vocabulary giving each draft a positive probability (checked_draft_probs), a
                ``base_committed_len`` past what the verifier has committed, or positions out
                of range (decoding refuses negative ones; the caller counts the error and
                quarantines the request's drafter), or prediction drafts for a request without
                a prediction.
        """
        req = self.requests.get(msg.request_id)
        if req is None or req.status is not RequestStatus.RUNNING or req.drafter != peer:
            self.stats.num_dropped_tails += 1
            return
        rid = req.request_id
        tree = msg.parents is not None and any(p != j - 1 for j, p in enumerate(msg.parents))
        if tree and msg.draft_probs is not None:
            raise ProtocolError("tree drafts with draft_probs are not verified (one-hot trees "
                                "only)", request_id=rid)
        if any(t < 0 or t >= self.vocab_size for t in msg.draft_token_ids):
            raise ProtocolError("draft token id out of vocabulary", request_id=rid)
        if msg.base_committed_len > req.committed_len:
            raise ProtocolError(f"tail drafted on {msg.base_committed_len} committed tokens, "
                                f"the verifier committed {req.committed_len}", request_id=rid)
        if msg.from_prediction and not req.prediction_token_ids:
            raise ProtocolError("prediction drafts for a request without a prediction",
                                request_id=rid)
        before = req.tail.stats.num_stale_tokens
        try:
            probs = None if msg.draft_probs is None else checked_draft_probs(
                msg.draft_probs, msg.draft_token_ids, self.vocab_size)
            if tree:
                req.tail.add_tree(msg.start_pos, list(msg.draft_token_ids), list(msg.parents),
                                  req.output_token_ids, base_committed_len=msg.base_committed_len)
            else:
                req.tail.add(msg.start_pos, list(msg.draft_token_ids), req.output_token_ids,
                             base_committed_len=msg.base_committed_len, draft_probs=probs,
                             from_prediction=msg.from_prediction)
        except ValueError as err:  # the buffer's (and rows') own checks: still the peer's fault
            raise ProtocolError(f"bad tail: {err}", request_id=rid) from None
        self.stats.num_stale_tail_tokens += req.tail.stats.num_stale_tokens - before
        if msg.base_committed_len >= req.committed_len:
            # the drafter's answer to the latest commit (or sync); a segment drafted on an
            # older prefix (run-ahead sent before that commit reached it) is not: with it the
            # wait would end just before the useful tail arrives
            req.tail_in_flight = False

    def add_branches(self, peer: str, msg: DraftBranches) -> None:
        """Keep a DraftBranches message with its request's tail (decode/tail_buffer.py); for
        an unknown, not running or reassigned request it is counted and dropped. Branches are
        not the drafter's answer to a commit: a wait for its tail goes on.

        Raises:
            ProtocolError: a candidate or continuation token outside the vocabulary, or a
                ``base_committed_len`` past what the verifier has committed.
        """
        req = self.requests.get(msg.request_id)
        if req is None or req.status is not RequestStatus.RUNNING or req.drafter != peer:
            self.stats.num_dropped_tails += 1
            return
        rid = req.request_id
        if any(t < 0 or t >= self.vocab_size
               for t in [*msg.token_ids, *(x for c in msg.continuations for x in c)]):
            raise ProtocolError("branch token id out of vocabulary", request_id=rid)
        if msg.base_committed_len > req.committed_len:
            raise ProtocolError(f"branches made on {msg.base_committed_len} committed tokens, "
                                f"the verifier committed {req.committed_len}", request_id=rid)
        try:
            self.stats.num_branch_candidates += req.tail.add_branches(
                msg.position, list(msg.token_ids), [list(c) for c in msg.continuations],
                req.output_token_ids, base_committed_len=msg.base_committed_len)
        except ValueError as err:
            raise ProtocolError(f"bad branches: {err}", request_id=rid) from None

    def drop_draft(self, req: Request) -> None:
        """``req`` runs without its drafter from now on (the drafter closed it): no tail is
        owed, none is waited for."""
        req.drafter = None
        req.tail_in_flight = False
        req.tail.reset(req.committed_len)

    def lose_drafter(self, peer: str) -> None:
        """Drafter ``peer`` cannot be reached (a send failed, its connection is gone): its
        running requests are re-opened with DraftSync on another drafter, or, with none left,
        run as plain decode and are re-synced when it is back (:meth:`restore_drafter`); new
        requests go elsewhere."""
        self.lost_drafters.add(peer)
        for req in list(self.requests.values()):
            if req.drafter == peer:
                self.drop_draft(req)
                req.lost_drafter = peer
                if req.status is RequestStatus.RUNNING:
                    self.open_draft(req)
                    if req.drafter is not None:
                        req.lost_drafter = None

    def restore_drafter(self, peer: str) -> None:
        """Drafter ``peer`` is heard from again (or restarted): re-open its lost requests."""
        self.lost_drafters.discard(peer)
        for req in self.requests.values():
            if req.lost_drafter == peer:
                req.lost_drafter = None
                if req.status is RequestStatus.RUNNING and req.drafter is None \
                        and req.spec_enabled:
                    req.drafter = peer
                    self.sync_draft(req)

    def quarantine(self, req: Request) -> None:
        """Drop ``req``'s drafter state after a bad message from it; it continues without
        drafts (docs/architecture.md, 'Draft tails and staleness')."""
        self.send(req.drafter, DraftClose(request_id=req.request_id, reason=DRAFT_CLOSE_ABORT))
        req.drafter = None
        req.spec_enabled = False
        req.tail.reset(req.committed_len)

    # -- KV transfer -----------------------------------------------------------------------

    def on_transfer(self, t: Transfer | None) -> None:
        """A KVFrame or PrefillDone was applied: a complete transfer starts its request (or
        fails it when the prefill reported an error or an invalid first token)."""
        req = self.get(t.request_id if t else None)
        if req is None or req.status is not RequestStatus.PREFILLING or t.done is None:
            return
        done = t.done
        if done.error:
            self.finish(req, FinishReason.ERROR, f"prefill failed: {done.error}")
        elif not 0 <= done.first_token_id < self.vocab_size:
            self.finish(req, FinishReason.ERROR, "prefill returned an invalid first token")
        else:
            if self.profile is not None:
                self.profile.observe("kv_transfer", time.monotonic() - t.started_at)
                self.profile.observe("kv_ingest", t.ingest_s)
            if req.fork_targets and self.fork_siblings is not None:
                self.fork_siblings(req, done)  # before the leader can finish and free its KV
            self.start(req, done.first_token_id, done.num_bytes, done.seed_state, t)

    def on_prefill_done(self, t: Transfer) -> None:
        """``t``'s PrefillDone arrived before all its frames: its first token is committed and
        streamed now (:meth:`first_token`), while the KV is still arriving; the request runs
        once the transfer is complete. A failed or invalid PrefillDone waits for
        :meth:`on_transfer`."""
        req = self.get(t.request_id)
        done = t.done
        if req is None or req.status is not RequestStatus.PREFILLING or done is None \
                or done.error or not 0 <= done.first_token_id < self.vocab_size:
            return
        if self.first_token(req, done.first_token_id, t):
            self._after_commit(req, req.output_token_ids[:1], notify_drafter=False)

    def first_token(self, req: Request, first_token_id: int, t: Transfer | None = None) -> bool:
        """Commit the prefill's first token (output position 0) of ``req`` unless it has one
        (a re-issued transfer's first token is not used: the client has the first); returns
        whether it did. Records the time to first token (the verifier's share: from the
        GenerateRequest's arrival) in the stats and the profile, with ``ttft_prefill``, from
        the transfer's PrefillRequest to this token."""
        if req.committed_len:
            return False
        now = time.monotonic()
        req.first_token_time = now
        self.stats.observe_ttft(now - req.arrival_time)
        if self.profile is not None:
            self.profile.observe("ttft", now - req.arrival_time)
            if t is not None:
                self.profile.observe("ttft_prefill", now - t.started_at)
        if t is not None and self.on_prefill_time is not None:
            self.on_prefill_time(req, now - t.started_at)
        self.grammars.commit(req, [first_token_id], self.eos_token_ids)
        if t is not None and t.done is not None:  # the prefill role's logprobs, when asked
            req.add_logprobs(t.done.logprobs, 1)
            req.prompt_logprobs = t.done.prompt_logprobs
        req.tail.reset(req.committed_len)
        return True

    # -- running ---------------------------------------------------------------------------

    def wants_hidden(self, req: Request) -> bool:
        """Whether ``req``'s verify rows should come with hidden states: its draft method needs
        them and it may have (or get again) a drafter."""
        return bool(self.seed_state) and req.spec_enabled and req.num_speculative_tokens > 0

    def start(self, req: Request, first_token_id: int, num_kv_bytes: int,
              seed_state: Buffer | None = None, transfer: Transfer | None = None) -> None:
        """The KV transfer of ``req`` completed: commit the prefill's first token (unless
        :meth:`on_prefill_done` did), open the request on a drafter (with the prefill's
        ``seed_state``) and stream the token."""
        self.stats.kv_transfer_bytes += num_kv_bytes
        if self.wants_hidden(req):
            req.seed_window = window_from_prefill(seed_state, req.prompt_len,
                                                  self.hidden_size, self.dtype)
        req.status = RequestStatus.RUNNING
        new = self.first_token(req, first_token_id, transfer)
        req.tail.reset(req.committed_len)
        if req.finish_reason is None:
            self.open_draft(req)  # DraftSync carries the first token: no VerifyCommit for it
        if new:
            self._after_commit(req, [first_token_id], notify_drafter=False)

    def apply(self, req: Request, out: VerifyOutput,
              from_prediction: list[bool] | None = None) -> None:
        """Commit one verify step's output for ``req`` (cut at EOS / stop / max_tokens); its
        spec stats count only the drafts up to the cut, and so do its prediction counts
        (``from_prediction``: the step's PlannedRequest.from_prediction)."""
        start = req.committed_len
        committed = self.grammars.commit(req, out.token_ids, self.eos_token_ids)
        req.add_logprobs(out.logprobs, len(committed))
        if out.accepted_node_ids is not None:
            self.stats.num_tree_verify_steps += 1
            self.stats.num_tree_side_branch_accepts += out.side_branch
        if out.num_draft_tokens:
            # the chain's leading prediction run (a tree's method nodes count as the method's)
            num_predicted = 0
            if from_prediction and out.accepted_node_ids is None:
                while num_predicted < len(from_prediction) and from_prediction[num_predicted]:
                    num_predicted += 1
            self.scheduler.observe_accept(req, out.accept_len, out.num_draft_tokens,
                                          num_predicted)
            req.observe_spec(start, len(committed), out.num_draft_tokens, out.accept_len)
        if from_prediction:
            # the flagged drafts are the chain from the root: a tree's accepted path follows
            # it for as many nodes as it accepted among the chain's
            on_chain = out.accept_len if out.accepted_node_ids is None else sum(
                j < len(from_prediction) for j in out.accepted_node_ids)
            req.prediction.observe(start, len(committed), from_prediction, on_chain,
                                   ended=req.finish_reason is not None)
        rows = None
        if out.hidden is not None and req.finish_reason is None and self.wants_hidden(req):
            # chunk row 0 sits at the last committed token (position L - 1): one row per
            # committed token, positions L - 1 .. L - 1 + accept_len
            rows = out.hidden[:len(committed)]
            if req.seed_window is None:
                req.seed_window = SeedWindow()
            req.seed_window.append(req.prompt_len + start - 1, rows)
        self._after_commit(req, committed, seed_rows=rows)

    def _after_commit(self, req: Request, committed: list[int],
                      notify_drafter: bool = True, seed_rows=None) -> None:  # noqa: ANN001
        self.stats.num_generated_tokens += len(committed)
        if req.finish_reason is not None:
            self.finish(req, req.finish_reason, req.error)
            return
        hits = req.tail.stats.num_branch_hits
        req.tail.on_commit(req.output_token_ids)
        self.stats.num_branch_hits += req.tail.stats.num_branch_hits - hits
        if req.drafter is not None and committed and notify_drafter:
            if self.send(req.drafter, VerifyCommit(
                    request_id=req.request_id, pre_commit_len=req.committed_len - len(committed),
                    committed_token_ids=committed, seed_state=commit_buffer(seed_rows),
                    num_drafts_wanted=self.scheduler.drafts_wanted(req))):
                req.tail_in_flight = True  # (a failed send put the request on plain decode)
        self.stream(req)

    def stream(self, req: Request, finished: bool = False) -> None:
        """Send the gateway the output committed since the last TokenStream."""
        offset = req.num_streamed  # the gateway fails the request on a gap or an overlap
        delta = req.output_token_ids[offset:]
        req.num_streamed = req.committed_len
        reason = req.finish_reason if finished else None
        self.send(req.gateway, TokenStream(
            request_id=req.request_id, token_ids=delta, offset=offset, finished=finished,
            finish_reason=None if reason is None else FinishReason(reason).value,
            num_prompt_tokens=req.prompt_len, num_draft_tokens=req.spec.num_draft_tokens,
            num_accepted_tokens=req.spec.num_accepted_tokens,
            num_verify_steps=req.spec.num_verify_steps, error=req.error,
            num_accepted_prediction_tokens=req.prediction.num_accepted,
            num_rejected_prediction_tokens=req.prediction.num_rejected,
            logprobs=req.take_logprobs(len(delta)),
            prompt_logprobs=req.prompt_logprobs if offset == 0 else None))

    # -- ending ----------------------------------------------------------------------------

    def finish(self, req: Request, reason: FinishReason, error: str = "",
               num_output_tokens: int | None = None) -> None:
        """End ``req`` now (abort, error, or after its last commit) and tell every peer. A
        request still prefilling keeps its blocks until the prefill side acknowledges the
        cancel (CANCELLING); any other is released at once.

        ``num_output_tokens``: where the output really ended (a stop string the gateway found,
        sent with its Abort); spec stats are cut there. The request's spec stats go into the
        verifier's counters (``spec_decode_*``, per-position acceptance) now, once the end of
        its output is known, so they never count a draft past it."""
        if req.status is RequestStatus.FINISHED:
            return
        prev = req.status
        req.finish_reason = req.finish_reason or FinishReason(reason)
        req.error = error
        if num_output_tokens is not None:
            req.cut_output(num_output_tokens)
        for _, _, num_draft_tokens, accept_len in req.spec_steps:
            self.stats.observe_verify(num_draft_tokens, accept_len)
        self.scheduler.dequeue(req)
        self.siblings.unlink(req)  # waiting siblings of a leader are prefilled on their own
        if req.drafter is not None:
            close = DRAFT_CLOSE_FINISHED if FinishReason(reason).is_success else DRAFT_CLOSE_ABORT
            self.send(req.drafter, DraftClose(request_id=req.request_id, reason=close))
        self.stream(req, finished=True)
        req.status = RequestStatus.FINISHED
        if prev is RequestStatus.PREFILLING and req.transfer_id in self.kv.transfers:
            self.kv.cancel(req.transfer_id)
            req.status = RequestStatus.CANCELLING  # blocks wait for the cancel ack
            self.send(req.prefill_peer, PrefillCancel(request_id=req.request_id,
                                                      transfer_id=req.transfer_id))
            return
        self.release(req)
        self.stats.num_finished += 1

    def views(self) -> dict[str, dict]:
        """What an operator (or a fault test) needs to see of each live request: ``status``,
        the ``drafter`` it is open on (None: plain decode), ``num_draft_syncs`` (DraftSyncs
        sent: 1 for the open, +1 per re-open), ``prefill_peer``, ``committed_len`` and its spec
        counters so far (``num_draft_tokens``, ``num_accepted_tokens``), plus the KV frames
        received of its transfer in flight (``transfer_frames``, None when none is). Safe to
        call from another thread (a snapshot; not called per step)."""
        transfers = dict(self.kv.transfers)
        out = {}
        for req in list(self.requests.values()):
            t = transfers.get(req.transfer_id) if req.transfer_id is not None else None
            out[req.request_id] = {
                "status": req.status.name.lower(), "drafter": req.drafter,
                "num_draft_syncs": req.num_draft_syncs, "prefill_peer": req.prefill_peer,
                "committed_len": req.committed_len,
                "num_draft_tokens": req.spec.num_draft_tokens,
                "num_accepted_tokens": req.spec.num_accepted_tokens,
                "transfer_frames": None if t is None else t.num_frames}
        return out

    def release(self, req: Request) -> None:
        """Free ``req``'s blocks and forget it."""
        self.scheduler.release(req)
        self.requests.pop(req.request_id, None)
