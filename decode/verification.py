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

A rule is chosen per request from its sampling parameters (:func:`rule_name_for`); the verify
step groups a batch by rule, so greedy, sampled and seeded requests mix in one forward. Rules
register by name (:func:`register_rule`), like the drafter's proposers; the sampled rules of
DESIGN.md §5 plug in here without touching the verify step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from kernels import greedy_verify
from protocol.messages import SamplingParams


@dataclass(frozen=True)
class RuleBatch:
    """The requests of one verify step that share a rule (shapes in the module docstring)."""

    draft_token_ids: torch.Tensor
    cu_num_draft_tokens: torch.Tensor
    target_logits: torch.Tensor
    sampling: list[SamplingParams]

    @property
    def batch_size(self) -> int:
        return len(self.sampling)


class VerificationRule(ABC):
    """Decides, for each request of a :class:`RuleBatch`, how many drafts pass and which target
    token follows them. Must be exact: the committed tokens are distributed as the target's own
    (greedy: equal to the target's argmax)."""

    name: ClassVar[str]

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


def rule_name_for(sampling: SamplingParams) -> str:
    """The rule a request with ``sampling`` is verified with.

    Raises:
        ValueError: no registered rule verifies these parameters (the verifier refuses such
            requests at admission, so this is never reached mid-request).
    """
    if sampling.temperature == 0:
        return GreedyRule.name
    raise ValueError("only greedy decoding (temperature 0) is supported by this verifier")


register_rule(GreedyRule())
