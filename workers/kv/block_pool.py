"""Fixed-size KV blocks with ref counts and an O(1) free list.

Invariants (``check_integrity`` asserts them):
- every block is either free (ref count 0, in the free queue) or used (ref count > 0,
  not in the queue): ``num_free + num_used == num_blocks``;
- a used block's ref count equals the number of block tables holding it.

The free queue is an intrusive doubly linked list: allocation takes from the head,
freeing appends to the tail, and a block can be unlinked from the middle in O(1)
(prefix-cache hits on free blocks need that). Callers free a sequence's blocks tail
first, so the blocks that are reused first are the ends of sequences.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class Block:
    __slots__ = ("block_id", "ref_count", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
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

    @property
    def num_free(self) -> int:
        return self.free_queue.size

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.free_queue.size

    def allocate(self, count: int) -> list[Block]:
        if count > self.free_queue.size:
            raise MemoryError(f"asked for {count} KV blocks, {self.free_queue.size} free")
        blocks = [self.free_queue.popleft() for _ in range(count)]
        for block in blocks:
            block.ref_count = 1
        return blocks

    def share(self, blocks: Iterable[Block]) -> None:
        """Add one reference to each block (a fork now holds them too)."""
        for block in blocks:
            assert block.ref_count > 0, f"sharing free block {block.block_id}"
            block.ref_count += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block, in the order given; free at zero."""
        for block in blocks:
            assert block.ref_count > 0, f"double free of block {block.block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

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
