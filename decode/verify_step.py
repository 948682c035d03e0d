"""The verify step: one batched ragged target forward over ``[last committed token] + drafts``
of every planned request, then each request's logits through its verification rule
(docs/architecture.md, 'The verify step'). Knows nothing of messages, peers or commits."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from specmesh.decode.config import AUTO_VERIFY_RULE, VerifierConfig
from specmesh.decode.draft_probs import batch_draft_probs
from specmesh.decode.grammar import VerifierGrammars
from specmesh.decode.rules import RuleSet, VerificationRule
from specmesh.decode.scheduler import PlannedRequest
from specmesh.decode.verification import RuleBatch
from specmesh.engine.hidden_layers import is_hidden_seed, seed_state_layers
from specmesh.engine.logprobs import token_logprobs
from specmesh.engine.lora import adapter_slot
from specmesh.engine.logits_processors import (
    RowsHistory, apply_logits_processors, chain_row_drafts, tree_row_drafts,
)
from specmesh.engine.runner import ModelRunner, SeqChunk
from specmesh.protocol.messages import TokenLogprobs
from specmesh.protocol.step_profile import StepProfile


@dataclass(frozen=True, slots=True)
class VerifyOutput:
    """What one request gets out of a verify step: ``token_ids`` are ``accept_len`` accepted
    drafts plus one bonus or recovered token (not yet cut at EOS / max_tokens). ``hidden``
    (only when the step was asked for them): the target hidden states of the chunk's rows
    ``0 .. accept_len`` on the CPU, [accept_len + 1, width] (hidden_size, or one hidden_size per
    layer of ``VerifyStep.hidden_layers``), row i the state that
    predicted ``token_ids[i]`` (decode/seed_state.py). For a tree (``PlannedRequest.parents``),
    ``accepted_node_ids`` are the accepted path's nodes, in path order (the hidden rows are
    then the root's and theirs), and ``side_branch`` tells whether the path left the first
    child (branch 0) somewhere. ``logprobs`` (only for a request that asked,
    ``SamplingParams.logprobs``): one entry per token of ``token_ids``, from the target logits
    of the row that chose it (engine/logprobs.py)."""

    token_ids: list[int]
    accept_len: int
    num_draft_tokens: int
    hidden: torch.Tensor | None = None
    accepted_node_ids: list[int] | None = None
    side_branch: bool = False
    logprobs: TokenLogprobs | None = None


class VerifyStep:
    """Runs verify forwards on ``runner`` (which writes the KV of every position it sees).

    ``seed`` seeds the verifier's own ``torch.Generator`` (on the logits' device), the
    randomness of unseeded sampled requests (the rejection rule); None draws a fresh one.
    Seeded requests never touch it (their noise is keyed by (seed, position)).
    ``config`` (the verifier's VerifierConfig; None: one with ``verify_rule`` and
    ``synthetic_acceptance``): the deployment's verification settings, from which
    :attr:`rules` (decode/rules.py) are built and choose each request's rule.

    Raises:
        ValueError: a ``verify_rule`` no deployment may pick, or settings a rule refuses
            (e.g. ``"synthetic"`` without a valid curve).
    """

    def __init__(self, runner: ModelRunner, profile: StepProfile | None = None,
                 seed: int | None = None, verify_rule: str = AUTO_VERIFY_RULE,
                 synthetic_acceptance: tuple[float, ...] = (),
                 seed_state: str = "", config: VerifierConfig | None = None) -> None:
        self.runner = runner
        #: the decoder layers whose outputs the hidden rows carry (None: the final-norm state),
        #: from the draft method's seed state (engine/hidden_layers.py)
        self.hidden_layers = seed_state_layers(seed_state) if is_hidden_seed(seed_state) \
            else None
        self.profile = profile or StepProfile()
        self.last_forward_s = 0.0  # seconds of the latest verify forward
        self._seed = seed
        self.rules = RuleSet(config or VerifierConfig(
            verify_rule=verify_rule, synthetic_acceptance=tuple(synthetic_acceptance)))
        self.verify_rule = self.rules.verify_rule
        self._generators: dict[torch.device, torch.Generator] = {}
        #: structured output: masks constrained requests' rows (decode/grammar.py; the
        #: verifier sets it)
        self.grammars: VerifierGrammars | None = None

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """The verifier's generator on ``device`` (created on first use)."""
        device = torch.device(device)
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._generators[device] = gen
        return gen

    def run(self, plan: list[PlannedRequest], return_hidden: bool = False) -> list[VerifyOutput]:
        """Verify every planned request; returns one output per request, in plan order, with
        its hidden-state rows when ``return_hidden`` (a draft method that needs them).

        Each request's block table must already cover ``kv_len + 1 + len(drafts)`` positions
        (the scheduler allocates them). A tree request's accepted path is compacted: its
        nodes' KV moves to the positions right after the last committed token (only the rows
        that are not there already move).

        Raises:
            ValueError: a request whose sampling parameters no rule verifies, or a chunk the
                runner refuses.
        """
        if not plan:
            return []
        chunks = [SeqChunk(token_ids=[p.request.output_token_ids[-1]] + p.draft_token_ids,
                           start_pos=p.request.kv_len, block_table=p.request.block_table,
                           parents=p.parents,
                           adapter=adapter_slot(self.runner.model, p.request.lora_name)
                           if p.request.lora_name else -1)
                  for p in plan]
        # forward time split by whether any request carried drafts: with / without drafts is
        # the cost ratio the bench compares with a (kappa+1)-token vs 1-token forward
        kind = "forward_with_drafts" if any(p.draft_token_ids for p in plan) else "forward_plain"
        t0 = time.perf_counter()
        hidden = None
        if return_hidden:
            logits, hidden = self.runner.forward(chunks, logits="all", return_hidden=True,
                                                 hidden_layers=self.hidden_layers)
        else:
            logits = self.runner.forward(chunks, logits="all")  # per request [k_b + 1, vocab]
        self.last_forward_s = time.perf_counter() - t0
        self.profile.observe("forward", self.last_forward_s)
        self.profile.observe(kind, self.last_forward_s)
        with self.profile.phase("verify"):
            outputs = self._verify(plan, logits)
            self._compact(plan, outputs)
        if hidden is None:
            return outputs
        with self.profile.phase("seed_state"):
            if hidden[0].device.type != "cpu":  # one copy to the host for the whole batch
                hidden = list(torch.cat(hidden).cpu().split([h.shape[0] for h in hidden]))
            return [replace(o, hidden=_path_rows(h, o)) for o, h in zip(outputs, hidden)]

    def _compact(self, plan: list[PlannedRequest], outputs: list[VerifyOutput]) -> None:
        """Move each tree request's accepted nodes' KV (chunk row ``1 + node``) to the
        positions after its root (``kv_len + 1 + i`` for the i-th path node)."""
        for p, o in zip(plan, outputs):
            if not o.accepted_node_ids:
                continue
            start = p.request.kv_len
            src = [start + 1 + j for j in o.accepted_node_ids]
            dst = [start + 1 + i for i in range(len(src))]
            moved = [(s, d) for s, d in zip(src, dst) if s != d]
            if moved:
                self.runner.kv_cache.copy_positions(p.request.block_table,
                                                    [s for s, _ in moved], [d for _, d in moved])

    def _verify(self, plan: list[PlannedRequest], logits: list[torch.Tensor]) -> list[VerifyOutput]:
        groups: dict[str, tuple[VerificationRule, list[int]]] = {}
        for i, p in enumerate(plan):
            rule = self.rules.select(p.request.sampling, tree=p.parents is not None)
            groups.setdefault(rule.name, (rule, []))[1].append(i)
        outputs: list[VerifyOutput | None] = [None] * len(plan)
        for rule, idx in groups.values():
            batch = self._rule_batch([plan[i] for i in idx], [logits[i] for i in idx],
                                     rule.uses_draft_probs)
            lp_rows = _logprob_rows(batch)  # the rule's logits, before the rule runs
            if rule.judges_trees:
                out, accept_len, nodes = rule.verify_tree(batch)
                for i, row, a, path in zip(idx, out.tolist(), accept_len.tolist(),
                                           nodes.tolist()):
                    parents = plan[i].parents
                    path = path[:a]
                    outputs[i] = VerifyOutput(
                        row[: a + 1], a, len(plan[i].draft_token_ids), accepted_node_ids=path,
                        side_branch=any(parents.index(parents[j]) != j for j in path))
            else:
                out, accept_len = rule.verify(batch)
                for i, row, a in zip(idx, out.tolist(), accept_len.tolist()):
                    outputs[i] = VerifyOutput(row[: a + 1], a, len(plan[i].draft_token_ids))
            for b, rows in lp_rows.items():
                outputs[idx[b]] = _with_logprobs(outputs[idx[b]], rows,
                                                 batch.sampling[b].logprobs)
        return outputs  # type: ignore[return-value]

    def _rule_batch(self, plan: list[PlannedRequest], logits: list[torch.Tensor],
                    with_draft_probs: bool = False) -> RuleBatch:
        drafts = [t for p in plan for t in p.draft_token_ids]
        draft_probs = None
        if with_draft_probs:  # one-hot rows for drafts without one (decode/draft_probs.py)
            rows = [r for p in plan
                    for r in (p.draft_probs or [None] * len(p.draft_token_ids))]
            draft_probs = batch_draft_probs(drafts, rows, logits[0].shape[-1], logits[0].device)
        counts = torch.tensor([len(p.draft_token_ids) for p in plan], dtype=torch.long)
        device = logits[0].device
        # row 0 of a request predicts output position committed_len
        # (docs/architecture.md, 'Verification rules')
        positions = torch.tensor([p.request.committed_len for p in plan], dtype=torch.int64,
                                 device=device)
        parents = None
        if any(p.parents is not None for p in plan):  # the tree rule's batches
            parents = torch.tensor([j for p in plan for j in p.parents], dtype=torch.long,
                                   device=device)
        target_logits = torch.cat(logits)
        _apply_penalties(plan, target_logits)
        self._grammar_masks(plan, target_logits)
        return RuleBatch(draft_token_ids=torch.tensor(drafts, dtype=torch.long, device=device),
                         cu_num_draft_tokens=counts.cumsum(0).to(device),
                         target_logits=target_logits,
                         sampling=[p.request.sampling for p in plan],
                         positions=positions, draft_probs=draft_probs,
                         generator=self.generator(device), parents=parents)

    def _grammar_masks(self, plan: list[PlannedRequest], target_logits: torch.Tensor) -> None:
        """Structured output: each constrained request's rows get its grammar's token mask
        (row i: the state after its drafts ``d_0 .. d_{i-1}``), disallowed logits -inf in
        place, before the verification rule sees them (decode/grammar.py)."""
        if self.grammars is None or all(p.request.sampling.grammar is None for p in plan):
            return
        self.grammars.mask_logits([p.request for p in plan], [p.draft_token_ids for p in plan],
                                  target_logits)


