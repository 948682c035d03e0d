"""EAGLE-2 draft trees of requests: the tree's selection (drafter/eagle/tree.py) driven by the
head's forwards over the tree (drafter/eagle/head_tree.py), one forward per depth for every
request whose tree is drafted in the same call.

The request's head KV must end at the context's second-to-last position (the proposer's
catch-up, drafter/proposers/eagle.py), and ``root_state`` is the state its last entry predicted
(whose logits are the distribution of the first draft).

A multi-layer head (drafter/eagle/steps.py) expands the nodes of depth d with its module for
depth d + 1, over that module's KV (``TreeJob.step_kvs``): nodes run by different modules never
attend to each other (each module's entry sees its context entries and itself), nodes run by a
repeated last module attend to their ancestors run by it, as a 1-module head's tree does. Its
branch 0 does not join any KV (the proposer rebuilds the modules' context entries).

Two kinds of tree, by the request's sampling (drafter/draft_sampling.py):

- deterministic (greedy and seeded requests, and sampled ones with penalties or token
  constraints): EAGLE-2's top-k children ranked by the head's cumulative log-probabilities at
  temperature 1 (its confidence). The drafts are a function of the context and the head, so
  the verifier's tree rule is exact with them verified one-hot (rows None); greedy and seeded
  requests are walked along the target's own tokens anyway;
- sampled (unseeded sampled requests, ``DraftSampling.sends_probs``): children drawn from the
  head's distribution processed with the request's temperature, top-k, top-p and min-p, ranked
  by perturbed scores (drafter/eagle/sampled_tree.py), each node with the row it was drawn from
  so the tree rule's multi-draft rejection uses the real q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmesh.drafter.draft_sampling import DraftSampling, target_space_logits
from specmesh.drafter.eagle.head import EagleHead
from specmesh.drafter.eagle.head_kv import HeadKV
from specmesh.drafter.eagle.head_tree import TreeKV, tree_level_many
from specmesh.drafter.eagle.sampled_tree import SampledChildren, sibling_row
from specmesh.drafter.eagle.tree import (TreeNode, grow_tree_steps, select_tree, top_children,
                                         tree_arrays)
from specmesh.engine.sampling import processed_probs

#: most children per node a tree may take (``--eagle-topk``): a depth's forward has topk rows
MAX_TOPK = 16


@dataclass
class DraftedTree:
    """A drafted tree: ``token_ids`` and ``parents`` as DraftTailStream carries them,
    ``rows`` (a sampled tree's: per node the float32 ``[vocab_size]`` distribution it was
    drawn from; else None per node), ``num_forwards`` (head forwards run, one per expanded
    depth), and the part of branch 0 whose entries were run (``branch0_tokens`` each entry's
    own token, ``branch0_outs`` its predicted state ``[d]``), already appended to the
    request's head KV."""

    token_ids: list[int]
    parents: list[int]
    rows: list[torch.Tensor | None]
    num_forwards: int
    branch0_tokens: list[int]
    branch0_outs: list[torch.Tensor]


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    """float32 draft-vocabulary log-probabilities of draft logits ``[n, draft_vocab]``."""
    return torch.log_softmax(logits.float(), dim=-1)


def _sampled_probs(head: EagleHead, logits: torch.Tensor, how: DraftSampling) -> torch.Tensor:
    """float32 ``[n, vocab_size]`` target-space distributions of draft logits ``[n,
    draft_vocab]``, processed with the request's sampling (drafter/draft_sampling.py: what its
    chain drafts are drawn from)."""
    full = torch.cat([target_space_logits(row[None], head.config.vocab_size,
                                          head.draft_to_target) for row in logits.float()])
    return processed_probs(full, [how.sampling], [full.shape[0]])


def samples_tree(how: DraftSampling | None) -> bool:
    """Whether a request drafted for ``how`` gets a sampled tree with rows (module
    docstring): an unseeded sampled request without penalties or token constraints."""
    return how is not None and how.sends_probs and not how.processes


