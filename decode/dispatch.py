"""The verifier's message dispatch (docs/architecture.md, 'Life of a request'): what each
message a peer sends does to the verifier's requests, transfers and drafters, and the
validation of a new GenerateRequest. A mixin of :class:`decode.worker.VerifierWorker` (its
``lifecycle``, ``kv``, ``scheduler``, ``grammars``, ``siblings``, ``corpus_relay``, ``lora``,
``stats``, peers and ``send``); a bad message is counted or refused, never raised to the loop."""

from __future__ import annotations

import logging

from specmesh.decode.request import Request, RequestStatus, sampling_with_eos
from specmesh.engine.lora import lora_refusal
from specmesh.protocol.enums import FinishReason
from specmesh.protocol.errors import ProtocolError
from specmesh.protocol.messages import (
    Abort,
    DraftBranches,
    DraftClose,
    DrafterCorpus,
    DrafterCorpusResult,
    DraftNeedSync,
    DraftTailStream,
    GenerateRequest,
    KVFrame,
    LoraAdapterOp,
    LoraAdapterResult,
    PrefillCancelAck,
    PrefillDone,
    TokenStream,
)
from specmesh.protocol.transport import Envelope

log = logging.getLogger(__name__)


class VerifierDispatch:
    """Applies the messages the verifier receives (see the module docstring)."""

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
        - LoraAdapterOp (gateway): applied to the model's LoRA adapters and relayed to the
          prefill workers (decode/lora_relay.py); LoraAdapterResult (prefill): forwarded to
          the gateway that sent the operation. Either from a peer of another role is ignored.
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
            elif isinstance(msg, LoraAdapterOp):
                if peer in self.lifecycle.drafter_peers or peer in self.prefill_peers:
                    self.stats.num_ignored_messages += 1  # only a gateway sends these
                else:
                    self.lora.on_op(peer, msg)
            elif isinstance(msg, LoraAdapterResult):
                if peer not in self.prefill_peers or not self.lora.on_result(peer, msg):
                    self.stats.num_ignored_messages += 1
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
        if not error and msg.lora_name:  # an adapter this verifier did not load
            error = lora_refusal(self.verify_step.runner.model, msg.lora_name)
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
                      prediction_token_ids=list(msg.prediction_token_ids or []) or None,
                      lora_name=msg.lora_name)
        self.requests[req.request_id] = req
        if msg.group and req.leader is None:
            self.siblings.join(req, msg.group, msg.group_size)
            if req.leader is not None and req.leader.prompt_token_ids != req.prompt_token_ids:
                self.siblings.unlink(req)  # a group is one prompt: this one runs on its own
        self.grammars.open(req)  # its grammar compiles while it waits and prefills
        self.scheduler.enqueue(req)
