"""Verification rules: the one interface between the verify step and the kernels
(docs/architecture.md, 'Verification rules').

Vocabulary (as vLLM's rejection sampler defines it): a batch of ``batch`` requests, request
``b`` with ``k_b >= 0`` drafts; ``draft_token_ids`` [num_draft_total] holds every request's
drafts back to back and ``cu_num_draft_tokens`` [batch] their running totals;
``target_logits`` [num_draft_total + batch, vocab_size] (float32) holds, per request, the
target's logits after the last committed token and after each draft (``k_b + 1`` rows, the
rows of the verify forward over ``[last committed token] + drafts``). A rule returns
``output_token_ids`` [batch, max_k + 1] (``accept_len`` accepted drafts, then the bonus token
when all passed or the recovered token after a rejection, then ``PLACEHOLDER_TOKEN_ID``
padding) and ``accept_len`` [batch] (int64; excludes the bonus / recovered token).

Each rule declares when it applies (decode/rules.py, the registry that chooses a request's
rule): ``tree`` (draft trees), ``greedy`` (temperature 0), ``coupled`` (sampled with a seed)
and, for sampled requests without a seed, ``block`` when the deployment picks it
(``verify_rule="block"``: block verification, Sun et al. arXiv 2403.10444), else
``rejection``. The verify step groups a batch by rule, so greedy, sampled and seeded
requests mix in one forward. Every concrete rule class of this module is registered.

The sampled rules process every verified row with the row's request parameters (temperature,
top-k, top-p, min-p; engine.sampling.processed_probs) into ``target_probs`` [num_draft_total +
batch, vocab_size] (float32) before verifying, so drafts are judged against the distribution
the request actually samples from, at every position, not only the bonus one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmesh.decode.rules import RuleQuery, VerificationRule
from specmesh.engine.row_argmax import row_argmax
from specmesh.engine.sampling import COUPLED, GREEDY, processed_probs, sampling_mode, seeds_tensor
from specmesh.kernels.block_verify import block_verify, block_verify_noise
from specmesh.kernels.constants import PLACEHOLDER_TOKEN_ID
from specmesh.kernels.coupled_sample import coupled_sample, gumbel_sample
from specmesh.kernels.greedy_verify import greedy_verify
from specmesh.kernels.rejection_sample import rejection_sample, rejection_sample_noise
from specmesh.kernels.tree_layout import tree_node_depths
from specmesh.kernels.tree_rejection_sample import tree_rejection_sample, tree_rejection_sample_noise
from specmesh.kernels.tree_walk import tree_walk
from specmesh.protocol.messages import SamplingParams


@dataclass(frozen=True)
class RuleBatch:
    """The requests of one verify step that share a rule (shapes in the module docstring).

    ``positions`` (int64 [batch]): the output position of each request's first verified row
    (its committed length: row ``j`` predicts output position ``positions[b] + j``; 0 is the
    prefill worker's first token), the noise key of the coupled rule. ``draft_probs``
    ([num_draft_total, vocab_size] float32, or None): the distributions the drafts were
    sampled from (DraftTailStream.draft_probs); None means one-hot drafts (n-gram and greedy
    drafters). ``generator``: the verifier's randomness for unseeded sampled requests (on the
    logits' device; torch's default generator when None).
    """

    draft_token_ids: torch.Tensor
    cu_num_draft_tokens: torch.Tensor
    target_logits: torch.Tensor
    sampling: list[SamplingParams]
    positions: torch.Tensor | None = None
    draft_probs: torch.Tensor | None = None
    generator: torch.Generator | None = None
    parents: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.sampling)

    def num_draft_tokens(self) -> list[int]:
        """Drafts per request, ``k_b`` [batch]."""
        cu = self.cu_num_draft_tokens.tolist()
        return [b - a for a, b in zip([0] + cu[:-1], cu)]

    def target_probs(self) -> torch.Tensor:
        """float32 [num_draft_total + batch, vocab_size]: every row processed with its
        request's parameters (engine.sampling.processed_probs)."""
        rows = [k + 1 for k in self.num_draft_tokens()]
        return processed_probs(self.target_logits, self.sampling, rows)


