"""BlockManager allocation, exhaustion, double free, and slot arithmetic."""

from __future__ import annotations

import pytest

from specmesh.engine.block_manager import BlockManager, KVCacheExhausted, slot_mapping


def test_allocate_and_free_round_trip():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = bm.allocate(3)
    b = bm.allocate(5)
    assert len(set(a + b)) == 8 and set(a + b) == set(range(8))
    assert bm.num_free_blocks == 0 and not bm.can_allocate(1) and bm.can_allocate(0)
    bm.free(a)
    assert bm.num_free_blocks == 3 and bm.can_allocate(3)
    assert sorted(bm.allocate(3)) == sorted(a)


def test_exhaustion_allocates_nothing():
    bm = BlockManager(num_blocks=4, block_size=16)
    bm.allocate(3)
    with pytest.raises(KVCacheExhausted):
        bm.allocate(2)
    assert bm.num_free_blocks == 1
    assert len(bm.allocate(1)) == 1


def test_double_free_and_unknown_id():
    bm = BlockManager(num_blocks=4, block_size=16)
    ids = bm.allocate(2)
    bm.free(ids[:1])
    with pytest.raises(ValueError, match="double free"):
        bm.free(ids[:1])
    with pytest.raises(ValueError, match="double free"):
        bm.free([ids[1], ids[1]])  # twice in one call: nothing freed
    assert bm.num_free_blocks == 3
    with pytest.raises(ValueError, match="unknown"):
        bm.free([4])
    with pytest.raises(ValueError, match="unknown"):
        bm.free([-1])
    bm.free([ids[1]])
    assert bm.num_free_blocks == 4


def test_blocks_for_is_ceil_division():
    bm = BlockManager(num_blocks=1, block_size=16)
    assert [bm.blocks_for(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError):
        bm.blocks_for(-1)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError):
        BlockManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError):
        BlockManager(num_blocks=-1, block_size=4)


def test_slot_mapping():
    table = [7, 2, 5]
    assert slot_mapping(table, 0, 3, 4) == [28, 29, 30]
    assert slot_mapping(table, 3, 3, 4) == [31, 8, 9]
    assert slot_mapping(table, 10, 2, 4) == [22, 23]
    assert slot_mapping(table, 12, 0, 4) == []


def test_slot_mapping_block_table_too_short():
    with pytest.raises(ValueError, match="covers"):
        slot_mapping([7, 2], 6, 3, 4)
    with pytest.raises(ValueError):
        slot_mapping([7], -1, 1, 4)
