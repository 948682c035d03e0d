"""A request's draft token tree on the verifier (tree verification, SpecInfer arXiv
2305.09781): a trie of draft tokens hanging below the last committed token, with nodes
numbered so that a parent comes before its children (``parents[j] < j``, -1 = the root), the
numbering of DraftTailStream.parents, engine/token_tree.py and kernels/tree_layout.py.

Siblings never share a token (a trie), so a verified path is unambiguous. Each node may keep
the draft-probability row it was drawn from (DraftTailStream.draft_probs of a sampled tree,
any row object; None: one-hot), carried through :meth:`DraftTree.subtree` and
:meth:`DraftTree.plan` with its node; siblings keep their order (the tree rule judges them in
it, each against the residual its earlier siblings left). Pure Python (the scheduler imports
no torch; engine/token_tree.py has the forward's side of trees).
"""

from __future__ import annotations


class DraftTree:
    """Draft tokens ``tokens[j]`` with parents ``parents[j]`` (-1: the root) and rows
    ``rows[j]`` (None: one-hot)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.rows: list[object | None] = []
        self._children: dict[tuple[int, int], int] = {}  # (parent, token) -> node

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_segment(cls, tokens: list[int], parents: list[int],
                     rows: list[object | None] | None = None) -> DraftTree:
        """The trie of a DraftTailStream tree (duplicate siblings merged, order kept; a
        duplicate keeps the first one's row), with ``rows`` one per token (None: none).

        Raises:
            ValueError: lengths differ or a parent does not point to an earlier node.
        """
        if len(tokens) != len(parents):
            raise ValueError(f"{len(parents)} parents for {len(tokens)} tree tokens")
        rows = [None] * len(tokens) if rows is None else list(rows)
        if len(rows) != len(tokens):
            raise ValueError(f"{len(rows)} draft_probs rows for {len(tokens)} tree tokens")
        tree = cls()
        where: list[int] = []  # segment node -> trie node
        for j, (tok, p) in enumerate(zip(tokens, parents)):
            if not -1 <= p < j:
                raise ValueError(f"tree node {j} has parent {p}; need -1 <= parent < {j}")
            where.append(tree.add(-1 if p < 0 else where[p], tok, rows[j]))
        return tree

    def child(self, parent: int, token: int) -> int | None:
        """The child of ``parent`` (-1: root) holding ``token``, or None."""
        return self._children.get((parent, token))

    def add(self, parent: int, token: int, row: object | None = None) -> int:
        """Node index of ``token`` below ``parent`` (added when new, with ``row``; an existing
        node keeps its own)."""
        node = self._children.get((parent, token))
        if node is None:
            node = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
            self.rows.append(row)
            self._children[(parent, token)] = node
        return node

    def first_path(self) -> list[int]:
        """Tokens of branch 0: from the root, always the lowest-numbered child (the
        drafter's first, e.g. most recent, continuation)."""
        first: dict[int, int] = {}
        for j, p in enumerate(self.parents):
            first.setdefault(p, j)
        out, node = [], first.get(-1)
        while node is not None:
            out.append(self.tokens[node])
            node = first.get(node)
        return out

    def follow(self, tokens: list[int]) -> int | None:
        """The node reached from the root along ``tokens`` (-1 for none), or None when they
        leave the tree."""
        node = -1
        for tok in tokens:
            node = self.child(node, tok)
            if node is None:
                return None
        return node

    def subtree(self, node: int) -> DraftTree:
        """The nodes below ``node`` as a tree of their own (``node`` becomes the root)."""
        out = DraftTree()
        where = {node: -1}
        for j, p in enumerate(self.parents):
            if p in where and j not in where:
                where[j] = out.add(where[p], self.tokens[j], self.rows[j])
        return out

    def depths(self) -> list[int]:
        """Depth of each node (1: a child of the root)."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    def plan(self, chain: list[int], max_depth: int, max_nodes: int,
             ) -> tuple[list[int], list[int]]:
        """The nodes to verify: ``chain`` (the buffered chain tail, the drafter's own path)
        first, then the tree's other nodes in index order, each at depth ``<= max_depth``, at
        most ``max_nodes`` in all. Returns ``(tokens, parents)`` renumbered (parents first)."""
        out = self.plan_tree(chain, None, max_depth, max_nodes)
        return list(out.tokens), list(out.parents)

    def plan_tree(self, chain: list[int], chain_rows: list[object | None] | None,
                  max_depth: int, max_nodes: int) -> DraftTree:
        """:meth:`plan` as a tree that keeps the rows: the chain's ``chain_rows`` (one per
        chain token; None: none), the tree's own for its other nodes. Nodes are dropped only
        by depth and by index order once ``max_nodes`` are in, so every sibling group keeps
        a prefix of its order."""
        out = DraftTree()
        if max_depth < 1 or max_nodes < 1:
            return out
        rows = [None] * len(chain) if chain_rows is None else list(chain_rows)
        node = -1
        for tok, row in zip(chain[:min(max_depth, max_nodes)], rows):
            node = out.add(node, tok, row)
        where: dict[int, int] = {-1: -1}
        for j, (tok, p, d) in enumerate(zip(self.tokens, self.parents, self.depths())):
            if d > max_depth or p not in where:
                continue
            if out.child(where[p], tok) is None and len(out) >= max_nodes:
                continue
            where[j] = out.add(where[p], tok, self.rows[j])
        return out


def is_chain(parents: list[int]) -> bool:
    """Whether ``parents`` is the chain ``[-1, 0, 1, ...]``."""
    return all(p == j - 1 for j, p in enumerate(parents))