class GreedyRule(VerificationRule):
    """Greedy prefix match: a draft passes while it equals the target's argmax at its position
    (the rule of greedy speculative decoding, Leviathan et al. arXiv 2211.17192 at temperature
    0); runs ``kernels.greedy_verify``."""

    name = "greedy"
    priority = 40

    def applies(self, query: RuleQuery) -> bool:
        return query.mode == GREEDY

    def verify(self, batch: RuleBatch) -> tuple[torch.Tensor, torch.Tensor]:
        target_token_ids = row_argmax(batch.target_logits)
        return greedy_verify(batch.draft_token_ids, batch.cu_num_draft_tokens, target_token_ids)


class RejectionRule(VerificationRule):
    """Standard speculative sampling (Leviathan et al. arXiv 2211.17192, Chen et al. arXiv
    2302.01318) for unseeded sampled requests: draft ``x`` passes with probability
    ``min(1, target_probs[x] / draft_probs[x])``; after a rejection the recovered token is
    sampled from ``normalize(max(target_probs - draft_probs, 0))``, after the last draft the
    bonus token from the target row. One-hot drafts (``draft_probs`` None) pass with
    probability ``target_probs[x]``; exact for any deterministic drafter. Runs
    ``kernels.rejection_sample`` with noise from the batch's generator."""

    name = "rejection"
    priority = 0  # every sampled request that no other rule takes
    uses_draft_probs = True

    def applies(self, query: RuleQuery) -> bool:
        return query.mode not in (GREEDY, COUPLED)

    def verify(self, batch: RuleBatch) -> tuple[torch.Tensor, torch.Tensor]:
        target_probs = batch.target_probs()
        uniform, noise = rejection_sample_noise(batch.cu_num_draft_tokens, target_probs.shape[1],
                                                dtype=target_probs.dtype,
                                                generator=batch.generator)
        draft_probs = batch.draft_probs
        if draft_probs is not None:
            draft_probs = draft_probs.to(target_probs.dtype)
        return rejection_sample(batch.draft_token_ids, batch.cu_num_draft_tokens, draft_probs,
                                target_probs, uniform, noise)


class BlockRule(VerificationRule):
    """Block verification (Sun et al., arXiv 2403.10444, Algorithm 2) for unseeded sampled
    requests when the deployment asks for it (``verify_rule="block"``): the drafts are judged
    jointly through residual weights ``p_i`` along the block, ``accept_len`` is the last
    position whose test passes, the extra token comes from ``normalize(max(p_tau *
    target_probs - draft_probs, 0))`` (the bonus row after the last draft). Exact like
    rejection sampling and never accepts fewer drafts in expectation (more with full
    ``draft_probs``; as many with one-hot drafts). Runs ``kernels.block_verify`` with noise
    from the batch's generator."""

    name = "block"
    priority = 20
    selectable = True
    help = ("block verification (arXiv 2403.10444) of sampled requests without a seed, "
            "greedy and seeded requests as auto")
    uses_draft_probs = True

    def applies(self, query: RuleQuery) -> bool:
        return query.verify_rule == self.name and query.mode not in (GREEDY, COUPLED)

    def verify(self, batch: RuleBatch) -> tuple[torch.Tensor, torch.Tensor]:
        target_probs = batch.target_probs()
        uniform, noise = block_verify_noise(batch.cu_num_draft_tokens, target_probs.shape[1],
                                            dtype=target_probs.dtype, generator=batch.generator)
        draft_probs = batch.draft_probs
        if draft_probs is not None:
            draft_probs = draft_probs.to(target_probs.dtype)
        return block_verify(batch.draft_token_ids, batch.cu_num_draft_tokens, draft_probs,
                            target_probs, uniform, noise)


