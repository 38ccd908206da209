"""Moving a prompt's KV blocks between engines (prefill/decode disaggregation).

The sender reads blocks out of its pool by content hash (``export``): the prompt's
full blocks stay in its prefix cache after its prefill, findable by hash until they
are evicted. The receiver ``reserve``s free blocks, ``write``s each one as it arrives,
then ``commit``s them: each is registered under its hash and released, so it sits in
the prefix cache, and the request, admitted next, takes them as prefix hits and
computes only its tail. ``release`` gives reserved blocks back unregistered (a failed
transfer leaves nothing behind).

Invariant: a reserved block is held (ref count 1) by its ``Reservation`` and by no
block table; ``Engine.check_integrity`` counts reservations as holders. Every call
that touches the pool holds ``engine.exclusive()`` (no step runs meanwhile); ``write``
touches only the pool tensor's rows of blocks no sequence reads.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tessera.workers.kv.block_pool import Block, BlockPool
from tessera.workers.kv.manager import KVCacheManager
from tessera.workers.kv.prefix_cache import extend_block_hashes


class _KVCacheHolder(Protocol):
    @property
    def kv_cache(self) -> torch.Tensor: ...  # [layers, 2, num_blocks, block_size, heads, dim]

    @property
    def group(self) -> Any: ...  # a tensor-parallel group's rank 0 (``TensorParallelGroup``)


class _PromptKeys(Protocol):
    def prompt_keys(self, prompt_len: int, cache_key: str | None) -> tuple[str, ...]: ...


class HandoffEngine(Protocol):
    """What a handoff needs of the engine that owns it (``Engine``): described here, not
    imported, because the engine imports this module."""

    @property
    def kv(self) -> KVCacheManager: ...

    @property
    def runner(self) -> _KVCacheHolder: ...

    @property
    def model_config(self) -> Any: ...  # the whole model's ``ModelConfig``

    @property
    def hasher(self) -> _PromptKeys: ...

    def exclusive(self) -> AbstractContextManager[None]:
        """Held: no engine step runs."""
        ...


@dataclass(eq=False)
class Reservation:
    """Free blocks held for an incoming transfer: ``blocks[i]`` receives the prompt's
    block ``first + i`` (hash ``hashes[i]``)."""

    first: int
    hashes: list[bytes]
    blocks: list[Block] = field(default_factory=list)
    written: int = 0
    # a tensor-parallel group's blocks as they came, written to every rank at commit
    pending: list[torch.Tensor] = field(default_factory=list)


class BlockHandoff:
    """The engine's side of a transfer (``engine.handoff``)."""

    def __init__(self, engine: HandoffEngine) -> None:
        self.engine = engine
        self.reservations: set[Reservation] = set()

    @property
    def _pool(self) -> BlockPool:
        return self.engine.kv.pool

    @property
    def _kv(self) -> torch.Tensor:  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        return self.engine.runner.kv_cache

    @property
    def kv_heads(self) -> int:
        """The KV heads of a block as it travels: the whole model's (a tensor-parallel
        group's rank 0 holds its own heads only; the group gathers and splits them)."""
        return self.engine.model_config.num_kv_heads

    def prompt_hashes(self, token_ids: list[int], cache_key: str | None) -> list[bytes]:
        """The content hashes of the prompt's full blocks (as the engine computes them;
        ``cache_key``: the request's ``Request.cache_key``)."""
        hashes: list[bytes] = []
        keys = self.engine.hasher.prompt_keys(len(token_ids), cache_key)
        extend_block_hashes(hashes, token_ids, self.engine.kv.block_size, keys)
        return hashes

    def cached_prefix(self, hashes: list[bytes]) -> int:
        """How many leading blocks of ``hashes`` this engine's prefix cache holds."""
        with self.engine.exclusive():
            count = 0
            for block_hash in hashes:
                if self._pool.lookup(block_hash) is None:
                    break
                count += 1
            return count

    def export(self, hashes: list[bytes]) -> list[torch.Tensor] | None:
        """Copies of the cached blocks with these hashes, each ``[layers, 2, block_size,
        kv_heads, head_dim]`` on the CPU; None if any is no longer cached."""
        with self.engine.exclusive():
            blocks = [self._pool.lookup(h) for h in hashes]
            if any(block is None for block in blocks):
                return None
            group = self.engine.runner.group
            if group is not None:  # every rank's heads
                ids = [block.block_id for block in blocks]
                rows = group.gather_blocks(self._kv, self.engine.model_config, ids)
            else:
                ids = torch.tensor([block.block_id for block in blocks], device=self._kv.device)
                rows = self._kv.index_select(2, ids)  # [layers, 2, n, bs, heads, dim]
        return [rows[:, :, i].to("cpu").contiguous() for i in range(len(blocks))]

    def reserve(self, first: int, hashes: list[bytes]) -> Reservation | None:
        """Hold free blocks for ``hashes`` (the prompt's blocks from ``first``); None when
        the pool cannot spare them (the receiver then prefills itself)."""
        with self.engine.exclusive():
            if len(hashes) > self._pool.num_free:
                return None
            reservation = Reservation(first, list(hashes), self._pool.allocate(len(hashes)))
            self.reservations.add(reservation)
            return reservation

    def write(self, reservation: Reservation, index: int, kv: torch.Tensor) -> None:
        """Write the prompt's block ``index`` (``[layers, 2, block_size, kv_heads,
        head_dim]``) into its reserved block; blocks come in order."""
        slot = index - reservation.first
        if slot != reservation.written or slot >= len(reservation.blocks):
            raise ValueError(f"block {index} out of order (expected {reservation.written})")
        block = reservation.blocks[slot]
        if self.engine.runner.group is not None:  # to every rank, at commit (its thread)
            reservation.pending.append(kv)
        else:
            self._kv[:, :, block.block_id].copy_(kv.to(self._kv.dtype), non_blocking=False)
        reservation.written += 1

    def commit(self, reservation: Reservation) -> None:
        """Register every written block under its hash and release it to the cache."""
        if reservation.written != len(reservation.blocks):
            raise ValueError(f"{reservation.written}/{len(reservation.blocks)} blocks written")
        with self.engine.exclusive():
            if reservation.pending:
                ids = [block.block_id for block in reservation.blocks]
                whole = torch.stack(reservation.pending, dim=2)
                reservation.pending.clear()
                self.engine.runner.group.write_blocks(
                    self._kv, self.engine.model_config, ids, whole
                )
            for block, block_hash in zip(reservation.blocks, reservation.hashes, strict=True):
                self._pool.cache(block, block_hash)  # a block cached meanwhile wins
            self._release(reservation)

    def release(self, reservation: Reservation) -> None:
        """Give the blocks back without registering them (a failed transfer)."""
        with self.engine.exclusive():
            self._release(reservation)

    def _release(self, reservation: Reservation) -> None:
        if reservation in self.reservations:
            self.reservations.discard(reservation)
            self._pool.free(reversed(reservation.blocks))
