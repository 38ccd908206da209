"""Per-sequence block tables over one ``BlockPool``: prefix hits, forks, copy-on-write.

A sequence's table covers its first ``len(table) * block_size`` token slots; token
``i`` lives in slot ``table[i // block_size].block_id * block_size + i % block_size``.

Sharing: a prefix-cache hit or a fork puts the same block in several tables (its ref
count says how many). Before a sequence writes into a block it shares, ``write``
gives it a private copy (copy-on-write) and records ``(src, dst)`` in ``copies``; the
model runner copies those blocks' K/V before the forward pass that writes them.
Only partly computed blocks are ever copied: hits are full computed blocks, which no
write touches.

Sliding windows: where every layer of the model attends to a window, blocks wholly
before every future query's window go back to the pool (``release_before``). Their
place in the table is kept by ``RELEASED`` (block id 0: readers may gather it, but
attention masks every index before the window), so a table always covers its
sequence's indices from 0, and only a table's leading blocks are ever released.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tessera.workers.kv.block_pool import Block, BlockPool
from tessera.workers.kv.prefix_cache import PrefixCacheStats

#: A released block's place in a table (``release_before``): not a pool block, never
#: counted, freed, shared or cached; its id (0, a block that always exists) is what a
#: reader that gathers it finds, masked.
RELEASED = Block(0)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class Write:
    """A sequence about to compute tokens ``[start, end)``; ``hits`` are cached blocks
    it takes first (only for a sequence with no table yet, ``start == len(hits) * bs``)."""

    seq_id: str
    start: int
    end: int
    hits: tuple[Block, ...] = ()
    query_tokens: int = 0  # tokens the prefix cache was asked for (0: not asked)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.tables: dict[str, list[Block]] = {}
        # block_ids' answers, each dropped whenever its table changes (most decode steps
        # change none): rebuilding every table's id list each step was O(context)
        self._ids: dict[str, list[int]] = {}
        self.copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) not yet applied
        self.num_queries = 0
        self.num_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.pool.num_used / self.pool.num_blocks

    # ------------------------------------------------------------------ growth
    def num_new_blocks(self, seq_id: str, num_tokens: int) -> int:
        """Blocks ``seq_id`` still lacks to hold ``num_tokens`` tokens."""
        have = len(self.tables.get(seq_id, ()))
        return max(0, blocks_needed(num_tokens, self.block_size) - have)

    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        """Grow ``seq_id``'s table to hold ``num_tokens``; False (and no change) if short.
        Does not copy shared blocks: callers that may write into one use ``write``."""
        need = self.num_new_blocks(seq_id, num_tokens)
        if need > self.pool.num_free:
            return False
        table = self.tables.setdefault(seq_id, [])
        if need:  # a draft model asks every step, mostly for nothing
            table.extend(self.pool.allocate(need))
            self._ids.pop(seq_id, None)
        return True

    def append_slot(self, seq_id: str, index: int) -> bool:
        """Make ``seq_id``'s table ready for one token at cache index ``index`` (a
        decode) where that needs at most a new block: True, the table holds the slot;
        False, nothing changed, and ``write`` must do it (no table yet, a shared block
        to copy, no free block, or more than one block short). Equals ``write`` of
        ``Write(seq_id, index, index + 1)`` wherever it returns True, in a fifth of the
        time."""
        table = self.tables.get(seq_id)
        if not table:
            return False
        i = index // self.block_size
        if i < len(table):
            return table[i].ref_count == 1
        if i > len(table) or not self.pool.num_free:
            return False
        table.extend(self.pool.allocate(1))
        self._ids.pop(seq_id, None)
        return True

    def find_cached(self, block_hashes: list[bytes], num_tokens: int) -> tuple[Block, ...]:
        """The longest run of cached blocks starting a sequence of ``num_tokens`` tokens,
        leaving at least its last token to compute (its logits are needed)."""
        if not self.enable_prefix_caching:
            return ()
        hits = []
        for block_hash in block_hashes[: (num_tokens - 1) // self.block_size]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return tuple(hits)

    def blocks_for(self, writes: Iterable[Write]) -> int:
        """Free blocks that applying ``writes`` in order takes: new blocks, private
        copies of shared blocks, and cache hits that are now free."""
        bs = self.block_size
        refs: dict[int, int] = {}  # ref counts as the writes before this one leave them
        count = 0
        for w in writes:
            for block in w.hits:
                ref = refs.get(block.block_id, block.ref_count)
                count += ref == 0
                refs[block.block_id] = ref + 1
            table = self.tables.get(w.seq_id, [])
            have = len(w.hits) + len(table)
            for block in table[w.start // bs : blocks_needed(w.end, bs)]:
                ref = refs.get(block.block_id, block.ref_count)
                if ref > 1:
                    count += 1
                    refs[block.block_id] = ref - 1
            count += max(0, blocks_needed(w.end, bs) - have)
        return count

    def write(self, writes: list[Write]) -> None:
        """Make each table ready to compute its ``[start, end)``: take the hits (all of
        them first, so no allocation below can evict a block a later write hits), then
        copy-on-write any shared block in range and add new blocks. The caller has
        checked ``blocks_for(writes)`` against the free count."""
        bs = self.block_size
        for w in writes:
            table = self.tables.setdefault(w.seq_id, [])
            if self.enable_prefix_caching:
                self.num_queries += w.query_tokens
                self.num_hits += len(w.hits) * bs
            if w.hits:
                assert not table and w.start == len(w.hits) * bs, "hits only start a table"
                self.pool.share(w.hits)
                table.extend(w.hits)
                self._ids.pop(w.seq_id, None)
        for w in writes:
            table = self.tables[w.seq_id]
            for i in range(w.start // bs, min(len(table), blocks_needed(w.end, bs))):
                block = table[i]
                assert block is not RELEASED, f"{w.seq_id} writes into a released block"
                if block.ref_count > 1:
                    assert block.block_hash is None, f"{block} is cached and must not change"
                    (copy,) = self.pool.allocate(1)
                    self.copies.append((block.block_id, copy.block_id))
                    self.pool.free([block])
                    table[i] = copy
                    self._ids.pop(w.seq_id, None)
            missing = blocks_needed(w.end, bs) - len(table)
            if missing > 0:  # most decode steps' tokens fit the last block
                table.extend(self.pool.allocate(missing))
                self._ids.pop(w.seq_id, None)

    def cache_blocks(self, seq_id: str, block_hashes: list[bytes], start: int, end: int) -> None:
        """Register the table's blocks ``start..end-1`` (full and computed) by hash."""
        if self.enable_prefix_caching:
            table = self.tables[seq_id]
            for i in range(start, end):
                if table[i] is not RELEASED:
                    self.pool.cache(table[i], block_hashes[i])

    def release_before(self, seq_id: str, index: int) -> int:
        """Give back ``seq_id``'s blocks that hold only cache indices before ``index``
        (no query to come attends to them: a sliding window has passed), each leaving
        ``RELEASED`` in its place; a cached one stays findable by its hash until
        evicted. Returns how many were released."""
        table = self.tables.get(seq_id)
        if not table or index < self.block_size:
            return 0
        end = min(index // self.block_size, len(table))
        first = end  # released blocks are a prefix: walk back to its end
        while first > 0 and table[first - 1] is not RELEASED:
            first -= 1
        if first == end:
            return 0
        dropped = table[first:end]
        table[first:end] = [RELEASED] * (end - first)
        self._ids.pop(seq_id, None)
        self.pool.free(reversed(dropped))
        return end - first

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    # ---------------------------------------------------------------- sharing
    def fork(self, parent_id: str, child_id: str, share: bool = True) -> bool:
        """``child_id`` gets ``parent_id``'s blocks: shared (ref count + 1 each), or
        with ``share=False`` private copies; False (child gets nothing) if short."""
        assert child_id not in self.tables, f"{child_id} already has blocks"
        table = self._fork_table(self.tables[parent_id], share)
        if table is None:
            return False
        self.tables[child_id] = table
        self._ids.pop(child_id, None)
        return True

    def reassign(
        self, targets: list[str], parents: list[str], released: list[str], share: bool = True
    ) -> set[str]:
        """Beam step: ``targets[j]`` continues ``parents[j]``; then every table in
        ``released`` drops its blocks, so the blocks no target kept are freed.

        With ``share=False`` the first target of each parent takes its table over and
        the others get private copies. Returns the targets left with no blocks (the
        pool was short for their copy)."""
        tables: list[list[Block] | None] = []
        taken: set[str] = set()
        for parent in parents:
            if not share and parent not in taken and parent in released:
                taken.add(parent)
                tables.append(self.tables[parent])
            else:
                tables.append(self._fork_table(self.tables[parent], share))
        for seq_id in released:
            if seq_id in taken:
                del self.tables[seq_id]
                self._ids.pop(seq_id, None)
            else:
                self.free(seq_id)
        missing = set()
        for seq_id, table in zip(targets, tables, strict=True):
            assert seq_id not in self.tables, f"{seq_id} still holds blocks"
            if table is None:
                missing.add(seq_id)
            else:
                self.tables[seq_id] = table
                self._ids.pop(seq_id, None)
        return missing

    def _fork_table(self, table: list[Block], share: bool) -> list[Block] | None:
        held = [block for block in table if block is not RELEASED]
        if share:
            self.pool.share(held)
            return list(table)
        if len(held) > self.pool.num_free:
            return None
        copies = self.pool.allocate(len(held))
        self.copies += [(a.block_id, b.block_id) for a, b in zip(held, copies, strict=True)]
        fresh = iter(copies)
        return [block if block is RELEASED else next(fresh) for block in table]

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Return the blocks past the first ``num_tokens`` tokens to the pool (rejected
        speculative tokens). They were written this step, so they are private and
        carry no hash."""
        table = self.tables.get(seq_id)
        if table is None:
            return
        keep = blocks_needed(num_tokens, self.block_size)
        if len(table) > keep:
            dropped = table[keep:]
            del table[keep:]
            self._ids.pop(seq_id, None)
            assert all(b.ref_count == 1 and b.block_hash is None for b in dropped), dropped
            self.pool.free(reversed(dropped))

    def free(self, seq_id: str) -> None:
        """Release the sequence's blocks, tail first (so its tail is reused first)."""
        table = self.tables.pop(seq_id, None)
        self._ids.pop(seq_id, None)
        if table:
            self.pool.free(block for block in reversed(table) if block is not RELEASED)

    def block_ids(self, seq_id: str) -> list[int]:
        """The ids of ``seq_id``'s table, in order (empty without one). The list is
        kept until the table changes: callers read it and never change it."""
        ids = self._ids.get(seq_id)
        if ids is None:
            table = self.tables.get(seq_id)
            if table is None:
                return []
            ids = self._ids[seq_id] = [block.block_id for block in table]
        return ids

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            enabled=self.enable_prefix_caching,
            queries=self.num_queries,
            hits=self.num_hits,
            evictions=self.pool.num_evictions,
            cached_blocks=len(self.pool.cached),
        )

    def held_tables(self) -> list[list[Block]]:
        """Each table's pool blocks (its ``RELEASED`` places left out)."""
        return [[b for b in table if b is not RELEASED] for table in self.tables.values()]

    def check_integrity(self) -> None:
        self.pool.check_integrity(self.held_tables())
        self.check_block_ids()

    def check_block_ids(self) -> None:
        """Every list ``block_ids`` kept is its table's ids as they are now."""
        for seq_id, ids in self._ids.items():
            table = self.tables.get(seq_id)
            assert table is not None, f"block ids kept for {seq_id}, which has no table"
            assert ids == [b.block_id for b in table], f"{seq_id}'s kept block ids {ids} are stale"