class CoupledRule(VerificationRule):
    """Coupled verification for seeded requests (docs/architecture.md, 'Verification rules'): the
    target token at output
    position ``i`` is the Gumbel-max sample of the processed row with noise keyed by (seed,
    ``i``); a draft passes iff it equals that token. The committed tokens are then the ones
    plain decode (and the prefill worker at position 0) samples with the same seed, whatever
    the drafter proposed. Runs ``kernels.coupled_sample``."""

    name = "coupled"
    priority = 40

    def applies(self, query: RuleQuery) -> bool:
        return query.mode == COUPLED

    def verify(self, batch: RuleBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if batch.positions is None:
            raise ValueError("the coupled rule needs the requests' output positions")
        target_probs = batch.target_probs()
        seeds = seeds_tensor(batch.sampling, target_probs.device)
        positions = batch.positions.to(device=target_probs.device, dtype=torch.int64)
        return coupled_sample(batch.draft_token_ids, batch.cu_num_draft_tokens, target_probs,
                              seeds, positions)


class TreeRule(VerificationRule):
    """Tree verification (SpecInfer, arXiv 2305.09781) over the token tree of each request
    (``RuleBatch.parents``), by sampling mode: greedy requests walk the tree along the target's
    argmax rows (``kernels.tree_walk``: from the root, the first child whose token
    equals the current row's target token); seeded requests walk it along the coupled rule's
    token of every row, the Gumbel-max sample keyed by (seed, committed_len + depth), so their
    output is the one plain decode samples whatever the tree held; unseeded sampled requests
    use SpecInfer's multi-draft rejection sampling (``tree_rejection_sample``) with each
    node's draft-probability row where the tree has them (a sampled EAGLE-2 tree's: the
    distribution the node was drawn from given its parent and earlier siblings), one-hot
    otherwise. :meth:`verify_tree` also returns the accepted path's node ids."""

    name = "tree"
    priority = 50
    judges_trees = True
    uses_draft_probs = True

    def applies(self, query: RuleQuery) -> bool:
        return query.tree

    def verify(self, batch: RuleBatch) -> tuple[torch.Tensor, torch.Tensor]:
        out, accept_len, _ = self.verify_tree(batch)
        return out, accept_len

    def verify_tree(self, batch: RuleBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(output_token_ids [B, max_depth + 1], accept_len [B], accepted_node_ids [B,
        max_depth])``, -1 padded node ids within each request's tree, in path order.

        Raises:
            ValueError: no ``parents`` (or no ``positions`` for a seeded request), or shapes
                the kernels refuse.
        """
        if batch.parents is None:
            raise ValueError("the tree rule needs the drafts' parents")
        modes = [sampling_mode(s) for s in batch.sampling]
        sampled = [b for b, m in enumerate(modes) if m not in (GREEDY, COUPLED)]
        walked = [b for b, m in enumerate(modes) if m in (GREEDY, COUPLED)]
        results = []
        for idx in (walked, sampled):
            if not idx:
                continue
            sub = _sub_batch(batch, idx)
            if idx is walked:
                res = tree_walk(sub.draft_token_ids, sub.cu_num_draft_tokens, sub.parents,
                                _walk_targets(sub))
            else:
                target_probs = sub.target_probs()
                uniform, noise = tree_rejection_sample_noise(
                    sub.cu_num_draft_tokens, target_probs.shape[1], dtype=target_probs.dtype,
                    generator=sub.generator)
                draft_probs = sub.draft_probs
                if draft_probs is not None:
                    draft_probs = draft_probs.to(target_probs.dtype)
                res = tree_rejection_sample(sub.draft_token_ids, sub.cu_num_draft_tokens,
                                            sub.parents, draft_probs, target_probs, uniform,
                                            noise)
            results.append((idx, res))
        return _stitch(batch.batch_size, results)


def _walk_targets(batch: RuleBatch) -> torch.Tensor:
    """int64 [num_draft_total + batch]: the token each row's walk compares with: the argmax
    (greedy requests) or the coupled rule's Gumbel-max sample at output position
    ``positions[b] + depth`` (seeded requests)."""
    target = row_argmax(batch.target_logits)
    coupled = [b for b, s in enumerate(batch.sampling) if sampling_mode(s) == COUPLED]
    if not coupled:
        return target
    if batch.positions is None:
        raise ValueError("the tree rule needs the output positions of seeded requests")
    counts = batch.num_draft_tokens()
    depths = tree_node_depths(batch.cu_num_draft_tokens, batch.parents).tolist()
    starts = [0]
    for k in counts:
        starts.append(starts[-1] + k + 1)
    pos = batch.positions.tolist()
    rows, row_pos, row_req = [], [], []
    node_lo = 0
    for b, k in enumerate(counts):
        if b in coupled:
            rows += range(starts[b], starts[b + 1])
            row_pos += [pos[b]] + [pos[b] + d for d in depths[node_lo:node_lo + k]]
            row_req += [b] * (k + 1)
        node_lo += k
    device = batch.target_logits.device
    rows_t = torch.tensor(rows, dtype=torch.long, device=device)
    req_sampling = [batch.sampling[b] for b in row_req]
    probs = processed_probs(batch.target_logits[rows_t], req_sampling)
    seeds = seeds_tensor(req_sampling, device)
    target[rows_t] = gumbel_sample(probs.contiguous(), seeds,
                                   torch.tensor(row_pos, dtype=torch.int64, device=device))
    return target


def _sub_batch(batch: RuleBatch, idx: list[int]) -> RuleBatch:
    """The requests ``idx`` of ``batch`` (rows, drafts and parents sliced)."""
    if idx == list(range(batch.batch_size)):
        return batch
    counts = batch.num_draft_tokens()
    row_lo, node_lo, rows, nodes = 0, 0, [], []
    for b, k in enumerate(counts):
        if b in idx:
            rows += range(row_lo, row_lo + k + 1)
            nodes += range(node_lo, node_lo + k)
        row_lo += k + 1
        node_lo += k
    device = batch.target_logits.device
    rows_t = torch.tensor(rows, dtype=torch.long, device=device)
    nodes_t = torch.tensor(nodes, dtype=torch.long, device=device)
    sub_counts = torch.tensor([counts[b] for b in idx], dtype=torch.long)
    return RuleBatch(
        draft_token_ids=batch.draft_token_ids[nodes_t],
        cu_num_draft_tokens=sub_counts.cumsum(0).to(batch.cu_num_draft_tokens.device),
        target_logits=batch.target_logits[rows_t],
        sampling=[batch.sampling[b] for b in idx],
        positions=None if batch.positions is None else batch.positions[idx],
        draft_probs=None if batch.draft_probs is None else batch.draft_probs[nodes_t],
        generator=batch.generator,
        parents=batch.parents[nodes_t])


def _stitch(batch_size: int, results: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One (output, accept_len, node ids) triple from the sub-batches' (padded alike)."""
    if len(results) == 1 and len(results[0][0]) == batch_size:
        return results[0][1]
    width = max(r[0].shape[1] for _, r in results)
    device = results[0][1][0].device
    out = torch.full((batch_size, width), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=device)
    nodes = torch.full((batch_size, max(width - 1, 0)), -1, dtype=torch.long, device=device)
    accept_len = torch.zeros(batch_size, dtype=torch.long, device=device)
    for idx, (o, a, n) in results:
        ix = torch.tensor(idx, dtype=torch.long, device=device)
        out[ix, :o.shape[1]] = o
        nodes[ix, :n.shape[1]] = n
        accept_len[ix] = a
    return out, accept_len, nodes


__all__ = ["BlockRule", "CoupledRule", "GreedyRule", "RejectionRule", "RuleBatch", "TreeRule",
           "VerificationRule"]
