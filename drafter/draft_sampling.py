"""How a model drafter picks each draft for a request's sampling mode
(docs/architecture.md, 'Verification rules').

The verifier verifies greedy requests by prefix match, seeded ones with the coupled rule and
unseeded sampled ones by rejection sampling (or block verification); each accepts most when the
drafter drafts the way the rule samples:

- greedy (temperature 0): the argmax of the draft logits; no probabilities;
- coupled (sampled, with a seed): the Gumbel-max sample of the processed draft distribution
  with the noise the target uses at that output position, keyed by (seed, position)
  (kernels.coupled_sample.gumbel_sample): the draft equals the target's token whenever the two
  distributions are close; no probabilities (the rule compares tokens);
- random (sampled, no seed): a sample of the processed draft distribution (temperature, top-k,
  top-p, min-p of the request: engine.sampling.processed_probs), drawn with the drafter's own
  generator, and that distribution as a dense float32 row ``[vocab_size]`` for
  DraftTailStream.draft_probs (192 KB per draft at V = 49,152), so rejection sampling accepts
  with probability ``min(1, target / draft)`` instead of ``target``.

A request with penalties or token constraints (SamplingParams.has_logits_processors) has its
draft logits processed first, each draft with the output before it (the committed output, the
drafter's path and the call's earlier drafts; engine/logits_processors.py), exactly as the
verifier processes the row it verifies that draft against: greedy drafts are then the argmax
of the processed logits, so drafts keep being accepted.

Logits come in the target's id space, ``[1, vocab_size]`` (a drafter whose vocabulary is a
subset puts ``-inf`` at the ids it cannot propose), so the coupled noise of column ``x`` is the
target's noise of token ``x``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specmesh.engine.logits_processors import RowsHistory, apply_logits_processors
from specmesh.engine.sampling import COUPLED, GREEDY, processed_probs, sampling_mode, seeds_tensor
from specmesh.kernels.coupled_sample import gumbel_sample
from specmesh.protocol.messages import SamplingParams


@dataclass(frozen=True)
class DraftSampling:
    """The sampling of one request's next drafts.

    ``sampling``: the request's parameters (DraftSync.sampling). ``first_position``: the output
    position of the first draft asked for (0 is the prefill worker's first token; draft ``j``
    of the call sits at ``first_position + j``). ``generator``: the drafter's randomness for
    unseeded sampled requests (torch's default generator when None). ``with_probs``: return the
    rows of unseeded sampled drafts (the verifier's rule uses them). ``prompt_token_ids`` /
    ``output_token_ids``: the request's prompt and its output before the call's first draft
    (committed + path), the history of the penalties and token constraints; the drafts
    :meth:`choose` picks are appended to that history for the next ones (index ``i`` sees the
    call's drafts ``0 .. i-1``). ``token_probs``: a greedy draft comes with its probability
    (a float: the softmax of the logits it is the argmax of) in place of a row, sent as
    DraftTailStream.draft_token_probs for the verifier's confidence budget, which calibrates
    it (decode/confidence_calibration.py); the draft itself is unchanged.
    """

    sampling: SamplingParams
    first_position: int
    generator: torch.Generator | None = None
    with_probs: bool = True
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    _drafted: list[int] = field(default_factory=list, repr=False, compare=False)
    token_probs: bool = False

    @property
    def processes(self) -> bool:
        """Whether draft logits go through the request's penalties and token constraints
        (then even a greedy request's drafts are picked here, not by a plain argmax)."""
        return self.sampling.has_logits_processors

    @property
    def mode(self) -> str:
        """specmesh.engine.sampling's mode: ``greedy``, ``coupled`` or ``random``."""
        return sampling_mode(self.sampling)

    @property
    def sends_probs(self) -> bool:
        """Whether drafts of this request come with their rows."""
        return self.with_probs and self.mode not in (GREEDY, COUPLED)

    def choose(self, logits: torch.Tensor, index: int) -> tuple[int, torch.Tensor | None]:
        """Draft ``index`` of the call (output position ``first_position + index``) from draft
        logits ``[1, vocab_size]`` in the target's id space.

        Returns:
            ``(token_id, row)``: ``row`` float32 ``[vocab_size]`` on the CPU, the distribution
            the token was drawn from, when :attr:`sends_probs`; else None.

        Raises:
            ValueError: logits not ``[1, V]``, or parameters out of range.
        """
        if logits.dim() != 2 or logits.shape[0] != 1:
            raise ValueError(f"draft logits must be [1, vocab_size], got {tuple(logits.shape)}")
        del self._drafted[index:]
        token, row = self._choose(self._processed(logits, index), index)
        self._drafted.append(token)
        return token, row

    def _processed(self, logits: torch.Tensor, index: int) -> torch.Tensor:
        """``logits`` (a copy) through the request's penalties and token constraints with the
        output before draft ``index``; unchanged without any."""
        if not self.processes:
            return logits
        history = list(self.output_token_ids) + self._drafted[:index]
        return apply_logits_processors(logits.clone(), [RowsHistory(
            self.sampling, self.prompt_token_ids, history, 0)])

    def _choose(self, logits: torch.Tensor, index: int) -> tuple[int, torch.Tensor | None]:
        mode = self.mode
        if mode == GREEDY:
            token = int(logits[0].argmax())
            return token, (token_probs(logits, [token])[0] if self.token_probs else None)
        probs = processed_probs(logits, [self.sampling])  # float32 [1, V]
        if mode == COUPLED:
            seeds = seeds_tensor([self.sampling], logits.device)
            pos = torch.tensor([self.first_position + index], dtype=torch.int64,
                               device=logits.device)
            return int(gumbel_sample(probs.contiguous(), seeds, pos)[0]), None
        # the exponential race argmax(probs / E), E ~ Exp(1): a sample of probs
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        token = int((probs / noise).argmax())
        return token, (probs[0].to("cpu") if self.with_probs else None)


def token_probs(logits: torch.Tensor, token_ids: Sequence[int]) -> list[float]:
    """Per row ``i`` of ``logits`` ``[n, vocab]``, the softmax probability of
    ``token_ids[i]`` (``exp(logit - logsumexp)`` in float32: one reduction per row, no ``[n,
    vocab]`` softmax kept). A greedy draft's ``q`` for DraftTailStream.draft_token_probs."""
    x = logits.float()
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=x.device)
    picked = x.gather(-1, ids[:, None])[:, 0]
    return torch.exp(picked - torch.logsumexp(x, dim=-1)).tolist()


def target_space_logits(logits: torch.Tensor, vocab_size: int,
                        target_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Draft logits ``[1, n]`` laid out over the target's ``vocab_size`` ids: column ``i`` goes
    to id ``target_ids[i]`` (None: ids ``0 .. n-1``, the first ``min(n, vocab_size)`` kept);
    ids no column maps to get ``-inf`` (never drafted).

    Raises:
        ValueError: ``target_ids`` of another length than the columns.
    """
    n = logits.shape[-1]
    if target_ids is None:
        if n == vocab_size:
            return logits
        out = logits.new_full((1, vocab_size), float("-inf"))
        m = min(n, vocab_size)
        out[:, :m] = logits[:, :m]
        return out
    if target_ids.shape != (n,):
        raise ValueError(f"{tuple(target_ids.shape)} target ids for {n} draft logits")
    out = logits.new_full((1, vocab_size), float("-inf"))
    out[:, target_ids.to(logits.device)] = logits
    return out


__all__ = ["DraftSampling", "target_space_logits", "token_probs"]
