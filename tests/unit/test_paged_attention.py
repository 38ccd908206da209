"""Paged attention against a dense reference, write_kv slot placement, memory estimates."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tessera.workers.attention import (
    PAD_BLOCK_ID,
    AttentionMetadata,
    causal_mask,
    estimate_attention_memory,
    paged_attention,
    reference_attention,
    write_kv,
)

BLOCK_SIZE = 16
NUM_BLOCKS = 128
HEAD_DIM = 32
DECODE_SEQ_LENS = [1, 15, 16, 17, 300, 700]
# (q_len, seq_len): pure prefill, chunked prefill after cached tokens, a single token that sits
# in the multi-token group, and a chunk ending exactly on a block boundary.
MULTI_TOKEN = [(37, 37), (20, 75), (1, 50), (16, 48)]
FP32_ATOL = 1e-5
# bf16: both sides read the same bf16 cache. torch's CPU flash kernel (the decode path) rounds
# the probabilities to bf16 before multiplying by V, so outputs can sit a few bf16 ulps from a
# float64 reference (observed <= 2e-3 absolute, 2% relative near zero); float32 is the exact
# path and is held to 1e-5.
BF16_ATOL, BF16_RTOL = 4e-3, 2**-5


def make_batch(
    decode_lens: list[int],
    multi: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    seed: int = 0,
    attn_masks: tuple[torch.Tensor | None, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Cache and metadata with shuffled block ids; every slot not holding a token is NaN."""
    gen = torch.Generator().manual_seed(seed)
    q_lens = [1] * len(decode_lens) + [q for q, _ in multi]
    seq_lens = decode_lens + [s for _, s in multi]
    max_blocks = max(math.ceil(s / BLOCK_SIZE) for s in seq_lens)
    # Block 0 stays unallocated (all NaN) and is the pad entry: reading it unmasked would show.
    free = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    block_tables = torch.full((len(seq_lens), max_blocks), PAD_BLOCK_ID, dtype=torch.int64)
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    k_cache = torch.full(cache_shape, math.nan, dtype=dtype)
    v_cache = torch.full(cache_shape, math.nan, dtype=dtype)
    slots = []
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        n = math.ceil(seq_len / BLOCK_SIZE)
        block_tables[i, :n] = torch.tensor([free.pop() for _ in range(n)])
        seq_slots = [
            int(block_tables[i, j // BLOCK_SIZE]) * BLOCK_SIZE + j % BLOCK_SIZE
            for j in range(seq_len)
        ]
        cached = seq_slots[: seq_len - q_len]
        for cache in (k_cache, v_cache):
            rows = torch.randn(len(cached), num_kv_heads, HEAD_DIM, generator=gen)
            cache.view(-1, num_kv_heads, HEAD_DIM)[cached] = rows.to(dtype)
        slots += seq_slots[seq_len - q_len :]
    num_tokens = sum(q_lens)
    qsl = [0]
    for q_len in q_lens:
        qsl.append(qsl[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        block_tables=block_tables,
        num_decodes=len(decode_lens),
        query_start_loc_list=qsl,
        seq_lens_list=seq_lens,
        attn_masks=attn_masks,
    )
    k = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    q = torch.randn(num_tokens, num_heads, HEAD_DIM, generator=gen).to(dtype)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("tile_tokens", [BLOCK_SIZE, 64, 256, 1024])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (4, 4)])
@pytest.mark.parametrize(
    ("dtype", "atol", "rtol"),
    [(torch.float32, FP32_ATOL, 0.0), (torch.bfloat16, BF16_ATOL, BF16_RTOL)],
)
def test_matches_reference(
    tile_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    atol: float,
    rtol: float,
) -> None:
    q, k_cache, v_cache, meta = make_batch(
        DECODE_SEQ_LENS, MULTI_TOKEN, num_heads, num_kv_heads, dtype
    )
    scale = HEAD_DIM**-0.5
    out = paged_attention(q, k_cache, v_cache, meta, scale, tile_tokens=tile_tokens)
    expected = reference_attention(q, k_cache, v_cache, meta, scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("tile_tokens", [BLOCK_SIZE, 256])
def test_float32_queries_over_a_float16_cache(tile_tokens: int) -> None:
    """The fast mode: float32 queries read a float16 cache (decode tiles and prompts) as
    float32 attention over the float16 values; write_kv rounds float32 K/V into it."""
    q, k_cache, v_cache, meta = make_batch(DECODE_SEQ_LENS, MULTI_TOKEN, 6, 2, torch.float32)
    k16, v16 = k_cache.half(), v_cache.half()
    out = paged_attention(q, k16, v16, meta, 0.3, tile_tokens=tile_tokens)
    expected = reference_attention(q, k16.float(), v16.float(), meta, 0.3)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=FP32_ATOL, rtol=0)
    k = torch.randn(3, 2, HEAD_DIM)
    slots = torch.tensor([5, 40, 41])
    write_kv(k16, v16, k, -k, slots)
    assert torch.equal(k16.view(-1, 2, HEAD_DIM)[slots], k.half())
    assert torch.equal(v16.view(-1, 2, HEAD_DIM)[slots], (-k).half())


@pytest.mark.parametrize(
    ("decode_lens", "multi"), [(DECODE_SEQ_LENS, []), ([], MULTI_TOKEN), ([5, 9], [])]
)
def test_decode_only_and_multi_only_batches(
    decode_lens: list[int], multi: list[tuple[int, int]]
) -> None:
    q, k_cache, v_cache, meta = make_batch(decode_lens, multi, 6, 2, torch.float32, seed=1)
    out = paged_attention(q, k_cache, v_cache, meta, 0.3, tile_tokens=2 * BLOCK_SIZE)
    expected = reference_attention(q, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(out, expected, atol=FP32_ATOL, rtol=0)


def test_custom_mask() -> None:
    q_len, seq_len = 4, 26
    # A tree draft: every token sees the cached prefix; tokens 1 and 2 are siblings under 0,
    # token 3 is the child of 2.
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    mask = torch.ones(q_len, seq_len, dtype=torch.bool)
    mask[:, seq_len - q_len :] = tree
    multi = [(20, 75), (q_len, seq_len)]
    q, k_cache, v_cache, meta = make_batch([17, 300], multi, 6, 2, torch.float32, 2, (None, mask))
    out = paged_attention(q, k_cache, v_cache, meta, 0.2, tile_tokens=64)
    expected = reference_attention(q, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(out, expected, atol=FP32_ATOL, rtol=0)
    # The mask must actually be used: plain causal differs for the sibling/child tokens.
    causal_meta = dataclasses.replace(meta, attn_masks=None)
    causal = reference_attention(q, k_cache, v_cache, causal_meta, 0.2)
    rows = slice(meta.query_start_loc_list[-2], meta.query_start_loc_list[-1])
    assert not torch.allclose(out[rows][2:], causal[rows][2:], atol=1e-3)
    torch.testing.assert_close(out[rows][:2], causal[rows][:2], atol=FP32_ATOL, rtol=0)


def test_causal_mask_is_bottom_right_aligned() -> None:
    expected = torch.tensor(
        [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(causal_mask(3, 6, torch.get_default_device()), expected)


def test_write_kv_lands_in_exact_slots() -> None:
    block_size, num_kv_heads, head_dim = 4, 2, 3
    k_cache = torch.zeros(5, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    slot_mapping = torch.tensor([13, 2, 7, 16], dtype=torch.int64)
    k = torch.arange(1, 4 * num_kv_heads * head_dim + 1, dtype=torch.float32)
    k = k.view(4, num_kv_heads, head_dim)
    write_kv(k_cache, v_cache, k, -k, slot_mapping)
    # slot -> (block, offset): 13 -> (3, 1), 2 -> (0, 2), 7 -> (1, 3), 16 -> (4, 0)
    for token, (block, offset) in enumerate([(3, 1), (0, 2), (1, 3), (4, 0)]):
        assert torch.equal(k_cache[block, offset], k[token])
        assert torch.equal(v_cache[block, offset], -k[token])
    # Nothing else was touched: 4 slots * H_kv * D nonzero values, all distinct and accounted.
    assert int((k_cache != 0).sum()) == k.numel()
    assert int((v_cache != 0).sum()) == k.numel()


def test_memory_estimate_matches_formulas() -> None:
    est = estimate_attention_memory(
        num_queries=1, context_len=4096, num_heads=32, head_dim=128, tile_tokens=256, dtype_bytes=2
    )
    # naive: scores 32 * 1 * 4096 * 2 = 262_144; K and V 2 * 4096 * 32 * 128 * 2 = 67_108_864
    assert est.naive_bytes == 262_144 + 67_108_864
    # flash: scores 32 * 1 * 256 * 2 = 16_384; K and V tile 2 * 256 * 32 * 128 * 2 = 4_194_304;
    # m and l and acc in float32: 32 * 1 * (2 + 128) * 4 = 16_640
    assert est.flash_bytes == 16_384 + 4_194_304 + 16_640


@pytest.mark.parametrize(("num_queries", "context_len"), [(1, 1024), (1, 32768), (512, 8192)])
def test_flash_uses_less_memory_for_long_contexts(num_queries: int, context_len: int) -> None:
    est = estimate_attention_memory(num_queries, context_len, 32, 128, 256, 2)
    assert est.flash_bytes < est.naive_bytes


def test_rejects_bad_tile_and_bad_metadata() -> None:
    q, k_cache, v_cache, meta = make_batch([5], [], 4, 4, torch.float32)
    with pytest.raises(ValueError, match="tile_tokens"):
        paged_attention(q, k_cache, v_cache, meta, 1.0, tile_tokens=BLOCK_SIZE + 1)
    with pytest.raises(ValueError, match="exactly one new token"):
        AttentionMetadata(
            slot_mapping=meta.slot_mapping,
            query_start_loc=meta.query_start_loc,
            seq_lens=meta.seq_lens,
            block_tables=meta.block_tables,
            num_decodes=1,
            query_start_loc_list=[0, 2],
            seq_lens_list=[5],
        )
