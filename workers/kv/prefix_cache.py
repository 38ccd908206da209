"""Content hashes of full KV blocks, chained so a block's hash names its whole prefix.

``hash_block(parent, tokens, extra_keys)`` is SHA-256 over the parent's hash, the
block's token ids and the extra keys (model id, dtype, the request's ``cache_salt``):
everything that decides the block's K/V contents. Two different prefixes share a
hash only through a SHA-256 collision; with N cached blocks the chance is about
N**2 / 2**257 (below 1e-60 for a billion blocks), so a hash match is taken as a
content match without comparing tokens.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

ROOT_HASH = bytes(32)  # the "parent" of a sequence's first block


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: tuple[str, ...]) -> bytes:
    digest = hashlib.sha256(parent)
    digest.update(len(token_ids).to_bytes(4, "little"))
    digest.update(array("q", token_ids).tobytes())
    digest.update(repr(extra_keys).encode())
    return digest.digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, extra_keys: tuple[str, ...]
) -> None:
    """Append the hashes of the full blocks of ``token_ids`` that ``hashes`` lacks."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(
            hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys)
        )


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Token counts over admitted sequences: ``queries`` prompt tokens looked up,
    ``hits`` of them found cached; ``evictions`` cached blocks reused for new contents."""

    enabled: bool
    queries: int
    hits: int
    evictions: int
    cached_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
