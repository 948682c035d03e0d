"""Drafter worker: keeps one speculative path per request and streams it ahead
(docs/architecture.md, 'Drafting').

The path runs up to ``window`` tokens past the committed prefix, drafted as if the tail in
flight were accepted (PEARL-style run-ahead), and leaves as DraftTailStream delta segments. A
VerifyCommit that agrees with the path keeps it; one that disagrees truncates the path to the
longest common prefix (the proposer rolls back) and drafting resumes after the commit.

The drafting itself (run-ahead paths, branches, trees, predictions): drafter/drafting.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from specmesh.drafter.config import DrafterConfig
from specmesh.drafter.corpus_loader import CorpusLoader
from specmesh.drafter.draft_state import DraftState
from specmesh.drafter.drafting import Drafting
from specmesh.drafter.prediction import PredictionDrafter, PredictionIndex
from specmesh.drafter.proposer import Proposer
from specmesh.drafter.registry import create_proposer
from specmesh.drafter.seed_state import hidden_rows
from specmesh.protocol.cross_checks import draft_seed_error
from specmesh.protocol.errors import ProtocolError
from specmesh.protocol.messages import (
    DraftClose,
    DraftNeedSync,
    DrafterCorpus,
    DraftSeed,
    DraftSync,
    VerifyCommit,
)
from specmesh.protocol.step_profile import StepProfile
from specmesh.protocol.transport import Envelope, Mailbox, MailboxWorker

#: DraftClose.reason a drafter sends when it has no room for a request
DRAFTER_FULL = "drafter full"
#: most (verifier, request id) pairs remembered as told DraftNeedSync: a peer sending commits
#: for ever new unknown ids must not grow the drafter's state (the oldest are forgotten: at
#: worst one more DraftNeedSync for such an id)
MAX_ASKED_SYNC = 4096

log = logging.getLogger(__name__)


@dataclass
class DrafterStats:
    num_syncs: int = 0
    num_commits: int = 0
    num_segments_sent: int = 0
    num_draft_tokens_sent: int = 0
    num_path_truncations: int = 0
    num_need_sync: int = 0
    num_protocol_errors: int = 0
    num_dropped_messages: int = 0  # for unknown / closed requests
    num_refused_full: int = 0  # DraftSyncs answered DraftClose("drafter full")
    num_branch_candidates_sent: int = 0
    num_branch_hits: int = 0  # commits whose bonus token had a branch sent for it
    num_prediction_tokens_sent: int = 0  # drafts copied from requests' predictions
    num_corpora: int = 0  # corpora held (DrafterCorpus loads)
    num_corpus_tokens: int = 0  # their tokens
    #: prefill draft seeds (DraftSync.draft_seed) the proposer installed / ignored
    num_draft_seeds_adopted: int = 0
    num_draft_seeds_refused: int = 0


class DrafterWorker(Drafting, MailboxWorker):
    """Plain-class drafter. Drive it with ``step()`` or ``run(stop)``."""

    name = "drafter"

    def __init__(self, config: DrafterConfig, mailbox: Mailbox,
                 proposer: Proposer | None = None) -> None:
        if config.window < 1:
            raise ValueError(f"window must be >= 1, got {config.window}")
        self.config = config
        self.mailbox = mailbox
        self.proposer = proposer or create_proposer(config.method, config.method_kwargs)
        self.requests: dict[str, DraftState] = {}
        #: (verifier, request id) told DraftNeedSync and not synced since: asked only once
        self._asked_sync: dict[tuple[str, str], None] = {}  # insertion-ordered set
        self.stats = DrafterStats()
        self.profile = StepProfile()
        self._gen: torch.Generator | None = None
        self._branches_pending = False  # prepare_branches left work for the next step
        self._forwards_seen = 0  # the proposer's num_draft_forwards already counted
        #: corpora and the cross-request history (DrafterCorpus), applied in the background
        self.corpus = CorpusLoader(self.proposer, mailbox.name, mailbox.wake)

    # -- message handling ------------------------------------------------------------------

    def handle(self, env: Envelope) -> None:
        """DraftSync: (re-)open the request on the verifier's committed prefix. VerifyCommit:
        advance it, keeping the path when the commit agrees and truncating it to the longest
        common prefix otherwise; a commit it cannot place answers DraftNeedSync. DraftClose:
        drop the request. ProtocolError: counted; a named request is dropped and the verifier
        told with DraftNeedSync. A request's state is never dropped without telling its
        verifier: a DraftSync it has no room for answers DraftClose(reason "drafter full"), a
        commit for a request it does not know answers DraftNeedSync (once until the next
        DraftSync). DrafterCorpus: a corpus operation, applied in the background
        (drafter/corpus_loader.py) and answered with DrafterCorpusResult. Anything else is
        counted as dropped.

        Seed states (a proposer whose ``seed_state`` is "hidden"): a DraftSync's rows (at
        least one) end at position ``len(context) - 2``, a VerifyCommit's (one per committed
        token) start at ``prompt_len + pre_commit_len - 1``; the proposer observes them after
        ``open`` / after the commit is applied (rollback included). Rows that do not fit (count,
        width, dtype) are a protocol error for the request: DraftNeedSync. A DraftSync's
        ``draft_seed`` (the prefill's first draft step) is then given to a proposer that
        ``makes_prefill_seed`` to adopt; one that is malformed or does not fit is ignored
        (logged, ``num_draft_seeds_refused``) and the proposer runs that step itself."""
        msg = env.msg
        if isinstance(msg, ProtocolError):
            self.stats.num_protocol_errors += 1
            st = self.requests.get(msg.request_id) if msg.request_id is not None else None
            if st is not None and st.verifier == env.peer:  # the verifier re-syncs it
                self._need_sync(st, f"protocol error: {msg}")
            return
        if isinstance(msg, DraftSync):
            self._on_sync(env.peer, msg)
        elif isinstance(msg, VerifyCommit):
            self._on_commit(env.peer, msg)
        elif isinstance(msg, DraftClose):
            self._asked_sync.pop((env.peer, msg.request_id), None)
            if msg.request_id in self.requests:
                self._drop(msg.request_id)
            else:
                self.stats.num_dropped_messages += 1
        elif isinstance(msg, DrafterCorpus):
            self._send_corpus_results(self.corpus.on_message(env.peer, msg))
        else:
            self.stats.num_dropped_messages += 1
            log.debug("drafter ignores %s from %s", type(msg).__name__, env.peer)

    def _on_sync(self, peer: str, msg: DraftSync) -> None:
        self.stats.num_syncs += 1
        self._asked_sync.pop((peer, msg.request_id), None)
        if msg.request_id in self.requests:
            self.proposer.close(msg.request_id)
        elif len(self.requests) >= self.config.max_requests:
            log.warning("drafter full; closing %s", msg.request_id)
            self.stats.num_refused_full += 1
            self.send(peer, DraftClose(request_id=msg.request_id, reason=DRAFTER_FULL))
            return
        st = DraftState(msg.request_id, peer, list(msg.prompt_token_ids),
                        list(msg.committed_token_ids), sampling=msg.sampling)
        if msg.prediction_token_ids:
            st.prediction = PredictionDrafter(PredictionIndex(msg.prediction_token_ids))
        self.requests[msg.request_id] = st
        self.proposer.open(msg.request_id, st.context)
        if msg.target_kv is not None and self.proposer.reads_target_kv:  # frozen-KV MTP
            self.proposer.observe_target_kv(st.request_id, peer, msg.target_kv)
        if self._wants_seed(msg.seed_state):  # rows end at position len(context) - 2
            try:
                hidden = hidden_rows(msg.seed_state, self.proposer.seed_hidden_size)
                start = len(st.context) - 1 - hidden.shape[0]
                if start < 0:
                    raise ValueError(f"seed state has {hidden.shape[0]} rows for a context "
                                     f"of {len(st.context)} tokens")
                self.proposer.observe_seed_state(st.request_id, start, hidden)
            except ValueError as err:
                self._need_sync(st, f"bad seed state: {err}")
                return
            if msg.draft_seed is not None and getattr(self.proposer, "makes_prefill_seed", False):
                self._adopt_seed(st, msg.draft_seed)

    def _adopt_seed(self, st: DraftState, seed: DraftSeed) -> None:
        """The prefill's first draft step (DraftSync.draft_seed) installed in the proposer's
        state for ``st`` (after its seed rows), counted adopted or refused: a seed that is
        malformed or does not fit is ignored (logged) and the proposer runs the step itself."""
        why = draft_seed_error(seed, position=len(st.context) - 2, token_id=st.context[-1])
        try:
            ok = not why and self.proposer.adopt_prefill_seed(st.request_id, st.context, seed)
        except Exception as err:  # noqa: BLE001 - a seed must never stop the drafter
            log.warning("adopting the draft seed of %s failed", st.request_id, exc_info=True)
            why, ok = f"{type(err).__name__}: {err}", False
        if ok:
            self.stats.num_draft_seeds_adopted += 1
        else:
            self.stats.num_draft_seeds_refused += 1
            if why:
                log.warning("draft seed of %s ignored: %s", st.request_id, why)

    def _on_commit(self, peer: str, msg: VerifyCommit) -> None:
        st = self.requests.get(msg.request_id)
        if st is None:  # dropped here (or never opened): the verifier must not wait for it
            self.stats.num_dropped_messages += 1
            if (peer, msg.request_id) not in self._asked_sync:
                self._asked(peer, msg.request_id)
                self.stats.num_need_sync += 1
                self.send(peer, DraftNeedSync(request_id=msg.request_id,
                                              reason="commit for a request the drafter "
                                                     "does not hold"))
            return
        self.stats.num_commits += 1
        self.profile.count("commits")
        toks = list(msg.committed_token_ids)
        pre = msg.pre_commit_len
        hidden = None
        if self._wants_seed(msg.seed_state):  # one row per committed token
            try:
                hidden = hidden_rows(msg.seed_state, self.proposer.seed_hidden_size,
                                     num_rows=len(toks))
            except ValueError as err:
                self._need_sync(st, f"bad seed state: {err}")
                return
        n_committed = len(st.committed)
        if pre < n_committed:  # replayed overlap: must agree with what we hold
            overlap = st.committed[pre:pre + len(toks)]
            if toks[:len(overlap)] != overlap:
                self._need_sync(st, f"commit at {pre} disagrees with committed prefix")
                return
            toks = toks[len(overlap):]
            pre = n_committed
        if pre != n_committed:
            self._need_sync(st, f"commit at {pre} but drafter holds {n_committed} tokens")
            return
        lcp = 0
        while lcp < len(toks) and lcp < len(st.path) and st.path[lcp] == toks[lcp]:
            lcp += 1
        branch = None
        if lcp == len(toks) - 1:  # the bonus token left the path: did we prepare it?
            branch = st.branches.get(n_committed + lcp, {}).get(toks[lcp])
        if lcp == len(toks):  # the commit agrees with our path: keep the rest of it
            del st.path[:lcp]
            del st.probs[:lcp]
            del st.predicted[:lcp]
            st.num_sent = max(st.num_sent - lcp, 0)
            end = n_committed + len(toks)
            st.branches = {p: b for p, b in st.branches.items() if p >= end}
        else:
            self.stats.num_path_truncations += 1
            self.proposer.rollback(st.request_id, len(st.prompt_token_ids) + n_committed + lcp)
            st.path.clear()
            st.probs.clear()
            st.predicted.clear()
            st.num_sent = 0
            st.branches = {}
            if branch:  # the verifier's tail is this branch: continue it (sent again, fresh)
                self.stats.num_branch_hits += 1
                self.profile.count("branch_hits")
                st.path.extend(branch)
                st.probs.extend([None] * len(branch))
                st.predicted.extend([False] * len(branch))
        st.committed.extend(toks)
        st.num_drafts_wanted = msg.num_drafts_wanted
        st.drafting_paused = msg.drafting_paused
        st.exhausted = False
        st.news = True
        st.commit_received_at = time.perf_counter()
        if branch:
            # The verifier made this branch its tail at the commit: answer at once, before
            # the catch-up and the next draft (a few ms served), so that it does
            # not spend its tail wait on a second draft that cannot arrive within it.
            self._send_segment(st)
        if msg.target_kv is not None and self.proposer.reads_target_kv:  # frozen-KV MTP
            self.proposer.observe_target_kv(st.request_id, peer, msg.target_kv)
        if hidden is not None and toks:  # the rows of the tokens new to us, after any rollback
            new = hidden[hidden.shape[0] - len(toks):]
            start = len(st.prompt_token_ids) + pre - 1
            try:
                self.proposer.observe_seed_state(st.request_id, start, new)
            except ValueError as err:
                self._need_sync(st, f"bad seed state: {err}")

    def _wants_seed(self, buf) -> bool:  # noqa: ANN001
        """A seed state came and the proposer uses it (others are never even decoded)."""
        return buf is not None and bool(self.proposer.seed_state)

    def _need_sync(self, st: DraftState, reason: str) -> None:
        self.stats.num_need_sync += 1
        self._drop(st.request_id)
        self._asked(st.verifier, st.request_id)
        self.send(st.verifier, DraftNeedSync(request_id=st.request_id, reason=reason))

    def _asked(self, peer: str, request_id: str) -> None:
        """Remember that ``peer`` was told DraftNeedSync for ``request_id`` (at most
        MAX_ASKED_SYNC pairs: the oldest is forgotten)."""
        self._asked_sync[peer, request_id] = None
        if len(self._asked_sync) > MAX_ASKED_SYNC:
            del self._asked_sync[next(iter(self._asked_sync))]

    def _drop(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.proposer.close(request_id)

    def on_send_failed(self, peer: str, err: ConnectionError) -> None:
        """The verifier is gone: its requests (and its half-sent corpora) are gone too."""
        self.drop_peer(peer)

    def drop_peer(self, peer: str) -> int:
        """Forget the requests (and half-sent corpora) of verifier ``peer``: it is gone, or
        restarted (a new incarnation never asks for its previous life's requests, and no
        send to the old one fails, so without this they would stay for good). Returns the
        requests dropped."""
        rids = [r for r, s in self.requests.items() if s.verifier == peer]
        for rid in rids:
            self._drop(rid)
        self.corpus.forget_peer(peer)
        return len(rids)

    def _send_corpus_results(self, results: list) -> None:
        """Send corpus answers ((peer, DrafterCorpusResult) pairs) and update the counts."""
        for peer, result in results:
            self.send(peer, result)
        if results:
            self.stats.num_corpora = len(self.corpus.held)
            self.stats.num_corpus_tokens = self.corpus.num_tokens

    def step(self, timeout_s: float = 0.0) -> int:
        """Ingest what arrived (waiting up to ``timeout_s`` for the first message), then draft;
        with every path full, prepare branches (:meth:`prepare_branches`)."""
        if self._has_work() or self._branches_pending:
            timeout_s = 0.0
        self.ingest(timeout_s)
        self._send_corpus_results(self.corpus.results())
        sent = self.draft()
        if not self._has_work():
            self.prepare_branches()
        self._count_forwards()
        return sent

    def _count_forwards(self) -> None:
        """The method's model forwards since the last step as the ``draft_forwards`` profile
        counter (the bench's draft forwards per verify step; drafter/draft_memory.py); none
        for a method that does not count them."""
        n = getattr(self.proposer, "num_draft_forwards", None)  # a duck-typed test proposer
        if n is not None and n > self._forwards_seen:
            self.profile.count("draft_forwards", n - self._forwards_seen)
            self._forwards_seen = n

