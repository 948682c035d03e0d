"""PARD: a parallel draft model that drafts a whole block in one forward (An et al., "PARD:
Accelerating LLM Inference with Low-Cost PARallel Draft Model Adaptation", arXiv 2504.18583;
AMD-AGI/PARD ``pard_infer.py``; vLLM runs such checkpoints as ``draft_model`` with
``parallel_drafting``).

The draft is a small LM of the target's shape and vocabulary (its first layers, trained by
``specmesh train-drafter --method pard``, drafter/pard_training.py) with its own paged KV over
the request's context. Each ``propose`` is ONE forward over [the context tokens the KV does
not hold yet, MASK x (k - 1)] (drafter/pard_block.py): the last context token's logits give
draft 1, mask j's give draft j + 1. A chain drafter pays k forwards for k drafts (step cost
1 + k c); this one pays one (1 + c), at the price of drafts that never saw each other. The
same forward extends the KV by the newly committed tokens; the mask rows' K/V lie past the
cached length afterwards and are overwritten by the next forward. As for ``draft-model``,
token ids decide what the KV holds (the longest common prefix with the context is kept), so
correctness never depends on ``rollback`` (which only frees blocks early). Seed state across
prefill -> decode: none beyond tokens (the first propose prefills the prompt in the draft).

Drafts follow the request's sampling (drafter/draft_sampling.py): argmax for greedy requests,
the coupled rule's Gumbel-max for seeded ones, a sample of the processed distribution of its
row, sent as DraftTailStream.draft_probs, for unseeded sampled ones. Each row's distribution
does not depend on the drafts before it, so rejection sampling against it stays exact. The
mask id itself is never drafted (its logit is -inf: with tied embeddings its LM-head row is
the learned mask vector).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from specmesh.drafter.draft_lm_kv import DraftLMKV, DraftLMStats, draft_lm_options
from specmesh.drafter.draft_sampling import DraftSampling, target_space_logits, token_probs
from specmesh.drafter.options import Option
from specmesh.drafter.pard_block import block_input, common_prefix
from specmesh.drafter.pard_files import build_pard_model, shipped_pard, target_name_and_files
from specmesh.drafter.proposer import DraftTarget, ProposeCall, Proposer
from specmesh.drafter.registry import register_proposer
from specmesh.drafter.training.pard import train_pard
from specmesh.engine.devices import resolve_device
from specmesh.engine.dtypes import model_dtype
from specmesh.engine.runner import SeqChunk
from specmesh.engine.sampling import GREEDY

log = logging.getLogger(__name__)

#: default KV memory of the draft, MiB (SmolLM2 2 layers fp32: ~87,000 tokens)
DEFAULT_KV_CACHE_MB = 128
#: an uncached tail longer than this is prefilled (chunked, last logits only) before the
#: block forward, so a prompt's logits over the whole vocabulary are never computed
CATCH_UP_LIMIT = 32


@dataclass
class PardStats(DraftLMStats):
    """num_forwards: block forwards (one per propose_many) + catch-up chunks; rows fed
    (num_tokens_computed) are context tails and mask tokens."""

    num_block_forwards: int = 0


def _train(prep: dict, args) -> dict:  # noqa: ANN001
    """``specmesh train-drafter --method pard``: drafter/training/pard.py."""
    return train_pard(prep, args, PardProposer)


@register_proposer
class PardProposer(DraftLMKV, Proposer):
    """Drafts a block per forward with a PARD draft model (module docstring).

    Args:
        model: the draft, an ``engine.model.LlamaForCausalLM`` (:func:`build_pard_model`).
        config: its ``engine.config.ModelConfig``.
        mask_token_id: the id whose embedding is the mask vector.
        block: K, the most drafts one forward makes (what it was trained for).
        num_blocks, block_size: the KV pool (``num_blocks`` None: ``kv_cache_mb`` MiB).
        max_model_len: longest context + drafts (default and cap: the model's).
        prefill_chunk_size: most tokens of one catch-up forward.
        target_vocab_size: the target's embedding rows (width of a draft row).

    Raises:
        ValueError: a KV pool of no block, bad sizes, a mask id outside the vocabulary.
    """

    name = "pard"
    summary = ("PARD parallel draft model: one forward over [last token, mask x (k-1)] drafts "
               "k tokens (the draft shipped for the target, or one from specmesh "
               "train-drafter --method pard)")
    options = draft_lm_options(
        Option("model", "path", "the PARD checkpoint directory (specmesh train-drafter "
               "--method pard --out DIR)", "the draft shipped for the target", positional=True),
        DEFAULT_KV_CACHE_MB)
    trainer = staticmethod(_train)
    trainer_reads_features = False
    returns_draft_probs = True
    returns_token_probs = True
    runs_a_model = True
    kv_owner = "PARD draft"

    @classmethod
    def create(cls, kwargs: dict, target: DraftTarget) -> PardProposer:
        """The draft at ``kwargs["model"]`` (default: the one shipped for the target) built on
        the target's embedding and LM head, in ``dtype`` (default the cluster's).

        Raises:
            FileNotFoundError: no checkpoint given and none shipped for the target.
            drafter.eagle.checkpoint.HeadMismatch: trained for another target.
        """
        kwargs = dict(kwargs)
        name, files = target_name_and_files(target.model)
        path = kwargs.pop("model", None) or shipped_pard(name)
        if path is None:
            raise FileNotFoundError(f"no PARD draft shipped for {name!r}: train one with "
                                    "`specmesh train-drafter --method pard` and pass "
                                    "--drafter pard:PATH")
        dtype = kwargs.pop("dtype", target.dtype)
        device = resolve_device(kwargs.pop("device", target.device))
        model, config, meta = build_pard_model(path, files, name, model_dtype(dtype), device,
                                               target.backend)
        log.info("PARD draft %s for %s: %d layers, block %d, mask id %d", path, name,
                 config.num_layers, meta["block"], meta["mask_token_id"])
        return cls(model, config, int(meta["mask_token_id"]), int(meta["block"]),
                   block_size=target.block_size, target_vocab_size=config.vocab_size, **kwargs)

    def __init__(self, model: Any, config: Any, mask_token_id: int, block: int, *,
                 num_blocks: int | None = None, block_size: int = 16,
                 kv_cache_mb: int = DEFAULT_KV_CACHE_MB, max_model_len: int | None = None,
                 prefill_chunk_size: int = 512, target_vocab_size: int | None = None) -> None:
        if not 0 <= mask_token_id < config.vocab_size:
            raise ValueError(f"mask token id {mask_token_id} is outside the draft's vocabulary "
                             f"[0, {config.vocab_size})")
        if block < 1 or block_size < 1 or prefill_chunk_size < 1:
            raise ValueError(f"need block, block_size, prefill_chunk_size >= 1; got {block}, "
                             f"{block_size}, {prefill_chunk_size}")
        self.model, self.config = model, config
        self.mask_token_id, self.block = int(mask_token_id), int(block)
        self.stats = PardStats()
        self._init_kv(model, config, num_blocks=num_blocks, block_size=block_size,
                      kv_cache_mb=kv_cache_mb, max_model_len=max_model_len,
                      prefill_chunk_size=prefill_chunk_size, target_vocab_size=target_vocab_size)

    def propose(self, request_id: str, context_token_ids: list[int], num_tokens: int) -> list[int]:
        """Greedy drafts (at most ``block``) continuing ``context_token_ids``."""
        return self.propose_many([ProposeCall(request_id, context_token_ids, num_tokens)])[0][0]

    def propose_sampled(self, request_id: str, context_token_ids: list[int], num_tokens: int,
                        how: DraftSampling) -> tuple[list[int], list[torch.Tensor | None]]:
        """Drafts for ``how`` and their rows (module docstring)."""
        return self.propose_many([ProposeCall(request_id, context_token_ids, num_tokens,
                                              how)])[0]

    @torch.inference_mode()
    def propose_many(self, calls: list[ProposeCall]
                     ) -> list[tuple[list[int], list[torch.Tensor | None]]]:
        """Drafts for several requests with ONE block forward for all of them (plus a chunked
        catch-up forward for a request whose uncached context is longer than
        :data:`CATCH_UP_LIMIT`, e.g. its prompt). Each request gets ``min(num_tokens, block)``
        drafts, fewer where ``max_model_len`` or the free KV blocks leave no room, none for an
        empty context or one holding an id outside the draft's vocabulary. Afterwards the KV
        holds each request's context."""
        out: list[tuple[list[int], list[torch.Tensor | None]]] = [([], []) for _ in calls]
        chunks, plans = [], []
        for i, c in enumerate(calls):
            plan = self._plan(c)
            if plan is not None:
                chunk, n = plan
                chunks.append(chunk)
                plans.append((i, n))
        if not chunks:
            return out
        logits = self.runner.forward(chunks, logits="all")
        self.stats.num_forwards += 1
        self.stats.num_block_forwards += 1
        self.stats.num_tokens_computed += sum(len(ch.token_ids) for ch in chunks)
        for (i, n), lg in zip(plans, logits):
            out[i] = self._pick_block(lg[-n:], calls[i].how)
            self.stats.num_tokens_drafted += n
        return out

    def _plan(self, c: ProposeCall) -> tuple[SeqChunk, int] | None:
        """The block chunk of call ``c`` and its number of drafts, after the catch-up forward
        when one is needed; None: no drafts for it."""
        ctx = list(c.context_token_ids)
        if c.num_tokens <= 0 or not ctx:
            return None
        seq = self._usable_seq(c.request_id, ctx)
        if seq is None:
            return None
        n_ctx = len(ctx)
        self._truncate(seq, common_prefix(seq.tokens, ctx[:-1]))
        n = self._reserve(seq, c.request_id, n_ctx, min(c.num_tokens, self.block))
        if n < 1:
            return None
        cached = len(seq.tokens)
        if n_ctx - 1 - cached > CATCH_UP_LIMIT:  # the prompt: KV only, chunked
            self._prefill(seq, ctx[cached:-1], cached)
            cached = n_ctx - 1
        blk = block_input(ctx, cached, n, self.mask_token_id)
        seq.tokens[:] = ctx  # the block forward writes the rest of the context's K/V
        return SeqChunk(blk.token_ids, blk.start_pos, seq.block_table), n

    def _pick_block(self, logits: torch.Tensor, how: DraftSampling | None
                    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Drafts from the block's rows [n, vocab] (row j: draft j + 1), never the mask id."""
        logits = logits[:, :self.draft_vocab_limit].clone()
        if self.mask_token_id < self.draft_vocab_limit:
            logits[:, self.mask_token_id] = float("-inf")
        if how is None or (how.mode == GREEDY and not how.processes):
            ids = logits.argmax(dim=-1).tolist()
            if how is not None and how.token_probs:  # q for the verifier's confidence budget
                return ids, token_probs(logits, ids)
            return ids, [None] * len(ids)
        drafts, rows = [], []
        for j in range(logits.shape[0]):
            full = target_space_logits(logits[j:j + 1], self.target_vocab_size)
            tok, row = how.choose(full, j)
            drafts.append(tok)
            rows.append(row)
        return drafts, rows