@dataclass
class TreeJob:
    """One request's tree to draft (:func:`draft_trees`): its head ``kv`` (ending at
    ``context_len - 1``), ``root_state`` ``[d]`` (the state the last entry predicted), the
    tree's ``topk``, ``depth`` and ``max_nodes``, and the sampling ``how`` (None: as a greedy
    request); ``step_kvs``: a multi-layer head's KVs of modules 1.. (each ending at
    ``context_len - 1`` where not empty)."""

    kv: HeadKV
    root_state: torch.Tensor
    context_len: int
    topk: int
    depth: int
    max_nodes: int
    how: DraftSampling | None = None
    step_kvs: tuple[HeadKV, ...] = ()


class _Growing:
    """A :class:`TreeJob` while its tree grows: its tree entries, their predicted states and
    the generator of its nodes (drafter/eagle/tree.py ``grow_tree_steps``)."""

    def __init__(self, head: EagleHead, job: TreeJob) -> None:
        kv = job.kv
        if not kv.length or kv.end != job.context_len - 1:
            raise ValueError(f"head KV holds [{kv.start}, {kv.end}); a tree after "
                             f"{job.context_len} tokens needs it to end at {job.context_len - 1}")
        self.head, self.job = head, job
        c = head.config
        kvs = (kv, *job.step_kvs)
        if len(kvs) != c.num_steps or any(k.length and k.end != job.context_len - 1
                                          for k in kvs):
            raise ValueError(f"a tree of a {c.num_steps}-module head needs its {c.num_steps} "
                             f"KVs ending at {job.context_len - 1}")
        self.tree = TreeKV(kv, kv.length)  # module 0's (the 1-module head's only one)
        self.trees = {0: self.tree}
        self.kvs = kvs
        self.entry_of: dict[int, tuple[int, int]] = {}  # node -> (module, its tree entry)
        self.states: list[torch.Tensor] = []  # predicted state of each tree entry
        self.sampled = samples_tree(job.how)
        self.children = SampledChildren(job.how.generator) if self.sampled else top_children
        self.nodes: list[TreeNode] = []
        self.frontier: list[int] = []
        root = self.rows(head.logits(job.root_state[None]))[0]
        depth = job.depth if c.after_last_step == "repeat" else min(job.depth, c.num_steps)
        self.steps = grow_tree_steps(root, job.topk, depth, job.max_nodes, self.children)
        self.advance(None)

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids of node ids (a sampled tree's nodes hold target ids already; the
        other's draft-vocabulary indices)."""
        return ids if self.sampled else self.head.target_ids(ids)

    def rows(self, logits: torch.Tensor) -> torch.Tensor:
        """The rows nodes' children come from: probabilities (sampled) or log-probabilities."""
        return _sampled_probs(self.head, logits, self.job.how) if self.sampled \
            else _log_probs(logits)

    def advance(self, rows: torch.Tensor | None) -> bool:
        """Send the frontier's rows (None: start); False once the tree is grown."""
        try:
            self.frontier, self.nodes = (next(self.steps) if rows is None
                                         else self.steps.send(rows))
            return True
        except StopIteration as done:
            self.nodes, self.frontier = done.value, []
            return False

    @property
    def step(self) -> int:
        """The module that runs the frontier (nodes of one depth d: module of depth d + 1)."""
        return self.head.config.step_of_depth(self.nodes[self.frontier[0]].depth + 1)

    def level(self) -> tuple:
        """The frontier's :func:`tree_level_many` item (for module :attr:`step`)."""
        nodes, device = self.nodes, self.job.root_state.device
        m = self.step
        if m not in self.trees:
            self.trees[m] = TreeKV(self.kvs[m], self.kvs[m].length)
        feats, toks, pos, parents = [], [], [], []
        for f in self.frontier:
            up = nodes[f].parent
            feats.append(self.job.root_state if up < 0 else self.states[nodes[up].expanded])
            toks.append(nodes[f].draft_id)
            pos.append(self.job.context_len - 2 + nodes[f].depth)
            run = self.entry_of.get(up)
            parents.append(run[1] if run is not None and run[0] == m else -1)
        return (self.trees[m], torch.stack(feats),
                self.to_target(torch.tensor(toks, dtype=torch.long, device=device)),
                torch.tensor(pos, dtype=torch.long, device=device), parents)

    def took(self, out: torch.Tensor) -> None:
        """The frontier's predicted states ``out`` ``[m, d]`` came back from the forward."""
        m = self.step
        at = len(self.trees[m]) - len(self.frontier)
        for j, f in enumerate(self.frontier):
            self.nodes[f].expanded = len(self.states)
            self.entry_of[f] = (m, at + j)
            self.states.append(out[j])

    def finish(self) -> DraftedTree:
        """Rerank, number and send; branch 0's run entries join the request's KV."""
        nodes, job = self.nodes, self.job
        order = select_tree(nodes, job.max_nodes)
        parents = tree_arrays(nodes, order)
        ids = torch.tensor([nodes[i].draft_id for i in order], dtype=torch.long,
                           device=job.root_state.device)
        token_ids = self.to_target(ids).tolist()
        rows = ([sibling_row(nodes, i, self.children.rows).cpu() for i in order]
                if self.sampled else [None] * len(order))
        # branch 0: from the root, each node's first child; its prefix of run entries joins kv
        # (a 1-module head's: a multi-layer head's entries belong to several modules)
        b0_entries, b0_tokens, node = [], [], -1
        while self.head.config.num_steps == 1:
            nxt = next((j for j, p in enumerate(parents) if p == node), None)
            if nxt is None or nodes[order[nxt]].expanded < 0:
                break
            b0_entries.append(nodes[order[nxt]].expanded)
            b0_tokens.append(token_ids[nxt])
            node = nxt
        if b0_entries:
            keys, values = self.tree.entries(b0_entries)
            for li in range(len(keys)):
                job.kv.write(li, keys[li], values[li])
            job.kv.commit(len(b0_entries))
        forwards = len({n.depth for n in nodes if n.expanded >= 0})
        return DraftedTree(token_ids, parents, rows, forwards, b0_tokens,
                           [self.states[e] for e in b0_entries])


@torch.inference_mode()
def draft_trees(head: EagleHead, jobs: list[TreeJob]) -> list[DraftedTree]:
    """The EAGLE-2 trees of several requests (module docstring), grown in lockstep: per depth
    one head forward over every request's frontier (:func:`tree_level_many`) and one LM-head
    product over all their states. Each request gets the tree it gets alone
    (:func:`draft_tree`); the run entries of each tree's branch 0 are appended to its ``kv``
    (which the tree's other entries never touch).

    Raises:
        ValueError: a ``kv`` that does not end at its ``context_len - 1``; ``topk``,
            ``depth`` or ``max_nodes`` below 1.
    """
    growing = [_Growing(head, job) for job in jobs]
    live = [g for g in growing if g.frontier]
    while live:
        by_step: dict[int, list[_Growing]] = {}  # lockstep: one module per depth for all
        for g in live:
            by_step.setdefault(g.step, []).append(g)
        live = [g for grp in by_step.values() for g in grp]
        outs = [o for m, grp in by_step.items()  # (a 1-module head's call as it was)
                for o in (tree_level_many(head, [g.level() for g in grp], m) if m
                          else tree_level_many(head, [g.level() for g in grp]))]
        for g, out in zip(live, outs):
            g.took(out)
        logits = head.logits(torch.cat(outs)).split([int(o.shape[0]) for o in outs])
        live = [g for g, lg in zip(live, logits) if g.advance(g.rows(lg))]
    return [g.finish() for g in growing]


def draft_tree(head: EagleHead, kv: HeadKV, root_state: torch.Tensor, context_len: int,
               topk: int, depth: int, max_nodes: int,
               how: DraftSampling | None = None) -> DraftedTree:
    """The EAGLE-2 tree after a context of ``context_len`` tokens (module docstring), at most
    ``depth`` deep and ``max_nodes`` large, for a request drafted for ``how`` (None: as a
    greedy one): :func:`draft_trees` of one :class:`TreeJob`.

    Raises:
        ValueError: as :func:`draft_trees`.
    """
    return draft_trees(head, [TreeJob(kv, root_state, context_len, topk, depth, max_nodes,
                                      how)])[0]


__all__ = ["MAX_TOPK", "DraftedTree", "TreeJob", "draft_tree", "draft_trees", "samples_tree"]
