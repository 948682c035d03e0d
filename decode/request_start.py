"""The start of a request on the verifier (docs/architecture.md, 'Life of a request'): its KV
transfer completes (or fails), the prefill's first token (output position 0) is committed and
streamed, as soon as PrefillDone arrives when the frames are still on their way, with the
parts of its time to first token; then the request runs and is opened on a drafter. A mixin
of :class:`decode.lifecycle.RequestLifecycle` (its ``requests``, ``stats``, ``profile``,
``grammars``, ``fork_siblings``, ``on_prefill_time``, ``finish``, ``open_draft`` and
``_after_commit``)."""

from __future__ import annotations

import logging
import time

from specmesh.decode.kv_receiver import Transfer
from specmesh.decode.request import Request, RequestStatus
from specmesh.decode.seed_state import window_from_prefill
from specmesh.protocol.cross_checks import draft_seed_error
from specmesh.protocol.enums import FinishReason
from specmesh.protocol.messages import Buffer, DraftSeed

log = logging.getLogger(__name__)


class RequestStart:
    """Starts a request once its prefill is done (see the module docstring)."""

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
            self.start(req, done.first_token_id, done.num_bytes, done.seed_state, t,
                       done.draft_seed)

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
        if t is not None and t.done is not None:
            req.num_cached_tokens = t.done.num_cached_tokens
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

    def start(self, req: Request, first_token_id: int, num_kv_bytes: int,
              seed_state: Buffer | None = None, transfer: Transfer | None = None,
              draft_seed: DraftSeed | None = None) -> None:
        """The KV transfer of ``req`` completed: commit the prefill's first token (unless
        :meth:`on_prefill_done` did), open the request on a drafter (with the prefill's
        ``seed_state`` and ``draft_seed``: :meth:`keep_draft_seed`) and stream the token."""
        self.stats.kv_transfer_bytes += num_kv_bytes
        if seed_state is not None:  # the P/D seed's cost per request (docs/drafters.md)
            self.stats.seed_state_bytes += seed_state.nbytes
            self.stats.num_seed_states += 1
            if self.profile is not None:
                self.profile.count("seed_state_bytes", seed_state.nbytes)
                self.profile.count("num_seed_states")
        if self.wants_hidden(req):
            req.seed_window = window_from_prefill(seed_state, req.prompt_len,
                                                  self.hidden_size, self.dtype)
        if draft_seed is not None:
            self.keep_draft_seed(req, draft_seed, first_token_id)
        req.status = RequestStatus.RUNNING
        new = self.first_token(req, first_token_id, transfer)
        req.tail.reset(req.committed_len)
        if req.finish_reason is None:
            self.open_draft(req)  # DraftSync carries the first token: no VerifyCommit for it
        if new:
            self._after_commit(req, [first_token_id], notify_drafter=False)

    def keep_draft_seed(self, req: Request, seed: DraftSeed, first_token_id: int) -> None:
        """Keep the prefill's draft seed on ``req`` for its first DraftSync
        (decode/draft_link.py) when it is well formed for it (protocol/cross_checks.py
        ``draft_seed_error``: its entry at the last prompt position, ids in the vocabulary,
        ...) and the request drafts from hidden states with a window to send; its bytes count
        in ``seed_state_bytes`` (the P/D seed's cost per request) and ``draft_seed_bytes``. A
        malformed one is ignored (logged, ``num_bad_draft_seeds``): the drafter then runs that
        step itself. A sibling whose first token is not the seed's shares none."""
        why = draft_seed_error(seed, self.vocab_size, position=req.prompt_len - 1)
        if why:
            self.stats.num_bad_draft_seeds += 1
            log.warning("draft seed of %s ignored: %s", req.request_id, why)
            return
        self.stats.num_draft_seeds += 1
        self.stats.draft_seed_bytes += seed.nbytes
        self.stats.seed_state_bytes += seed.nbytes
        if self.profile is not None:  # the bench's per-request seed bytes include it
            self.profile.count("draft_seed_bytes", seed.nbytes)
            self.profile.count("seed_state_bytes", seed.nbytes)
        if seed.token_id == first_token_id and req.seed_window is not None:
            req.draft_seed = seed
