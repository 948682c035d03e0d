"""The life of a request on the verifier: every state change and the messages it sends.

:class:`RequestLifecycle` owns the live requests. It starts a request when its KV transfer
completes (the prefill's first token is output position 0), opens it on a drafter, applies a
verify step's output (commit, cut at EOS / stop token / max_tokens; VerifyCommit to the
drafter; TokenStream to the gateway), and ends it (DraftClose, the last TokenStream, PrefillCancel
when the KV is still in flight, then the blocks go back). Messages leave through the ``send``
callable it is given, so the worker stays the only transport edge. The start of a request is
in :mod:`decode.request_start`, its link to its drafter in :mod:`decode.draft_link` (mixins
of :class:`RequestLifecycle`).
"""

from __future__ import annotations

from collections.abc import Callable

from specmesh.decode.draft_link import DraftLink
from specmesh.decode.grammar import VerifierGrammars
from specmesh.decode.kv_receiver import KVReceiver
from specmesh.decode.request import Request, RequestStatus
from specmesh.decode.request_start import RequestStart
from specmesh.decode.scheduler import Scheduler
from specmesh.decode.seed_state import SeedWindow
from specmesh.decode.siblings import SiblingGroups
from specmesh.decode.stats import VerifierStats
from specmesh.decode.verify_step import VerifyOutput
from specmesh.protocol.enums import DRAFT_CLOSE_ABORT, DRAFT_CLOSE_FINISHED, FinishReason
from specmesh.protocol.step_profile import StepProfile
from specmesh.protocol.messages import (
    DraftClose,
    PrefillCancel,
    PrefillDone,
    TokenStream,
)

Send = Callable[[str | None, object], object]


class RequestLifecycle(DraftLink, RequestStart):
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

    # -- running ---------------------------------------------------------------------------

    def wants_hidden(self, req: Request) -> bool:
        """Whether ``req``'s verify rows should come with hidden states: its draft method needs
        them and it may have (or get again) a drafter."""
        return bool(self.seed_state) and req.spec_enabled and req.num_speculative_tokens > 0

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
        if notify_drafter:
            self.notify_commit(req, len(committed), seed_rows)
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
            num_cached_tokens=req.num_cached_tokens,
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
            if FinishReason(reason).is_success:
                self.flush_held_commits(req)
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
