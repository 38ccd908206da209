"""The torch attention backend over a paged KV cache (CPU, and CUDA when the inputs live there).

Cache layout: ``k_cache``/``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``;
token ``j`` of sequence ``i`` lives in block ``block_tables[i, j // block_size]`` at offset
``j % block_size``. Decode sequences run as one batched tiled online-softmax ("flash") loop;
multi-token sequences go one by one through torch's flash kernel (causal chunks on the CPU)
or ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tessera.workers.attention.metadata import AttentionMetadata, DecodeTile

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
    # K/V in another dtype than the cache's (the fast mode's float16 cache) are rounded.
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    tile_tokens: int = DEFAULT_TILE_TOKENS,
    window: int = 0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of the new tokens' queries over their sequences' cached K/V.

    q: [T, num_heads, head_dim], num_heads a multiple of num_kv_heads (grouped-query attention).
    The step's K/V must already be in the cache (``write_kv``). Returns [T, num_heads, head_dim]
    in q.dtype.

    ``window``: a sliding window, the query at cache index ``i`` attends to indices
    ``i - window + 1 .. i`` only (transformers' ``sliding_window``); 0: all of ``0 .. i``.
    ``softcap``: scores become ``softcap * tanh(score / softcap)`` before the softmax
    (Gemma 2), computed op by op rather than by the flash kernels.
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
        tiles = meta.decode_plan
        if tiles is None:
            tiles = plan_decode(
                meta.block_tables[:nd],
                meta.seq_lens[:nd],
                meta.seq_lens_list[:nd],
                block_size,
                q.dtype,
                tile_tokens,
            )
        if window:
            tiles = window_plan(meta, tiles, window, q.dtype)
        out[:nd] = _decode_attention(q[:nd], k_cache, v_cache, tiles, scale, softcap)
    for i in range(nd, meta.num_seqs):
        start, end = meta.query_start_loc_list[i], meta.query_start_loc_list[i + 1]
        mask = None if meta.attn_masks is None else meta.attn_masks[i - nd]
        out[start:end] = _sequence_attention(
            q[start:end],
            k_cache,
            v_cache,
            meta.block_tables[i],
            meta.seq_lens_list[i],
            mask,
            scale,
            window,
            softcap,
        )
    return out


def window_plan(
    meta: AttentionMetadata, tiles: tuple[DecodeTile, ...], window: int, dtype: torch.dtype
) -> tuple[DecodeTile, ...]:
    """The decode tiles of a layer with a sliding window: ``tiles`` (the step's plan)
    with the positions before each sequence's window masked, and the tiles that end
    before every window dropped; built once per step and window (``meta.window_plans``),
    with tensor ops only (a static decode step captures it)."""
    cached = meta.window_plans.get(window)
    if cached is not None:
        return cached
    nd = meta.num_decodes
    seq_lens = meta.seq_lens[:nd]
    first = seq_lens - window  # [B]: positions before it are outside the window
    own = meta.slot_mapping[:nd, None]  # [B, 1]: each decode row's new token's slot
    # (host lengths: a tile before every sequence's window is not attended at all)
    first_host = min(meta.seq_lens_list[:nd]) - window
    windowed = []
    for tile in tiles:
        if tile.start + tile.tokens <= first_host:
            continue
        positions = torch.arange(tile.start, tile.start + tile.tokens, device=seq_lens.device)
        outside = positions[None, :] < first[:, None]  # [B, tile]
        # masked positions read the row's own new slot (written this step, so finite:
        # behind the window may be a block given back and reused, or never written, and
        # past the row's end the plan's stand-in, its first slot, may be such a block)
        masked = outside | (positions[None, :] >= seq_lens[:, None])
        slots = torch.where(masked, own, tile.slots.view(masked.shape)).reshape(-1)
        bias = torch.zeros(outside.shape, dtype=dtype, device=seq_lens.device)
        bias = bias.masked_fill_(outside, -math.inf)[:, None, None, :]
        if tile.bias is not None:
            bias = bias + tile.bias
        empty = (first >= tile.start + tile.tokens)[:, None, None]
        if tile.empty is not None:
            empty = empty | tile.empty
        windowed.append(DecodeTile(slots, bias, tile.tokens, empty, tile.start))
    meta.window_plans[window] = plan = tuple(windowed)
    return plan


def plan_decode(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_list: list[int],
    block_size: int,
    dtype: torch.dtype,
    tile_tokens: int = DEFAULT_TILE_TOKENS,
) -> tuple[DecodeTile, ...]:
    """Gather indices and masks of the decode tiles; computed once per step, not per layer."""
    if tile_tokens <= 0 or tile_tokens % block_size:
        raise ValueError(f"tile_tokens={tile_tokens} must be a positive multiple of {block_size}")
    num_seqs = len(seq_lens_list)
    device = block_tables.device
    blocks_needed = math.ceil(max(seq_lens_list) / block_size)
    blocks_per_tile = min(tile_tokens // block_size, blocks_needed)
    min_len = min(seq_lens_list)
    slot_in_block = torch.arange(block_size, device=device)
    first_slot = block_tables[:, :1] * block_size  # [B, 1]
    tiles = []
    for first_block in range(0, blocks_needed, blocks_per_tile):
        last_block = min(first_block + blocks_per_tile, blocks_needed)
        tokens = (last_block - first_block) * block_size
        start = first_block * block_size
        slots = block_tables[:, first_block:last_block, None] * block_size + slot_in_block
        slots = slots.view(num_seqs, tokens)
        bias = empty = None
        if start >= min_len:
            empty = (seq_lens <= start)[:, None, None]
        if start + tokens > min_len:  # only tiles reaching past the shortest sequence
            positions = torch.arange(start, start + tokens, device=device)
            past_end = positions[None, :] >= seq_lens[:, None]  # [B, tile]
            slots = torch.where(past_end, first_slot, slots)
            bias = torch.zeros(past_end.shape, dtype=dtype, device=device)
            bias = bias.masked_fill_(past_end, -math.inf)[:, None, None, :]
        tiles.append(DecodeTile(slots.reshape(-1), bias, tokens, empty, start))
    return tuple(tiles)


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tiles: tuple[DecodeTile, ...],
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query per sequence, all sequences at once, tile by tile ("flash decoding").

    Per tile only [B, tile, H_kv, D] of K and V exist, so memory is O(B * tile), not
    O(B * context). Grouped-query attention needs no repeated K/V: the ``group`` query
    heads that share a KV head are that head's queries, q viewed as [B, H_kv, group, D].
    Each tile yields its output and log-sum-exp; tiles combine by softmax over the LSEs
    (the online-softmax rescaling, done once at the end).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    q_heads = q.view(num_seqs, num_kv_heads, group, head_dim)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, H_kv, D]
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    outs, lses = [], []
    for tile in tiles:
        shape = (num_seqs, tile.tokens, num_kv_heads, head_dim)
        k = flat_k.index_select(0, tile.slots).view(shape).transpose(1, 2)  # [B, H_kv, tile, D]
        v = flat_v.index_select(0, tile.slots).view(shape).transpose(1, 2)
        k, v = k.to(q.dtype), v.to(q.dtype)  # a float16 cache under float32 queries
        out, lse = _attend(q_heads, k, v, tile.bias, scale, softcap)
        if tile.empty is not None:  # fully masked rows come back as out 0, lse 0: drop them
            lse = lse.masked_fill(tile.empty, -math.inf)
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        out = outs[0]
    else:
        lse = torch.stack(lses)  # [tiles, B, H_kv, group]
        weights = torch.softmax(lse.to(ACCUM_DTYPE), dim=0)[..., None]
        out = (torch.stack(outs).to(ACCUM_DTYPE) * weights).sum(dim=0)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [B, H, G, D] over k/v [B, H, S, D]; returns (out, logsumexp)."""
    if q.device.type == "cpu" and softcap is None:
        # torch's CPU flash kernel: tiled online softmax in float32, and it returns the LSE.
        return _flash_cpu(q, k, v, bias, False, scale)
    scores = torch.matmul(q.to(ACCUM_DTYPE), k.to(ACCUM_DTYPE).transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias.to(ACCUM_DTYPE)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.to(ACCUM_DTYPE))
    return out.to(q.dtype), lse


def _flash_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash attention: q [B, H, Q, D] over k/v [B, H, S, D] -> (out, lse)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, is_causal=is_causal, attn_mask=bias, scale=scale
    )


