"""The paged KV of a draft LM over each request's context, shared by the drafters that run a
small causal LM of the target's vocabulary (drafter/proposers/draft_model.py, one forward per
draft; drafter/proposers/pard.py, one forward per block of drafts).

A request's KV holds a prefix of its context: ``tokens`` are the ids whose K/V lie at
positions ``0 .. len(tokens) - 1`` of its ``block_table`` (an ``engine.block_manager``
pool over an ``engine.kv_cache.KVCache``). Token ids, not calls, decide what the KV holds: a
drafter keeps the longest common prefix with the context it is given and recomputes the rest
(:meth:`DraftLMKV._prefill`), so correctness never depends on ``rollback``, which only frees
blocks early. A context the pool or ``max_model_len`` has no room for, or one holding an id
outside the draft's vocabulary, gets no drafts (logged once), never an error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from specmesh.drafter.draft_memory import resident_bytes
from specmesh.drafter.options import Option, OptionSchema
from specmesh.engine.block_manager import BlockManager
from specmesh.engine.kv_cache import KVCache, num_blocks_for_memory
from specmesh.engine.runner import ModelRunner

log = logging.getLogger(__name__)


def draft_lm_options(model: Option, default_kv_cache_mb: int) -> OptionSchema:
    """The ``--drafter METHOD:KEY=VALUE`` options of a draft-LM method (drafter/options.py):
    its checkpoint ``model``, the draft's ``dtype`` and its KV memory ``kv_cache_mb`` (MiB,
    default ``default_kv_cache_mb``)."""
    return OptionSchema((
        model,
        Option("dtype", str, "dtype of the draft model", "the cluster's dtype",
               choices=("float32", "bfloat16", "float64")),
        Option("kv_cache_mb", int, "KV memory of the draft model, MiB", default_kv_cache_mb,
               minimum=1),
    ))


@dataclass
class DraftSeq:
    """``tokens``: the context tokens whose K/V lie at positions 0 .. len-1 of
    ``block_table`` (which may hold more blocks)."""

    tokens: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)


@dataclass
class DraftLMStats:
    """Counters every draft LM keeps (a drafter's stats add its own)."""

    num_forwards: int = 0
    num_tokens_computed: int = 0  # rows fed to the draft LM (catch-up, drafting, masks)
    num_tokens_drafted: int = 0
    num_out_of_blocks: int = 0  # proposes answered [] for want of KV blocks
    num_out_of_vocab: int = 0  # proposes answered [] for a context id past the draft vocab


class DraftLMKV:
    """Mixin of a :class:`drafter.proposer.Proposer` running a draft LM with its own paged KV:
    the ``open`` / ``rollback`` / ``close`` of the Proposer interface, and the KV bookkeeping
    its ``propose`` uses. The subclass calls :meth:`_init_kv` in its constructor and keeps a
    ``stats`` with :class:`DraftLMStats`'s fields."""

    #: how the log and errors name the draft ("draft model", "PARD draft")
    kv_owner = "draft LM"
    stats: DraftLMStats

    def _init_kv(self, model: Any, config: Any, *, num_blocks: int | None, block_size: int,
                 kv_cache_mb: int, max_model_len: int | None, prefill_chunk_size: int,
                 target_vocab_size: int | None) -> None:
        """The KV pool of ``model`` (``num_blocks`` None: as many blocks of ``block_size``
        tokens as ``kv_cache_mb`` MiB hold), its runner, and the limits: ``max_model_len``
        (default and cap: the model's ``max_position_embeddings``), ``draft_vocab_limit``
        (drafts are ids below the draft's rows and the target's ``target_vocab_size``) and
        ``target_vocab_size`` (the width of a draft row).

        Raises:
            ValueError: the pool holds no block.
        """
        if num_blocks is None:
            num_blocks = num_blocks_for_memory(config, block_size, model.dtype,
                                               int(kv_cache_mb) << 20)
        if num_blocks < 1:
            raise ValueError(f"the {self.kv_owner}'s KV pool holds no block of {block_size} "
                             f"tokens (num_blocks={num_blocks}, kv_cache_mb={kv_cache_mb})")
        self.kv_cache = KVCache(config, num_blocks, block_size, model.dtype, model.device)
        self.runner = ModelRunner(model, config, self.kv_cache)
        self.block_manager = BlockManager(num_blocks, block_size)
        self.block_size = block_size
        self.prefill_chunk_size = prefill_chunk_size
        self.max_model_len = min(max_model_len or config.max_position_embeddings,
                                 config.max_position_embeddings)
        #: drafts are ids below this (the draft's rows, capped by the target's)
        self.draft_vocab_limit = min(config.vocab_size, target_vocab_size or config.vocab_size)
        #: width of a draft row (the target's embedding rows)
        self.target_vocab_size = target_vocab_size or config.vocab_size
        self._kv_vocab_size = config.vocab_size
        self._seqs: dict[str, DraftSeq] = {}
        self._warned: set[str] = set()
        self._weights_bytes = resident_bytes(model)  # measured once: the weights never change

    # -- what it costs the drafter (drafter/draft_memory.py) -------------------------------

    @property
    def draft_weights_bytes(self) -> int:
        """Resident bytes of the draft LM's weights (parameters, buffers, GGUF blocks)."""
        return self._weights_bytes

    @property
    def draft_kv_pool_bytes(self) -> int:
        """Bytes of the preallocated KV pool (all blocks, used or free)."""
        return resident_bytes(self.kv_cache.data)

    @property
    def num_draft_forwards(self) -> int:
        """Draft LM forwards so far (``stats.num_forwards``: drafting and catch-up chunks)."""
        return self.stats.num_forwards

    # -- the Proposer interface's KV part --------------------------------------------------

    def open(self, request_id: str, context_token_ids: list[int]) -> None:
        """(Re-)start a request with an empty KV; its first propose prefills its context."""
        self.close(request_id)
        self._seqs[request_id] = DraftSeq()

    def rollback(self, request_id: str, num_context_tokens: int) -> None:
        """Keep the K/V of the first ``num_context_tokens`` context tokens; free blocks past
        them."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            self._truncate(seq, max(0, min(num_context_tokens, len(seq.tokens))))

    def close(self, request_id: str) -> None:
        """Free the request's KV blocks and forget it (unknown ids are ignored)."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None and seq.block_table:
            self.block_manager.free(seq.block_table)

    def num_cached_tokens(self, request_id: str) -> int:
        """Context tokens whose K/V the draft holds for ``request_id`` (0 if unknown)."""
        seq = self._seqs.get(request_id)
        return len(seq.tokens) if seq is not None else 0

    # -- for propose -----------------------------------------------------------------------

    def _usable_seq(self, request_id: str, ctx: list[int]) -> DraftSeq | None:
        """The request's KV state (opened if unknown), or None (counted, logged once) when
        ``ctx`` holds an id outside the draft's vocabulary."""
        seq = self._seqs.setdefault(request_id, DraftSeq())
        if min(ctx) < 0 or max(ctx) >= self._kv_vocab_size:
            self.stats.num_out_of_vocab += 1
            self._warn_once("vocab", "context of %s holds a token id outside the %s's "
                            "vocabulary [0, %d): no drafts", request_id, self.kv_owner,
                            self._kv_vocab_size)
            return None
        return seq

    def _reserve(self, seq: DraftSeq, request_id: str, n_ctx: int, n: int) -> int:
        """How many of ``n`` wanted drafts fit after a context of ``n_ctx`` tokens (the KV
        must cover the context and every draft but the last), with the blocks for them
        allocated; 0 (counted, logged once, the request's blocks freed for the others) when
        the pool has no room for one, 0 silently when ``max_model_len`` has none."""
        n = min(n, self.max_model_len - n_ctx + 1)
        room = (len(seq.block_table) + self.block_manager.num_free_blocks) * self.block_size
        n = min(n, room - n_ctx + 1)
        if n < 1:
            if n_ctx <= self.max_model_len:
                self.stats.num_out_of_blocks += 1
                self._warn_once("blocks", "%s KV full (%d blocks of %d tokens): no drafts for "
                                "%s (%d context tokens)", self.kv_owner,
                                self.block_manager.num_blocks, self.block_size, request_id,
                                n_ctx)
                self._truncate(seq, 0)
            return 0
        need = self.block_manager.blocks_for(n_ctx + n - 1) - len(seq.block_table)
        if need > 0:
            seq.block_table += self.block_manager.allocate(need)
        return n

    def _prefill(self, seq: DraftSeq, token_ids: list[int], start_pos: int) -> torch.Tensor:
        """Write the K/V of ``token_ids`` at ``start_pos`` .. of the request's blocks
        (chunked by ``prefill_chunk_size``, counted in ``stats``); the last one's logits
        [1, vocab]. The caller records the tokens in ``seq.tokens``."""
        logits = self.runner.prefill(token_ids, seq.block_table,
                                     chunk_size=self.prefill_chunk_size, start_pos=start_pos)
        self.stats.num_tokens_computed += len(token_ids)
        self.stats.num_forwards += -(-len(token_ids) // self.prefill_chunk_size)
        return logits

    def _truncate(self, seq: DraftSeq, num_tokens: int) -> None:
        del seq.tokens[num_tokens:]
        keep = self.block_manager.blocks_for(num_tokens)
        if len(seq.block_table) > keep:
            self.block_manager.free(seq.block_table[keep:])
            del seq.block_table[keep:]

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key in self._warned:
            log.debug(msg, *args)
        else:
            self._warned.add(key)
            log.warning(msg + " (logged once)", *args)
