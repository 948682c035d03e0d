"""Paged KV block allocator and slot arithmetic (pure Python, no torch)."""

from __future__ import annotations


class KVCacheExhausted(RuntimeError):
    """Not enough free KV blocks for an allocation; nothing was allocated."""


class BlockManager:
    """Hands out KV block ids ``0 .. num_blocks-1``; each block holds ``block_size`` tokens.

    A block may be held by several block tables at once (:meth:`share`: the full prompt blocks
    of sibling requests, decode/siblings.py, which never write them again); it returns to the
    pool when the last holder frees it (a reference count per block).

    Raises:
        ValueError: ``num_blocks < 0`` or ``block_size < 1``.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Pop from the end: the lowest ids go out first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._is_free: list[bool] = [True] * num_blocks
        self._refs: dict[int, int] = {}  # holders beyond the first, of shared blocks only

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to :meth:`allocate`."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks currently allocated."""
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (ceil division).

        Raises:
            ValueError: ``num_tokens < 0``.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        """True if :meth:`allocate` of ``num_blocks`` would succeed."""
        return 0 <= num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks and return their ids.

        Raises:
            KVCacheExhausted: fewer than ``num_blocks`` are free (nothing is allocated).
            ValueError: ``num_blocks < 0``.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self._free):
            raise KVCacheExhausted(
                f"need {num_blocks} KV blocks, only {len(self._free)} of {self.num_blocks} free"
            )
        ids = [self._free.pop() for _ in range(num_blocks)]
        for i in ids:
            self._is_free[i] = False
        return ids

    def share(self, block_ids: list[int]) -> list[int]:
        """One more holder for each of ``block_ids`` (allocated blocks); returns them, for the
        new holder's block table. Each holder frees them once.

        Raises:
            ValueError: an unknown or free id (nothing is shared then).
        """
        self._check(block_ids)
        for i in block_ids:
            self._refs[i] = self._refs.get(i, 0) + 1
        return list(block_ids)

    def num_holders(self, block_id: int) -> int:
        """Block tables holding ``block_id`` (0: free)."""
        return 0 if self._is_free[block_id] else 1 + self._refs.get(block_id, 0)

    def _check(self, block_ids: list[int]) -> None:
        seen: dict[int, int] = {}
        for i in block_ids:
            if not isinstance(i, int) or not 0 <= i < self.num_blocks:
                raise ValueError(f"unknown KV block id {i!r} (pool has {self.num_blocks})")
            seen[i] = seen.get(i, 0) + 1
            if self._is_free[i] or seen[i] > 1 + self._refs.get(i, 0):
                raise ValueError(f"double free of KV block {i}")

    def free(self, block_ids: list[int]) -> None:
        """Give up one hold on each block; a block no table holds any more returns to the pool.
        Validates all ids before freeing any.

        Raises:
            ValueError: an unknown id, an id that is already free, or an id given more times
                than it has holders.
        """
        self._check(block_ids)
        for i in reversed(block_ids):
            refs = self._refs.get(i, 0)
            if refs:
                if refs == 1:
                    del self._refs[i]
                else:
                    self._refs[i] = refs - 1
                continue
            self._is_free[i] = True
            self._free.append(i)


def slot_mapping(block_table: list[int], start: int, num_tokens: int, block_size: int) -> list[int]:
    """Cache slots of positions ``start .. start+num_tokens-1`` of one request.

    slot = block_table[pos // block_size] * block_size + pos % block_size.

    Raises:
        ValueError: negative ``start``/``num_tokens``, or ``block_table`` too short to cover
            ``start + num_tokens`` positions.
    """
    if start < 0 or num_tokens < 0:
        raise ValueError(f"start and num_tokens must be >= 0, got {start}, {num_tokens}")
    end = start + num_tokens
    if end > len(block_table) * block_size:
        raise ValueError(
            f"block table of {len(block_table)} blocks x {block_size} covers "
            f"{len(block_table) * block_size} positions, need {end}"
        )
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
