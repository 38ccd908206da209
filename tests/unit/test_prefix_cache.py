"""Prefix caching and copy-on-write in the block pool and manager: exact block ids,
hits, eviction order (LRU over the free queue), forks and beam re-pointing."""

from __future__ import annotations

import pytest

from tessera.workers.kv.manager import KVCacheManager, Write
from tessera.workers.kv.prefix_cache import ROOT_HASH, extend_block_hashes, hash_block

KEYS = ("model", "float32", "")


def _hashes(tokens: list[int], block_size: int = 4, keys=KEYS) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, block_size, keys)
    return hashes


def _compute(kv: KVCacheManager, seq_id: str, tokens: list[int]) -> None:
    """Admit ``seq_id`` with its cache hits, compute all of ``tokens``, cache full blocks."""
    hashes = _hashes(tokens, kv.block_size)
    hits = kv.find_cached(hashes, len(tokens))
    write = Write(seq_id, len(hits) * kv.block_size, len(tokens), hits)
    assert kv.blocks_for([write]) <= kv.num_free_blocks
    kv.write([write])
    kv.cache_blocks(seq_id, hashes, 0, len(tokens) // kv.block_size)


def test_hashes_chain_and_cover_salt_and_model():
    a = _hashes(list(range(12)))
    assert len(a) == 3 and len(set(a)) == 3
    assert a[1] == hash_block(a[0], [4, 5, 6, 7], KEYS)
    assert a[0] == hash_block(ROOT_HASH, [0, 1, 2, 3], KEYS)
    # same block tokens after a different first block: a different hash (it is chained)
    b = _hashes([9, 9, 9, 9, 4, 5, 6, 7])
    assert b[1] != a[1]
    assert _hashes(list(range(12)), keys=("model", "float32", "tenant"))[0] != a[0]
    assert _hashes(list(range(12)), keys=("model", "bfloat16", ""))[0] != a[0]
    assert _hashes(list(range(12)), keys=("other", "float32", ""))[0] != a[0]
    assert _hashes(list(range(11))) == a[:2]  # only full blocks are hashed


def test_hit_partial_hit_and_last_token_is_always_computed():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    _compute(kv, "a", list(range(14)))  # blocks 0 1 2 full and cached, 3 partial
    assert kv.block_ids("a") == [0, 1, 2, 3]
    assert len(kv.pool.cached) == 3
    # same 12-token prefix + more: 3 hits, then new blocks
    tokens = list(range(12)) + [50, 51, 52]
    hits = kv.find_cached(_hashes(tokens), len(tokens))
    assert [b.block_id for b in hits] == [0, 1, 2]
    # partial hit: diverges inside the second block
    tokens = [0, 1, 2, 3, 4, 99, 6, 7, 8]
    assert [b.block_id for b in kv.find_cached(_hashes(tokens), len(tokens))] == [0]
    # exactly 12 tokens, all cached: the last block is left to compute its last token
    tokens = list(range(12))
    assert [b.block_id for b in kv.find_cached(_hashes(tokens), 12)] == [0, 1]
    _compute(kv, "b", list(range(12)) + [50, 51, 52])
    assert kv.block_ids("b") == [0, 1, 2, 4]
    assert [kv.pool.blocks[i].ref_count for i in range(5)] == [2, 2, 2, 1, 1]
    kv.check_integrity()


def test_freed_cached_blocks_stay_findable_and_are_evicted_lru_tail_first():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    _compute(kv, "a", list(range(8)) + [100])  # blocks 0 1 cached, 2 partial
    _compute(kv, "b", list(range(20, 28)) + [100])  # blocks 3 4 cached, 5 partial
    kv.free("a")  # tail first: 2, 1, 0
    kv.free("b")  # then 5, 4, 3
    assert kv.pool.free_queue.ids() == [2, 1, 0, 5, 4, 3]
    assert kv.num_free_blocks == 6 and len(kv.pool.cached) == 4
    # "a"'s prefix is still there; a hit takes blocks out of the middle of the queue
    hits = kv.find_cached(_hashes(list(range(8)) + [7]), 9)
    assert [b.block_id for b in hits] == [0, 1]
    kv.write([Write("c", 8, 9, hits)])
    assert kv.block_ids("c") == [0, 1, 2]  # block 2 reused: it held no cached contents
    assert kv.pool.free_queue.ids() == [5, 4, 3]
    assert kv.pool.num_evictions == 0
    # allocating 2 more evicts the least recently freed first: 5 (no hash), then 4
    kv.write([Write("d", 0, 8)])
    assert kv.block_ids("d") == [5, 4]
    assert kv.pool.num_evictions == 1
    b_hashes = _hashes(list(range(20, 28)))
    assert kv.pool.lookup(b_hashes[1]) is None  # evicted
    assert kv.pool.lookup(b_hashes[0]).block_id == 3  # still cached, still free
    kv.check_integrity()


def test_duplicate_contents_keep_the_first_cached_block():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    tokens = list(range(8)) + [1]
    kv.write([Write("a", 0, 9)])
    kv.write([Write("b", 0, 9)])  # computed at the same time, before either was cached
    kv.cache_blocks("a", _hashes(tokens), 0, 2)
    kv.cache_blocks("b", _hashes(tokens), 0, 2)
    assert [kv.pool.lookup(h).block_id for h in _hashes(tokens)] == [0, 1]
    assert kv.pool.blocks[3].block_hash is None
    kv.check_integrity()


def test_caching_off_finds_nothing():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    _compute(kv, "a", list(range(9)))
    assert kv.pool.cached == {}
    assert kv.find_cached(_hashes(list(range(9))), 9) == ()


def test_fork_shares_and_first_write_into_a_partly_full_block_copies_it():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    kv.write([Write("p", 0, 6)])  # blocks 0 (full) and 1 (2 of 4 slots)
    kv.fork("p", "c1")
    kv.fork("p", "c2")
    assert [kv.pool.blocks[i].ref_count for i in (0, 1)] == [3, 3]
    assert kv.pool.num_used == 2
    writes = [Write(s, 6, 7) for s in ("p", "c1", "c2")]
    # three writers of one shared block: two copies, the last writer keeps the original
    assert kv.blocks_for(writes) == 2
    kv.write(writes)
    assert kv.block_ids("p") == [0, 2] and kv.block_ids("c1") == [0, 3]
    assert kv.block_ids("c2") == [0, 1]
    assert kv.take_copies() == [(1, 2), (1, 3)]
    assert kv.pool.blocks[0].ref_count == 3
    kv.check_integrity()
    kv.free("c1")
    kv.free("c2")
    kv.free("p")
    assert kv.num_free_blocks == 10
    kv.check_integrity()


def test_fork_without_sharing_copies_every_block_or_reports_short():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    kv.write([Write("p", 0, 6)])
    assert kv.fork("p", "c", share=False)
    assert kv.block_ids("c") == [2, 3] and kv.take_copies() == [(0, 2), (1, 3)]
    assert not kv.fork("p", "d", share=False)  # one block left, two needed
    assert "d" not in kv.tables
    kv.check_integrity()


def test_reassign_frees_dropped_beams_at_once_and_shares_survivors():
    kv = KVCacheManager(num_blocks=12, block_size=4)
    kv.write([Write("b0", 0, 6)])  # 0, 1
    kv.fork("b0", "b1")
    kv.write([Write("b0", 6, 9)])  # copy of 1 -> 2, then 3
    kv.write([Write("b1", 6, 9)])  # 1 is now private to b1; then 4
    kv.take_copies()
    assert kv.block_ids("b0") == [0, 2, 3] and kv.block_ids("b1") == [0, 1, 4]
    # both next beams continue b0: b1's private blocks 1 and 4 go back at once
    missing = kv.reassign(["b0", "b1"], ["b0", "b0"], ["b0", "b1"])
    assert missing == set()
    assert kv.block_ids("b0") == kv.block_ids("b1") == [0, 2, 3]
    assert [kv.pool.blocks[i].ref_count for i in (0, 1, 2, 3, 4)] == [2, 0, 2, 2, 0]
    assert kv.pool.free_queue.ids()[-2:] == [4, 1]
    kv.check_integrity()


def test_integrity_check_catches_bad_ref_counts_and_stale_hashes():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    _compute(kv, "a", list(range(9)))
    kv.pool.blocks[0].ref_count += 1
    with pytest.raises(AssertionError, match="held by 1 tables"):
        kv.check_integrity()
    kv.pool.blocks[0].ref_count -= 1
    kv.pool.blocks[1].block_hash = b"x" * 32
    with pytest.raises(AssertionError, match="stale hash"):
        kv.check_integrity()


def test_one_write_cannot_evict_a_block_another_write_of_the_same_step_hits():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    kv.write([Write("other", 0, 8)])  # holds 0 1
    _compute(kv, "old", list(range(8)) + [1])  # 2 3 cached, 4 partial
    kv.free("old")
    queue = kv.pool.free_queue
    for block_id in (5, 4):  # put the cached blocks at the head: 3 2 5 4
        queue.remove(kv.pool.blocks[block_id])
        queue.append(kv.pool.blocks[block_id])
    assert queue.ids() == [3, 2, 5, 4]
    tokens = list(range(8)) + [5]
    hits = kv.find_cached(_hashes(tokens), len(tokens))
    assert [b.block_id for b in hits] == [2, 3]
    writes = [Write("new", 0, 3), Write("hit", 8, 9, hits)]
    assert kv.blocks_for(writes) == 4 == kv.num_free_blocks
    kv.write(writes)  # "new" must not take block 3 from under "hit"
    assert kv.block_ids("new") == [5] and kv.block_ids("hit") == [2, 3, 4]
    assert kv.pool.num_evictions == 0
    kv.check_integrity()