def _sequence_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    mask: torch.Tensor | None,
    scale: float,
    window: int = 0,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [q_len, H, D] of one sequence whose K/V occupy cache positions 0..seq_len-1."""
    q_len, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if mask is not None and (mask.shape != (q_len, seq_len) or mask.dtype != torch.bool):
        raise ValueError(
            f"mask must be bool [{q_len}, {seq_len}], got {mask.dtype} {tuple(mask.shape)}"
        )
    custom = mask is not None
    # Cache indices before ``first`` are outside every query's window: not gathered.
    first = max(0, seq_len - q_len - window + 1) if window else 0
    windowed = bool(window) and seq_len > window
    if windowed or softcap is not None:
        # an explicit mask over the gathered keys: causal (or the given one) and windowed
        keys = torch.arange(first, seq_len, device=q.device)[None, :]
        rows = torch.arange(q_len, device=q.device)[:, None] + (seq_len - q_len)
        allowed = mask[:, first:] if custom else keys <= rows
        mask = allowed & (keys > rows - window) if windowed else allowed
    first_block = first // block_size
    ids = block_table[first_block : math.ceil(seq_len / block_size)]
    begin, end = first - first_block * block_size, seq_len - first_block * block_size
    k = k_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[begin:end]  # [S, H_kv, D]
    v = v_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[begin:end]
    k, v = k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype)  # [H_kv, S, D]
    if softcap is not None:
        return _capped_attention(q, k, v, mask, scale, softcap)
    if q.device.type == "cpu" and not custom:
        # Causal (and windowed) chunks on the CPU: torch's flash kernel (tiled, float32
        # sums) called directly, K/V repeated per query head; SDPA's dispatch took its
        # math path for grouped-query K/V (scores materialised, masked with
        # where/isneginf), ~3x slower for a 250-token prompt (5.8 against 1.8 ms a layer
        # on 2 AVX2 cores; a 1,024-token prompt's prefill went from 212-216 to 307-330
        # tok/s).
        group = num_heads // num_kv_heads
        bias = None
        if mask is not None:  # a window's: every row's keys past it
            bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
            bias.masked_fill_(~mask, -math.inf)
        elif q_len != seq_len:  # cached tokens before the chunk: its causal mask as a bias
            bias = torch.zeros(q_len, seq_len, dtype=q.dtype, device=q.device)
            bias.masked_fill_(~causal_mask(q_len, seq_len, q.device), -math.inf)
        out, _ = _flash_cpu(
            q.transpose(0, 1)[None],
            k.repeat_interleave(group, dim=0)[None],
            v.repeat_interleave(group, dim=0)[None],
            bias,
            mask is None and q_len == seq_len,
            scale,
        )
        return out[0].transpose(0, 1)
    if mask is not None:
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


def _capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """Soft-capped attention of q [Q, H, D] over k/v [H_kv, S, D] where ``mask`` [Q, S]
    allows, op by op in float32 (as transformers' eager attention, which Gemma 2 takes)."""
    num_heads, num_kv_heads = q.shape[1], k.shape[0]
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=0).to(ACCUM_DTYPE)  # [H, S, D]
    v = v.repeat_interleave(group, dim=0).to(ACCUM_DTYPE)
    scores = torch.matmul(q.transpose(0, 1).to(ACCUM_DTYPE), k.transpose(1, 2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, -math.inf)
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [H, Q, D]
    return out.transpose(0, 1).to(q.dtype)


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
