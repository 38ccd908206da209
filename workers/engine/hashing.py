"""Content hashes of a sequence's full blocks, and offering computed blocks to the
prefix cache.

A block's hash chains its parent's, its tokens and the keys that change its K/V
besides them (model, precision, kernels, the request's salt and LoRA adapter, and for a RoPE that
depends on the sequence's length, a long prompt's length: ``prompt_keys``). Blocks from a
sequence's first parallel set on are never hashed: their K/V depend on positions and
masks, not tokens alone; ``block_hashes`` covers real tokens only (never drafts).
"""

from __future__ import annotations

from collections.abc import Callable

from tessera.workers.engine.sequence import Sequence
from tessera.workers.kv.manager import KVCacheManager
from tessera.workers.kv.prefix_cache import extend_block_hashes


class BlockHasher:
    def __init__(
        self,
        kv: KVCacheManager,
        enabled: bool,
        hash_keys: tuple[str, ...],
        context_key: Callable[[int], str] = lambda prompt_len: "",
    ) -> None:
        self.kv = kv
        self.enabled = enabled
        self.hash_keys = hash_keys
        self.context_key = context_key  # RotaryEmbedding.context_key
        #: Sequences whose last token filled a block, hashed at the next step's start
        #: (``filled``): nothing reads a sequence's hashes before then but speculative
        #: verification, which hashes its own sequence first.
        self.pending: list[Sequence] = []

    def filled(self, seq: Sequence) -> None:
        """``seq``'s last token filled a block: hash it before the next step (hashed
        here, after a forward has streamed the weights through the caches, every
        sequence's tokens and the hash's code would be cache misses)."""
        self.pending.append(seq)

    def flush(self) -> None:
        """Hash the blocks filled since the last step (before drafts join the tokens)."""
        if self.pending:
            for seq in self.pending:
                self.update(seq)
            self.pending = []

    def update(self, seq: Sequence) -> None:
        """Hash the sequence's new full blocks."""
        if not self.enabled:
            return
        end = seq.parallel_sets[0][0] if seq.parallel_sets else len(seq.token_ids)
        if end // self.kv.block_size <= len(seq.block_hashes):
            return  # no block has filled (most tokens fill none)
        keys = self.prompt_keys(len(seq.request.prompt_token_ids), seq.request.cache_key)
        if seq.request.sampling.prompt_logprobs is not None:
            # Every prompt position's logits are needed, and a cached block holds only
            # K/V: such a prompt runs whole, so it neither matches nor is matched (its
            # blocks hash under its own request id).
            keys = (*keys, seq.request.request_id)
        token_ids = seq.token_ids if end == len(seq.token_ids) else seq.token_ids[:end]
        extend_block_hashes(seq.block_hashes, token_ids, self.kv.block_size, keys)

    def prompt_keys(self, prompt_len: int, cache_key: str | None) -> tuple[str, ...]:
        """The hash keys of a request's blocks: the engine's, its ``Request.cache_key``
        (salt and adapter) and what its prompt's length changes
        (``RotaryEmbedding.context_key``)."""
        keys = (*self.hash_keys, cache_key or "")
        context = self.context_key(prompt_len)
        return (*keys, context) if context else keys

    def cache_computed(self, seq: Sequence, first_full: int) -> None:
        """Offer the prefix cache ``seq``'s full blocks from block ``first_full`` up to the
        end of its computed tokens (each under its hash)."""
        last_full = min(seq.num_computed_tokens // self.kv.block_size, len(seq.block_hashes))
        self.kv.cache_blocks(seq.seq_id, seq.block_hashes, first_full, last_full)