def _logprob_rows(batch: RuleBatch) -> dict[int, torch.Tensor]:
    """Batch index -> a float32 copy of its ``k_b + 1`` target-logits rows, for the requests
    of ``batch`` that asked for logprobs (``SamplingParams.logprobs``; the others pay
    nothing). Taken after any in-place processing of ``target_logits`` and before the rule
    runs, so the logprobs are of the distribution the rule judged."""
    wanted = [b for b, s in enumerate(batch.sampling) if s.logprobs is not None]
    if not wanted:
        return {}
    starts = [0]
    for k in batch.num_draft_tokens():
        starts.append(starts[-1] + k + 1)
    return {b: batch.target_logits[starts[b]:starts[b + 1]].float().clone() for b in wanted}


def _with_logprobs(out: VerifyOutput, rows: torch.Tensor, k: int) -> VerifyOutput:
    """``out`` with the logprobs of its tokens: token i was chosen by chunk row i of a chain;
    by the root's row, then the accepted nodes' rows (``1 + node``), of a tree."""
    if out.accepted_node_ids:
        rows = rows.index_select(0, torch.tensor([0] + [1 + j for j in out.accepted_node_ids],
                                                 dtype=torch.long, device=rows.device))
    return replace(out, logprobs=token_logprobs(rows[:len(out.token_ids)], out.token_ids,
                                                min(k, rows.shape[-1])))
