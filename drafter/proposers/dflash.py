"""DFlash: a block drafter whose attention context is the target's own hidden states (z-lab,
DFlash, arXiv 2602.06036; vLLM ``DFlashProposer``, SGLang ``dflash_worker_v2.py``; the model
is drafter/dflash_model.py, trained by ``specmesh train-drafter --method dflash``).

Seed state ``"hidden:L1,L2,..."`` (the target layers the checkpoint was trained on, side by
side; ``"hidden"``, the final-norm state, for a checkpoint without feature layers): the
prefill worker ships the row at the last prompt position, each VerifyCommit one row per
committed token, a DraftSync the verifier's window (decode/seed_state.py). Each row becomes
the K/V of its position in every draft layer as it arrives (:meth:`observe_seed_state`,
drafter/dflash_kv.py): the context KV holds target states at committed positions only, and
the draft's forwards never write to it, so there is no draft / draft-extend split and no
rollback of it (a DraftSync or a gap restarts it from the rows sent).

Each ``propose_many`` is ONE block forward for all requests: per request ``[the tokens after
the last context row, MASK x block]`` (always the ``block`` mask rows it was trained with; the
first ``n`` give the drafts asked for) (usually the bonus token alone; with run-ahead also the
path's drafts past the committed prefix, at most ``block`` of them), non-causal over the
context KV and the block; mask row j's logits give draft j. The context starts at the last
prompt position (what PrefillDone carries), so the prompt reaches the draft only through that
row; training sees the same context (drafter/dflash_training.py).

Drafts follow the request's sampling (drafter/draft_sampling.py): argmax for greedy requests
(with its probability when the verifier's confidence budget asks, ``returns_token_probs``),
the coupled rule's Gumbel-max for seeded ones, a sample of the row's processed distribution,
sent as DraftTailStream.draft_probs, for unseeded sampled ones. A mask row's distribution
depends on the context and the block's real tokens, never on the drafts of the same forward,
so rejection sampling against it stays exact.

Sizes, for the bench's per-method table: :attr:`DFlashProposer.draft_weights_bytes` (the
draft's own weights in memory; the target's embedding and LM head are borrowed, not counted)
and :attr:`DFlashProposer.draft_kv_pool_bytes` (the most context KV the requests held at
once, capacity included); the seed-state bytes are counted by the verifier (``seed_state_bytes``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specmesh.drafter.dflash_files import (
    load_dflash,
    quantize_draft,
    read_dflash_config,
    shipped_dflash,
)
from specmesh.drafter.dflash_kv import ContextKV
from specmesh.drafter.dflash_model import MASK, DFlashDraft
from specmesh.drafter.draft_sampling import DraftSampling, target_space_logits, token_probs
from specmesh.drafter.options import Option, OptionSchema
from specmesh.drafter.proposer import DraftTarget, ProposeCall, Proposer, shipped_or_raise
from specmesh.drafter.registry import register_proposer
from specmesh.drafter.training.dflash import train_dflash
from specmesh.engine.backend import default_backend
from specmesh.engine.devices import resolve_device
from specmesh.engine.dtypes import MODEL_DTYPES, model_dtype
from specmesh.engine.loader import model_files, model_name
from specmesh.engine.sampling import GREEDY

log = logging.getLogger(__name__)


@dataclass
class DFlashStats:
    """num_block_forwards: one per propose_many that drafted; num_block_rows: rows fed to
    them (real tokens and masks); num_context_rows: target hidden-state rows written into
    context KVs; num_tokens_drafted; num_no_context: proposes answered [] for want of
    context rows (none yet, or too many run-ahead tokens past them)."""

    num_block_forwards: int = 0
    num_block_rows: int = 0
    num_context_rows: int = 0
    num_tokens_drafted: int = 0
    num_no_context: int = 0
    peak_kv_bytes: int = 0


def _train(prep: dict, args) -> dict:  # noqa: ANN001
    """``specmesh train-drafter --method dflash``: drafter/training/dflash.py."""
    return train_dflash(prep, args, DFlashProposer)


@register_proposer
class DFlashProposer(Proposer):
    """Drafts a block per forward from the target's hidden states (module docstring).

    Args:
        draft: the loaded :class:`DFlashDraft` (its ``embed`` / ``lm_head`` the target's).
        max_run_ahead: most tokens past the last context row besides the bonus token that a
            block may carry (default: what the draft was trained for, its config's
            ``run_ahead_limit``); a context further ahead gets no drafts until the next commit.
    """

    name = "dflash"
    summary = ("DFlash block drafter: one forward over [bonus token, mask x k] attending to the "
               "target's hidden states, no embedding or LM head of its own (the draft shipped "
               "for the target, or one from specmesh train-drafter --method dflash)")
    options = OptionSchema((
        Option("model", "path", "the DFlash checkpoint directory (specmesh train-drafter "
               "--method dflash --out DIR)", "the draft shipped for the target",
               positional=True),
        Option("dtype", str, "dtype of the draft's weights", "the cluster's dtype",
               choices=tuple(d for d in MODEL_DTYPES if d != "float16")),
    ))
    trainer = staticmethod(_train)
    seed_state = "hidden"
    returns_draft_probs = True
    returns_token_probs = True
    runs_a_model = True

    @classmethod
    def create(cls, kwargs: dict, target: DraftTarget) -> DFlashProposer:
        """The draft at ``kwargs["model"]`` (default: the one shipped for the target) on the
        target's embedding and LM head, in ``dtype`` (default the cluster's).

        Raises:
            FileNotFoundError: no checkpoint given and none shipped for the target.
            drafter.eagle.checkpoint.HeadMismatch: trained for another target.
        """
        kwargs = dict(kwargs)
        name, files = model_name(target.model), model_files(target.model)
        path = kwargs.pop("model", None) or shipped_or_raise(shipped_dflash(name),
                                                             "DFlash draft", name, "dflash")
        dtype = model_dtype(kwargs.pop("dtype", target.dtype))
        backend = target.backend if target.backend is not None else default_backend()
        draft = load_dflash(path, files, name, dtype, resolve_device(target.device), backend)
        on_blocks = quantize_draft(draft, backend)
        log.info("DFlash draft %s for %s: %d layers, block %d, seed state %s, %.2f M "
                 "parameters, %d of %d draft-vocabulary rows scored, %d products on Q8_0 "
                 "blocks", path, name, draft.config.num_layers, draft.config.block,
                 draft.config.seed_state, draft.num_own_parameters() / 1e6,
                 draft.config.num_draft_logits, draft.config.vocab_size, on_blocks)
        return cls(draft, **kwargs)

    @classmethod
    def seed_state_for(cls, kwargs: dict, target: DraftTarget | None = None) -> str:
        """The checkpoint's seed state (its config.json only); ``"hidden"`` when none can be
        found (the drafter then fails at startup with the reason)."""
        if isinstance(kwargs.get("draft"), DFlashDraft):
            return kwargs["draft"].config.seed_state
        try:
            path = kwargs.get("model") or shipped_dflash(
                model_name(target.model if target is not None else None))
            return read_dflash_config(path).seed_state if path else cls.seed_state
        except (OSError, ValueError) as err:
            log.warning("DFlash seed state: %s; assuming %r", err, cls.seed_state)
            return cls.seed_state

    def __init__(self, draft: DFlashDraft, max_run_ahead: int | None = None) -> None:
        self.draft = draft
        self.block = draft.config.block
        self.max_run_ahead = (draft.config.run_ahead_limit if max_run_ahead is None
                              else max_run_ahead)
        if self.max_run_ahead < 0:
            raise ValueError(f"max_run_ahead must be >= 0, got {self.max_run_ahead}")
        self.seed_state = draft.config.seed_state
        self.seed_hidden_size = draft.config.seed_width
        self.vocab_size = draft.config.vocab_size
        self.stats = DFlashStats()
        self._ctx: dict[str, ContextKV] = {}

    # -- sizes -----------------------------------------------------------------------------

    @property
    def draft_weights_bytes(self) -> int:
        """Bytes of the draft's own weights in memory (the target's are borrowed)."""
        return self.draft.own_weight_bytes()

    @property
    def draft_kv_pool_bytes(self) -> int:
        """The most bytes of context KV the open requests held at once (capacity included;
        drafter/draft_memory.py): sampled after each commit's rows, and read now."""
        return max(self.stats.peak_kv_bytes, self._kv_held())

    def _kv_held(self) -> int:
        return sum(c.nbytes for c in self._ctx.values())

    # -- interface -------------------------------------------------------------------------

    def open(self, request_id: str, context_token_ids: list[int]) -> None:
        """(Re-)start a request with an empty context KV (its rows come with the seed
        state)."""
        self._ctx[request_id] = ContextKV()

    def observe_seed_state(self, request_id: str, start_position: int,
                           hidden: torch.Tensor) -> None:
        """Write the K/V of target rows ``hidden`` [n, seed width] at positions
        ``start_position ..`` into the request's context KV (module docstring).

        Raises:
            ValueError: rows of another width (the drafter asks for a DraftSync).
        """
        ctx = self._ctx.get(request_id)
        if ctx is None or hidden.shape[0] == 0:
            return
        with torch.inference_mode():
            pos = torch.arange(start_position, start_position + hidden.shape[0],
                               device=self.draft.embed.device)
            ctx.write(start_position, self.draft.context_kv(
                hidden.to(self.draft.embed.device), pos))
        self.stats.num_context_rows += hidden.shape[0]
        self.stats.peak_kv_bytes = max(self.stats.peak_kv_bytes, self._kv_held())

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
        """Drafts for several requests with ONE block forward for all of them. Each request
        gets ``min(num_tokens, block)`` drafts, none when it has no context row, when its
        context runs more than ``max_run_ahead`` tokens past them, or when it holds an id
        outside the vocabulary. The context KV is left as it was."""
        out: list[tuple[list[int], list[torch.Tensor | None]]] = [([], []) for _ in calls]
        blocks, where = [], []
        for i, c in enumerate(calls):
            plan = self._plan(c)
            if plan is not None:
                blocks.append(plan[0])
                where.append((i, plan[1]))
        if not blocks:
            return out
        hidden = self.draft.block_hidden(blocks)
        self.stats.num_block_forwards += 1
        self.stats.num_block_rows += hidden.shape[0]
        lo = 0
        for (i, n), (_, ids, _) in zip(where, blocks):
            lo += len(ids)
            first = lo - self.block  # the block's mask rows: the first n are the drafts
            logits = self.draft.logits(hidden[first:first + n]).float()
            out[i] = self._pick(logits, calls[i].how)
            self.stats.num_tokens_drafted += n
        return out

    def _plan(self, c: ProposeCall):  # noqa: ANN202
        """``((context K/V, block ids, block start), number of drafts)`` of call ``c``, or
        None: no drafts for it."""
        ctx = self._ctx.get(c.request_id)
        ids = c.context_token_ids
        L = len(ids)
        if c.num_tokens <= 0 or not ids or min(ids) < 0 or max(ids) >= self.vocab_size:
            return None
        if ctx is None or ctx.length == 0 or ctx.start > L - 1:
            self.stats.num_no_context += 1
            return None
        use = min(ctx.end, L - 1)  # rows at positions < use; the block starts at use
        if use <= ctx.start and self.draft.config.anchor_input:  # no row before the block
            self.stats.num_no_context += 1
            return None
        if L - 1 - use > self.max_run_ahead:
            self.stats.num_no_context += 1
            return None
        # always the block it was trained with (k mask rows), however many drafts are wanted
        n = min(c.num_tokens, self.block)
        return (ctx.layers(use), list(ids[use:]) + [MASK] * self.block, use), n

    def _pick(self, logits: torch.Tensor, how: DraftSampling | None
              ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Drafts from the mask rows' logits [n, num_draft_logits] (row j: draft j; a draft
        vocabulary's rows are laid out over the target's ids, -inf elsewhere, before a
        sampled pick, so ``draft_probs`` is the distribution the draft was drawn from)."""
        draft = self.draft
        if how is None or (how.mode == GREEDY and not how.processes):
            cols = logits.argmax(dim=-1)
            ids = draft.target_ids(cols).tolist()
            if how is not None and how.token_probs:  # q for the verifier's confidence budget
                return ids, token_probs(logits, cols.tolist())
            return ids, [None] * len(ids)
        drafts, rows = [], []
        to_target = draft.draft_to_target if draft.config.draft_vocab_size else None
        for j in range(logits.shape[0]):
            row = target_space_logits(logits[j:j + 1], self.vocab_size, to_target)
            tok, row = how.choose(row, j)
            drafts.append(tok)
            rows.append(row)
        return drafts, rows

    def rollback(self, request_id: str, num_context_tokens: int) -> None:
        """Forget context rows of positions past the kept context (a row at position i
        depends on tokens 0 .. i)."""
        ctx = self._ctx.get(request_id)
        if ctx is not None:
            ctx.truncate(num_context_tokens)

    def close(self, request_id: str) -> None:
        self._ctx.pop(request_id, None)

    def num_context_rows(self, request_id: str) -> int:
        """Context rows held for ``request_id`` (0 if unknown)."""
        ctx = self._ctx.get(request_id)
        return ctx.length if ctx is not None else 0
