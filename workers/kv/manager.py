"""Per-sequence block tables over one ``BlockPool``.

A sequence's table covers its first ``len(table) * block_size`` token slots; token
``i`` lives in slot ``table[i // block_size].block_id * block_size + i % block_size``.
"""

from __future__ import annotations

from workers.kv.block_pool import Block, BlockPool


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.tables: dict[str, list[Block]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.pool.num_used / self.pool.num_blocks

    def num_new_blocks(self, seq_id: str, num_tokens: int) -> int:
        """Blocks ``seq_id`` still lacks to hold ``num_tokens`` tokens."""
        have = len(self.tables.get(seq_id, ()))
        return max(0, blocks_needed(num_tokens, self.block_size) - have)

    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        """Grow ``seq_id``'s table to hold ``num_tokens``; False (and no change) if short."""
        need = self.num_new_blocks(seq_id, num_tokens)
        if need > self.pool.num_free:
            return False
        if need:
            self.tables.setdefault(seq_id, []).extend(self.pool.allocate(need))
        else:
            self.tables.setdefault(seq_id, [])
        return True

    def free(self, seq_id: str) -> None:
        """Release the sequence's blocks, tail first (so its tail is reused first)."""
        table = self.tables.pop(seq_id, None)
        if table:
            self.pool.free(reversed(table))

    def block_ids(self, seq_id: str) -> list[int]:
        return [block.block_id for block in self.tables.get(seq_id, ())]

    def check_integrity(self) -> None:
        self.pool.check_integrity(self.tables.values())