def _apply_penalties(plan: list[PlannedRequest], target_logits: torch.Tensor) -> None:
    """Penalties and token constraints (engine/logits_processors.py) on ``target_logits``
    [num_draft_total + batch, V], in place, before any rule reads them: row ``i`` of a request
    with the history of the output committed plus the drafts before that row (a tree node's
    row: its path), so greedy takes the argmax of the processed row and the sampled rules
    process it further."""
    histories, first = [], 0
    for p in plan:
        s = p.request.sampling
        if s.has_logits_processors:
            rows = (chain_row_drafts(p.draft_token_ids) if p.parents is None
                    else tree_row_drafts(p.draft_token_ids, p.parents))
            histories.append(RowsHistory(s, p.request.prompt_token_ids,
                                         p.request.output_token_ids, first, rows))
        first += len(p.draft_token_ids) + 1
    apply_logits_processors(target_logits, histories)


def _path_rows(hidden: torch.Tensor, out: VerifyOutput) -> torch.Tensor:
    """The hidden rows of the committed tokens' predecessors: rows ``0 .. accept_len`` of a
    chain, the root's and the accepted nodes' (``1 + node``) of a tree, in path order."""
    if not out.accepted_node_ids:
        return hidden[: out.accept_len + 1]
    rows = torch.tensor([0] + [1 + j for j in out.accepted_node_ids], dtype=torch.long,
                        device=hidden.device)
    return hidden.index_select(0, rows)
