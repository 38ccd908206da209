"""What one forward step tells the attention backend about the flattened batch.

Layout of the ``T`` new tokens (rows of q/k/v) for ``B`` sequences::

    rows:  | d0 | d1 | ... | d{n-1} | p0 p0 p0 p0 | p1 p1 | ...
             one new token each       any number of new tokens each
             (num_decodes sequences)  (prefill chunks, drafts, parallel sets)

``query_start_loc[i]:query_start_loc[i + 1]`` are the rows of sequence ``i``; its new tokens
occupy the last ``q_len`` of its ``seq_len`` cache positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: Value for unused entries of ``block_tables``. Attention reads whole blocks and masks by
#: ``seq_lens``, so a pad entry is gathered but never contributes; it only has to be a valid
#: index, and block 0 always exists.
PAD_BLOCK_ID = 0


@dataclass(frozen=True, slots=True)
class DecodeTile:
    """One tile of the decode context, the same for every layer of a step (built by
    ``paged.plan_decode``; it lives here because ``AttentionMetadata`` carries it).

    ``slots`` [B * tile] are the cache rows to gather; positions past a sequence's end
    are redirected to its first slot (always written, so finite: stale or never-written
    slots may hold NaN, and 0 * NaN = NaN) and get a -inf score ``bias`` [B, 1, 1, tile].
    ``bias`` is None when the tile lies inside every sequence. ``empty`` [B, 1, 1] marks
    sequences that end before the tile starts (or, windowed, whose window starts after
    it ends): their (masked-out) result must not count. ``start`` is the position of the
    tile's first token.
    """

    slots: torch.Tensor
    bias: torch.Tensor | None
    tokens: int
    empty: torch.Tensor | None = None
    start: int = 0


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """A flattened batch of B sequences and T new tokens.

    Sequences ``0..num_decodes-1`` have exactly one new token each and come first; the rest
    may have any number (chunked prefill, prefill after a cached prefix, a target verifying
    draft tokens, a set of parallel tokens with its mask).
    """

    # [T] int64: block_id * block_size + offset where each new token's K/V is written
    slot_mapping: torch.Tensor
    # [B + 1] int64: new tokens of sequence i are rows query_start_loc[i]:query_start_loc[i + 1]
    query_start_loc: torch.Tensor
    # [B] int64: tokens in the cache for sequence i once this step's K/V is written (cached + new)
    seq_lens: torch.Tensor
    # [B, max_blocks] int64: block ids of each sequence, padded with PAD_BLOCK_ID
    block_tables: torch.Tensor
    num_decodes: int
    # Host copies of query_start_loc / seq_lens, so loops and tile counts never sync the device.
    query_start_loc_list: list[int]
    seq_lens_list: list[int]
    # Per non-decode sequence: None (causal by token order) or a bool [q_len, seq_len] mask,
    # True = may attend. None for the whole field means every such sequence is causal.
    attn_masks: tuple[torch.Tensor | None, ...] | None = None
    # The decode sequences' gather indices and masks (``paged.plan_decode``): the same for
    # every layer, so the model runner builds them once per step. None: built per call.
    decode_plan: tuple[DecodeTile, ...] | None = None
    # The decode plan of each sliding window, derived from ``decode_plan`` the first time
    # a layer of that window asks (``paged.window_plan``); shared by the step's layers.
    window_plans: dict[int, tuple[DecodeTile, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Host-side checks only: this runs every step and must not touch device memory.
        num_seqs = len(self.seq_lens_list)
        if len(self.query_start_loc_list) != num_seqs + 1:
            raise ValueError(
                f"query_start_loc_list has {len(self.query_start_loc_list)} entries, "
                f"expected {num_seqs + 1}"
            )
        if not 0 <= self.num_decodes <= num_seqs:
            raise ValueError(f"num_decodes={self.num_decodes} not in [0, {num_seqs}]")
        # With every q_len >= 1 (checked below) this makes each decode exactly one token.
        if self.query_start_loc_list[0] != 0 or (
            self.query_start_loc_list[self.num_decodes] != self.num_decodes
        ):
            raise ValueError("each decode sequence must have exactly one new token")
        # the decodes checked at C speed (a 64-decode step spent ~30 us in the loop below)
        decodes = self.num_decodes
        if self.query_start_loc_list[: decodes + 1] != list(range(decodes + 1)):
            raise ValueError("each decode sequence must have exactly one new token")
        if decodes and min(self.seq_lens_list[:decodes]) < 1:
            i = next(i for i, n in enumerate(self.seq_lens_list) if n < 1)
            raise ValueError(f"sequence {i}: q_len=1, seq_len={self.seq_lens_list[i]}")
        for i in range(decodes, num_seqs):
            q_len = self.query_start_loc_list[i + 1] - self.query_start_loc_list[i]
            if not 0 < q_len <= self.seq_lens_list[i]:
                raise ValueError(f"sequence {i}: q_len={q_len}, seq_len={self.seq_lens_list[i]}")
        if self.attn_masks is not None and len(self.attn_masks) != num_seqs - self.num_decodes:
            raise ValueError(
                f"attn_masks has {len(self.attn_masks)} entries, "
                f"expected one per non-decode sequence ({num_seqs - self.num_decodes})"
            )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_list[-1]
