"""Automatic prefix caching of the prefill worker: the KV blocks of prompts already prefilled,
found again by their tokens (vLLM's automatic prefix caching, SGLang's radix cache).

A full KV block is indexed by a chained hash of its tokens: block i's key is
``sha256(key of block i-1 || token ids of block i)`` (block 0's parent is empty), so a key
names the whole prefix up to the end of its block and a prompt's cached prefix is the longest
run of its leading block keys present (vLLM's hash chain). Only full blocks are cached. A
cached block is referenced by the prompts using it (``ref_count``); one no prompt uses stays
in the cache, evictable, in least-recently-used order, until the worker needs its room for a
new prompt. A prompt's blocks are released tail first, so its last blocks are evicted before
the prefix blocks other prompts are likelier to share.

Pure Python: block ids come from and go back to the worker's
:class:`~engine.block_manager.BlockManager`; this class only decides which ids it keeps.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass


def block_keys(token_ids: list[int], block_size: int, salt: str = "") -> list[bytes]:
    """The chained keys of the full blocks of ``token_ids`` (``len // block_size`` of them).
    ``salt``: what else the KV depends on (the LoRA adapter's name, "" the base model; vLLM's
    extra keys): the chain starts from its hash, so no adapter reuses another's blocks.

    Raises:
        ValueError: ``block_size`` < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    keys: list[bytes] = []
    parent = hashlib.sha256(salt.encode()).digest() if salt else b""
    for lo in range(0, len(token_ids) - block_size + 1, block_size):
        tokens = array("q", token_ids[lo:lo + block_size]).tobytes()
        parent = hashlib.sha256(parent + tokens).digest()
        keys.append(parent)
    return keys


@dataclass
class _Entry:
    block_id: int
    ref_count: int = 0


class PrefixCache:
    """Full KV blocks of past prompts by chained block key, with reference counts and LRU
    eviction of the blocks no prompt uses.

    Protocol per prompt: :meth:`match` (acquires the cached prefix's blocks), compute the rest,
    :meth:`insert` (hands the prompt's new full blocks to the cache), then :meth:`release` of
    every block :meth:`match` or :meth:`insert` returned as held by the prompt.
    """

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._entries: dict[bytes, _Entry] = {}
        self._key_of: dict[int, bytes] = {}  # block id -> its key
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # unused entries, oldest first

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the cache holds (in use or not)."""
        return len(self._entries)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no prompt uses: :meth:`evict` can hand them back."""
        return len(self._lru)

    def ref_count(self, block_id: int) -> int:
        """Prompts using cached block ``block_id`` (0 for an unused one).

        Raises:
            KeyError: the block is not cached.
        """
        return self._entries[self._key_of[block_id]].ref_count

    def num_matching(self, keys: list[bytes], max_blocks: int) -> int:
        """How many blocks :meth:`match` would return now, acquiring nothing."""
        count = 0
        for key in keys[:max(max_blocks, 0)]:
            if key not in self._entries:
                break
            count += 1
        return count

    def match(self, keys: list[bytes], max_blocks: int) -> list[int]:
        """The block ids of the longest cached run of ``keys`` from the first, at most
        ``max_blocks`` of them, each acquired (its reference count + 1) until :meth:`release`."""
        ids: list[int] = []
        for key in keys[:max(max_blocks, 0)]:
            entry = self._entries.get(key)
            if entry is None:
                break
            if entry.ref_count == 0:
                del self._lru[key]
            entry.ref_count += 1
            ids.append(entry.block_id)
        return ids

    def insert(self, keys: list[bytes], block_ids: list[int]) -> list[int]:
        """Offer a computed prompt's full blocks (``block_ids[i]`` holds the block of
        ``keys[i]``). A key not cached yet takes its block, acquired for the prompt; a key
        cached already (a block matched, or one this prompt computed again) keeps its block.
        Returns the offered ids the cache took (the caller releases them with the rest; the
        others stay the caller's to free).

        Raises:
            ValueError: lists of different lengths, or an id the cache holds under another key.
        """
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys but {len(block_ids)} block ids")
        taken: list[int] = []
        for key, block_id in zip(keys, block_ids):
            if key in self._entries:
                continue
            if block_id in self._key_of:
                raise ValueError(f"block {block_id} is cached under another key")
            self._entries[key] = _Entry(block_id, ref_count=1)
            self._key_of[block_id] = key
            taken.append(block_id)
        return taken

    def release(self, block_ids: list[int]) -> None:
        """A prompt is done with these cached blocks (in prompt order): reference counts - 1;
        a block no prompt uses any more becomes evictable, the prompt's later blocks first.

        Raises:
            ValueError: a block not cached or not in use (nothing is released then).
        """
        for block_id in block_ids:
            key = self._key_of.get(block_id)
            if key is None or self._entries[key].ref_count < 1:
                raise ValueError(f"block {block_id} is not a cached block in use")
        for block_id in reversed(block_ids):  # tail blocks become the oldest: evicted first
            entry = self._entries[self._key_of[block_id]]
            entry.ref_count -= 1
            if entry.ref_count == 0:
                self._lru[self._key_of[block_id]] = None

    def evict(self, num_blocks: int) -> list[int]:
        """Drop up to ``num_blocks`` unused blocks, least recently used first, and return
        their ids (the caller frees them). Blocks in use are never evicted."""
        out: list[int] = []
        while self._lru and len(out) < num_blocks:
            key, _ = self._lru.popitem(last=False)
            block_id = self._entries.pop(key).block_id
            del self._key_of[block_id]
            out.append(block_id)
        return out

    def clear(self) -> list[int]:
        """Evict every unused block; returns their ids."""
        return self.evict(len(self._lru))
