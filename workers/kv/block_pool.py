"""Fixed-size KV blocks with ref counts, an O(1) LRU free list and a prefix-cache index.

Invariants (``check_integrity`` asserts them):
- every block is either free (ref count 0, in the free queue) or used (ref count > 0,
  not in the queue): ``num_free + num_used == num_blocks``;
- a used block's ref count equals the number of block tables holding it;
- ``cached`` maps each content hash to exactly one block carrying that hash. A block
  gets a hash only once it is full and computed, and is never written while it has one
  (writes go to positions past a sequence's computed tokens, and a hashed block is
  entirely before them), so a hash always describes the block's contents.

The free queue is an intrusive doubly linked list and doubles as the LRU order of the
prefix cache: allocation takes from the head, freeing appends to the tail, and a cache
hit on a free block unlinks it from the middle in O(1). A free block keeps its hash, so
it stays findable until allocation reuses it (an eviction). Callers free a sequence's
blocks tail first, so a sequence's last blocks are reused (evicted) before its first.

With ``record_events`` on, every hash stored and evicted is logged, in order, for the
cluster scheduler's per-worker prefix index (``drain_events``).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None  # set once full and computed, if caching
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count})"


class FreeBlockQueue:
    """Doubly linked list of free blocks; O(1) popleft, append and remove."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        self.head: Block | None = None
        self.tail: Block | None = None
        self.size = 0
        for block in blocks:
            self.append(block)

    def append(self, block: Block) -> None:
        block.prev_free, block.next_free = self.tail, None
        if self.tail is None:
            self.head = block
        else:
            self.tail.next_free = block
        self.tail = block
        self.size += 1

    def popleft(self) -> Block:
        block = self.head
        if block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        if block.prev_free is None:
            self.head = block.next_free
        else:
            block.prev_free.next_free = block.next_free
        if block.next_free is None:
            self.tail = block.prev_free
        else:
            block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.size -= 1

    def ids(self) -> list[int]:
        """Block ids from head (next to be allocated) to tail; for tests and debugging."""
        out, block = [], self.head
        while block is not None:
            out.append(block.block_id)
            block = block.next_free
        return out


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.num_evictions = 0
        # (stored?, hash) in the order they happened; None: not recorded. A deque, so
        # another thread may drain it while a step appends.
        self.events: deque[tuple[bool, bytes]] | None = None

    def record_events(self) -> None:
        """Start logging hashes stored and evicted (see ``drain_events``)."""
        if self.events is None:
            self.events = deque()

    def drain_events(self) -> list[tuple[bool, bytes]]:
        """The (stored?, hash) events since the last call, oldest first."""
        if self.events is None:
            return []
        return [self.events.popleft() for _ in range(len(self.events))]

    @property
    def num_free(self) -> int:
        return self.free_queue.size

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.free_queue.size

    def allocate(self, count: int) -> list[Block]:
        """Take ``count`` blocks from the head of the free queue (least recently freed
        first), evicting any cached contents they hold."""
        if count > self.free_queue.size:
            raise MemoryError(f"asked for {count} KV blocks, {self.free_queue.size} free")
        blocks = [self.free_queue.popleft() for _ in range(count)]
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
        return blocks

    def _evict(self, block: Block) -> None:
        del self.cached[block.block_hash]
        if self.events is not None:
            self.events.append((False, block.block_hash))
        block.block_hash = None
        self.num_evictions += 1

    def share(self, blocks: Iterable[Block]) -> None:
        """Add one reference to each block (a fork or a cache hit now holds it too);
        a free block leaves the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block, in the order given; free at zero."""
        for block in blocks:
            assert block.ref_count > 0, f"double free of block {block.block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

    # ------------------------------------------------------------ prefix cache
    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash)

    def cache(self, block: Block, block_hash: bytes) -> None:
        """Make a full, computed block findable by its content hash. If another block
        already holds that hash, this one stays private (the first copy wins)."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block
            if self.events is not None:
                self.events.append((True, block_hash))

    def check_integrity(self, tables: Iterable[list[Block]]) -> None:
        holders = Counter(block.block_id for table in tables for block in table)
        free_ids = self.free_queue.ids()
        assert len(free_ids) == len(set(free_ids)) == self.free_queue.size, "free list corrupt"
        free = set(free_ids)
        assert self.num_free + self.num_used == self.num_blocks
        for block in self.blocks:
            if block.block_id in free:
                assert block.ref_count == 0, f"{block} is in the free list"
                assert block.block_id not in holders, f"{block} is free but held by a table"
            else:
                assert block.ref_count == holders[block.block_id], (
                    f"{block}: held by {holders[block.block_id]} tables"
                )
                assert block.ref_count > 0, f"{block} is neither free nor used"
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"{block}: stale hash"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"{block}: cached under another hash"
