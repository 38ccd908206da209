"""Attention over the paged KV cache: the batch description and the torch backend."""

from tessera.workers.attention.metadata import PAD_BLOCK_ID, AttentionMetadata
from tessera.workers.attention.paged import (
    DEFAULT_TILE_TOKENS,
    AttentionMemoryEstimate,
    causal_mask,
    estimate_attention_memory,
    paged_attention,
    reference_attention,
    write_kv,
)

__all__ = [
    "DEFAULT_TILE_TOKENS",
    "PAD_BLOCK_ID",
    "AttentionMemoryEstimate",
    "AttentionMetadata",
    "causal_mask",
    "estimate_attention_memory",
    "paged_attention",
    "reference_attention",
    "write_kv",
]
