"""Verification rules: the one interface between the verify step and the kernels (DESIGN.md §5).

Vocabulary (as vLLM's rejection sampler defines it): a batch of ``batch`` requests, request
``b`` with ``k_b >= 0`` drafts; ``draft_token_ids`` [num_draft_total] holds every request's
drafts back to back and ``cu_num_draft_tokens`` [batch] their running totals;
``target_logits`` [num_draft_total + batch, vocab_size] (float32) holds, per request, the
target's logits after the last committed token and after each draft (``k_b + 1`` rows, the
rows of the verify forward over ``[last committed token] + drafts``). A rule returns
``output_token_ids`` [batch, max_k + 1] (``accept_len`` accepted drafts, then the bonus token
when all passed or the recovered token after a rejection, then ``PLACEHOLDER_TOKEN_ID``
padding) and ``accept_len`` [batch] (int64; excludes the bonus / recovered token).

A rule is chosen per request from its sampling parameters (:func:`rule_name_for`; the mode of
engine/sampling.py) and the deployment's ``verify_rule`` (VerifierConfig): ``greedy``
(temperature 0), ``coupled`` (sampled with a seed) and, for sampled requests without a seed,
``rejection`` (``verify_rule="auto"``) or ``block`` (``verify_rule="block"``: block
verification, Sun et al. arXiv 2403.10444). The verify step groups a batch by rule, so greedy, sampled and
seeded requests mix in one forward. Rules register by name (:func:`register_rule`), like the
drafter's proposers.

The sampled rules process every verified row with the row's request parameters (temperature,
top-k, top-p, min-p; engine.sampling.processed_probs) into ``target_probs`` [num_draft_total +
batch, vocab_size] (float32) before verifying, so drafts are judged against the distribution
the request actually samples from, at every position, not only the bonus one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from decode.config import VERIFY_RULES
from engine.sampling import COUPLED, GREEDY, processed_probs, sampling_mode, seeds_tensor
from kernels import (
    block_verify,
    block_verify_noise,
    coupled_sample,
    greedy_verify,
    rejection_sample,
    rejection_sample_noise,
)
from protocol.messages import SamplingParams


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


class VerificationRule(ABC):
    """Decides, for each request of a :class:`RuleBatch`, how many drafts pass and which target
    token follows them. Must be exact: the committed tokens are distributed as the target's own
    (greedy: equal to the target's argmax)."""

    name: ClassVar[str]
    #: whether the rule reads ``RuleBatch.draft_probs`` (the verify step builds them only then)
    uses_draft_probs: ClassVar[bool] = False

    @abstractmethod
    def verify(self, batch: RuleBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(output_token_ids [batch, max_k + 1], accept_len [batch])``.

        Raises:
            ValueError: inconsistent shapes (as the kernels raise).
        """


class GreedyRule(VerificationRule):
    """Greedy prefix match: a draft passes while it equals the target's argmax at its position
    (the rule of greedy speculative decoding, Leviathan et al. arXiv 2211.17192 at temperature
    0); runs ``kernels.greedy_verify``."""

    name = "greedy"

    def verify(self, batch: RuleBatch) -> tuple[torch.Tensor, torch.Tensor]:
        target_token_ids = torch.argmax(batch.target_logits, dim=-1)
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
    uses_draft_probs = True

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
    uses_draft_probs = True

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
    """Coupled verification for seeded requests (DESIGN.md §5): the target token at output
    position ``i`` is the Gumbel-max sample of the processed row with noise keyed by (seed,
    ``i``); a draft passes iff it equals that token. The committed tokens are then the ones
    plain decode (and the prefill worker at position 0) samples with the same seed, whatever
    the drafter proposed. Runs ``kernels.coupled_sample``."""

    name = "coupled"

    def verify(self, batch: RuleBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if batch.positions is None:
            raise ValueError("the coupled rule needs the requests' output positions")
        target_probs = batch.target_probs()
        seeds = seeds_tensor(batch.sampling, target_probs.device)
        positions = batch.positions.to(device=target_probs.device, dtype=torch.int64)
        return coupled_sample(batch.draft_token_ids, batch.cu_num_draft_tokens, target_probs,
                              seeds, positions)


_RULES: dict[str, VerificationRule] = {}


def register_rule(rule: VerificationRule) -> VerificationRule:
    """Make ``rule`` available under ``rule.name``.

    Raises:
        TypeError: not a VerificationRule, or no name.
        ValueError: the name is taken by another rule.
    """
    if not isinstance(rule, VerificationRule):
        raise TypeError(f"{rule!r} is not a VerificationRule")
    name = getattr(rule, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{type(rule).__name__} has no string `name`")
    if name in _RULES and type(_RULES[name]) is not type(rule):
        raise ValueError(f"verification rule {name!r} already registered")
    _RULES[name] = rule
    return rule


def get_rule(name: str) -> VerificationRule:
    """The rule registered as ``name``. Raises KeyError listing the known rules."""
    try:
        return _RULES[name]
    except KeyError:
        raise KeyError(f"unknown verification rule {name!r}; known: {sorted(_RULES)}") from None


def check_verify_rule(verify_rule: str) -> str:
    """``verify_rule`` if it is one of :data:`decode.config.VERIFY_RULES`.

    Raises:
        ValueError: any other value, naming the known ones.
    """
    if verify_rule not in VERIFY_RULES:
        raise ValueError(f"unknown verify_rule {verify_rule!r}; use one of {VERIFY_RULES}")
    return verify_rule


def rule_name_for(sampling: SamplingParams, verify_rule: str = "auto") -> str:
    """The rule a request with ``sampling`` is verified with: ``greedy`` at temperature 0 (below
    1e-5), ``coupled`` for a sampled request with a seed, else ``rejection`` (``verify_rule``
    ``"auto"``) or ``block`` (``verify_rule="block"``).

    Raises:
        ValueError: an unknown ``verify_rule``; parameters no rule can verify
            (SamplingParams.invalid_reason; the verifier refuses such requests at admission,
            so this is never reached mid-request).
    """
    check_verify_rule(verify_rule)
    why = sampling.invalid_reason()
    if why:
        raise ValueError(why)
    mode = sampling_mode(sampling)
    if mode == GREEDY:
        return GreedyRule.name
    if mode == COUPLED:
        return CoupledRule.name
    return BlockRule.name if verify_rule == "block" else RejectionRule.name


register_rule(GreedyRule())
register_rule(RejectionRule())
register_rule(CoupledRule())
register_rule(BlockRule())
