"""DSpark: a parallel block drafter with a sequential refund (DeepSeek, arXiv 2607.05147; SGLang
``dspark_components``, vLLM ``dspark``; the chapter's DSpark section).

The block is PARD's (drafter/proposers/pard.py): ONE forward of the draft model over [the
context tokens its KV does not hold yet, MASK x (k - 1)] gives every block position its base
logits and hidden state. Parallel drafts never see each other; DSpark's Markov head
(drafter/dspark_markov.py) then walks the block once, biasing position j's logits by the token
drafted at position j - 1 (for j = 0, the last context token) through a rank-r correction
(``vanilla``, ``gated`` or ``rnn``), with no further transformer forward: the step costs one
forward plus k small products (1 + c, not a chain's 1 + k c). Its confidence head predicts
each draft's survival given that the drafts before it survived, sent as
DraftTailStream.draft_confidences (``returns_draft_confidences``; the verifier's confidence
budget, ``--speculative-policy confidence``, uses them as sent).

Drafts follow the request's sampling (drafter/draft_sampling.py), position by position along
the walk: greedy requests take the argmax of the corrected logits (with the draft's softmax
probability, DraftTailStream.draft_token_probs), seeded ones the coupled Gumbel-max sample,
unseeded sampled ones a sample of the request's processed distribution of the corrected logits
(temperature, top-k, top-p, min-p), sent as the ``draft_probs`` row: that row is the
distribution the draft was drawn from given the drafts before it, which is what rejection
sampling needs to stay exact. The mask id is never drafted.

Checkpoints: drafter/dspark_files.py (``specmesh train-drafter --method dspark``,
drafter/training/dspark.py); the shipped one lives in drafter/heads/<target>/dspark/.
Seed state across prefill -> decode: none beyond tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from specmesh.drafter.draft_memory import resident_bytes
from specmesh.drafter.draft_lm_kv import draft_lm_options
from specmesh.drafter.draft_sampling import target_space_logits, token_probs
from specmesh.drafter.dspark_files import build_dspark, shipped_dspark
from specmesh.drafter.dspark_markov import MARKOV_KINDS, MarkovHead, markov_walk
from specmesh.drafter.head_confidences import WithConfidence
from specmesh.drafter.options import Option, OptionSchema
from specmesh.drafter.pard_files import target_name_and_files
from specmesh.drafter.proposer import DraftTarget, ProposeCall
from specmesh.drafter.proposers.pard import DEFAULT_KV_CACHE_MB, PardProposer, PardStats
from specmesh.drafter.registry import register_proposer
from specmesh.drafter.training.dspark import train_dspark
from specmesh.engine.devices import resolve_device
from specmesh.engine.dtypes import model_dtype
from specmesh.engine.sampling import GREEDY

log = logging.getLogger(__name__)


@dataclass
class DSparkStats(PardStats):
    """PARD's counters plus ``num_markov_steps`` (block positions walked by the Markov
    head)."""

    num_markov_steps: int = 0


def _train(prep: dict, args) -> dict:  # noqa: ANN001
    """``specmesh train-drafter --method dspark``: drafter/training/dspark.py."""
    return train_dspark(prep, args, DSparkProposer)


def _options() -> OptionSchema:
    base = draft_lm_options(
        Option("model", "path", "the DSpark checkpoint directory (specmesh train-drafter "
               "--method dspark --out DIR)", "the draft shipped for the target",
               positional=True),
        DEFAULT_KV_CACHE_MB)
    return OptionSchema(base.options + (
        Option("markov", str, "the Markov head the checkpoint must have (refused otherwise)",
               "the checkpoint's", choices=MARKOV_KINDS),
        Option("markov_rank", int, "the Markov rank the checkpoint must have (refused "
               "otherwise; rank 0 would be the pard method)", "the checkpoint's", minimum=1),
        Option("confidence", bool, "send the confidence head's predictions as the drafts' "
               "confidences (the verifier's confidence budget)", True),
    ))


@register_proposer
class DSparkProposer(PardProposer):
    """Drafts a block per forward and walks it with the Markov head (module docstring).

    Args:
        model, config, mask_token_id, block: the backbone, as for :class:`PardProposer`.
        head: the Markov and confidence heads (drafter/dspark_markov.py).
        confidence: send the confidence head's predictions (``returns_draft_confidences``).
        num_blocks, block_size, kv_cache_mb, max_model_len, prefill_chunk_size,
        target_vocab_size: as for :class:`PardProposer`.

    Raises:
        ValueError: as :class:`PardProposer`, or a head whose widths do not fit the model.
    """

    name = "dspark"
    summary = ("DSpark: PARD's one-forward mask block walked once by a Markov head (each draft "
               "biased by the one before it, no extra forward) with a confidence head whose "
               "survival predictions the confidence budget uses (the draft shipped for the "
               "target, or one from specmesh train-drafter --method dspark)")
    options = _options()
    trainer = staticmethod(_train)
    trainer_reads_features = False
    returns_draft_confidences = True
    kv_owner = "DSpark draft"

    @classmethod
    def create(cls, kwargs: dict, target: DraftTarget) -> DSparkProposer:
        """The draft at ``kwargs["model"]`` (default: the one shipped for the target) on the
        target's embedding and LM head, in ``dtype`` (default the cluster's).

        Raises:
            FileNotFoundError: no checkpoint given and none shipped for the target.
            ValueError: ``markov`` / ``markov_rank`` given and not the checkpoint's.
            drafter.eagle.checkpoint.HeadMismatch: trained for another target.
        """
        kwargs = dict(kwargs)
        name, files = target_name_and_files(target.model)
        path = kwargs.pop("model", None) or shipped_dspark(name)
        if path is None:
            raise FileNotFoundError(f"no DSpark draft shipped for {name!r}: train one with "
                                    "`specmesh train-drafter --method dspark` and pass "
                                    "--drafter dspark:PATH")
        want_kind, want_rank = kwargs.pop("markov", None), kwargs.pop("markov_rank", None)
        dtype = kwargs.pop("dtype", target.dtype)
        device = resolve_device(kwargs.pop("device", target.device))
        model, config, head, meta = build_dspark(path, files, name, model_dtype(dtype), device,
                                                 target.backend)
        for key, want in (("markov", want_kind), ("markov_rank", want_rank)):
            if want is not None and want != meta[key]:
                raise ValueError(f"dspark: {key}={want} asked, but the checkpoint {path} has "
                                 f"{key}={meta[key]} (the head is trained: retrain with "
                                 f"--{key.replace('_', '-')} {want})")
        log.info("DSpark draft %s for %s: %d layers, block %d, %s Markov head of rank %d",
                 path, name, config.num_layers, meta["block"], head.kind, head.rank)
        return cls(model, config, head, int(meta["mask_token_id"]), int(meta["block"]),
                   block_size=target.block_size, target_vocab_size=config.vocab_size, **kwargs)

    def __init__(self, model: Any, config: Any, head: MarkovHead, mask_token_id: int,
                 block: int, *, confidence: bool = True, **kwargs: Any) -> None:
        if head.hidden_size != config.hidden_size or head.vocab_size != config.vocab_size:
            raise ValueError(f"the Markov head (hidden {head.hidden_size}, vocabulary "
                             f"{head.vocab_size}) does not fit the draft (hidden "
                             f"{config.hidden_size}, vocabulary {config.vocab_size})")
        super().__init__(model, config, mask_token_id, block, **kwargs)
        self.head = head.to(model.device).float().eval()
        self.returns_draft_confidences = bool(confidence)
        self.stats = DSparkStats()

    @property
    def draft_weights_bytes(self) -> int:
        """Resident bytes of the draft LM's weights and of the Markov and confidence heads
        (the bench's per-method table, drafter/draft_memory.py)."""
        return self._weights_bytes + resident_bytes(self.head)

    @torch.inference_mode()
    def propose_many(self, calls: list[ProposeCall]
                     ) -> list[tuple[list[int], list[Any]]]:
        """Drafts for several requests: ONE block forward for all of them (plus PARD's chunked
        catch-up of a long uncached context), then one Markov walk of all their blocks. Each
        request gets ``min(num_tokens, block)`` drafts (fewer or none as for PARD); each row
        (None, a greedy draft's probability, or a sampled draft's distribution) comes as a
        :class:`~drafter.head_confidences.WithConfidence` when the confidences are sent."""
        out: list[tuple[list[int], list[Any]]] = [([], []) for _ in calls]
        chunks, plans = [], []
        for i, c in enumerate(calls):
            plan = self._plan(c)
            if plan is not None:
                chunks.append(plan[0])
                plans.append((i, plan[1]))
        if not chunks:
            return out
        logits, hidden = self.runner.forward(chunks, logits="all", return_hidden=True)
        self.stats.num_forwards += 1
        self.stats.num_block_forwards += 1
        self.stats.num_tokens_computed += sum(len(ch.token_ids) for ch in chunks)
        ns = [n for _, n in plans]
        hows = [calls[i].how for i, _ in plans]
        width, nmax = self.draft_vocab_limit, max(ns)
        base = logits[0].new_zeros((len(plans), nmax, width), dtype=torch.float32)
        hid = hidden[0].new_zeros((len(plans), nmax, hidden[0].shape[-1]))
        for b, (n, lg, hd) in enumerate(zip(ns, logits, hidden)):
            base[b, :n] = lg[-n:, :width].float()
            hid[b, :n] = hd[-n:]
        if self.mask_token_id < width:
            base[:, :, self.mask_token_id] = float("-inf")
        rows: list[list[Any]] = [[None] * n for n in ns]

        def pick(j: int, step_logits: torch.Tensor) -> torch.Tensor:
            tokens = step_logits.argmax(dim=-1)
            for b, how in enumerate(hows):
                if j < ns[b] and how is not None and (how.mode != GREEDY or how.processes):
                    full = target_space_logits(step_logits[b:b + 1], self.target_vocab_size)
                    tokens[b], rows[b][j] = how.choose(full, j)
            return tokens

        first_prev = torch.tensor([calls[i].context_token_ids[-1] for i, _ in plans],
                                  device=base.device)
        walk = markov_walk(self.head, base, hid, self.model.model.embed_tokens.weight,
                           first_prev, pick)
        self.stats.num_markov_steps += nmax
        for b, ((i, n), how) in enumerate(zip(plans, hows)):
            drafts = walk.tokens[b, :n].tolist()
            if how is not None and how.token_probs and how.mode == GREEDY and not how.processes:
                rows[b] = token_probs(walk.logits[b, :n], drafts)  # q for the budget
            if self.returns_draft_confidences:
                rows[b] = [WithConfidence(r, c)
                           for r, c in zip(rows[b], walk.confidences[b, :n].tolist())]
            out[i] = (drafts, rows[b])
            self.stats.num_tokens_drafted += n
        return out
