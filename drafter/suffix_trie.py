"""A counted suffix trie of bounded depth over token sequences: the index suffix decoding drafts
from (SuffixDecoding, Oliaro et al., arXiv 2411.04975; ArcticInference's
``csrc/suffix_decoding/suffix_tree.cc``). Pure Python, no torch.

What it answers: for every token string ``w`` of at most ``depth`` tokens found in the
sequences it holds, how often ``w`` occurs (each start position of each sequence counts once)
and which tokens followed those occurrences, how often each: the frequencies suffix decoding
scores its drafts with. Sequences grow (:meth:`SuffixTrie.extend`), shrink from the end
(:meth:`SuffixTrie.truncate`: a rolled-back draft) and leave whole (:meth:`SuffixTrie.discard`).

Structure: conceptually the trie of every substring of at most ``depth`` tokens, each node
counting its string's occurrences. It is stored with *leaf compression*: a node whose string
occurs once keeps no children; its one occurrence (the sequence and the index of the string's
last token) stands for the chain of count-1 nodes below it, read from the sequence when asked.
A second occurrence expands such a leaf by one level. So the trie keeps a node per string that
occurs at least twice plus a leaf per point where occurrences part, instead of ``depth`` nodes
per token.

Why this structure (per-step cost independent of the sequences' lengths): each growing
sequence keeps its *active points* (Ukkonen's, bounded in depth as ArcticInference's
``SuffixTree::append`` keeps them): a cursor per suffix of at most ``depth`` tokens ending at
its last token. Appending a token moves each one step down, counting or creating one node:
O(depth) per token. Removing the last token moves them back up, plus one walk of ``depth``
steps for the longest: O(depth) per token. Matching a pattern walks at most its length. The
suffixes of a growing sequence are its active points, so matching its own end costs nothing.
Removing a whole sequence walks down from each of its start positions until a count reaches 0:
O(length x depth) at most, paid once, in steps a caller may interleave with queries
(:meth:`SuffixTrie.discard_steps`). ArcticInference compresses every unary path (a suffix tree
proper); leaf compression keeps appending, removing the last token and removing a sequence
simple enough to be checked against a brute-force count (tests/drafter/test_suffix_trie.py),
and its node count stays within a small factor of it on text.

Cursors (:data:`Cursor`): a position in the trie, ``(node, k)``: the node's string followed by
the ``k`` tokens after its one occurrence (``k`` > 0 only below a leaf). They stay valid until
the trie changes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

#: a position in a trie (module docstring): ``(node, k)``, opaque to callers
Cursor = tuple[Any, int]


class _Node:
    """One trie node: its string is its parent's plus ``token``, ``depth`` tokens long, and
    occurs ``count`` times. ``kids`` (token -> node) once expanded; None for a leaf, whose one
    occurrence ends at ``seq[end]``. ``best``: the child with most occurrences, latest first
    among equals (a cache, None when unknown); ``stamp``: the trie's clock at the latest
    occurrence counted here."""

    __slots__ = ("count", "kids", "parent", "token", "depth", "seq", "end", "best", "stamp")

    def __init__(self, parent: _Node | None, token: int, depth: int, seq: list[int] | None,
                 end: int, stamp: int) -> None:
        self.count = 1
        self.kids: dict[int, _Node] | None = None
        self.parent = parent
        self.token = token
        self.depth = depth
        self.seq = seq
        self.end = end
        self.best: _Node | None = None
        self.stamp = stamp


def _rank(node: _Node) -> tuple[int, int]:
    return node.count, node.stamp


class SuffixTrie:
    """Occurrence counts of every token string of at most ``depth`` tokens over a set of
    sequences, each under a hashable key (module docstring). Not thread-safe: a caller that
    shares one across threads locks around it.

    ``undo``: for how many of a sequence's latest tokens :meth:`truncate` also restores which
    follower was seen latest (the tie-break among equally frequent followers), so that
    appending tokens and truncating them away leaves no trace at all; counts are always
    restored exactly. 0: none kept (sequences that are never truncated).

    Raises:
        ValueError: ``depth`` < 1 or ``undo`` < 0.
    """

    def __init__(self, depth: int, undo: int = 0) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if undo < 0:
            raise ValueError(f"undo must be >= 0, got {undo}")
        self.depth = depth
        self.undo = undo
        #: key -> per appended token (the latest ``undo``), the stamps it overwrote
        self._undo: dict[Hashable, deque[list[tuple[_Node, int]]]] = {}
        self._root = _Node(None, -1, 0, None, -1, 0)
        self._root.kids = {}
        self._root.count = 0
        self._seqs: dict[Hashable, list[int]] = {}
        #: key -> active points of the sequence, longest suffix first
        self._active: dict[Hashable, list[Cursor]] = {}
        self._clock = 0
        #: tokens of every sequence held
        self.num_tokens = 0

    # -- sequences -------------------------------------------------------------------------

    def __contains__(self, key: Hashable) -> bool:
        return key in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def keys(self) -> list[Hashable]:
        """The keys of the sequences held, oldest first."""
        return list(self._seqs)

    def tokens(self, key: Hashable) -> Sequence[int]:
        """The tokens of sequence ``key`` (the trie's own list: read, never modify).

        Raises:
            KeyError: no such sequence.
        """
        return self._seqs[key]

    def extend(self, key: Hashable, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to sequence ``key`` (a new key starts an empty one first):
        O(depth) per token."""
        seq = self._seqs.get(key)
        if seq is None:
            seq = self._seqs[key] = []
            self._active[key] = []
            if self.undo:
                self._undo[key] = deque(maxlen=self.undo)
        active = self._active[key]
        log = self._undo.get(key)
        for tok in tokens:
            active = self._append(seq, active, tok, log)
        self._active[key] = active

    def truncate(self, key: Hashable, length: int) -> None:
        """Cut sequence ``key`` to its first ``length`` tokens (no-op when it is not longer):
        O(depth) per token removed.

        Raises:
            KeyError: no such sequence.
            ValueError: ``length`` < 0.
        """
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        seq = self._seqs[key]
        while len(seq) > length:
            self._pop(key, seq)

    def discard(self, key: Hashable) -> int:
        """Remove sequence ``key`` and every count it added; returns its length (0 when the
        trie does not hold it)."""
        n = len(self._seqs.get(key, ()))
        for _ in self.discard_steps(key):
            pass
        return n

    def discard_steps(self, key: Hashable, starts_per_step: int = 1024) -> Iterator[int]:
        """Remove sequence ``key`` in steps: the generator removes the counts of
        ``starts_per_step`` start positions per step and yields the tokens still to go, so a
        caller can release its lock between steps (between two steps the trie is consistent:
        it holds the sequence's suffixes not yet removed). The key is gone from the first
        step; nothing happens for a key the trie does not hold."""
        seq = self._seqs.pop(key, None)
        if seq is None:
            return
        del self._active[key]
        self._undo.pop(key, None)
        n, depth, root = len(seq), self.depth, self._root
        for a in range(0, n, max(starts_per_step, 1)):
            b = min(a + max(starts_per_step, 1), n)
            for j in range(a, b):
                node = root
                for idx in range(j, min(j + depth, n)):
                    child = node.kids[seq[idx]]
                    child.count -= 1
                    if node.best is child:
                        node.best = None
                    if child.count == 0:
                        del node.kids[child.token]
                        break
                    node = child
            root.count -= b - a
            self.num_tokens -= b - a
            yield n - b

    # -- queries ---------------------------------------------------------------------------

    def find(self, pattern: Sequence[int]) -> Cursor | None:
        """The cursor of ``pattern`` (at most ``depth`` tokens; the empty pattern is the
        root), or None when it does not occur. O(len(pattern))."""
        if len(pattern) > self.depth:
            return None
        node, k = self._root, 0
        for tok in pattern:
            if node.kids is None:
                nxt = node.end + k + 1
                if nxt >= len(node.seq) or node.seq[nxt] != tok:
                    return None
                k += 1
            else:
                node = node.kids.get(tok)
                if node is None:
                    return None
        return node, k

    def suffixes(self, key: Hashable) -> list[Cursor]:
        """The cursors of sequence ``key``'s suffixes of 1, 2, ... up to ``depth`` tokens (or
        its length), shortest first: its active points, at no cost.

        Raises:
            KeyError: no such sequence.
        """
        seq = self._seqs[key]
        active = self._active[key]
        for i, (node, k) in enumerate(active):
            if k and node.kids is not None:
                active[i] = self._resolve(node, k, seq, len(seq))
        return active[::-1]

    @staticmethod
    def count(cursor: Cursor) -> int:
        """Occurrences of the cursor's string."""
        node, k = cursor
        return 1 if k else node.count

    @staticmethod
    def depth_of(cursor: Cursor) -> int:
        """Tokens in the cursor's string."""
        node, k = cursor
        return node.depth + k

    def top_child(self, cursor: Cursor) -> tuple[int, Cursor, int] | None:
        """``(token, cursor, count)`` of the token that most often followed the cursor's
        string (the latest among equals), or None when nothing followed it (or it is
        ``depth`` long). O(1), or O(children) once after that child lost an occurrence."""
        node, k = cursor
        if node.depth + k >= self.depth:
            return None
        if node.kids is None:
            nxt = node.end + k + 1
            return (node.seq[nxt], (node, k + 1), 1) if nxt < len(node.seq) else None
        best = node.best
        if best is None:
            if not node.kids:
                return None
            best = node.best = max(node.kids.values(), key=_rank)
        return best.token, (best, 0), best.count

    def children(self, cursor: Cursor, min_count: int = 1) -> list[tuple[int, Cursor, int]]:
        """``(token, cursor, count)`` of every token that followed the cursor's string at
        least ``min_count`` times, most frequent first (the latest among equals).
        O(children)."""
        node, k = cursor
        if node.depth + k >= self.depth:
            return []
        if node.kids is None:
            top = self.top_child(cursor)
            return [top] if top is not None and min_count <= 1 else []
        kids = [c for c in node.kids.values() if c.count >= min_count]
        kids.sort(key=_rank, reverse=True)
        return [(c.token, (c, 0), c.count) for c in kids]

    # -- internals -------------------------------------------------------------------------

    @staticmethod
    def _resolve(node: _Node, k: int, seq: list[int], n: int) -> Cursor:
        """An active point ``(node, k)`` of ``seq[:n]`` whose leaf was expanded since, moved
        down to the node that now holds it (its string's next token is ``seq[n - k]``)."""
        while k and node.kids is not None:
            node = node.kids[seq[n - k]]
            k -= 1
        return node, k

    def _append(self, seq: list[int], active: list[Cursor], tok: int,
                log: deque | None) -> list[Cursor]:
        """Append ``tok`` to ``seq`` (active points ``active``; ``log``: its undo log, or
        None); returns the new active points. Longest suffix first: a leaf a shorter suffix
        expands may hold a longer suffix's occurrence, which the longer one has already passed
        as a virtual step."""
        n = len(seq)
        seq.append(tok)
        self._clock += 1
        clock = self._clock
        depth = self.depth
        stamps: list[tuple[_Node, int]] | None = [] if log is not None else None
        out: list[Cursor] = []
        for node, k in active:
            if k and node.kids is not None:
                node, k = self._resolve(node, k, seq, n)
            if node.depth + k >= depth:
                continue  # the suffix is `depth` long: it cannot grow
            if node.kids is None:  # a leaf of this very occurrence: one virtual step down
                out.append((node, k + 1))
            else:
                out.append((self._count_child(node, tok, seq, n, clock, stamps), 0))
        out.append((self._count_child(self._root, tok, seq, n, clock, stamps), 0))
        self._root.count += 1
        self.num_tokens += 1
        if log is not None:
            log.append(stamps)
        return out

    def _count_child(self, node: _Node, tok: int, seq: list[int], end: int, clock: int,
                     stamps: list | None) -> _Node:
        """Count one more occurrence of ``node``'s string + ``tok`` ending at ``seq[end]``
        (the stamp it overwrites goes to ``stamps`` when not None)."""
        child = node.kids.get(tok)
        if child is None:
            child = node.kids[tok] = _Node(node, tok, node.depth + 1, seq, end, clock)
        else:
            if child.kids is None:
                self._expand(child)
            child.count += 1
            if stamps is not None:
                stamps.append((child, child.stamp))
            child.stamp = clock
        best = node.best
        if best is not None and best is not child and child.count >= best.count:
            node.best = child
        return child

    def _expand(self, leaf: _Node) -> None:
        """Give a leaf its one child (its occurrence's next token, if any, within depth)
        before a second occurrence is counted at it."""
        seq, nxt = leaf.seq, leaf.end + 1
        leaf.kids = {}
        leaf.seq = None
        if leaf.depth < self.depth and nxt < len(seq):
            tok = seq[nxt]
            leaf.best = leaf.kids[tok] = _Node(leaf, tok, leaf.depth + 1, seq, nxt, leaf.stamp)

    def _pop(self, key: Hashable, seq: list[int]) -> None:
        """Remove the last token of sequence ``key`` (``seq``) and its counts."""
        n = len(seq)
        root = self._root
        out: list[Cursor] = []
        for node, k in self._active[key]:
            if k and node.kids is not None:
                node, k = self._resolve(node, k, seq, n)
            if k:  # a virtual step below a leaf: it vanishes with the token
                out.append((node, k - 1))
                continue
            parent = node.parent
            node.count -= 1
            if node.count == 0:
                del parent.kids[node.token]
            if parent.best is node:
                parent.best = None
            if parent is not root:
                out.append((parent, 0))
        seq.pop()
        root.count -= 1
        self.num_tokens -= 1
        log = self._undo.get(key)
        if log:  # the latest occurrences before this token's, for the tie-break
            for node, stamp in log.pop():
                node.stamp = stamp
        if n > self.depth:  # the shorter sequence's suffix of `depth` tokens
            cursor = self.find(seq[n - 1 - self.depth:])
            if cursor is None:  # the trie always holds its own sequences' strings
                raise AssertionError("suffix trie lost a held string")
            out.insert(0, cursor)
        self._active[key] = out
