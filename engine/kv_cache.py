"""Paged KV cache: one tensor [num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim]."""

from __future__ import annotations

import torch

from specmesh.engine.block_manager import slot_mapping
from specmesh.engine.config import ModelConfig
from specmesh.engine.dtypes import model_dtype


def _bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * itemsize


def num_blocks_for_memory(
    config: ModelConfig, block_size: int, dtype: str | torch.dtype, budget_bytes: int
) -> int:
    """How many KV blocks of ``block_size`` tokens fit in ``budget_bytes`` (floor).

    Raises:
        ValueError: ``block_size < 1`` or an unsupported dtype.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    per_block = _bytes_per_token(config, model_dtype(dtype)) * block_size
    return max(0, int(budget_bytes) // per_block)


class KVCache:
    """Key/value storage for all layers, addressed by slot = block_id * block_size + offset.

    ``data[layer, 0]`` holds keys and ``data[layer, 1]`` values, each [num_slots, H, D] with
    H = ``num_kv_heads``, D = ``head_dim``. Keys are stored after RoPE. Block ids come from a
    :class:`~engine.block_manager.BlockManager` of the same ``num_blocks``/``block_size``.

    ``dtype`` is the model's, or for a float32 model bfloat16 or float16 (``--kv-cache-dtype``,
    :func:`engine.dtypes.resolve_kv_cache_dtype`): :meth:`write` rounds the model's K/V to it
    (round to nearest even), and every attention path reads the stored values (widened
    exactly), so a verify step reads the same K/V a one-token step would.

    ``shared_file``: the engine.shared_kv.SharedKVFile whose mapping holds ``data`` when the
    pool is shared with a frozen-KV drafter (kept alive with the cache), else None.

    Raises:
        ValueError: ``num_blocks < 1``, ``block_size < 1`` or an unsupported dtype.
    """

    shared_file = None

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: str | torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        storage: torch.Tensor | None = None,
    ) -> None:
        """``storage``: a zeroed tensor of the cache's shape and dtype to keep the KV in
        instead of a new one (the pool in shared memory a frozen-KV drafter reads,
        engine/shared_kv.py); ValueError when its shape, dtype or device differ."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = model_dtype(dtype)
        self.device = torch.device(device)
        self.num_layers = config.num_layers
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        shape = (config.num_layers, 2, num_blocks * block_size, config.num_kv_heads,
                 config.head_dim)
        if storage is not None and (tuple(storage.shape) != shape or storage.dtype != self.dtype
                                    or storage.device != self.device):
            raise ValueError(f"storage {tuple(storage.shape)} {storage.dtype} on "
                             f"{storage.device} != the cache's {shape} {self.dtype} on "
                             f"{self.device}")
        self.data = storage if storage is not None else torch.zeros(
            shape, dtype=self.dtype, device=self.device)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token over all layers (keys and values)."""
        return _bytes_per_token(self.config, self.dtype)

    @property
    def num_slots(self) -> int:
        """Token slots in the cache (num_blocks * block_size)."""
        return self.num_blocks * self.block_size

    def _slots(self, block_table: list[int], start: int, num_tokens: int) -> torch.Tensor:
        for b in block_table[: -(-(start + num_tokens) // self.block_size)]:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block id {b} out of range [0, {self.num_blocks})")
        slots = slot_mapping(block_table, start, num_tokens, self.block_size)
        return torch.tensor(slots, dtype=torch.long, device=self.device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys/values of T tokens of one layer.

        Args:
            slots: LongTensor [T] of cache slots.
            k, v: [T, H, D], converted to the cache dtype (round to nearest even) when
                theirs differs.
        """
        self.data[layer, 0].index_copy_(0, slots, k.to(self.dtype))
        self.data[layer, 1].index_copy_(0, slots, v.to(self.dtype))

    def copy_positions(self, block_table: list[int], src_positions: list[int],
                       dst_positions: list[int]) -> None:
        """Copy the keys and values of every layer from positions ``src_positions`` to
        ``dst_positions`` of one request (all sources are read before any write, so the two
        may overlap). Tree verification's compaction: the accepted path's rows move to the
        positions right after the committed prefix (keys keep their RoPE, which was applied
        at the destination position already, engine/token_tree.py).

        Raises:
            ValueError: lists of different lengths, a negative position, or a position the
                block table does not cover (nothing is copied then).
        """
        if len(src_positions) != len(dst_positions):
            raise ValueError(f"{len(src_positions)} source and {len(dst_positions)} "
                             "destination positions")
        if not src_positions:
            return
        positions = list(src_positions) + list(dst_positions)
        if min(positions) < 0 or max(positions) >= len(block_table) * self.block_size:
            raise ValueError(f"positions must lie in [0, {len(block_table) * self.block_size})")
        bs = self.block_size

        def slots(ps: list[int]) -> torch.Tensor:
            return torch.tensor([block_table[p // bs] * bs + p % bs for p in ps],
                                dtype=torch.long, device=self.device)

        for b in {block_table[p // bs] for p in positions}:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block id {b} out of range [0, {self.num_blocks})")
        rows = self.data.index_select(2, slots(src_positions))
        self.data.index_copy_(2, slots(dst_positions), rows)

    def copy_blocks(self, src_blocks: list[int], dst_blocks: list[int]) -> None:
        """Copy every layer's keys and values of whole blocks ``src_blocks[i]`` into
        ``dst_blocks[i]`` (a sibling request's own copy of a prompt block it will write past,
        decode/siblings.py). Sources and destinations must not overlap.

        Raises:
            ValueError: lists of different lengths, a block id out of range, or a block in
                both lists (nothing is copied then).
        """
        if len(src_blocks) != len(dst_blocks):
            raise ValueError(f"{len(src_blocks)} source and {len(dst_blocks)} destination blocks")
        for b in list(src_blocks) + list(dst_blocks):
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block id {b} out of range [0, {self.num_blocks})")
        if set(src_blocks) & set(dst_blocks):
            raise ValueError("a block is both a source and a destination")
        if not src_blocks:
            return
        bs = self.block_size

        def slots(blocks: list[int]) -> torch.Tensor:
            return torch.tensor([b * bs + j for b in blocks for j in range(bs)],
                                dtype=torch.long, device=self.device)

        self.data.index_copy_(2, slots(dst_blocks), self.data.index_select(2, slots(src_blocks)))

    def layer_blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (no copy) of one layer's keys and values as [num_blocks, block_size, H, D]:
        the layout :func:`kernels.paged_attention.paged_attention` reads through block tables."""
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return self.data[layer, 0].view(shape), self.data[layer, 1].view(shape)

    def gather(
        self, layer: int, block_table: list[int] | torch.Tensor, kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``0 .. kv_len-1`` of one request.

        Returns:
            (k, v), each [kv_len, H, D] (copies).
        """
        nb = -(-kv_len // self.block_size)
        if not isinstance(block_table, torch.Tensor):
            block_table = torch.tensor(block_table[:nb], dtype=torch.long, device=self.device)
        blocks = self.data[layer].view(
            2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim
        )
        kv = blocks.index_select(1, block_table[:nb]).flatten(1, 2)[:, :kv_len]
        return kv[0], kv[1]

    def _check_layers(self, layer_start: int, layer_end: int) -> None:
        if not 0 <= layer_start < layer_end <= self.num_layers:
            raise ValueError(
                f"bad layer range [{layer_start}, {layer_end}) for {self.num_layers} layers"
            )

    def read_chunk(
        self,
        layer_start: int,
        layer_end: int,
        block_table: list[int],
        token_start: int,
        num_tokens: int,
    ) -> torch.Tensor:
        """KV of layers [layer_start, layer_end) at positions [token_start, token_start+num_tokens).

        Returns:
            Tensor [L, 2, num_tokens, H, D], L = layer_end - layer_start (a contiguous copy).

        Raises:
            ValueError: bad layer range, block table too short or a block id out of range.
        """
        self._check_layers(layer_start, layer_end)
        slots = self._slots(block_table, token_start, num_tokens)
        return self.data[layer_start:layer_end].index_select(2, slots)

    def write_chunk(
        self,
        layer_start: int,
        layer_end: int,
        block_table: list[int],
        token_start: int,
        kv: torch.Tensor,
    ) -> None:
        """Inverse of :meth:`read_chunk`: store ``kv`` [L, 2, num_tokens, H, D].

        Raises:
            ValueError: bad layer range, wrong shape or dtype, block table too short or a block
                id out of range. Nothing is written then.
        """
        self._check_layers(layer_start, layer_end)
        if kv.dim() != 5:
            raise ValueError(f"kv must be [L, 2, T, H, D], got shape {tuple(kv.shape)}")
        want = (layer_end - layer_start, 2, kv.shape[2], self.num_kv_heads, self.head_dim)
        if tuple(kv.shape) != want:
            raise ValueError(f"kv shape {tuple(kv.shape)} != expected {want}")
        if kv.dtype != self.dtype:
            raise ValueError(f"kv dtype {kv.dtype} != cache dtype {self.dtype}")
        slots = self._slots(block_table, token_start, kv.shape[2])
        self.data[layer_start:layer_end].index_copy_(2, slots, kv.to(self.device))
