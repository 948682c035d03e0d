"""ModelRunner: validated batched ragged forward (prefill, decode, verify), chunked prefill and
batched prefill of whole prompts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmesh.engine.config import ModelConfig
from specmesh.engine.hidden_layers import check_hidden_layers
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.model import AttentionMetadata, LlamaForCausalLM
from specmesh.engine.token_tree import ancestry_mask, check_parents, chunk_positions, is_chain
from specmesh.kernels.paged_attention_plan import NARROW_KV_DTYPES


@dataclass
class SeqChunk:
    """One request's query tokens in a batched forward.

    ``start_pos`` is the absolute position of ``token_ids[0]``; the KV of positions
    ``[0, start_pos)`` already lies in the cache. ``block_table`` must cover
    ``start_pos + len(token_ids)`` positions.

    ``parents`` (a verify chunk over a token tree, engine/token_tree.py): one per token after
    the first, the parent's index among those tokens (-1: ``token_ids[0]``, the root). Row i's
    KV still goes to position ``start_pos + i``, but its RoPE position is ``start_pos +
    depth`` and it attends to the KV before the chunk plus its ancestors and itself only. None
    (or a chain's parents) is the plain causal chunk.

    ``adapter``: the LoRA adapter slot of the model's bank (engine/lora.py) every row of the
    chunk runs with; -1 is the base model.
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    parents: list[int] | None = None
    adapter: int = -1

    @property
    def end_pos(self) -> int:
        """KV length after this chunk: start_pos + len(token_ids)."""
        return self.start_pos + len(self.token_ids)


class ModelRunner:
    """Runs ``model`` over a list of :class:`SeqChunk` using ``kv_cache``.

    Logits come back in float32, or in float64 for a float64 model (bf16/fp16 logits are
    upcast exactly after ``lm_head``).

    The cache is in the model dtype, or in bfloat16 / float16 for a float32 model on the CPU
    (``--kv-cache-dtype``; the Triton kernel reads q's dtype only).

    Raises:
        ValueError: any other pair of cache and model dtypes, or a 16-bit cache of a float32
            model off the CPU.
    """

    def __init__(self, model: LlamaForCausalLM, config: ModelConfig, kv_cache: KVCache) -> None:
        if kv_cache.dtype != model.dtype:
            if kv_cache.dtype not in NARROW_KV_DTYPES.get(model.dtype, ()):
                raise ValueError(f"KV cache dtype {kv_cache.dtype} != model dtype {model.dtype}"
                                 " (a float32 model may have a bfloat16 or float16 cache)")
            if model.device.type != "cpu" or kv_cache.device.type != "cpu":
                raise ValueError(f"a {kv_cache.dtype} KV cache of a {model.dtype} model runs on "
                                 f"the CPU only, got {model.device}")
        self.model = model
        self.config = config
        self.kv_cache = kv_cache
        self.device = model.device
        self.block_size = kv_cache.block_size

    def _validate(self, chunks: list[SeqChunk]) -> None:
        if not chunks:
            raise ValueError("forward needs at least one chunk")
        cfg, cache = self.config, self.kv_cache
        for i, c in enumerate(chunks):
            if not c.token_ids:
                raise ValueError(f"chunk {i} has no tokens")
            if c.start_pos < 0:
                raise ValueError(f"chunk {i}: start_pos {c.start_pos} < 0")
            if c.end_pos > cfg.max_position_embeddings:
                raise ValueError(
                    f"chunk {i}: positions up to {c.end_pos - 1} exceed "
                    f"max_position_embeddings={cfg.max_position_embeddings}"
                )
            need = -(-c.end_pos // self.block_size)
            if len(c.block_table) < need:
                raise ValueError(
                    f"chunk {i}: block table has {len(c.block_table)} blocks, positions "
                    f"[0, {c.end_pos}) need {need} of size {self.block_size}"
                )
            if c.adapter != -1 and (self.model.lora is None
                                    or c.adapter not in self.model.lora.adapters):
                raise ValueError(f"chunk {i}: no LoRA adapter in slot {c.adapter}")
            for b in c.block_table[:need]:
                if not 0 <= b < cache.num_blocks:
                    raise ValueError(
                        f"chunk {i}: block id {b} out of range [0, {cache.num_blocks})"
                    )
            if min(c.token_ids) < 0 or max(c.token_ids) >= cfg.vocab_size:
                raise ValueError(f"chunk {i}: token id out of range [0, {cfg.vocab_size})")
            if c.parents is not None:
                if len(c.parents) != len(c.token_ids) - 1:
                    raise ValueError(f"chunk {i}: {len(c.parents)} parents for "
                                     f"{len(c.token_ids) - 1} tree nodes")
                try:
                    check_parents(c.parents)
                except ValueError as err:
                    raise ValueError(f"chunk {i}: {err}") from None

    def forward(
        self, chunks: list[SeqChunk], logits: str = "all", return_hidden: bool = False,
        hidden_layers: tuple[int, ...] | None = None, paged: bool = False,
    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One batched forward over all chunks; writes their K/V into the cache.

        Args:
            logits: "all" -> per chunk [q_len, vocab]; "last" -> per chunk [1, vocab] (the row
                of its last token; lm_head runs only on those rows).
            return_hidden: also return per chunk the final hidden states [q_len, hidden_size]
                (all rows, final-norm output), or with ``hidden_layers`` those decoder layers'
                outputs side by side, [q_len, len(hidden_layers) * hidden_size].
            paged: whole prompts too attend through the paged kernel (AttentionMetadata's
                ``paged``: each row's result is the same wherever its chunk starts).

        Returns:
            list of logits per chunk, or (logits list, hidden list) when ``return_hidden``.

        Raises:
            ValueError: no chunks, an empty chunk, a negative start, a position beyond
                ``max_position_embeddings``, a block table too short or with an out-of-range
                block id, a token id outside the vocabulary, tree ``parents`` of the wrong
                length or not pointing to an earlier node, or an unknown ``logits`` mode.
        """
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        self._validate(chunks)
        if hidden_layers is not None:
            check_hidden_layers(tuple(hidden_layers), self.config.num_layers)
        q_lens = [len(c.token_ids) for c in chunks]
        ids: list[int] = []
        pos: list[int] = []
        masks: list[torch.Tensor | None] = []
        for c in chunks:
            ids += c.token_ids
            tree = c.parents is not None and not is_chain(c.parents)
            if tree:
                pos += chunk_positions(c.start_pos, c.parents)
            else:
                pos += range(c.start_pos, c.end_pos)
            masks.append(ancestry_mask(c.parents) if tree else None)
        meta = AttentionMetadata.build(
            q_lens, [c.start_pos for c in chunks], [c.block_table for c in chunks],
            self.block_size, self.device, tree_masks=masks, paged=paged,
        )
        ends = torch.tensor(q_lens).cumsum(0)
        rows = None if logits == "all" else (ends - 1).to(self.device)
        adapter_rows = None
        if any(c.adapter != -1 for c in chunks):
            adapter_rows = torch.tensor([c.adapter for c in chunks]).repeat_interleave(
                torch.tensor(q_lens)).to(self.device)
        with torch.inference_mode():
            out = self.model(
                torch.tensor(ids, dtype=torch.long, device=self.device),
                torch.tensor(pos, dtype=torch.long, device=self.device),
                meta,
                self.kv_cache,
                return_hidden=return_hidden,
                logits_indices=rows,
                hidden_layers=hidden_layers,
                adapter_rows=adapter_rows,
            )
            all_logits, hidden = out if return_hidden else (out, None)
            if all_logits.dtype in (torch.bfloat16, torch.float16):
                all_logits = all_logits.float()
        sizes = q_lens if logits == "all" else [1] * len(chunks)
        per_chunk = list(all_logits.split(sizes))
        if return_hidden:
            return per_chunk, list(hidden.split(q_lens))
        return per_chunk

    def prefill(
        self,
        token_ids: list[int],
        block_table: list[int],
        chunk_size: int | None = None,
        start_pos: int = 0,
        return_hidden: bool = False,
        hidden_layers: tuple[int, ...] | None = None,
        paged: bool = False,
        logits: str = "last",
        adapter: int = -1,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run one prompt (positions start_pos ..) in chunks of ``chunk_size`` tokens (all at once
        when None) and return the logits of its last token, [1, vocab]; with ``logits="all"``
        those of every token run, [len(token_ids), vocab] (prompt logprobs).

        With ``return_hidden`` also returns the final hidden states of all prompt tokens
        [len(token_ids), hidden_size] (``hidden_layers``, ``paged``: as :meth:`forward`; with
        ``paged`` the KV and logits do not depend on ``chunk_size`` or ``start_pos``, bit for
        bit: a prompt's tail run over its cached prefix equals the whole prompt run).
        ``adapter``: the LoRA adapter slot the prompt runs with (-1: the base model).

        Raises:
            ValueError: as :meth:`forward`, or ``chunk_size < 1``.
        """
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self._validate([SeqChunk(list(token_ids), start_pos, block_table, adapter=adapter)])
        step = chunk_size or len(token_ids)
        hiddens: list[torch.Tensor] = []
        rows: list[torch.Tensor] = []
        for lo in range(0, len(token_ids), step):
            chunk = SeqChunk(token_ids[lo : lo + step], start_pos + lo, block_table,
                             adapter=adapter)
            out = self.forward([chunk], logits=logits, return_hidden=return_hidden,
                               hidden_layers=hidden_layers, paged=paged)
            if return_hidden:
                out, hidden = out
                hiddens.append(hidden[0])
            rows.append(out[0])
        result = rows[-1] if logits == "last" else torch.cat(rows)
        if return_hidden:
            return result, torch.cat(hiddens)
        return result

    def prefill_batch(
        self,
        prompts: list[list[int]],
        block_tables: list[list[int]],
        return_hidden: bool = False,
        hidden_layers: tuple[int, ...] | None = None,
        start_positions: list[int] | None = None,
        paged: bool = False,
        logits: str = "last",
        adapters: list[int] | None = None,
    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Run several whole prompts (each from position 0, into its own ``block_tables``
        entry) in ONE forward and return, per prompt, the logits of its last token [1, vocab]
        (``logits="all"``: of every token run, [len, vocab]: prompt logprobs).
        ``start_positions`` (None: all 0): prompt i's tokens start there, the KV before them
        already in its blocks (a prefix cache hit; use with ``paged``, as :meth:`prefill`).
        ``adapters`` (None: all base): prompt i's LoRA adapter slot (-1: the base model).

        Each prompt computes exactly as :meth:`prefill` computes it alone in one chunk: a forward
        of whole prompts attends within each prompt (causal, one attention call per prompt) and
        every other op is row-invariant (docs/architecture.md, 'Batch invariance'), so its K/V
        and logits do not depend on the other prompts. The caller keeps the forward's size in
        check (a prompt longer than a chunk runs alone through :meth:`prefill`).

        With ``return_hidden`` also returns per prompt its hidden states [len, hidden_size]
        (``hidden_layers``, ``paged``: as :meth:`forward`).

        Raises:
            ValueError: as :meth:`forward`, or ``prompts``, ``block_tables`` and
                ``start_positions`` of different lengths.
        """
        starts = [0] * len(prompts) if start_positions is None else list(start_positions)
        if not len(prompts) == len(block_tables) == len(starts):
            raise ValueError(f"{len(prompts)} prompts, {len(block_tables)} block tables and "
                             f"{len(starts)} start positions")
        slots = [-1] * len(prompts) if adapters is None else list(adapters)
        if len(slots) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts and {len(slots)} adapters")
        chunks = [SeqChunk(list(p), s, t, adapter=a)
                  for p, t, s, a in zip(prompts, block_tables, starts, slots)]
        return self.forward(chunks, logits=logits, return_hidden=return_hidden,
                            hidden_layers=hidden_layers, paged=paged)
