"""The prefill's prefix cache as a plain class: chained block keys, matching, reference
counts, LRU eviction under pressure, and never evicting a block in use."""

from __future__ import annotations

import pytest

from specmesh.prefill.prefix_cache import PrefixCache, block_keys


def test_keys_chain_over_full_blocks_only():
    keys = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(keys) == 2  # the partial block [9] has no key
    # block 1's key depends on block 0's tokens: same tokens after another prefix differ
    other = block_keys([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert other[0] != keys[0] and other[1] != keys[1]
    assert block_keys([1, 2, 3, 4, 5, 6, 7, 8, 0, 0], 4) == keys
    assert block_keys([5, 6, 7, 8], 4)[0] != keys[1]  # a key names the whole prefix
    with pytest.raises(ValueError, match="block_size"):
        block_keys([1], 0)


def test_match_takes_the_longest_cached_run_and_counts_references():
    cache = PrefixCache(4)
    keys = block_keys(list(range(12)), 4)
    assert cache.match(keys, 3) == []
    assert cache.insert(keys, [7, 8, 9]) == [7, 8, 9]
    cache.release([7, 8, 9])
    assert cache.num_evictable_blocks == 3
    # a prompt sharing the first two blocks only, then another third block
    other = block_keys(list(range(8)) + [50, 51, 52, 53], 4)
    assert cache.match(other, 3) == [7, 8]
    assert cache.ref_count(7) == 1 and cache.ref_count(9) == 0
    assert cache.match(keys, 2) == [7, 8]  # max_blocks caps the match
    assert cache.ref_count(8) == 2 and cache.num_evictable_blocks == 1
    cache.release([7, 8])
    cache.release([7, 8])
    assert cache.ref_count(7) == 0 and cache.num_evictable_blocks == 3
    with pytest.raises(ValueError, match="not a cached block in use"):
        cache.release([7])
    with pytest.raises(ValueError, match="not a cached block in use"):
        cache.release([42])


def test_num_matching_counts_what_match_would_take_and_acquires_nothing():
    cache = PrefixCache(4)
    keys = block_keys(list(range(12)), 4)
    assert cache.num_matching(keys, 3) == 0
    cache.release(cache.insert(keys[:2], [7, 8]))
    assert cache.num_matching(keys, 3) == 2 and cache.num_matching(keys, 1) == 1
    assert cache.num_matching(keys, 0) == 0 and cache.num_matching(keys, -1) == 0
    assert cache.ref_count(7) == 0 and cache.num_evictable_blocks == 2  # nothing acquired
    assert cache.num_matching(keys, 3) == len(cache.match(keys, 3))


def test_insert_keeps_the_cached_block_of_a_key_seen_before():
    cache = PrefixCache(2)
    keys = block_keys([1, 2, 3, 4], 2)
    assert cache.insert(keys, [0, 1]) == [0, 1]
    # the same blocks computed again into other blocks: the cache keeps its own
    assert cache.insert(keys, [5, 6]) == []
    assert cache.num_cached_blocks == 2
    with pytest.raises(ValueError, match="cached under another key"):
        cache.insert(block_keys([9, 9], 2), [0])
    with pytest.raises(ValueError, match="2 keys but 1 block ids"):
        cache.insert(keys, [3])


def test_eviction_is_lru_tail_first_and_never_takes_a_block_in_use():
    cache = PrefixCache(2)
    a = block_keys([1, 1, 2, 2, 3, 3], 2)
    b = block_keys([4, 4, 5, 5], 2)
    cache.release(cache.insert(a, [0, 1, 2]))  # a's tail block (2) is its oldest
    cache.release(cache.insert(b, [3, 4]))
    held = cache.match(a, 3)  # a in use again
    assert held == [0, 1, 2]
    # under pressure only b's blocks can go, tail first
    assert cache.evict(5) == [4, 3]
    assert cache.num_evictable_blocks == 0 and cache.num_cached_blocks == 3
    assert cache.evict(1) == []
    cache.release(held)
    assert cache.evict(1) == [2]  # a's tail first
    assert cache.match(a, 3) == [0, 1]  # its prefix still matches
    cache.release([0, 1])
    # a block touched most recently goes last
    cache.release(cache.insert(b, [3, 4]))
    assert cache.match(a, 1) == [0]
    cache.release([0])
    assert cache.clear() == [1, 4, 3, 0]
    assert cache.num_cached_blocks == 0
