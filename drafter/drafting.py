"""The drafting half of the drafter worker (drafter/worker.py, which handles the messages):
each request's path extended towards its window, by its prediction or by the method, and
streamed as DraftTailStream segments; branches prepared once every path is full.

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

import time

import torch

from specmesh.drafter.branches import MAX_BRANCH_REQUESTS, kept_candidates, plan_branches
from specmesh.drafter.config import RUN_AHEAD_STEPS
from specmesh.drafter.draft_sampling import DraftSampling
from specmesh.drafter.draft_state import DraftState
from specmesh.drafter.head_confidences import split_confidences
from specmesh.drafter.prediction import output_tail
from specmesh.drafter.proposer import ProposeCall, Proposer
from specmesh.engine.frames import tensor_to_buffer
from specmesh.engine.sampling import GREEDY, sampling_mode
from specmesh.engine.token_tree import first_branch
from specmesh.protocol.messages import Buffer, DraftBranches, DraftTailStream


class Drafting:
    """A mixin of :class:`drafter.worker.DrafterWorker` (its ``requests``, ``proposer``,
    ``config``, ``profile``, ``stats``, ``send``, ``_gen`` and ``_branches_pending``)."""

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
