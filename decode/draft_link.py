"""A request's link to its drafter, on the verifier (docs/architecture.md, 'Draft tails and
staleness'): which drafter drafts for it, opening and re-opening it there (DraftSync with the
committed prefix), the tails and branches it streams back, and what happens when a drafter
closes a request, goes away, comes back or sends something bad (the request runs as plain
decode meanwhile: the verifier alone decides every committed token). A mixin of
:class:`decode.lifecycle.RequestLifecycle` (its ``requests``, ``scheduler``, ``stats``,
``drafter_peers``, ``lost_drafters``, ``vocab_size`` and ``send``)."""

from __future__ import annotations

from specmesh.decode.draft_probs import checked_draft_probs
from specmesh.decode.request import Request, RequestStatus
from specmesh.decode.seed_state import commit_buffer, sync_buffer
from specmesh.decode.target_kv import target_kv_rows
from specmesh.protocol.enums import DRAFT_CLOSE_ABORT
from specmesh.protocol.errors import ProtocolError
from specmesh.protocol.messages import (
    DraftBranches,
    DraftClose,
    DraftSync,
    DraftTailStream,
    VerifyCommit,
)


class DraftLink:
    """Opens requests on drafters and applies what drafters send (see the module docstring)."""

    #: the KV pool is in shared memory for a frozen-KV drafter: DraftSync and VerifyCommit
    #: carry each request's committed rows (decode/target_kv.py)
    share_kv: bool = False

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
        req.commits_held_from = None  # the sync carries every committed token
        req.drafter_told_paused = False  # (a DraftSync opens the request drafting)
        seed = sync_buffer(req.seed_window, req.prompt_len + req.committed_len)
        # the prefill's draft seed: on the first DraftSync only, while the output is just the
        # first token the seed read and the sync carries the prompt's last row (else stale)
        dseed, req.draft_seed = req.draft_seed, None
        if dseed is not None and (req.committed_len != 1 or seed is None
                                  or req.output_token_ids[0] != dseed.token_id):
            dseed = None
        if self.send(req.drafter, DraftSync(
                request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                committed_token_ids=list(req.output_token_ids), sampling=req.sampling,
                seed_state=seed, prediction_token_ids=req.prediction_token_ids,
                target_kv=target_kv_rows(req, self.share_kv), draft_seed=dseed)):
            req.num_draft_syncs += 1
            req.tail_in_flight = True  # (a failed send put the request on plain decode)
            self.stats.seed_state_sent_bytes += seed.nbytes if seed is not None else 0
            self.stats.num_draft_seeds_sent += dseed is not None

    def notify_commit(self, req: Request, num_committed: int, seed_rows=None) -> None:  # noqa: ANN001
        """Tell ``req``'s drafter about the ``num_committed`` tokens it just committed
        (VerifyCommit; ``seed_rows``: their hidden states, one row each, or None).

        Held commits: while the speculation gate has drafting off (Scheduler.drafting_paused)
        the drafter drafts nothing, so telling it every step only costs: the verifier's
        commit (seed rows copied out and encoded), the send, and the drafter's decode and
        ingest on cores the verifier's forward needs (measured on 2 cores, EAGLE at 4
        streams: commit 0.66 ms against 0.17 ms, forward 18.4 ms against 17.7 ms, drafting
        paused on 95 % of the steps). So once a commit has told the drafter it is paused
        (``drafting_paused``: it stops drafting and preparing branches) the commits are held
        (``req.commits_held_from``: the committed length the drafter last heard of) and sent
        as one VerifyCommit when
        drafting resumes or the request ends, with the seed rows the window still holds; a
        hold longer than the window (decode/seed_state.py, MAX_SEED_ROWS) re-opens the
        request with a DraftSync instead. A request whose drafter reads the target's KV
        (``share_kv``) is never held: its commits carry those rows."""
        if req.drafter is None or not num_committed:
            return
        pre = req.committed_len - num_committed
        if self.scheduler.drafting_paused(req) and req.drafter_told_paused \
                and not self.share_kv:
            if req.commits_held_from is None:
                req.commits_held_from = pre
            return
        if req.commits_held_from is not None:
            pre, req.commits_held_from = req.commits_held_from, None
            self.stats.num_held_commit_flushes += 1
            if seed_rows is not None:
                seed_rows = req.seed_window.rows_from(req.prompt_len + pre - 1)
                if seed_rows is None or seed_rows.shape[0] != req.committed_len - pre:
                    self.sync_draft(req)  # the window no longer holds every row
                    return
        self.send_commit(req, pre, seed_rows)

    def send_commit(self, req: Request, pre_commit_len: int, seed_rows=None) -> None:  # noqa: ANN001
        """VerifyCommit of ``req``'s output from ``pre_commit_len`` on."""
        seed = commit_buffer(seed_rows)
        paused = self.scheduler.drafting_paused(req)
        if self.send(req.drafter, VerifyCommit(
                request_id=req.request_id, pre_commit_len=pre_commit_len,
                committed_token_ids=req.output_token_ids[pre_commit_len:], seed_state=seed,
                num_drafts_wanted=self.scheduler.drafts_wanted(req), drafting_paused=paused,
                target_kv=target_kv_rows(req, self.share_kv))):
            # a paused drafter answers with no tail: none is owed, so the step that resumes
            # drafting does not wait for one (a failed send put the request on plain decode)
            req.tail_in_flight = not paused
            req.drafter_told_paused = paused
            self.stats.seed_state_sent_bytes += seed.nbytes if seed is not None else 0

    def flush_held_commits(self, req: Request) -> None:
        """Before ``req``'s drafter is told it finished: the commits held from it, so that
        what it keeps of the finished output (suffix decoding's global tree) is whole."""
        if req.drafter is not None and req.commits_held_from is not None:
            pre, req.commits_held_from = req.commits_held_from, None
            self.send_commit(req, pre)

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
                                  req.output_token_ids, base_committed_len=msg.base_committed_len,
                                  draft_probs=probs)
            else:
                req.tail.add(msg.start_pos, list(msg.draft_token_ids), req.output_token_ids,
                             base_committed_len=msg.base_committed_len, draft_probs=probs,
                             from_prediction=msg.from_prediction)
                if not msg.from_prediction:  # scores for the confidence budget
                    req.head_confidences.add(msg.start_pos, msg.draft_token_ids,
                                             msg.draft_confidences)
                    req.draft_token_probs.add(msg.start_pos, msg.draft_token_ids,
                                              msg.draft_token_probs)
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
