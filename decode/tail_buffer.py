"""Per-request buffer of draft tokens streamed ahead by the drafter
(docs/architecture.md, 'Draft tails and staleness').

Tokens decide staleness: a tail token is usable only if every tail token before it, and every
tail token at an already committed output position, equals what the verifier committed there.
The buffer always starts right after the committed prefix (output position ``committed_len``).

A segment also continues the drafter's path at positions ``[base_committed_len, start_pos)``
(tokens it sent in earlier segments, not repeated in this one): it is usable only if the
verifier knows that path and it agrees with every commit. The buffer keeps the stretch of the
drafter's path it has seen and found consistent, ``[origin, path_end)``: a commit that
disagrees with the path ends it at the disagreement, a segment drafted fresh from the drafter's
committed prefix (``start_pos == base_committed_len``) starts a new one. A segment whose path
reaches outside that stretch was drafted on a prefix the verifier rejected (stale) or never saw
(a gap), and is dropped whole, even when its ``start_pos`` equals the committed length.

Each buffered token keeps the probability row it was drafted from (DraftTailStream.draft_probs,
any row object; None for a one-hot draft): rows are cut, replaced and committed with their
tokens. A duplicate token keeps its row (it was drafted on the same prefix), or takes the new
one when it had none and was not copied from the prediction.

Each buffered token also keeps whether it was copied from the request's prediction
(DraftTailStream.from_prediction, OpenAI Predicted Outputs), cut, replaced and committed with
it like its row; a duplicate keeps its flag. Such a token never takes a row: it was proposed
deterministically, and judging it against a distribution it was not drawn from would not be
exact.

Token trees (DraftTailStream.parents, tree verification): a tree segment is usable only when
it was drafted on the verifier's current committed prefix (``start_pos ==
base_committed_len == committed_len``); otherwise it is stale and dropped whole. Its branch 0
(from the root, always the first child: the drafter's own path) also goes through :meth:`add`
as a chain, so the drafter's later chain segments continue it as before. A commit keeps the
tree only when the committed tokens follow a path in it, and then keeps the subtree below that
path (re-rooted at the new committed length); any other commit drops it. A sampled tree
(EAGLE-2's, drafter/eagle/sampled_tree.py) carries a draft-probability row per node, kept with
its node (branch 0's rows go through :meth:`add` with its tokens); other trees carry none
(one-hot drafts). Chains without a tree behave exactly as before.

Branches (DraftBranches, the speculation cache of SSD / Saguaro, arXiv 2603.03251): drafts the
drafter prepared for outcomes other than its path, keyed by output position and candidate
token. They are kept only when they hang on the stretch of the drafter's path the buffer holds
consistent. A commit that follows the path up to a branch position and commits a candidate
there makes that candidate's continuation the tail at once (a new path, as if a segment drafted
on the new committed prefix had arrived); any other change of the path drops the branches past
it, and every commit drops those it passed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specmesh.decode.draft_tree import DraftTree, is_chain


@dataclass
class TailStats:
    """Counters of one buffer (tokens, not segments, unless named ``num_*_segments``)."""

    num_received_tokens: int = 0
    num_stale_tokens: int = 0  # discarded because they disagreed with a commit
    num_gap_segments: int = 0  # segments dropped because they left a hole after the tail
    num_duplicate_tokens: int = 0  # already buffered or already committed, and equal
    num_replaced_tokens: int = 0  # buffered tokens superseded by a newer, different segment
    num_branch_candidates: int = 0  # DraftBranches candidates kept
    num_branch_hits: int = 0  # commits whose outcome a kept branch had prepared


class TailBuffer:
    """Draft tokens at output positions ``[committed_len, committed_len + len(tokens))``."""

    def __init__(self, committed_len: int = 0) -> None:
        self.start = committed_len
        self.tokens: list[int] = []
        self.probs: list[object | None] = []  # one draft-probability row per token (or None)
        self.predicted: list[bool] = []  # per token: copied from the request's prediction
        self.stats = TailStats()
        self.origin = committed_len  # the drafter's path is known and consistent on
        self.path_end = committed_len  # [origin, path_end)
        self._rejected = False  # path_end is where a commit disagreed with the path
        self.tree: DraftTree | None = None  # a draft tree rooted at the committed prefix
        #: output position -> {candidate token: drafts after it} (DraftBranches)
        self.branches: dict[int, dict[int, list[int]]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def end(self) -> int:
        """Output position one past the last buffered draft token."""
        return self.start + len(self.tokens)

    def reset(self, committed_len: int) -> None:
        """Forget every buffered token and the drafter's path (e.g. after a DraftSync
        re-open): only a segment drafted fresh from a committed prefix is usable next."""
        self.start = committed_len
        self.tokens.clear()
        self.probs.clear()
        self.predicted.clear()
        self.origin = self.path_end = committed_len
        self._rejected = False
        self.tree = None
        self.branches.clear()

    def add_branches(self, position: int, token_ids: list[int], continuations: list[list[int]],
                     committed: list[int], *, base_committed_len: int) -> int:
        """Keep a DraftBranches message's continuations (see the module doc): only when
        ``position`` is not committed yet and the drafter's path up to it is its committed
        prefix (``position == base_committed_len``) or the stretch the buffer holds consistent
        (``base_committed_len >= origin``, ``position <= path_end``), and no buffered path
        token at ``position`` is a candidate. Returns the candidates kept (0:
        stale, the message is dropped whole).

        Raises:
            ValueError: ``position < base_committed_len``, or continuations that are not one
                non-empty list per candidate.
        """
        if position < base_committed_len or len(continuations) != len(token_ids) \
                or any(not c for c in continuations):
            raise ValueError(f"bad branches: position {position}, base_committed_len "
                             f"{base_committed_len}, {len(token_ids)} candidates, "
                             f"{len(continuations)} continuations")
        if self.start != len(committed):
            self.reset(len(committed))
        on_path = position == base_committed_len or (  # at the drafter's committed prefix
            base_committed_len >= self.origin and position <= self.path_end)
        own = self.tokens[position - self.start] if self.start <= position < self.end else None
        if not on_path or position < self.start or own in token_ids:
            self.stats.num_stale_tokens += sum(len(c) for c in continuations)
            return 0
        kept = self.branches.setdefault(position, {})
        for tok, cont in zip(token_ids, continuations):
            kept[int(tok)] = [int(t) for t in cont]
        self.stats.num_branch_candidates += len(token_ids)
        return len(token_ids)

    def _drop_branches_after(self, pos: int) -> None:
        """The path changed at output position ``pos``: branches hung past it are stale."""
        for p in [p for p in self.branches if p > pos]:
            del self.branches[p]

    def add_tree(self, start_pos: int, draft_token_ids: list[int], parents: list[int],
                 committed: list[int], *, base_committed_len: int,
                 draft_probs: Sequence[object] | None = None) -> int:
        """Merge a tree segment (see the module doc): its branch 0 as a chain through
        :meth:`add` (with its rows), the whole tree kept when it hangs below the committed
        prefix; ``draft_probs``: one row per node (e.g. a ``[n, vocab_size]`` tensor) or
        None. Returns the tree nodes kept (0 when stale).

        Raises:
            ValueError: as :meth:`add`, or parents of the wrong length or not pointing to an
                earlier node, or rows that are not one per node.
        """
        rows = None if draft_probs is None else list(draft_probs)
        tree = DraftTree.from_segment(list(draft_token_ids), list(parents), rows)
        branch0 = tree.first_path()
        b0_rows = None
        if rows is not None:
            b0_rows, node = [], -1
            for tok in branch0:
                node = tree.child(node, tok)
                b0_rows.append(tree.rows[node])
        self.add(start_pos, branch0, committed, base_committed_len=base_committed_len,
                 draft_probs=b0_rows)
        self.stats.num_received_tokens += len(draft_token_ids) - len(branch0)
        if not start_pos == base_committed_len == len(committed):
            self.stats.num_stale_tokens += len(draft_token_ids)
            return 0
        self.tree = tree
        return len(tree)

    def usable_tree(self, max_depth: int, max_nodes: int) -> tuple[list[int], list[int]] | None:
        """``(draft_token_ids, parents)`` of the tree to verify next (the chain tail first,
        then the tree's other nodes; depth ``<= max_depth``, at most ``max_nodes`` nodes), or
        None without a tree or when the result is a plain chain."""
        planned = self.usable_tree_rows(max_depth, max_nodes)
        return None if planned is None else (planned[0], planned[1])

    def usable_tree_rows(self, max_depth: int, max_nodes: int,
                         ) -> tuple[list[int], list[int], list[object | None]] | None:
        """:meth:`usable_tree` with each node's row (the chain tail's own, the tree's for the
        other nodes; None: one-hot)."""
        if self.tree is None:
            return None
        chain = self.usable(max_depth)
        out = self.tree.plan_tree(chain, self.usable_probs(len(chain)), max_depth, max_nodes)
        if is_chain(out.parents):
            return None
        return list(out.tokens), list(out.parents), list(out.rows)

    def add(self, start_pos: int, draft_token_ids: list[int], committed: list[int], *,
            base_committed_len: int, draft_probs: Sequence[object] | None = None,
            from_prediction: bool = False) -> int:
        """Merge a DraftTailStream segment; ``committed`` is the full committed output and
        ``base_committed_len`` the drafter's committed length when it drafted the segment;
        ``draft_probs``: one row per token (e.g. a ``[n, vocab_size]`` tensor) or None;
        ``from_prediction``: its tokens were copied from the request's prediction.

        Returns the number of new tokens appended. A segment whose path before ``start_pos``
        the verifier rejected (or never saw) is stale (or a gap) and dropped whole; one that
        disagrees with a committed token is stale from that token on; one that starts past the
        buffered end is a gap and is dropped whole; a part that overlaps the buffer and
        disagrees replaces the buffer from the first difference (the drafter changed its path).

        Raises:
            ValueError: a negative position, ``start_pos < base_committed_len`` (decoding
                refuses both: only a local caller can pass them), ``draft_probs`` whose
                row count is not the token count, or ``draft_probs`` with ``from_prediction``.
        """
        if from_prediction and draft_probs is not None:
            raise ValueError("prediction drafts with draft_probs (they are verified one-hot)")
        rows = [None] * len(draft_token_ids) if draft_probs is None else list(draft_probs)
        if len(rows) != len(draft_token_ids):
            raise ValueError(f"{len(rows)} draft_probs rows for {len(draft_token_ids)} tokens")
        if start_pos < 0 or base_committed_len < 0 or start_pos < base_committed_len:
            raise ValueError(f"bad segment positions: start_pos {start_pos}, "
                             f"base_committed_len {base_committed_len}")
        self.stats.num_received_tokens += len(draft_token_ids)
        committed_len = len(committed)
        if self.start != committed_len:  # commits always go through on_commit first
            self.reset(committed_len)
        if start_pos == base_committed_len:  # drafted fresh from a committed prefix: a new path
            self.origin = self.path_end = start_pos
            self._rejected = False
        elif base_committed_len < self.origin or start_pos > self.path_end:
            # continues a path the verifier rejected, replaced or never saw
            if base_committed_len < self.origin or self._rejected:
                self.stats.num_stale_tokens += len(draft_token_ids)
            else:
                self.stats.num_gap_segments += 1
            return 0
        toks = draft_token_ids
        pos = start_pos
        # Part of the segment that lies inside the committed prefix must equal it.
        while toks and pos < committed_len:
            if toks[0] != committed[pos]:
                self.stats.num_stale_tokens += len(toks)
                self._cut_path(pos)
                return 0
            self.stats.num_duplicate_tokens += 1
            toks, rows = toks[1:], rows[1:]
            pos += 1
        self.path_end = max(self.path_end, pos)
        if not toks:
            return 0
        if pos > self.end:
            self.stats.num_gap_segments += 1
            return 0
        # Overlap with the buffered tail.
        i = pos - self.start
        while toks and i < len(self.tokens):
            if toks[0] != self.tokens[i]:
                self.stats.num_replaced_tokens += len(self.tokens) - i
                del self.tokens[i:]
                del self.probs[i:]
                del self.predicted[i:]
                self._drop_branches_after(self.start + i)
                break
            self.stats.num_duplicate_tokens += 1
            if self.probs[i] is None and not self.predicted[i]:
                self.probs[i] = rows[0]
            toks, rows = toks[1:], rows[1:]
            i += 1
        self.tokens.extend(toks)
        self.probs.extend(rows)
        self.predicted.extend([from_prediction] * len(toks))
        self.path_end = max(self.end, committed_len)
        return len(toks)

    def _cut_path(self, pos: int) -> None:
        """The drafter's path disagrees with the commit at ``pos``: nothing drafted after it
        is usable."""
        self.path_end = min(self.path_end, pos)
        self._rejected = True
        self._drop_branches_after(pos)

    def on_commit(self, committed: list[int]) -> None:
        """Advance past newly committed tokens; on the first disagreement drop the whole tail
        (and remember that the drafter's path is wrong from there on). A tree is kept (its
        subtree below the committed tokens) only when they follow a path in it."""
        new_len = len(committed)
        if self.tree is not None and new_len > self.start:
            node = self.tree.follow(committed[self.start:new_len])
            self.tree = None if node is None else self.tree.subtree(node) or None
        n = min(new_len - self.start, len(self.tokens))
        i = self._agreeing(committed, 0, n)
        if self.branches and self._take_branch(committed, i):
            n = min(new_len - self.start, len(self.tokens))
            i = self._agreeing(committed, i + 1, n)  # the branch's token agrees by its key
        if i < n:
            self.stats.num_stale_tokens += len(self.tokens) - i
            self._cut_path(self.start + i)
            self.start = new_len
            self.tokens.clear()
            self.probs.clear()
            self.predicted.clear()
            return
        del self.tokens[: max(new_len - self.start, 0)]
        del self.probs[: max(new_len - self.start, 0)]
        del self.predicted[: max(new_len - self.start, 0)]
        self.start = new_len

    def _agreeing(self, committed: list[int], i: int, n: int) -> int:
        """The first buffered index from ``i`` (below ``n``) whose token differs from the
        committed one at its position; ``n`` when none does."""
        while i < n and self.tokens[i] == committed[self.start + i]:
            i += 1
        return i

    def _take_branch(self, committed: list[int], i: int) -> bool:
        """Before a commit is applied, ``i`` the buffered index where it first leaves the path
        (or the path's end): a kept branch for the committed token there becomes the path
        (that token, then its continuation); returns whether one did. Branches the commit
        passed are dropped."""
        new_len = len(committed)
        q = self.start + i
        cont = self.branches.get(q, {}).get(committed[q]) if q < new_len else None
        if cont is not None:
            self.stats.num_branch_hits += 1
            del self.tokens[i:]
            del self.probs[i:]
            del self.predicted[i:]
            self.tokens += [committed[q], *cont]
            self.probs += [None] * (1 + len(cont))
            self.predicted += [False] * (1 + len(cont))
            self.origin, self.path_end, self._rejected = new_len, self.end, False
            self.branches.clear()
            return True
        for p in [p for p in self.branches if p < new_len]:
            del self.branches[p]
        return False

    def usable(self, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` drafts for the next verify step (positions from committed_len)."""
        return self.tokens[: max(max_tokens, 0)]

    def usable_probs(self, max_tokens: int) -> list[object | None]:
        """The draft-probability rows of :meth:`usable`'s tokens (None: a one-hot draft)."""
        return self.probs[: max(max_tokens, 0)]

    def usable_predicted(self, max_tokens: int) -> list[bool]:
        """Per token of :meth:`usable`: whether it was copied from the request's prediction."""
        return self.predicted[: max(max_tokens, 0)]
