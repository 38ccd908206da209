"""The torch attention backend over a paged KV cache (CPU, and CUDA when the inputs live there).

Cache layout: ``k_cache``/``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``;
token ``j`` of sequence ``i`` lives in block ``block_tables[i, j // block_size]`` at offset
``j % block_size``. Decode sequences run as one batched tiled online-softmax ("flash") loop;
multi-token sequences go one by one through ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.attention.metadata import AttentionMetadata

#: Decode context is processed in tiles of this many tokens (a multiple of block_size). A tile
#: costs ~15 + 2 * H_kv op dispatches, so small tiles turn a long context into a long Python loop
#: (x30 layers per step); large tiles gather more K/V at once, B * tile * H_kv * D per tensor
#: (64 seqs * 256 * 8 * 128 * 4 B = 64 MiB for K at the largest batch) and fall out of cache.
#: On 2 CPU cores (B=16, ~300 tokens) 128..512 measured within noise of each other; 256 keeps
#: chat-length contexts (<1k tokens) to at most 4 iterations.
DEFAULT_TILE_TOKENS = 256

#: Running max / sum / accumulator and all scores are kept in float32, whatever the cache dtype.
ACCUM_DTYPE = torch.float32
ACCUM_DTYPE_BYTES = 4

# SDPA takes grouped-query K/V directly from torch 2.5 on; before that K/V are repeated.
_SDPA_HAS_GQA = torch.__version__ >= (2, 5)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter each new token's K/V into its slot.

    k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; k, v: [T, num_kv_heads,
    head_dim]; slot_mapping: [T] int64, block_id * block_size + offset.
    """
    num_kv_heads, head_dim = k_cache.shape[2:]
    # A [num_blocks * block_size, H_kv, D] view: a slot id is then a plain row index.
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    tile_tokens: int = DEFAULT_TILE_TOKENS,
) -> torch.Tensor:
    """Attention of the new tokens' queries over their sequences' cached K/V.

    q: [T, num_heads, head_dim], num_heads a multiple of num_kv_heads (grouped-query attention).
    The step's K/V must already be in the cache (``write_kv``). Returns [T, num_heads, head_dim]
    in q.dtype.
    """
    block_size = k_cache.shape[1]
    if tile_tokens <= 0 or tile_tokens % block_size:
        raise ValueError(f"tile_tokens={tile_tokens} must be a positive multiple of {block_size}")
    if meta.seq_lens_list and meta.block_tables.shape[1] * block_size < max(meta.seq_lens_list):
        raise ValueError("block_tables has too few columns for the longest sequence")
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        # Decode sequence i owns row i: one token each, and they come first.
        out[:nd] = _decode_attention(
            q[:nd],
            k_cache,
            v_cache,
            meta.block_tables[:nd],
            meta.seq_lens[:nd],
            meta.seq_lens_list[:nd],
            scale,
            tile_tokens,
        )
    for i in range(nd, meta.num_seqs):
        start, end = meta.query_start_loc_list[i], meta.query_start_loc_list[i + 1]
        mask = None if meta.attn_masks is None else meta.attn_masks[i - nd]
        out[start:end] = _sequence_attention(
            q[start:end], k_cache, v_cache, meta.block_tables[i], meta.seq_lens_list[i], mask, scale
        )
    return out


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_list: list[int],
    scale: float,
    tile_tokens: int,
) -> torch.Tensor:
    """One query per sequence, all sequences at once, online softmax over context tiles.

    Per tile only [B, tile, H_kv, D] of K and V and [H_kv, B, group, tile] scores exist, so
    memory is O(B * tile), not O(B * context). The loop bound comes from host-side seq_lens_list.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    device = q.device
    blocks_needed = math.ceil(max(seq_lens_list) / block_size)
    blocks_per_tile = min(tile_tokens // block_size, blocks_needed)
    min_len = min(seq_lens_list)
    # Query head h reads KV head h // group: per KV head, a batch of [group, D] query matrices.
    q_heads = q.reshape(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1)
    q_heads = (q_heads.to(ACCUM_DTYPE) * scale).contiguous()  # [H_kv, B, group, D]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, H_kv, D]
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    slot_in_block = torch.arange(block_size, device=device)
    positions = torch.arange(blocks_per_tile * block_size, device=device)
    # Token 0 is always written (seq_len >= 1). Positions past a sequence's end are read from its
    # slot instead of their own, which may be stale or never written (NaN, and 0 * NaN = NaN):
    # finite K/V there plus a -inf score bias contribute exactly 0.
    first_slot = block_tables[:, :1] * block_size  # [B, 1]
    # One gather buffer for all tiles: a fresh multi-MB tensor per tile costs page faults.
    gathered = torch.empty(
        (2, num_seqs * positions.numel(), num_kv_heads, head_dim),
        dtype=k_cache.dtype,
        device=device,
    )
    converted = (
        gathered if k_cache.dtype == ACCUM_DTYPE else torch.empty_like(gathered, dtype=ACCUM_DTYPE)
    )
    row_max = row_sum = acc = None
    for first_block in range(0, blocks_needed, blocks_per_tile):
        last_block = min(first_block + blocks_per_tile, blocks_needed)
        tile = (last_block - first_block) * block_size
        start = first_block * block_size
        slots = block_tables[:, first_block:last_block, None] * block_size + slot_in_block
        slots = slots.view(num_seqs, tile)  # [B, tile]
        bias = None  # [B, 1, tile]: 0 where the position exists, -inf past the end
        if start + tile > min_len:  # only tiles that reach past the shortest sequence need it
            past_end = (start + positions[:tile]) >= seq_lens[:, None]  # [B, tile]
            slots = torch.where(past_end, first_slot, slots)
            bias = torch.zeros(past_end.shape, dtype=ACCUM_DTYPE, device=device)
            bias = bias.masked_fill_(past_end, -math.inf)[:, None, :]
        rows = num_seqs * tile
        torch.index_select(flat_k, 0, slots.view(-1), out=gathered[0, :rows])
        torch.index_select(flat_v, 0, slots.view(-1), out=gathered[1, :rows])
        if converted is not gathered:
            converted[:, :rows].copy_(gathered[:, :rows])
        k = converted[0, :rows].view(num_seqs, tile, num_kv_heads, head_dim)
        v = converted[1, :rows].view(num_seqs, tile, num_kv_heads, head_dim)
        # Per KV head, k[:, :, h] is a strided [B, tile, D] batch that bmm reads in place: no
        # transposing copy of K/V, no repeat for GQA.
        s = torch.empty((num_kv_heads, num_seqs, group, tile), dtype=ACCUM_DTYPE, device=device)
        for h in range(num_kv_heads):
            k_t = k[:, :, h].transpose(1, 2)  # [B, D, tile]
            if bias is None:
                torch.bmm(q_heads[h], k_t, out=s[h])
            else:
                torch.baddbmm(bias, q_heads[h], k_t, out=s[h])
        tile_max = s.amax(dim=-1)  # [H_kv, B, group]
        if row_max is None:
            row_max = tile_max  # finite: every sequence has position 0 in the first tile
            p = s.sub_(row_max[..., None]).exp_()
            row_sum = p.sum(dim=-1)
            acc = torch.empty(
                (num_kv_heads, num_seqs, group, head_dim), dtype=ACCUM_DTYPE, device=device
            )
            for h in range(num_kv_heads):
                torch.bmm(p[h], v[:, :, h], out=acc[h])
            continue
        new_max = torch.maximum(row_max, tile_max)
        # Rescale what was accumulated against the old max to the new one.
        alpha = torch.exp(row_max - new_max)
        p = s.sub_(new_max[..., None]).exp_()
        row_sum = row_sum * alpha + p.sum(dim=-1)
        acc.mul_(alpha[..., None])
        for h in range(num_kv_heads):
            acc[h].baddbmm_(p[h], v[:, :, h])
        row_max = new_max
    out = acc / row_sum[..., None]  # [H_kv, B, group, D]
    return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def _sequence_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """q: [q_len, H, D] of one sequence whose K/V occupy cache positions 0..seq_len-1."""
    q_len, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    ids = block_table[: math.ceil(seq_len / block_size)]
    k = k_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:seq_len]  # [S, H_kv, D]
    v = v_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:seq_len]
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # [H_kv, S, D]
    if mask is not None:
        if mask.shape != (q_len, seq_len) or mask.dtype != torch.bool:
            raise ValueError(
                f"mask must be bool [{q_len}, {seq_len}], got {mask.dtype} {tuple(mask.shape)}"
            )
        is_causal = False
    elif q_len == seq_len:
        # SDPA's causal mask is top-left aligned: right only when no tokens were cached before.
        is_causal = True
    else:
        mask = causal_mask(q_len, seq_len, q.device)
        is_causal = False
    gqa = {"enable_gqa": True} if _SDPA_HAS_GQA else {}
    if not _SDPA_HAS_GQA and num_heads != num_kv_heads:
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=0)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=0)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k, v, attn_mask=mask, is_causal=is_causal, scale=scale, **gqa
    )  # [H, q_len, D]
    return out.transpose(0, 1)


def causal_mask(q_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[q_len, seq_len] bool: new token i sits at cache index seq_len - q_len + i and sees 0..it.

    cache index:  0 ............ seq_len-q_len ... seq_len-1
    token 0:      x x x x x x x  x
    token q_len-1 x x x x x x x  x x x x x x x x x x x x
    """
    rows = torch.arange(q_len, device=device)[:, None] + (seq_len - q_len)
    return torch.arange(seq_len, device=device)[None, :] <= rows


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Dense float64 attention, one sequence and one token position at a time (for tests)."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # [num_slots, H_kv, D]
    out = torch.empty_like(q)
    for i in range(meta.num_seqs):
        start, end = meta.query_start_loc_list[i], meta.query_start_loc_list[i + 1]
        seq_len = meta.seq_lens_list[i]
        slots = [
            int(meta.block_tables[i, j // block_size]) * block_size + j % block_size
            for j in range(seq_len)
        ]
        k = flat_k[slots].double().repeat_interleave(group, dim=1)  # [S, H, D]
        v = flat_v[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,shd->hqs", q[start:end].double(), k) * scale
        custom = None
        if i >= meta.num_decodes and meta.attn_masks is not None:
            custom = meta.attn_masks[i - meta.num_decodes]
        allowed = causal_mask(end - start, seq_len, q.device) if custom is None else custom
        probs = scores.masked_fill(~allowed, -math.inf).softmax(dim=-1)
        out[start:end] = torch.einsum("hqs,shd->qhd", probs, v).to(q.dtype)
    return out


@dataclass(frozen=True, slots=True)
class AttentionMemoryEstimate:
    """Peak bytes of the attention intermediates for one sequence (inputs/outputs excluded)."""

    naive_bytes: int
    flash_bytes: int


def estimate_attention_memory(
    num_queries: int,
    context_len: int,
    num_heads: int,
    head_dim: int,
    tile_tokens: int,
    dtype_bytes: int,
) -> AttentionMemoryEstimate:
    """Intermediates of dense vs tiled attention; K/V are counted at num_heads (no GQA sharing).

    dtype_bytes is the element size of the scores and gathered K/V; the flash m / l / acc
    state is always ACCUM_DTYPE.
    """
    # Naive: the full [heads, queries, context] score matrix, plus K and V gathered out of the
    # paged cache for the whole context: 2 * [context, heads, head_dim].
    naive_scores = num_heads * num_queries * context_len * dtype_bytes
    naive_kv = 2 * context_len * num_heads * head_dim * dtype_bytes
    # Flash: one tile of scores [heads, queries, tile] and one tile of K and V, plus the running
    # state: max m and sum l [heads, queries] and the accumulator acc [heads, queries, head_dim].
    tile = min(tile_tokens, context_len)
    flash_scores = num_heads * num_queries * tile * dtype_bytes
    flash_kv = 2 * tile * num_heads * head_dim * dtype_bytes
    flash_state = num_heads * num_queries * (2 + head_dim) * ACCUM_DTYPE_BYTES
    return AttentionMemoryEstimate(
        naive_bytes=naive_scores + naive_kv, flash_bytes=flash_scores + flash_kv + flash_state
    )
