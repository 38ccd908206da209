"""Exact block ids for allocate / free / preempt, and the integrity check itself."""

from __future__ import annotations

import pytest

from tessera.workers.kv.block_pool import BlockPool, FreeBlockQueue
from tessera.workers.kv.manager import KVCacheManager, Write


def test_allocate_takes_from_head_in_id_order():
    pool = BlockPool(6)
    assert [b.block_id for b in pool.allocate(2)] == [0, 1]
    assert [b.block_id for b in pool.allocate(3)] == [2, 3, 4]
    assert pool.free_queue.ids() == [5]
    assert (pool.num_free, pool.num_used) == (1, 5)


def test_free_appends_to_tail_so_tails_are_reused_first():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate("a", 10)  # 3 blocks
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.allocate("b", 4)
    assert kv.block_ids("b") == [3]
    kv.free("a")  # tail first: 2, 1, 0 go to the end of the queue
    assert kv.pool.free_queue.ids() == [4, 5, 6, 7, 2, 1, 0]
    assert kv.allocate("c", 20)  # 5 blocks
    assert kv.block_ids("c") == [4, 5, 6, 7, 2]
    kv.check_integrity()


def test_grow_table_one_block_at_a_time():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate("a", 4)
    assert kv.num_new_blocks("a", 4) == 0
    assert kv.num_new_blocks("a", 5) == 1
    assert kv.allocate("a", 5)
    assert kv.block_ids("a") == [0, 1]


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.allocate("a", 8)
    assert not kv.allocate("b", 8)
    assert "b" not in kv.tables or kv.block_ids("b") == []
    assert kv.pool.free_queue.ids() == [2]
    kv.check_integrity()


def test_block_ids_follow_every_change_of_a_table():
    """block_ids keeps its lists between steps: each change of a table drops its list."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate("a", 6)
    assert kv.block_ids("a") == [0, 1]
    kv.write([Write("a", 6, 9)])  # a new block
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.fork("a", "b")  # shared
    assert kv.block_ids("b") == [0, 1, 2]
    kv.write([Write("b", 9, 10)])  # into the shared block 2: b's own copy, 3
    assert kv.take_copies() == [(2, 3)]
    assert (kv.block_ids("a"), kv.block_ids("b")) == ([0, 1, 2], [0, 1, 3])
    kv.truncate("b", 8)
    assert kv.block_ids("b") == [0, 1]
    kv.check_integrity()
    assert kv.reassign(["c"], ["a"], ["a", "b"]) == set()
    assert (kv.block_ids("a"), kv.block_ids("b"), kv.block_ids("c")) == ([], [], [0, 1, 2])
    kv.free("c")
    assert kv.block_ids("c") == []
    kv.check_integrity()


def test_append_slot_adds_a_block_only_where_write_would_and_refuses_the_rest():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert not kv.append_slot("a", 0)  # no table yet: write takes the prefix cache's hits
    assert kv.allocate("a", 3)
    assert kv.block_ids("a") == [0]
    assert kv.append_slot("a", 3)  # in the last block: nothing to add
    assert kv.block_ids("a") == [0]
    assert kv.append_slot("a", 4)  # starts a block
    assert kv.block_ids("a") == [0, 1]
    assert not kv.append_slot("a", 12)  # two blocks short: write adds both
    assert kv.fork("a", "b")
    assert not kv.append_slot("b", 5)  # into a shared block: write copies it
    assert kv.block_ids("b") == [0, 1] and not kv.take_copies()
    assert kv.allocate("c", 8)  # the pool's last two blocks
    assert not kv.append_slot("c", 8)  # no free block: the scheduler preempts
    assert kv.block_ids("c") == [2, 3]
    kv.check_integrity()


def test_integrity_check_catches_block_ids_kept_past_a_change():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate("a", 4)
    assert kv.block_ids("a") == [0]
    kv.tables["a"] += kv.pool.allocate(1)  # behind the manager's back
    with pytest.raises(AssertionError, match=r"a's kept block ids \[0\] are stale"):
        kv.check_integrity()


def test_free_queue_remove_from_middle_is_o1_and_keeps_order():
    pool = BlockPool(5)
    queue: FreeBlockQueue = pool.free_queue
    queue.remove(pool.blocks[2])
    assert queue.ids() == [0, 1, 3, 4]
    queue.remove(pool.blocks[0])
    queue.remove(pool.blocks[4])
    assert queue.ids() == [1, 3]
    assert queue.size == 2
    queue.append(pool.blocks[4])
    assert queue.popleft().block_id == 1
    assert queue.ids() == [3, 4]


def test_share_and_free_count_references():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.share(blocks)
    assert [b.ref_count for b in blocks] == [2, 2]
    pool.check_integrity([blocks, blocks])
    pool.free(blocks)
    assert pool.num_free == 2
    pool.check_integrity([blocks])
    pool.free(reversed(blocks))
    assert pool.free_queue.ids() == [2, 3, 1, 0]
    with pytest.raises(AssertionError, match="double free"):
        pool.free(blocks)


def test_integrity_check_catches_a_wrong_ref_count():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    blocks[0].ref_count = 2  # claims two holders, one table holds it
    with pytest.raises(AssertionError, match="held by 1 tables"):
        pool.check_integrity([blocks])


def test_integrity_check_catches_a_leak():
    pool = BlockPool(4)
    pool.allocate(1)  # held by no table
    with pytest.raises(AssertionError, match="held by 0 tables"):
        pool.check_integrity([])


def test_invalid_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)
