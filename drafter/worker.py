"""Drafter worker: keeps one speculative path per request and streams it ahead
(docs/architecture.md, 'Drafting').

The path runs up to ``window`` tokens past the committed prefix, drafted as if the tail in
flight were accepted (PEARL-style run-ahead), and leaves as DraftTailStream delta segments. A
VerifyCommit that agrees with the path keeps it; one that disagrees truncates the path to the
longest common prefix (the proposer rolls back) and drafting resumes after the commit.

Branches (the speculation cache of SSD / Saguaro, arXiv 2603.03251; drafter/branches.py picks
them): once every path is as long as its run-ahead allows, a proposer that prepares them
drafts, for the first positions of the path, the next draft after each likely token other than
the path's, and the worker sends them as DraftBranches. The verifier keeps them; a commit whose
bonus token is one of them makes its continuation the tail at once, with no wait for this
worker. Here such a commit starts the path from that continuation, re-sent as a fresh segment
while the commit is handled (which also covers a verifier that never got the branches).

Trees: a proposer whose ``draft_shape`` is "tree" is asked for a tree only for the segment at
the committed prefix (an empty path); the segment carries the whole tree (``parents``) and its
branch 0 becomes the path, which later segments extend as chains. A commit that leaves branch 0
truncates the path as usual, so the next segment at the new committed prefix is a tree again.

Predictions (OpenAI Predicted Outputs): a request whose DraftSync carries a prediction drafts
from it first (drafter/prediction.py: the output's suffix aligned to the prediction, the tokens
after it copied), whatever the method; the method drafts only where the prediction has nothing
(no match, or its end). Prediction tokens leave as segments of their own
(DraftTailStream.from_prediction, without draft_probs: a deterministic proposal, verified
one-hot), so the verifier can count how many of them it accepted. Copying costs no forward,
so a path continued from the prediction runs up to ``prediction_window`` tokens ahead, past the
method's window and ``max_segment``: the verifier verifies a run of prediction drafts wider than
kappa (decode/scheduler.py, Scheduler.prediction_drafts).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from specmesh.drafter.branches import MAX_BRANCH_REQUESTS, kept_candidates, plan_branches
from specmesh.drafter.config import RUN_AHEAD_STEPS, DrafterConfig
from specmesh.drafter.corpus_loader import CorpusLoader
from specmesh.drafter.draft_sampling import DraftSampling
from specmesh.drafter.draft_state import DraftState
from specmesh.drafter.head_confidences import split_confidences
from specmesh.drafter.prediction import PredictionDrafter, PredictionIndex, output_tail
from specmesh.drafter.proposer import ProposeCall, Proposer
from specmesh.drafter.registry import create_proposer
from specmesh.drafter.seed_state import hidden_rows
from specmesh.engine.frames import tensor_to_buffer
from specmesh.engine.sampling import GREEDY, sampling_mode
from specmesh.engine.token_tree import first_branch
from specmesh.protocol.cross_checks import draft_seed_error
from specmesh.protocol.errors import ProtocolError
from specmesh.protocol.messages import (
    Buffer,
    DraftBranches,
    DraftClose,
    DraftNeedSync,
    DrafterCorpus,
    DraftSeed,
    DraftSync,
    DraftTailStream,
    VerifyCommit,
)

#: DraftClose.reason a drafter sends when it has no room for a request
DRAFTER_FULL = "drafter full"
#: most (verifier, request id) pairs remembered as told DraftNeedSync: a peer sending commits
#: for ever new unknown ids must not grow the drafter's state (the oldest are forgotten: at
#: worst one more DraftNeedSync for such an id)
MAX_ASKED_SYNC = 4096
from specmesh.protocol.step_profile import StepProfile
from specmesh.protocol.transport import Envelope, Mailbox, MailboxWorker

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


class DrafterWorker(MailboxWorker):
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

    # -- drafting --------------------------------------------------------------------------

    def draft(self) -> int:
        """Extend every request's path towards the window: from its prediction where it has
        one that continues the path (:meth:`_predict`), else by the method (one
        :meth:`Proposer.propose_many` call for all of them); returns tokens streamed."""
        sent = 0
        wants = []
        for st in self.requests.values():
            if st.exhausted:
                continue
            if st.prediction is not None and \
                    self._predict(st, self._prediction_window(st) - len(st.path)):
                continue
            room = min(self._window(st) - len(st.path), self.config.max_segment)
            if room > 0:
                if self.proposer.max_drafts_per_call:
                    room = min(room, self._tree_depth(st) if self._tree_segment(st)
                               else self.proposer.max_drafts_per_call)
                wants.append((st, room))
            elif st.prediction is not None:
                # the prediction has nothing here and the method's window is full: nothing
                # changes until the next commit
                st.exhausted = True
        if wants:
            with self.profile.phase("propose"):
                results = self._propose_all(wants)
            for (st, room), (new, rows) in zip(wants, results):
                if new:
                    st.path.extend(new[:room])
                    st.probs.extend(rows[:room])
                    st.predicted.extend([False] * len(new[:room]))
                else:
                    st.exhausted = True  # until the next commit changes the context
        for st in list(self.requests.values()):
            if st.num_sent < len(st.path) or st.news:
                sent += self._send_segment(st)
        return sent

    def _predict(self, st: DraftState, room: int) -> bool:
        """Extend ``st``'s path by up to ``room`` tokens of its prediction, aligned to the
        output's suffix (drafter/prediction.py); False when it has no prediction or the
        prediction has nothing to continue the path with (the method drafts then)."""
        if st.prediction is None or room <= 0:
            return False
        with self.profile.phase("predict"):
            n = st.prediction.index.max_match
            new = st.prediction.draft(output_tail(st.committed, st.path, n),
                                      len(st.committed) + len(st.path), room)
        if not new:
            return False
        st.path.extend(new)
        st.probs.extend([None] * len(new))
        st.predicted.extend([True] * len(new))
        self.profile.count("prediction_tokens", len(new))
        return True

    def _send_segment(self, st: DraftState) -> int:
        """Send ``st``'s path past what was sent (an empty segment when only news is owed:
        it tells a verifier waiting for a tail that none is coming), one segment per run of
        prediction tokens or method drafts; returns tokens sent."""
        start = st.num_sent
        st.news = False
        tree, st.tree = st.tree, None
        if tree is not None and start == 0:  # branch 0 is the path: send the tree
            runs = [(tree[0], tree[1], tree[2], False)]
        else:
            runs = [(st.path[a:b], None, st.probs[a:b], flag)
                    for a, b, flag in _runs(st.predicted, start, len(st.path))]
        pos = len(st.committed) + start
        for seg, parents, rows, flag in runs:
            rows, confidences = split_confidences(rows)  # a confidence head's (dspark)
            self.send(st.verifier, DraftTailStream(
                request_id=st.request_id, base_committed_len=len(st.committed),
                start_pos=pos, draft_token_ids=seg, draft_probs=self._probs_buffer(rows),
                parents=parents, from_prediction=flag,
                draft_token_probs=_token_probs(rows), draft_confidences=confidences))
            pos += len(seg)
            if flag:
                self.stats.num_prediction_tokens_sent += len(seg)
        seg = [t for run in runs for t in run[0]]
        st.num_sent = len(st.path)
        if st.commit_received_at is not None:  # how fast a commit turns into a tail
            self.profile.observe("commit_to_tail",
                                 time.perf_counter() - st.commit_received_at)
            st.commit_received_at = None
        # run-ahead: drafted tokens past the committed prefix when the segment leaves
        self.profile.count("run_ahead_tokens", len(st.path))
        self.profile.count("num_segments", len(runs))
        self.stats.num_segments_sent += len(runs)
        self.stats.num_draft_tokens_sent += len(seg)
        return len(seg)

    def prepare_branches(self) -> int:
        """Branches for requests whose path has no room left to grow (drafter/branches.py):
        one :meth:`Proposer.propose_branches` call of at most
        :data:`~drafter.branches.MAX_BRANCH_ROWS` candidates, so a commit that arrives
        meanwhile waits little; the rest is left for the next step (``_branches_pending``).
        Returns the candidates sent."""
        n, pos_cap = self.config.num_branches, self.config.branch_positions
        self._branches_pending = False
        if not n or not pos_cap or len(self.requests) > MAX_BRANCH_REQUESTS or \
                type(self.proposer).propose_branches is Proposer.propose_branches:
            return 0
        plan = plan_branches([s for s in self.requests.values() if not s.drafting_paused],
                             n, pos_cap, self._window)
        self._branches_pending = plan.pending
        if not plan.calls:
            return 0
        sent = 0
        with self.profile.phase("branches"):
            results = self.proposer.propose_branches(plan.calls)
        for (st, pos), got in zip(plan.where, results):
            got = kept_candidates(got, st.path[pos - len(st.committed)])
            if not got:
                continue
            st.branches[pos] = got
            self.send(st.verifier, DraftBranches(
                request_id=st.request_id, base_committed_len=len(st.committed), position=pos,
                token_ids=list(got), continuations=list(got.values())))
            sent += len(got)
        self.stats.num_branch_candidates_sent += sent
        return sent

    def _tree_segment(self, st: DraftState) -> bool:
        """Whether ``st``'s next segment is a tree: a tree proposer's, at the committed
        prefix (module docstring)."""
        return self.proposer.draft_shape == "tree" and not st.path and st.num_sent == 0

    def _tree_depth(self, st: DraftState) -> int:
        """How deep the tree of a model drafter that streams its chains a draft per call
        (EAGLE-2, drafter/eagle/tree_draft.py) is drafted, whole, in one call: as deep as the
        verifier verifies (``num_drafts_wanted``; without it, the window). The run-ahead past
        it continues branch 0 as chains."""
        return max(1, st.num_drafts_wanted or self.config.window)

    def _window(self, st: DraftState) -> int:
        """How far ``st``'s path may run past its committed prefix: the configured window or,
        when the verifier said how many drafts it will verify and drafts cost this method a
        forward (``Proposer.runs_a_model``), the same run-ahead multiple of that (at least one
        draft, so a verifier that holds drafts back can still probe). A method that runs no
        model (n-gram, suffix) keeps the whole window: its drafts cost nothing to make, and
        the verifier's caps can only take the drafts they are offered (bounded by what it
        asked for, a request capped at one draft was offered about one, and the caps never
        saw that more would have paid: served suffix at 1 stream verified 1.00 tokens a step
        under the caps against 1.28 at a fixed kappa of 3)."""
        if st.drafting_paused:  # the verifier's gate: no drafts, not even a probe's
            return 0
        if st.num_drafts_wanted is None or not self.proposer.runs_a_model:
            return self.config.window
        return min(self.config.window, RUN_AHEAD_STEPS * max(st.num_drafts_wanted, 1))

    def _prediction_window(self, st: DraftState) -> int:
        """How far ``st``'s path may run past its committed prefix: for a request with a
        prediction, ``prediction_window`` in prediction tokens, never less than the method's
        run-ahead; without one, the method's run-ahead (:meth:`_window`)."""
        if st.prediction is None:
            return self._window(st)
        return max(self.config.prediction_window, self._window(st))

    def _propose_all(self, wants: list[tuple[DraftState, int]]) -> list[tuple[list[int], list]]:
        """Up to ``room`` drafts for each ``(st, room)`` and their rows, in order: a proposer
        that samples (``returns_draft_probs``) drafts a sampled request the way it samples
        (drafter/draft_sampling.py, rows checked one per draft); every other draft is
        deterministic (row None). A tree proposer's segments at the committed prefix are
        trees, asked for in one ``propose_trees``; the rest go to the proposer in one
        ``propose_many``."""
        p = self.proposer
        out: list[tuple[list[int], list] | None] = [None] * len(wants)
        calls, where, tree_calls, tree_where = [], [], [], []
        for j, (st, room) in enumerate(wants):
            how = None
            # sampled requests, and greedy ones with penalties or token constraints, are
            # drafted from the distribution the verifier verifies them against
            # a proposer that scores greedy drafts (returns_token_probs) drafts them here too,
            # for their q (DraftTailStream.draft_token_probs; the drafts are the same)
            greedy = st.sampling is not None and sampling_mode(st.sampling) == GREEDY
            if st.sampling is not None and (
                    (p.returns_draft_probs and (not greedy or st.sampling.has_logits_processors))
                    or (greedy and p.returns_token_probs)):
                how = DraftSampling(st.sampling, len(st.committed) + len(st.path),
                                    self._generator(), self.config.draft_probs,
                                    st.prompt_token_ids, st.committed + st.path,
                                    token_probs=p.returns_token_probs)
            if self._tree_segment(st):  # the segment at the committed prefix: a tree
                tree_calls.append(ProposeCall(st.request_id, st.context, room, how))
                tree_where.append(j)
                continue
            calls.append(ProposeCall(st.request_id, st.context, room, how))
            where.append(j)
        if tree_calls:
            for j, call, tree in zip(tree_where, tree_calls, p.propose_trees(tree_calls)):
                out[j] = self._take_tree(wants[j][0], call, *tree)
        if calls:
            for j, call, (new, rows) in zip(where, calls, p.propose_many(calls)):
                keep = call.how is not None or p.returns_draft_confidences
                rows = list(rows) if keep else [None] * len(new)
                if len(rows) != len(new):
                    raise ValueError(f"{type(p).__name__} returned {len(rows)} rows for "
                                     f"{len(new)} drafts")
                out[j] = (list(new), rows)
        return out  # type: ignore[return-value]

    def _take_tree(self, st: DraftState, call: ProposeCall, tokens: list[int],
                   parents: list[int], rows: list) -> tuple[list[int], list]:
        """A proposer's tree for ``st``: its branch 0 becomes the path (returned with its
        rows), the whole tree is kept for the next segment when it branches (rows: a sampled
        tree's, each node's distribution, else None)."""
        rows = list(rows) if call.how is not None else [None] * len(tokens)
        if len(rows) != len(tokens):
            raise ValueError(f"{type(self.proposer).__name__} returned {len(rows)} rows for a "
                             f"tree of {len(tokens)} nodes")
        branch0 = first_branch(list(range(len(tokens))), parents)
        if len(branch0) < len(tokens):
            st.tree = (list(tokens), list(parents), rows)
            self.profile.count("tree_segments")
            self.profile.count("tree_nodes", len(tokens))
        return [tokens[i] for i in branch0], [rows[i] for i in branch0]

    def _generator(self) -> torch.Generator:
        """The drafter's randomness for unseeded sampled drafts (created on first use)."""
        if self._gen is None:
            self._gen = torch.Generator()
            if self.config.seed is None:
                self._gen.seed()
            else:
                self._gen.manual_seed(self.config.seed)
        return self._gen

    @staticmethod
    def _probs_buffer(rows: list) -> Buffer | None:
        """DraftTailStream.draft_probs of a segment: float32 [n, vocab_size] when every draft
        has its row, else None (the verifier then treats the drafts as one-hot, which stays
        exact, docs/architecture.md, 'Exactness')."""
        if not rows or not all(isinstance(r, torch.Tensor) for r in rows):
            return None
        return tensor_to_buffer(torch.stack(rows).to(torch.float32))

    def _has_work(self) -> bool:
        """Some path may still grow: below its own run-ahead cap (:meth:`_window`, which the
        verifier's ``num_drafts_wanted`` can set below the window; :meth:`_prediction_window`
        for a request with a prediction) and not exhausted."""
        return any(not s.exhausted and len(s.path) < self._prediction_window(s)
                   for s in self.requests.values())

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


def _runs(flags: list[bool], start: int, end: int) -> list[tuple[int, int, bool]]:
    """``flags[start:end]`` as maximal runs ``(first, last + 1, flag)`` of equal flags; one
    empty run at ``start`` when the range is empty."""
    if start >= end:
        return [(start, start, False)]
    out = []
    a = start
    for i in range(start + 1, end + 1):
        if i == end or flags[i] != flags[a]:
            out.append((a, i, flags[a]))
            a = i
    return out


def _token_probs(rows: list | None) -> list[float]:
    """DraftTailStream.draft_token_probs of a segment: each draft's probability when every
    draft of it came with one (a float in place of its row: greedy drafts of a proposer that
    scores them), else none."""
    if not rows or not all(isinstance(r, float) for r in rows):
        return []
    return [min(max(r, 0.0), 1.0) for r in rows]
