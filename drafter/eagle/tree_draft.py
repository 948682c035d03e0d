"""One EAGLE-2 draft tree of one request: the tree's selection (drafter/eagle/tree.py) driven
by the head's forwards over the tree (drafter/eagle/head_tree.py), one forward per depth.

The request's head KV must end at the context's second-to-last position (the proposer's
catch-up, drafter/proposers/eagle.py), and ``root_state`` is the state its last entry predicted
(whose logits are the distribution of the first draft).

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
from specmesh.drafter.eagle.head_tree import TreeKV, tree_level
from specmesh.drafter.eagle.sampled_tree import SampledChildren, sibling_row
from specmesh.drafter.eagle.tree import (TreeNode, grow_tree, select_tree, top_children,
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


def _log_probs(head: EagleHead, states: torch.Tensor) -> torch.Tensor:
    """float32 draft-vocabulary log-probabilities ``[n, draft_vocab]`` of states ``[n, d]``."""
    return torch.log_softmax(head.logits(states).float(), dim=-1)


def _sampled_probs(head: EagleHead, states: torch.Tensor, how: DraftSampling) -> torch.Tensor:
    """float32 ``[n, vocab_size]`` target-space distributions of states ``[n, d]``, processed
    with the request's sampling (drafter/draft_sampling.py: what its chain drafts are drawn
    from)."""
    logits = torch.cat([target_space_logits(row[None], head.config.vocab_size,
                                            head.draft_to_target)
                        for row in head.logits(states).float()])
    return processed_probs(logits, [how.sampling], [logits.shape[0]])


def samples_tree(how: DraftSampling | None) -> bool:
    """Whether a request drafted for ``how`` gets a sampled tree with rows (module
    docstring): an unseeded sampled request without penalties or token constraints."""
    return how is not None and how.sends_probs and not how.processes


@torch.inference_mode()
def draft_tree(head: EagleHead, kv: HeadKV, root_state: torch.Tensor, context_len: int,
               topk: int, depth: int, max_nodes: int,
               how: DraftSampling | None = None) -> DraftedTree:
    """The EAGLE-2 tree after a context of ``context_len`` tokens (module docstring), at most
    ``depth`` deep and ``max_nodes`` large, for a request drafted for ``how`` (None: as a
    greedy one); the run entries of its branch 0 are appended to ``kv`` (which the tree's
    other entries never touch).

    Raises:
        ValueError: ``kv`` does not end at ``context_len - 1``; ``topk``, ``depth`` or
            ``max_nodes`` below 1.
    """
    if not kv.length or kv.end != context_len - 1:
        raise ValueError(f"head KV holds [{kv.start}, {kv.end}); a tree after {context_len} "
                         f"tokens needs it to end at {context_len - 1}")
    tree = TreeKV(kv, kv.length)
    states: list[torch.Tensor] = []  # predicted state of each tree entry
    device = root_state.device
    sampled = samples_tree(how)
    # a sampled tree's nodes hold target ids and probability rows; the other's draft ids
    # and log-probability rows
    to_target = (lambda ids: ids) if sampled else head.target_ids

    def rows_of(out: torch.Tensor) -> torch.Tensor:
        return _sampled_probs(head, out, how) if sampled else _log_probs(head, out)

    def expand(frontier: list[int], nodes: list[TreeNode]) -> torch.Tensor:
        feats, toks, pos, parents = [], [], [], []
        for f in frontier:
            up = nodes[f].parent
            feats.append(root_state if up < 0 else states[nodes[up].expanded])
            toks.append(nodes[f].draft_id)
            pos.append(context_len - 2 + nodes[f].depth)
            parents.append(-1 if up < 0 else nodes[up].expanded)
        out = tree_level(head, tree, torch.stack(feats),
                         to_target(torch.tensor(toks, dtype=torch.long, device=device)),
                         torch.tensor(pos, dtype=torch.long, device=device), parents)
        for j, f in enumerate(frontier):
            nodes[f].expanded = len(states)
            states.append(out[j])
        return rows_of(out)

    children = SampledChildren(how.generator) if sampled else top_children
    nodes = grow_tree(rows_of(root_state[None])[0], expand, topk, depth, max_nodes, children)
    order = select_tree(nodes, max_nodes)
    parents = tree_arrays(nodes, order)
    ids = torch.tensor([nodes[i].draft_id for i in order], dtype=torch.long, device=device)
    token_ids = to_target(ids).tolist()
    rows = ([sibling_row(nodes, i, children.rows).cpu() for i in order] if sampled
            else [None] * len(order))
    # branch 0: from the root, each node's first child; its prefix of run entries joins kv
    b0_entries, b0_tokens, node = [], [], -1
    while True:
        nxt = next((j for j, p in enumerate(parents) if p == node), None)
        if nxt is None or nodes[order[nxt]].expanded < 0:
            break
        b0_entries.append(nodes[order[nxt]].expanded)
        b0_tokens.append(token_ids[nxt])
        node = nxt
    if b0_entries:
        keys, values = tree.entries(b0_entries)
        for li in range(len(keys)):
            kv.write(li, keys[li], values[li])
        kv.commit(len(b0_entries))
    return DraftedTree(token_ids, parents, rows, len({nodes[i].depth for i in range(len(nodes))
                                                if nodes[i].expanded >= 0}),
                       b0_tokens, [states[e] for e in b0_entries])


__all__ = ["MAX_TOPK", "DraftedTree", "draft_tree", "samples_tree"]
