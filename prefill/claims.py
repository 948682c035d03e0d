"""The KV blocks a prefill batch holds in its worker while it runs: cached prefix blocks it
reuses (prefill/prefix_cache.py) and new blocks it computes into, claimed before the forward
and handed back after it (the new full blocks to the prefix cache when their KV was computed).

Prefix caching follows vLLM's automatic prefix caching: a prompt reuses the longest cached run
of its leading full blocks that still leaves its last token to compute (whose logits give the
first token); least recently used unreferenced cached blocks are evicted for room.
"""

from __future__ import annotations

from dataclasses import dataclass

from specmesh.engine.block_manager import BlockManager
from specmesh.prefill.prefix_cache import PrefixCache, block_keys
from specmesh.protocol.messages import PrefillRequest


@dataclass
class Claim:
    """One request's blocks in this worker during its prefill: ``held``, the cached prefix
    blocks it reuses (acquired from the prefix cache), then ``new``, the blocks it computes into;
    ``keys``: its full blocks' chained keys (empty with prefix caching off)."""

    held: list[int]
    new: list[int]
    keys: list[bytes]

    @property
    def table(self) -> list[int]:
        """The request's block table in this worker."""
        return self.held + self.new


def can_allocate(bm: BlockManager, cache: PrefixCache | None, num_blocks: int) -> bool:
    """``num_blocks`` blocks are free or can be freed by evicting unused cached ones."""
    evictable = cache.num_evictable_blocks if cache else 0
    return 0 <= num_blocks <= bm.num_free_blocks + evictable


def allocate(bm: BlockManager, cache: PrefixCache | None, num_blocks: int) -> list[int]:
    """``num_blocks`` free blocks, evicting least recently used cached ones for room."""
    short = num_blocks - bm.num_free_blocks
    if short > 0 and cache is not None:
        bm.free(cache.evict(short))
    return bm.allocate(num_blocks)


def tokens_to_compute(cache: PrefixCache | None, req: PrefillRequest, block_size: int) -> int:
    """Prompt tokens a prefill of ``req`` would run through the forward if it started now: its
    length less the cached prefix :func:`claim_blocks` would reuse (the batching decision's
    size, so a cache hit is counted as the short forward it is)."""
    n = len(req.prompt_token_ids)
    if cache is None or req.sampling.prompt_logprobs is not None:
        return n
    keys = block_keys(req.prompt_token_ids, block_size, salt=req.lora_name)
    held = cache.num_matching(keys, (n - 1) // block_size)
    return n - held * block_size


def claim_blocks(bm: BlockManager, cache: PrefixCache | None,
                 reqs: list[PrefillRequest]) -> list[Claim]:
    """Per request its blocks: with prefix caching (``cache`` not None), the longest cached run
    of its leading full blocks that leaves its last token to compute (whose logits give the
    first token), then new blocks for the rest. On failure nothing stays claimed.

    Raises:
        KVCacheExhausted: not enough blocks, even after evicting every unused cached one.
    """
    claims: list[Claim] = []
    try:
        for req in reqs:
            n = len(req.prompt_token_ids)
            claim = Claim([], [], [])
            claims.append(claim)
            if cache is not None:
                claim.keys = block_keys(req.prompt_token_ids, bm.block_size,
                                        salt=req.lora_name)
                # prompt logprobs need every prompt row's logits: nothing reused
                if req.sampling.prompt_logprobs is None:
                    claim.held = cache.match(claim.keys, (n - 1) // bm.block_size)
            claim.new = allocate(bm, cache, bm.blocks_for(n) - len(claim.held))
    except BaseException:
        unclaim(bm, cache, claims, keep=False)
        raise
    return claims


def unclaim(bm: BlockManager, cache: PrefixCache | None, claims: list[Claim],
            keep: bool) -> None:
    """Hand back a batch's blocks; with ``keep`` (their KV computed) each request's new
    full blocks go to the prefix cache first, where it has none under their keys yet."""
    for claim in claims:
        taken: list[int] = []
        if cache is not None:
            if keep:
                n_held = len(claim.held)
                taken = cache.insert(claim.keys[n_held:],
                                     claim.new[:len(claim.keys) - n_held])
            cache.release(claim.held + taken)
        kept = set(taken)
        bm.free([b for b in claim.new if b not in kept])
