"""Starting a request's prefill from the verifier (docs/architecture.md, 'KV transfer'): a
fresh transfer id, the PrefillRequest (with its siblings' sampling), and the choices for a
prefill on cores this verifier shares (decode/core_sharing.py): whether the verifier computes
nothing meanwhile (so the prefill may take every core) and whether a verify step pauses for
the prompts in flight (decode/prefill_pause.py). A mixin of
:class:`decode.worker.VerifierWorker` (its ``kv``, ``requests``, ``core_sharing``,
``prefill_pause``, ``siblings``, ``profile`` and ``_next_transfer_id``)."""

from __future__ import annotations

import time

from specmesh.decode.request import Request, RequestStatus
from specmesh.protocol.messages import PrefillRequest


class PrefillStart:
    """Starts prefills and paces verify steps around them (see the module docstring)."""

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
            sibling_sampling=[f.sampling for f in req.fork_targets] or None,
            lora_name=req.lora_name))

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
        not wait behind another prompt (queueing is not the way's doing), per prompt token
        the prefill computed (a prefix cache hit's tokens cost it nothing: counted, they would
        make a way that met more hits look faster)."""
        if self.core_sharing is not None and self.core_sharing.shared and req.prefill_alone:
            computed = max(req.prompt_len - req.num_cached_tokens, 1)
            self.prefill_pause.observe(req.prefill_paused, computed, seconds)

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
